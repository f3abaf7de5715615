"""GPT-OSS served through the real openai SDK: its harmony markers are special tokens that the
reply's text keeps, so that the harmony parser reads channels and calls from them; a forced call
(``tool_choice: required``) comes back as an OpenAI tool call whose arguments match the schema."""

from __future__ import annotations

import pytest

from tests.checkpoints import make_checkpoint
from tests.serving_helpers import assert_forced_calls, running_server

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "required": ["unit"], "additionalProperties": False,
    "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai

    path, _ = make_checkpoint(tmp_path_factory.mktemp("gpt-oss-harmony"), "gpt_oss", chat_format="harmony")
    with running_server(path, {"max_model_len": 1024}, scripted=False) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_a_forced_call_comes_back_as_a_tool_call(client) -> None:
    assert_forced_calls(client, TOOL, '<|', 200)


def test_a_free_reply_never_leaks_markers_as_calls(client) -> None:
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[TOOL],
                                            max_tokens=24, stream=True, temperature=0)
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
