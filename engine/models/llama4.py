"""Llama 4 (``Llama4ForCausalLM``, and the text model of ``Llama4ForConditionalGeneration``: Scout,
Maverick). Rotary layers turn interleaved pairs in fp32 (as a complex product), then take a weightless
L2 norm of q and k (``use_qk_norm``), and attend within chunks of ``attention_chunk_size`` tokens;
the layers without rotary (``no_rope_layers`` 0) attend globally, their queries scaled by position
(``attn_temperature_tuning``: 1 + attn_scale * log1p(floor((p + 1) / floor_scale))). MoE layers
(``moe_layers``) route by the sigmoid of the top-k logits and scale each expert's *input* by it, beside
a shared expert; the other layers are dense MLPs ``intermediate_size_mlp`` wide. Experts are stored
fused and transposed ([E, H, 2I], [E, I, H])."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention, ChunkedAttention
from hearth.engine.layers.batch import LayerContext
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import MoEBlock
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import ModelFamily, decoder_fields
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.ops import linear


@dataclass(frozen=True, kw_only=True)
class Llama4Config(ModelConfig):
    rope_layers: tuple[bool, ...]
    chunk: int | None
    qk_norm: bool
    temperature: tuple[float, float] | None  # (floor_scale, attn_scale) where tuned
    attention_bias: bool


class L2Norm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps)`` in fp32, no weight (Llama 4's q/k norm)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def temperature_scale(floor_scale: float, attn_scale: float, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q [T, heads, D] times 1 + attn_scale * log1p(floor((p + 1) / floor_scale)), in fp32, rounded once."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # [T]
    return (q * scales[:, None, None]).to(q.dtype)


class SigmoidTop1Router(nn.Module):
    """The top-k logits, each expert's weight the sigmoid of its logit (in fp32, rounded to the model dtype)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(linear(x, self.weight), self.top_k, dim=-1)
        return ids, torch.sigmoid(top.float()).to(top.dtype)


class InputScaledMoEBlock(MoEBlock):
    """Llama 4's MoE: each chosen expert runs on the input times its weight, and the outputs add up
    (in expert order) beside the shared expert. A token's k experts go to the backend as k rows of
    weight one."""

    def forward(self, x: torch.Tensor, ctx: LayerContext | None = None) -> torch.Tensor:
        ids, weights = self.gate(x)  # [T, k]
        ids, order = ids.sort(dim=-1)
        weights = weights.gather(-1, order)
        t, k = ids.shape
        rows = (x[:, None, :] * weights[..., None]).reshape(t * k, -1)  # [T*k, H]
        ones = torch.ones(t * k, 1, dtype=x.dtype, device=x.device)
        out = self.backend.forward(rows, ids.reshape(-1, 1) + self.first_expert_id, ones,
                                   ctx.batch.experts if ctx else None)
        routed = out.view(t, k, -1).sum(dim=1) if k > 1 else out
        return self.shared_expert(x) + routed


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> Llama4Config:
    text = getattr(hf, "text_config", None) or hf
    n = text.num_hidden_layers
    rope_layers = tuple(bool(flag) for flag in text.no_rope_layers)
    kinds = text.layer_types or ["chunked_attention" if r else "full_attention" for r in rope_layers]
    tuned = bool(getattr(text, "attn_temperature_tuning", False))
    return Llama4Config(
        architecture="Llama4ForCausalLM", **decoder_fields(text, model_dir, dtype),
        num_experts=text.num_local_experts, top_k=text.num_experts_per_tok,
        moe_intermediate_size=text.intermediate_size, intermediate_size=text.intermediate_size_mlp,
        moe_layers=tuple(i in set(text.moe_layers) for i in range(n)), rope_layers=rope_layers,
        chunk=text.attention_chunk_size if "chunked_attention" in kinds else None,
        qk_norm=bool(text.use_qk_norm), attention_bias=bool(getattr(text, "attention_bias", False)),
        temperature=(float(text.floor_scale), float(text.attn_scale)) if tuned else None,
        experts_transposed=True, rope_in_fp32=True,
    )


def build(cfg: Llama4Config, experts: ExpertBackend) -> MoECausalLM:
    h, dt = cfg.hidden_size, cfg.dtype
    norm = partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=dt)

    def attention(i: int) -> Attention:
        rope = cfg.rope_layers[i]
        attn = ChunkedAttention(i, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dt, bias=cfg.attention_bias,
                                out_bias=cfg.attention_bias, chunk=cfg.chunk if rope else None,
                                qk_norm=(lambda width: L2Norm(cfg.rms_norm_eps)) if rope and cfg.qk_norm else None)
        attn.use_rope, attn.interleaved_rope, attn.norm_after_rope = rope, rope, True
        if not rope and cfg.temperature is not None:
            attn.query_scale = partial(temperature_scale, *cfg.temperature)
        return attn

    def feed_forward(i: int) -> nn.Module:
        if not cfg.moe_layers[i]:
            return GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, dt)
        router = SigmoidTop1Router(h, cfg.num_experts, cfg.top_k, dt)
        shared = GatedMLP(h, cfg.moe_intermediate_size, cfg.hidden_act, dt)
        return InputScaledMoEBlock(i, cfg.num_experts, router, experts, shared)

    layers = [DecoderLayer(attention(i), feed_forward(i), norm(h), norm(h)) for i in range(cfg.num_layers)]
    return MoECausalLM(cfg, layers, norm(h))


_NAMES = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."))


def map_name(name: str) -> str:
    """transformers' names (``feed_forward``, ``router``), and the multimodal checkpoint's language
    model (``language_model.``; its vision parts are not used)."""
    if name.startswith(("vision_model.", "multi_modal_projector.")):
        return ""
    name = name.removeprefix("language_model.")
    for old, new in _NAMES:
        name = name.replace(old, new)
    return name


FAMILY = ModelFamily(
    "llama4",
    ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
    parse_config,
    build,
    map_name,
)
