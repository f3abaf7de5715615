"""Normalised model configuration shared by every model family.

Each family file turns a Hugging Face config into a :class:`ModelConfig`; everything below the
family layer (layers, expert backends, the runner) reads only this dataclass.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hearth.config import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (the checkpoint's ``rope_parameters`` / ``rope_scaling``)."""

    theta: float
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Shape of the recurrent layers of a hybrid model: gated DeltaNet (linear attention), or LFM2's
    short convolution (no heads: its state is the convolution's history of ``channels`` only)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    channels: int = 0  # the convolution's channels where they are not q, k and v (LFM2: hidden)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short causal convolution (q, k and v together, or ``channels``)."""
        return self.channels or 2 * self.key_dim + self.value_dim


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What the engine (KV cache, state pool, expert pool, scheduler) knows about a decoder-only MoE
    model. A family subclasses it with the choices only its own network reads (bias, router rules,
    shared experts); the shared layers never see a config, they are built by the family."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    hidden_act: str
    tie_word_embeddings: bool
    dtype: torch.dtype
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    # Per layer: True when the layer's feed-forward is an MoE block.
    moe_layers: tuple[bool, ...]
    # Dense MLP size (the dense layers of MoE models).
    intermediate_size: int = 0
    # Per layer: the sliding window in tokens, or None for full attention (empty: all full).
    sliding_windows: tuple[int | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    # Hybrid models: per layer "full_attention" or "linear_attention" (empty: all full attention).
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionConfig | None = None
    # The KV cache's per-token layout (heads, key width, value width) where it is not (num_kv_heads,
    # head_dim, head_dim): multi-head latent attention caches its compressed latent and rope key.
    kv_cache_layout: tuple[int, int, int] | None = None
    # Per layer, where layers differ (DeepSeek-V4: a compressor's per-token columns on some layers).
    kv_layer_layouts: tuple[tuple[int, int, int], ...] = ()
    # The rotary tables in fp32 rather than the model dtype (DeepSeek-V2 rotates in fp32).
    rope_in_fp32: bool = False
    # Experts with biases on gate/up and down (GPT-OSS): kept in each bank row's last column.
    expert_bias: bool = False
    # Fused expert tensors stored [E, H, 2I] and [E, I, H] rather than [E, 2I, H] and [E, H, I] (Llama 4).
    experts_transposed: bool = False
    # A pipeline stage's layers [first, end): only these are loaded, cached and run (None: all).
    layer_range: tuple[int, int] | None = None
    # Per layer, a rotary table of its own (None: ``rope``'s); empty: every layer turns by ``rope``
    # (Mellum's sliding and full layers, each kind with its own base).
    layer_ropes: tuple[RopeConfig | None, ...] = ()

    def in_stage(self, idx: int) -> bool:
        """Whether layer ``idx`` is this stage's (every layer without a ``layer_range``)."""
        return self.layer_range is None or self.layer_range[0] <= idx < self.layer_range[1]

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(heads, key width, value width) of each attention layer's KV cache per token."""
        return self.kv_cache_layout or (self.num_kv_heads, self.head_dim, self.head_dim)

    def kv_layout_of(self, idx: int) -> tuple[int, int, int]:
        """Layer ``idx``'s KV cache layout per token (see :attr:`kv_layout`)."""
        return self.kv_layer_layouts[idx] if self.kv_layer_layouts else self.kv_layout

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes over every attention layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(heads * (key + value) for heads, key, value in map(self.kv_layout_of, self.attention_layer_ids)) \
            * elem

    def window(self, idx: int) -> int | None:
        return self.sliding_windows[idx] if self.sliding_windows else None

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, is_moe in enumerate(self.moe_layers) if is_moe and self.in_stage(i)]

    def stage_may_start(self, idx: int) -> bool:
        """Whether a pipeline stage may begin at layer ``idx`` (one that needs the layer before it in
        the same pass may not: GLM-5's shared sparse-attention layers)."""
        return True

    def is_linear_layer(self, idx: int) -> bool:
        return bool(self.layer_types) and self.layer_types[idx] == "linear_attention"

    @property
    def hybrid(self) -> bool:
        """Whether any layer of the whole model (not only this stage's) is linear attention."""
        return any(self.is_linear_layer(i) for i in range(self.num_layers))

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_linear_layer(i) and self.in_stage(i)]

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_linear_layer(i) and self.in_stage(i)]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (gate, up and down projections)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        h, i = self.hidden_size, self.moe_intermediate_size
        return (3 * h * i + (2 * i + h if self.expert_bias else 0)) * elem



def read_config_json(model_dir: Path) -> dict[str, Any]:
    """Read ``config.json`` with a clear error when it is absent or not JSON."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc


def config_architectures(raw: dict[str, Any]) -> list[str]:
    """A config.json's ``architectures``; where it names none, the causal-LM class that transformers'
    ``AutoModelForCausalLM`` takes for its ``model_type`` (so such a checkpoint loads as it does there)."""
    named = raw.get("architectures") or []
    if named or not isinstance(raw.get("model_type"), str):
        return list(named)
    # deferred: transformers is heavy to import, and only a config without 'architectures' needs its table
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    default = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(raw["model_type"])
    return [default] if isinstance(default, str) else []


def parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    """Read rope parameters from either the transformers 5 or the legacy layout. (Parameters per layer
    type, ``{"full_attention": {...}, "sliding_attention": {...}}``, are :func:`parse_layer_ropes`'.)"""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    return RopeConfig(theta=float(theta), rope_type=str(rope_type), params=params)


def parse_layer_ropes(cfg: dict[str, Any], layer_types: list[str]) -> tuple[RopeConfig, tuple[RopeConfig, ...]]:
    """(the first layer's rotary, each layer's) where ``rope_parameters`` are given per layer type
    (transformers 5's layout for Gemma 3's, Mellum's and MiMo's): each type's parameters read as
    :func:`parse_rope` reads a whole config's; one set for all: that set for every layer."""
    by_type = cfg.get("rope_parameters") or {}
    if not any(isinstance(value, dict) for value in by_type.values()):
        rope = parse_rope(cfg)
        return rope, (rope,) * len(layer_types)
    missing = sorted({kind for kind in layer_types if not isinstance(by_type.get(kind), dict)})
    if missing:
        raise ConfigError(f"rope_parameters name no rotary for the layer type(s) {', '.join(missing)}")
    ropes = tuple(parse_rope({"rope_parameters": by_type[kind]}) for kind in layer_types)
    return ropes[0], ropes


def parse_dtype(cfg: dict[str, Any], override: str | torch.dtype | None) -> torch.dtype:
    """The compute dtype: an explicit override, else the checkpoint's ``dtype``/``torch_dtype``."""
    if isinstance(override, torch.dtype):
        return override
    name = override if override not in (None, "auto") else (cfg.get("dtype") or cfg.get("torch_dtype"))
    name = str(name or "float32").replace("torch.", "")
    if name not in DTYPES:
        raise ConfigError(f"unsupported dtype '{name}' (choose one of float32, bfloat16, float16)")
    return DTYPES[name]


def eos_ids(cfg: dict[str, Any], model_dir: Path) -> tuple[int, ...]:
    """EOS token ids from generation_config.json (preferred) or config.json."""
    value = cfg.get("eos_token_id")
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(gen_path.read_text()).get("eos_token_id", value)
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)
