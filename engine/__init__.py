"""hearth's single-machine inference engine (no Ray)."""

from hearth.engine.llm import LLM
from hearth.engine.llm_engine import EngineConfig, LLMEngine
from hearth.proto.contracts import RequestOutput, SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
