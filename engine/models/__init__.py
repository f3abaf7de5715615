"""The model families, one file each, keyed by the checkpoint's ``architectures`` name.

A family file reads its config (``parse_config``), composes its network from the shared layer
classes (``build``) and maps checkpoint names (``map_name``); see :class:`ModelFamily`. A new
architecture is a new file here plus, where its attention or routing is new, a new layer class.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from hearth.config import ConfigError
from hearth.engine import hugepages
from hearth.engine.config import ModelConfig, config_architectures
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.models import (
    afmoe,
    axk1,
    bailing_hybrid,
    cohere2_moe,
    dbrx,
    deepseek_v2,
    deepseek_v3,
    deepseek_v4,
    deepseek_v32,
    dots1,
    ernie4_5_moe,
    exaone_moe,
    flex_olmo,
    flint,
    glm4_moe,
    glm4_moe_lite,
    glm_moe_dsa,
    gpt_oss,
    granitemoe,
    granitemoe_swa,
    granitemoehybrid,
    hunyuan_v1_moe,
    hy_v3,
    jetmoe,
    kimi_k25,
    kimi_linear,
    kolibri1,
    laguna,
    lfm2_moe,
    llama4,
    mellum,
    mimo_v2_flash,
    minimax_m2,
    mixtral,
    olmoe,
    phimoe,
    qwen2_moe,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    solar_open,
)
from hearth.engine.models.base import ModelFamily
from hearth.engine.models.decoder import MoECausalLM

FAMILIES: tuple[ModelFamily, ...] = (
    qwen3_moe.FAMILY, qwen2_moe.FAMILY, mixtral.FAMILY, qwen3_next.FAMILY, qwen3_5_moe.FAMILY, olmoe.FAMILY,
    glm4_moe.FAMILY, deepseek_v3.FAMILY, deepseek_v2.FAMILY, minimax_m2.FAMILY,
    gpt_oss.FAMILY, deepseek_v4.FAMILY, dots1.FAMILY, glm4_moe_lite.FAMILY, granitemoe.FAMILY,
    ernie4_5_moe.FAMILY, exaone_moe.FAMILY, lfm2_moe.FAMILY,
    granitemoehybrid.FAMILY, afmoe.FAMILY, flex_olmo.FAMILY, cohere2_moe.FAMILY,
    phimoe.FAMILY, hunyuan_v1_moe.FAMILY, granitemoe_swa.FAMILY, llama4.FAMILY,
    jetmoe.FAMILY, deepseek_v32.FAMILY, glm_moe_dsa.FAMILY, kimi_k25.FAMILY,
    kimi_linear.FAMILY, bailing_hybrid.FAMILY, solar_open.FAMILY, dbrx.FAMILY, hy_v3.FAMILY, mellum.FAMILY,
    axk1.FAMILY, kolibri1.FAMILY, flint.FAMILY, laguna.FAMILY, mimo_v2_flash.FAMILY,
)


# MoE causal LMs of the transformers version hearth pins that it does not run yet, and what is missing
# (tests/test_families.py checks that every one is here or supported).
_NEW_MECHANISM = MappingProxyType({
    "LongcatFlashForCausalLM": "its layers (two latent attention sublayers and two MLPs each, beside a shortcut MoE "
                               "with zero-computation experts) are not built",
    "MiniMaxForCausalLM": "MiniMax-Text-01's lightning attention layers are not built",
    "Dots3NoteForCausalLM": "dots3's per-layer configurations and indexed latent attention are not built",
    "Qwen4ExpForCausalLM": "Qwen4-Exp's gated residual streams, per-layer n-gram embeddings and QSA indexer are not "
                           "built",
    "Glm5NextForConditionalGeneration": "GLM-5 Next's hyper-connections and gated linear attention are not built",
    "MiniMaxM3VLForCausalLM": "MiniMax-M3's block-sparse indexed attention is not built",
    "AXK2ForCausalLM": "A.X K2's indexed sparse attention and gated norms are not built",
    "HYV4ForCausalLM": "Hunyuan V4's hyper-connections and indexed attention are not built",
    "DogeForCausalLM": "Doge's cross-domain MoE (product-key experts) is not built",
    "JambaForCausalLM": "Jamba's Mamba (v1) layers are not built",
    "NemotronHForCausalLM": "Nemotron-H's block pattern (Mamba-2, attention and squared-ReLU MoE blocks) is not "
                            "composed yet",
    "ZayaForCausalLM": "Zaya's compressed convolutional attention and residual scaling are not built",
    "Gemma4ForConditionalGeneration": "Gemma 4's text model (its experts beside the dense MLP, per-layer inputs) is "
                                      "not composed yet",
    "BeamForCausalLM": "Beam's per-head output-gate bias, depth-scaled residuals, logit soft-capping and MoE output "
                       "scaled after the sum are not built",
})
NOT_YET: Mapping[str, str] = MappingProxyType(
    {**_NEW_MECHANISM, "MiniMaxText01ForCausalLM": _NEW_MECHANISM["MiniMaxForCausalLM"],
     "Dots3NoteForConditionalGeneration": _NEW_MECHANISM["Dots3NoteForCausalLM"],
     "Qwen4ExpForConditionalGeneration": _NEW_MECHANISM["Qwen4ExpForCausalLM"],
     "MiniMaxM3SparseForConditionalGeneration": _NEW_MECHANISM["MiniMaxM3VLForCausalLM"]})


def supported_architectures() -> list[str]:
    return sorted(arch for fam in FAMILIES for arch in fam.architectures)


def family_for(architectures: list[str] | None) -> ModelFamily:
    """The family for a config's ``architectures`` list, or a clear error naming what is supported."""
    for arch in architectures or []:
        for fam in FAMILIES:
            if arch in fam.architectures:
                return fam
    named = " / ".join(architectures or []) or "no architecture (config.json has no 'architectures')"
    why = next((NOT_YET[a] for a in architectures or [] if a in NOT_YET), None)
    reason = f" yet: {why}" if why else ""
    raise ConfigError(f"{named} is not supported{reason}; supported: {', '.join(supported_architectures())}")


def build_model(cfg: ModelConfig, experts: ExpertBackend) -> MoECausalLM:
    """The network of ``cfg``'s family, its MoE layers computing through ``experts`` (weights
    uninitialised: the loader fills them)."""
    model = family_for([cfg.architecture]).build(cfg, experts)
    for tensor in [*model.parameters(), *model.buffers()]:  # untouched yet: the loader fills them
        hugepages.advise(tensor)
    return model


__all__ = ["FAMILIES", "ModelFamily", "MoECausalLM", "build_model", "config_architectures", "family_for",
           "supported_architectures"]
