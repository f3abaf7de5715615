"""The in-process engine client: an :class:`~hearth.proto.contracts.EngineClient` over an engine in
this process.

It owns an :class:`~hearth.engine.llm_engine.LLMEngine` and drives it from one background thread:
requests and aborts arrive through a queue, every step's chunks are handed to the waiting
coroutines on their event loop. (The cluster's router is the other implementation of the contract.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hearth.engine.experts import watch_engine
from hearth.proto.contracts import (
    EngineNotReady,
    EngineOverloaded,
    GenerateRequest,
    GenerationChunk,
    ModelInfo,
    StageLost,
)
from hearth.serving.admission import AdmissionLimits, Backlog, FairQueue, refusal

log = logging.getLogger("hearth.serving")
_STATS_PERIOD_S = 0.25  # engine statistics are refreshed at most this often while it runs
_SPEED_EWMA = 0.3  # weight of the newest finished request in the moving averages


def _ewma(average: float, value: float) -> float:
    """A moving average (the first value starts it)."""
    return value if not average else _SPEED_EWMA * value + (1 - _SPEED_EWMA) * average


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    matcher: Any = None  # the request's grammar, compiled on a worker thread before the engine sees it


class InProcessEngineClient:
    """Runs an :class:`~engine.llm_engine.LLMEngine` in a background thread of this process.

    ``limits`` (default: ``max_waiting`` requests queued beyond those the engine runs at once) say
    when a request is refused with :class:`EngineOverloaded` (``serving/admission.py``). Loading
    happens in the thread too, so a server can answer ``/health`` ("loading") while the weights are
    read.
    """

    def __init__(self, model_path: str | Path, engine_factory: Callable[[], Any], served_name: str | None = None,
                 max_waiting: int = 64, describe: Callable[[], tuple[int, int]] | None = None,
                 limits: AdmissionLimits | None = None) -> None:
        self.model_path = str(model_path)
        self.model = ModelInfo(served_name or Path(model_path).name, self.model_path, 0, 0, int(time.time()))
        self.limits = limits or AdmissionLimits(max_waiting)
        # Admitted requests that have not produced a token yet, their prompt tokens, and the measured
        # prompt speed and time a request holds a slot: what admission estimates a wait from.
        self._waiting = 0
        self._waiting_tokens = 0
        self._held: FairQueue[GenerateRequest] = FairQueue()  # admitted, given to the engine as slots free
        self._prefill_tok_s = 0.0
        self._service_s = 0.0
        self.engine: Any = None
        self.load_error: BaseException | None = None
        self._factory = engine_factory
        self._describe = describe  # (context length, vocab size) from the config, before the weights load
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._in_flight = 0
        self._lock = threading.Lock()
        self._stats: dict[str, Any] = {}
        self._stats_time = 0.0
        self._decode_tok_s = 0.0
        self._loaded = threading.Event()
        self._stopping = False
        self._watcher = None  # the elastic-VRAM watcher, on a GPU
        self.phase = "starting"  # what loading is doing (reported while a start takes long)
        self._thread = threading.Thread(target=self._run, name="hearth-engine", daemon=True)
        self._thread.start()

    # -- public API (any thread / the event loop) -----------------------------------------------
    @property
    def ready(self) -> bool:
        return self._loaded.is_set() and self.engine is not None

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the model is loaded; re-raise a load failure."""
        if not self._loaded.wait(timeout):
            raise TimeoutError("the model did not finish loading in time")
        if self.load_error is not None:
            raise self.load_error

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        """Submit a request and yield its chunks; leaving early (or being cancelled) aborts it."""
        if not self.ready:
            raise EngineNotReady("the model is still loading" if self.load_error is None
                                 else f"the model failed to load: {self.load_error}")
        tokens = len(request.prompt_ids)
        matcher = None
        if request.params.grammar is not None:  # compiled here, off the engine thread (a ValueError: a 400)
            matcher = await asyncio.to_thread(self.engine.grammars.matcher, request.params.grammar,
                                              request.params.stop_token_ids)
        with self._lock:
            refused = refusal(self.backlog(), tokens, self.limits)
            if refused is not None:
                raise EngineOverloaded(refused.reason, refused.retry_after_s)
            self._in_flight += 1
            self._waiting += 1
            self._waiting_tokens += tokens
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), matcher)
        self._streams[request.request_id] = stream
        self._commands.put(("add", request))
        finished = started = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if not started:
                    started = True
                    self._started(tokens)
                if item.finished:
                    self._measure(item)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not started:
                self._started(tokens)
            with self._lock:
                self._in_flight -= 1
            if not finished:
                self._commands.put(("abort", request.request_id))

    def backlog(self) -> Backlog:
        """What waits ahead of a new request now (call with ``_lock`` held)."""
        slots = self.engine.config.scheduler.max_num_seqs
        return Backlog(slots, self._in_flight - self._waiting, self._waiting, self._waiting_tokens,
                       self._prefill_tok_s, self._service_s)

    def _started(self, tokens: int) -> None:
        with self._lock:
            self._waiting -= 1
            self._waiting_tokens -= tokens

    def _measure(self, chunk: GenerationChunk) -> None:
        """Fold a finished request's prompt speed and slot time into the admission estimates."""
        m, timings = chunk.metrics, chunk.timings
        if timings.get("prompt_n", 0) >= 32 and timings.get("prompt_per_second", 0.0) > 0:
            self._prefill_tok_s = _ewma(self._prefill_tok_s, timings["prompt_per_second"])
        if m.finished and (m.first_scheduled or m.arrival):
            self._service_s = _ewma(self._service_s, max(m.finished - (m.first_scheduled or m.arrival), 0.0))

    def stats(self) -> dict[str, Any]:
        """The latest engine statistics (published by the engine thread after each step), with the
        requests in flight and a moving average of finished requests' decode speed."""
        with self._lock:
            return dict(self._stats, in_flight=self._in_flight, decode_tok_s=self._decode_tok_s)

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between two steps (a safe point: no layer is
        running); the future holds its result. Used to push a new q table, probe bandwidths, etc."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping:
            future.set_exception(EngineNotReady("the engine is stopping"))
        elif not self.ready:
            future.set_exception(EngineNotReady("the model is not loaded"))
        else:
            self._commands.put(("call", (fn, future)))
        return future

    async def resize_expert_cache(self, size: str, replica: str | None = None) -> dict[str, dict[str, int]]:
        """Resize the engine's device expert cache between two steps (elastic VRAM); {"local": report}."""
        if replica not in (None, "local"):
            raise LookupError(f"no replica '{replica}': this server runs one engine, 'local'")
        report = await asyncio.wrap_future(self.call(lambda engine: engine.resize_expert_cache(size)))
        if self._watcher is not None:  # an operator's size is the new ceiling: the watcher must not undo it
            self._watcher.set_ceiling(report["bytes"])
        return {"local": report}

    def _resize_now(self, nbytes: int) -> dict[str, int]:
        """Resize the expert cache to ``nbytes`` at the next step boundary and wait for it."""
        return self.call(lambda engine: engine.resize_expert_cache(f"{nbytes}b")).result(timeout=300)

    def close(self) -> None:
        """Stop the engine thread (aborting what runs) and release the engine."""
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.phase = "reading the model's config"
            if self._describe is not None:
                self.model = ModelInfo(self.model.name, self.model_path, *self._describe(), self.model.created)
            self.phase = "loading the weights and building the engine"
            self.engine = self._factory()
            cfg = self.engine.model_config
            self.model = ModelInfo(self.model.name, self.model_path, self.engine.max_model_len, cfg.vocab_size,
                                   self.model.created)
            if getattr(self.engine, "tokenizer", None) is not None:
                self.phase = "preparing constrained decoding"  # so that the first such request stalls nobody
                self.engine.grammars.prepare()
            self._publish_stats()
            self.phase = "ready"
        except BaseException as exc:  # noqa: BLE001 - reported through /health and every request
            log.exception("loading %s failed", self.model_path)
            self.load_error = exc
            self._loaded.set()
            return
        self._loaded.set()
        self._watcher = watch_engine(self.engine, self._resize_now)  # elastic VRAM on a GPU, where NVML reads
        try:
            self._loop()
        finally:
            if self._watcher is not None:
                self._watcher.stop()
            self.engine.close()

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            block = not engine.has_unfinished() and not self._held
            try:
                while True:
                    cmd, arg = self._commands.get(block=block)
                    block = False
                    if cmd == "stop":
                        self._fail_pending()
                        return
                    self._apply(cmd, arg)
            except queue.Empty:
                pass
            self._feed()
            if engine.has_unfinished():
                self._step()

    def _fail_pending(self) -> None:
        """Calls still queued at stop get an error instead of never finishing (whoever waits on
        them, e.g. the VRAM watcher, would otherwise hold up the shutdown)."""
        while True:
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd == "call":
                arg[1].set_exception(EngineNotReady("the engine is stopping"))

    def _apply(self, cmd: str, arg: Any) -> None:
        if cmd == "call":
            fn, future = arg
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            self._publish_stats()
            return
        if cmd == "abort":
            if not self._held.remove(lambda r: r.request_id == arg):
                self.engine.abort(arg)
            self._publish_stats()
            return
        self._held.push(arg.tenant, arg)

    def _feed(self) -> None:
        """Give the engine held requests while it has free slots, the tenants in turn (a request
        waits here rather than in the engine's queue, so that free slots are shared fairly)."""
        slots = self.engine.config.scheduler.max_num_seqs
        while self._held and self.engine.num_unfinished() < slots:
            request = self._held.pop()
            stream = self._streams.get(request.request_id)
            if stream is None:
                continue  # the client left before the engine saw the request
            try:
                self.engine.add_request(request.prompt_ids, request.params, request.request_id, stream.matcher)
            except ValueError as exc:
                self._deliver(request.request_id, exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StageLost as exc:  # the engine ended the requests the stage held; the others go on
            log.warning("%s", exc)
            for rid in exc.request_ids:
                self._deliver(rid, StageLost(str(exc)))
            self._publish_stats()
            return
        except Exception:  # noqa: BLE001 - fail the running requests, keep serving
            log.exception("engine step failed")
            for rid in list(self._streams):
                self.engine.abort(rid)
                self._deliver(rid, RuntimeError("the engine failed during a step (the details are in the server log); "
                                                "this request is lost, retry it"))
            return
        for out in outputs:
            chunk = out.chunk
            if chunk.finish_reason == "error":  # this request alone failed (its sampler or grammar)
                why = chunk.stop_reason  # the client's own doing (its grammar), said to it: a 400
                self._deliver(out.request_id, ValueError(why) if isinstance(why, str) else RuntimeError(
                    "generating this request failed (the details are in the server log); retry it"))
                continue
            self._deliver(out.request_id, chunk)
            speed = chunk.timings.get("predicted_per_second", 0.0)
            if speed > 0:
                self._decode_tok_s = _ewma(self._decode_tok_s, speed)
        now = time.monotonic()
        if now - self._stats_time > _STATS_PERIOD_S or any(out.finished for out in outputs):
            self._publish_stats()
            self._stats_time = now

    def _deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            self.engine.abort(request_id)  # nobody is listening any more
            return
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _publish_stats(self) -> None:
        stats = self.engine.stats()  # read here, in the engine's thread, not when Prometheus scrapes
        stats["waiting"] = stats.get("waiting", 0) + len(self._held)  # admitted, held for a fair turn
        with self._lock:
            self._stats = stats
