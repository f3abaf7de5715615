"""What ``hearth convert --quant`` writes per family, as llama.cpp's converter writes it: the GGUF
architecture, the metadata beyond the common keys, the special tokens it names, and the tensors it
reshapes or leaves out. Metadata are a mapping from a ``gguf.GGUFWriter`` ``add_*`` method's name
(without ``add_``) to its value, so that a family replaces a common key rather than adding it twice;
a name starting with ``.`` is a key under the architecture's prefix, written as it is (an array)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import torch

from hearth.engine.checkpoint.common import LAYER
from hearth.engine.checkpoint.gguf_families import ZERO_CENTRED, reorder_value_heads
from hearth.engine.checkpoint.gguf_write_common import (
    GATING,
    ConvertError,
    Fields,
    WriteFamily,
    common_fields,
    deepseek_router,
    nextn_layers,
    rope_of,
)
from hearth.engine.checkpoint.gguf_write_latent import (
    deepseek2,
    deepseek3,
    glm4_moe_lite,
    kimi_linear,
    kimi_linear_tensors,
    sparse_deepseek,
    split_kv_b,
)
from hearth.engine.checkpoint.gguf_write_plain import dbrx, dbrx_config, dbrx_experts, hy_v3, laguna, mellum
from hearth.engine.config import config_architectures
from hearth.engine.ops import deinterleave

__all__ = ["WRITE_FAMILIES", "ConvertError", "WriteFamily", "common_fields", "layer_of", "nextn_layers"]


def _minimax_m2(cfg: dict, fields: Fields) -> None:
    # Its experts are intermediate_size wide, and its routing is sigmoid, which llama.cpp must be told.
    fields["expert_feed_forward_length"] = cfg["intermediate_size"]
    fields["expert_gating_func"] = GATING["sigmoid"]


def _glm4_moe(cfg: dict, fields: Fields) -> None:
    """GLM-4.5/4.6/4.7: sigmoid routing, the MTP layers counted in ``block_count``."""
    deepseek_router(cfg, fields)
    fields["expert_gating_func"] = GATING["sigmoid"]
    if cfg.get("norm_topk_prob") is not None:
        fields["expert_weights_norm"] = bool(cfg["norm_topk_prob"])
    if "num_nextn_predict_layers" in cfg:
        fields["block_count"] += nextn_layers(cfg)
        fields["nextn_predict_layers"] = nextn_layers(cfg)
    fields.pop("vocab_size")


def _dots1(cfg: dict, fields: Fields) -> None:
    """dots.llm1: DeepSeek-V3's router on Qwen's layout; sigmoid gating written whatever the config
    says (transformers' class routes by sigmoid, and llama.cpp refuses a dots1 file without it)."""
    deepseek_router(cfg, fields)
    fields.update(expert_weights_norm=bool(cfg.get("norm_topk_prob")), expert_gating_func=GATING["sigmoid"])
    fields.pop("vocab_size")


def _ernie4_5_moe(cfg: dict, fields: Fields) -> None:
    """ERNIE-4.5 MoE: its experts and layers under the original config's names; the shared experts'
    width written as the converter computes it (``intermediate_size`` over the KV heads)."""
    fields.update(interleave_moe_layer_step=cfg.get("moe_layer_interval") or 1,
                  leading_dense_block_count=cfg.get("moe_layer_start_index") or 0)
    shared = cfg.get("moe_num_shared_experts")
    if shared is not None:
        fields["expert_shared_count"] = shared
        if shared > 0:
            fields["expert_shared_feed_forward_length"] = cfg["intermediate_size"] // cfg["num_key_value_heads"]
    fields.pop("vocab_size")


def _exaone_moe(cfg: dict, fields: Fields) -> None:
    """EXAONE-MoE: the window and its per-layer pattern, the shared experts, the router's groups and
    its weights' scale and normalisation, the leading dense layers, no rope scaling."""
    if cfg.get("sliding_window") is not None:
        fields["sliding_window"] = cfg["sliding_window"]
        if cfg.get("layer_types"):
            fields["sliding_window_pattern"] = [kind == "sliding_attention" for kind in cfg["layer_types"]]
    for key, name in (("n_group", "expert_group_count"), ("topk_group", "expert_group_used_count")):
        if cfg.get(key) is not None:
            fields[name] = cfg[key]
    shared = cfg["num_shared_experts"]
    fields.update(expert_feed_forward_length=cfg["moe_intermediate_size"], expert_shared_count=shared,
                  expert_shared_feed_forward_length=cfg["moe_intermediate_size"] * shared,
                  expert_weights_scale=cfg["routed_scaling_factor"], expert_weights_norm=cfg["norm_topk_prob"],
                  leading_dense_block_count=cfg.get("first_k_dense_replace", cfg.get("first_last_k_dense_replace", 0)),
                  nextn_predict_layers=nextn_layers(cfg), rope_scaling_type="none",
                  # (the converter writes no gating function, and llama.cpp 0.3.36 refuses a file without one)
                  expert_gating_func=GATING["sigmoid"])


def _lfm2_moe(cfg: dict, fields: Fields) -> None:
    """LFM2-MoE: KV heads per layer (none on its convolution layers), the convolution's taps, the
    experts' width, leading dense layers, sigmoid gating."""
    fields.update(head_count_kv=[cfg["num_key_value_heads"] if kind == "full_attention" else 0
                                 for kind in cfg["layer_types"]],
                  expert_feed_forward_length=cfg["moe_intermediate_size"],
                  leading_dense_block_count=cfg["num_dense_layers"], expert_gating_func=GATING["sigmoid"],
                  shortconv_l_cache=cfg["conv_L_cache"])


def _squeezed_conv(target: str, t: torch.Tensor, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """LFM2's convolution weights [H, 1, L] written [H, L], as the converter writes them."""
    yield target, t.squeeze(1) if ".shortconv.conv." in target else t


def _granitehybrid(cfg: dict, fields: Fields) -> None:
    """Granite 4: Granite MoE's keys, the Mamba-2 shapes under ``ssm.*`` (the heads as the time-step
    rank), KV heads only on the attention layers, rotary flagged by ``rope.scaling.finetuned`` (a
    model without it written with a 2^20 context, as the converter writes it)."""
    _granitemoe(cfg, fields)
    kinds, heads = cfg["layer_types"], cfg["mamba_n_heads"]
    use_rope = cfg.get("position_embedding_type") == "rope" or "mamba" not in kinds and "linear_attention" not in kinds
    fields.update(ssm_conv_kernel=cfg["mamba_d_conv"], ssm_state_size=cfg["mamba_d_state"],
                  ssm_group_count=cfg["mamba_n_groups"], ssm_inner_size=heads * cfg["mamba_d_head"],
                  ssm_time_step_rank=heads, rope_scaling_finetuned=use_rope,
                  head_count_kv=[cfg["num_key_value_heads"] if kind in ("attention", "full_attention") else 0
                                 for kind in kinds])
    if not use_rope:
        fields["context_length"] = 2**20


def _mamba2_tensors(target: str, t: torch.Tensor, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Mamba-2's parameters as the converter stores them: A as -exp(A_log) and D as [heads, 1], the
    gated norm as [groups, inner / groups], the convolution [C, K]."""
    if target.endswith(".ssm_a"):
        t = -torch.exp(t.float()).reshape(-1, 1)
    elif target.endswith(".ssm_d"):
        t = t.reshape(-1, 1)
    elif target.endswith(".ssm_norm.weight"):
        t = t.reshape(cfg["mamba_n_groups"], -1)
    elif ".ssm_conv1d.weight" in target:
        t = t.squeeze(1)
    yield target, t


def _afmoe(cfg: dict, fields: Fields) -> None:
    """AfMoE: shared experts, the experts' width, leading dense layers, the routed weights' scale (and
    normalisation where the config names it), the window. llama.cpp scales the embeddings by muP's
    sqrt(hidden) whatever the file says, so a checkpoint without muP is refused."""
    if not cfg.get("mup_enabled"):
        raise ConvertError("AfmoeForCausalLM with mup_enabled=false: llama.cpp's afmoe always scales the "
                           "embeddings by sqrt(hidden_size), and a GGUF file has no key to say otherwise")
    for key, name in (("num_shared_experts", "expert_shared_count"), ("moe_intermediate_size",
                      "expert_feed_forward_length"), ("num_dense_layers", "leading_dense_block_count"),
                      ("route_norm", "expert_weights_norm"), ("route_scale", "expert_weights_scale"),
                      ("sliding_window", "sliding_window")):
        if cfg.get(key) is not None:
            fields[name] = cfg[key]


def _cohere2moe(cfg: dict, fields: Fields) -> None:
    """Cohere2-MoE: the logit scale, the window and its pattern, the experts' width (the dense layers'
    is ``feed_forward_length``), the leading dense layers, the weights' normalisation, shared experts.
    llama.cpp averages shared experts in, drops biases and turns the rotary on every leading dense
    layer: a checkpoint that differs is refused."""
    dense_kinds = cfg.get("mlp_layer_types") or ["sparse"] * cfg["num_hidden_layers"]
    dense = next((i for i, kind in enumerate(dense_kinds) if kind != "dense"), len(dense_kinds))
    if cfg.get("num_shared_experts") and cfg.get("shared_expert_combination_strategy", "average") != "average":
        raise ConvertError("Cohere2MoeForCausalLM summing its shared experts: llama.cpp's cohere2moe averages them")
    if cfg.get("attention_bias"):
        raise ConvertError("Cohere2MoeForCausalLM with attention biases: llama.cpp's cohere2moe has none")
    if dense and cfg.get("prefix_dense_sliding_window_pattern", 1) != 1:
        raise ConvertError("Cohere2MoeForCausalLM with prefix_dense_sliding_window_pattern != 1: llama.cpp's "
                           "cohere2moe turns the rotary on every leading dense layer")
    fields.update(logit_scale=cfg["logit_scale"], sliding_window=cfg["sliding_window"],
                  sliding_window_pattern=[kind == "sliding_attention" for kind in cfg["layer_types"]],
                  expert_feed_forward_length=cfg["intermediate_size"], leading_dense_block_count=dense,
                  expert_weights_norm=cfg.get("norm_topk_prob", False), rope_dimension_count=cfg["head_dim"],
                  rope_scaling_type="none")
    if cfg.get("prefix_dense_intermediate_size"):
        fields["feed_forward_length"] = cfg["prefix_dense_intermediate_size"]
    if cfg.get("num_shared_experts"):
        fields.update(expert_shared_count=cfg["num_shared_experts"],
                      expert_shared_feed_forward_length=cfg["intermediate_size"] * cfg["num_shared_experts"])


def _llama4(cfg: dict, fields: Fields) -> None:
    """Llama 4: the dense layers' width as ``feed_forward_length``, the experts' as the expert one,
    the MoE layers' step; a window of 0 where every layer is global. llama.cpp holds the chunk size,
    the NoPE step and the query scaling as constants: a checkpoint with other values is refused."""
    kinds = cfg.get("layer_types") or []
    if kinds and all(kind == "full_attention" for kind in kinds):
        fields["sliding_window"] = 0
    else:
        wanted = {"attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1, "no_rope_layer_interval": 4}
        off = {k: cfg.get(k) for k, v in wanted.items() if cfg.get(k, v) != v}
        if off or not cfg.get("attn_temperature_tuning", True):
            raise ConvertError(f"Llama4ForCausalLM with {off or 'attn_temperature_tuning=false'}: llama.cpp's llama4 "
                               f"holds {wanted} and temperature tuning as constants")
    fields.update(feed_forward_length=cfg["intermediate_size_mlp"], expert_feed_forward_length=cfg["intermediate_size"],
                  interleave_moe_layer_step=cfg.get("interleave_moe_layer_step", 1))


def _llama4_tensors(tensors: dict, cfg: dict) -> dict:
    """Llama 4's fused experts in the standard orientation ([E, 2I, H], [E, H, I]), and llama3-style
    rotary scaling as the per-channel divisors the converter writes (``rope_freqs``)."""
    out = {name: (lambda load=load: load().transpose(1, 2).contiguous()) if name.endswith(
        ("experts.gate_up_proj", "experts.down_proj")) else load for name, load in tensors.items()}
    rope = rope_of(cfg)
    if rope.get("rope_type") == "llama3":
        out = {"rope.freqs": lambda: llama3_divisors(rope, cfg["head_dim"]), **out}
    return out


def llama3_divisors(rope: dict, dim: int) -> torch.Tensor:
    """llama3 scaling as divisors of the base frequencies (1 for short wavelengths, ``factor`` for long
    ones, a blend between), as llama.cpp's converter computes them."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:  # (0-d fp32 tensors: the converter's arithmetic, to the bit)
        wavelen = 2 * math.pi / freq
        smooth = (old / wavelen - low) / (high - low)
        out.append(1.0 if wavelen < old / high else factor if wavelen > old / low else
                   float(1 / ((1 - smooth) / factor + smooth)))
    return torch.tensor(out, dtype=torch.float32)


def _granitemoe(cfg: dict, fields: Fields) -> None:
    """Granite MoE: its four scalars under the converter's names (each only where set), the shared
    expert's width."""
    for key, name in (("attention_multiplier", "attention_scale"), ("embedding_multiplier", "embedding_scale"),
                      ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale")):
        if cfg.get(key):
            fields[name] = cfg[key]
    if cfg.get("shared_intermediate_size"):
        fields["expert_shared_feed_forward_length"] = cfg["shared_intermediate_size"]


_GRANITE_SHARED = re.compile(r"^(model\.layers\.\d+)\.shared_mlp\.input_linear\.weight$")


def _granite_shared(tensors: dict, cfg: dict) -> dict:
    """The shared expert's fused gate/up rows as its gate and up (the converter splits them too)."""
    out = {}
    for name, load in tensors.items():
        m = _GRANITE_SHARED.match(name)
        if m is None:
            out[name] = load
            continue
        half = cfg["shared_intermediate_size"]
        for i, part in enumerate(("gate_proj", "up_proj")):
            out[f"{m.group(1)}.mlp.shared_expert.{part}.weight"] = \
                lambda load=load, lo=i * half, hi=(i + 1) * half: load()[lo:hi].contiguous()
    return out


def _decoder_layers_only(name: str, cfg: dict) -> bool:
    """DeepSeek's converter leaves the MTP layers (after the decoder's) out."""
    layer = layer_of(name)
    return layer is None or layer < cfg["num_hidden_layers"]


def _no_ernie_mtp(name: str, cfg: dict) -> bool:
    """ERNIE's converter leaves its multi-token-prediction parts (``model.mtp_*``) out."""
    return not name.startswith("model.mtp_")


def _gpt_oss(cfg: dict, fields: Fields) -> None:
    """GPT-OSS: experts ``intermediate_size`` wide, the sliding window (every other layer's)."""
    fields.update(expert_feed_forward_length=cfg["intermediate_size"], sliding_window=cfg["sliding_window"])
    fields.pop("vocab_size")


_GPT_OSS_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?$")


def _gpt_oss_experts(tensors: dict, cfg: dict) -> dict:
    """GPT-OSS's fused experts as the writer's standard ones: ``gate_up_proj`` [E, H, 2I] with gate
    and up interleaved column by column -> [E, 2I, H] gate rows then up; ``down_proj`` [E, I, H] ->
    [E, H, I]; their biases as the stacked experts' ``.bias`` (gate and up de-interleaved)."""
    packed = [name for name in tensors if name.endswith(("_blocks", "_scales"))]
    if packed:
        raise ConvertError(f"this checkpoint ships its experts in MXFP4 ({packed[0]}, …), which GGUF writing "
                           "does not repack yet: serve it as it is, or convert its bf16 form")
    out = {}
    for name, load in tensors.items():
        m = _GPT_OSS_EXPERTS.match(name)
        if m is None:
            out[name] = load
            continue
        prefix, part, bias = m.groups()
        if part == "down_proj":
            out[prefix + ("down_proj.bias" if bias else "down_proj")] = (
                load if bias else (lambda load=load: load().transpose(1, 2).contiguous()))
        elif bias:
            out[prefix + "gate_proj.bias"] = lambda load=load: load()[:, 0::2].contiguous()
            out[prefix + "up_proj.bias"] = lambda load=load: load()[:, 1::2].contiguous()
        else:
            out[prefix + "gate_up_proj"] = lambda load=load: deinterleave(load().transpose(1, 2), dim=1).contiguous()
    return out


def _hybrid(cfg: dict, fields: Fields) -> None:
    """Qwen3-Next / Qwen3.5: the DeltaNet layers' shapes under ``ssm.*``, which layers attend (every
    ``full_attention_interval``-th), and Qwen3.5's rotary sections (interleaved MRoPE)."""
    fields.update(ssm_conv_kernel=cfg["linear_conv_kernel_dim"], ssm_state_size=cfg["linear_key_head_dim"],
                  ssm_group_count=cfg["linear_num_key_heads"], ssm_time_step_rank=cfg["linear_num_value_heads"],
                  ssm_inner_size=cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"],
                  full_attention_interval=cfg.get("full_attention_interval", 4))
    if cfg.get("layer_types"):  # (a key the gguf package has no method for: written as a raw array)
        fields[".attention.recurrent_layers"] = [kind == "linear_attention" for kind in cfg["layer_types"]]
    if config_architectures(cfg) == ["Qwen3_5MoeForCausalLM"]:
        sections = list(rope_of(cfg).get("mrope_section") or [11, 11, 10, 0])[:4]
        fields["rope_dimension_sections"] = sections + [0] * (4 - len(sections))  # (as the converter pads them)
    fields.pop("vocab_size")


def _hybrid_tensors(tensors: dict, cfg: dict) -> dict:
    """The hybrids' tensors as llama.cpp's converter stores them: zero-centred RMSNorm weights plus
    one, ``A_log`` as ``-exp(A_log)``, ``dt_bias`` as the time-step projection's bias, the depthwise
    convolution [C, 1, K] as [C, K], Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, v, z) as
    ``in_proj_qkv`` and ``in_proj_z`` (all heads' q, then k, then v; z), and, for Qwen3.5 with more
    value than key heads, the value heads reordered from grouped by key head to tiled."""
    tile = config_architectures(cfg) == ["Qwen3_5MoeForCausalLM"] and \
        cfg["linear_num_value_heads"] != cfg["linear_num_key_heads"]
    out = {}
    for name, load in tensors.items():
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            base, part = name.removesuffix("in_proj_qkvz.weight"), _split_once(load, cfg)
            out[base + "in_proj_qkv.weight"] = lambda part=part: part(0)
            out[base + "in_proj_z.weight"] = lambda part=part: part(1)
            continue
        renamed = name.removesuffix(".dt_bias") + ".dt_proj.bias" if name.endswith(".dt_bias") else name
        out[renamed] = lambda name=name, load=load: _hybrid_values(name, load(), cfg, tile)
    return out


def _hybrid_values(name: str, t: torch.Tensor, cfg: dict, tile: bool) -> torch.Tensor:
    if ".linear_attn." in name:
        if "conv1d" in name:
            t = t.squeeze(1)  # [C, 1, K] -> [C, K]
        if tile:
            t = _tiled(name, t, cfg)
        if name.endswith(".A_log"):
            t = -torch.exp(t.float())
    elif name.endswith(ZERO_CENTRED):
        t = t.float() + 1
    return t


def _split_once(load: Callable[[], torch.Tensor], cfg: dict) -> Callable[[int], torch.Tensor]:
    """part(i): part i of ``in_proj_qkvz`` split (0: qkv, 1: z), the tensor read once and each part
    let go when taken (the writer takes both, one after the other)."""
    held: dict[int, torch.Tensor] = {}

    def part(i: int) -> torch.Tensor:
        if not held:
            held.update(enumerate(_split_qkvz(load(), cfg)))
        return held.pop(i)

    return part


def _split_qkvz(t: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's ``in_proj_qkvz`` [keys * (2 dk + 2 r dv), H] -> qkv [keys * (2 dk + r dv), H]
    (every head's q, then k, then v) and z [keys * r dv, H]."""
    keys, dk, dv = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    rv = cfg["linear_num_value_heads"] // keys * dv
    q, k, v, z = t.reshape(keys, 2 * dk + 2 * rv, t.shape[-1]).split([dk, dk, rv, rv], dim=1)
    flat = [part.reshape(-1, t.shape[-1]) for part in (q, k, v, z)]
    return torch.cat(flat[:3]).contiguous(), flat[3].contiguous()


def _tiled(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """A Qwen3.5 DeltaNet tensor's value heads tiled, as the converter writes them."""
    keys = cfg["linear_num_key_heads"]
    return reorder_value_heads(name, t, keys, cfg["linear_num_value_heads"] // keys, cfg["linear_key_head_dim"],
                               cfg["linear_value_head_dim"], to_tiled=True)


# The tokens llama.cpp's converter names for GLM (its _set_vocab_glm).
_GLM_TOKENS = MappingProxyType({"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"})
# ... and for Solar Open, written as GLM-4.5 (its SolarOpenModel).
_SOLAR_TOKENS = MappingProxyType({"eos": "<|endoftext|>", "eot": "<|endoftext|>", "unk": "<unk>",
                                  "bos": "<|startoftext|>"})

WRITE_FAMILIES: Mapping[str, WriteFamily] = MappingProxyType({
    "Qwen3MoeForCausalLM": WriteFamily("QWEN3MOE"),
    "Qwen2MoeForCausalLM": WriteFamily("QWEN2MOE"),
    "MixtralForCausalLM": WriteFamily("LLAMA"),  # Mixtral: llama with experts, as llama.cpp writes it
    "OlmoeForCausalLM": WriteFamily("OLMOE"),
    "MiniMaxM2ForCausalLM": WriteFamily("MINIMAXM2", _minimax_m2),
    "Glm4MoeForCausalLM": WriteFamily("GLM4_MOE", _glm4_moe, _GLM_TOKENS, nextn=True),
    "SolarOpenForCausalLM": WriteFamily("GLM4_MOE", _glm4_moe, _SOLAR_TOKENS),
    "DeepseekV2ForCausalLM": WriteFamily("DEEPSEEK2", deepseek2, tensors=split_kv_b, keeps=_decoder_layers_only),
    "DeepseekV3ForCausalLM": WriteFamily("DEEPSEEK2", deepseek3, tensors=split_kv_b, keeps=_decoder_layers_only),
    "GptOssForCausalLM": WriteFamily("GPT_OSS", _gpt_oss, prepare=_gpt_oss_experts),
    "Dots1ForCausalLM": WriteFamily("DOTS1", _dots1),
    "Ernie4_5_MoeForCausalLM": WriteFamily("ERNIE4_5_MOE", _ernie4_5_moe, keeps=_no_ernie_mtp, vocab="spm"),
    "ExaoneMoeForCausalLM": WriteFamily("EXAONE_MOE", _exaone_moe, nextn=True),
    "Lfm2MoeForCausalLM": WriteFamily("LFM2MOE", _lfm2_moe, tensors=_squeezed_conv),
    "GraniteMoeHybridForCausalLM": WriteFamily("GRANITE_HYBRID", _granitehybrid, tensors=_mamba2_tensors,
                                               prepare=_granite_shared),
    "GraniteMoeForCausalLM": WriteFamily("GRANITE_MOE", _granitemoe),
    "AfmoeForCausalLM": WriteFamily("AFMOE", _afmoe),
    "Cohere2MoeForCausalLM": WriteFamily("COHERE2MOE", _cohere2moe),
    "Llama4ForCausalLM": WriteFamily("LLAMA4", _llama4, prepare=_llama4_tensors),
    "GraniteMoeSharedForCausalLM": WriteFamily("GRANITE_MOE", _granitemoe, prepare=_granite_shared),
    "Glm4MoeLiteForCausalLM": WriteFamily("DEEPSEEK2", glm4_moe_lite, _GLM_TOKENS, tensors=split_kv_b,
                                          keeps=_decoder_layers_only),
    "DeepseekV32ForCausalLM": WriteFamily("DEEPSEEK32", sparse_deepseek, tensors=split_kv_b, nextn=True),
    "GlmMoeDsaForCausalLM": WriteFamily("GLM_DSA", sparse_deepseek, _GLM_TOKENS, tensors=split_kv_b, nextn=True),
    "KimiLinearForCausalLM": WriteFamily("KIMI_LINEAR", kimi_linear, tensors=kimi_linear_tensors),
    "DbrxForCausalLM": WriteFamily("DBRX", dbrx, prepare=dbrx_experts, config=dbrx_config, quantized_router=True),
    "HYV3ForCausalLM": WriteFamily("HY_V3", hy_v3),
    "MellumForCausalLM": WriteFamily("MELLUM", mellum),
    "LagunaForCausalLM": WriteFamily("LAGUNA", laguna),
    "Qwen3NextForCausalLM": WriteFamily("QWEN3NEXT", _hybrid, prepare=_hybrid_tensors),
    "Qwen3_5MoeForCausalLM": WriteFamily("QWEN35MOE", _hybrid, prepare=_hybrid_tensors),
})


def layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to, or None."""
    m = LAYER.match(name)
    return int(m.group(1)) if m else None
