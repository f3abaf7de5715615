"""Streaming text: deltas concatenate to the full decode, never splitting a UTF-8 character."""

from __future__ import annotations

from hearth.engine import LLM, SamplingParams
from hearth.engine.text.detokenizer import IncrementalDetokenizer
from tests.checkpoints import build_tokenizer


def test_multibyte_characters_are_never_split(tmp_path):
    tok = build_tokenizer(tmp_path)
    text = "Héllo wörld 東京 🙂🚀 Привет"
    ids = tok.encode(text, add_special_tokens=False)
    # Byte-level BPE splits some of these characters over several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, prompt_ids=[])
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stream_deltas_add_up_to_final_text(checkpoint):
    path, _ = checkpoint("qwen3_moe")
    llm = LLM(path)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    chunks = list(llm.stream("def fibonacci(n):", params))
    assert chunks[-1].finished and len(chunks) == 40
    assert "".join(c.delta_text for c in chunks) == chunks[-1].text
    assert chunks[-1].text == llm.tokenizer.decode(chunks[-1].token_ids, skip_special_tokens=True)


def test_stop_string_truncates_and_is_never_streamed(checkpoint):
    path, _ = checkpoint("qwen3_moe")
    llm = LLM(path)
    base = llm.generate("import os", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = base.text[8:11]
    assert len(stop) == 3
    chunks = list(llm.stream("import os", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])))
    final = chunks[-1]
    assert final.finish_reason == "stop"
    assert final.text == base.text[: base.text.find(stop)]
    assert "".join(c.delta_text for c in chunks) == final.text


def test_stop_token_ids_and_eos(checkpoint):
    path, _ = checkpoint("qwen3_moe")
    llm = LLM(path)
    base = llm.generate("import os", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    target = base.token_ids[5]
    out = llm.generate("import os", SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[target]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(target) + 1]
