"""GGUF files written by llama.cpp's own converter (``tests/fixtures/gguf``, made by
``tools/make_gguf_fixtures.py``): the families hearth reads from GGUF match transformers on the
same file and on the checkpoint the file was made from; the others are refused with one line that
names the architecture, never a traceback or a wrong model."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("gguf")

from hearth.engine import LLM, SamplingParams  # noqa: E402
from hearth.engine.checkpoint.common import CheckpointError  # noqa: E402
from hearth.engine.checkpoint.gguf_reader import ARCHITECTURES, GGUFError  # noqa: E402
from tests.gguf_checkpoints import (  # noqa: E402
    PROMPTS,
    assert_greedy_within_a_tie,
    assert_matches_transformers,
    dequantized_reference,
)
from tests.gguf_fixtures import FAMILIES, FIXTURES, fixture, fixture_model  # noqa: E402

MANIFEST = {r["family"]: r for r in json.loads((FIXTURES / "MANIFEST.json").read_text())}
MADE = [(family, kind) for family in FAMILIES for kind in ("bf16", "q8_0", "q4_k_m")
        if f"{family}-{kind}.gguf" in MANIFEST.get(family, {}).get("written", [])]


def architecture(path) -> str:
    """The file's ``general.architecture``, as the gguf package reads it."""
    import gguf

    return gguf.GGUFReader(path).fields["general.architecture"].contents()


READ = [(f, k) for f, k in MADE if architecture(fixture(f, k)) in ARCHITECTURES]
UNREAD = [(f, k) for f, k in MADE if (f, k) not in READ]


def test_every_family_has_fixtures_or_says_why_not() -> None:
    for family in FAMILIES:
        made = MANIFEST[family]["written"]
        assert made or MANIFEST[family]["failed"], family


# Architectures whose GGUF files transformers reads itself (with its own GGUF loading).
TRANSFORMERS_READS = ("qwen3moe", "qwen2moe", "llama")


@pytest.mark.parametrize(("family", "kind"), READ, ids=[f"{f}-{k}" for f, k in READ])
def test_a_llama_cpp_file_matches_transformers_on_it(family, kind, tmp_path) -> None:
    """transformers on the same file where it reads it; otherwise transformers' model of the
    family holding the file's weights as the gguf package decodes them."""
    path = fixture(family, kind)
    ref = None
    if architecture(path) not in TRANSFORMERS_READS:
        ref = dequantized_reference(path, fixture_model(tmp_path / family, family))
    assert_matches_transformers(path, ref)


@pytest.mark.parametrize("family", sorted({f for f, k in READ if k == "bf16"}))
def test_a_lossless_llama_cpp_file_matches_the_checkpoint_it_was_made_from(family, tmp_path) -> None:
    """The bf16 file against transformers on the bf16 checkpoint itself (computed in fp32): the
    converter's layout (names, q/k row order, stacked experts) read back exactly."""
    model = fixture_model(tmp_path / family, family)
    llm = LLM(fixture(family, "bf16"))
    for prompt in PROMPTS:
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
        assert out.chunk.logprobs[0].logprob == pytest.approx(float(want[out.token_ids[0]]), abs=1e-4)
        tokens = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].token_ids
        assert_greedy_within_a_tie(model, prompt, list(tokens))


def test_an_architecture_hearth_does_not_read_is_refused_by_name(tmp_path) -> None:
    path = tmp_path / "other.gguf"
    with_extra_tensors(fixture("olmoe", "q8_0"), path, {}, architecture="jamba")
    with pytest.raises(GGUFError, match="GGUF architecture 'jamba' is not supported .supported: .*olmoe"):
        LLM(path)


def with_extra_tensors(src, dst, extra: dict, architecture: str | None = None) -> None:
    """``src`` copied to ``dst`` with ``extra`` (name -> float32 array) added, the metadata unchanged
    but for ``general.architecture`` if given."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = architecture or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)  # (row bytes if quantized)
    for name, values in extra.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_multi_token_prediction_layers_in_the_file_are_skipped(tmp_path, caplog) -> None:
    """GLM's and DeepSeek's files from llama.cpp keep their nextn layers after the decoder's
    (``blk.N`` with N = the decoder's layer count, counted in ``block_count``): skipped, named in
    one log line, the model unchanged; a stray tensor elsewhere is still refused."""
    import logging

    import numpy as np

    src = fixture("glm4_moe", "q8_0")
    extra = tmp_path / "nextn.gguf"
    with_extra_tensors(src, extra, {"blk.3.nextn.eh_proj.weight": np.ones((64, 128), np.float32),
                                    "blk.3.attn_norm.weight": np.ones(64, np.float32)})
    with caplog.at_level(logging.INFO, logger="hearth.engine.checkpoint.gguf_reader"):
        got = LLM(extra).generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    assert any("skipped 2 tensors" in r.getMessage() and "blk.3" in r.getMessage() for r in caplog.records)
    assert got == LLM(src).generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    stray = tmp_path / "stray.gguf"
    with_extra_tensors(src, stray, {"blk.1.mystery.weight": np.ones(64, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'blk.1.mystery.weight'"):
        LLM(stray)


def test_every_fixture_made_is_read() -> None:
    assert not UNREAD, UNREAD
