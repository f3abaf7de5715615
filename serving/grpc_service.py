"""The gRPC service (``proto/hearth.proto``) over the same engine client as the HTTP API."""

from __future__ import annotations

import uuid
from typing import Any

import grpc

from hearth.proto import hearth_pb2, hearth_pb2_grpc
from hearth.proto.contracts import GenerateRequest
from hearth.serving.errors import APIError, key_matches
from hearth.serving.generation import stream_reply
from hearth.serving.session import request_tenant, session_key

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE, 500: grpc.StatusCode.INTERNAL}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logprobs", "grammar")


class Malformed:
    """A request whose bytes are not its message: the handler answers INVALID_ARGUMENT (grpcio would
    answer UNKNOWN, with the parser's exception, and log a traceback)."""

    def __init__(self, message: type, error: Exception) -> None:
        self.detail = f"the request is not a valid {message.__name__} message: {str(error)[:200]}"


def _lenient(message: type) -> Any:
    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or anything else the bytes cause
            return Malformed(message, exc)
    return parse


async def _refuse_malformed(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail)


class HearthService(hearth_pb2_grpc.HearthServicer):
    """Generate / ListModels / Health, sharing the HTTP server's state (client, tokenizer, metrics)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    async def Generate(self, request: hearth_pb2.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        await _refuse_malformed(request, context)
        try:
            self._authorize(context)
            meta = dict(context.invocation_metadata() or ())
            meta["peer"] = context.peer()
            scope, gen = await self.state.prepare(lambda: self._request(request, meta))  # tokenized off the loop
            async for _, chunk in stream_reply(scope, gen, None, "openai", "grpc"):
                reply = hearth_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text)
                for lp in chunk.logprobs or ():
                    reply.logprobs.append(hearth_pb2.TokenLogprob(
                        token_id=lp.token_id, logprob=lp.logprob,
                        top=[hearth_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]))
                if chunk.finished:
                    reply.finish_reason = "stop" if chunk.finish_reason == "abort" else chunk.finish_reason
                    if isinstance(chunk.stop_reason, str):
                        reply.stop_sequence = chunk.stop_reason
                    m = chunk.metrics
                    reply.usage.CopyFrom(hearth_pb2.Usage(prompt_tokens=m.num_prompt_tokens,
                                                          completion_tokens=m.num_output_tokens,
                                                          cached_tokens=m.num_cached_tokens))
                    for key, value in chunk.timings.items():
                        reply.timings[key] = float(value)
                yield reply
        except APIError as exc:
            await context.abort(_CODES.get(exc.status, grpc.StatusCode.UNKNOWN), exc.message)

    async def ListModels(self, request, context):  # noqa: N802
        await _refuse_malformed(request, context)
        try:
            self._authorize(context)
        except APIError as exc:
            await context.abort(_CODES.get(exc.status, grpc.StatusCode.UNKNOWN), exc.message)
        return hearth_pb2.ListModelsResponse(models=[
            hearth_pb2.ModelCard(id=name, max_model_len=m.client.model.max_model_len, created=m.client.model.created)
            for m in self.state.models for name in m.names])

    async def Health(self, request, context):  # noqa: N802
        await _refuse_malformed(request, context)
        client = self.state.client
        error = getattr(client, "load_error", None)
        status = hearth_pb2.HealthResponse.READY if client.ready else (
            hearth_pb2.HealthResponse.FAILED if error is not None else hearth_pb2.HealthResponse.LOADING)
        return hearth_pb2.HealthResponse(status=status, model=self.state.model_name, error=str(error or ""))

    def _request(self, request: hearth_pb2.GenerateRequest, meta: dict[str, Any]) -> tuple[Any, GenerateRequest]:
        scope = self.state.check_model(request.model)
        frontend = scope.frontend
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise APIError(400, "prompt: give text or token_ids", "prompt")
        if kind == "token_ids" and len(request.token_ids.ids) >= frontend.max_model_len:  # before copying them
            raise APIError(400, f"prompt: {len(request.token_ids.ids)} token ids; the maximum context is "
                                f"{frontend.max_model_len}", "prompt")
        ids = frontend.prompt_ids(request.text if kind == "text" else list(request.token_ids.ids), "prompt")
        s = request.sampling
        max_tokens = frontend.max_tokens(s.max_tokens if s.HasField("max_tokens") else 16, len(ids), "max_tokens")
        fields = {name: getattr(s, name) if s.HasField(name) else None for name in _SAMPLING_FIELDS}
        params = frontend.sampling(max_tokens, list(s.stop), ignore_eos=s.ignore_eos or None,
                                   stop_token_ids=list(s.stop_token_ids) or None,
                                   logit_bias=dict(s.logit_bias) or None, **fields)
        if s.HasField("skip_special_tokens"):
            params.skip_special_tokens = s.skip_special_tokens
        return scope, GenerateRequest(f"grpc-{uuid.uuid4().hex}", ids, params,
                                      session_key(meta.get("x-session-id"), prompt_ids=ids),
                                      request_tenant(meta, meta.get("peer", "").rsplit(":", 1)[0], self.state.api_key))

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        key = self.state.api_key
        if not key:
            return
        meta = dict(context.invocation_metadata() or ())
        if not key_matches(meta.get("authorization", ""), meta.get("x-api-key"), key):
            raise APIError(401, "invalid or missing API key (metadata 'authorization: Bearer KEY' or 'x-api-key')")


def add_service(server: grpc.aio.Server, state: Any) -> None:
    """The Hearth service on ``server``: as the generated ``add_HearthServicer_to_server``, with
    request parsing that turns malformed bytes into INVALID_ARGUMENT."""
    service = HearthService(state)
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=_lenient(hearth_pb2.GenerateRequest),
            response_serializer=hearth_pb2.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels, request_deserializer=_lenient(hearth_pb2.ListModelsRequest),
            response_serializer=hearth_pb2.ListModelsResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            service.Health, request_deserializer=_lenient(hearth_pb2.HealthRequest),
            response_serializer=hearth_pb2.HealthResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("hearth.v1.Hearth", handlers),))
    server.add_registered_method_handlers("hearth.v1.Hearth", handlers)
