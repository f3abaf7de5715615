"""Every family through the engine's paths, against transformers: batched requests arriving at
different steps (with chunked prefill, and with preemption), the expert hierarchy on the virtual
device at cache fractions 0.1 and 0.5, and prefix reuse. test_exactness.py holds the logits checks
per family; this holds what the engine does around them."""

from __future__ import annotations

import pytest

from hearth.engine import LLM
from tests.conftest import FAMILIES
from tests.helpers import greedy, hf_argmax, max_rel_error, record_logits, reference
from tests.test_batching import PROMPTS, run_staggered

STEPS = 16
OVERRIDES = {"num_experts_per_tok": 4}


@pytest.fixture(scope="module")
def solo(checkpoint):
    """Per family: the checkpoint and transformers' greedy tokens for each prompt."""
    found: dict[str, tuple] = {}

    def get(family: str):
        if family not in found:
            path, _ = checkpoint(family, **OVERRIDES)
            ref = reference(path)
            found[family] = path, [hf_argmax(ref, p, STEPS) for p in PROMPTS]
        return found[family]
    return get


@pytest.mark.parametrize("options", [{"prefill_chunk": 8, "max_num_batched_tokens": 12},
                                     {"kv_cache_tokens": 96, "block_size": 8}], ids=["chunked", "preemption"])
@pytest.mark.parametrize("family", FAMILIES)
def test_staggered_batches_match_transformers(solo, family, options) -> None:
    path, refs = solo(family)
    llm = LLM(path, **options)
    scheduler, preempted = llm.engine.scheduler, []
    preempt = scheduler._preempt
    scheduler._preempt = lambda req, step: (preempted.append(req.request_id), preempt(req, step))
    batched = run_staggered(llm, [greedy(STEPS)] * len(PROMPTS))
    assert [batched[i] for i in range(len(PROMPTS))] == [tokens for tokens, _ in refs]
    assert bool(preempted) == ("kv_cache_tokens" in options)


@pytest.mark.parametrize("fraction", ["0.1", "0.5"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hierarchy_matches_transformers(solo, family, fraction) -> None:
    path, refs = solo(family)
    llm = LLM(path, expert_device="virtual", expert_cache=fraction, q_mode="table")
    recorded = record_logits(llm)
    outs = llm.generate(PROMPTS, greedy(STEPS))
    for out, (tokens, logits) in zip(outs, refs, strict=True):
        assert out.token_ids == tokens
        assert max(max_rel_error(a, b) for a, b in zip(recorded[out.request_id], logits, strict=True)) <= 1e-4
    stats = llm.engine.stats()["experts"]
    # The experts went through the hierarchy: by the decode path, or streamed whole layers where the
    # measured costs say so even for one token (tiny experts, whose copies cost their fixed part).
    assert stats["hits"] + stats["fills"] + stats["cpu"] + stats.get("prefill_streamed_steps", 0) > 0
    llm.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_reuse_matches_transformers(solo, family) -> None:
    """A prompt that extends a finished one reuses its cached blocks (and, for hybrids, a state
    checkpoint) and still gives transformers' tokens and logits."""
    path, refs = solo(family)
    ref = reference(path)
    llm = LLM(path, prefix_caching=True, block_size=8)
    recorded = record_logits(llm)
    base = PROMPTS[3]
    llm.generate(base, greedy(4))
    longer = base + [7, 9, 11, 13, 15, 17, 19, 21, 23]
    out = llm.generate(longer, greedy(STEPS))[0]
    assert out.metrics.num_cached_tokens >= 64
    tokens, logits = hf_argmax(ref, longer, STEPS)
    assert out.token_ids == tokens
    assert max(max_rel_error(a, b) for a, b in zip(recorded[out.request_id], logits, strict=True)) <= 1e-4


def test_latent_attention_caches_the_latent_and_rotary_key(checkpoint) -> None:
    """DeepSeek-V3's paged cache holds per token the compressed latent and the rotary key, not
    expanded keys and values, and `hearth inspect` reports those bytes."""
    from hearth.engine.checkpoint.inspect import summarize

    path, _ = checkpoint("deepseek_v3", **OVERRIDES)
    llm = LLM(path)
    cfg, kv = llm.engine.model_config, llm.engine.runner.kv
    rank, rope = cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim
    assert kv.keys[0].shape[1:] == (1, rank) and kv.values[0].shape[1:] == (1, rope)
    assert summarize(cfg).kv_bytes_per_token == cfg.num_layers * (rank + rope) * 4
    expanded = cfg.num_layers * cfg.num_heads * (2 * cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim) * 4
    assert summarize(cfg).expanded_kv_bytes_per_token == expanded  # (v_head_dim = qk_nope_head_dim here)
    assert summarize(cfg).kv_bytes_per_token * 4 < expanded


@pytest.mark.parametrize("family, what", [("deepseek_v3", "latent attention"), ("gpt_oss", "attention sinks"),
                                          ("deepseek_v4", "compressed attention"),
                                          ("granitemoe_swa", "attention sinks"), ("llama4", "chunked attention"),
                                          ("jetmoe", "mixture of attention heads")])
def test_fixed_shape_steps_refuse_what_they_do_not_run(checkpoint, family, what) -> None:
    from hearth.config import ConfigError

    path, _ = checkpoint(family, **OVERRIDES)
    with pytest.raises(ConfigError, match=what):
        LLM(path, static_decode="eager")


def test_a_granite_swa_rotary_base_of_its_own_per_layer_is_refused(checkpoint) -> None:
    """Layers turn by rope_theta or not at all (0); another base on some layer is named, not run wrong."""
    from hearth.config import ConfigError

    path, _ = checkpoint("granitemoe_swa", layer_rope_theta=[10000.0, 500000.0, 0])
    with pytest.raises(ConfigError, match="rotary bases other than 0 and rope_theta"):
        LLM(path)


@pytest.mark.parametrize("options", [{"prefill_chunk": 5, "block_size": 6, "checkpoint_interval": 60},
                                     {"prefill_chunk": 3, "block_size": 16},
                                     {"prefill_chunk": 7, "block_size": 8, "max_num_seqs": 1}])
def test_deepseek_v4_chunks_that_cut_through_compressed_windows(solo, options) -> None:
    """Prefill chunks of 5, 3 and 7 tokens end inside the 4- and 8-token windows of the CSA and
    HCA layers (and blocks of 6 split them across pages): each window's entry is still made from
    its tokens' projections in the pages, and the logits stay transformers'."""
    path, refs = solo("deepseek_v4")
    llm = LLM(path, **options)
    recorded = record_logits(llm)
    outs = llm.generate(PROMPTS, greedy(STEPS))
    for out, (tokens, logits) in zip(outs, refs, strict=True):
        assert out.token_ids == tokens
        assert max(max_rel_error(a, b) for a, b in zip(recorded[out.request_id], logits, strict=True)) <= 1e-4


def test_deepseek_v4_prefix_reuse_restores_a_half_filled_window(solo) -> None:
    """Blocks of 6 tokens: the reused prefix (a multiple of 6) ends inside a compressor window, so
    the new request starts from projections that a finished one left in the shared pages."""
    path, _ = solo("deepseek_v4")
    ref = reference(path)
    llm = LLM(path, prefix_caching=True, block_size=6, checkpoint_interval=60)
    recorded = record_logits(llm)
    base = PROMPTS[3]
    llm.generate(base, greedy(4))
    longer = base + [7, 9, 11, 13, 15, 17, 19, 21, 23]
    out = llm.generate(longer, greedy(STEPS))[0]
    cached = out.metrics.num_cached_tokens
    assert cached >= 60 and cached % 4 and cached % 8
    tokens, logits = hf_argmax(ref, longer, STEPS)
    assert out.token_ids == tokens
    assert max(max_rel_error(a, b) for a, b in zip(recorded[out.request_id], logits, strict=True)) <= 1e-4


def test_deepseek_v4_cache_holds_window_and_compressor_columns(checkpoint) -> None:
    """Each layer's pages hold the shared K=V per token, and on compressed layers the compressor's
    (and indexer's) projections and entries; `hearth inspect` reports those bytes."""
    from hearth.engine.checkpoint.inspect import summarize

    path, _ = checkpoint("deepseek_v4", **OVERRIDES)
    llm = LLM(path)
    cfg, kv = llm.engine.model_config, llm.engine.runner.kv
    d, di = cfg.head_dim, cfg.index_head_dim
    widths = {"sliding_attention": 0, "heavily_compressed_attention": 3 * d,
              "compressed_sparse_attention": 5 * d + 5 * di}
    for i, kind in enumerate(cfg.attention_kinds):
        assert kv.keys[i].shape[1:] == (1, d) and kv.values[i].shape[1:] == (1, widths[kind])
    assert summarize(cfg).kv_bytes_per_token == sum(d + widths[k] for k in cfg.attention_kinds) * 4


# (family, the multimodal class, its model_type, a vision tensor it ships beside the language model)
MULTIMODAL = [("llama4", "Llama4ForConditionalGeneration", "llama4", "vision_model.patch_embedding.weight"),
              ("deepseek_v3", "KimiK25ForConditionalGeneration", "kimi_k25", "mm_projector.proj.0.weight")]


@pytest.mark.parametrize("family, architecture, model_type, vision", MULTIMODAL, ids=[m[1] for m in MULTIMODAL])
def test_a_multimodal_checkpoint_serves_its_language_model(solo, tmp_path, family, architecture, model_type,
                                                           vision) -> None:
    """Llama 4 ships as Llama4ForConditionalGeneration, Kimi-K2.5 as Kimi_K25ForConditionalGeneration:
    the text config under ``text_config``, the language model's tensors under a prefix
    (``language_model.``: ``language_model.model.layers…``, ``language_model.lm_head``), beside vision
    parts that are not read. The tokens are the text model's own."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path, refs = solo(family)
    out = tmp_path / "multimodal"
    shutil.copytree(path, out)
    text = json.loads((out / "config.json").read_text())
    config = {"architectures": [architecture], "model_type": model_type, "text_config": text}
    (out / "config.json").write_text(json.dumps(config))
    for file in out.glob("*.safetensors"):
        tensors = {f"language_model.{name}": t for name, t in load_file(file).items()}
        save_file(tensors | {vision: torch.zeros(4, 4)}, file)
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {f"language_model.{k}": v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))
    llm = LLM(out)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(STEPS))] == [tokens for tokens, _ in refs]
    llm.close()


def test_kimi_k25_reads_transformers_saved_names_too() -> None:
    from hearth.engine.models import kimi_k25

    assert kimi_k25.map_name("model.language_model.layers.1.mlp.shared_experts.up_proj.weight") == \
        "model.layers.1.mlp.shared_expert.up_proj.weight"
    assert kimi_k25.map_name("language_model.lm_head.weight") == kimi_k25.map_name("lm_head.weight") == "lm_head.weight"
    assert kimi_k25.map_name("model.vision_tower.patch_embed.proj.weight") == ""


def test_every_moe_causal_lm_of_the_pinned_transformers_is_served_or_refused_with_a_reason() -> None:
    """Each causal LM class of the installed transformers whose modeling file defines experts: a
    supported architecture, or one ``NOT_YET`` names with what it lacks (so the refusal says why)."""
    import importlib
    import inspect
    import re

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hearth.config import ConfigError
    from hearth.engine.models import NOT_YET, family_for, supported_architectures

    supported, unclaimed = set(supported_architectures()), []
    for model_type, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        try:
            module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
            source = inspect.getsource(module)
        except (ImportError, OSError):
            continue
        if re.search(r"class \w+(Experts|SparseMoeBlock|MoE|MoeBlock)\b", source) and cls not in supported:
            unclaimed += [] if cls in NOT_YET else [cls]
    assert not unclaimed, f"neither supported nor refused with a reason: {unclaimed}"
    with pytest.raises(ConfigError, match="LongcatFlashForCausalLM is not supported yet: its layers"):
        family_for(["LongcatFlashForCausalLM"])


def test_dbrx_reads_its_rotary_base_from_attn_config_as_shipped(checkpoint, tmp_path) -> None:
    """A DBRX config.json as Databricks ships it (the base only in ``attn_config.rope_theta``): hearth
    turns by that base, which transformers 5 replaces by its default; with ``rope_parameters`` those rule."""
    import json
    import shutil

    from hearth.engine.checkpoint.hf import load_hf_config

    path, _ = checkpoint("dbrx")
    shipped = tmp_path / "shipped"
    shutil.copytree(path, shipped)
    raw = json.loads((shipped / "config.json").read_text())
    raw.pop("rope_parameters")
    raw["attn_config"]["rope_theta"] = 250000.0
    (shipped / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(shipped)[1].rope.theta == 250000.0
    assert load_hf_config(path)[1].rope.theta == 500000.0


def test_mellum_fixed_shape_steps_turn_each_layer_by_its_own_rotary(solo) -> None:
    """Mellum's sliding and global layers turn by rotary tables of their own: the fixed-shape decode
    steps (a StaticBatch through the modules) read each layer's as the flattened steps do."""
    path, refs = solo("mellum")
    llm = LLM(path, static_decode="eager")
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(STEPS))] == [tokens for tokens, _ in refs]
    llm.close()


def test_axk1_as_released_without_a_correction_bias_and_with_norms_on_dense_layers(checkpoint, tmp_path) -> None:
    """A.X K1 as SK Telecom ships it: no router correction bias (transformers keeps it at zero), and a
    ``post_mlp_layernorm`` on the dense layers too, which nothing computes (skipped, as transformers does)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path, model = checkpoint("axk1")
    shipped = tmp_path / "shipped"
    shutil.copytree(path, shipped)
    index = shipped / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    for file in shipped.glob("*.safetensors"):
        save_file({n: t for n, t in load_file(file).items() if not n.endswith("e_score_correction_bias")}, file,
                  metadata={"format": "pt"})
    data["weight_map"] = {n: f for n, f in data["weight_map"].items() if not n.endswith("e_score_correction_bias")}
    first = sorted(shipped.glob("*.safetensors"))[0]
    save_file({**load_file(first), "model.layers.0.post_mlp_layernorm.weight": model.model.norm.weight.detach()},
              first, metadata={"format": "pt"})
    data["weight_map"]["model.layers.0.post_mlp_layernorm.weight"] = first.name
    index.write_text(json.dumps(data))
    ref = reference(shipped)  # transformers: the missing bias at zero, the dense layer's norm unused
    assert not any(layer.mlp.gate.e_score_correction_bias.any() for layer in ref.model.layers[1:])
    llm = LLM(shipped)
    for prompt in PROMPTS:
        assert llm.generate(prompt, greedy(STEPS))[0].token_ids == hf_argmax(ref, prompt, STEPS)[0]
    llm.close()
