"""`hearth convert --quant`: a Hugging Face checkpoint quantized into one GGUF file, loaded as
shipped and exact against transformers on that file; the mixes (Q4_K_M) keep each tensor in its
own format through the engine; Qwen2-MoE (shared experts) too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from hearth.cli.main import main  # noqa: E402
from hearth.engine.checkpoint.gguf_reader import GGUFFile  # noqa: E402
from hearth.engine.checkpoint.gguf_writer import ConvertError, tensor_format, write_gguf  # noqa: E402
from hearth.engine.kernels.cpu import cpu_decode_ops  # noqa: E402
from tests.gguf_checkpoints import assert_matches_transformers  # noqa: E402

SHAPE = dict(hidden_size=256, moe_intermediate_size=512, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    path, _ = make_checkpoint(tmp_path_factory.mktemp("hf3"), "qwen3_moe", num_hidden_layers=3, **SHAPE)
    return path


def test_the_q4_k_m_mix_follows_llama_cpp_rules() -> None:
    assert tensor_format("output.weight", "q4_k_m", 24) == "q6_k"
    assert tensor_format("blk.0.attn_v.weight", "q4_k_m", 24) == "q6_k"  # first eighth
    assert tensor_format("blk.23.ffn_down_exps.weight", "q4_k_m", 24) == "q6_k"  # last eighth
    assert tensor_format("blk.5.ffn_down_exps.weight", "q4_k_m", 24) == "q6_k"  # (5 - 3) % 3 == 2
    assert tensor_format("blk.4.ffn_down_exps.weight", "q4_k_m", 24) == "q4_k"
    assert tensor_format("blk.0.attn_q.weight", "q4_k_m", 24) == "q4_k"
    assert tensor_format("blk.0.ffn_gate_exps.weight", "q8_0", 24) == "q8_0"


def test_convert_quant_writes_a_gguf_that_matches_transformers(three_layers, tmp_path, capsys) -> None:
    out = tmp_path / "m-q4_k_m.gguf"
    assert main(["convert", str(three_layers), str(out), "--quant", "q4_k_m"]) == 0
    tensors = GGUFFile(out).tensors
    formats = {n: t.format.name for n, t in tensors.items() if t.quantized}
    assert formats["blk.2.ffn_down_exps.weight"] == formats["blk.2.attn_v.weight"] == "q6_k"
    assert formats["blk.1.ffn_down_exps.weight"] == formats["blk.1.attn_v.weight"] == "q4_k"
    assert formats["output.weight"] == "q6_k" and "blk.0.ffn_gate_inp.weight" not in formats
    llm = assert_matches_transformers(out)
    if cpu_decode_ops() is None:
        return
    pool, model = llm.engine.pool, llm.engine.runner.model
    assert [pool.layer_blocks(layer).down.name for layer in range(3)] == ["q4_k", "q4_k", "q6_k"]
    assert model.model.layers[2].self_attn.qkv_weight is None  # q/k in Q4_K, v in Q6_K: one by one
    assert model.model.layers[1].self_attn.qkv_weight.dtype == torch.uint8


def test_convert_refuses_what_it_cannot_write(three_layers, tmp_path, capsys) -> None:
    assert main(["convert", str(three_layers), str(tmp_path / "x.gguf"), "--quant", "q3_k"]) == 2
    assert "unknown quantization 'q3_k'" in capsys.readouterr().err
    assert main(["convert", str(three_layers), str(tmp_path / "x"), "--quant", "q8_0"]) == 2
    assert "FILE.gguf" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


def test_qwen2_moe_with_shared_experts_round_trips_through_gguf(tmp_path) -> None:
    from tests.checkpoints import make_checkpoint

    hf, _ = make_checkpoint(tmp_path / "hf", "qwen2_moe", shared_expert_intermediate_size=256, **SHAPE)
    out = write_gguf(hf, tmp_path / "q2.gguf", "q8_0")
    assert "blk.0.ffn_gate_shexp.weight" in GGUFFile(out).tensors
    assert_matches_transformers(out)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "qwen3_next", "qwen3_5_moe",
                                    "dots1", "granitemoe", "granitemoe_shared", "glm4_moe_lite",
                                    "ernie4_5_moe", "exaone_moe", "lfm2_moe",
                                    "granitemoehybrid", "afmoe", "cohere2_moe", "llama4", "deepseek_v32",
                                    "glm_moe_dsa", "kimi_linear", "dbrx", "solar_open", "hy_v3", "mellum",
                                    "laguna"])
def test_hearth_written_files_match_transformers(tmp_path, family) -> None:
    """A family's checkpoint written by ``hearth convert --quant q8_0`` (the layout llama.cpp's
    converter writes: tests/test_gguf_llama_cpp.py compares them tensor by tensor) reads back
    through the GGUF loader and matches transformers on the same file."""
    from tests.gguf_checkpoints import dequantized_reference
    from tests.gguf_fixtures import fixture_checkpoint, fixture_model

    hf, _ = fixture_checkpoint(tmp_path / "hf", family)
    out = write_gguf(hf, tmp_path / "m.gguf", "q8_0")
    # (transformers does not read these architectures' GGUF files: its model of the family holds the
    # file's weights as the gguf package decodes them)
    assert_matches_transformers(out, dequantized_reference(out, fixture_model(tmp_path / "ref", family)))


def test_a_dbrx_checkpoint_whose_weights_llama_cpp_cannot_normalise_is_refused(tmp_path) -> None:
    """llama.cpp divides DBRX's top-k weights by their sum: a 2-norm cannot be written."""
    from tests.checkpoints import make_checkpoint

    hf, _ = make_checkpoint(tmp_path / "hf", "dbrx", ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8,
                                                                 "moe_top_k": 2, "moe_normalize_expert_weights": 2.0})
    with pytest.raises(ConvertError, match="moe_normalize_expert_weights=2.0"):
        write_gguf(hf, tmp_path / "m.gguf", "q8_0")


def test_a_hunyuan_v3_checkpoint_with_biases_is_refused(tmp_path) -> None:
    """llama.cpp's hy_v3 computes no biases: a GGUF file would carry them to no effect."""
    from tests.checkpoints import make_checkpoint

    hf, _ = make_checkpoint(tmp_path / "hf", "hy_v3")  # (the test defaults: attention and MLP biases)
    with pytest.raises(ConvertError, match="attention_bias and mlp_bias"):
        write_gguf(hf, tmp_path / "m.gguf", "q8_0")


def test_a_laguna_checkpoint_with_a_router_soft_cap_is_refused(tmp_path) -> None:
    """llama.cpp's laguna has no router soft-cap (the test defaults have one)."""
    from tests.checkpoints import make_checkpoint

    hf, _ = make_checkpoint(tmp_path / "hf", "laguna")
    with pytest.raises(ConvertError, match="router soft-cap"):
        write_gguf(hf, tmp_path / "m.gguf", "q8_0")


def test_an_afmoe_checkpoint_without_mup_is_refused(tmp_path) -> None:
    """llama.cpp's AfMoE always scales the embeddings by muP; a GGUF file cannot carry a model without it."""
    from tests.checkpoints import make_checkpoint

    hf, _ = make_checkpoint(tmp_path / "hf", "afmoe", mup_enabled=False)
    with pytest.raises(ConvertError, match="mup_enabled=false"):
        write_gguf(hf, tmp_path / "m.gguf", "q8_0")


@pytest.mark.parametrize(("overrides", "reason"), [
    ({"shared_expert_combination_strategy": "sum"}, "averages them"),
    ({"attention_bias": True}, "attention biases"),
    ({"prefix_dense_sliding_window_pattern": 2}, "every leading dense layer"),
], ids=["sum", "bias", "dense-pattern"])
def test_a_cohere2_moe_checkpoint_llama_cpp_cannot_compute_is_refused(tmp_path, overrides, reason) -> None:
    """llama.cpp's Cohere2-MoE averages the shared experts in, has no biases and turns the rotary on
    every leading dense layer: a checkpoint that does otherwise is refused with the reason."""
    from tests.checkpoints import make_checkpoint

    hf, _ = make_checkpoint(tmp_path / "hf", "cohere2_moe", **overrides)
    with pytest.raises(ConvertError, match=reason):
        write_gguf(hf, tmp_path / "m.gguf", "q8_0")


def test_a_llama4_checkpoint_off_llama_cpp_constants_is_refused(tmp_path) -> None:
    """llama.cpp's Llama 4 holds the chunk size (8192), the NoPE step and the query scaling as constants."""
    from tests.checkpoints import make_checkpoint

    hf, _ = make_checkpoint(tmp_path / "hf", "llama4")  # (chunks of 6 tokens, floor 4)
    with pytest.raises(ConvertError, match="attention_chunk_size"):
        write_gguf(hf, tmp_path / "m.gguf", "q8_0")


def test_an_unsupported_architecture_is_named(tmp_path) -> None:
    from tests.checkpoints import make_checkpoint

    hf, _ = make_checkpoint(tmp_path / "hf", "deepseek_v4", chat_format="deepseek_v4")
    with pytest.raises(ConvertError, match="DeepseekV4ForCausalLM"):
        write_gguf(hf, tmp_path / "m.gguf", "q8_0")


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_k", "q5_k", "q6_k", "q4_k_m"])
def test_mixtral_gguf_matches_transformers(tmp_path, fmt) -> None:
    """Mixtral as llama.cpp writes it (GGUF ``llama`` with experts, q/k rows interleaved)."""
    from tests.checkpoints import make_checkpoint

    hf, original = make_checkpoint(tmp_path / "hf", "mixtral", hidden_size=256, intermediate_size=512,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=3)
    out = write_gguf(hf, tmp_path / f"mx-{fmt}.gguf", fmt)
    assert GGUFFile(out).architecture == "llama"
    if fmt == "f32":  # the reference reads the file back to the original model (the q/k order is llama.cpp's)
        from tests.gguf_checkpoints import reference

        prompt = torch.tensor([[5, 17, 42, 99, 3]])
        with torch.no_grad():
            torch.testing.assert_close(reference(out)(prompt).logits, original.float()(prompt).logits,
                                       rtol=1e-4, atol=1e-5)
    assert_matches_transformers(out)


def test_a_preset_falls_back_per_tensor_and_says_so(tmp_path, capsys) -> None:
    """Rows that are not whole 256-value blocks get Q8_0 where 32-value blocks fit and f16 where
    nothing does (as llama.cpp's quantizer falls back), never a silent f32; the command counts the
    formats and warns for each fallback; the file is exact against transformers on it."""
    from hearth.engine.checkpoint.gguf_writer import WriteSummary, fitting_format
    from tests.checkpoints import make_checkpoint

    assert fitting_format("q4_k", 256) == "q4_k" and fitting_format("q4_k", 96) == "q8_0"
    assert fitting_format("q6_k", 40) == "f16" and fitting_format("f32", 40) == "f32"
    # hidden 96: q/k/v/o rows of 96 values (q8_0); the experts' down rows of 40 (f16)
    hf, _ = make_checkpoint(tmp_path / "hf", "qwen3_moe", hidden_size=96, moe_intermediate_size=40,
                            intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    summary = WriteSummary()
    out = write_gguf(hf, tmp_path / "direct.gguf", "q4_k_m", summary=summary)
    formats = {n: t.format.name if t.quantized else None for n, t in GGUFFile(out).tensors.items()}
    assert formats["blk.0.attn_q.weight"] == formats["blk.0.ffn_gate_exps.weight"] == "q8_0"
    assert GGUFFile(out).tensors["blk.0.ffn_down_exps.weight"].format == torch.float16
    assert summary.fallbacks[("q4_k", "q8_0")] > 0 and summary.fallbacks[("q6_k", "f16")] > 0
    assert summary.formats["f32"] > 0 and "q4_k" not in summary.formats
    assert_matches_transformers(out)
    assert main(["convert", str(hf), str(tmp_path / "cli.gguf"), "--quant", "q4_k_m"]) == 0
    err = capsys.readouterr().err
    assert "warning: q4_k_m not honoured for" in err and "whole q4_k blocks (256 values): written as q8_0" in err
    assert "(tensors: q8_0 " in err or ", q8_0 " in err


def test_an_mxfp4_shipped_checkpoint_is_refused_in_one_line(tmp_path) -> None:
    """GPT-OSS as released (MXFP4 experts) is not repacked into GGUF yet: one error that says so."""
    from tests.checkpoints import make_checkpoint
    from tests.hf_quant_checkpoints import write_gpt_oss_mxfp4

    src, model = make_checkpoint(tmp_path / "float", "gpt_oss", hidden_size=64, intermediate_size=64,
                                 num_attention_heads=4, num_key_value_heads=2)
    path = write_gpt_oss_mxfp4(model, src, tmp_path / "mxfp4")
    with pytest.raises(ConvertError, match="ships its experts in MXFP4"):
        write_gguf(path, tmp_path / "m.gguf", "q8_0")
