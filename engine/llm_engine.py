"""The engine loop: schedule -> execute -> update, plus request bookkeeping around it."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.anchors import anchor_token_ids
from engine.config import ConfigError
from engine.detokenizer import IncrementalDetokenizer
from engine.ftw import load_checkpoint
from engine.hierarchy.host_pool import HostExpertPool
from engine.hierarchy.setup import HierarchyConfig, build_hierarchy
from engine.kernels import cpu_decode_ops
from engine.kv_cache import BlockAllocator, PagedKVCache
from engine.prefix_cache import RadixCache
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, sample_token
from engine.scheduler import RecurrentConfig, ScheduledStep, Scheduler, SchedulerConfig
from engine.state_checkpoints import POLICIES, CheckpointStore, checkpoint_positions
from engine.state_pool import RecurrentStatePool
from engine.tokenizer import load_tokenizer


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings; every field has a sane default for a single machine."""

    dtype: str | None = None  # None/"auto": the checkpoint's dtype
    block_size: int = 16
    kv_cache_tokens: int | None = None  # default: enough for max_num_seqs full-length sequences, within kv_cache_bytes
    kv_cache_bytes: int = 2 << 30
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 512
    max_model_len: int | None = None  # default: min(max_position_embeddings, 32768)
    # Expert hierarchy (see engine.hierarchy.setup.HierarchyConfig for the meaning of each).
    expert_device: str = "auto"  # auto | cuda | virtual | none
    expert_cache: str | float | None = None  # fraction, bytes ("2GiB") or "Nslots"; default: what fits
    virtual_link_gbps: float | None = None
    q_mode: str = "table"  # table | step | zero | all
    expert_bandwidths: tuple[float, float] | None = None  # (B_P, B_H) bytes/s instead of measuring
    double_buffer: bool = True  # prefill streams whole layers through two buffers (False: one)
    prefix_caching: bool = False  # reuse the KV blocks of any cached whole-block prompt prefix
    # Hybrid models with prefix caching: where to keep recurrent-state checkpoints (none, prompt-end,
    # periodic, anchors = semantic anchors + periodic), the periodic interval, and their byte budget.
    checkpoints: str = "anchors"
    checkpoint_interval: int = 64
    checkpoint_bytes: int = 1 << 30
    stream_min_tokens: int | None = None  # steps of at least this many tokens stream; None: from costs
    # Where the CPU share runs: inline | thread | process | external (the last two need host_pool_name;
    # external: a worker started by someone else, e.g. the cluster's CPU-worker actor, serves the ring).
    cpu_experts: str = "inline"
    record_routing: str | None = None  # JSON-lines file of routed expert ids per step and layer
    host_pool_name: str | None = None  # put the expert pool in this named shared-memory segment
    verify_checksums: bool = True  # FTW: check every extent's CRC while loading


# (prompt ids, output ids so far, fp32 logits [V]) -> logits: applied before penalties and sampling.
LogitsProcessor = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]


@dataclass
class RequestMetrics:
    """Timings of one request (seconds since the epoch)."""

    arrival: float
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


@dataclass
class RequestOutput:
    """A request's state after a step: everything so far plus what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any


@dataclass
class _TextState:
    detok: IncrementalDetokenizer | None
    stop_holdback: int
    text: str = ""
    emitted: int = 0
    metrics: RequestMetrics | None = None


class LLMEngine:
    """Continuous-batching engine over one model. Not thread-safe: drive it from one thread."""

    def __init__(self, model_path: str | Path, config: EngineConfig | None = None, show_progress: bool = False,
                 logits_processors: Sequence[LogitsProcessor] = ()):
        self.config = config or EngineConfig()
        self.logits_processors = tuple(logits_processors)
        cpu_decode_ops()  # build or load the native kernels now, not during the first request
        self.host_pool: HostExpertPool | None = self._attach_filled_pool()
        loaded = load_checkpoint(
            model_path, self.config.dtype, self._pool_factory(), self.config.verify_checksums, show_progress,
            filled_pool=self.host_pool.tensors if self.host_pool is not None else None,
        )
        if self.host_pool is not None and self.host_pool.owner:
            self.host_pool.mark_filled()
        self.model_config = loaded.config
        self.pool = loaded.pool
        self.tokenizer = load_tokenizer(model_path)
        cfg = self.model_config
        self.max_model_len = self.config.max_model_len or min(cfg.max_position_embeddings, 32768)
        kv_tokens = self._kv_tokens()
        bs = self.config.block_size
        num_blocks = -(-kv_tokens // bs)
        kv = PagedKVCache(cfg.num_layers, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                          attention_layers=cfg.attention_layer_ids)
        self.experts = build_hierarchy(cfg, self.pool, HierarchyConfig(
            device=self.config.expert_device, expert_cache=self.config.expert_cache,
            virtual_link_gbps=self.config.virtual_link_gbps, q_mode=self.config.q_mode,
            bandwidths=self.config.expert_bandwidths, cpu_workers=self.config.cpu_experts,
            max_tokens=max(self.config.max_num_batched_tokens, self.config.prefill_chunk),
            double_buffer=self.config.double_buffer, stream_min_tokens=self.config.stream_min_tokens,
        ), pool_name=self.host_pool.name if self.host_pool is not None else None)
        if self.experts is not None:
            loaded.model.set_expert_backend(self.experts)
        self._routing_file = None
        if self.config.record_routing:
            if self.experts is None:
                raise ValueError("recording routing needs the expert hierarchy (--virtual-device or a GPU)")
            self._routing_file = open(self.config.record_routing, "w")  # noqa: SIM115 - closed by close()
            self.experts.routing_log = []
        self._steps = 0
        states = RecurrentStatePool(cfg, self.config.max_num_seqs) if cfg.linear_layer_ids else None
        self.runner = ModelRunner(loaded.model, kv, states)
        sched_cfg = SchedulerConfig(
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            prefill_chunk=self.config.prefill_chunk,
            max_model_len=self.max_model_len,
        )
        prefix = RadixCache(bs) if self.config.prefix_caching else None
        self.scheduler = Scheduler(sched_cfg, BlockAllocator(num_blocks, bs), prefix, self._recurrent_config(states))
        self.anchor_ids = anchor_token_ids(self.tokenizer) if self.tokenizer is not None else frozenset()
        self._requests: dict[str, Request] = {}
        self._text: dict[str, _TextState] = {}
        self._ids = itertools.count()
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    def _recurrent_config(self, states: RecurrentStatePool | None) -> RecurrentConfig | None:
        if states is None:
            return None
        policy, interval = self.config.checkpoints, self.config.checkpoint_interval
        if policy not in POLICIES:
            raise ValueError(f"unknown checkpoint policy '{policy}' (one of {', '.join(POLICIES)})")
        if interval <= 0 or interval % self.config.block_size:
            raise ValueError(f"checkpoint_interval must be a positive multiple of the block size "
                             f"({self.config.block_size}), got {interval}")
        store = CheckpointStore(self.config.checkpoint_bytes) if policy != "none" else None
        return RecurrentConfig(states.num_slots, store)

    def _capture_plan(self, scheduled: ScheduledStep) -> dict[str, dict[int, frozenset[str]]]:
        """Per request of the step: positions to checkpoint the recurrent state at (-> anchor kinds)."""
        store = self.scheduler.checkpoints
        if store is None:
            return {}
        nbytes = self.runner.states.nbytes
        plan = {}
        for req, n in scheduled.items:
            found = checkpoint_positions(req.tokens, req.num_computed, req.num_computed + n, len(req.prompt_ids),
                                         self.config.block_size, self.config.checkpoints,
                                         self.config.checkpoint_interval, self.anchor_ids)
            found = store.worth_taking(found, nbytes)
            if found:
                plan[req.request_id] = found
        return plan

    def _attach_filled_pool(self) -> HostExpertPool | None:
        """An existing, completely filled shared pool of this name (a restarted executor reuses its
        pages instead of reading the experts again), or None."""
        name = self.config.host_pool_name
        if not name:
            return None
        try:
            pool = HostExpertPool.attach(name)
        except FileNotFoundError:
            return None
        if not pool.filled:
            pool.close()
            raise ConfigError(f"shared expert pool '{name}' exists but was never completely filled (its owner "
                              f"died while loading?); remove it with `hearth pool clean {name}`")
        return pool

    def _pool_factory(self):
        """Storage for the expert banks: a named shared-memory segment when asked for."""
        name = self.config.host_pool_name
        if not name or self.host_pool is not None:
            return None

        def create(gate_up_shape, down_shape, dtype):
            self.host_pool = HostExpertPool.create(name, gate_up_shape, down_shape, dtype)
            return self.host_pool.tensors

        return create

    def _kv_tokens(self) -> int:
        if self.config.kv_cache_tokens:
            return self.config.kv_cache_tokens
        cfg = self.model_config
        layers = len(cfg.attention_layer_ids)
        per_token = PagedKVCache.bytes_per_token(layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
        wanted = self.config.max_num_seqs * self.max_model_len
        return max(self.config.block_size, min(wanted, self.config.kv_cache_bytes // per_token))

    # -- requests -------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Raises ValueError for prompts that cannot run."""
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the maximum context is {self.max_model_len}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id '{request_id}' is already in use")
        now = time.time()
        req = Request(request_id, ids, params, arrival=now)
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        self.scheduler.add(req)
        self._requests[request_id] = req
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) if self.tokenizer else None
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self._text[request_id] = _TextState(detok, holdback, metrics=RequestMetrics(now, num_prompt_tokens=len(ids)))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (e.g. the client went away)."""
        req = self._requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, "abort")
        self._text.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the requests that produced a token."""
        scheduled = self.scheduler.schedule()
        if not scheduled.items:
            return []
        self._mark_scheduled(scheduled)
        if self.experts is not None:
            self.experts.begin_step(scheduled.num_tokens, self._next_prefill_tokens(scheduled))
        plan = self._capture_plan(scheduled)
        logits, sampled = self.runner.execute(scheduled.items, {rid: list(p) for rid, p in plan.items()})
        self._write_routing()
        self._steps += 1
        return self._update(scheduled, logits, sampled, plan)

    def _next_prefill_tokens(self, scheduled: ScheduledStep) -> int:
        """About how many prompt tokens the step after this one will prefill (chunks left of the
        prompts in this step, and prompts still waiting), so a streamed prefill can prefetch."""
        chunk = self.config.prefill_chunk
        left = sum(min(req.num_pending - n, chunk) for req, n in scheduled.items if req.num_pending > n)
        waiting = sum(min(req.num_pending, chunk) for req in self.scheduler.waiting)
        return min(left + waiting, self.config.max_num_batched_tokens)

    def _write_routing(self) -> None:
        if self._routing_file is None:
            return
        log = self.experts.routing_log
        layers = {str(layer): ids for layer, ids in log}
        self._routing_file.write(json.dumps({"step": self._steps, "num_experts": self.model_config.num_experts,
                                             "layers": layers}) + "\n")
        log.clear()

    def close(self) -> None:
        """Stop the CPU expert workers, close the routing record and release a shared pool."""
        if self.experts is not None:
            self.experts.close()
        if self.host_pool is not None:
            self.host_pool.close()
            self.host_pool = None
        if self._routing_file is not None:
            self._routing_file.close()
            self._routing_file = None

    def _mark_scheduled(self, scheduled: ScheduledStep) -> None:
        now = time.time()
        for req, _ in scheduled.items:
            metrics = self._text[req.request_id].metrics
            if metrics.first_scheduled is None:
                metrics.first_scheduled = now

    def _update(self, scheduled: ScheduledStep, logits: torch.Tensor, sampled: list[Request],
                plan: dict[str, dict[int, frozenset[str]]] | None = None) -> list[RequestOutput]:
        for req, n in scheduled.items:
            req.num_computed += n
            self.scheduler.cache_computed(req)
        for req, position, snapshot in self.runner.last_captures:
            self.scheduler.add_checkpoint(req, position, snapshot, (plan or {})[req.request_id][position])
        outputs = []
        for row, req in enumerate(sampled):
            row_logits = logits[row]
            for processor in self.logits_processors:
                row_logits = processor(req.prompt_ids, req.output_ids, row_logits)
            token = sample_token(row_logits, req.params, req.prompt_ids, req.output_ids, req.generator)
            req.output_ids.append(token)
            outputs.append(self._after_token(req, token))
        return outputs

    def _after_token(self, req: Request, token: int) -> RequestOutput:
        state = self._text[req.request_id]
        now = time.time()
        if state.metrics.first_token is None:
            state.metrics.first_token = now
            state.metrics.num_cached_tokens = req.num_cached_tokens
        reason = self._stop_reason(req, token)
        stop_reason: str | int | None = token if reason == "stop" and token in req.params.stop_token_ids else None
        if state.detok is not None:
            prev_len = len(state.text)
            state.text += state.detok.add(token)
            if reason is not None:
                state.text += state.detok.flush()
            hit = self._find_stop(state.text, req.params.stop, prev_len)
            if hit is not None:
                cut, stop_reason = hit
                state.text, reason = state.text[:cut], "stop"
        if reason is not None:
            self.scheduler.finish(req, reason)
            state.metrics.finished = now
        visible = len(state.text) if reason else max(state.emitted, len(state.text) - state.stop_holdback)
        delta, state.emitted = state.text[state.emitted : visible], visible
        state.metrics.num_output_tokens = len(req.output_ids)
        out = RequestOutput(
            req.request_id, req.prompt_ids, list(req.output_ids), state.text[:visible], [token], delta,
            reason is not None, reason, state.metrics, stop_reason,
        )
        if reason is not None:
            self._requests.pop(req.request_id, None)
            self._text.pop(req.request_id, None)
        return out

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _find_stop(text: str, stops: list[str], prev_len: int) -> tuple[int, str] | None:
        """(position, stop string) of the earliest stop string that the newest text completed."""
        hits = [(text.find(s, max(0, prev_len - len(s) + 1)), s) for s in stops]
        hits = [h for h in hits if h[0] >= 0]
        return min(hits) if hits else None

    def stats(self) -> dict[str, Any]:
        """Scheduler and KV occupancy, plus the expert hierarchy's counters when it runs."""
        out: dict[str, Any] = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_free": self.scheduler.allocator.num_free,
            "kv_blocks_total": self.scheduler.allocator.num_blocks,
        }
        if self.scheduler.checkpoints is not None:
            out.update(self.scheduler.checkpoints.stats())
        if self.experts is not None:
            out["experts"] = self.experts.stats()
            if self.experts.streamer is not None:
                out["prefill_layers"] = self.experts.prefill_layers()  # per MoE layer: copy, wait, compute
        return out
