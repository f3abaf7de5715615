"""Turns a scheduled step into a :class:`ForwardBatch`, runs the model and returns logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hearth.engine.cache.kv_pages import PagedKVCache
from hearth.engine.cache.state_slots import RecurrentStatePool, StateSnapshot
from hearth.engine.experts.contract import StepContext
from hearth.engine.layers.batch import ForwardBatch, SequenceSlice
from hearth.engine.models import MoECausalLM
from hearth.engine.request import Request


def build_batch(
    items: list[tuple[Request, int]], block_size: int, captures: dict[str, list[int]] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[ForwardBatch, list[Request]]:
    """Flatten the step's new tokens; also return the requests that get a sampled token.
    ``captures`` maps a request id to the positions after which to snapshot its recurrent state;
    the batch's tensors are made on ``device`` (the model's)."""
    captures = captures or {}
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sequences: list[SequenceSlice] = []
    logits_rows: list[int] = []
    sampled: list[Request] = []
    for req, n in items:
        start, end = req.num_computed, req.num_computed + n
        table = req.block_table[: -(-end // block_size)]
        blocks = torch.tensor(table, dtype=torch.long, device=device)
        consecutive = table == list(range(table[0], table[0] + len(table)))
        offsets = tuple(p - start for p in captures.get(req.request_id, ()) if start < p <= end)
        sequences.append(SequenceSlice(len(token_ids), n, end, blocks, table[0] if consecutive else -1,
                                       req.state_slot, offsets))
        token_ids += req.tokens[start:end]
        positions += range(start, end)
        # Each new token's cache slot: its position's block times the block size, plus the offset
        # (Python ints: a decode step's one token per sequence costs a few torch calls otherwise).
        slots += (table[p // block_size] * block_size + p % block_size for p in range(start, end))
        if end == req.num_tokens:
            logits_rows.append(len(token_ids) - 1)
            sampled.append(req)
    batch = ForwardBatch(
        token_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        sequences=sequences,
        logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=device),
        block_size=block_size,
    )
    return batch, sampled


class ModelRunner:
    """Owns the model, its KV cache and (hybrid models) its recurrent-state pool; executes one step."""

    def __init__(self, model: MoECausalLM, kv: PagedKVCache, states: RecurrentStatePool | None = None) -> None:
        self.model = model
        self.kv = kv
        self.states = states
        # The last step's state snapshots: (request, position, snapshot).
        self.last_captures: list[tuple[Request, int, StateSnapshot]] = []
        self.static = None  # a StaticDecoder (engine/executor/fixed_shape.py) that takes the pure decode steps
        self.device = kv.device  # where the model runs: the batches are made there
        # Pipeline stages: the later stages' forward, (batch, this stage's hidden states) -> logits,
        # or, to overlap the stages across requests, a handle whose ``result()`` gives them.
        self.next_stage: Callable[[ForwardBatch, torch.Tensor], Any] | None = None
        self.micro_batches = 1  # split a step's sequences in this many, so the stages work at once

    def execute(
        self, items: list[tuple[Request, int]], captures: dict[str, list[int]] | None = None,
        experts: StepContext | None = None,
    ) -> tuple[torch.Tensor, list[Request]]:
        """Run the step; ``experts`` is what the expert hierarchy made of it (its MoE layers read it)."""
        fresh: set[int] = set()  # state slots new in this step (the later stages zero theirs)
        for req, _ in items:
            if req.state_slot >= 0 and not req.state_ready:  # first step since admission: zeros or a checkpoint
                if self.states is not None:
                    self.states.prepare(req.state_slot, req.state_source)
                req.state_ready, req.state_source = True, None
                fresh.add(req.state_slot)
        if self.static is not None and not captures and (experts is None or experts.mode == "decode") and all(
                n == 1 and req.num_computed + 1 == req.num_tokens for req, n in items):
            self.last_captures = []
            return self.static.execute(items, experts)
        if self.next_stage is not None and self.micro_batches > 1 and len(items) > 1 and not captures:
            self.last_captures = []
            return self._pipelined(items, experts, fresh)
        batch, sampled = build_batch(items, self.kv.block_size, captures, self.device)
        batch.experts, batch.fresh_slots = experts, tuple(sorted(fresh))
        logits = self.model(batch, self.kv, self.states)
        if self.next_stage is not None:
            logits = _result(self.next_stage(batch, logits)).to(self.device)
        self.last_captures = [
            (items[index][0], batch.sequences[index].context_len - batch.sequences[index].query_len + offset,
             StateSnapshot(layers))
            for (index, offset), layers in batch.captured.items()
        ]
        return logits, sampled

    def _pipelined(self, items: list[tuple[Request, int]], experts: StepContext | None,
                   fresh: set[int]) -> tuple[torch.Tensor, list[Request]]:
        """A pipeline stage's step in micro-batches: each goes on to the later stages as soon as this
        stage is done with it, so that they work on one while this stage computes the next."""
        size = -(-len(items) // min(self.micro_batches, len(items)))
        handles, sampled = [], []
        for start in range(0, len(items), size):
            batch, part = build_batch(items[start : start + size], self.kv.block_size, None, self.device)
            batch.experts = experts
            batch.fresh_slots = tuple(sorted(req.state_slot for req, _ in items[start : start + size]
                                             if req.state_slot in fresh))
            handles.append(self.next_stage(batch, self.model(batch, self.kv, self.states)))
            sampled += part
        return torch.cat([_result(h) for h in handles]).to(self.device), sampled


def _result(handle: Any) -> torch.Tensor:
    """Logits from a later stage: given, or from a handle (a future, a Ray reference's wrapper)."""
    return handle if isinstance(handle, torch.Tensor) else handle.result()

