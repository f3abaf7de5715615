"""The flattened batch handed to a model forward: several sequences, each a run of new tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceSlice:
    """One sequence's share of a step.

    Its new tokens are rows ``query_start : query_start + query_len`` of the batch; after the step
    the sequence holds ``context_len`` tokens in the KV cache, stored at ``context_slots``.
    """

    query_start: int
    query_len: int
    context_len: int
    context_slots: torch.Tensor  # [context_len] int64


@dataclass
class ForwardBatch:
    """Inputs of one forward pass over a flattened (ragged) batch of T tokens."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    sequences: list[SequenceSlice]
    logits_indices: torch.Tensor  # [B'] rows whose logits are needed (last token of a sampled sequence)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])
