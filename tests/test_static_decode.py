"""Fixed-shape decode steps (engine/executor/fixed_shape.py), the CPU proof of graph safety: the whole decode
step, dense part and expert hierarchy on the virtual device, compiles with
``torch.compile(fullgraph=True)`` (a graph break, a host read or data-dependent Python would raise),
and gives the tokens and logits of the eager step and of the plain engine."""

from __future__ import annotations

import pytest
import torch

from hearth.engine import LLM
from hearth.engine.executor.fixed_shape import block_bucket, bucket_of
from tests.helpers import PROMPTS, greedy, max_rel_error
from tests.test_gguf_hierarchy import q4_k_m  # noqa: F401 - the fixture
from tests.test_hierarchy import BATCH4, OVERRIDES, SPLIT_BANDWIDTHS, run

THREE = PROMPTS  # three sequences: a bucket of 4 rows, one of them padding
STEPS = 12
# The cache sizes of the hierarchy, with the q table splitting the misses.
HIERARCHY = {"none": {"expert_device": "none"}} | {
    size: {"expert_device": "virtual", "expert_cache": size, "q_mode": "table", "expert_bandwidths": SPLIT_BANDWIDTHS,
           "stream_min_tokens": 1 << 20} for size in ("0slots", "0.37", "1.0")}


@pytest.fixture(scope="module")
def plain(checkpoint):
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="none")
    out = run(llm, THREE, STEPS)
    llm.close()
    return out


def test_buckets() -> None:
    assert [bucket_of(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 9]
    assert [block_bucket(n, 64) for n in (1, 2, 3, 5, 33, 100)] == [1, 2, 4, 8, 64, 64]


@pytest.mark.parametrize("setup", list(HIERARCHY))
def test_eager_static_steps_equal_the_plain_engine(checkpoint, plain, setup) -> None:
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, static_decode="eager", block_size=4, **HIERARCHY[setup])
    tokens, logits = run(llm, THREE, STEPS)
    assert tokens == plain[0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, plain[1], strict=True)) <= 1e-5
    assert llm.engine.runner.static.steps >= STEPS - 1  # every step after the prompts was a static one
    if setup == "0.37":
        stats = llm.engine.stats()["experts"]
        assert stats["fills"] > 0 and stats["cpu"] > 0  # both paths ran inside static steps
        # the credit tuner is fed whole steps: every MoE layer of every static step counted
        assert stats["layer_calls"] >= llm.engine.runner.static.steps * 3
    llm.close()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_step_has_no_graph_break_and_equals_eager(checkpoint, plain, backend) -> None:
    """fullgraph=True: any graph break (a pybind call, .item(), .tolist(), a branch on data) fails.
    aot_eager traces the whole step and its custom ops without generating code (fast enough for
    every run); inductor generates it (slow)."""
    pytest.importorskip("torch._dynamo")
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    options = dict(HIERARCHY["0.37"], block_size=4)
    eager = LLM(path, static_decode="eager", **options)
    eager_tokens, eager_logits = run(eager, THREE, STEPS)
    eager.close()
    llm = LLM(path, static_decode="compile", **options)
    llm.engine.runner.static.backend = backend  # the graph and its custom ops, without code generation
    tokens, logits = run(llm, THREE, STEPS)
    assert tokens == eager_tokens == plain[0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, eager_logits, strict=True)) <= 1e-5
    assert llm.engine.runner.static.compiled_buckets  # the steps ran compiled
    llm.close()
    torch._dynamo.reset()


def test_compiled_step_with_quantized_weights(q4_k_m) -> None:  # noqa: F811 - the imported fixture
    """A Q4_K_M GGUF file: block-quantized projections, embedding and experts as custom-op nodes,
    the experts through the hierarchy; tokens and logits those of the plain engine."""
    path, refs = q4_k_m
    llm = LLM(path, static_decode="compile", block_size=4, **HIERARCHY["0.37"])
    llm.engine.runner.static.backend = "aot_eager"
    tokens, logits = run(llm, BATCH4, 16)
    assert tokens == refs[4][0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, refs[4][1], strict=True)) <= 1e-5
    assert llm.engine.runner.static.compiled_buckets and llm.engine.runner.static.steps >= 15
    llm.close()
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_cpu_share_through_the_ring(checkpoint, plain, mode) -> None:
    """CPU experts in a worker process: each static step hands the CPU share over as a descriptor in
    the shared task ring (payload, then the SUBMITTED word), computes the device share meanwhile,
    and waits for the completion word; tokens and logits those of the plain engine."""
    import uuid

    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, static_decode=mode, block_size=4, cpu_experts="process",
              host_pool_name=f"test-static-{uuid.uuid4().hex[:8]}", **HIERARCHY["0.37"])
    llm.engine.runner.static.backend = "aot_eager"
    tokens, logits = run(llm, THREE, STEPS)
    assert tokens == plain[0]
    assert max(max_rel_error(a, b) for a, b in zip(logits, plain[1], strict=True)) <= 1e-5
    assert llm.engine.stats()["experts"]["cpu"] > 0 and llm.engine.runner.static.steps >= STEPS - 1
    llm.close()
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "lfm2_moe", "granitemoehybrid"])
def test_hybrid_models_in_static_steps(checkpoint, family) -> None:
    """Hybrid models (gated DeltaNet + gated attention): each row's convolution window and recurrent
    state advance in its state slot inside the fixed-shape step; eager and compiled steps give the
    plain engine's tokens and logits, three sequences in a four-row bucket."""
    path, _ = checkpoint(family, **OVERRIDES)
    plain = LLM(path, expert_device="none")
    ref_tokens, ref_logits = run(plain, THREE, STEPS)
    plain.close()
    for mode in ("eager", "compile"):
        llm = LLM(path, static_decode=mode, block_size=4, **HIERARCHY["0.37"])
        llm.engine.runner.static.backend = "aot_eager"
        tokens, logits = run(llm, THREE, STEPS)
        assert tokens == ref_tokens, mode
        assert max(max_rel_error(a, b) for a, b in zip(logits, ref_logits, strict=True)) <= 1e-4, mode
        assert llm.engine.runner.static.steps >= STEPS - 1
        llm.close()
    torch._dynamo.reset()


def test_many_buckets_compile_without_hitting_the_recompile_limit(checkpoint) -> None:
    """A sequence growing through many block-table widths, and a batch shrinking through row
    buckets: more compiled shapes than torch allows one function (8), each bucket its own code."""
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, static_decode="compile", block_size=1, expert_device="none")
    static = llm.engine.runner.static
    static.backend = "aot_eager"
    engine = llm.engine
    long_id = engine.add_request([5, 6, 7, 8, 9], greedy(300))
    engine.add_request([11, 12, 13], greedy(6))
    engine.add_request([21, 22], greedy(3))
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.chunk.token_ids)
    assert len(static.compiled_buckets) > 8, static.compiled_buckets
    plain = LLM(path, expert_device="none")
    assert tokens[long_id] == plain.generate([[5, 6, 7, 8, 9]], greedy(300))[0].token_ids
    plain.close()
    llm.close()
    torch._dynamo.reset()
