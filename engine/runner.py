"""Turns a scheduled step into a :class:`ForwardBatch`, runs the model and returns logits."""

from __future__ import annotations

import torch

from engine.batch import ForwardBatch, SequenceSlice
from engine.kv_cache import PagedKVCache
from engine.models import MoECausalLM
from engine.request import Request


def build_batch(items: list[tuple[Request, int]], block_size: int) -> tuple[ForwardBatch, list[Request]]:
    """Flatten the step's new tokens; also return the requests that get a sampled token."""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[torch.Tensor] = []
    sequences: list[SequenceSlice] = []
    logits_rows: list[int] = []
    sampled: list[Request] = []
    for req, n in items:
        start, end = req.num_computed, req.num_computed + n
        table = req.block_table[: -(-end // block_size)]
        blocks = torch.tensor(table, dtype=torch.long)
        consecutive = table == list(range(table[0], table[0] + len(table)))
        sequences.append(SequenceSlice(len(token_ids), n, end, blocks, table[0] if consecutive else -1))
        token_ids += req.tokens[start:end]
        positions += range(start, end)
        new_slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[start:end]
        slots.append(new_slots)
        if end == req.num_tokens:
            logits_rows.append(len(token_ids) - 1)
            sampled.append(req)
    batch = ForwardBatch(
        token_ids=torch.tensor(token_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.cat(slots),
        sequences=sequences,
        logits_indices=torch.tensor(logits_rows, dtype=torch.long),
        block_size=block_size,
    )
    return batch, sampled


class ModelRunner:
    """Owns the model and its KV cache; executes one step."""

    def __init__(self, model: MoECausalLM, kv: PagedKVCache) -> None:
        self.model = model
        self.kv = kv

    def execute(self, items: list[tuple[Request, int]]) -> tuple[torch.Tensor, list[Request]]:
        batch, sampled = build_batch(items, self.kv.block_size)
        return self.model(batch, self.kv), sampled
