"""What coding agents send and expect: system messages anywhere, media in resent histories,
context-overflow wording clients act on, clamped max_tokens, cached-token usage, rejection logs."""

from __future__ import annotations

import json
import logging
import threading

import anthropic
import openai
import pytest
import requests

from hearth.serving.frontend import OMITTED, place_system_messages
from tests.serving_helpers import SCRIPTS, wait_until

CONTEXT = 2048  # the shared server's max_model_len


def _long_text(tokens: int) -> str:
    return " ".join(f"w{i % 50}" for i in range(tokens))


# -- system messages ------------------------------------------------------------------------------
def test_system_messages_are_folded_into_the_turn_they_introduce_never_dropped() -> None:
    msgs = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
            {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "system", "content": "S1"}, {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "a2"}, {"role": "system", "content": "S2"}]
    out = place_system_messages(msgs, mid_system=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert out[0]["content"] == "A\n\nB"
    assert out[3]["content"] == "<system_note>\nS1\n</system_note>\n\nu2"
    assert out[5]["content"] == "<system_note>\nS2\n</system_note>"
    # A note before an assistant turn with no user turn between: kept in the tool result it follows.
    tool = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": []},
            {"role": "tool", "content": "r", "tool_call_id": "1"}, {"role": "system", "content": "S"},
            {"role": "assistant", "content": "a"}]
    assert place_system_messages(tool, False)[2]["content"] == "r\n\n<system_note>\nS\n</system_note>"
    # A template that renders them keeps them in place.
    assert place_system_messages(msgs, mid_system=True)[3] == {"role": "system", "content": "S1"}


def test_anthropic_system_role_inside_messages_reaches_the_prompt(aclient) -> None:
    """Claude Code sends system-role messages inside ``messages``; the test template drops such
    messages, so the server folds it into the next user turn (the script key proves it arrived)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "system", "content": "SCRIPT:STOPWORD"}, {"role": "user", "content": "go on"}]
    m = aclient.messages.create(model="tiny", max_tokens=40, system="Be brief.", messages=messages)
    assert m.content[0].text == SCRIPTS["STOPWORD"]
    count = aclient.messages.count_tokens(model="tiny", system="Be brief.", messages=messages)
    assert count.input_tokens > 0


def test_openai_non_leading_system_message_is_not_dropped(oclient) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "developer", "content": "SCRIPT:STOPWORD"}, {"role": "user", "content": "go on"}]
    r = oclient.chat.completions.create(model="tiny", messages=messages, max_tokens=40)
    assert r.choices[0].message.content == SCRIPTS["STOPWORD"]


# -- media in resent histories ----------------------------------------------------------------------
def test_images_become_placeholders_in_both_apis(server, aclient, oclient) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    messages = [{"role": "user", "content": "look"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "here:"}, image]},
                                             image, {"type": "text", "text": "and?"}]}]
    m = aclient.messages.create(model="tiny", max_tokens=4, messages=messages)
    assert m.type == "message"
    with_image = aclient.messages.count_tokens(model="tiny", messages=messages).input_tokens
    plain = [*messages[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "here:" + OMITTED["image"]},
        {"type": "text", "text": OMITTED["image"] + "and?"}]}]
    assert with_image == aclient.messages.count_tokens(model="tiny", messages=plain).input_tokens
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,x"}}
    r = oclient.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, picture]}])
    assert r.choices[0].finish_reason in ("stop", "length")


# -- context limits ---------------------------------------------------------------------------------
def test_context_overflow_uses_each_ecosystems_wording(server, aclient, oclient) -> None:
    long = _long_text(CONTEXT + 200)
    with pytest.raises(openai.BadRequestError) as err:
        oclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}], max_tokens=4)
    assert err.value.code == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in err.value.message
    with pytest.raises(anthropic.BadRequestError) as aerr:
        aclient.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": long}])
    message = aerr.value.body["error"]["message"]
    n = aclient.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": long}]).input_tokens
    assert n > CONTEXT  # count_tokens counts a prompt too long to run
    assert message == f"prompt is too long: {n} tokens > {CONTEXT - 1} maximum"


def test_max_tokens_beyond_the_context_is_clamped_and_reported(server, aclient) -> None:
    messages = [{"role": "user", "content": "SCRIPT:STOPWORD"}]  # a short scripted reply, then EOS
    raw = aclient.messages.with_raw_response.create(model="tiny", max_tokens=20000, messages=messages)
    assert raw.headers["x-hearth-max-tokens-requested"] == "20000"
    used = int(raw.headers["x-hearth-max-tokens"])
    prompt = aclient.messages.count_tokens(model="tiny", messages=messages).input_tokens
    assert used == CONTEXT - prompt
    r = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "SCRIPT:STOPWORD"}], "max_tokens": 10**9})
    assert r.status_code == 200 and r.headers["x-hearth-max-tokens-requested"] == str(10**9)


def test_models_list_reports_the_context_in_both_shapes(server) -> None:
    data = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert data[0]["max_model_len"] == CONTEXT and data[0]["context_length"] == CONTEXT
    page = requests.get(server.url + "/v1/models", headers={"anthropic-version": "2023-06-01"}, timeout=10).json()
    assert page["data"][0]["type"] == "model" and page["data"][0]["max_input_tokens"] == CONTEXT
    assert page["has_more"] is False


def test_context_length_is_known_while_the_weights_load(agent_checkpoint) -> None:
    from hearth.config import EngineConfig
    from hearth.engine.llm_engine import LLMEngine
    from hearth.serving.client import InProcessEngineClient
    from hearth.serving.server import describe_model

    config, release = EngineConfig(max_model_len=777), threading.Event()
    client = InProcessEngineClient(agent_checkpoint, lambda: (release.wait(30), LLMEngine(agent_checkpoint, config))[1],
                                   "tiny", describe=lambda: describe_model(agent_checkpoint, config))
    try:
        assert wait_until(lambda: client.model.max_model_len == 777, 20)
        assert not client.ready  # the weights are still "loading"
        release.set()
        client.wait_ready(60)
        assert client.model.max_model_len == 777
    finally:
        release.set()
        client.close()


# -- usage with the prefix cache (on by default) --------------------------------------------------------
def test_anthropic_usage_counts_cached_tokens_apart(server, aclient) -> None:
    system = _long_text(300)
    messages = [{"role": "user", "content": "first question"}]
    aclient.messages.create(model="tiny", max_tokens=2, system=system, messages=messages)
    total = aclient.messages.count_tokens(model="tiny", system=system, messages=messages).input_tokens
    again = aclient.messages.create(model="tiny", max_tokens=2, system=system, messages=messages)
    cached = again.usage.cache_read_input_tokens
    assert cached >= total - 32  # all but the last partial block (and one token) came from the cache
    assert again.usage.input_tokens == total - cached
    with aclient.messages.stream(model="tiny", max_tokens=2, system=system, messages=messages) as stream:
        start = None
        for event in stream:
            if event.type == "message_start":
                start = event.message.usage
        final = stream.get_final_message().usage
    assert start.cache_read_input_tokens == cached and start.input_tokens == total - cached
    assert final.cache_read_input_tokens == cached


def test_openai_usage_reports_cached_prompt_tokens(oclient) -> None:
    messages = [{"role": "system", "content": _long_text(300)}, {"role": "user", "content": "q"}]
    first = oclient.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    second = oclient.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32


# -- rejections are logged with their reason ----------------------------------------------------------
def test_rejections_are_logged_with_message_and_field(server, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hearth.serving"):
        r = requests.post(server.url + "/v1/chat/completions", timeout=10,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 9})
    assert r.status_code == 400
    lines = [rec for rec in caplog.records if rec.getMessage().startswith("rejected")]
    assert lines, [rec.getMessage() for rec in caplog.records]
    fields = lines[-1].fields
    assert fields["status"] == 400 and fields["param"] == "temperature" and "temperature" in fields["message"]
    assert json.dumps(fields)  # the structured log line serialises
