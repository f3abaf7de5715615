"""hearth's single-machine inference engine (no Ray)."""

from engine.llm import LLM
from engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from engine.sampling import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
