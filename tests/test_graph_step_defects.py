"""Captured decode steps (engine/executor/fixed_shape.py graph mode), checked without a GPU: a layer with
nothing for the CPU makes no round trip through the task ring (the ring kernels under Triton's
interpreter, and the host ring ops); the CPU share goes out before the fills; B_P is measured
through the fill op the captured steps fill by; the sync check covers only a captured step's
replays; and a CUDA graph that inductor skips is counted, reported and raised."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

import hearth.engine.executor.graph_ops  # noqa: F401 - registers torch.ops.hearth.*
from hearth.config import ConfigError
from hearth.engine import LLM, llm_engine
from hearth.engine.executor import fixed_shape
from hearth.engine.executor.fixed_shape import CAPTURE_CALLS, CudaGraphSkipped, watch_graph_skips
from hearth.engine.experts import build
from hearth.engine.experts.measure import measure_link_path
from hearth.engine.kernels.gpu import device_ring
from hearth.engine.kernels.ring_words import FREE
from tests.helpers import PROMPTS, greedy, max_rel_error
from tests.test_device_ring import kernels, ring, serve_once  # noqa: F401 - the fixtures
from tests.test_hierarchy import OVERRIDES, SPLIT_BANDWIDTHS, run

VIRTUAL = {"expert_device": "virtual", "expert_cache": "0.37", "q_mode": "table", "stream_min_tokens": 1 << 20}


def record_ops(monkeypatch, names: tuple[str, ...], calls: list[str]) -> None:
    """Wrap torch.ops.hearth.<name> so each call appends its name to ``calls`` and then runs."""
    for name in names:
        op = getattr(torch.ops.hearth, name)

        def recorded(*args, _op=op, _name=name):
            calls.append(_name)
            return _op(*args)

        monkeypatch.setattr(torch.ops.hearth, name, recorded)


# A. An empty CPU share (every expert a cache hit) is not posted, and its collect does not wait.

def test_device_post_of_an_empty_share_leaves_the_slot_free(kernels, ring) -> None:  # noqa: F811
    slot = ring.slots[0]
    x, weights = torch.randn(3, 24), torch.rand(3, 3)
    stale = slot["x"].clone()
    ticket = device_ring.post(slot["ctrl"], slot["x"], slot["rows"], slot["weights"], x,
                              torch.full((3, 3), -1), weights, kernels)
    assert int(slot["ctrl"][0]) == FREE and int(slot["ctrl"][1]) == 0  # nothing published, no sequence number
    assert int(ticket) == 0 and torch.equal(slot["x"], stale)
    started = time.monotonic()
    out = device_ring.collect(slot["ctrl"], slot["out"], torch.full((3, 24), 7.0), 10**9, kernels)  # nobody serves
    assert time.monotonic() - started < 10 and torch.equal(out, torch.zeros(3, 24))
    assert int(slot["ctrl"][0]) == FREE
    device_ring.raise_if_failed(slot["ctrl"])  # no error either
    rows = torch.tensor([[-1, -1, 5], [-1, -1, -1], [-1, 2, -1]])  # a share with pairs: as before
    worker = serve_once(slot)
    ticket = device_ring.post(slot["ctrl"], slot["x"], slot["rows"], slot["weights"], x, rows, weights, kernels)
    out = device_ring.collect(slot["ctrl"], slot["out"], torch.empty(3, 24), 10**7, kernels)
    worker.join(30)
    assert int(ticket) == 1 and torch.equal(out, x * 2 + rows.sum() + weights.reshape(-1)[0])
    assert slot["ctrl"][:2].tolist() == [FREE, 1]
    device_ring.raise_if_failed(slot["ctrl"])


def test_host_ring_ops_skip_an_empty_share(ring) -> None:  # noqa: F811
    """The ring ops on host tensors (eager static steps on the CPU) make the same choice."""
    slot = ring.slots[0]
    x, weights = torch.randn(2, 24), torch.rand(2, 3)
    ticket = torch.ops.hearth.ring_post(slot["ctrl"], slot["x"], slot["rows"], slot["weights"], x,
                                        torch.full((2, 3), -1), weights)
    assert int(ticket) == 0 and int(slot["ctrl"][0]) == FREE and int(slot["ctrl"][1]) == 0
    out = torch.ops.hearth.ring_collect(ticket, slot["ctrl"], slot["out"], 2, 24, 0.2)  # no worker: no wait
    assert torch.equal(out, torch.zeros(2, 24))


# B. The CPU share is posted before the fills; B_P is measured through the captured steps' fill op.

def test_cpu_share_is_posted_before_the_fills(checkpoint, monkeypatch) -> None:
    """Each MoE layer of a static step: control step, ring post, fill, device share, collect, so
    the CPU workers compute while the device fills; tokens and logits those of the plain engine."""
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    plain = LLM(path, expert_device="none")
    ref_tokens, ref_logits = run(plain, PROMPTS, 8)
    plain.close()
    llm = LLM(path, static_decode="eager", block_size=4, cpu_experts="process",
              host_pool_name=f"test-order-{uuid.uuid4().hex[:8]}", expert_bandwidths=SPLIT_BANDWIDTHS, **VIRTUAL)
    layer = ("cache_step", "ring_post", "fill_slots", "routed_experts", "ring_collect")
    calls: list[str] = []
    record_ops(monkeypatch, layer, calls)
    tokens, logits = run(llm, PROMPTS, 8)
    assert llm.engine.runner.static.steps > 0 and calls
    assert [tuple(calls[i : i + 5]) for i in range(0, len(calls), 5)] == [layer] * (len(calls) // 5)
    assert len(calls) % 5 == 0
    assert tokens == ref_tokens
    assert max(max_rel_error(a, b) for a, b in zip(logits, ref_logits, strict=True)) <= 1e-5
    llm.close()


@pytest.mark.parametrize(("mode", "expected"), [("graph", "fill_op"), ("eager", "copy")])
def test_graph_mode_build_measures_the_link_through_the_fill_op(checkpoint, monkeypatch, mode, expected) -> None:
    """With --static-decode graph the start-up B_P measurement fills through torch.ops.hearth.fill_slots
    (what a captured step runs), otherwise through the device's copy path. (Graph mode then stops
    on this machine: it needs a GPU.)"""
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    calls, paths = [], []
    record_ops(monkeypatch, ("fill_slots",), calls)
    real_build = llm_engine.build_hierarchy

    def recording_build(*args, **kwargs):
        paths.append(kwargs.get("link_path"))
        return real_build(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "build_hierarchy", recording_build)
    if mode == "graph":
        with pytest.raises(ConfigError, match="GPU"):
            LLM(path, static_decode=mode, **VIRTUAL)
    else:
        LLM(path, static_decode=mode, **VIRTUAL).close()
    assert paths == [expected]
    assert bool(calls) == (mode == "graph")  # the link measurement ran through the fill op


def test_link_measured_through_the_fill_op_keeps_results_exact(checkpoint, monkeypatch) -> None:
    """measure_link_path(path="fill_op") on the virtual device: fill_slots' CPU path copies the real
    experts into the slots (bit for bit), device.fill is not used; an engine built that way, and
    probed that way between steps, gives the plain engine's tokens and logits."""
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    plain = LLM(path, expert_device="none")
    ref_tokens, ref_logits = run(plain, PROMPTS, 8)
    plain.close()
    real_build = llm_engine.build_hierarchy
    monkeypatch.setattr(llm_engine, "build_hierarchy",
                        lambda *a, **kw: real_build(*a, **(kw | {"link_path": "fill_op"})))  # as graph mode does
    llm = LLM(path, static_decode="eager", block_size=4, **VIRTUAL)  # B_P and B_H measured
    backend, pool = llm.engine.experts, llm.engine.pool
    assert backend.link_path == "fill_op" and backend.costs.link.bytes_per_s > 0
    calls: list[str] = []
    record_ops(monkeypatch, ("fill_slots",), calls)
    with monkeypatch.context() as patch:  # (prefill steps fill through the copy path: that stays)
        patch.setattr(backend.device, "fill", lambda plan: pytest.fail("the copy path was used"))
        measure_link_path(backend.device, pool, 4, repeats=1, path="fill_op")  # the tables are still empty
    assert calls
    first = pool.moe_layer_ids[0] * pool.num_experts
    rows = pool.row_table[torch.arange(first, first + 4)]
    assert torch.equal(backend.device.gate_up[:4], pool.gate_up[rows])
    assert torch.equal(backend.device.down[:4], pool.down[rows])
    # Experts resident for the probe, whatever the measured split: under load q* may leave every miss to
    # the CPU (nothing filled, nothing to probe), so here every miss is filled, then the table is back.
    with monkeypatch.context() as patch:
        patch.setattr(backend, "_rebuild_qtable", lambda: None)
        backend.tables.set_qtable(torch.arange(backend.tables.qtable.shape[0]).to(backend.tables.qtable))
        run(llm, PROMPTS[:2], 4)
    backend._rebuild_qtable()
    calls.clear()
    b_p, _ = backend.probe(4, repeats=1)  # refills resident slots with what they hold, through the same path
    assert calls and b_p > 0
    tokens, logits = run(llm, PROMPTS, 8)
    assert tokens == ref_tokens
    assert max(max_rel_error(a, b) for a, b in zip(logits, ref_logits, strict=True)) <= 1e-5
    llm.close()


# C. The sync check wraps only the replay of a captured step.

def test_sync_check_covers_only_the_replays(checkpoint, monkeypatch) -> None:
    """Graph mode's step path on the CPU (the step itself eager): sync debug mode "error" is set right
    before a replayed step (a bucket's calls after its warm-up and recording) and restored right
    after; building the batch, the first calls and sampling stay outside."""
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, static_decode="eager", block_size=64, expert_device="none")
    static = llm.engine.runner.static
    static.mode, static.sync_check = "graph", True
    events: list[str] = []

    def traced(name, fn):
        return lambda *a, **kw: (events.append(name), fn(*a, **kw))[1]

    monkeypatch.setattr(static, "step_fn", lambda rows, width: traced("step", static._forward))
    monkeypatch.setattr(fixed_shape, "build_static_batch", traced("batch", fixed_shape.build_static_batch))
    monkeypatch.setattr(llm_engine, "sample_token", traced("sample", llm_engine.sample_token))
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 1)  # "warn", say, before
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: events.append(f"sync {mode}"))
    llm.generate([[5, 6, 7]], greedy(8))  # one prefill step, then 7 static steps in one bucket
    checked = ["batch", "sync error", "step", "sync 1", "sample"]
    assert events == ["sample"] + ["batch", "step", "sample"] * CAPTURE_CALLS + checked * (7 - CAPTURE_CALLS)
    assert static.replays_checked == 7 - CAPTURE_CALLS
    events.clear()

    def failing(batch):
        events.append("step")
        raise RuntimeError("a synchronisation")

    with pytest.raises(RuntimeError, match="synchronisation"):
        static._run_step((1, 1), failing, None)  # a replay (the bucket above): checked, and restored on error
    assert events == ["sync error", "step", "sync 1"]
    llm.close()


# D. A CUDA graph inductor skips is counted, reported in the stats, and raised.

def test_watch_graph_skips_sees_a_skipped_graph() -> None:
    """mode="reduce-overhead" of a CPU function: inductor skips the CUDA graph (cpu device) and counts
    it; a plain compile is no skip."""
    graphless = torch.compile(lambda x: x * 2 + 1, mode="reduce-overhead")
    with watch_graph_skips() as skips:
        out = graphless(torch.ones(3))
    assert skips.count == 1 and torch.equal(out, torch.full((3,), 3.0))
    assert "1 skip" in skips.describe()  # inductor logs no reason for a graph without CUDA work
    plain = torch.compile(lambda x: x * 3 + 1)
    with watch_graph_skips() as skips:
        plain(torch.ones(3))
    assert skips.count == 0
    torch._dynamo.reset()


def test_graph_mode_raises_and_reports_a_skipped_graph(checkpoint) -> None:
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, static_decode="eager", expert_device="none")
    static = llm.engine.runner.static
    static.mode = "graph"  # graph mode's step path; the steps below compile for the CPU, so skip their graphs
    first = torch.compile(lambda x: x + 1, mode="reduce-overhead")
    with pytest.raises(CudaGraphSkipped, match="4x2 decode step without a CUDA graph"):
        static._run_step((4, 2), lambda batch: first(torch.ones(2)), None)
    assert static.graph_skips == 1
    static.require_graphs = False  # counted only
    second = torch.compile(lambda x: x + 2, mode="reduce-overhead")
    assert torch.equal(static._run_step((8, 2), lambda batch: second(torch.ones(2)), None), torch.full((2,), 3.0))
    static._run_step((8, 2), lambda batch: second(torch.ones(2)), None)  # compiled already: nothing new
    assert static.graph_skips == 2
    assert llm.engine.stats()["static_decode"]["graph_skips"] == 2
    llm.close()
    torch._dynamo.reset()


def test_build_passes_the_link_path_to_the_measurement(monkeypatch) -> None:
    """measure_costs hands its link path to measure_link_path (the engine's choice reaches it)."""
    seen = []
    monkeypatch.setattr(build, "measure_host_path", lambda *a, **kw: build.PathCost(1e9, 0.0))
    monkeypatch.setattr(build, "measure_link_path", lambda *a, path="copy", **kw: (seen.append(path),
                                                                                   build.PathCost(1e9))[1])
    monkeypatch.setattr(build.LayerStreamer, "fits", staticmethod(lambda *a, **kw: False))

    class Device:
        num_slots, link_bytes_per_s = 4, None

    class Pool:
        expert_bytes = 1

    build.measure_costs(Pool(), None, Device(), 2, None, "fill_op")
    assert seen == ["fill_op"]
