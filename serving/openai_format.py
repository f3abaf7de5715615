"""OpenAI response bodies and stream chunks, built from parsed replies: one choice per sample,
usage over all samples, log-probabilities in the chat and the legacy completions shapes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from hearth.proto.contracts import TokenLogprob
from hearth.serving.errors import APIError
from hearth.serving.generation import Reply
from hearth.serving.parsers import ToolCall
from hearth.serving.transport import sse

FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def usage(replies: list[Reply]) -> dict[str, Any]:
    """The prompt counted once (every sample shares it), completions summed over the samples."""
    prompt = replies[0].prompt_tokens
    completion = sum(r.completion_tokens for r in replies)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": replies[0].cached_tokens}}


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out["index"] = index
    return out


def finish_reason(reason: str | None, has_tools: bool) -> str:
    if has_tools and reason == "stop":
        return "tool_calls"
    return FINISH.get(reason or "stop", "stop")


class LogprobFormat:
    """Token log-probabilities as OpenAI writes them (token text, UTF-8 bytes, alternatives)."""

    def __init__(self, token_text) -> None:
        self.token_text = token_text  # token id -> its text

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in logprobs],
                "refusal": None}

    def completion(self, logprobs: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}


def chat_response(model: str, request_id: str, replies: list[Reply], logprobs: LogprobFormat | None) -> dict:
    choices = []
    for index, reply in enumerate(replies):
        message: dict[str, Any] = {"role": "assistant",
                                   "content": reply.content if reply.content or not reply.tool_calls else None}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [tool_call_json(c) for c in reply.tool_calls]
        choices.append({"index": index, "message": message,
                        "logprobs": logprobs.chat(reply.logprobs) if logprobs else None,
                        "finish_reason": finish_reason(reply.finish_reason, bool(reply.tool_calls))})
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(replies), "timings": replies[0].timings}


def _stream_end(head: dict[str, Any], replies: list[Reply], include_usage: bool) -> str:
    """What closes a stream: the usage chunk (when asked for), then ``[DONE]``."""
    usage_chunk = sse({**head, "choices": [], "usage": usage(replies)}) if include_usage else ""
    return usage_chunk + "data: [DONE]\n\n"


async def chat_events(model: str, request_id: str, stream: AsyncIterator, n: int, include_usage: bool,
                      logprobs: LogprobFormat | None):
    head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None, **extra: Any) -> str:
        return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
                    **extra})

    for index in range(n):
        yield chunk(index, {"role": "assistant", "content": ""})
    replies, calls = [Reply() for _ in range(n)], [0] * n
    try:
        async for index, events, gen_chunk in stream:
            lp = logprobs.chat(gen_chunk.logprobs) if logprobs and gen_chunk.logprobs else None
            for e in events:
                if e.kind == "reasoning":
                    yield chunk(index, {"reasoning_content": e.text}, lp=lp)
                elif e.kind == "content":
                    yield chunk(index, {"content": e.text}, lp=lp)
                else:
                    yield chunk(index, {"tool_calls": [tool_call_json(e.tool_call, calls[index])]}, lp=lp)
                    calls[index] += 1
                lp = None  # a step's log-probabilities go with its first delta
            if lp is not None:  # text held back (a possible stop string): the tokens still count
                yield chunk(index, {}, lp=lp)
            if gen_chunk.finished:
                replies[index].add([], gen_chunk)
                yield chunk(index, {}, finish_reason(gen_chunk.finish_reason, calls[index] > 0),
                            timings=replies[index].timings)
    except APIError as exc:  # after the response started: one error event ends the stream
        yield sse(exc.openai_body())
        return
    yield _stream_end(head, replies, include_usage)


def completion_response(model: str, request_id: str, replies: list[Reply], logprobs: LogprobFormat | None,
                        token_ids: bool) -> dict:
    choices = []
    for index, reply in enumerate(replies):
        choice = {"index": index, "text": reply.content,
                  "logprobs": logprobs.completion(reply.logprobs) if logprobs else None,
                  "finish_reason": FINISH.get(reply.finish_reason, "stop")}
        if token_ids:
            choice["token_ids"] = reply.token_ids
        choices.append(choice)
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(replies), "timings": replies[0].timings}


async def completion_events(model: str, request_id: str, stream: AsyncIterator, n: int, include_usage: bool,
                            token_ids: bool, logprobs: LogprobFormat | None):
    head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
    replies, offsets = [Reply() for _ in range(n)], [0] * n
    try:
        async for index, events, gen_chunk in stream:
            text = "".join(e.text for e in events)
            finish = FINISH.get(gen_chunk.finish_reason, "stop") if gen_chunk.finished else None
            if not (text or finish or token_ids or (logprobs and gen_chunk.logprobs)):
                continue
            choice = {"index": index, "text": text, "finish_reason": finish,
                      "logprobs": logprobs.completion(gen_chunk.logprobs or [], offsets[index]) if logprobs else None}
            offsets[index] += len(text)
            if token_ids:
                choice["token_ids"] = gen_chunk.token_ids
            extra = {}
            if finish:
                replies[index].add([], gen_chunk)
                extra = {"timings": replies[index].timings}
            yield sse({**head, "choices": [choice], **extra})
    except APIError as exc:
        yield sse(exc.openai_body())
        return
    yield _stream_end(head, replies, include_usage)
