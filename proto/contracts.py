"""The contracts that cross process boundaries: plain typed dataclasses, no torch.

The engine produces them, the serving layer turns them into each protocol, the cluster sends them
between actors (Ray pickles them), and ``hearth.proto`` (``hearth.proto``'s gRPC messages) mirrors
them on the wire; ``tests/test_contracts.py`` keeps the two in step.

- :class:`SamplingParams`   how to pick tokens and when to stop (proto ``SamplingParams``)
- :class:`GenerateRequest`  prompt token ids + sampling parameters, as an engine client receives them
- :class:`RequestMetrics`   timings and token counts of one request (proto ``Usage`` and ``timings``)
- :class:`GenerationChunk`  what one engine step added to one request (proto ``GenerateResponse``)
- :class:`TokenLogprob`     one generated token's log-probability and alternatives (proto ``TokenLogprob``)
- :class:`RequestOutput`    the in-process view: a chunk plus everything generated so far
- :class:`ModelInfo`        what the API layer knows of the served model (proto ``ModelCard``)
- :class:`EngineClient`     how the API layer talks to an engine, in-process or remote
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol


class EngineOverloaded(Exception):
    """The request queue is full; the client should retry later (429 / 529), after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineNotReady(Exception):
    """The model is still loading (or failed to load)."""


class StageLost(RuntimeError):
    """A later pipeline stage of the replica went away (its process or its machine) during a step.
    The requests whose KV cache it held are ended with this message; ``request_ids`` names them (set
    by the engine), and requests still waiting go on once the stage is back."""

    def __init__(self, message: str, request_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.request_ids = request_ids

    def __reduce__(self):  # picklable with its ids (it crosses Ray processes)
        return type(self), (str(self), self.request_ids)


MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows
MAX_LOGIT_BIAS = 300  # biased tokens per request, as OpenAI allows
MAX_STOP_TOKEN_IDS = 256


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest
    grammar: str | None = None  # constrained decoding: an llguidance grammar (JSON text) the output must match
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit before sampling

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0 <= self.temperature < math.inf, "temperature must be >= 0 and finite"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (0 < self.repetition_penalty < math.inf, "repetition_penalty must be > 0 and finite"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens"),
            (all(isinstance(t, int) and t >= 0 for t in self.logit_bias), "logit_bias keys must be token ids"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: prompt token ids and sampling parameters. ``session_key`` (an
    ``x-session-id`` header, else a hash of the conversation's opening) lets a router keep a
    session on one replica, where its prefix cache is."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    session_key: str | None = None
    tenant: str = ""  # whose request (a session, a client address): free slots go to tenants in turn


@dataclass
class RequestMetrics:
    """Timings (seconds since the epoch) and token counts of one request."""

    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused instead of computed

    def timings(self) -> dict[str, float | int]:
        """Prompt and decode speed in the style of llama.cpp's ``timings`` response field."""
        start = self.first_scheduled or self.arrival
        prompt_s = (self.first_token - start) if self.first_token else 0.0
        decode_n = max(self.num_output_tokens - 1, 0)
        decode_s = (self.finished - self.first_token) if self.finished and self.first_token else 0.0
        computed = self.num_prompt_tokens - self.num_cached_tokens
        return {
            "prompt_n": computed,
            "prompt_ms": prompt_s * 1e3,
            "prompt_per_second": computed / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": self.num_output_tokens,
            "predicted_ms": decode_s * 1e3,
            "predicted_per_second": decode_n / decode_s if decode_s > 0 else 0.0,
            "cache_n": self.num_cached_tokens,
            "queue_ms": max(start - self.arrival, 0.0) * 1e3,
        }


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model (before penalties, temperature and
    filtering), and the likeliest alternatives as (token id, log-probability), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationChunk:
    """What one engine step added to one request: the new tokens and text, and how it stands
    (``metrics`` is a snapshot; its totals are final once ``finished``)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error (this request alone failed)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them

    @property
    def timings(self) -> dict[str, float | int]:
        """llama.cpp-style speeds, once finished (empty before)."""
        return self.metrics.timings() if self.finished else {}

    @staticmethod
    def merge(chunks: list[GenerationChunk]) -> GenerationChunk:
        """Consecutive chunks of one request as one (tokens and text joined, the last one's state):
        a remote stream sends what piled up since its last send in one message."""
        if len(chunks) == 1:
            return chunks[0]
        last = chunks[-1]
        logprobs = None if last.logprobs is None else [lp for c in chunks for lp in c.logprobs or ()]
        return GenerationChunk(last.request_id, [t for c in chunks for t in c.token_ids],
                               "".join(c.text for c in chunks), last.finished, last.finish_reason, last.stop_reason,
                               last.metrics, logprobs)


@dataclass
class RequestOutput:
    """A request after an engine step, in-process: the step's chunk plus everything so far."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str  # every generated character so far (stop strings cut)
    chunk: GenerationChunk

    @property
    def request_id(self) -> str:
        return self.chunk.request_id

    @property
    def delta_token_ids(self) -> list[int]:
        return self.chunk.token_ids

    @property
    def delta_text(self) -> str:
        return self.chunk.text

    @property
    def finished(self) -> bool:
        return self.chunk.finished

    @property
    def finish_reason(self) -> str | None:
        return self.chunk.finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.chunk.stop_reason

    @property
    def metrics(self) -> RequestMetrics:
        return self.chunk.metrics


@dataclass(frozen=True)
class ModelInfo:
    """What the API layer needs to know about the served model."""

    name: str
    path: str
    max_model_len: int
    vocab_size: int
    created: int


class EngineClient(Protocol):
    """How the API layer talks to an engine (in-process, or the cluster's replicas)."""

    model: ModelInfo

    @property
    def ready(self) -> bool: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]: ...

    def stats(self) -> dict[str, Any]: ...

    async def resize_expert_cache(self, size: str, replica: str | None = None) -> dict[str, dict[str, int]]:
        """Resize the device expert cache (``--expert-cache``'s forms) at the next step boundary, of
        one replica or all; {replica: slots, bytes, kept, dropped}. LookupError for an unknown
        replica, ValueError where there is no cache."""
        ...

    def close(self) -> None: ...
