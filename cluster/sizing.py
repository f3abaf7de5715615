"""What a model needs from a machine, read from its checkpoint's config (and, for a quantized one,
its files' size) without loading it: the placement's :class:`ModelSpec`, the bytes of each layer
for pipeline stages, and the stage plan of a model over machines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hearth.cluster.placement import ModelSpec, NodeInfo
from hearth.cluster.specs import DeployOptions
from hearth.cluster.stages import StagePlan, plan_stages
from hearth.engine.checkpoint import load_config, summarize


def model_spec(path: str, name: str, replicas: int | None = None, require: str | None = None) -> ModelSpec:
    """Pool and dense sizes of the checkpoint at ``path``, from its config (and, for a quantized
    one, its files' size)."""
    _, cfg = load_config(path)
    s = summarize(cfg)
    item = s.expert_pool_bytes // max(s.expert_params, 1)
    scale = stored_fraction(path, cfg, s.total_params * item)
    return ModelSpec(name, path, int(s.expert_pool_bytes * scale),
                     int((s.total_params - s.expert_params) * item * scale), replicas, require)


def stored_fraction(path: str, cfg: Any, float_bytes: int) -> float:
    """The weights' bytes on disk over ``float_bytes`` (their size as floats), at most 1, for a model
    that runs in float32: its quantized weights (a GGUF file's, an FTW directory's, an FP8 or MXFP4
    checkpoint's) stay in their blocks in memory too, so it needs about what it takes on disk. In
    another dtype they are decoded: 1."""
    if cfg.dtype != torch.float32:
        return 1.0
    p = Path(path)
    files = [p] if p.is_file() else [*p.glob("*.safetensors"), *p.glob("*.ftw"), *p.glob("*.gguf")]
    stored = sum(f.stat().st_size for f in files if f.is_file())
    return min(1.0, stored / float_bytes) if stored and float_bytes else 1.0


def layer_sizes(path: str) -> tuple[list[int], int, int]:
    """(bytes of each decoder layer, experts included; embeddings; head) from the config alone."""
    _, cfg = load_config(path)
    s = summarize(cfg)
    item = s.expert_pool_bytes // max(s.expert_params, 1)
    scale = stored_fraction(path, cfg, s.total_params * item)
    embed = cfg.vocab_size * cfg.hidden_size * item
    head = 0 if cfg.tie_word_embeddings else embed
    dense = (s.total_params - s.expert_params) * item - embed - head
    per_moe = cfg.num_experts * s.expert_bytes
    return ([int((dense // cfg.num_layers + (per_moe if cfg.moe_layers[i] else 0)) * scale)
             for i in range(cfg.num_layers)], int(embed * scale), int(head * scale))


def plan_model_stages(options: DeployOptions, nodes: list[NodeInfo]) -> tuple[StagePlan, ...]:
    """The stage plan of the (one) model of ``options`` over ``nodes`` (raises PlacementError)."""
    path, name = options.models[0]
    sizes, embed, head = layer_sizes(path)
    cfg = load_config(path)[1]
    return plan_stages(nodes, name, sizes, embed, head, min_stages=2 if options.stages else 1,
                       may_start=[cfg.stage_may_start(i) for i in range(cfg.num_layers)])
