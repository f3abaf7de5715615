"""DeepSeek-V3.2 ships its conversation format as Python code (``encoding_dsv32.py``), not as a chat
template: hearth renders it with its own template. These are that encoding's outputs, written out."""

from __future__ import annotations

import json

import pytest

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
DSML = "｜DSML｜"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools you can use to answer the user's question.\n"
    f'You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply '
    f"to the user:\n<{DSML}function_calls>\n<{DSML}invoke name=\"$FUNCTION_NAME\">\n"
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>\n...\n'
    f"</{DSML}invoke>\n<{DSML}invoke name=\"$FUNCTION_NAME2\">\n...\n</{DSML}invoke>\n</{DSML}function_calls>\n\n"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from hearth.engine.text.tokenizer import load_tokenizer
    from tests.checkpoints import make_checkpoint

    path, _ = make_checkpoint(tmp_path_factory.mktemp("deepseek-v32"), "deepseek_v32", chat_format="deepseek_v4")
    return load_tokenizer(path)


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_chat_and_thinking_modes(tokenizer) -> None:
    assert f"<{DSML}function_calls>" in tokenizer.chat_template
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
            {"role": "user", "content": "and?"}]
    assert render(tokenizer, chat) == \
        f"{BOS}Be brief.{USER}hi{ASSISTANT}</think>Hello.{EOS}{USER}and?{ASSISTANT}</think>"
    # Thinking mode: reasoning before the last user turn dropped, the reply opened with <think>.
    assert render(tokenizer, chat, thinking=True) == \
        f"{BOS}Be brief.{USER}hi{ASSISTANT}</think>Hello.{EOS}{USER}and?{ASSISTANT}<think>"


def test_tools_calls_and_results(tokenizer) -> None:
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "need it",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Oslo", "days": 3}}}]},
            {"role": "tool", "content": "cold"}]
    schema = json.dumps(WEATHER["function"], ensure_ascii=False)
    text = render(tokenizer, chat, tools=[WEATHER], thinking=True)
    assert text.startswith(f"{BOS}S\n\n{TOOLS_HEAD}")
    assert f"<functions>\n{schema}\n</functions>\n{USER}weather?{ASSISTANT}<think>need it</think>" in text
    call = (f"\n\n<{DSML}function_calls>\n<{DSML}invoke name=\"get_weather\">\n"
            f'<{DSML}parameter name="city" string="true">Oslo</{DSML}parameter>\n'
            f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n'
            f"</{DSML}invoke>\n</{DSML}function_calls>")
    assert text.endswith(f"{call}{EOS}\n\n<function_results>\n<result>cold</result>\n</function_results>\n\n<think>")
    # Chat mode: the results closed with </think>; without a system message the tools come first.
    assert render(tokenizer, chat[1:], tools=[WEATHER]).endswith("</function_results>\n\n</think>")
    assert render(tokenizer, chat[1:], tools=[WEATHER]).startswith(f"{BOS}\n\n{TOOLS_HEAD}")
