"""Constrained decoding in the engine: sampled output always matches the request's grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest

from hearth.engine.checkpoint.demo import demo_model_dir
from hearth.engine.llm import LLM
from hearth.engine.text.grammar import GrammarError, json_schema_grammar
from hearth.proto.contracts import SamplingParams
from hearth.serving.constraints import GrammarBuilder
from hearth.serving.parsers import parse_xml_call

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "kind", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"},
                         "kind": {"enum": ["a", "b"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}}


@pytest.fixture(scope="module")
def llm():
    return LLM(demo_model_dir())


def test_sampled_json_always_matches_the_schema(llm) -> None:
    grammar = json_schema_grammar(SCHEMA)
    for seed in range(4):
        out = llm.generate("def f(x):", SamplingParams(max_tokens=120, temperature=1.0, seed=seed, grammar=grammar))[0]
        assert out.chunk.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_forced_tool_call_grammar_yields_a_call_to_a_given_tool(llm) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    grammar = GrammarBuilder(llm.engine.tokenizer).tool_call("hermes", tools, "get_weather")
    for seed in range(3):
        out = llm.generate("<tool_call>\n", SamplingParams(max_tokens=80, temperature=1.0, seed=seed,
                                                          grammar=grammar))[0]
        body, tail = out.text.rsplit("\n</tool_call>", 1)
        call = json.loads(body)
        assert tail == "" and call["name"] == "get_weather"
        jsonschema.validate(call["arguments"], params)


def test_forced_xml_tool_call_grammar_yields_a_parsable_call(llm) -> None:
    # Bounded values only: raw-text values end when the model writes the closing tag, which a
    # barely trained model may never do (see the acceptance test below for free text).
    params = {"type": "object", "required": ["unit"], "properties": {
        "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    grammar = GrammarBuilder(llm.engine.tokenizer).tool_call("qwen3_coder", tools, "get_weather")
    for seed in range(3):
        out = llm.generate("<tool_call>\n", SamplingParams(max_tokens=80, temperature=1.0, seed=seed,
                                                          grammar=grammar))[0]
        body, tail = out.text.rsplit("</tool_call>", 1)
        call = parse_xml_call(body)
        assert tail == "" and call is not None and call.name == "get_weather", out.text
        jsonschema.validate(call.input, params)


def test_a_grammar_that_does_not_compile_is_refused(llm) -> None:
    with pytest.raises(GrammarError, match="invalid"):
        llm.engine.add_request("x", SamplingParams(grammar=json_schema_grammar({"type": "objectx"})))


def _accepts(llm, grammar: str, text: str) -> bool:
    matcher = llm.engine.grammars.matcher(grammar)
    tokens = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    return all(matcher._ll.consume_token(t) for t in tokens) and matcher._ll.is_accepting()


def test_xml_grammar_takes_free_text_values_and_pydantic_refs(llm) -> None:
    # No maxLength, "<" and newlines inside a value, a "$ref" into "$defs" (what pydantic writes).
    params = {"type": "object", "required": ["code", "mode"], "$defs": {"Mode": {"enum": ["r", "w"]}},
              "properties": {"code": {"type": "string"}, "mode": {"$ref": "#/$defs/Mode"},
                             "n": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "run", "parameters": params}}]
    grammar = GrammarBuilder(llm.engine.tokenizer).tool_call("qwen3_coder", tools, None)
    call = ('<function=run>\n<parameter=code>\nif a < b:\n    42\n</parameter>\n<parameter=mode>\n"w"\n'
            '</parameter>\n</function>\n</tool_call>')
    assert _accepts(llm, grammar, call)
    assert not _accepts(llm, grammar, call.replace("<parameter=mode>", "<parameter=mood>"))
    parsed = parse_xml_call(call.removesuffix("</tool_call>"), {"run": frozenset({"code"})})
    assert parsed.input == {"code": "if a < b:\n    42", "mode": "w"}
    assert parse_xml_call("<function=run>\n<parameter=code>\n42\n</parameter>\n</function>",
                          {"run": frozenset({"code"})}).input == {"code": "42"}  # a string stays a string


def test_a_tool_grammar_needs_a_tool(llm) -> None:
    with pytest.raises(ValueError, match="no tool"):
        GrammarBuilder(llm.engine.tokenizer).tool_call("hermes", [], None)


def sampled_calls(llm, grammar: str, prefix: str, parser: str, max_tokens: int, seeds: int = 3):
    """(events, text) of replies sampled under ``grammar`` after ``prefix``, read by ``parser``."""
    from hearth.serving.reply_parsers import OutputParser

    for seed in range(seeds):
        out = llm.generate(prefix, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                                                  grammar=grammar))[0]
        reader = OutputParser(parser, False, False, True)
        yield reader.feed(prefix + out.text) + reader.flush(), out.text


@pytest.mark.parametrize("parser", ["glm45", "minimax_m2", "deepseek_v4"])
def test_forced_calls_in_glm_and_minimax_formats(llm, parser) -> None:
    """The forced-call grammar of each key/value format accepts what its parser reads (free text
    with "<" and newlines, JSON values, an optional parameter left out) and refuses an unknown key;
    sampled calls parse to a call of the named tool whose arguments match the schema."""
    from hearth.serving.constraints import FORCED_CALL_PREFIX
    from hearth.serving.reply_parsers import OutputParser

    params = {"type": "object", "required": ["code", "unit"],
              "properties": {"code": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "n": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "run", "parameters": params}}]
    grammar = GrammarBuilder(llm.engine.tokenizer).tool_call(parser, tools, "run")
    if parser == "glm45":
        call = "run\n<arg_key>code</arg_key>\n<arg_value>if a < b:\n  1</arg_value>\n<arg_key>unit</arg_key>\n" \
               "<arg_value>f</arg_value>\n</tool_call>"
    elif parser == "minimax_m2":
        call = '<invoke name="run">\n<parameter name="code">if a < b:\n  1</parameter>\n<parameter name="unit">f' \
               '</parameter>\n</invoke>\n</minimax:tool_call>'
    else:  # DSML: string="true" marks a value written as text
        call = '<｜DSML｜invoke name="run">\n<｜DSML｜parameter name="code" string="true">if a < b:\n  1' \
               '</｜DSML｜parameter>\n<｜DSML｜parameter name="unit" string="true">f</｜DSML｜parameter>\n' \
               '</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
        assert not _accepts(llm, grammar, call.replace('"unit" string="true"', '"unit" string="false"'))
    assert _accepts(llm, grammar, call)
    assert not _accepts(llm, grammar, call.replace("unit", "units"))
    parser_ = OutputParser(parser, False, False, True, {"run": frozenset({"code"})})
    events = parser_.feed(FORCED_CALL_PREFIX[parser] + call) + parser_.flush()
    assert [(e.kind, e.tool_call.name, e.tool_call.input) for e in events] == [
        ("tool_call", "run", {"code": "if a < b:\n  1", "unit": "f"})]
    bounded = {**params, "required": ["unit"], "properties": {"unit": params["properties"]["unit"],
                                                              "n": {"type": "integer", "minimum": 1, "maximum": 9}}}
    grammar = GrammarBuilder(llm.engine.tokenizer).tool_call(parser, [
        {"type": "function", "function": {"name": "run", "parameters": bounded}}], "run")
    for events, text in sampled_calls(llm, grammar, FORCED_CALL_PREFIX[parser], parser,
                                      240 if parser == "deepseek_v4" else 80):
        assert [e.kind for e in events] == ["tool_call"], text
        jsonschema.validate(events[0].tool_call.input, bounded)


@pytest.mark.parametrize("call_format", ["deepseek_v3", "deepseek_v31", "harmony", "kimi_k2"])
def test_forced_calls_with_json_arguments(llm, call_format) -> None:
    """DeepSeek's two layouts, harmony and Kimi-K2's: the grammar accepts the format's call and refuses another
    tool's name; sampled calls parse (by the family's parser) to the tool, arguments per schema."""
    from hearth.serving.constraints import FORCED_CALL_PREFIX

    params = {"type": "object", "required": ["unit"], "additionalProperties": False,
              "properties": {"unit": {"enum": ["c", "f"]}, "n": {"type": "integer", "minimum": 1, "maximum": 9}}}
    tools = [{"type": "function", "function": {"name": "run", "parameters": params}}]
    grammar = GrammarBuilder(llm.engine.tokenizer).tool_call(call_format, tools, "run")
    call = {"deepseek_v3": '<｜tool▁call▁begin｜>function<｜tool▁sep｜>run\n```json\n{"unit": "f"}\n```'
                           "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "deepseek_v31": '<｜tool▁call▁begin｜>run<｜tool▁sep｜>{"unit": "f"}<｜tool▁call▁end｜>'
                            "<｜tool▁calls▁end｜>",
            "harmony": 'run <|constrain|>json<|message|>{"unit": "f"}<|call|>',
            "kimi_k2": '<|tool_call_begin|>functions.run:0<|tool_call_argument_begin|>{"unit": "f"}<|tool_call_end|>'
                       "<|tool_calls_section_end|>"}[call_format]
    assert _accepts(llm, grammar, call)
    assert not _accepts(llm, grammar, call.replace("run", "ran", 1))
    parser = call_format if call_format in ("harmony", "kimi_k2") else "deepseek"
    for events, text in sampled_calls(llm, grammar, FORCED_CALL_PREFIX[call_format], parser, 240):
        assert [e.kind for e in events] == ["tool_call"], text
        assert events[0].tool_call.name == "run"
        jsonschema.validate(events[0].tool_call.input, params)


def test_a_reply_that_ends_before_its_grammar_is_whole_is_not_complete(llm) -> None:
    grammar = json_schema_grammar(SCHEMA)
    matcher = llm.engine.grammars.matcher(grammar)
    assert not matcher.complete
    eos = llm.engine.tokenizer.eos_token_id
    assert matcher.advance(eos) and not matcher.complete  # ended: and said to be cut short
    whole = llm.engine.grammars.matcher(grammar)
    text = '{"name": "a", "n": 1, "kind": "b", "tags": []}'
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    assert [whole.advance(t) for t in ids][-1] and whole.complete


def test_a_grammar_over_its_mask_budget_ends_its_request_alone(llm, monkeypatch) -> None:
    from hearth.engine.text import grammar as grammar_module

    monkeypatch.setattr(grammar_module, "MASK_BUDGET_S", -1.0)  # every mask is over
    engine = llm.engine
    slow = engine.add_request("def f(x):", SamplingParams(max_tokens=8, grammar=json_schema_grammar(SCHEMA)))
    plain = engine.add_request("def f(x):", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    done = {}
    for _ in range(100):
        for out in engine.step():
            if out.chunk.finished:
                done[out.chunk.request_id] = out.chunk
        if len(done) == 2:
            break
    assert done[slow].finish_reason == "error" and "too costly" in done[slow].stop_reason
    assert done[plain].finish_reason == "length" and done[plain].metrics.num_output_tokens == 8


def test_token_bitmask_bits_are_read_as_llguidance_writes_them() -> None:
    import torch

    from hearth.engine.text.grammar import allowed_tokens

    words = torch.tensor([-1, 0, 5, -2**31, 2**31 - 1], dtype=torch.int32)  # sign bits included
    vocab = 150
    expected = [bool((int(words[i // 32]) >> (i % 32)) & 1) for i in range(vocab)]
    assert allowed_tokens(words, vocab).tolist() == expected


def test_masks_never_compile(llm, monkeypatch) -> None:
    """A mask runs in plain eager torch, not llguidance's torch.compile kernel: a compilation on
    another thread flips torch's process-wide compiling flag under the engine's eager step (seen as
    a RecursionError in linear), and the first one takes seconds."""
    import llguidance.torch
    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("llguidance's compiled kernel was called")

    monkeypatch.setattr(llguidance.torch, "apply_token_bitmask_inplace", refuse)
    monkeypatch.setattr(llguidance.torch, "apply_token_bitmask_inplace_kernel", refuse)
    matcher = llm.engine.grammars.matcher(json_schema_grammar(SCHEMA))
    masked = matcher.mask(torch.zeros(llm.engine.model_config.vocab_size))
    assert torch.isfinite(masked).any() and torch.isinf(masked).any()
