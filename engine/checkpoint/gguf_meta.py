"""The metadata readers shared by the GGUF architectures (``gguf_families.py``): the keys every
decoder's file has, as llama.cpp's converter writes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Meta = Callable[..., Any]  # meta(key, default=None): the value of "{architecture}.{key}"
Has = Callable[[str], bool]  # has(name): whether the file holds that tensor


class TensorIndex:
    """``has(name)`` for a file's tensors, and ``has.rows(name)``: a tensor's first dimension (torch
    order), where an architecture tells a variant by a tensor's shape (Laguna's output gate)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self._shapes = shapes

    def __call__(self, name: str) -> bool:
        return name in self._shapes

    def rows(self, name: str) -> int:
        return self._shapes[name][0]


def common_fields(meta: Meta) -> dict[str, Any]:
    """The fields every decoder's metadata gives: shapes, norms, rotary base, the router's top-k.
    Multi-token-prediction layers (``nextn_predict_layers``) are counted in ``block_count``; the
    decoder has the others."""
    heads = int(meta("attention.head_count"))
    fields: dict[str, Any] = dict(
        hidden_size=int(meta("embedding_length")),
        num_hidden_layers=int(meta("block_count")) - int(meta("nextn_predict_layers", 0) or 0),
        num_attention_heads=heads,
        # (a list where layers differ: LFM2's convolution layers have none)
        num_key_value_heads=max(as_list(meta("attention.head_count_kv", heads))),
        max_position_embeddings=int(meta("context_length")),
        rope_parameters={"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))},
        num_experts_per_tok=int(meta("expert_used_count")),
    )
    if meta("attention.layer_norm_rms_epsilon") is not None:
        fields["rms_norm_eps"] = float(meta("attention.layer_norm_rms_epsilon"))
    else:  # (a LayerNorm: Cohere's)
        fields["layer_norm_eps"] = float(meta("attention.layer_norm_epsilon"))
    if meta("feed_forward_length") is not None:
        fields["intermediate_size"] = int(meta("feed_forward_length"))
    if meta("attention.key_length") is not None:
        fields["head_dim"] = int(meta("attention.key_length"))
    return fields


def as_list(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
