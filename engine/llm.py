"""The offline Python API: ``LLM(path).generate(prompts, SamplingParams(...))`` and streaming."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hearth.config import EngineConfig
from hearth.engine.llm_engine import LLMEngine
from hearth.engine.text.tokenizer import render_chat
from hearth.proto.contracts import RequestOutput, SamplingParams

Prompt = str | list[int]


class LLM:
    """A model loaded for offline generation.

    >>> llm = LLM("path/to/checkpoint")
    >>> llm.generate(["def fib(n):"], SamplingParams(max_tokens=32, temperature=0))[0].text
    """

    def __init__(self, model: str | Path, show_progress: bool = False, config: EngineConfig | None = None,
                 **options: Any) -> None:
        """``config`` and/or any engine option by name (``LLM(path, prefix_caching=True)``; see
        :class:`hearth.config.EngineConfig`)."""
        config = config.replace(**options) if config is not None else EngineConfig(**options)
        self.engine = LLMEngine(model, config, show_progress=show_progress)

    def close(self) -> None:
        """Release CPU workers, a shared-memory pool and the routing record (also on ``with`` exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion (batched continuously); outputs in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        param_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, param_list, strict=True)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one output per generated token (``delta_text`` holds the new text)."""
        request_id = self.engine.add_request(prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(request_id)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> RequestOutput:
        """Generate the assistant's reply to a conversation, using the checkpoint's chat template."""
        return self.generate(render_chat(self.tokenizer, messages), params)[0]
