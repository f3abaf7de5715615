"""Paged KV cache: a pure-Python block allocator plus the per-layer cache tensors, and how many
tokens an engine's cache holds (:func:`kv_cache_tokens`).

A sequence owns a list of fixed-size blocks (its block table); token ``i`` of the sequence lives
in slot ``block_table[i // block_size] * block_size + i % block_size`` of every layer's cache.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hearth.config import EngineConfig
from hearth.engine import hugepages
from hearth.engine.config import ModelConfig


def kv_cache_tokens(config: EngineConfig, cfg: ModelConfig, max_model_len: int) -> int:
    """Tokens the engine's KV cache holds: as set, else every sequence's whole context within the
    cache's byte budget."""
    kv = config.kv_cache
    if kv.num_tokens:
        return kv.num_tokens
    # Pipeline stages size their caches alike (their block tables are the first stage's): by the
    # whole model's bytes per token.
    per_token = (replace(cfg, layer_range=None) if cfg.layer_range is not None else cfg).kv_bytes_per_token
    wanted = config.scheduler.max_num_seqs * max_model_len
    return max(kv.block_size, min(wanted, kv.num_bytes // per_token))


class OutOfBlocks(RuntimeError):
    """Raised when the allocator cannot satisfy a request; the scheduler preempts or waits."""


class BlockAllocator:
    """Hands out KV blocks by id. Pure bookkeeping, no tensors (unit-testable)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int, blocks_held: int) -> int:
        """Extra blocks a sequence holding ``blocks_held`` blocks needs to store ``num_tokens`` tokens."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - blocks_held)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """Key/value tensors for every layer, addressed by flat slot index."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        attention_layers: list[int] | None = None,
        value_dim: int | None = None,
        layer_layouts: list[tuple[int, int, int]] | None = None,
    ) -> None:
        """``value_dim``: the values' width where it is not ``head_dim`` (a latent-attention cache);
        ``layer_layouts``: (heads, key width, value width) per layer where layers differ."""
        slots = num_blocks * block_size
        uniform = (num_kv_heads, head_dim, value_dim or head_dim)
        self.block_size = block_size
        self.device = torch.device(device)
        layers = set(range(num_layers) if attention_layers is None else attention_layers)

        def empty(i: int, width_at: int) -> torch.Tensor:
            # Uninitialised on purpose: attention only reads slots this sequence has written, and the
            # OS then commits pages as they are first used rather than all at start-up. Layers without
            # attention (a hybrid model's linear-attention layers) get an empty placeholder.
            heads, *widths = layer_layouts[i] if layer_layouts else uniform
            shape = (slots, heads, widths[width_at]) if i in layers else (0,)
            return hugepages.advise(torch.empty(shape, dtype=dtype, device=device))

        self.keys = [empty(i, 0) for i in range(num_layers)]
        self.values = [empty(i, 1) for i in range(num_layers)]

    @classmethod
    def for_model(cls, cfg, num_blocks: int, block_size: int, device: torch.device | str = "cpu") -> PagedKVCache:
        """The cache of a :class:`~hearth.engine.config.ModelConfig`'s attention layers, in its layout."""
        heads, key_dim, value_dim = cfg.kv_layout
        return cls(cfg.num_layers, num_blocks, block_size, heads, key_dim, cfg.dtype, device=device,
                   attention_layers=cfg.attention_layer_ids, value_dim=value_dim,
                   layer_layouts=list(cfg.kv_layer_layouts) or None)

