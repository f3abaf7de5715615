"""The engine's memory plan: every part counted once, and a warning when it exceeds free memory."""

from __future__ import annotations

import logging

import torch

from hearth.engine import LLM
from hearth.engine.executor.memory_plan import MemoryPlan, available_memory, tensor_bytes


def test_views_share_their_storage_in_the_count() -> None:
    base = torch.zeros(100, dtype=torch.float32)
    assert tensor_bytes([base, base[:10], base.view(10, 10), torch.zeros(5, dtype=torch.bfloat16)], "cpu") == 410


def test_a_plan_past_the_free_memory_warns_and_names_the_knobs() -> None:
    plan = MemoryPlan(weights=3 << 30, kv_cache=2 << 30, kv_tokens=1000, checkpoints=1 << 30, available=5 << 30)
    assert plan.total == 6 << 30
    assert "--kv-cache-bytes" in plan.warning() and "6.0 GiB" in plan.warning()
    assert MemoryPlan(1, 1, 16, available=None).warning() is None
    assert "state checkpoints up to 1.0 GiB" in plan.describe()


def test_free_memory_is_read_from_meminfo(tmp_path) -> None:
    (tmp_path / "m").write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert available_memory(tmp_path / "m") == 2 << 20
    assert available_memory(tmp_path / "missing") is None


def test_engine_counts_kv_cache_and_checkpoint_budget(checkpoint, caplog) -> None:
    path, _ = checkpoint("qwen3_next")
    with caplog.at_level(logging.INFO, logger="hearth.engine"):
        llm = LLM(path, kv_cache_bytes=4 << 20, checkpoint_bytes=1 << 20, max_num_seqs=2)
    plan = llm.engine.memory
    params = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    assert plan.weights >= params // 2 and plan.kv_cache <= 4 << 20 and plan.kv_tokens > 0
    assert plan.recurrent_states > 0 and plan.checkpoints == 1 << 20
    assert any(r.getMessage().startswith("memory:") for r in caplog.records)
    default = LLM(path, kv_cache_bytes=4 << 20, max_num_seqs=2)
    assert default.engine.memory.checkpoints == 1 << 30  # the default budget, counted whether or not it fills


def test_an_attached_shared_pool_is_not_counted_against_free_memory() -> None:
    plan = MemoryPlan(weights=4 << 30, kv_cache=1 << 30, kv_tokens=1000, available=2 << 30, resident=3 << 30)
    assert plan.warning() is None and "3.0 GiB of it shared" in plan.describe()
