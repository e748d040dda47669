"""`POST /v1/responses` (OpenAI's Responses API) and reasoning in chat completions, driven by the real `openai` SDK.

The tiny random llama answers the plain requests (its replies equal chat completions' for the same transcript);
canned model output (test_serve.Scripted) stands in for what a random model does not write: thinking and calls.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_serve import (CALLING, CITIES, MODEL, THINKING, play, Server, _qwen3_template_client,   # noqa: E402
                        raw, server)   # noqa: F401 (server: the fixture, one for this module)

HI = [{"role": "user", "content": "hi there"}]
TOOL = {"type": "function", "name": "get_weather", "description": "The weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_response_is_the_chat_reply_whole_and_streamed(server):
    sdk = server.sdk()
    chat = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    whole = sdk.responses.create(model=MODEL, input="hi there", max_output_tokens=8, temperature=0)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == MODEL
    assert whole.output_text == chat.choices[0].message.content and [o.type for o in whole.output] == ["message"]
    # 8 tokens, cut at max_output_tokens: incomplete, as OpenAI says it
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete"   # the message it was cut in
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    assert whole.usage.total_tokens == whole.usage.input_tokens + 8
    assert whole.usage.output_tokens_details.reasoning_tokens == 0

    events = list(sdk.responses.create(model=MODEL, input="hi there", max_output_tokens=8, temperature=0,
                                            stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text and events[-1].response.usage.output_tokens == 8
    assert events[-2].item.status == "incomplete" and events[-1].response.output[0].status == "incomplete"
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1

    # the SDK's own accumulator takes the events in order to the final response
    with sdk.responses.stream(model=MODEL, input="hi there", temperature=0, extra_body=server.ends) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(texts) == ""
    assert final.usage.output_tokens == 1 and final.output[0].status == "completed"


def test_instructions_and_input_items_are_the_chat_messages(server):
    sdk = server.sdk()
    messages = [{"role": "system", "content": "Be brief."}, *HI, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "And then?"}]
    chat = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},   # dropped, as templates drop old thinking
             {"role": "user", "content": "And then?"}]
    whole = sdk.responses.create(model=MODEL, instructions="Be brief.", input=items, max_output_tokens=6,
                                 temperature=0)
    assert whole.output_text == chat.choices[0].message.content and whole.instructions == "Be brief."
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    # a developer message at the head joins the instructions as one system message
    system = {"role": "system", "content": "Be brief.\n\nUse French."}
    joined = sdk.chat.completions.create(model=MODEL, messages=[system, *HI], max_tokens=6, temperature=0)
    whole = sdk.responses.create(model=MODEL, instructions="Be brief.", input=[
        {"role": "developer", "content": "Use French."}, *HI], max_output_tokens=6, temperature=0)
    assert whole.output_text == joined.choices[0].message.content


def test_previous_response_id_continues_the_conversation_and_its_kv(server):
    sdk = server.sdk()
    first = sdk.responses.create(model=MODEL, input="hi there", max_output_tokens=8, temperature=0)
    second = sdk.responses.create(model=MODEL, input="tell me more", previous_response_id=first.id,
                                  max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    # the same transcript through chat completions: the same reply
    chat = sdk.chat.completions.create(model=MODEL, messages=[*HI, {"role": "assistant", "content": first.output_text},
                                                              {"role": "user", "content": "tell me more"}],
                                       max_tokens=8, temperature=0)
    assert second.output_text == chat.choices[0].message.content
    # the first turn's KV stayed with the conversation: only the new message is prefilled
    before = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= before - 1
    assert sdk.responses.retrieve(second.id).output_text == second.output_text
    sdk.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError, match="no response"):
        sdk.responses.retrieve(second.id)
    unstored = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model=MODEL, input="more", previous_response_id=unstored.id, max_output_tokens=2)


def test_a_json_schema_text_format_holds_the_reply(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    sdk = server.sdk()
    whole = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=40, temperature=0,
                                 text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert whole.status == "completed" and json.loads(whole.output_text) in ({"ok": True}, {"ok": False})
    assert whole.text.format.type == "json_schema"


@pytest.mark.parametrize("body, status, words", [
    ({"input": ""}, 400, "input must not be empty"),
    ({"input": []}, 400, "input must be a string or a non-empty list"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "only text parts"),
    ({"input": [{"type": "web_search_call", "id": "ws"}]}, 400, 'input items of type "web_search_call"'),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, 400, 'only function tools are supported, got "custom"'),
    ({"background": True}, 400, "background responses are not supported"),
    ({"truncation": "auto"}, 400, 'truncation "auto" is not supported'),
    ({"include": ["message.output_text.logprobs"]}, 400, "logprobs are not supported"),
    ({"previous_response_id": "resp_nope"}, 404, 'no response "resp_nope" is stored here'),
    ({"messages": HI}, 400, "/v1/responses takes input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format json_schema needs its schema"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, 400,
     "the last message must be the user's or a tool result"),
])
def test_bad_requests(server, body, status, words):
    got, answer = raw(server, "POST", "/v1/responses", json.dumps({"model": MODEL, "input": "hi", **body}))
    assert got == status and words in answer["error"]["message"], answer


def test_calls_are_function_call_items_and_their_outputs_go_back_as_tool_messages(server, monkeypatch):
    """Canned output with a call: a message and a function_call item, whole and streamed (the SDK's accumulator
    checks the events' order); the call's output sent back reaches the engine as the tool's message."""
    sdk = server.sdk()
    given = play(server, monkeypatch, CALLING, tools=True)
    whole = sdk.responses.create(model=MODEL, input="the weather in Paris?", tools=[TOOL])
    assert given[-1][2]["tools"] == [{"type": "function", "function": {k: TOOL[k] for k in
                                                                       ("name", "description", "parameters")}}]
    message, call = whole.output
    assert message.type == "message" and whole.output_text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed" and whole.status == "completed"

    with sdk.responses.stream(model=MODEL, input="the weather in Paris?", tools=[TOOL]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output[1].name == "get_weather" and json.loads(final.output[1].arguments) == {"city": "Paris"}
    assert kinds.count("response.output_item.added") == 2 and "response.function_call_arguments.done" in kinds

    # the call's result, sent back as items after the earlier ones: the tool message of the assistant's call
    sdk.responses.create(model=MODEL, tools=[TOOL], input=[
        {"role": "user", "content": "the weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in whole.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    history, turn, _ = given[-1]
    assert turn == [{"role": "tool", "content": "sunny", "tool_call_id": call.call_id}]
    assert history[-1]["role"] == "assistant" and history[-1]["tool_calls"][0]["function"]["name"] == "get_weather"
    # or continued from the stored response: the same transcript
    sdk.responses.create(model=MODEL, tools=[TOOL], previous_response_id=whole.id,
                         input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert given[-1][1] == turn and given[-1][0][-1]["tool_calls"][0]["id"] == call.call_id


def test_thinking_is_reasoning_in_responses_and_in_chat_completions(server, monkeypatch):
    """A <think> block is the reasoning item (Responses) and reasoning_content (chat), whole and streamed; the
    answer is the message; the next turn finds the conversation's KV though the client sends the answer alone."""
    sdk = server.sdk()
    play(server, monkeypatch, THINKING)
    whole = sdk.responses.create(model=MODEL, input="the capital of France?")
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == ["weighing it"]
    assert whole.output_text == "Paris." and whole.usage.output_tokens_details.reasoning_tokens == 4
    with sdk.responses.stream(model=MODEL, input="the capital of France?") as stream:
        deltas = [(e.type, e.delta) for e in stream if e.type.endswith(".delta")]
        final = stream.get_final_response()
    assert "".join(d for kind, d in deltas if kind == "response.reasoning_text.delta") == "weighing it"
    assert "".join(d for kind, d in deltas if kind == "response.output_text.delta") == "Paris."
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "Paris."

    chat = sdk.chat.completions.create(model=MODEL, messages=HI).choices[0].message
    assert chat.content == "Paris." and chat.model_extra["reasoning_content"] == "weighing it"
    chunks = [c.choices[0].delta for c in sdk.chat.completions.create(model=MODEL, messages=HI, stream=True)
              if c.choices]
    assert "".join(d.content or "" for d in chunks) == "Paris."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in chunks) == "weighing it"


def test_a_reasoning_turn_keeps_its_session_when_the_client_sends_back_the_answer():
    """The session holds the reply as written (<think> and all); the client sends back its answer: the same turn."""
    from nanochat.app.openai_api import Conversations

    held = {"role": "assistant", "content": "<think>\nweighing it\n</think>\n\nParis."}
    sent = {"role": "assistant", "content": "Paris."}
    assert Conversations._key(None, [*HI, held], None) == Conversations._key(None, [*HI, sent], None)
    assert Conversations._key(None, [*HI, held], None) != Conversations._key(None, [*HI, {**sent, "content": "Rome."}],
                                                                             None)


def test_forced_calls_and_the_thinking_switch_under_the_qwen3_template(tiny_models, tmp_path):
    """The real Qwen3 template: a named function forced through the Responses API gives a valid call;
    chat_template_kwargs' enable_thinking reaches the template (false adds its empty think block to the prompt)."""
    client, im_end = _qwen3_template_client(tiny_models, tmp_path)
    srv = Server(client)
    try:
        sdk = srv.sdk()
        tools = [{"type": "function", **tool["function"]} for tool in CITIES]
        for stream in (False, True):
            kw = dict(model=MODEL, input="the time in Paris?", tools=tools, max_output_tokens=200, temperature=0,
                      tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False)
            if stream:
                with sdk.responses.stream(**kw) as events:
                    whole = events.get_final_response()
            else:
                whole = sdk.responses.create(**kw)
            calls = [o for o in whole.output if o.type == "function_call"]
            assert [c.name for c in calls] == ["get_time"] and json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")
            assert not whole.output_text.strip()
        plain = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
        off = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.usage.prompt_tokens > plain.usage.prompt_tokens   # "<think>\n\n</think>\n\n" in the prompt
        status, answer = raw(srv, "POST", "/v1/chat/completions", json.dumps(
            {"model": MODEL, "messages": HI, "chat_template_kwargs": {"enable_thinking": "no"}}))
        assert status == 400 and "chat_template_kwargs must be" in answer["error"]["message"]
    finally:
        srv.stop()
        client.shutdown()



def test_codexs_request_shape(server, monkeypatch):
    """What Codex sends: developer messages, then two user messages, a namespace of functions and a hosted web
    search among the tools, store false with encrypted reasoning asked for. The developer messages are the system
    prompt, the user messages one turn, the namespace's functions tools (a call of one names its namespace), the
    web search left out."""
    pieces = ["<tool_call>\n", '{"name": "close_agent", "arguments": {"target": "a1"}}', "\n</tool_call>"]
    given = play(server, monkeypatch, pieces, tools=True)
    space = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "close_agent", "description": "Close one.", "strict": False,
         "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]}}]}
    kw = dict(model=MODEL, store=False, include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
              tools=[TOOL, space, {"type": "web_search", "external_web_access": False}], input=[
                  {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
                  {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox."}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env>/root</env>"}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]}],
              extra_body={"prompt_cache_key": "k", "client_metadata": {"x": "y"}})
    whole = server.sdk().responses.create(**kw)
    history, turn, variables = given[-1]
    assert history == [] and turn == [{"role": "user", "content": "<env>/root</env>"},
                                      {"role": "user", "content": "say hi"}]
    assert [t["function"]["name"] for t in variables["tools"]] == ["get_weather", "close_agent"]
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "close_agent" and call.namespace == "multi_agent_v1"
    with server.sdk().responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert final.output[0].namespace == "multi_agent_v1" and whole.store is False
    with pytest.raises(openai.NotFoundError):   # store: false keeps nothing
        server.sdk().responses.retrieve(whole.id)


def test_the_store_keeps_the_last_responses_within_its_count_and_bytes():
    from nanochat.app.api_errors import ApiError
    from nanochat.app.responses_api import ResponseStore

    store = ResponseStore(capacity=3, max_bytes=2500)
    chain = []
    for k in range(4):   # a chain: each response's messages share the earlier ones, and count only their own
        added = [{"role": "user", "content": f"{k}" * 500}, {"role": "assistant", "content": "ok"}]
        chain = chain + added
        store.put({"id": f"r{k}"}, chain, added)
    assert [store.get(f"r{k}")[1] == chain[:2 * k + 2] for k in (1, 2, 3)] == [True] * 3
    with pytest.raises(ApiError, match="no response"):   # the fourth pushed the first out (count)
        store.get("r0")
    store.put({"id": "big"}, [], [{"role": "user", "content": "x" * 2000}])   # over the bytes: the oldest go
    assert store.bytes <= 2500 and store.get("big")
    with pytest.raises(ApiError):
        store.get("r1")
    store.delete("big")
    assert store.bytes == sum(size for *_, size in store._items.values())
