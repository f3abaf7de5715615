"""hearth's single-machine inference engine (no Ray).

This module is the engine's public face for the packages above it (serving, cluster), together
with :mod:`hearth.engine.checkpoint` (checkpoint formats) and :mod:`hearth.engine.experts` (the
expert hierarchy's shared-memory pieces): they import the engine through these three only.
"""

from hearth.engine.llm import LLM
from hearth.engine.llm_engine import EngineConfig, LLMEngine
from hearth.engine.text.grammar import JSON_STYLE
from hearth.engine.text.tokenizer import load_tokenizer
from hearth.proto.contracts import RequestOutput, SamplingParams

__all__ = ["JSON_STYLE", "LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "load_tokenizer"]
