"""What every checkpoint reader shares, so that none of them imports another for it: the error
they raise, the model they return, a pipeline stage's share of the tensors, the expert tensor
names of a Hugging Face checkpoint, and how weights kept in their blocks join the model."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hearth.engine.config import ConfigError, ModelConfig
from hearth.engine.experts.pool import ExpertPool
from hearth.engine.kernels.cpu import cpu_decode_ops
from hearth.engine.models import MoECausalLM

# ``pool_factory(gate_up_shape, down_shape, dtype)``: the expert banks' storage (e.g. shared memory).
PoolFactory = Callable[[tuple, tuple, torch.dtype], tuple[torch.Tensor, torch.Tensor]]

# Expert tensor names in a Hugging Face checkpoint (after the family's name mapping), read by the
# float loader (:mod:`.hf`), the quantized one (:mod:`.hf_quant`) and the GGUF writer.
# ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``: one expert's matrix.
PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# ``model.layers.{l}.mlp.experts.{gate_up,down}_proj``: every expert of a layer in one tensor.
FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
# ``model.layers.{l}.mlp.experts.{gate,up,down}_rows``: each of a layer's three matrices for every expert
# in one [E * I, H] tensor, expert after expert, down's transposed (DBRX's ``w1``, ``v1``, ``w2``).
ROWS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate|up|down)_rows$")
# A decoder layer's tensor (its number in group 1), in the in-memory (transformers) names.
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match what its config describes."""


@dataclass
class LoadedModel:
    """A model ready to run: its config, the non-expert module and the expert pool."""

    config: ModelConfig
    model: MoECausalLM
    pool: ExpertPool
    model_dir: Path


# -- pipeline stages -------------------------------------------------------------------------------


def stage_config(cfg, layers: tuple[int, int]):
    """``cfg`` for the pipeline stage holding layers [first, end)."""
    first, end = layers
    if not 0 <= first < end <= cfg.num_layers:
        raise ConfigError(f"stage layers [{first}, {end}) are not within the model's {cfg.num_layers} layers")
    return replace(cfg, layer_range=(first, end))


def stage_owns(canonical: str, cfg) -> bool:
    """Whether a pipeline stage (``cfg.layer_range``) holds this tensor: its own layers' tensors, the
    embeddings on the first stage, the final norm and the head on the last."""
    if cfg.layer_range is None:
        return True
    first, end = cfg.layer_range
    layer = LAYER.match(canonical)
    if layer is not None:
        return first <= int(layer.group(1)) < end
    if canonical.startswith("model.embed_tokens."):
        return first == 0 or (canonical == "model.embed_tokens.weight" and cfg.tie_word_embeddings
                              and end == cfg.num_layers)
    return end == cfg.num_layers  # the final norm and the head


# -- weights kept in their blocks ------------------------------------------------------------------


def blocks_can_stay(cfg, kernels: bool = True) -> bool:
    """Whether weights may stay in blocks: float32 activations, and (``kernels``) the native kernels
    run here."""
    return cfg.dtype == torch.float32 and (not kernels or cpu_decode_ops() is not None)


def replace_parameter(model, param: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
    """Put ``new`` in place of ``param`` in every module that holds it (tied embeddings: two)."""
    for module in model.modules():
        for attr, value in list(module._parameters.items()):
            if value is param:
                module._parameters[attr] = new


def adopt_blocks(model) -> None:
    """Layers that fuse several projections (attention's q/k/v) re-fuse them from their blocks."""
    for module in model.modules():
        adopt = getattr(module, "adopt_block_weights", None)
        if adopt is not None:
            adopt()
