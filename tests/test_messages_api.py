"""`POST /v1/messages` (Anthropic's Messages API) and its count_tokens, driven by the real `anthropic` SDK.

The tiny random llama answers the plain requests (its replies equal chat completions' for the same transcript);
canned model output (test_serve.Scripted) stands in for what a random model does not write: thinking and calls.
"""

from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_serve import (CALLING, CITIES, KEY, MODEL, THINKING, play, Server, _qwen3_template_client,   # noqa: E402
                        raw, server)   # noqa: F401 (server: the fixture, one for this module)

HI = [{"role": "user", "content": "hi there"}]
TOOL = {"name": "get_weather", "description": "The weather.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def claude(server, key: str = KEY):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def test_a_message_is_the_chat_reply_whole_and_streamed(server):
    sdk, chat_sdk = claude(server), server.sdk()
    chat = chat_sdk.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *HI],
                                            max_tokens=8, extra_body={"temperature": 0})
    whole = sdk.messages.create(model=MODEL, system="Be brief.", messages=HI, max_tokens=8,
                                extra_body={"temperature": 0})
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == chat.choices[0].message.content
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    # Anthropic's input_tokens leaves out what the cache served
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert whole.usage.cache_read_input_tokens > 0 and whole.usage.output_tokens == 8

    with sdk.messages.stream(model=MODEL, system=[{"type": "text", "text": "Be brief."}], messages=HI, max_tokens=8,
                             extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8 and final.usage.input_tokens == whole.usage.input_tokens

    ended = sdk.messages.create(model=MODEL, messages=HI, max_tokens=8, extra_body=server.ends)
    assert ended.stop_reason == "end_turn" and ended.content[0].text == "" and ended.usage.output_tokens == 1


def test_stop_sequences_say_which_ended_the_reply(server):
    sdk = claude(server)
    text = sdk.messages.create(model=MODEL, messages=HI, max_tokens=12, extra_body={"temperature": 0}).content[0].text
    at = next(k for k in range(3, len(text) - 2) if text.find(text[k:k + 2]) == k)
    stop = text[at:at + 2]
    for stream in (False, True):
        kw = dict(model=MODEL, messages=HI, max_tokens=12, extra_body={"temperature": 0},
                  stop_sequences=["\x00never", stop])
        if stream:
            with sdk.messages.stream(**kw) as events:
                got = events.get_final_message()
        else:
            got = sdk.messages.create(**kw)
        assert got.content[0].text == text[:at] and (got.stop_reason, got.stop_sequence) == ("stop_sequence", stop)


def test_count_tokens_is_the_prompt_the_request_would_take(server):
    sdk = claude(server)
    messages = [*HI, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And then?"}]
    counted = sdk.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    made = sdk.messages.create(model=MODEL, system="Be brief.", messages=messages, max_tokens=1)
    assert counted.input_tokens == made.usage.input_tokens + made.usage.cache_read_input_tokens > 10


def test_an_output_format_holds_the_reply_to_its_schema(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    got = claude(server).messages.create(model=MODEL, messages=HI, max_tokens=40, extra_body={"temperature": 0},
                                         output_config={"format": {"type": "json_schema", "schema": schema}})
    assert got.stop_reason == "end_turn" and json.loads(got.content[0].text) in ({"ok": True}, {"ok": False})


@pytest.mark.parametrize("body, status, kind, words", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     'content blocks of type "image" are not supported'),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     "only client tools"),
    ({"messages": [*HI, {"role": "assistant", "content": "The answer is"}]}, 400, "invalid_request_error",
     "(prefill) is not supported"),
    ({"tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice must be"),
    ({"output_config": {"format": {"type": "json_schema"}}}, 400, "invalid_request_error",
     "output_config.format must be"),
    ({"model": "claude-opus"}, 404, "not_found_error", 'the model "claude-opus" does not exist'),
])
def test_bad_requests_get_anthropics_error_object(server, body, status, kind, words):
    request = {"model": MODEL, "messages": HI, "max_tokens": 4, **body}
    got, answer = raw(server, "POST", "/v1/messages", json.dumps({k: v for k, v in request.items() if v is not None}))
    assert got == status and answer["type"] == "error" and answer["error"]["type"] == kind
    assert words in answer["error"]["message"], answer


def test_the_key_comes_as_x_api_key(server):
    with pytest.raises(anthropic.AuthenticationError):
        claude(server, key="wrong").messages.create(model=MODEL, messages=HI, max_tokens=1)
    got, answer = raw(server, "POST", "/v1/messages", json.dumps({"model": MODEL, "messages": HI, "max_tokens": 1}),
                      key=None, headers={"x-api-key": KEY})
    assert got == 200 and answer["type"] == "message"


def test_calls_are_tool_use_blocks_and_results_go_back_as_tool_messages(server, monkeypatch):
    sdk = claude(server)
    given = play(server, monkeypatch, CALLING, tools=True)
    ask = [{"role": "user", "content": "the weather in Paris?"}]
    whole = sdk.messages.create(model=MODEL, messages=ask, tools=[TOOL], max_tokens=64)
    assert given[-1][2]["tools"][0]["function"] == {"name": "get_weather", "parameters": TOOL["input_schema"],
                                                     "description": "The weather."}
    text, use = whole.content
    assert text.text == "Let me check." and whole.stop_reason == "tool_use"
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    with sdk.messages.stream(model=MODEL, messages=ask, tools=[TOOL], max_tokens=64) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"

    # the result goes back in a user message: the tool message of the assistant's call, then the user's text
    sdk.messages.create(model=MODEL, tools=[TOOL], max_tokens=64, messages=[
        *ask, {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                                     {"type": "text", "text": "thanks"}]}])
    history, turn, _ = given[-1]
    assert turn == [{"role": "tool", "content": "sunny", "tool_call_id": use.id},
                    {"role": "user", "content": "thanks"}]
    call = history[-1]["tool_calls"][0]
    assert call["id"] == use.id and call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == {"city": "Paris"}


def test_thinking_is_a_thinking_block_and_the_switch_reaches_the_template(server, monkeypatch):
    sdk = claude(server)
    given = play(server, monkeypatch, THINKING)
    whole = sdk.messages.create(model=MODEL, messages=HI, max_tokens=64)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == "weighing it" and whole.content[1].text == "Paris."
    with sdk.messages.stream(model=MODEL, messages=HI, max_tokens=64,
                             thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "weighing it"
    assert "thinking_delta" in kinds and "text_delta" in kinds and given[-1][2] == {"enable_thinking": True}
    sdk.messages.create(model=MODEL, messages=HI, max_tokens=64, thinking={"type": "disabled"})
    assert given[-1][2] == {"enable_thinking": False}


def test_a_forced_tool_under_the_qwen3_template(tiny_models, tmp_path):
    """tool_choice {"type": "tool"} holds the random model to a valid call of that tool."""
    client, _ = _qwen3_template_client(tiny_models, tmp_path)
    srv = Server(client)
    try:
        sdk = claude(srv)
        tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in CITIES]
        for stream in (False, True):
            kw = dict(model=MODEL, messages=[{"role": "user", "content": "the time in Paris?"}], tools=tools,
                      max_tokens=200, extra_body={"temperature": 0},
                      tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True})
            if stream:
                with sdk.messages.stream(**kw) as events:
                    got = events.get_final_message()
            else:
                got = sdk.messages.create(**kw)
            uses = [b for b in got.content if b.type == "tool_use"]
            assert [u.name for u in uses] == ["get_time"] and uses[0].input["zone"] in ("UTC", "CET")
            assert got.stop_reason == "tool_use"
    finally:
        srv.stop()
        client.shutdown()


def test_system_messages_among_the_messages_join_their_users_turn(server, monkeypatch):
    """Claude Code sends a system message after the user's: it joins that user message (or the next one)."""
    given = play(server, monkeypatch, ["ok"])
    sdk = claude(server)
    sdk.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"},
                                                             {"role": "system", "content": "Agents: none."}])
    assert given[-1][1] == [{"role": "user", "content": "hi\n\nAgents: none."}]
    sdk.messages.create(model=MODEL, max_tokens=8, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "more"}]}])
    assert given[-1][1] == [{"role": "user", "content": "Be brief.\n\nmore"}]
