"""JetMoE (``JetMoeForCausalLM``): a mixture of attention heads and a mixture of feed-forwards. The
attention's experts are pairs of query and output projections: each token's top-k experts (a softmax
over the top-k router logits) each make ``num_key_value_heads`` query heads over the one shared
key/value projection (``kv_proj``), and their outputs are weighted and summed, plus a bias. The
feed-forward's experts are SwiGLU experts (gate rows first in ``input_linear``) routed the same way,
plus a bias. The layer norms' eps is transformers' fixed 1e-6; the final norm's is the config's."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.attention import Attention
from hearth.engine.layers.batch import LayerContext, StaticBatch
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.moe import MoEBlock, TopKThenScoreRouter
from hearth.engine.layers.norm import RMSNorm
from hearth.engine.models.base import ModelFamily, decoder_fields, renaming
from hearth.engine.models.decoder import DecoderLayer, MoECausalLM
from hearth.engine.ops import linear

LAYER_EPS = 1e-6  # (JetMoeRMSNorm(hidden_size) in every decoder layer: the class default)


@dataclass(frozen=True, kw_only=True)
class JetMoeConfig(ModelConfig):
    pass


class MixtureOfAttention(Attention):
    """Attention whose query and output projections are routed experts ([E, kv_heads * D, H] and
    [E, H, kv_heads * D]); a token's k experts give k * kv_heads query heads, each group of k sharing
    one KV head (ordered by KV head for the grouped attention, then back by expert)."""

    checkpoint_name = "self_attention"
    fixed_shape_refusal = "mixture of attention heads"  # (its experts are chosen on the host per step)

    def __init__(self, layer_idx: int, hidden: int, num_experts: int, top_k: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        nn.Module.__init__(self)  # (none of Attention's projections: the experts hold q and o)
        self.layer_idx, self.num_heads, self.num_kv_heads = layer_idx, top_k * kv_heads, kv_heads
        self.head_dim = head_dim
        self.window, self.scale, self.top_k, width = None, head_dim**-0.5, top_k, kv_heads * head_dim
        self.kv_proj = Projection(hidden, 2 * width, False, dtype)
        self.experts = nn.Module()
        self.experts.input_linear = nn.Module()
        self.experts.input_linear.weight = nn.Parameter(torch.empty(num_experts, width, hidden, dtype=dtype),
                                                        requires_grad=False)
        self.experts.output_linear = nn.Module()
        self.experts.output_linear.weight = nn.Parameter(torch.empty(num_experts, hidden, width, dtype=dtype),
                                                         requires_grad=False)
        self.experts.bias = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        self.experts.router = nn.Module()
        self.experts.router.layer = TopKThenScoreRouter(hidden, num_experts, top_k, dtype, scoring="softmax",
                                                        normalize=False)
        self.q_norm = self.k_norm = self.query_scale = None
        self.interleaved_rope, self.use_rope, self.rotate_in_fp32, self.norm_after_rope = False, True, False, False

    def adopt_block_weights(self) -> None:
        """No q/k/v to fuse: ``kv_proj`` is one projection already."""

    @staticmethod
    def _per_expert(x: torch.Tensor, rows: list[tuple[int, torch.Tensor]], weight: torch.Tensor,
                    out: int) -> torch.Tensor:
        """x [T, k, in] through each (expert, its [T, k] rows) of ``weight`` [E, out, in] -> [T, k, out]."""
        y = x.new_empty(*x.shape[:2], out)
        for e, chosen in rows:
            y[chosen] = linear(x[chosen], weight[e])
        return y

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:  # x: [T, H]
        t, batch, d, kvh, k = x.shape[0], ctx.batch, self.head_dim, self.num_kv_heads, self.top_k
        ids, gates = self.experts.router.layer(x)  # [T, k]
        rows = [(e, ids == e) for e in ids.unique().tolist()]  # (found once: q and o share them)
        q = self._per_expert(x[:, None].expand(t, k, -1), rows, self.experts.input_linear.weight, kvh * d)
        key, value = linear(x, self.kv_proj.weight).view(t, 2, kvh, d).unbind(1)
        q, key = self.rotate(q.view(t, k * kvh, d), key, ctx.rope, x.dtype)
        ctx.kv.keys[self.layer_idx].index_copy_(0, batch.slot_mapping, key)
        ctx.kv.values[self.layer_idx].index_copy_(0, batch.slot_mapping, value)
        q = q.view(t, k, kvh, d).transpose(1, 2).reshape(t, kvh * k, d)  # (each KV head's k queries together)
        attend = self.attend_static if isinstance(batch, StaticBatch) else self.attend
        out = attend(q, batch, ctx.kv.keys[self.layer_idx], ctx.kv.values[self.layer_idx])
        out = out.view(t, kvh, k, d).transpose(1, 2).reshape(t, k, kvh * d)  # back by expert
        o = self._per_expert(out, rows, self.experts.output_linear.weight, x.shape[1]) * gates[..., None]
        return o.sum(dim=1) + self.experts.bias


class BiasedMoEBlock(MoEBlock):
    """The routed experts plus a bias on their sum (JetMoE's feed-forward)."""

    def __init__(self, *args, hidden: int, dtype: torch.dtype, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bias = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, ctx: LayerContext | None = None) -> torch.Tensor:
        return super().forward(x, ctx) + self.bias


def parse_config(hf: Any, model_dir: Path, dtype: torch.dtype) -> JetMoeConfig:
    if not hasattr(hf, "hidden_act"):  # (JetMoE names it activation_function)
        hf.hidden_act = hf.activation_function
    heads = hf.num_experts_per_tok * hf.num_key_value_heads  # (the query heads a token attends with)
    fields = decoder_fields(hf, model_dir, dtype) | {"num_heads": heads, "head_dim": hf.kv_channels}
    return JetMoeConfig(
        architecture="JetMoeForCausalLM", **fields, num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok, moe_intermediate_size=hf.intermediate_size,
        intermediate_size=hf.intermediate_size, moe_layers=(True,) * hf.num_hidden_layers,
    )


def build(cfg: JetMoeConfig, experts: ExpertBackend) -> MoECausalLM:
    h, dt = cfg.hidden_size, cfg.dtype
    norm = partial(RMSNorm, h, LAYER_EPS, dt)

    def layer(i: int) -> DecoderLayer:
        attn = MixtureOfAttention(i, h, cfg.num_experts, cfg.top_k, cfg.num_kv_heads, cfg.head_dim, dt)
        router = TopKThenScoreRouter(h, cfg.num_experts, cfg.top_k, dt, scoring="softmax", normalize=False)
        return DecoderLayer(attn, BiasedMoEBlock(i, cfg.num_experts, router, experts, hidden=h, dtype=dt),
                            norm(), norm())

    return MoECausalLM(cfg, [layer(i) for i in range(cfg.num_layers)], RMSNorm(h, cfg.rms_norm_eps, dt))


map_name = renaming(((".mlp.router.layer.", ".mlp.gate."), (".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
                     (".mlp.output_linear.weight", ".mlp.experts.down_proj")))


FAMILY = ModelFamily(
    "jetmoe",
    ("JetMoeForCausalLM",),
    parse_config,
    build,
    map_name,
    (("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("kv_channels",), ("num_key_value_heads",),
     ("num_local_experts",), ("num_experts_per_tok",)),
)
