"""DeepSeek-V4 served through the real openai SDK. Its checkpoints ship their conversation format
as code, not as a chat template: hearth renders it with its own template (tools in the system turn,
tool results as <tool_result> blocks of the user turn, <think> opened or closed by the mode), and
reads DSML tool calls from the reply."""

from __future__ import annotations

import json

import pytest

from tests.checkpoints import make_checkpoint
from tests.serving_helpers import assert_forced_calls, running_server

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "required": ["city", "unit"], "additionalProperties": False,
    "properties": {"city": {"enum": ["Oslo", "Rome"]}, "unit": {"enum": ["c", "f"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("deepseek-v4"), "deepseek_v4", chat_format="deepseek_v4")
    return path


@pytest.fixture(scope="module")
def client(checkpoint_dir):
    import openai

    with running_server(checkpoint_dir, {"max_model_len": 2048}, scripted=False) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_builtin_template_writes_deepseek_v4s_format(checkpoint_dir) -> None:
    from hearth.engine.text.tokenizer import load_tokenizer

    tok = load_tokenizer(checkpoint_dir)
    assert "｜DSML｜tool_calls" in tok.chat_template
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
            {"role": "user", "content": "and?"}]
    render = lambda msgs, **kw: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)  # noqa: E731
    assert render(chat) == f"{BOS}Be brief.{USER}hi{ASSISTANT}</think>Hello.{EOS}{USER}and?{ASSISTANT}</think>"
    # Thinking mode: earlier reasoning dropped, the reply opened with <think>.
    assert render(chat, thinking=True) == f"{BOS}Be brief.{USER}hi{ASSISTANT}</think>Hello.{EOS}{USER}and?" \
                                          f"{ASSISTANT}<think>"
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}
    agent = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}, {"role": "tool", "tool_call_id": "c2",
                                                                          "content": "snow"}]
    text = render(agent, tools=[TOOL], thinking=True)
    schema = json.dumps(TOOL["function"], ensure_ascii=False)
    assert text.startswith(f"{BOS}\n\n## Tools\n\nYou have access to a set of tools")
    assert f"### Available Tool Schemas\n\n{schema}\n\nYou MUST strictly follow" in text
    # With tools every turn keeps its reasoning; the calls are one DSML block; the results one user turn.
    assert text.endswith(
        f"invoke tool calls.\n{USER}weather?{ASSISTANT}<think>look it up</think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        f"</｜DSML｜tool_calls>{EOS}{USER}<tool_result>-3 C</tool_result>\n\n<tool_result>snow</tool_result>"
        f"{ASSISTANT}<think>")


def test_a_forced_call_comes_back_as_a_tool_call(client) -> None:
    assert_forced_calls(client, TOOL, 'DSML', 400)


def test_a_plain_chat_streams_a_reply(client) -> None:
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=16, stream=True, temperature=0)
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
