"""Pipeline stages as a pure function: a model too big for any one machine's RAM split by layers
over several machines, each stage holding a contiguous run of layers (with their experts) and the
first and last stages the embeddings and the output head. Like :func:`cluster.placement.plan_placement`,
no Ray: frozen machine reports in, a frozen plan out.

The split uses the fewest machines whose free RAM (less each one's headroom) holds the model, the
fastest first, so a token crosses as few hops as possible; it gives each stage layers in proportion
to its machine's measured speed, as far as its RAM allows, so that stages take about as long each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hearth.cluster.placement import NodeInfo, PlacementError, PlacementPolicy, _fmt


@dataclass(frozen=True)
class StagePlan:
    """One stage: layers ``first_layer``..``end_layer - 1`` of ``model`` on one machine."""

    model: str
    index: int
    node_id: str
    node_name: str
    first_layer: int
    end_layer: int
    ram_bytes: int  # its layers' weights (experts included), and the embeddings or head where it has them
    executor: str = "cpu"  # "cuda": its machine has a GPU, and the stage runs the expert hierarchy there

    @property
    def stage_id(self) -> str:
        return f"{self.model}/stage{self.index}@{self.node_name}"


def node_speed(node: NodeInfo) -> float:
    """How fast a machine runs its share: its measured host expert bandwidth B_H where known
    (experts dominate a MoE layer's time on the host), else its physical cores."""
    return float(node.b_h) if node.b_h else float(node.physical_cores)


def plan_stages(nodes: Sequence[NodeInfo], model: str, layer_bytes: Sequence[int], embed_bytes: int,
                head_bytes: int, policy: PlacementPolicy | None = None,
                speeds: Mapping[str, float] | None = None, min_stages: int = 1,
                may_start: Sequence[bool] | None = None) -> tuple[StagePlan, ...]:
    """Split ``model`` (``layer_bytes``: each decoder layer's weights, experts included) over the
    live ``nodes``, over ``min_stages`` machines at least; ``speeds``: node id -> relative speed
    (default :func:`node_speed`); ``may_start``: per layer, whether a stage may begin there (GLM-5's
    layers that reuse the sparse selection of the layer before may not; default: every layer).
    Raises :class:`PlacementError` when even all the machines together cannot hold it."""
    policy = policy or PlacementPolicy()
    if not layer_bytes:
        raise PlacementError(f"model '{model}' has no layers to place")
    speed = {n.node_id: (speeds or {}).get(n.node_id) or node_speed(n) for n in nodes}
    live = sorted((n for n in nodes if n.alive), key=lambda n: (-speed[n.node_id], -n.usable_ram_bytes, n.node_id))
    if len(live) < min_stages:
        raise PlacementError(f"{min_stages} pipeline stages need {min_stages} machines; the cluster has {len(live)} "
                             "live")
    room = {n.node_id: max(0, n.usable_ram_bytes - policy.headroom(n)) for n in live}
    total = sum(layer_bytes) + embed_bytes + head_bytes
    chosen: list[NodeInfo] = []
    for node in live:  # the fewest machines, fastest first, whose room holds everything
        chosen.append(node)
        if len(chosen) >= min_stages and sum(room[n.node_id] for n in chosen) >= total:
            break
    else:
        have = sum(room.values())
        raise PlacementError(f"model '{model}' needs {_fmt(total)} of RAM for its weights; all "
                             f"{len(live)} machine(s) together have {_fmt(have)} free beyond their headroom: "
                             f"{_fmt(total - have)} short")
    rooms = [room[n.node_id] for n in chosen]
    try:
        bounds = _cut(layer_bytes, embed_bytes, head_bytes, _shares(total, [speed[n.node_id] for n in chosen], rooms),
                      rooms, may_start)
    except PlacementError:  # the speed-proportional cut strands too much on the last machine: fill up instead
        bounds = _cut(layer_bytes, embed_bytes, head_bytes, [float(r) for r in rooms], rooms, may_start)
    stages = []
    for i, (node, (first, end)) in enumerate(zip(chosen, bounds, strict=True)):
        ends = (embed_bytes if i == 0 else 0) + (head_bytes if i == len(chosen) - 1 else 0)
        stages.append(StagePlan(model, i, node.node_id, node.name, first, end, sum(layer_bytes[first:end]) + ends,
                                "cuda" if node.gpus else "cpu"))
    return tuple(stages)


def _allowed_start(end: int, start: int, n: int, may_start: Sequence[bool] | None) -> int:
    """``end`` moved to the nearest layer after ``start`` where a stage may begin: back first, then on."""
    if may_start is None or end >= n or may_start[end]:
        return end
    back = next((e for e in range(end - 1, start, -1) if may_start[e]), None)
    return back if back is not None else next((e for e in range(end + 1, n) if may_start[e]), n)


def _shares(total: int, speeds: list[float], rooms: list[int]) -> list[float]:
    """Bytes each stage should take: in proportion to speed, none beyond its room (the excess goes
    to the others, again by speed)."""
    shares = [0.0] * len(speeds)
    left, open_ = float(total), set(range(len(speeds)))
    while open_ and left > 0:
        weight = sum(speeds[i] for i in open_)
        capped = {i for i in open_ if shares[i] + left * speeds[i] / weight >= rooms[i]}
        if not capped:
            for i in open_:
                shares[i] += left * speeds[i] / weight
            break
        for i in capped:
            left -= rooms[i] - shares[i]
            shares[i] = rooms[i]
        open_ -= capped
    return shares


def _cut(layer_bytes: Sequence[int], embed: int, head: int, targets: list[float],
         rooms: list[int], may_start: Sequence[bool] | None = None) -> list[tuple[int, int]]:
    """Contiguous layer ranges, stage i taking layers until its running total reaches its target
    (never past its room); every stage gets at least one layer, the last whatever remains. A stage
    ends earlier (or, where it cannot, later) so that the next begins where ``may_start`` allows."""
    n, stages = len(layer_bytes), len(targets)
    if n < stages:
        raise PlacementError(f"{n} layers cannot fill {stages} stages")
    bounds, start = [], 0
    for i in range(stages):
        if i == stages - 1:
            end = n
        else:
            held, end = (embed if i == 0 else 0), start
            while end < n - (stages - 1 - i) and (end == start or held + layer_bytes[end] / 2 <= targets[i]) \
                    and held + layer_bytes[end] <= rooms[i]:
                held += layer_bytes[end]
                end += 1
            end = _allowed_start(end, start, n, may_start)
            if sum(layer_bytes[start:end]) + (embed if i == 0 else 0) > rooms[i]:
                raise PlacementError(f"stage {i} cannot end where the next stage may begin (layer {end})")
        if end == start:
            raise PlacementError(f"stage {i} cannot hold even one layer ({_fmt(layer_bytes[start])})")
        bounds.append((start, end))
        start = end
    last = sum(layer_bytes[bounds[-1][0]:]) + head + (embed if stages == 1 else 0)
    if last > rooms[-1]:
        raise PlacementError(f"the last stage would need {_fmt(last)} but its machine has {_fmt(rooms[-1])} free")
    return bounds
