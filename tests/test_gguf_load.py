"""A GGUF file loads as one file (config, tokenizer, chat template and weights from it) and runs
like transformers on the same file: transformers reads and dequantizes it with the gguf package,
independently of hearth's decoders; fp32 logits within 1e-4, greedy tokens equal."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from hearth.engine import LLM  # noqa: E402
from hearth.engine.checkpoint.gguf_reader import GGUFError  # noqa: E402
from tests.gguf_checkpoints import assert_matches_transformers, write_gguf  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 3], [200, 7, 7, 31], list(range(40, 61))]


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    # Rows of 256 and 512 (hidden, expert width): whole K-quant super-blocks, so every matrix is
    # quantized; the two differ, so a swap of H and I anywhere would show.
    path, _ = make_checkpoint(tmp_path_factory.mktemp("hf"), "qwen3_moe", hidden_size=256, moe_intermediate_size=512,
                              intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return path


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0", "q4_k", "q5_k", "q6_k", "q4_0", "mxfp4"])
def test_gguf_model_matches_transformers_on_the_same_file(hf_checkpoint, tmp_path, fmt) -> None:
    path = write_gguf(hf_checkpoint, tmp_path / f"m-{fmt}.gguf", fmt)
    from hearth.engine.checkpoint.gguf_reader import GGUFFile

    stored = GGUFFile(path).tensors
    matrices = [t for n, t in stored.items() if len(t.shape) >= 2 and "ffn_gate_inp" not in n]  # routers stay f32
    floats = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    assert all((t.format.name if t.quantized else floats[t.format]) == fmt for t in matrices), "another format"
    assert_matches_transformers(path)


def test_tokenizer_and_chat_template_come_from_the_file(hf_checkpoint, tmp_path) -> None:
    from transformers import AutoTokenizer

    path = write_gguf(hf_checkpoint, tmp_path / "m.gguf", "q8_0")
    llm = LLM(path)
    original = AutoTokenizer.from_pretrained(hf_checkpoint)
    # Single spaces: transformers rebuilds a Qwen2 tokenizer (its split regex) from the file, while
    # the tiny checkpoint's own splits runs of spaces the GPT-2 way.
    text = "def f(x): return x + 1"
    assert llm.engine.encode(text) == original.encode(text, add_special_tokens=False)
    assert llm.engine.tokenizer.chat_template == original.chat_template


def test_a_gguf_that_does_not_match_its_metadata_is_refused(hf_checkpoint, tmp_path) -> None:
    import numpy as np

    path = write_gguf(hf_checkpoint, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "less.gguf"), "qwen3moe")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        if t.name != "blk.1.ffn_up_exps.weight":
            writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="missing tensor 'blk.1.ffn_up_exps.weight'"):
        LLM(tmp_path / "less.gguf")
    with pytest.raises(GGUFError, match="no such GGUF file"):
        from hearth.engine.checkpoint.gguf_reader import GGUFFile

        GGUFFile(tmp_path / "nope.gguf")


def test_inspect_shows_the_stored_formats_and_bytes_per_token(hf_checkpoint, tmp_path) -> None:
    import json
    import subprocess
    import sys

    path = write_gguf(hf_checkpoint, tmp_path / "m.gguf", "q8_0")
    out = subprocess.run([sys.executable, "-m", "hearth.cli.main", "inspect", str(path), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    stored = json.loads(out.stdout)["stored"]
    experts = stored["formats"]["experts"]
    assert list(experts) == ["q8_0"] and list(stored["formats"]["norms"]) == ["float32"]
    from hearth.engine.checkpoint.gguf_reader import GGUFFile

    f = GGUFFile(path)
    cfg = json.loads((hf_checkpoint / "config.json").read_text())
    exps = sum(t.nbytes for n, t in f.tensors.items() if "_exps" in n)
    assert experts["q8_0"] == exps
    embed = f.tensors["token_embd.weight"]
    dense = sum(t.nbytes for n, t in f.tensors.items() if "_exps" not in n and n != "token_embd.weight")
    tied = 0 if "output.weight" in f.tensors else embed.nbytes
    want = dense + embed.nbytes / embed.shape[0] + tied + exps * cfg["num_experts_per_tok"] / cfg["num_local_experts"]
    assert stored["bytes_per_decode_token"] == int(want)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_quantized_weights_stay_in_their_blocks_and_both_paths_agree(hf_checkpoint, tmp_path, fmt) -> None:
    from hearth.engine.experts.compute import routed_partial_sum
    from hearth.engine.kernels.cpu import cpu_decode_ops

    path = write_gguf(hf_checkpoint, tmp_path / "m.gguf", fmt)
    llm = LLM(path)
    pool, model = llm.engine.pool, llm.engine.runner.model
    if cpu_decode_ops() is None:
        pytest.skip("no native kernels here: weights are decoded at load")
    blocks = pool.layer_blocks(pool.moe_layer_ids[0])
    assert blocks.gate_up.name == blocks.down.name == fmt and pool.gate_up.dtype == torch.uint8
    # Dense projections, the output projection and the embedding stay in blocks too.
    attn = model.model.layers[0].self_attn
    assert attn.qkv_weight.dtype == attn.o_proj.weight.dtype == model.lm_head.weight.dtype == torch.uint8
    assert model.model.embed_tokens.weight.block_format.name == fmt
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([[0, 5], [7, -1], [3, 3]])
    weights = torch.tensor([[0.7, 0.3], [1.0, 0.0], [0.5, 0.5]])
    kernel = routed_partial_sum(x, pool.gate_up, pool.down, rows, weights, torch.nn.functional.silu, blocks)
    decoded = routed_partial_sum(x, pool.gate_up, pool.down, rows, weights, torch.sigmoid, blocks)  # torch path
    torch_silu = routed_partial_sum(x.repeat(3, 1)[:9], pool.gate_up, pool.down, rows.repeat(3, 1),
                                    weights.repeat(3, 1), torch.nn.functional.silu, blocks)[:3]  # 9 tokens: torch
    # Two chained products, each within 5e-6 of its largest output (tests/test_split_activations.py).
    assert float((kernel - torch_silu).abs().max()) <= 1e-5 * float(torch_silu.abs().max())
    assert not torch.allclose(kernel, decoded)  # a different activation gives a different result
    # The hierarchy keeps them in blocks too (tests/test_gguf_hierarchy.py runs it).
    assert LLM(path, expert_device="virtual").engine.pool.blocks is not None


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_a_gguf_file_splits_into_pipeline_stages(hf_checkpoint, tmp_path, fmt) -> None:
    """Two stages of a GGUF file, each reading only its layers' tensors (the first the embeddings,
    the last the head): one engine's tokens and logits."""
    from hearth.config import EngineConfig
    from hearth.engine import LLMEngine
    from tests.helpers import greedy, max_rel_error, record_logits

    path = write_gguf(hf_checkpoint, tmp_path / f"m-{fmt}.gguf", fmt)
    config = EngineConfig(kv_cache_tokens=512)
    whole = LLM(path, config=config)
    layers = whole.engine.model_config.num_layers
    later = LLMEngine(path, config, layers=(1, layers))
    assert later.pool.moe_layer_ids == list(range(1, layers))
    staged = object.__new__(LLM)
    staged.engine = LLMEngine(path, config, layers=(0, 1), next_stage=later.stage_forward)
    recorded = {"whole": record_logits(whole), "staged": record_logits(staged)}
    prompt = "def fibonacci(n):"
    outs = {name: llm.generate([prompt], greedy(8))[0] for name, llm in (("whole", whole), ("staged", staged))}
    assert outs["staged"].token_ids == outs["whole"].token_ids
    for a, b in zip(recorded["staged"][outs["staged"].request_id], recorded["whole"][outs["whole"].request_id],
                    strict=True):
        assert max_rel_error(a, b) <= 1e-5
