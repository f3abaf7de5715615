"""The FastAPI application: both protocols, health, metrics, API-key check and error shapes."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from hearth.engine import load_tokenizer
from hearth.engine.checkpoint import load_config
from hearth.serving import admin_api, anthropic_api, openai_api, openapi, responses_api
from hearth.serving.constraints import check_grammar
from hearth.serving.errors import APIError, check_json_schema, key_matches, protocol_of
from hearth.serving.frontend import ModelFrontend
from hearth.serving.metrics import ServerMetrics
from hearth.serving.responses_format import ResponseStore
from hearth.serving.security import AllowedHosts, BrowserGuard
from hearth.serving.session import request_owner, request_tenant
from hearth.serving.status_page import status_page_html
from hearth.serving.transport import ClientGone

log = logging.getLogger("hearth.serving")
_OPEN_PATHS = {"/health"}
R = TypeVar("R")
_TRIM_AFTER_BYTES = 1 << 20  # a request body this large gets its memory returned once it is prepared


class ServedModel:
    """One model a server serves: the names it answers to, its engine client, and its tokenizer-side
    frontend (built by the first request that needs it)."""

    def __init__(self, names: list[str], client: Any, tool_parser: str | None = None) -> None:
        self.names, self.client, self.tool_parser = names, client, tool_parser
        self._frontend: ModelFrontend | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def frontend(self) -> ModelFrontend:
        """Built once, one thread at a time: the intake threads would otherwise import and build it
        together, and transformers' lazy imports are not safe to race."""
        if self._frontend is None:
            with self._lock:
                if self._frontend is None:
                    self._frontend = self._build_frontend()
        return self._frontend

    def _build_frontend(self) -> ModelFrontend:
        self.check_ready()
        path = Path(self.client.model.path)
        _, cfg = load_config(path)
        model = self.client.model
        return ModelFrontend(load_tokenizer(path), cfg.architecture, model.max_model_len, model.vocab_size,
                             self.tool_parser)

    def warm(self) -> None:
        """Build the frontend and run the schema checks once, so that the first request (and the
        first with a schema) finds them ready instead of stalling the others on the interpreter lock."""
        frontend = self.frontend
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        check_json_schema(schema, "warm-up")
        check_grammar(frontend.grammars.json(schema), "warm-up")

    def check_ready(self) -> None:
        if not self.client.ready:
            error = getattr(self.client, "load_error", None)
            unavailable = getattr(self.client, "unavailable", None)  # a router: why no replica serves
            why = unavailable() if error is None and callable(unavailable) else None
            raise APIError(503, why or (f"the model '{self.name}' is still loading, retry shortly" if error is None
                                        else f"the model '{self.name}' failed to load: {error}"))

    def answers_to(self, name: str) -> bool:
        return name in self.names or name == self.client.model.path


class ModelScope:
    """A request's view of the server once its model is known: that model's client, frontend and
    name, and everything else (tenant, intake, metrics, stored responses) from the server."""

    def __init__(self, state: ServerState, served: ServedModel) -> None:
        self._state, self.served = state, served
        self.client, self.model_name = served.client, served.name

    @property
    def frontend(self) -> ModelFrontend:
        return self.served.frontend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


class ServerState:
    """What the handlers share: the served models, metrics and settings. ``client`` is the engine
    client of the one model, or with ``models`` (several), the one that answers for all of them
    (stats, admin); a request works through the :class:`ModelScope` of the model it names."""

    def __init__(self, client: Any, model_names: list[str] | None = None, api_key: str | tuple[str, ...] | None = None,
                 tool_parser: str | None = None, max_body_bytes: int = 8 << 20, intake_timeout: float = 30.0,
                 models: list[ServedModel] | None = None, hosts: AllowedHosts | None = None,
                 cors_origins: tuple[str, ...] = (), response_store_bytes: int = 64 << 20) -> None:
        """``hosts``: the Host names answered (default: loopback names and IP addresses);
        ``cors_origins``: web origins whose pages may call the API (default none)."""
        self.client = client
        self.models = models or [ServedModel(model_names or [client.model.name], client, tool_parser)]
        self.model_names = [name for m in self.models for name in m.names]
        self.api_key = api_key
        self.tool_parser = tool_parser
        self.max_body_bytes = max_body_bytes
        self.intake_timeout = intake_timeout
        self.metrics = ServerMetrics(client)
        self.hosts = hosts or AllowedHosts()
        self.cors_origins = cors_origins
        self.responses = ResponseStore(max_bytes=response_store_bytes)  # for previous_response_id
        self.recent: deque[dict[str, Any]] = deque(maxlen=50)  # finished requests, for the status page
        # The machines behind this server, for the status page (a cluster's router sets it).
        self.node_provider: Callable[[], list[dict[str, Any]]] | None = None
        self.stage_provider: Callable[[], list[dict[str, Any]]] | None = None  # a split model's stages
        # Parsing, template rendering and tokenization run here, off the event loop: a large or slow
        # request then delays only itself, never /health or the streams of others.
        self._intake = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hearth-intake")

    def close(self) -> None:
        """Stop the engine clients and the intake threads (a request still being prepared is dropped)."""
        self._intake.shutdown(wait=False, cancel_futures=True)
        for client in {id(c): c for c in [self.client, *(m.client for m in self.models)]}.values():
            client.close()

    async def warm_when_ready(self, timeout_s: float = 3600.0) -> None:
        """Once the models load, warm their frontends on an intake thread (best effort: a failure
        here is met again, and reported, by the first request)."""
        loop, deadline = asyncio.get_running_loop(), asyncio.get_running_loop().time() + timeout_s
        for served in self.models:
            while not served.client.ready and getattr(served.client, "load_error", None) is None:
                if loop.time() > deadline:
                    return
                await asyncio.sleep(0.1)
            if served.client.ready:
                try:
                    await loop.run_in_executor(self._intake, served.warm)
                except Exception:  # noqa: BLE001 - see the docstring
                    log.info("warming the frontend of %s failed", served.name, exc_info=True)

    async def prepare(self, fn: Callable[[], R], size: int = 0) -> R:
        """``fn()`` (a request's parsing, rendering and tokenization; ``size``: its body's bytes) on an
        intake thread; a 503 when it takes longer than the intake timeout (the thread finishes on its
        own; its result is dropped)."""

        def run() -> R:
            try:
                return fn()
            finally:
                if size >= _TRIM_AFTER_BYTES:
                    release_memory()

        future = asyncio.get_running_loop().run_in_executor(self._intake, run)
        try:
            return await asyncio.wait_for(future, self.intake_timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"preparing the request took longer than {self.intake_timeout:g} s "
                                "(the server is busy, or the request is very large)") from None

    def tenant(self, request: Request) -> str:
        """Whose request it is, for the fair turns of admission (:func:`session.request_tenant`)."""
        return request_tenant(request.headers, request.client.host if request.client else None, self.api_key)

    def owner(self, request: Request) -> str:
        """Who owns what the request stores (:func:`session.request_owner`)."""
        return request_owner(request.headers, self.api_key)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def frontend(self) -> ModelFrontend:
        """The first model's frontend (the one a single-model server has)."""
        return self.models[0].frontend

    def check_ready(self) -> None:
        self.models[0].check_ready()

    def check_model(self, name: str) -> ModelScope:
        """The scope of the served model named ``name`` (ready), or a 404 listing the served names."""
        served = next((m for m in self.models if m.answers_to(name)), None)
        if served is None:
            if len(self.models) == 1:
                self.check_ready()
            raise APIError(404, f"model: '{name}' is not served here (this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)})", "model")
        served.check_ready()
        return ModelScope(self, served)


def error_response(path: str, error: APIError) -> JSONResponse:
    body = error.anthropic_body() if protocol_of(path) == "anthropic" else error.openai_body()
    headers = {"retry-after": str(error.retry_after)} if error.status in (429, 503, 529) else None
    return JSONResponse(body, status_code=error.status, headers=headers)


def rejected(request: Request, error: APIError) -> JSONResponse:
    """The error response, logged with its reason so that an operator sees why a client failed."""
    level = logging.WARNING if error.status >= 500 else logging.INFO
    log.log(level, "rejected: %s", error.message, extra={"fields": {
        "method": request.method, "path": request.url.path, "status": error.status, "param": error.param,
        "code": error.code, "message": error.message}})
    return error_response(request.url.path, error)


def create_app(state: ServerState) -> FastAPI:
    """The ASGI app over ``state``'s engine client."""
    app = FastAPI(title="hearth", description="OpenAI- and Anthropic-compatible API of a hearth engine",
                  version="0.1.0")
    app.state.hearth = state
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)
    app.include_router(admin_api.router)
    openapi.install(app, state.model_names)
    _add_middlewares(app, state)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return rejected(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        response = rejected(request, APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))
        if exc.headers:  # a 405's Allow
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        log.info("client disconnected before its answer", extra={"fields": {"path": request.url.path}})
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        # The client learns that it failed, not how: the details (and the traceback) are in the log.
        return error_response(request.url.path, APIError(500, "internal error (logged on the server)"))

    @app.get("/health")
    async def health():
        if len(state.models) > 1:  # ready once every model is
            models = {m.name: _health_of(m.client) for m in state.models}
            ready = all(h["status"] == "ready" for h in models.values())
            return JSONResponse({"status": "ready" if ready else "loading", "model": state.model_name,
                                 "models": models}, status_code=200 if ready else 503)
        health = _health_of(state.client)
        if health["status"] == "ready":
            return {**health, "model": state.model_name}
        return JSONResponse(health, status_code=503)

    @app.get("/", response_class=HTMLResponse)
    async def status_page():
        """The live status page (one static file; it polls /admin/status)."""
        return HTMLResponse(status_page_html())

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus' text format, so documented
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_middlewares(app: FastAPI, state: ServerState) -> None:
    """Innermost first: the body limit, the API key, the browser guard, then CORS where asked for."""
    app.add_middleware(BodyLimit, limit=state.max_body_bytes)
    app.add_middleware(AuthAndAccessLog, state=state)  # the key is checked before a body is read
    app.add_middleware(BrowserGuard, hosts=state.hosts, error_response=error_response)  # before the key
    if state.cors_origins:  # outermost: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(state.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id", "retry-after"], max_age=600)


def _health_of(client: Any) -> dict[str, str]:
    if client.ready:
        return {"status": "ready"}
    error = getattr(client, "load_error", None)
    return {"status": "loading"} if error is None else {"status": "failed", "error": str(error)}


class AuthAndAccessLog:
    """Pure ASGI middleware (no per-chunk overhead on streams): the API-key check, then one
    structured log line per request when its response completes."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path = scope["path"]
        status = 0

        async def send_and_watch(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.state.api_key and path not in _OPEN_PATHS and not _authorized(scope, self.state.api_key):
                error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or "
                                      "'x-api-key: KEY')")
                await error_response(path, error)(scope, receive, send_and_watch)
            else:
                await self.app(scope, receive, send_and_watch)
        finally:
            log.info("request", extra={"fields": {
                "method": scope.get("method"), "path": path, "status": status,
                "ms": round((time.perf_counter() - start) * 1e3, 2)}})


def _authorized(scope: dict, key: str | tuple[str, ...]) -> bool:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    if scope["path"] == "/":  # a browser opening the status page passes the key in the address: /?key=KEY
        given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key", [""])[0]
        if given and key_matches("", given, key):
            return True
    return key_matches(headers.get("authorization", ""), headers.get("x-api-key"), key)


def release_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim over every arena; nothing
    elsewhere). Parsing and tokenizing a body of megabytes takes hundreds of megabytes for a moment,
    in an intake thread's own arena, which glibc would otherwise keep for good."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, looked up once (finding the C library runs ``ldconfig``), or None."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


class BodyLimit:
    """Pure ASGI middleware: a request body is read here, at most ``limit`` bytes of it, before the
    handler runs; a larger one gets 413 in its API's format as soon as its length is known (from
    ``Content-Length`` before any byte is read, else once the bytes received pass the limit)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and (not length.isdigit() or len(length) > 18):
            await error_response(path, APIError(400, "Content-Length: not a byte count"))(scope, receive, send)
            return
        if length is not None and int(length) > self.limit:
            await self._too_large(path, scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._too_large(path, scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # later calls watch for the client disconnecting
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, path: str, scope: dict, receive: Any, send: Any) -> None:
        error = APIError(413, f"the request body is larger than this server's limit of {self.limit} bytes "
                              "(hearth serve --max-body-size)")
        log.info("rejected: %s", error.message, extra={"fields": {"path": path, "status": 413}})
        await error_response(path, error)(scope, receive, send)
