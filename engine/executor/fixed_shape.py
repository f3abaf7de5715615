"""Decode steps with static shapes: the step that compiles whole and that a GPU captures as a graph.

A decode step of n sequences runs in a bucket of B >= n rows (``BATCH_BUCKETS``) and block tables of
MB blocks (a power of two >= the longest sequence's). Rows past the real ones repeat row 0 exactly,
so inside the step there are no masks over rows, no valid counts and no host reads: the model's own
modules run on a :class:`~hearth.engine.layers.batch.StaticBatch` (attention over gathered blocks masked by
context length; the expert hierarchy through custom ops, ``engine/executor/graph_ops.py``), and the same
shapes recur at every token. :class:`StaticDecoder` keeps one compiled step per bucket
(``torch.compile(fullgraph=True)``: a graph break is an error) or runs it eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import hearth.engine.executor.graph_ops  # noqa: F401 - registers torch.ops.hearth.*
from hearth.config import ConfigError
from hearth.engine.cache.kv_pages import PagedKVCache
from hearth.engine.cache.state_slots import RecurrentStatePool
from hearth.engine.layers.attention import ChunkedAttention, SinkAttention
from hearth.engine.layers.batch import StaticBatch
from hearth.engine.layers.compressed_attention import CompressedAttention
from hearth.engine.layers.mla import LatentAttention
from hearth.engine.request import Request

BATCH_BUCKETS = (1, 2, 4, 8, 16)
# Graph mode: a bucket's first calls are inductor's CUDA-graph warm-up (the step run without a graph)
# and its recording, both of which synchronise by design; the calls after them replay the graph.
CAPTURE_CALLS = 2


class CudaGraphSkipped(RuntimeError):
    """Graph mode, and inductor runs a step without a CUDA graph (mode="reduce-overhead" falls back
    silently otherwise)."""


@dataclass
class GraphSkips:
    """What :func:`watch_graph_skips` saw: inductor's CUDA-graph skips and the reasons it logged."""

    count: int = 0
    reasons: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return "; ".join(self.reasons) or f"{self.count} skip(s) counted, no reason logged"


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@contextlib.contextmanager
def watch_graph_skips() -> Iterator[GraphSkips]:
    """Count the CUDA graphs inductor skips in the block (``torch._dynamo.utils.counters["inductor"]
    ["cudagraph_skips"]``, bumped where a mode="reduce-overhead" compile decides against a graph) and
    collect the reasons it logs ("skipping cudagraphs due to ..."; logged for graphs with CUDA work,
    only counted for CPU-only ones). The count is filled in when the block ends."""
    from torch._dynamo.utils import counters  # deferred: torch._dynamo takes seconds to import; graph mode only
    from torch._inductor import cudagraph_utils  # deferred: as torch._dynamo

    found = GraphSkips()
    logger = getattr(cudagraph_utils, "cudagraphs_log", None)
    handler = _Collect(found.reasons)
    before = counters["inductor"]["cudagraph_skips"]
    if logger is not None:
        logger.addHandler(handler)
    try:
        yield found
    finally:
        if logger is not None:
            logger.removeHandler(handler)
        found.count = counters["inductor"]["cudagraph_skips"] - before


@contextlib.contextmanager
def sync_errors(enabled: bool = True) -> Iterator[None]:
    """When ``enabled``, torch.cuda's sync debug mode "error" in the block: a host synchronisation
    in it raises. The mode in force before comes back after, also when the block raises."""
    if not enabled:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def bucket_of(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding n rows (n itself past the largest)."""
    return next((b for b in buckets if b >= n), n)


def block_bucket(blocks: int, max_blocks: int) -> int:
    """Block-table width for a longest sequence of ``blocks`` blocks: the next power of two, at most
    ``max_blocks`` (few widths, so few compiled steps, and at most twice the blocks gathered)."""
    return min(1 << max(blocks - 1, 0).bit_length(), max_blocks)


def build_static_batch(items: list[tuple[Request, int]], block_size: int, rows: int, max_blocks: int,
                       device: torch.device | str = "cpu") -> StaticBatch:
    """The decode step of ``items`` (each one new token) in ``rows`` rows; rows past the items
    repeat the first one."""
    if any(n != 1 for _, n in items) or not 0 < len(items) <= rows:
        raise ValueError("a static step takes 1..rows sequences of one new token each")
    tokens, positions, slots, lens, tables = [], [], [], [], []
    for req, _ in items:
        pos = req.num_computed
        blocks = req.block_table[: pos // block_size + 1]
        tokens.append(req.tokens[pos])
        positions.append(pos)
        slots.append(blocks[-1] * block_size + pos % block_size)
        lens.append(pos + 1)
        tables.append(blocks)
    width = block_bucket(max(len(t) for t in tables), max_blocks)
    pad = rows - len(items)
    table = torch.zeros((rows, width), dtype=torch.long)
    for i, blocks in enumerate(tables + [tables[0]] * pad):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)

    def column(values: list[int]) -> torch.Tensor:
        return torch.tensor(values + values[:1] * pad, dtype=torch.long, device=device)

    return StaticBatch(token_ids=column(tokens), positions=column(positions), slot_mapping=column(slots),
                       block_tables=table.to(device), context_lens=column(lens),
                       logits_indices=torch.arange(rows, device=device), block_size=block_size,
                       state_slots=column([req.state_slot for req, _ in items]))


class StaticDecoder:
    """Runs decode steps through :func:`build_static_batch`: ``mode`` "eager" calls the model on
    the static batch, "compile" compiles it once per (rows, blocks) bucket with
    ``torch.compile(fullgraph=True, dynamic=False)`` and ``backend`` (a graph break raises), "graph"
    with inductor's CUDA graphs (a skipped graph is counted in ``graph_skips`` and raises
    :class:`CudaGraphSkipped` while ``require_graphs``; ``sync_check`` puts each replay under
    torch.cuda's sync debug mode "error")."""

    def __init__(self, model: torch.nn.Module, kv: PagedKVCache, max_model_len: int, mode: str = "compile",
                 backend: str | Callable = "inductor", buckets: tuple[int, ...] = BATCH_BUCKETS,
                 states: RecurrentStatePool | None = None, experts=None) -> None:
        """``states``: a hybrid model's state pool; ``experts``: the expert hierarchy, whose tables and
        arena a captured graph keeps in place."""
        if model.config.linear_layer_ids and states is None:
            raise ValueError(f"{model.config.architecture} has linear-attention layers: static steps need its "
                             "state pool")
        unsupported = {"latent attention": LatentAttention, "attention sinks": SinkAttention,
                       "compressed attention": CompressedAttention, "chunked attention": ChunkedAttention}
        # (and what a family's own layer says it cannot do in a fixed shape)
        unsupported |= {what: type(m) for m in model.modules() if (what := getattr(m, "fixed_shape_refusal", None))}
        for what, kind in unsupported.items():
            if any(isinstance(m, kind) for m in model.modules()):
                raise ConfigError(f"--static-decode: fixed-shape steps do not run {model.config.architecture}'s "
                                  f"{what} yet (use --static-decode off)")
        if mode not in ("eager", "compile", "graph"):
            raise ValueError(f"static decode mode '{mode}': eager, compile or graph")
        if mode == "graph" and kv.device.type != "cuda":
            raise ConfigError("--static-decode graph captures CUDA graphs: it needs the model on a GPU (--device cuda)")
        if mode == "graph" and (experts is None or getattr(experts, "device_ring", None) is None):
            raise ConfigError("--static-decode graph needs every part of a step on the GPU: the expert cache there "
                              "(--expert-device cuda) and the CPU experts behind the task ring, which the GPU "
                              "feeds itself (--cpu-experts process --host-pool NAME)")
        self.model, self.kv, self.states, self.experts = model, kv, states, experts
        self.max_blocks = -(-max_model_len // kv.block_size)
        self.mode, self.backend, self.buckets = mode, backend, buckets
        self._compiled: dict[tuple[int, int], Any] = {}
        self.on_step: Callable[[float, int], None] | None = None  # (seconds, tokens) of each step
        self.after_step: Callable[[], None] | None = None  # raises what a step's device-side parts left
        self.steps = 0  # static steps run
        self.just_compiled = False  # the last step compiled its bucket (its time is not the step's)
        self.recompiles = 0  # times the compiled steps were dropped (resizes)
        # Graph mode: replays (a bucket's calls after its first CAPTURE_CALLS) run under torch.cuda's
        # sync debug mode "error", so a host synchronisation inside the captured step raises; the
        # work around it (the batch, the sampler's read) is not checked.
        self.sync_check = False
        self.graph_skips = 0  # graph mode: CUDA graphs inductor skipped (steps run without one)
        self.replays_checked = 0  # graph mode: replays that ran under the sync check and made no sync
        self.require_graphs = True  # graph mode: a skipped graph raises CudaGraphSkipped
        self._calls: dict[tuple[int, int], int] = {}  # graph mode: calls per bucket since it compiled

    def step_fn(self, rows: int, width: int):
        """The step for one bucket (compiled on first use in compile mode). Each bucket compiles its
        own copy of the step's code: torch keeps compiled versions per code object and allows only a
        few, which the buckets' widths and the compiles after resizes would exhaust."""
        if self.mode == "eager":
            return self._forward
        key = (rows, width)
        if key not in self._compiled:
            code = StaticDecoder._forward.__code__.replace(co_name=f"static_step_{rows}x{width}_{self.recompiles}")
            fresh = types.MethodType(types.FunctionType(code, StaticDecoder._forward.__globals__), self)
            if self.mode == "graph":  # inductor's CUDA graphs: one capture per bucket, replayed each token
                self._mark_static()
                self._compiled[key] = torch.compile(fresh, fullgraph=True, dynamic=False, mode="reduce-overhead")
            else:
                self._compiled[key] = torch.compile(fresh, fullgraph=True, dynamic=False, backend=self.backend)
            self.just_compiled = True
        return self._compiled[key]

    def _forward(self, batch: StaticBatch) -> torch.Tensor:
        # The model's forward without its inference_mode wrapper (see execute).
        return type(self.model).forward.__wrapped__(self.model, batch, self.kv, self.states)

    def execute(self, items: list[tuple[Request, int]], experts=None) -> tuple[torch.Tensor, list[Request]]:
        """Logits [n, vocab] fp32 of the n decoding sequences, and those requests (sampled, in order)."""
        rows = bucket_of(len(items), self.buckets)
        batch = build_static_batch(items, self.kv.block_size, rows, self.max_blocks, self.kv.keys[0].device)
        batch.experts = experts
        self.steps += 1
        self.just_compiled = False
        start = time.perf_counter()
        key = (rows, batch.block_tables.shape[1])
        step = self.step_fn(*key)
        with torch.no_grad():  # not inference mode: AOTAutograd cannot trace views of inference tensors
            logits = self._run_step(key, step, batch) if self.mode == "graph" else step(batch)
        if self.after_step is not None:
            self.after_step()
        if self.on_step is not None and not self.just_compiled:  # a step that compiled says nothing of the split
            if logits.is_cuda:
                torch.cuda.synchronize(logits.device)  # the step's own time, not its launch
            self.on_step(time.perf_counter() - start, len(items))
        return logits[: len(items)], [req for req, _ in items]

    def _run_step(self, key: tuple[int, int], step, batch: StaticBatch) -> torch.Tensor:
        """A graph-mode step: inductor's CUDA-graph skips counted (raised, with ``require_graphs``),
        and a replay checked for host synchronisations when ``sync_check`` is on."""
        calls = self._calls[key] = self._calls.get(key, 0) + 1
        checked = self.sync_check and calls > CAPTURE_CALLS
        with watch_graph_skips() as skips, sync_errors(checked):
            logits = step(batch)
        self.replays_checked += checked
        if skips.count:
            self.graph_skips += skips.count
            if self.require_graphs:
                raise CudaGraphSkipped(f"--static-decode graph: inductor runs the {key[0]}x{key[1]} decode step "
                                       f"without a CUDA graph ({skips.describe()}); use --static-decode compile, "
                                       "or find what keeps the step off the graph")
        return logits

    def stats(self) -> dict[str, Any]:
        """Mode, steps, compiled buckets, recompiles (resizes) and CUDA graphs skipped."""
        return {"mode": self.mode, "steps": self.steps, "buckets": len(self._compiled), "recompiles": self.recompiles,
                "graph_skips": self.graph_skips}

    def _mark_static(self) -> None:
        """Tell the compiler which tensors keep their address from step to step (the KV cache, the
        expert cache's arena and tables, the recurrent states): a captured graph reads and writes
        them in place instead of copying them in (marked again after a resize replaced them)."""
        tensors = [*self.kv.keys, *self.kv.values]
        if self.states is not None:
            tensors += [*self.states.conv.values(), *self.states.recurrent.values()]
        experts = self.experts
        if experts is not None:
            t = experts.tables
            tensors += [t.slot_of, t.expert_of, t.last_used, t.clock, t.qtable, t.stats, experts.device.gate_up,
                        experts.device.down, *experts.device.fill_sources()]
            if experts.device_ring is not None:  # the ring itself, not a copy the graph would make of it
                tensors += list(experts.device_ring.values())
        for tensor in tensors:
            if tensor.numel():
                torch._dynamo.mark_static_address(tensor)

    def invalidate(self) -> None:
        """Drop the compiled steps (after the expert cache's arena and tables were replaced by a
        resize): each bucket compiles, or is captured, again at its next step."""
        self._compiled.clear()
        self._calls.clear()
        self.recompiles += 1

    @property
    def compiled_buckets(self) -> list[tuple[int, int]]:
        return sorted(self._compiled)
