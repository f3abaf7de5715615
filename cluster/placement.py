"""Placement: which node runs a replica of which model, as a pure function of the cluster's state.

No Ray here: :func:`plan_placement` takes frozen descriptions of the nodes and of the models
asked for and returns a :class:`PlacementPlan`; the deployment code only carries the plan out
(actors pinned to the chosen nodes). That keeps every placement rule unit-testable.

Rules:
- a node hosts a model when its available RAM holds the expert pool, the dense weights and a
  headroom (the OS, the KV cache, the other programs of a home machine); where the machine's owner
  set ``HEARTH_RAM_LIMIT``, within that limit instead;
- a node runs at most one replica of a model (one pool per machine; a second replica there
  would only split the same memory bandwidth);
- nodes with a GPU come first (the one with most free VRAM), then by RAM and cores;
- a node's GPU serves one model at a time, so a two-GPU desktop can host two models;
- a model that fits nowhere is an error naming the shortfall of the best node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1 << 30


class PlacementError(ValueError):
    """The requested models cannot be placed on the cluster as it is."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU of a node (from pynvml)."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class NodeInfo:
    """What a node has, discovered on the node itself (see ``cluster.node_info``)."""

    node_id: str
    address: str
    ram_bytes: int
    ram_available_bytes: int
    physical_cores: int
    gpus: tuple[GpuInfo, ...] = ()
    labels: frozenset[str] = frozenset()  # custom Ray resources such as "desktop" or "laptop"
    alive: bool = True
    b_p: float | None = None  # measured link bandwidth (bytes/s), when known
    b_h: float | None = None  # measured host expert bandwidth (bytes/s), when known
    ram_limit_bytes: int | None = None  # what its owner lets hearth use (HEARTH_RAM_LIMIT there), if set

    @property
    def usable_ram_bytes(self) -> int:
        """The RAM a plan may fill: what is available, within the owner's limit where one is set."""
        if self.ram_limit_bytes is None:
            return self.ram_available_bytes
        return min(self.ram_available_bytes, self.ram_limit_bytes)

    @property
    def name(self) -> str:
        """A short human name: the first label, else the address."""
        return sorted(self.labels)[0] if self.labels else self.address


@dataclass(frozen=True)
class ModelSpec:
    """A model to deploy: its sizes (from the checkpoint) and how many replicas are wanted.

    ``replicas`` None means one on every node that can hold it; ``require`` restricts the model to
    nodes carrying that label."""

    name: str
    path: str
    pool_bytes: int
    dense_bytes: int
    replicas: int | None = None
    require: str | None = None


@dataclass(frozen=True)
class ReplicaPlan:
    """One replica: where it runs and with what."""

    model: str
    node_id: str
    node_name: str
    executor: str  # "cuda" or "cpu"
    gpu_index: int | None
    expert_cache_bytes: int  # device budget for the expert cache (0 on a CPU executor)
    cpu_cores: int

    @property
    def replica_id(self) -> str:
        return f"{self.model}@{self.node_name}"


@dataclass(frozen=True)
class PlacementPlan:
    replicas: tuple[ReplicaPlan, ...]
    ram_committed: dict[str, int] = field(default_factory=dict)  # node id -> bytes the plan uses

    def for_model(self, model: str) -> tuple[ReplicaPlan, ...]:
        return tuple(r for r in self.replicas if r.model == model)


@dataclass(frozen=True)
class PlacementPolicy:
    """Tunables. The headroom is max(min_headroom_bytes, headroom_fraction x node RAM), and none on a
    machine whose owner set a RAM limit (the limit is the whole budget)."""

    min_headroom_bytes: int = 2 * GIB
    headroom_fraction: float = 0.10
    vram_fraction: float = 0.80  # of a GPU's free memory, for the dense weights and the expert cache

    def headroom(self, node: NodeInfo) -> int:
        if node.ram_limit_bytes is not None:
            return 0
        return max(self.min_headroom_bytes, int(self.headroom_fraction * node.ram_bytes))

    def ram_needed(self, model: ModelSpec, node: NodeInfo) -> int:
        return model.pool_bytes + model.dense_bytes + self.headroom(node)


def _fmt(nbytes: float) -> str:
    """GiB with one decimal; MiB or KiB below a GiB (tiny test models)."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def _node_order(node: NodeInfo) -> tuple:
    best_gpu = max((g.free_bytes for g in node.gpus), default=-1)
    return (-best_gpu, -node.usable_ram_bytes, -node.physical_cores, node.node_id)


def plan_placement(nodes: tuple[NodeInfo, ...] | list[NodeInfo], models: tuple[ModelSpec, ...] | list[ModelSpec],
                   policy: PlacementPolicy | None = None) -> PlacementPlan:
    """Place ``models`` on ``nodes``; raises :class:`PlacementError` when a model cannot be placed."""
    policy = policy or PlacementPolicy()
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise PlacementError(f"model names must be unique, got {names}")
    live = sorted((n for n in nodes if n.alive), key=_node_order)
    if not live:
        raise PlacementError("the cluster has no live node")
    ram_left = {n.node_id: n.usable_ram_bytes for n in live}
    gpus_free = {n.node_id: sorted(n.gpus, key=lambda g: (-g.free_bytes, g.index)) for n in live}
    replicas: list[ReplicaPlan] = []
    # Largest models first: they have the fewest choices.
    for model in sorted(models, key=lambda m: (-(m.pool_bytes + m.dense_bytes), m.name)):
        candidates = [n for n in live if model.require is None or model.require in n.labels]
        if not candidates:
            known = sorted({label for n in live for label in n.labels})
            raise PlacementError(f"model '{model.name}' asks for nodes labelled '{model.require}'; the cluster's "
                                 f"labels are {known or 'none'}")
        fitting = [n for n in candidates if ram_left[n.node_id] >= policy.ram_needed(model, n)]
        wanted = len(fitting) if model.replicas is None else model.replicas
        if wanted < 1 or len(fitting) < wanted:
            raise PlacementError(_shortfall(model, candidates, ram_left, policy, len(fitting), wanted))
        for node in fitting[:wanted]:
            ram_left[node.node_id] -= model.pool_bytes + model.dense_bytes
            replicas.append(_replica(model, node, gpus_free[node.node_id], policy))
    committed = {n.node_id: n.usable_ram_bytes - ram_left[n.node_id] for n in live}
    return PlacementPlan(tuple(replicas), committed)


def plan_joiners(nodes: tuple[NodeInfo, ...] | list[NodeInfo], models: tuple[ModelSpec, ...] | list[ModelSpec],
                 placed: dict[str, int], holders: dict[str, frozenset[str]],
                 policy: PlacementPolicy | None = None) -> tuple[ReplicaPlan, ...]:
    """Replicas to add on ``nodes`` (machines that joined, or that lost their replicas) without
    touching the running ones: per model, every fitting node without one of its replicas
    (``holders``: model -> node ids holding one) when it asks for one per machine, else as many
    as it lacks (``placed``: model -> replicas alive). Their RAM is what the nodes report now, so
    what runs on them already counts. Never refuses: what does not fit is left out."""
    policy = policy or PlacementPolicy()
    live = sorted((n for n in nodes if n.alive), key=_node_order)
    ram_left = {n.node_id: n.usable_ram_bytes for n in live}
    gpus_free = {n.node_id: sorted(n.gpus, key=lambda g: (-g.free_bytes, g.index)) for n in live}
    added: list[ReplicaPlan] = []
    for model in sorted(models, key=lambda m: (-(m.pool_bytes + m.dense_bytes), m.name)):
        held = holders.get(model.name, frozenset())
        fitting = [n for n in live if n.node_id not in held and (model.require is None or model.require in n.labels)
                   and ram_left[n.node_id] >= policy.ram_needed(model, n)]
        wanted = len(fitting) if model.replicas is None else max(0, model.replicas - placed.get(model.name, 0))
        for node in fitting[:wanted]:
            ram_left[node.node_id] -= model.pool_bytes + model.dense_bytes
            added.append(_replica(model, node, gpus_free[node.node_id], policy))
    return tuple(added)


def _replica(model: ModelSpec, node: NodeInfo, gpus_free: list[GpuInfo], policy: PlacementPolicy) -> ReplicaPlan:
    """A CUDA executor on the node's freest unused GPU whose budget holds the dense weights; else CPU."""
    for gpu in list(gpus_free):
        budget = int(gpu.free_bytes * policy.vram_fraction) - model.dense_bytes
        if budget > 0:
            gpus_free.remove(gpu)
            cache = min(budget, model.pool_bytes)
            return ReplicaPlan(model.name, node.node_id, node.name, "cuda", gpu.index, cache, node.physical_cores)
    return ReplicaPlan(model.name, node.node_id, node.name, "cpu", None, 0, node.physical_cores)


def _shortfall(model: ModelSpec, candidates: list[NodeInfo], ram_left: dict[str, int], policy: PlacementPolicy,
               fitting: int, wanted: int) -> str:
    if fitting and wanted > fitting:
        return (f"model '{model.name}' asks for {wanted} replicas but only {fitting} node(s) can hold it "
                f"({_fmt(model.pool_bytes + model.dense_bytes)} each plus headroom)")
    best = max(candidates, key=lambda n: ram_left[n.node_id] - policy.ram_needed(model, n))
    need = policy.ram_needed(model, best)
    have = ram_left[best.node_id]
    return (f"model '{model.name}' fits on no node: it needs {_fmt(need)} of RAM (expert pool "
            f"{_fmt(model.pool_bytes)} + dense weights {_fmt(model.dense_bytes)} + headroom "
            f"{_fmt(policy.headroom(best))}); the best node, {best.name} ({best.address}), has {_fmt(have)} "
            f"available: {_fmt(need - have)} short")
