"""Static facts about a model: parameter counts, expert sizes and bytes read per decode token from
its config alone (:func:`summarize`), and what a checkpoint stores in which formats
(:func:`stored_summary`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hearth.engine.checkpoint.dispatch import checkpoint_format
from hearth.engine.checkpoint.ftw import BANKS, read_index
from hearth.engine.checkpoint.gguf_reader import GGUFFile, expert_blocks, kernel_format
from hearth.engine.checkpoint.hf import checkpoint_files, is_unused_tensor, open_safetensors
from hearth.engine.checkpoint.hf_quant import QuantSpec, quant_spec
from hearth.engine.config import ModelConfig, read_config_json
from hearth.engine.kernels.cpu import cpu_decode_ops
from hearth.engine.models import build_model, config_architectures, family_for


@dataclass(frozen=True)
class ModelSummary:
    """Counts derived from the config alone (no weights are read)."""

    architecture: str
    dtype: str
    num_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    total_params: int
    expert_params: int
    active_params_per_token: int
    expert_bytes: int
    expert_pool_bytes: int
    bytes_per_decode_token: int
    kv_bytes_per_token: int  # the KV cache (or a latent-attention cache) over every attention layer
    # Latent attention: the per-head keys and values a plain cache would hold instead (else None).
    expanded_kv_bytes_per_token: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _non_expert_params(cfg: ModelConfig) -> int:
    """Parameters of the family's network without its experts, counted on a model built on the meta
    device (no memory, no weights read): whatever layers the family composes are counted."""
    with torch.device("meta"):
        model = build_model(cfg, experts=None)  # type: ignore[arg-type] - never called here
    return sum(p.numel() for p in model.parameters() if p.is_floating_point())  # (not routing tables)


def summarize(cfg: ModelConfig) -> ModelSummary:
    """Parameter and byte counts of ``cfg``; bytes per decode token counts every weight one
    token's forward pass reads at batch 1 (one embedding row, all dense weights, top-k experts)."""
    h = cfg.hidden_size
    per_expert = 3 * h * cfg.moe_intermediate_size
    moe_layers = len(cfg.moe_layer_ids)
    non_expert = _non_expert_params(cfg)
    expert_params = moe_layers * cfg.num_experts * per_expert
    embed = cfg.vocab_size * h
    # One token reads one embedding row; the output projection is read whole (tied or not).
    active = non_expert - embed + h + (embed if cfg.tie_word_embeddings else 0) + moe_layers * cfg.top_k * per_expert
    elem = torch.empty((), dtype=cfg.dtype).element_size()
    return ModelSummary(
        architecture=cfg.architecture,
        dtype=str(cfg.dtype).replace("torch.", ""),
        num_layers=cfg.num_layers,
        num_moe_layers=moe_layers,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        total_params=non_expert + expert_params,
        expert_params=expert_params,
        active_params_per_token=active,
        expert_bytes=per_expert * elem,
        expert_pool_bytes=expert_params * elem,
        bytes_per_decode_token=active * elem,
        kv_bytes_per_token=cfg.kv_bytes_per_token,
        expanded_kv_bytes_per_token=expanded_kv_bytes(cfg),
    )


def expanded_kv_bytes(cfg: ModelConfig) -> int | None:
    """Per token, the K/V a plain cache would hold for a latent-attention model: every head's whole
    key (no-rope and rotary parts) and value on every layer; None for a model without MLA."""
    mla = getattr(cfg, "mla", None)
    if mla is None:
        return None
    elem = torch.empty((), dtype=cfg.dtype).element_size()
    per_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim
    return len(cfg.attention_layer_ids) * cfg.num_heads * per_head * elem


def _scaled(n: float, base: int, units: tuple[str, ...]) -> tuple[float, str]:
    for unit in units[:-1]:
        if abs(n) < base:
            return n, unit
        n /= base
    return n, units[-1]


def human_bytes(n: float) -> str:
    value, unit = _scaled(n, 1024, ("B", "KiB", "MiB", "GiB", "TiB"))
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def human_count(n: float) -> str:
    value, unit = _scaled(n, 1000, ("", "K", "M", "B", "T"))
    return str(int(value)) if not unit else f"{value:.2f}{unit}"


def _group(name: str) -> str:
    """The role of a GGUF tensor, for the per-group format listing."""
    if name.startswith("token_embd"):
        return "embedding"
    if name.startswith("output.") or name == "output.weight":
        return "output"
    if "_exps" in name:
        return "experts"
    if "ffn_gate_inp" in name:
        return "router"
    if "norm" in name:
        return "norms"
    if ".attn_" in name:
        return "attention"
    return "dense ffn" if ".ffn_" in name else "other"


def _hf_group(name: str) -> str:
    """The role of a tensor under its in-memory (transformers) name, in the groups of :func:`_group`."""
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if name.startswith("lm_head."):
        return "output"
    if ".mlp.experts." in name:
        return "experts"
    if name.endswith((".mlp.gate.weight", ".mlp.gate.bias", ".e_score_correction_bias")) or \
            ".shared_expert_gate." in name:
        return "router"
    if "norm" in name:
        return "norms"
    if ".self_attn." in name or ".linear_attn." in name:
        return "attention"
    return "dense ffn" if ".mlp." in name else "other"


@dataclass(frozen=True)
class _Stored:
    """One stored tensor (or a part of one) for :func:`stored_summary`."""

    group: str
    format: str  # a block format's name, or a dtype's
    nbytes: int
    rows: int  # the first dimension (an embedding's vocabulary)
    in_blocks: bool  # its format stays in blocks at run time (where native kernels run: _summary checks)


def _summary(items: list[_Stored], cfg: ModelConfig, file_bytes: int) -> dict:
    """Bytes per format in each group, the bytes one decode token reads at batch 1 in those formats
    (one embedding row, every dense weight, top-k of each layer's experts; the output projection
    whole, the embedding's when tied), and the groups whose weights stay in their blocks."""
    groups: dict[str, dict[str, int]] = {}
    per_token = 0.0
    for t in items:
        groups.setdefault(t.group, {})
        groups[t.group][t.format] = groups[t.group].get(t.format, 0) + t.nbytes
        if t.group == "embedding":
            per_token += t.nbytes / max(t.rows, 1) + (t.nbytes if cfg.tie_word_embeddings else 0)
        elif t.group == "experts":
            per_token += t.nbytes * cfg.top_k / cfg.num_experts
        else:
            per_token += t.nbytes
    kernels = cpu_decode_ops() is not None  # without them every block is decoded at load
    return {"formats": groups, "bytes_per_decode_token": int(per_token), "file_bytes": file_bytes,
            "in_blocks": sorted({t.group for t in items if t.in_blocks and kernels})}


def stored_summary(path, cfg: ModelConfig) -> dict | None:
    """A checkpoint as stored (see :func:`_summary`): a GGUF file, an FTW directory, or a Hugging Face
    directory quantized as shipped (FP8, MXFP4); None for a plain Hugging Face directory, whose weights
    are all in the dtype its config names."""
    kind = checkpoint_format(path)
    if kind == "gguf":
        return _gguf_summary(GGUFFile(path), cfg)
    path = Path(path)
    if kind == "ftw":
        return _ftw_summary(path, cfg)
    spec = quant_spec(read_config_json(path), path)
    return _hf_quant_summary(path, cfg, spec) if spec is not None else None


def _gguf_summary(f: GGUFFile, cfg: ModelConfig) -> dict:
    experts_in_blocks = expert_blocks(f, cfg) is not None
    items = []
    for name, t in f.tensors.items():
        group = _group(name)
        fmt = t.format.name if t.quantized else str(t.format).removeprefix("torch.")
        # The experts as their layers' banks; another tensor when it is a matrix (not the vector of a
        # [1, H] gate) in a format the kernels read.
        blocks = experts_in_blocks if group == "experts" else kernel_format(t) is not None and len(t.shape) == 2
        items.append(_Stored(group, fmt, t.nbytes, t.shape[0], blocks))
    return _summary(items, cfg, f.path.stat().st_size)


def _ftw_summary(path: Path, cfg: ModelConfig) -> dict:
    index = read_index(path)
    items = []
    for name, entry in index["tensors"].items():
        dtype = entry.get("dtype", index["dtype"])
        size = 1 if "format" in entry else getattr(torch, dtype).itemsize
        nbytes = size * math.prod(entry["shape"])
        items.append(_Stored(_hf_group(name), entry.get("format", dtype), nbytes, entry["shape"][0],
                             "format" in entry))
    banks = index["banks"]
    blocks = banks.get("blocks")
    elem = getattr(torch, index["dtype"]).itemsize
    for bank in BANKS:
        for piece in banks[bank]:
            r0, _ = piece["rows"]
            if blocks is None:
                items.append(_Stored("experts", index["dtype"], elem * math.prod(piece["shape"]), 0, False))
            else:
                layer = banks["moe_layers"][r0 // banks["num_experts"]]
                items.append(_Stored("experts", blocks[str(layer)][bank], math.prod(piece["shape"]), 0, True))
    return _summary(items, cfg, sum(s["bytes"] for s in index["shards"]))


# safetensors dtypes: (torch name, bytes per element)
_ST_DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2),
              "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "F8_E8M0": ("float8_e8m0fnu", 1),
              "U8": ("uint8", 1), "I8": ("int8", 1), "I16": ("int16", 2), "I32": ("int32", 4),
              "I64": ("int64", 8), "BOOL": ("bool", 1)}


def _hf_quant_summary(path: Path, cfg: ModelConfig, spec: QuantSpec) -> dict:
    """An FP8 or MXFP4 checkpoint as shipped: an FP8 weight and its tile scales count as ``fp8_e4m3``,
    MXFP4 blocks and their scales as ``mxfp4``; the rest under its dtype. Tensors the family does
    not use are left out."""
    family = family_for(config_architectures(read_config_json(path)))
    files = checkpoint_files(path)
    headers: dict[str, tuple[str, list[int]]] = {}
    for shard in sorted(set(files.values())):
        with open_safetensors(shard) as f:
            names = f.keys()  # a safetensors handle: no iteration of its own
            for name in names:
                sl = f.get_slice(name)
                headers[name] = (sl.get_dtype(), list(sl.get_shape()))
    quantized = {}  # weight name -> its block format's name
    for name, (dtype, _) in headers.items():
        if (spec.method == "fp8" and dtype == "F8_E4M3") or (spec.method == "mxfp4" and name.endswith("_blocks")):
            quantized[name] = spec.format.name
    items = []
    for name, (dtype, shape) in headers.items():
        weight = name  # a scale tensor counts with its weight
        if name.endswith(spec.scale_suffix):
            weight = name.removesuffix(spec.scale_suffix) + ("_blocks" if spec.method == "mxfp4" else "")
        canonical = family.map_name(weight.removesuffix("_blocks"))
        if not canonical or is_unused_tensor(canonical, cfg):
            continue
        torch_name, size = _ST_DTYPES.get(dtype, (dtype.lower(), 1))
        fmt = quantized.get(weight)
        items.append(_Stored(_hf_group(canonical), fmt or torch_name, size * math.prod(shape),
                             shape[0] if shape else 1, fmt is not None))
    return _summary(items, cfg, sum(p.stat().st_size for p in set(files.values())))
