"""LongRoPE (Phi's ``rope_type: longrope``) against transformers' own frequencies: the short factors
up to ``original_max_position_embeddings``, the long ones from there on, each with its scale."""

from __future__ import annotations

import math

import pytest
import torch

from hearth.engine.config import ModelConfig, parse_rope
from hearth.engine.layers.rope import RotaryEmbedding

ORIGINAL, LONGEST, HEAD_DIM, THETA = 64, 1024, 16, 10000.0
SHORT = [1.0 + i / 8 for i in range(HEAD_DIM // 2)]
LONG = [2.0 + i for i in range(HEAD_DIM // 2)]


def _params(mscales: bool) -> dict:
    params = {"rope_type": "longrope", "rope_theta": THETA, "short_factor": SHORT, "long_factor": LONG,
              "original_max_position_embeddings": ORIGINAL}
    return params | ({"short_mscale": 1.1, "long_mscale": 1.3} if mscales else {})


def _hearth(params: dict) -> RotaryEmbedding:
    rope = parse_rope({"rope_parameters": params})
    cfg = ModelConfig(architecture="x", vocab_size=8, hidden_size=4 * HEAD_DIM, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope=rope,
                      max_position_embeddings=LONGEST, hidden_act="silu", tie_word_embeddings=False,
                      dtype=torch.float32, num_experts=2, top_k=1, moe_intermediate_size=4, moe_layers=(True,))
    return RotaryEmbedding(cfg)


def _reference(params: dict, long: bool) -> tuple[torch.Tensor, float]:
    """transformers' LongRoPE frequencies (a sequence past the original context takes the long ones)
    and its scale: Phi-3.5-MoE's mscale where given, else the one transformers derives."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Phi3Config(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=LONGEST,
                        original_max_position_embeddings=ORIGINAL,
                        rope_parameters={k: v for k, v in params.items() if not k.endswith("mscale")})
    inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=ORIGINAL + 1 if long else None)
    return inv_freq, params.get("long_mscale" if long else "short_mscale", scale)


@pytest.mark.parametrize("mscales", [False, True], ids=["derived-scale", "phimoe-mscales"])
def test_longrope_switches_to_the_long_factors_at_the_original_context(mscales: bool) -> None:
    params = _params(mscales)
    positions = torch.tensor([0, 5, ORIGINAL - 1, ORIGINAL, ORIGINAL + 7, LONGEST - 1])
    cos, sin = _hearth(params)(positions, torch.float32)
    for row, pos in enumerate(positions.tolist()):
        inv_freq, scale = _reference(params, long=pos >= ORIGINAL)
        emb = torch.cat((pos * inv_freq, pos * inv_freq))
        torch.testing.assert_close(cos[row], emb.cos() * scale, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin[row], emb.sin() * scale, rtol=1e-6, atol=1e-6)
    if not mscales:  # (the derived scale itself, as LongRoPE's paper gives it)
        expected = math.sqrt(1 + math.log(LONGEST / ORIGINAL) / math.log(ORIGINAL))
        assert _reference(params, long=False)[1] == pytest.approx(expected)
