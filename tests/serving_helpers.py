"""A real server on a tiny checkpoint for the serving tests, with a test-only logits processor
that forces scripted replies (tool calls, thinking, malformed calls) when the prompt asks for one."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import torch

from hearth.config import EngineConfig, ServingConfig
from hearth.serving.server import BackgroundServer, build_state, free_port

SCRIPTS = {
    "WEATHER": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "TWO_CALLS": 'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    "THINK": "<think>\nThe user greets me. I greet back.\n</think>\n\nHello there!",
    "THINK_TOOL": '<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                  '{"city": "Oslo"}}\n</tool_call>',
    "BAD_CALL": '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}\n</tool_call>',
    "NAMED_REST": '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "PROSE": "Just some prose, no call.",
    "STOPWORD": "alpha beta STOP gamma",
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


class ScriptedReplies:
    """Forces the tokens of ``SCRIPTS[KEY]`` (then EOS) when the prompt contains ``SCRIPT:KEY`` (the
    last one, when a conversation holds several)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.scripts = {k: tokenizer.encode(v, add_special_tokens=False) + [tokenizer.eos_token_id]
                        for k, v in SCRIPTS.items()}
        self._by_prompt: dict[tuple[int, ...], list[int] | None] = {}

    def __call__(self, prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        key = tuple(prompt)
        if key not in self._by_prompt:
            found = re.findall(r"SCRIPT:([A-Z_]+)", self.tokenizer.decode(prompt))
            self._by_prompt[key] = self.scripts.get(found[-1]) if found else None
        script = self._by_prompt[key]
        if script is None or len(output) >= len(script):
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[script[len(output)]] = 0.0
        return forced


def metrics(server) -> dict[str, float]:
    """The server's /metrics samples by ``name{label=value,...}``."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@contextlib.contextmanager
def running_server(model_dir, engine_options: dict | None = None, scripted: bool = True,
                   **options: Any) -> Iterator[BackgroundServer]:
    """A BackgroundServer on loopback (free ports), stopped on exit."""
    from hearth.engine.text.tokenizer import load_tokenizer

    opts = ServingConfig(host="127.0.0.1", port=free_port(), grpc_port=free_port(), model_names=("tiny",),
                        **options)
    processors = [ScriptedReplies(load_tokenizer(model_dir))] if scripted else []
    state = build_state(model_dir, EngineConfig(**(engine_options or {})), opts, logits_processors=processors)
    server = BackgroundServer(state, opts).start()
    try:
        yield server
    finally:
        server.stop()


def assert_forced_calls(client: Any, tool: dict[str, Any], marker: str, max_tokens: int, seeds: int = 2) -> None:
    """Sampled replies to ``tool_choice: required`` (openai SDK ``client``) come back as a call to
    ``tool`` whose arguments match its schema, with no ``marker`` of the call format left in the text."""
    import json

    import jsonschema

    for seed in range(seeds):
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                               tools=[tool], tool_choice="required", max_tokens=max_tokens,
                                               seed=seed, temperature=1.0)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        call = choice.message.tool_calls[0]
        assert call.function.name == tool["function"]["name"]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert marker not in (choice.message.content or "")
