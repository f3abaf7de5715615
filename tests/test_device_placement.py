"""The executor device: the dense part moves to it keeping what aliases what, and a device the
machine lacks is a clear error. (The GPU run itself is in bench/gpu_check.py.)"""

from __future__ import annotations

import pytest
import torch

from hearth.config import ConfigError
from hearth.engine import LLM
from hearth.engine.executor.device_placement import move_module, resolve_device
from hearth.engine.executor.memory_plan import plan_vram
from tests.test_hierarchy import OVERRIDES


def test_move_keeps_views_ties_and_attributes(checkpoint) -> None:
    """Moved to the meta device (shapes and storages, no data): the fused q/k/v matrix and its three
    projection views stay one storage at the same offsets, tied embeddings stay one tensor, and a
    parameter's attributes survive."""
    path, _ = checkpoint("qwen3_moe", tie_word_embeddings=True, **OVERRIDES)
    llm = LLM(path, expert_device="none")
    model = llm.engine.runner.model
    attn = model.model.layers[0].self_attn
    offsets = [p.weight.storage_offset() for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    model.lm_head.weight.block_format = "marker"
    before = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    move_module(model, "meta")
    attn = model.model.layers[0].self_attn
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert {name: tuple(t.shape) for name, t in model.state_dict().items()} == before
    fused = attn.qkv_weight.untyped_storage()._cdata
    assert all(p.weight.untyped_storage()._cdata == fused for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert [p.weight.storage_offset() for p in (attn.q_proj, attn.k_proj, attn.v_proj)] == offsets
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.block_format == "marker" and isinstance(model.lm_head.weight, torch.nn.Parameter)
    llm.close()


def test_device_setting() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")


def test_engine_on_the_cpu_device_is_the_cpu_engine(checkpoint) -> None:
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, device="cpu", expert_device="none")
    assert llm.engine.device == torch.device("cpu") and llm.engine.runner.kv.device == torch.device("cpu")
    llm.close()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            LLM(path, device="cuda", expert_device="none")


def test_vram_plan() -> None:
    gib = 1 << 30
    plan = plan_vram(free=24 * gib, weights=2 * gib, kv_bytes_per_token=1 << 16, kv_tokens=32768,
                     expert_bytes=gib // 64, total_experts=10_000)
    assert plan.kv_cache == 2 * gib and plan.fits()
    assert plan.cache_slots == int(20 * gib * 0.8) // (gib // 64) and plan.cache_bytes == plan.cache_slots * (gib // 64)
    assert plan_vram(8 * gib, 2 * gib, 1 << 16, 32768, gib // 64, 100).cache_slots == 100  # no more than there are
    tight = plan_vram(3 * gib, 2 * gib, 1 << 16, 32768, gib // 64, 100)
    assert not tight.fits() and tight.cache_slots == 0
