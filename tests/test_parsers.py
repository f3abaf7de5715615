"""The output parsers: the same events however the text is split into stream chunks."""

from __future__ import annotations

import random

import pytest

from hearth.serving.parsers import parse_hermes_call
from hearth.serving.reply_parsers import OutputParser, choose_tool_parser

CASES = [
    ("<think>\nplan it\n\nstep 2  \n</think>\n\nSure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n"
     "</tool_call>\n<tool_call>\n{bad}\n</tool_call> tail",
     [("reasoning", "plan it\n\nstep 2"), ("content", "Sure."), ("tool_call", ("f", '{"a": 1}')),
      ("content", "<tool_call>\n{bad}\n</tool_call> tail")]),
    ("plain text <tool_ca", [("content", "plain text <tool_ca")]),
    ("<thin", [("content", "<thin")]),
    ("  <think> abc", [("reasoning", "abc")]),
    ('<tool_call>{"name":"x","arguments":"{\\"q\\": 2}"}</tool_call>', [("tool_call", ("x", '{"q": 2}'))]),
    ('<tool_call>{"name":"x","arguments":{}}', [("content", '<tool_call>{"name":"x","arguments":{}}')]),
    ("a < b and c <think> d", [("content", "a < b and c <think> d")]),
]


def parse(chunks: list[str], reasoning: bool = True, in_reasoning: bool = False, tools: str = "hermes") -> list[tuple]:
    parser = OutputParser(tools, reasoning, in_reasoning, tools_enabled=True)
    events = [e for c in chunks for e in parser.feed(c)] + parser.flush()
    merged: list[tuple] = []
    for e in events:
        if e.kind == "tool_call":
            merged.append(("tool_call", (e.tool_call.name, e.tool_call.arguments)))
        elif merged and merged[-1][0] == e.kind:
            merged[-1] = (e.kind, merged[-1][1] + e.text)
        else:
            merged.append((e.kind, e.text))
    return merged


def assert_any_chunking(text: str, expected: list[tuple], tools: str, seed: int, rounds: int = 200,
                        most: int = 30) -> None:
    """Whole, and cut at ``rounds`` random sets of up to ``most`` places, ``text`` parses to ``expected``."""
    assert parse([text], tools=tools) == expected
    rng = random.Random(seed)
    for _ in range(rounds):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, most))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert parse(chunks, tools=tools) == expected, chunks


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_any_chunking_gives_the_same_events(text, expected):
    assert parse([text]) == expected
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 25))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert parse(chunks) == expected, chunks


def test_prompt_opened_reasoning():
    assert parse(["still thinking</think>answer"], in_reasoning=True) == [
        ("reasoning", "still thinking"), ("content", "answer")]


def test_without_reasoning_markers_stay_text():
    assert parse(["<think>x</think>y"], reasoning=False) == [("content", "<think>x</think>y")]


def test_tools_disabled_leaves_markup():
    parser = OutputParser("hermes", False, False, tools_enabled=False)
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert "".join(e.text for e in parser.feed(text) + parser.flush()) == text


@pytest.mark.parametrize("body", ['{"name": 3}', "[]", '{"arguments": {}}', '{"name": "f", "arguments": [1]}',
                                  '{"name": "f", "arguments": "not json"}'])
def test_invalid_calls_rejected(body):
    assert parse_hermes_call(body) is None


def test_parser_choice():
    assert choose_tool_parser("Qwen3MoeForCausalLM", None) == "hermes"
    assert choose_tool_parser("Unknown", "{{ '<tool_call>' }}") == "hermes"
    assert choose_tool_parser("Unknown", "plain") == "none"
    with pytest.raises(ValueError, match="unknown tool parser"):
        choose_tool_parser("Qwen3MoeForCausalLM", None, "xml")


XML_CASES = [
    ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nMilan\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     [("content", "I'll check."), ("tool_call", ("get_weather", '{"city": "Milan", "days": 3}'))]),
    ("<tool_call>\n<function=run>\n<parameter=cmd>\nls -la\necho hi\n</parameter>\n</function>\n</tool_call>"
     "<tool_call>\n<function=noop>\n</function>\n</tool_call> done",
     [("tool_call", ("run", '{"cmd": "ls -la\\necho hi"}')), ("tool_call", ("noop", "{}")), ("content", "done")]),
    ("<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
     [("content", "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>")]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>',
     [("content", '<tool_call>{"name": "f", "arguments": {}}</tool_call>')]),
]


@pytest.mark.parametrize(("text", "expected"), XML_CASES)
def test_qwen3_coder_xml_calls_under_any_chunking(text, expected):
    def run(chunks):
        return parse(chunks, tools="qwen3_coder")

    assert run([text]) == expected
    rng = random.Random(1)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 20))))
        assert run([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]) == expected


def test_qwen3_coder_parser_choice():
    assert choose_tool_parser("Qwen3_5MoeForCausalLM", None) == "qwen3_coder"
    template = "{{ '<tool_call>\\n<function=' + name + '>' }}"
    assert choose_tool_parser("Unknown", template) == "qwen3_coder"
    assert choose_tool_parser("Qwen3NextForCausalLM", None) == "hermes"


# The assistant turn as GLM-4.5's chat template writes it (reasoning in <think>, then content, then
# each call as <tool_call>NAME and <arg_key>/<arg_value> pairs; non-string values as JSON).
GLM45_ASSISTANT = (
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content.strip() }}</think>{% endif %}\n"
    "{{- m.content.strip() }}"
    "{%- for tc in m.tool_calls %}\n<tool_call>{{ tc.name }}"
    "{%- for k, v in tc.arguments.items() %}\n<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>{% endfor %}\n</tool_call>"
    "{%- endfor %}"
)


def _render_glm(message: dict, newlines: bool = True) -> str:
    import jinja2

    text = jinja2.Environment().from_string(GLM45_ASSISTANT).render(m=message)
    return text if newlines else text.replace(">\n<", "><")  # GLM-4.7 writes the tags back to back


@pytest.mark.parametrize("newlines", [True, False], ids=["glm-4.5", "glm-4.7"])
def test_glm45_calls_from_its_template_under_any_chunking(newlines):
    message = {"reasoning_content": "The user wants weather.\nCheck it.", "content": "Checking now.",
               "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "units": "metric"}},
                              {"name": "run", "arguments": {"cmd": "ls -la\necho <hi>", "env": {"A": "1"}}}]}
    text = _render_glm(message, newlines)
    expected = [("reasoning", "The user wants weather.\nCheck it."), ("content", "Checking now."),
                ("tool_call", ("get_weather", '{"city": "Paris", "days": 3, "units": "metric"}')),
                ("tool_call", ("run", '{"cmd": "ls -la\\necho <hi>", "env": {"A": "1"}}'))]
    assert_any_chunking(text, expected, "glm45", seed=2, rounds=200, most=30)


def test_glm45_rejects_what_is_not_a_call():
    pair = "<arg_key>a</arg_key><arg_value>1</arg_value>"
    for body in ("\n" + pair, "f\nstray" + pair, "two words\nmore"):
        assert parse([f"<tool_call>{body}</tool_call>"], tools="glm45") == [
            ("content", f"<tool_call>{body}</tool_call>")]
    assert choose_tool_parser("Glm4MoeForCausalLM", None) == "glm45"
    assert choose_tool_parser("Unknown", "{{ '<arg_key>' + k + '</arg_key>' }}") == "glm45"


# The assistant turn as MiniMax-M2's chat template writes it: <think> reasoning, the content, and
# the calls grouped in one <minimax:tool_call> block of <invoke> elements.
MINIMAX_ASSISTANT = (
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{{ m.content }}"
    "{%- if m.tool_calls %}\n<minimax:tool_call>\n{%- for tc in m.tool_calls %}\n<invoke name=\"{{ tc.name }}\">"
    "{%- for k, v in tc.arguments.items() %}\n<parameter name=\"{{ k }}\">{{ v if v is string else v | tojson }}"
    "</parameter>{% endfor %}\n</invoke>{% endfor %}\n</minimax:tool_call>{% endif %}"
)


def test_minimax_m2_calls_from_its_template_under_any_chunking():
    import jinja2

    message = {"reasoning_content": "Two lookups.", "content": "On it.",
               "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
                              {"name": "search", "arguments": {"q": "a <b> & c", "filters": {"lang": "en"}}}]}
    text = jinja2.Environment().from_string(MINIMAX_ASSISTANT).render(m=message)
    expected = [("reasoning", "Two lookups."), ("content", "On it."),
                ("tool_call", ("get_weather", '{"city": "Paris", "days": 3}')),
                ("tool_call", ("search", '{"q": "a <b> & c", "filters": {"lang": "en"}}'))]
    assert_any_chunking(text, expected, "minimax_m2", seed=3, rounds=200, most=30)
    bad = '<minimax:tool_call>\n<invoke name="f">stray</invoke>\n</minimax:tool_call>'
    assert parse([bad], tools="minimax_m2") == [("content", bad)]
    assert choose_tool_parser("MiniMaxM2ForCausalLM", None) == "minimax_m2"


# DeepSeek's assistant turns as their chat templates write them: V3 / R1 name the call's type before
# the separator and fence the JSON arguments; V3.1 puts the name before the separator, bare JSON after.
DEEPSEEK_ASSISTANT = {
    "v3": ("{{ m.content }}<｜tool▁calls▁begin｜>{%- for tc in m.tool_calls %}<｜tool▁call▁begin｜>function"
           "<｜tool▁sep｜>{{ tc.name }}\n```json\n{{ tc.arguments | tojson }}\n```<｜tool▁call▁end｜>"
           "{%- if not loop.last %}\n{% endif %}{%- endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"),
    "v3.1": ("<think>{{ m.reasoning_content }}</think>{{ m.content }}<｜tool▁calls▁begin｜>"
             "{%- for tc in m.tool_calls %}<｜tool▁call▁begin｜>{{ tc.name }}<｜tool▁sep｜>{{ tc.arguments | tojson }}"
             "<｜tool▁call▁end｜>{%- endfor %}<｜tool▁calls▁end｜>"),
}


@pytest.mark.parametrize("version", ["v3", "v3.1"])
def test_deepseek_calls_from_its_template_under_any_chunking(version):
    import jinja2

    message = {"reasoning_content": "Weather, then news.", "content": "Looking.",
               "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
                              {"name": "news", "arguments": {"topic": "a ``` b"}}]}
    text = jinja2.Environment().from_string(DEEPSEEK_ASSISTANT[version]).render(m=message)
    text = text.removesuffix("<｜end▁of▁sentence｜>")  # the stop token: never part of the text
    expected = [("reasoning", "Weather, then news.")] if version == "v3.1" else []
    expected += [("content", "Looking."), ("tool_call", ("get_weather", '{"city": "Paris", "days": 3}')),
                 ("tool_call", ("news", '{"topic": "a ``` b"}'))]
    assert_any_chunking(text, expected, "deepseek", seed=4, rounds=200, most=30)
    bad = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>not json<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert parse([bad], tools="deepseek") == [("content", bad)]
    assert choose_tool_parser("DeepseekV3ForCausalLM", None) == "deepseek"


# GPT-OSS's reply as text with its special tokens, as the harmony format writes it after the prompt's
# "<|start|>assistant": reasoning in the analysis channel, a preamble in commentary, calls addressed
# to functions.NAME (the recipient before or after the channel), the final answer; <|call|> and
# <|return|> are stop tokens, so the reply's text ends before them.
HARMONY_REPLY = (
    "<|channel|>analysis<|message|>Need weather. Use <tool>.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "days": 3}<|call|>'
    "<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{\"q\": \"a <|x\"}<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Done: sunny."
)


def test_harmony_channels_and_calls_under_any_chunking():
    text = HARMONY_REPLY
    expected = [("reasoning", "Need weather. Use <tool>."), ("content", "Checking both."),
                ("tool_call", ("get_weather", '{"city": "Paris", "days": 3}')),
                ("tool_call", ("search", '{"q": "a <|x"}')), ("content", "Done: sunny.")]
    assert_any_chunking(text, expected, "harmony", seed=5, rounds=300, most=40)
    # A call ended by the stop token (the reply's end), a call whose body is not JSON, plain text.
    tail = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}'
    assert parse([tail], tools="harmony") == [("tool_call", ("f", '{"a": 1}'))]
    broken = "<|channel|>commentary to=functions.f<|message|>not json<|call|>"
    assert parse([broken], tools="harmony") == [("content", "not json")]
    assert parse(["just text"], tools="harmony") == [("content", "just text")]
    assert choose_tool_parser("GptOssForCausalLM", None) == "harmony"
    assert choose_tool_parser("Unknown", "{{ '<|channel|>analysis' }}") == "harmony"


# DeepSeek-V4's assistant turn as its encoding writes it: reasoning in <think>, then the calls in one
# DSML block, each parameter marked string="true" (written as is) or "false" (JSON). V3.2 wraps the
# same invokes in function_calls.
DSML_ASSISTANT = (
    "<think>{{ m.reasoning_content }}</think>{{ m.content }}\n\n<｜DSML｜{{ block }}>\n"
    "{%- for tc in m.tool_calls %}\n<｜DSML｜invoke name=\"{{ tc.name }}\">"
    "{%- for k, v in tc.arguments.items() %}\n<｜DSML｜parameter name=\"{{ k }}\" "
    "string=\"{{ 'true' if v is string else 'false' }}\">{{ v if v is string else v | tojson }}</｜DSML｜parameter>"
    "{%- endfor %}\n</｜DSML｜invoke>{%- endfor %}\n</｜DSML｜{{ block }}>"
)


@pytest.mark.parametrize("version, block", [("deepseek_v4", "tool_calls"), ("deepseek_v32", "function_calls")])
def test_dsml_calls_from_the_deepseek_encoding_under_any_chunking(version, block):
    import jinja2

    message = {"reasoning_content": "Weather, then the files.", "content": "Looking.",
               "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
                              {"name": "grep", "arguments": {"pattern": "[0-9]+ <｜x", "paths": ["a", "b"],
                                                             "count": "12"}}]}
    text = jinja2.Environment().from_string(DSML_ASSISTANT).render(m=message, block=block)
    expected = [("reasoning", "Weather, then the files."), ("content", "Looking."),
                ("tool_call", ("get_weather", '{"city": "Paris", "days": 3}')),
                ("tool_call", ("grep", '{"pattern": "[0-9]+ <｜x", "paths": ["a", "b"], "count": "12"}'))]
    assert_any_chunking(text, expected, version, seed=5, rounds=200, most=30)
    bad = f'<｜DSML｜{block}>\n<｜DSML｜invoke name="f">stray</｜DSML｜invoke>\n</｜DSML｜{block}>'
    assert parse([bad], tools=version) == [("content", bad)]
    assert choose_tool_parser("Unknown", "{{ '<｜DSML｜" + block + ">' }}") == version
    if version == "deepseek_v4":
        assert choose_tool_parser("DeepseekV4ForCausalLM", None) == "deepseek_v4"


# Kimi-K2's assistant turn as its chat template writes it: reasoning in <think> (K2 Thinking, K2.5),
# the content, then the calls in one section, each under the id the model gave it (functions.NAME:N).
KIMI_ASSISTANT = (
    "<think>{{ m.reasoning_content }}</think>{{ m.content }}<|tool_calls_section_begin|>"
    "{%- for tc in m.tool_calls %}<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>"
    "{{ tc.arguments | tojson }}<|tool_call_end|>{%- endfor %}<|tool_calls_section_end|>"
)


def test_kimi_k2_calls_from_its_template_under_any_chunking():
    import jinja2

    message = {"reasoning_content": "Weather, then news.", "content": "Looking.",
               "tool_calls": [{"id": "functions.get_weather:0", "arguments": {"city": "Paris", "days": 3}},
                              {"id": "functions.news:1", "arguments": {"topic": "a <|x b"}}]}
    text = jinja2.Environment().from_string(KIMI_ASSISTANT).render(m=message)
    expected = [("reasoning", "Weather, then news."), ("content", "Looking."),
                ("tool_call", ("get_weather", '{"city": "Paris", "days": 3}')),
                ("tool_call", ("news", '{"topic": "a <|x b"}'))]
    assert_any_chunking(text, expected, "kimi_k2", seed=6, rounds=200, most=30)
    parser = OutputParser("kimi_k2", False, False, tools_enabled=True)
    calls = [e.tool_call for e in parser.feed(text.split("</think>")[1]) + parser.flush() if e.kind == "tool_call"]
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.news:1"]  # as the template renders back
    bad = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>not json"
           "<|tool_call_end|><|tool_calls_section_end|>")
    assert parse([bad], tools="kimi_k2") == [("content", bad)]
    assert choose_tool_parser("DeepseekV3ForCausalLM", "{{ '<|tool_calls_section_begin|>' }}") == "kimi_k2"
    assert choose_tool_parser("KimiLinearForCausalLM", None) == "kimi_k2"


def test_every_tool_parser_is_a_serve_choice():
    import typing

    from hearth.config import ServingConfig
    from hearth.serving.reply_parsers import TOOL_PARSERS

    hint = typing.get_type_hints(ServingConfig)["tool_parser"]
    choices = {a for arg in typing.get_args(hint) for a in typing.get_args(arg)}
    assert choices == set(TOOL_PARSERS)
