"""Model registry keyed by the checkpoint's ``architectures`` name."""

from __future__ import annotations

from engine.config import ConfigError
from engine.models import mixtral, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next
from engine.models.base import ModelFamily, MoECausalLM

_FAMILIES: tuple[ModelFamily, ...] = (
    qwen3_moe.FAMILY, qwen2_moe.FAMILY, mixtral.FAMILY, qwen3_next.FAMILY, qwen3_5_moe.FAMILY,
)


def supported_architectures() -> list[str]:
    return sorted(arch for fam in _FAMILIES for arch in fam.architectures)


def family_for(architectures: list[str] | None) -> ModelFamily:
    """The family for a config's ``architectures`` list, or a clear error naming what is supported."""
    for arch in architectures or []:
        for fam in _FAMILIES:
            if arch in fam.architectures:
                return fam
    raise ConfigError(f"unknown architecture {architectures!r}; supported: {', '.join(supported_architectures())}")


__all__ = ["ModelFamily", "MoECausalLM", "family_for", "supported_architectures"]
