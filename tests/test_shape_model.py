"""bench/shape_model.py: a random model at a real model's shapes, loaded through the real loader with
its experts in a filled shared pool (a tiny shape here; the full shape only by arithmetic)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from bench.shape_model import (
    POOL_PREFIX,
    QWEN3_30B_A3B,
    build_shape_model,
    decode_bytes,
    fill_banks,
    full_config,
    remove_stale_pools,
)
from hearth.engine import LLM, SamplingParams
from hearth.engine.checkpoint.ftw import read_index
from hearth.engine.experts.mechanism.host_pool import HostExpertPool

TINY = {"num_hidden_layers": 3, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
        "vocab_size": 512, "max_position_embeddings": 512}
PROMPTS = [[5, 17, 33, 99, 100, 3, 7, 200], [300, 12, 12, 250, 8]]
SMALL_ENGINE = {"device": "cpu", "max_model_len": 256, "kv_cache_tokens": 512}


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with build_shape_model(tmp_path_factory.mktemp("shape") / "ftw", TINY) as model:
        yield model


def test_full_shape_bytes_by_hand():
    est = decode_bytes()
    h, v, layers, e, inter = 2048, 151936, 48, 128, 768
    attention = 4096 * h + 512 * h + 512 * h + h * 4096 + 2 * 128  # q, k, v, o and the q/k norms
    per_layer = attention + 2 * h + e * h  # two norms and the router
    dense = 2 * v * h + layers * per_layer + h  # embedding, lm_head (untied), final norm
    assert dense == 1_541_093_376
    assert est.dense_bytes == 2 * dense  # ~3.08 GB
    assert est.expert_bytes == 2 * layers * e * 3 * h * inter == 57_982_058_496  # 54.0 GiB
    assert est.dense_bytes_per_token == 2 * (dense - v * h + h)  # one embedding row, all the rest
    assert est.expert_bytes_per_token == 2 * layers * 8 * 3 * h * inter
    assert est.bytes_per_token == 6_083_739_648
    assert est.step_bytes(1000) == est.bytes_per_token + 1000 * layers * 2 * 4 * 128 * 2
    with pytest.raises(TypeError):
        QWEN3_30B_A3B["num_experts"] = 64  # the default shape is immutable


def test_estimate_matches_the_built_model(tiny):
    est = decode_bytes(TINY)
    assert (tiny.dense_bytes, tiny.expert_bytes) == (est.dense_bytes, est.expert_bytes)
    assert tiny.shape == full_config(TINY) and tiny.shape["eos_token_id"] < TINY["vocab_size"]
    assert set(tiny.seconds) == {"dense", "experts", "total"}


def test_loads_through_the_real_loader_with_the_pools_experts(tiny):
    index = read_index(tiny.path)
    bank_shard = tiny.path / index["shards"][1]["file"]
    assert bank_shard.stat().st_size == index["shards"][1]["bytes"] > 0
    assert bank_shard.stat().st_blocks * 512 < 1 << 20  # a hole: no expert byte on disk
    llm = LLM(tiny.path, expert_device="none", **SMALL_ENGINE, **tiny.engine_options())
    engine = llm.engine
    assert engine.host_pool.name == tiny.pool_name and not engine.host_pool.owner  # attached, not created
    assert torch.equal(engine.pool.gate_up, tiny.host_pool.gate_up)
    assert torch.equal(engine.pool.down, tiny.host_pool.down)
    assert engine.pool.gate_up.float().std().item() == pytest.approx(0.02, rel=0.1)  # random, not the zeros on disk
    dense = dict(engine.runner.model.named_parameters())
    assert dense["model.embed_tokens.weight"].float().std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(dense["model.norm.weight"], torch.ones_like(dense["model.norm.weight"]))
    llm.close()


def test_decode_is_deterministic_on_the_cpu_engine_and_the_hierarchy(tiny):
    runs = []
    for options in ({"expert_device": "none"}, {"expert_device": "none"},
                    {"expert_device": "virtual", "expert_cache": "0.5", "expert_bandwidths": (10e9, 25e9)}):
        with LLM(tiny.path, **SMALL_ENGINE, **options, **tiny.engine_options()) as llm:
            runs.append([o.token_ids for o in llm.generate(PROMPTS, greedy())])
            if options["expert_device"] == "virtual":
                stats = llm.engine.stats()["experts"]
                assert stats["fills"] > 0 and stats["cpu"] > 0  # pool rows copied to the cache and computed there
    assert all(len(t) == 6 for t in runs[0])
    assert runs[0] == runs[1] == runs[2]


def test_directory_is_a_valid_ftw_without_the_pool(tiny):
    with LLM(tiny.path, expert_device="none", **SMALL_ENGINE) as llm:  # checksums verified, banks read
        assert not llm.engine.pool.gate_up.any() and not llm.engine.pool.down.any()
        assert len(llm.generate(PROMPTS[0], greedy(2))[0].token_ids) == 2


def test_fallback_fills_the_engines_own_pool(tmp_path, tiny):
    """Without a shared pool (the engine reads the sparse banks as zeros), fill_banks with the same
    seed gives the engine the pooled model's experts, and the same tokens."""
    with build_shape_model(tmp_path / "nopool", TINY, with_pool=False) as bare:
        assert bare.pool_name is None and bare.engine_options() == {}
        with LLM(bare.path, expert_device="none", verify_checksums=False, **SMALL_ENGINE) as llm:
            fill_banks(llm.engine.pool.gate_up, llm.engine.pool.down, seed=0)
            assert torch.equal(llm.engine.pool.gate_up, tiny.host_pool.gate_up)
            tokens = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    with LLM(tiny.path, expert_device="none", **SMALL_ENGINE, **tiny.engine_options()) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_experts_generated_on_the_gpu(tmp_path):
    with build_shape_model(tmp_path / "gpu", TINY, device="cuda") as model:
        assert model.host_pool.gate_up.float().std().item() == pytest.approx(0.02, rel=0.1)
        with LLM(model.path, expert_device="none", **SMALL_ENGINE, **model.engine_options()) as llm:
            assert len(llm.generate(PROMPTS[0], greedy(2))[0].token_ids) == 2


def test_same_seed_same_model_whatever_the_threads(tmp_path, tiny):
    with build_shape_model(tmp_path / "again", TINY, threads=1) as again:
        for shard in read_index(tiny.path)["shards"]:
            assert (tiny.path / shard["file"]).read_bytes() == (again.path / shard["file"]).read_bytes()
        assert torch.equal(again.host_pool.gate_up, tiny.host_pool.gate_up)
        assert torch.equal(again.host_pool.down, tiny.host_pool.down)


def test_pool_is_removed_on_close_and_after_a_crash(tmp_path):
    model = build_shape_model(tmp_path / "closed", TINY, with_pool=True)
    name = model.pool_name
    assert name.startswith(POOL_PREFIX)
    HostExpertPool.attach(name).close()
    model.close()
    with pytest.raises(FileNotFoundError):
        HostExpertPool.attach(name)
    # A killed owner (os._exit skips every exit handler) leaves its pool; remove_stale_pools finds it.
    crashed = f"{POOL_PREFIX}crash-{os.getpid()}"
    code = ("import os, sys, torch; from hearth.engine.experts.mechanism.host_pool import HostExpertPool as P; "
            "p = P.create(sys.argv[1], (2, 4, 4), (2, 4, 2), torch.bfloat16); p.mark_filled(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, crashed], check=True, timeout=120)
    HostExpertPool.attach(crashed).close()  # still there
    assert crashed in remove_stale_pools()
    with pytest.raises(FileNotFoundError):
        HostExpertPool.attach(crashed)
