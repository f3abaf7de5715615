"""A generation request and its mutable state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from hearth.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Prompt, generated tokens and bookkeeping of one sequence.

    ``num_computed`` counts tokens whose K/V are in the cache; the next step must feed
    ``tokens[num_computed:]`` (a prefill chunk, or the single newest token while decoding).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # Prefix cache: the first ``num_tree_blocks`` blocks of ``block_table`` belong to the shared
    # tree, pinned through ``prefix_node``; ``num_cached_tokens`` prompt tokens were found there.
    num_tree_blocks: int = 0
    prefix_node: object | None = None
    num_cached_tokens: int = 0
    # Hybrid models: the recurrent-state slot, and what it starts from before the first step
    # after admission (a StateCheckpoint's state, or None for zeros) until ``state_ready``.
    state_slot: int = -1
    state_source: object | None = None
    state_ready: bool = False
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    matcher: object | None = None  # constrained decoding: the request's place in its grammar
    grammar_done: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
