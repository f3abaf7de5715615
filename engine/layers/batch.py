"""The flattened batch handed to a model forward: several sequences, each a run of new tokens."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hearth.engine.cache.kv_pages import PagedKVCache
    from hearth.engine.cache.state_slots import RecurrentStatePool
    from hearth.engine.experts.contract import StepContext


@dataclass
class SequenceSlice:
    """One sequence's share of a step.

    Its new tokens are rows ``query_start : query_start + query_len`` of the batch; after the step
    the sequence holds ``context_len`` tokens in the KV cache, in the blocks ``block_ids``.
    """

    query_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64
    first_block: int = -1  # when the blocks are consecutive: the first one (-1 otherwise)
    # Hybrid models: the sequence's recurrent-state slot, and offsets (1..query_len) after which
    # the linear-attention layers snapshot their state into ``ForwardBatch.captured``.
    state_slot: int = -1
    captures: tuple[int, ...] = ()


@dataclass
class ForwardBatch:
    """Inputs of one forward pass over a flattened (ragged) batch of T tokens."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    sequences: list[SequenceSlice]
    logits_indices: torch.Tensor  # [B'] rows whose logits are needed (last token of a sampled sequence)
    block_size: int
    # Attention masks by (sequence index, window or ("chunk", size), explicit causal), built by the first layer
    # that needs one and reused by the others: they depend only on the sequence's positions.
    masks: dict[tuple[int, int | tuple[str, int] | None, bool], torch.Tensor | None] = field(default_factory=dict)
    # Snapshots requested by ``SequenceSlice.captures``: (sequence index, offset) -> layer -> (conv, state).
    captured: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    # What the expert hierarchy was told about this step (None: the plain backend, decode rules).
    experts: StepContext | None = None
    # Pipeline stages of a hybrid model: the state slots of requests new in this step, which each
    # later stage starts from zeros (the first stage prepares its own before the step).
    fresh_slots: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def moved(self, device: torch.device | str) -> ForwardBatch:
        """This batch with its tensors on ``device``, as a pipeline stage on another machine (or
        another device) needs it; the masks and snapshots that layers cache on it are left behind
        (the next stage builds its own)."""
        seqs = [replace(s, block_ids=s.block_ids.to(device)) for s in self.sequences]
        return replace(self, token_ids=self.token_ids.to(device), positions=self.positions.to(device),
                       slot_mapping=self.slot_mapping.to(device), sequences=seqs,
                       logits_indices=self.logits_indices.to(device), masks={}, captured={})


@dataclass
class StaticBatch:
    """One decode step in fixed-size buffers (a batch bucket of B rows, block tables of MB blocks),
    so that the step's shapes are the same at every token: it compiles once and can be captured as a
    graph (``engine/executor/fixed_shape.py``). Every row is one sequence's one new token; rows past the real
    sequences repeat row 0 exactly (same token, position, slot and blocks), so they write the same
    K/V to the same slot and route to the same experts: no masks, no valid counts inside the step."""

    token_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, MB] int64 (unused entries 0)
    context_lens: torch.Tensor  # [B] int64: tokens in the cache after the step
    logits_indices: torch.Tensor  # [B] every row (the caller keeps the real ones)
    block_size: int
    state_slots: torch.Tensor | None = None  # [B] hybrid models: each row's recurrent-state slot
    experts: StepContext | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class LayerContext:
    """What every decoder layer reads besides its hidden states, one per forward pass: the batch, the
    KV cache, the recurrent states of hybrid models, and the rotary tables of the batch's positions."""

    batch: ForwardBatch | StaticBatch
    kv: PagedKVCache
    states: RecurrentStatePool | None
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, R]
    # What a family's own layers share besides (DeepSeek-V4: its rotary tables by kind, and the
    # rotary module for compressed positions), made once per forward pass.
    extras: dict[str, Any] = field(default_factory=dict)
    # The other rotary tables of models whose layers turn by their own (ModelConfig.layer_ropes), by
    # the index an attention layer's ``rope_table`` names.
    ropes: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
