"""The engine loop: schedule -> execute -> update, plus request bookkeeping around it."""

from __future__ import annotations

import gc
import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import torch

from hearth.config import ConfigError, EngineConfig
from hearth.engine.cache.anchors import anchor_token_ids
from hearth.engine.cache.kv_pages import BlockAllocator, PagedKVCache, kv_cache_tokens
from hearth.engine.cache.prefix_tree import RadixCache
from hearth.engine.cache.state_checkpoints import CheckpointStore, checkpoint_positions
from hearth.engine.cache.state_slots import RecurrentStatePool
from hearth.engine.checkpoint.common import LoadedModel
from hearth.engine.checkpoint.dispatch import load_checkpoint
from hearth.engine.executor.device_placement import move_module, resolve_device
from hearth.engine.executor.fixed_shape import StaticDecoder
from hearth.engine.executor.memory_plan import (
    MemoryPlan,
    available_memory,
    bytes_by_device,
    executor_bytes,
    tensor_bytes,
)
from hearth.engine.executor.runner import ModelRunner
from hearth.engine.experts.backend import HierarchicalExpertBackend
from hearth.engine.experts.build import build_hierarchy, cache_slots
from hearth.engine.experts.contract import ExpertControl
from hearth.engine.experts.mechanism.host_pool import HostExpertPool
from hearth.engine.kernels.cpu import cpu_decode_ops, int8_mode
from hearth.engine.layers.batch import ForwardBatch
from hearth.engine.models import MoECausalLM
from hearth.engine.request import Request
from hearth.engine.sampling import sample_token, token_logprob
from hearth.engine.scheduler import RecurrentConfig, ScheduledStep, Scheduler
from hearth.engine.text.detokenizer import IncrementalDetokenizer
from hearth.engine.text.grammar import Grammars, GrammarTooSlow, Matcher
from hearth.engine.text.tokenizer import load_tokenizer
from hearth.proto.contracts import (
    GenerationChunk,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    StageLost,
    TokenLogprob,
)

log = logging.getLogger("hearth.engine")


# (prompt ids, output ids so far, fp32 logits [V]) -> logits: applied before penalties and sampling.
LogitsProcessor = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]


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
                 logits_processors: Sequence[LogitsProcessor] = (), layers: tuple[int, int] | None = None,
                 next_stage: Callable[[ForwardBatch, torch.Tensor], torch.Tensor] | None = None):
        """``layers``: run as the pipeline stage holding layers [first, end) only. The first stage
        schedules and samples; ``next_stage`` (batch, its hidden states) -> logits runs the others,
        each an engine of its own whose :meth:`stage_forward` takes the batch."""
        self.config = config = config or EngineConfig()
        self.logits_processors = tuple(logits_processors)
        if config.threads:
            torch.set_num_threads(config.threads)
        cpu_decode_ops()  # load the native kernels (or warn that they are missing) at start, not mid-request
        self.device = resolve_device(config.device)  # refused before anything is loaded
        available = available_memory()
        self.host_pool: HostExpertPool | None = self._attach_filled_pool()
        attached = self.host_pool is not None  # a pool another process filled: already in memory
        loaded = self._load_model(model_path, show_progress, layers)
        self.model_config = loaded.config
        self.pool = loaded.pool
        self.tokenizer = load_tokenizer(model_path)
        cfg = self.model_config
        self.max_model_len = config.context_length(cfg.max_position_embeddings)
        bs = config.kv_cache.block_size
        num_blocks = -(-self._kv_tokens() // bs)
        kv = PagedKVCache.for_model(cfg, num_blocks, bs, self.device)
        self.experts = self._build_experts(loaded.model, kv)
        self._routing_file = self._open_routing_record()
        self._steps = 0
        self._weight_bytes: dict[str, int] | None = None
        self.runner = self._build_runner(loaded.model, kv, layers, next_stage)
        prefix = RadixCache(bs) if config.kv_cache.prefix_caching else None
        self.scheduler = Scheduler(config.scheduler, BlockAllocator(num_blocks, bs), prefix,
                                   self._recurrent_config(cfg, staged=layers is not None))
        self._set_up_requests()
        self.memory = self._memory_plan(loaded.model, kv, self.runner.states, available, attached)
        # The model, tokenizer and grammar tables are long-lived: move them out of the collector's
        # sight, so that the collections the per-step allocations trigger do not walk them again
        # (a full collection over them cost ~5 % of decode time on the ~1B model).
        gc.collect()
        gc.freeze()

    def _load_model(self, model_path: str | Path, show_progress: bool, layers: tuple[int, int] | None) -> LoadedModel:
        """The checkpoint's model and expert pool, in int8-activation mode if asked, the dense part on
        the executor device (the experts stay in the host pool)."""
        config = self.config
        dtype = None if config.dtype == "auto" else config.dtype
        loaded = load_checkpoint(
            model_path, dtype, self._pool_factory(), config.verify_checksums, show_progress,
            filled_pool=self.host_pool.tensors if self.host_pool is not None else None,
            # Quantized experts stay in blocks, through the hierarchy too, unless CPU worker processes
            # (which compute float experts) share the pool.
            keep_blocks=config.experts.cpu_workers in ("inline", "thread"),
            layers=layers,
        )
        if self.host_pool is not None and self.host_pool.owner:
            self.host_pool.mark_filled()
        if config.int8_activations:
            if self.device.type != "cpu":
                raise ConfigError("--int8-activations is a CPU kernel mode: it needs --device cpu")
            int8_mode.enable(loaded.model, loaded.pool)
        elif self.device.type == "cpu" and show_progress:  # a user at a console: say when the mode would pay
            line = int8_mode.hint(int8_mode.model_formats(loaded.model, loaded.pool))
            if line is not None:
                log.warning(line)
        if self.device.type != "cpu":
            move_module(loaded.model, self.device)  # the dense part; the experts stay in the host pool
        return loaded

    def _build_experts(self, model: MoECausalLM, kv: PagedKVCache) -> HierarchicalExpertBackend | None:
        """The expert hierarchy (None where every expert runs on the CPU), installed as the model's
        expert backend."""
        config = self.config
        step_tokens = max(config.scheduler.step_tokens, config.scheduler.prefill_chunk)
        experts = build_hierarchy(self.model_config, self.pool, config.experts, step_tokens,
                                  pool_name=self.host_pool.name if self.host_pool is not None else None,
                                  executor_device=self.device,
                                  in_use=executor_bytes(model, kv, self.device),
                                  # captured steps fill through the fill op (SM loads), not the DMA copy
                                  link_path="fill_op" if config.static_decode == "graph" else "copy")
        if experts is not None:
            model.set_expert_backend(experts)
        return experts

    def _open_routing_record(self) -> IO[str] | None:
        """The file ``record_routing`` names, opened for the routing log (None when not asked)."""
        path = self.config.experts.record_routing
        if not path:
            return None
        if self.experts is None:
            raise ValueError("recording routing needs the expert hierarchy (--virtual-device or a GPU)")
        routing_file = open(path, "w")  # noqa: SIM115 - closed by close()
        self.experts.routing_log = []
        return routing_file

    def _build_runner(self, model: MoECausalLM, kv: PagedKVCache, layers: tuple[int, int] | None,
                      next_stage: Callable[[ForwardBatch, torch.Tensor], torch.Tensor] | None) -> ModelRunner:
        """The model runner with its recurrent-state pool (hybrid models), the later pipeline stages
        and the fixed-shape decoder as configured."""
        config, cfg = self.config, self.model_config
        states = RecurrentStatePool(cfg, config.scheduler.max_num_seqs, self.device) if cfg.linear_layer_ids else None
        runner = ModelRunner(model, kv, states)
        if layers is not None:
            self._check_stage(cfg, next_stage)
        runner.next_stage = next_stage
        if config.static_decode != "off":
            runner.static = StaticDecoder(model, kv, self.max_model_len, config.static_decode,
                                          states=states, experts=self.experts)
            if self.experts is not None:
                runner.static.on_step = self.experts.observe_step  # the tuner times whole steps here
                self.experts.tune_layer_calls = False
                runner.static.after_step = self.experts.check_static_step
        return runner

    def _set_up_requests(self) -> None:
        """Request bookkeeping and what the tokenizer decides for every request: the anchor tokens,
        the end-of-sequence ids and the grammar tables."""
        cfg = self.model_config
        self.anchor_ids = anchor_token_ids(self.tokenizer) if self.tokenizer is not None else frozenset()
        self._requests: dict[str, Request] = {}
        self._text: dict[str, _TextState] = {}
        self._ids = itertools.count()
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        tokenizer_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size, tokenizer_eos, self.eos_token_ids)

    def _memory_plan(self, model: torch.nn.Module, kv: PagedKVCache, states: RecurrentStatePool | None,
                     available: int | None, pool_attached: bool) -> MemoryPlan:
        """What this engine holds in host memory; logged, with a warning when it exceeds what was free."""
        pool = [t for t in vars(self.pool).values() if isinstance(t, torch.Tensor)]
        store = self.scheduler.checkpoints
        plan = MemoryPlan(
            weights=tensor_bytes([*model.parameters(), *model.buffers(), *pool], "cpu"),
            resident=tensor_bytes(pool, "cpu") if pool_attached else 0,
            kv_cache=tensor_bytes(kv.keys + kv.values, "cpu"),
            kv_tokens=self.scheduler.allocator.num_blocks * kv.block_size,
            recurrent_states=states.nbytes * states.num_slots if states is not None else 0,
            checkpoints=store.budget_bytes if store is not None else 0, available=available)
        log.info(plan.describe(), extra={"fields": plan.as_dict()})
        if plan.warning():
            log.warning(plan.warning())
        return plan

    def _recurrent_config(self, cfg, staged: bool) -> RecurrentConfig | None:
        """Hybrid models: a state slot per sequence (on a pipeline stage too where its own layers are
        all full attention: the later stages' states use the same slots), and the state checkpoints
        prefix reuse restores from. Stages keep no checkpoints (each stage's states are its own), so
        a split hybrid model recomputes shared prefixes."""
        if not cfg.hybrid:
            return None
        checkpoints = self.config.checkpoints
        store = CheckpointStore(checkpoints.budget_bytes) if checkpoints.policy != "none" and not staged else None
        return RecurrentConfig(self.config.scheduler.max_num_seqs, store)

    def _capture_plan(self, scheduled: ScheduledStep) -> dict[str, dict[int, frozenset[str]]]:
        """Per request of the step: positions to checkpoint the recurrent state at (-> anchor kinds)."""
        store = self.scheduler.checkpoints
        if store is None:
            return {}
        nbytes = self.runner.states.nbytes
        plan = {}
        for req, n in scheduled.items:
            found = checkpoint_positions(req.tokens, req.num_computed, req.num_computed + n, len(req.prompt_ids),
                                         self.config.kv_cache.block_size, self.config.checkpoints.policy,
                                         self.config.checkpoints.interval, self.anchor_ids)
            found = store.worth_taking(found, nbytes)
            if found:
                plan[req.request_id] = found
        return plan

    def _attach_filled_pool(self) -> HostExpertPool | None:
        """An existing, completely filled shared pool of this name (a restarted executor reuses its
        pages instead of reading the experts again), or None."""
        name = self.config.experts.host_pool
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
        name = self.config.experts.host_pool
        if not name or self.host_pool is not None:
            return None

        def create(gate_up_shape, down_shape, dtype):
            self.host_pool = HostExpertPool.create(name, gate_up_shape, down_shape, dtype)
            return self.host_pool.tensors

        return create

    def _kv_tokens(self) -> int:
        return kv_cache_tokens(self.config, self.model_config, self.max_model_len)

    # -- requests -------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
        matcher: Matcher | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ValueError for prompts that cannot run.
        ``matcher``: the grammar's, compiled beforehand off this thread (``grammars.matcher``)."""
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias) or any(t < 0 or t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"logit_bias and stop_token_ids take token ids in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the maximum context is {self.max_model_len}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id '{request_id}' is already in use")
        now = time.time()
        req = Request(request_id, ids, params, arrival=now)
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        if params.grammar is not None:
            req.matcher = matcher or self.grammars.matcher(params.grammar, params.stop_token_ids)
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

    def num_unfinished(self) -> int:
        """Requests running or waiting to run."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    @property
    def expert_control(self) -> ExpertControl | None:
        """The expert hierarchy's control interface (None without one): call between steps."""
        return self.experts

    def resize_expert_cache(self, size: str) -> dict[str, int]:
        """Elastic VRAM: resize the device expert cache to ``size`` (as ``--expert-cache``: a fraction
        of all experts like ``0.1``, bytes like ``2GiB``, or slots like ``8slots``). Call between
        steps (``EngineClient.call`` does); requests in flight go on with the same results. Returns
        the new slots and bytes and how many cached experts were kept and dropped."""
        if self.experts is None:
            raise ValueError("this engine has no expert cache to resize (it runs every expert on the CPU; "
                             "start it with a GPU or --virtual-device)")
        report = self.experts.resize(cache_slots(size, self.pool, 0))
        if self.runner.static is not None:
            self.runner.static.invalidate()  # its steps read the old arena and tables: compile them again
        return report

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the requests that produced a token."""
        scheduled = self.scheduler.schedule()
        if not scheduled.items:
            return []
        self._mark_scheduled(scheduled)
        step = None
        if self.experts is not None:
            step = self.experts.begin_step(scheduled.num_tokens, self._next_prefill_tokens(scheduled))
        plan = self._capture_plan(scheduled)
        try:
            logits, sampled = self.runner.execute(scheduled.items, {rid: list(p) for rid, p in plan.items()}, step)
        except StageLost as exc:
            raise StageLost(str(exc), self._drop_stage_state()) from exc
        self._write_routing()
        self._steps += 1
        return self._update(scheduled, logits, sampled, plan)

    def _drop_stage_state(self) -> tuple[str, ...]:
        """After a later stage lost its KV cache: end every request that has KV (the running ones) and
        forget the cached prefixes, so that nothing relies on the stage's old pages; the waiting
        requests start afresh. Returns the ended request ids."""
        ended = tuple(req.request_id for req in self.scheduler.running)
        for rid in ended:
            self.abort(rid)
        freed = self.scheduler.forget_prefixes()
        log.warning("a pipeline stage was lost: %d request(s) ended, %d cached prefix block(s) dropped",
                    len(ended), freed)
        return ended

    def _next_prefill_tokens(self, scheduled: ScheduledStep) -> int:
        """About how many prompt tokens the step after this one will prefill (chunks left of the
        prompts in this step, and prompts still waiting), so a streamed prefill can prefetch."""
        chunk = self.config.scheduler.prefill_chunk
        left = sum(min(req.num_pending - n, chunk) for req, n in scheduled.items if req.num_pending > n)
        waiting = sum(min(req.num_pending, chunk) for req in self.scheduler.waiting)
        return min(left + waiting, self.config.scheduler.step_tokens)

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
            try:
                token, logprob = self._pick(req, logits[row])
            except GrammarTooSlow as exc:  # the client's grammar: its request ends, saying why
                log.info("request %s: %s", req.request_id, exc)
                outputs.append(self._failed(req, str(exc)))
                continue
            except Exception:  # noqa: BLE001 - one request's sampler or grammar fails alone
                log.exception("sampling request %s failed; it ends with finish_reason 'error'", req.request_id)
                outputs.append(self._failed(req))
                continue
            outputs.append(self._after_token(req, token, logprob))
        return outputs

    def _pick(self, req: Request, raw: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """The next token of ``req`` from its raw logits [V] (processors, grammar, sampler), appended."""
        row_logits = raw
        for processor in self.logits_processors:
            row_logits = processor(req.prompt_ids, req.output_ids, row_logits)
        if req.matcher is not None:
            row_logits = req.matcher.mask(row_logits, raw)
        token = sample_token(row_logits, req.params, req.prompt_ids, req.output_ids, req.generator)
        req.output_ids.append(token)
        if req.matcher is not None:
            req.grammar_done = req.matcher.advance(token)
        logprob = token_logprob(raw, token, req.params.logprobs) if req.params.logprobs is not None else None
        return token, logprob

    def _failed(self, req: Request, why: str | None = None) -> RequestOutput:
        """End ``req`` with finish_reason "error" (the others in the step go on); ``why``, for the
        client, travels as the chunk's stop_reason."""
        state = self._text.pop(req.request_id)
        self._requests.pop(req.request_id, None)
        self.scheduler.finish(req, "error")
        state.metrics.finished = time.time()
        chunk = GenerationChunk(req.request_id, [], "", True, "error", why, replace(state.metrics))
        return RequestOutput(req.prompt_ids, list(req.output_ids), state.text[:state.emitted], chunk)

    def _after_token(self, req: Request, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
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
        chunk = GenerationChunk(req.request_id, [token], delta, reason is not None, reason, stop_reason,
                                replace(state.metrics), None if logprob is None else [logprob])
        out = RequestOutput(req.prompt_ids, list(req.output_ids), state.text[:visible], chunk)
        if reason is not None:
            self._requests.pop(req.request_id, None)
            self._text.pop(req.request_id, None)
        return out

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids) or req.grammar_done:
            # An output that ends before its grammar is whole is cut short, not finished.
            return "length" if req.matcher is not None and not req.matcher.complete else "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _find_stop(text: str, stops: list[str], prev_len: int) -> tuple[int, str] | None:
        """(position, stop string) of the earliest stop string that the newest text completed."""
        hits = [(text.find(s, max(0, prev_len - len(s) + 1)), s) for s in stops]
        hits = [h for h in hits if h[0] >= 0]
        return min(hits) if hits else None

    def memory_by_device(self) -> list[dict[str, Any]]:
        """What this engine holds where: [{"device", "use", "bytes"}] for the dense weights, the KV
        cache, the expert pool and the expert cache's slot arena ("virtual" for the virtual device)."""
        if self._weight_bytes is None:  # fixed after loading; the slot arena changes with resizes
            model = self.runner.model
            self._weight_bytes = bytes_by_device([*model.parameters(), *model.buffers()])
        kv = self.runner.kv
        rows = [("weights", self._weight_bytes), ("kv_cache", bytes_by_device(kv.keys + kv.values)),
                ("expert_pool", bytes_by_device([self.pool.gate_up, self.pool.down]))]
        if self.experts is not None:
            device = self.experts.device
            where = "virtual" if device.kind == "virtual" else str(device.gate_up.device)  # "cuda:0", not "cuda"
            rows.append(("expert_cache", {where: device.gate_up.nbytes + device.down.nbytes}))
        return [{"device": d, "use": use, "bytes": n} for use, by_device in rows for d, n in by_device.items()]

    def stats(self) -> dict[str, Any]:
        """Scheduler and KV occupancy, memory by device, and the expert hierarchy's counters when it runs."""
        out: dict[str, Any] = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_free": self.scheduler.allocator.num_free,
            "kv_blocks_total": self.scheduler.allocator.num_blocks,
            # Blocks of finished requests kept for prefix reuse: evicted when space is needed.
            "kv_blocks_cached": self.scheduler.prefix.evictable_blocks() if self.scheduler.prefix is not None else 0,
        }
        if self.scheduler.checkpoints is not None:
            out.update(self.scheduler.checkpoints.stats())
        out["memory"] = self.memory_by_device()
        if self.runner.static is not None:  # fixed-shape decode steps: steps, buckets, CUDA graphs skipped
            out["static_decode"] = self.runner.static.stats()
        if self.experts is not None:
            out["experts"] = self.experts.stats()
            if self.experts.streamer is not None:
                out["prefill_layers"] = self.experts.prefill_layers()  # per MoE layer: copy, wait, compute
        return out

    def prefix_summary(self, limit: int = 4096) -> dict[str, Any] | None:
        """What a router needs to route by cached prefix: the block size and the chained hashes of
        up to ``limit`` cached blocks, most recently used first (None without a prefix cache)."""
        prefix = self.scheduler.prefix
        if prefix is None:
            return None
        return {"block_size": prefix.block_size, "hashes": prefix.block_hashes(limit)}

    def _check_stage(self, cfg, next_stage) -> None:
        first, end = cfg.layer_range
        if self.config.static_decode != "off":
            raise ConfigError("pipeline stages run eager steps for now (--static-decode off)")
        if first == 0 and end < cfg.num_layers and next_stage is None:
            raise ConfigError(f"the first stage [{first}, {end}) needs the later stages (next_stage) to reach "
                              f"the model's {cfg.num_layers} layers")

    @torch.inference_mode()
    def stage_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """A later pipeline stage's step: the first stage's ``batch`` (the same block tables: the KV
        caches of all stages have the same blocks) and the previous stage's hidden states [T, H]; its
        hidden states, or the logits on the last stage."""
        if batch.token_ids.device != self.device:  # from a stage on another machine or device
            batch = batch.moved(self.device)
        states = self.runner.states
        if states is not None:  # a hybrid model's requests new in this step start from zeros here too
            for slot in batch.fresh_slots:
                states.prepare(slot, None)
        if self.experts is not None:  # this stage's own hierarchy decides how its MoE layers run
            told = batch.experts
            batch = replace(batch, experts=self.experts.begin_step(
                told.num_tokens if told else int(batch.token_ids.numel()), told.next_tokens if told else 0))
        return self.runner.model(batch, self.runner.kv, self.runner.states, hidden.to(self.device))

