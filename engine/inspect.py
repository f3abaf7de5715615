"""Static facts about a model: parameter counts, expert sizes, bytes read per decode token."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hearth.engine.config import ModelConfig


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

    def as_dict(self) -> dict:
        return asdict(self)


def _non_expert_params(cfg: ModelConfig) -> int:
    """Parameters of the family's network without its experts, counted on a model built on the meta
    device (no memory, no weights read): whatever layers the family composes are counted."""
    from hearth.engine.models import build_model

    with torch.device("meta"):
        model = build_model(cfg, experts=None)  # type: ignore[arg-type] - never called here
    return sum(p.numel() for p in model.parameters())


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
    )


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


def stored_summary(f, cfg: ModelConfig) -> dict:
    """A GGUF file as stored: bytes per format in each tensor group, and the bytes one decode token
    reads at batch 1 in those formats (one embedding row, every dense weight, top-k of each layer's
    experts; the output projection whole, the embedding's when tied)."""
    groups: dict[str, dict[str, int]] = {}
    per_token = 0.0
    for name, t in f.tensors.items():
        group = _group(name)
        fmt = t.format.name if t.quantized else str(t.format).removeprefix("torch.")
        groups.setdefault(group, {})
        groups[group][fmt] = groups[group].get(fmt, 0) + t.nbytes
        if group == "embedding":
            per_token += t.nbytes / t.shape[0] + (t.nbytes if cfg.tie_word_embeddings else 0)
        elif group == "experts":
            per_token += t.nbytes * cfg.top_k / cfg.num_experts
        else:
            per_token += t.nbytes
    return {"formats": groups, "bytes_per_decode_token": int(per_token), "file_bytes": f.path.stat().st_size}
