"""GGUF files made by llama.cpp's own tools (its converter, then its quantizer) load in hearth and
match transformers on the same file. Opt-in: set HEARTH_LLAMA_CPP to a llama.cpp checkout (for
``convert_hf_to_gguf.py``) and install llama-cpp-python (the ``peers`` extra, for the quantizer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gguf_checkpoints import assert_matches_transformers
from tests.gguf_fixtures import ADDS_BOS, CONVERTER_FLAGS, RECIPES, SENTENCEPIECE, SHIPPED_NAMES, rename_tensors

LLAMA_CPP = os.environ.get("HEARTH_LLAMA_CPP")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not LLAMA_CPP, reason="HEARTH_LLAMA_CPP (a llama.cpp checkout) is not set")]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("family", "shape"), [("qwen3_moe", {"moe_intermediate_size": 512, "intermediate_size": 256}),
                                               ("mixtral", {"intermediate_size": 512})])
def test_llama_cpp_files_match_transformers(tmp_path, family, shape) -> None:
    pytest.importorskip("llama_cpp")
    from bench.peers import quantize
    from tests.checkpoints import make_checkpoint

    hf, _ = make_checkpoint(tmp_path / "hf", family, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, num_hidden_layers=3, dtype="bfloat16", **shape)
    bf16 = tmp_path / "m-bf16.gguf"
    code = ("import sys; from pathlib import Path; sys.argv = ['convert']; from bench.peers import convert; "
            f"convert(Path({str(hf)!r}), Path({LLAMA_CPP!r}), Path({str(bf16)!r}))")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)  # its own process
    # (Q2_K, Q3_K_M and IQ4_XS: the low-bit experts of llama.cpp's smaller files and the Unsloth-style mixes)
    for name in ("q8_0", "q4_k_m", "q2_k", "q3_k_m", "iq4_xs"):
        out = tmp_path / f"m-{name}.gguf"
        quantize(bf16, out, name, 2)
        assert_matches_transformers(out)
    assert_matches_transformers(bf16)



_FIRST_TOKENS = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
first = [next(iter(llm.generate(prompt, top_k=1, temp=0.0, reset=True))) for prompt in json.loads(sys.argv[2])]
print(json.dumps(first))
"""
# log-probability: llama.cpp multiplies with int8 activations (Q8_K ones for the K formats), so where a
# random model's top tokens are this close it may pick either (0.12 was seen at Q4_K_M; a wrong layout
# gives tokens far down the list)
LLAMA_TIE = 0.15
# the families hearth convert writes
WRITTEN = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "minimax_m2", "glm4_moe", "deepseek_v2", "deepseek_v3",
           "gpt_oss", "qwen3_next", "qwen3_5_moe", "dots1", "granitemoe_shared", "glm4_moe_lite",
           "ernie4_5_moe", "exaone_moe", "lfm2_moe", "granitemoehybrid", "afmoe", "cohere2_moe", "llama4",
           "deepseek_v32", "glm_moe_dsa", "kimi_linear", "dbrx", "solar_open", "hy_v3", "mellum", "laguna"]


def _checkpoint(tmp_path, family: str):
    from tests.checkpoints import make_checkpoint, write_gpt2_files, write_sentencepiece

    shape = {"intermediate_size": 256} if family in ("mixtral", "granitemoe_shared") else {"moe_intermediate_size": 256,
                                                                     "intermediate_size": 256}
    # llama.cpp's OLMoE takes its k norm as wide as the model, and its dots1 takes as many KV heads as
    # heads (as OLMoE and dots.llm1 ship)
    attention = {"num_key_value_heads": 4 if family in ("olmoe", "dots1") else 2, "head_dim": 64}
    if family == "qwen3_next":
        # llama.cpp 0.3.36's Qwen3-Next parts from transformers at head widths of 32 and 64 (its first
        # token on a 21-token prompt ranked at -5.3 by transformers against -2.6, on its own
        # converter's file as on hearth's, which are equal tensor for tensor); at 16 they agree.
        attention["head_dim"] = 16
    if family.startswith("deepseek") or family in ("glm4_moe_lite", "glm_moe_dsa"):
        # Latent attention: as many KV heads as heads (the converter splits kv_b by them), the head
        # widths its own; llama.cpp takes a V2 without a query LoRA for V2-Lite only by its 27 layers.
        attention = {"num_key_value_heads": 4, "q_lora_rank": 32}
        if family == "glm4_moe_lite":  # (its two layers: the first dense)
            attention["mlp_layer_types"] = ["dense", "sparse"]
        if family in ("deepseek_v32", "glm_moe_dsa"):  # (llama.cpp's indexer turns its keys by a Hadamard
            attention["index_head_dim"] = 64              # matrix of at least 64; GLM-5's second layer reuses
        if family == "glm_moe_dsa":                       # the first's selection)
            attention["indexer_types"] = ["full", "shared"]
    if family == "ernie4_5_moe":  # (its converter writes the shared experts' width as intermediate_size / KV heads)
        shape["intermediate_size"] = 2 * 256
    if family == "granitemoehybrid":  # (a Mamba-2 layer, then attention; llama.cpp takes an SSM twice as wide)
        attention |= {"layer_types": ["linear_attention", "attention"], "mamba_n_heads": 8, "mamba_d_head": 64}
        shape = {"intermediate_size": 256}
    if family == "lfm2_moe":  # (two layers: a dense convolution, then MoE attention)
        attention |= {"layer_types": ["conv", "full_attention"]}
    if family == "kimi_linear":  # (two layers: a dense delta attention one, then a latent attention MoE one;
        # llama.cpp takes as many delta attention heads as attention heads)
        attention = {"num_key_value_heads": 4, "layer_types": ["linear_attention", "full_attention"],
                     "mlp_layer_types": ["dense", "sparse"], "linear_num_heads": 4, "linear_head_dim": 64}
    if family == "exaone_moe":  # (two layers: a dense one in a window, then a global MoE one)
        attention |= {"layer_types": ["sliding_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"]}
    if family == "dbrx":  # (its widths, heads and experts in its sub-configs)
        attention = {"d_model": 256, "attn_config": {"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 500000.0}}
        shape = {"ffn_config": {"ffn_hidden_size": 256, "moe_num_experts": 8, "moe_top_k": 2}}
    # The hybrids attend every fourth layer: llama.cpp cannot run one with no attention layer (no KV cache).
    # llama.cpp's Llama 4 needs its fourth, global layer (with two chunked layers only it stops on an
    # unallocated buffer).
    layers = 4 if family in ("qwen3_next", "qwen3_5_moe", "llama4") else 2
    # (AfMoE's recipe: two sliding layers here, llama.cpp taking every fourth layer global)
    if family == "mellum":  # (two layers: a sliding one, then a global one)
        attention |= {"layer_types": ["sliding_attention", "full_attention"], "mlp_layer_types": ["sparse"] * 2}
    if family == "laguna":  # (two layers: a dense global one, then a sliding MoE one with half the query heads)
        attention |= {"layer_types": ["full_attention", "sliding_attention"], "mlp_layer_types": ["dense", "sparse"],
                      "num_attention_heads_per_layer": [4, 2]}
    recipe = {k: v for k, v in RECIPES.get(family, {}).items() if k != "num_hidden_layers" and k not in attention}
    path = make_checkpoint(tmp_path / "hf", family, hidden_size=256, num_attention_heads=4, num_hidden_layers=layers,
                           **attention, **shape, **recipe)[0]  # (recipes: each converter's tokenizer)
    if family in SENTENCEPIECE:  # (its converter reads tokenizer.model only)
        write_sentencepiece(path)
    if family in ADDS_BOS:  # (its converter insists on a tokenizer that adds BOS: see tests/gguf_fixtures.py)
        write_gpt2_files(path)
    if family in SHIPPED_NAMES:  # as shipped (names transformers saves otherwise)
        rename_tensors(path, SHIPPED_NAMES[family])
    if family in SHIPPED:  # as shipped (transformers' config classes do not write these; the converter reads them)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **SHIPPED[family]}))
    return path


SHIPPED = {"minimax_m2": {"scoring_func": "sigmoid"}, "deepseek_v2": {"scoring_func": "softmax"},
           "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
           # (the router's score function, which llama.cpp's converter reads from the config and its
           # dots1 requires; transformers' class routes by sigmoid whatever the config says)
           "dots1": {"scoring_func": "sigmoid"},
           # (GLM-4.7-Flash's dense first layer and sigmoid routing, as the converter reads them)
           "glm4_moe_lite": {"first_k_dense_replace": 1, "scoring_func": "sigmoid"},
           "deepseek_v32": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
           "glm_moe_dsa": {"scoring_func": "sigmoid"},
           "kimi_linear": {"first_k_dense_replace": 1, "moe_router_activation_func": "sigmoid",
                           "linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1], "head_dim": 64,
                                                  "num_heads": 4, "short_conv_kernel_size": 4}},
           # (Granite 4's own names for its layers, which the converter reads)
           "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
           # (Solar Open's full rotary, which the converter takes as half where config.json does not name it)
           "solar_open": {"partial_rotary_factor": 1.0}}


@pytest.mark.parametrize("family", WRITTEN)
def test_hearth_writes_the_tensors_llama_cpps_converter_writes(tmp_path, family) -> None:
    """``hearth convert --quant q8_0`` and llama.cpp's converter (to Q8_0) on the same checkpoint:
    every tensor of the same name, type and bytes, and the metadata both write equal."""
    import gguf
    import numpy as np

    from hearth.engine.checkpoint.gguf_writer import write_gguf

    hf = _checkpoint(tmp_path, family)
    ours = gguf.GGUFReader(write_gguf(hf, tmp_path / "hearth.gguf", "q8_0"))
    theirs_path = tmp_path / "llama.gguf"
    code = ("import sys; from pathlib import Path; from bench.peers import convert; "
            f"convert(Path({str(hf)!r}), Path({LLAMA_CPP!r}), Path({str(theirs_path)!r}), 'q8_0', "
            f"{CONVERTER_FLAGS.get(family, ())!r})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    theirs = gguf.GGUFReader(theirs_path)
    tensors = {t.name: t for t in theirs.tensors}
    assert {t.name for t in ours.tensors} == set(tensors)
    for t in ours.tensors:
        assert t.tensor_type == tensors[t.name].tensor_type, t.name
        assert list(t.shape) == list(tensors[t.name].shape), t.name
        assert np.array_equal(np.asarray(t.data).reshape(-1), np.asarray(tensors[t.name].data).reshape(-1)), t.name
    skip = ("general.", "tokenizer.ggml.pre", "GGUF.")  # (names, sizes; the pre-tokenizer: see the converter patch)
    for key, field in theirs.fields.items():  # every key the converter writes, with its value (hearth may add keys)
        if not key.startswith(skip):
            assert key in ours.fields and ours.fields[key].contents() == field.contents(), key


@pytest.mark.parametrize("family", WRITTEN)
@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_llama_cpp_runs_hearth_written_files(tmp_path, family, quant) -> None:
    """``hearth convert --quant`` files load in llama.cpp, whose first greedy token on each prompt
    is hearth's, or a near-tie in hearth's log-probabilities (``LLAMA_TIE``). (Further tokens are
    not compared: on random tiny models llama.cpp's int8 activations break ties a few tokens on,
    and its own choices then change with its batch size and KV cache type.)"""
    pytest.importorskip("llama_cpp")
    from hearth.engine import LLM, SamplingParams
    from hearth.engine.checkpoint.gguf_writer import write_gguf
    from tests.gguf_checkpoints import PROMPTS

    out = write_gguf(_checkpoint(tmp_path, family), tmp_path / f"m-{quant}.gguf", quant)
    done = subprocess.run([sys.executable, "-c", _FIRST_TOKENS, str(out), json.dumps(PROMPTS)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    llm = LLM(out)
    for prompt, token in zip(PROMPTS, theirs, strict=True):
        sampled = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=20))[0]
        top = dict(sampled.chunk.logprobs[0].top)
        assert token in top and max(top.values()) - top[token] < LLAMA_TIE, (family, quant, token, top)
