"""Running the HTTP and gRPC servers: in the foreground (``hearth serve``) or in a background
thread (tests and benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import uvicorn

from hearth.config import EngineConfig, ServingConfig
from hearth.engine import LLMEngine
from hearth.engine.checkpoint import load_config
from hearth.serving.admission import AdmissionLimits
from hearth.serving.app import ServerState, create_app
from hearth.serving.client import InProcessEngineClient
from hearth.serving.grpc_service import add_service
from hearth.serving.security import AllowedHosts, guarded_h11_protocol


def build_state(model: str | Path, engine: EngineConfig, serving: ServingConfig,
                logits_processors: Sequence[Any] = (), show_progress: bool = False) -> ServerState:
    """An in-process engine client (loading in its thread) and the state the handlers share."""

    def factory():
        return LLMEngine(model, engine, show_progress=show_progress, logits_processors=logits_processors)

    names = list(serving.model_names) or [Path(model).name]
    limits = AdmissionLimits(serving.max_waiting, serving.max_queued_tokens, serving.max_queue_wait or None)
    client = InProcessEngineClient(model, factory, names[0], describe=functools.partial(describe_model, model, engine),
                                   limits=limits)
    return ServerState(client, names, serving.api_keys(), serving.tool_parser, serving.max_body_bytes,
                       serving.intake_timeout, **guard_options(serving))


def guard_options(serving: ServingConfig) -> dict[str, Any]:
    """The :class:`ServerState` settings that keep browsers and clients apart: allowed Host names,
    CORS origins and the stored responses' budget."""
    return {"hosts": AllowedHosts.for_server(serving.host, serving.allowed_hosts),
            "cors_origins": serving.cors_origins, "response_store_bytes": serving.response_store_bytes}


def describe_model(model: str | Path, engine: EngineConfig) -> tuple[int, int]:
    """(context length, vocabulary size) from the checkpoint's config alone, before the weights load."""
    _, cfg = load_config(model)
    return engine.context_length(cfg.max_position_embeddings), cfg.vocab_size


class _Uvicorn(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the owner of the thread/loop handles signals
        pass


async def serve_async(state: ServerState, options: ServingConfig, started: threading.Event | None = None,
                      stop: asyncio.Event | None = None) -> None:
    """Serve HTTP (and gRPC) until ``stop`` is set (or forever)."""
    config = uvicorn.Config(create_app(state), host=options.host, port=options.port, log_config=None,
                            access_log=False, lifespan="off", timeout_graceful_shutdown=2,
                            http=guarded_h11_protocol(options.read_timeout))
    http = _Uvicorn(config)
    grpc_server = None
    if options.grpc_port is not None:
        size = options.max_body_bytes  # the HTTP body limit holds for gRPC messages too
        grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", size)])
        add_service(grpc_server, state)
        grpc_server.add_insecure_port(f"{_grpc_host(options.host)}:{options.grpc_port}")
        await grpc_server.start()
    task = asyncio.create_task(http.serve())
    while not http.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        task.result()  # raises the bind error
    warming = asyncio.create_task(state.warm_when_ready())
    if started is not None:
        started.set()
    try:
        if stop is None:
            await task
        else:
            await stop.wait()
            http.should_exit = True
            await task
    finally:
        warming.cancel()
        if grpc_server is not None:
            await grpc_server.stop(grace=1)


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class BackgroundServer:
    """A server on its own event loop thread, for tests and benchmarks: ``with BackgroundServer(...)``."""

    def __init__(self, state: ServerState, options: ServingConfig, on_loop_start=None) -> None:
        """``on_loop_start``: a coroutine function run on the server's loop as it starts (e.g. the
        router's first health check)."""
        self.state = state
        self.options = options
        self._on_loop_start = on_loop_start
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hearth-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.options.port}"

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The server's event loop (to run coroutines on it from other threads)."""
        return self._loop

    def start(self, timeout: float = 300) -> BackgroundServer:
        self._thread.start()
        if not self._started.wait(timeout) or self._error is not None:
            raise RuntimeError(f"the server did not start: {self._error}")
        self.state.client.wait_ready(timeout)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        if self._on_loop_start is not None:
            self._loop.create_task(self._on_loop_start())
        try:
            self._loop.run_until_complete(serve_async(self.state, self.options, self._started, self._stop))
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._started.set()

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=30)
        self.state.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the record's structured fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextLogFormatter(logging.Formatter):
    """Human-readable lines; structured fields appended as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        return super().format(record) + "".join(f" {k}={v}" for k, v in fields.items())


def configure_logging(fmt: str = "json", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if fmt == "json" else TextLogFormatter())
    for name in ("hearth", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (for tests and benchmarks)."""
    with contextlib.closing(socket.socket()) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
