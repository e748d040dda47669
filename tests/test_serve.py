"""`nanochat serve`: the OpenAI-compatible server, driven by the real `openai` SDK and by raw HTTP.

One server (uvicorn in a thread, the engine in its own process, a tiny model) serves the module; each
test leaves it idle. The engine-crash test kills that engine, and the server restarts it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from nanochat.app.openai_api import ServerConfig, build_app   # noqa: E402
from nanochat.app.serve import bind, url_of                    # noqa: E402
from nanochat.engine.sampling_params import SamplingParams     # noqa: E402
from nanochat.engine.serve.client import AsyncEngineClient, EngineClient   # noqa: E402

from conftest import gone   # noqa: E402

ENGINE = dict(dtype="float32", max_model_len=256, kvcache_block_size=16)
BLOCK = 16
KEY = "test-key"
MODEL = "tiny"
LIMITS = dict(max_body_bytes=64 * 1024, max_messages=9, max_queue=3)


class Server:
    def __init__(self, client: EngineClient, **config):   # config: more ServerConfig fields
        self.aclient = AsyncEngineClient(client)
        self.sock = bind("127.0.0.1", 0)
        self.url = url_of(self.sock, "127.0.0.1")
        self.port = self.sock.getsockname()[1]
        self.log: list[str] = []
        self.app = build_app(self.aclient, ServerConfig(model_id=MODEL, api_key=KEY, log=self.log.append,
                                                        **{**LIMITS, **config}))
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def sdk(self, key: str = KEY):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(tiny_models):
    """A server over the tiny llama in its own engine process (other modules import this fixture: one each).
    `ends`: request fields that end a random reply at its first token (a +100 bias on its end token)."""
    client = EngineClient()
    client.load_model(str(tiny_models["llama"]), **ENGINE)
    srv = Server(client)
    srv.ends = {"logit_bias": {str(json.loads((tiny_models["llama"] / "config.json").read_text())["eos_token_id"]): 100}}
    yield srv
    srv.stop()
    pid = client.pid
    client.shutdown()
    assert gone(pid)


def raw(server, method: str, path: str, body: bytes | str | None = None, key: str | None = KEY,
        headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        all_headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=body, headers=all_headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, json.loads(data)


def wait_idle(server, baseline: int | None = None, within: float = 10.0):
    """The engine's stats once nothing runs (and, with `baseline`, no more blocks are used than that)."""
    deadline = time.monotonic() + within
    while True:
        stats = server.aclient.client.stats(fresh=True)
        idle = stats.running == 0 and stats.waiting == 0
        if idle and (baseline is None or stats.kv_blocks_used <= baseline):
            return stats
        assert time.monotonic() < deadline, f"the engine did not go idle: {stats}"
        time.sleep(0.05)


LONG = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 200,
        "temperature": 0, "ignore_eos": True}


# ---------------------------------------------------------------------------------- the async client
def test_the_async_client_streams_without_a_thread_per_token(tiny_models):
    """Events reach the loop from the client's reader thread: the executor runs one call per submit,
    none per token; concurrent requests share the engine and end as the blocking client's do."""
    client = EngineClient(in_process=True)
    client.load_model(str(tiny_models["llama"]), **ENGINE)
    calls = []

    class CountingExecutor(ThreadPoolExecutor):
        def submit(self, fn, *args, **kwargs):
            calls.append(fn)
            return super().submit(fn, *args, **kwargs)

    async def main():
        asyncio.get_running_loop().set_default_executor(CountingExecutor(2))
        aclient = AsyncEngineClient(client)
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        streams = [await aclient.submit(f"prompt number {i}", sp) for i in range(3)]
        batches = [[] for _ in streams]

        async def drain(i, stream):
            while True:
                events = await stream.next_events()
                batches[i].append(events)
                if events[-1].finished:
                    return

        await asyncio.gather(*(drain(i, s) for i, s in enumerate(streams)))
        session = aclient.open_session("Be brief.")
        turn = await aclient.submit_turn(session, "hello", sp)
        reply = await turn.result()
        return streams, batches, reply, session

    try:
        streams, batches, reply, session = asyncio.run(main())
        for stream, got in zip(streams, batches):
            events = [e for batch in got for e in batch]
            assert sum(e.token_id is not None for e in events) == 24 and events[-1].finish_reason == "length"
            assert events[-1].finished and not any(e.finished for e in events[:-1])
            assert "".join(e.text for e in events) == stream.reply.text
        assert len(reply.token_ids) == 24 and session.turns == 1
        assert len(calls) == 4   # one per submit
        expected = client.submit("prompt number 1", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert expected.result(30).text == streams[1].reply.text
    finally:
        client.shutdown()


# ---------------------------------------------------------------------------------- the SDK
def test_chat_streaming_and_not(server):
    sdk = server.sdk()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion" and whole.model == MODEL and whole.id.startswith("chatcmpl-")
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8

    chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content            # greedy: the same reply
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # the same first message again: its prompt comes from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens - BLOCK


def test_text_parts_top_k_repetition_penalty_seed_and_stop(server):
    sdk = server.sdk()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    kw = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0.9, seed=7, top_p=0.9, presence_penalty=0.5,
              frequency_penalty=0.5, extra_body={"top_k": 20, "repetition_penalty": 1.1})
    a, b = sdk.chat.completions.create(**kw), sdk.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content   # seeded
    word = a.choices[0].message.content[2:5]
    if word.strip():
        c = sdk.chat.completions.create(**{**kw, "stop": [word]})
        assert word not in c.choices[0].message.content and c.choices[0].finish_reason == "stop"


def test_logit_bias_forces_and_bans_tokens(server, tiny_models):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_models["llama"] / "tokenizer.json"))
    sdk = server.sdk()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0)
    forced = tok.encode("hello").ids[-1]
    reply = sdk.chat.completions.create(**kw, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == tok.decode([forced] * 6)
    text = sdk.chat.completions.create(**kw).choices[0].message.content
    banned = {str(t): -100 for t in tok.encode(text).ids}
    assert sdk.chat.completions.create(**kw, logit_bias=banned).choices[0].message.content != text


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", "blue"]},
                                           "tag": {"type": "string", "maxLength": 6}},
          "required": ["ok", "pick", "tag"], "additionalProperties": False}


def test_response_format_holds_replies_to_json_and_to_a_schema(server):
    """A random tiny model writes JSON only because the tokens that would break it are never sampled."""
    sdk = server.sdk()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=200, temperature=1.0)
    for seed in range(3):
        reply = sdk.chat.completions.create(**kw, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        assert set(value) == {"ok", "pick", "tag"} and isinstance(value["ok"], bool)
        assert value["pick"] in ("red", "green", "blue") and isinstance(value["tag"], str) and len(value["tag"]) <= 6
    streamed = sdk.chat.completions.create(**kw, seed=0, stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}})
    text = "".join(part.choices[0].delta.content or "" for part in streamed if part.choices)
    assert set(json.loads(text)) == {"ok", "pick", "tag"}
    # json_object: any object; cut at max_tokens it is a prefix, finish_reason "length"
    reply = sdk.chat.completions.create(**{**kw, "max_tokens": 8}, seed=1, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.content.lstrip().startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


YES_NO = 'root ::= ("yes" | "no") " " [0-9]'


def test_a_grammar_holds_chat_and_completion_replies(server):
    """llama.cpp's `grammar` extra (GBNF; Lark too), on both endpoints, and vLLM's structured outputs; two ways to
    hold one reply, or a value of the wrong kind, a 400."""
    sdk = server.sdk()
    hi = [{"role": "user", "content": "Hello"}]
    for seed in range(3):
        chat = sdk.chat.completions.create(model=MODEL, messages=hi, max_tokens=20, temperature=1.0, seed=seed,
                                           extra_body={"grammar": YES_NO})
        done = sdk.completions.create(model=MODEL, prompt="The fox", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"grammar": 'start: "maybe" | "never"'})
        assert re.fullmatch("(yes|no) [0-9]", chat.choices[0].message.content), chat.choices[0]
        assert done.choices[0].text in ("maybe", "never") and done.choices[0].finish_reason == "stop"
    # vLLM's structured outputs, new and old spellings
    for extra, pattern in (({"structured_outputs": {"choice": ["café", "tea"]}}, "café|tea"),
                           ({"guided_choice": ["up", "down"]}, "up|down"),
                           ({"structured_outputs": {"regex": r"[0-9]{2}/[0-9]{2}"}}, "[0-9]{2}/[0-9]{2}"),
                           ({"guided_regex": "(ab)+c"}, "(ab)+c"),
                           ({"guided_grammar": YES_NO}, "(yes|no) [0-9]"),
                           ({"structured_outputs": {"grammar": 'start: "a"+'}}, "a{1,39}")):
        reply = sdk.chat.completions.create(model=MODEL, messages=hi, max_tokens=40, temperature=1.0, seed=1,
                                            extra_body=extra).choices[0]
        assert re.fullmatch(pattern, reply.message.content) and reply.finish_reason == "stop", (extra, reply)
    for extra in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": json.dumps(SCHEMA)}}):
        reply = sdk.chat.completions.create(model=MODEL, messages=hi, max_tokens=200, temperature=1.0, seed=2,
                                            extra_body=extra).choices[0]
        assert set(json.loads(reply.message.content)) == {"ok", "pick", "tag"}, reply
    for body, words in (({"grammar": 5}, "grammar must be a grammar's text"),
                        ({"grammar": YES_NO, "response_format": {"type": "json_object"}},
                         "response_format and grammar cannot both hold a reply"),
                        ({"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_json and guided_regex cannot both"),
                        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs must be one of"),
                        ({"guided_choice": []}, "guided_choice must be a non-empty list"),
                        ({"guided_json": "{oops"}, "guided_json must be a JSON schema"),
                        ({"guided_regex": "(a"}, "grammar cannot be followed"),
                        ({"grammar": "root ::= ("}, "grammar cannot be followed")):
        status, answer = raw(server, "POST", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": hi,
                                                                                  **body}))
        assert status == 400 and words in answer["error"]["message"], answer


def test_completions_and_models(server):
    sdk = server.sdk()
    done = sdk.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    parts = list(sdk.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == done.choices[0].text
    models = sdk.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        sdk.models.retrieve("another/model")


def test_each_turn_prefills_only_its_new_message(server):
    sdk = server.sdk()
    messages = [{"role": "system", "content": "You are terse."}]
    previous = None
    for turn in range(4):
        if turn == 2:   # two user messages in a row: one turn
            messages.append({"role": "user", "content": "a note first."})
        messages.append({"role": "user", "content": f"question {turn}: what comes next?"})
        reply = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.8)
        usage = reply.usage
        if previous is not None:   # the earlier transcript, its replies' generated ids included, is cached
            assert usage.prompt_tokens_details.cached_tokens >= previous - BLOCK, (turn, usage)
        previous = usage.prompt_tokens + usage.completion_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    # a regenerated last reply (the transcript cut before it) branches the kept conversation
    again = sdk.chat.completions.create(model=MODEL, messages=messages[:-1], max_tokens=4, temperature=0.8)
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - BLOCK


def test_n_choices_share_the_prompt_and_batch(server):
    sdk = server.sdk()
    before = wait_idle(server)
    messages = [{"role": "user", "content": "several answers to one question, please, a few of them " * 3}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=11, n=3,
              extra_body={"ignore_eos": True})
    whole = sdk.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) == 3 and all(c.finish_reason == "length" for c in whole.choices)
    prompt = whole.usage.prompt_tokens
    assert whole.usage.completion_tokens == 24 and whole.usage.total_tokens == prompt + 24
    # choices 1 and 2 found choice 0's prompt in the prefix cache
    after = wait_idle(server)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= 2 * (prompt - BLOCK)
    # choice i samples with seed + i: choice 1 of seed 11 is choice 0 of seed 12
    one = sdk.chat.completions.create(**{**kw, "n": 1, "seed": 12})
    assert one.choices[0].message.content == texts[1]

    chunks = list(sdk.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = ["", "", ""]
    finished = {}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert streamed == texts and finished == {0: "length", 1: "length", 2: "length"}   # seeded: the same
    assert chunks[-1].usage.completion_tokens == 24

    done = sdk.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in done.choices] == [0, 1] and done.choices[0].text == done.choices[1].text   # greedy
    assert done.usage.completion_tokens == 10
    assert server.app.state.api.in_flight == 0


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"nanochat_{name}") and not line.startswith("#"))


def test_metrics(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/metrics")
    assert conn.getresponse().status == 401   # behind the key
    conn.close()

    def scrape() -> str:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("content-type").startswith("text/plain")
        text = response.read().decode()
        conn.close()
        return text

    before = scrape()
    reply = server.sdk().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}],
                                                 max_tokens=7, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
    usage = list(reply)[-1].usage
    stats = wait_idle(server)
    after = scrape()
    assert metric(after, "prompt_tokens_total") - metric(before, "prompt_tokens_total") == usage.prompt_tokens
    assert metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total") == 7
    assert metric(after, "time_to_first_token_seconds_count") - metric(before, "time_to_first_token_seconds_count") == 1
    assert metric(after, "inter_token_latency_seconds_count") - metric(before, "inter_token_latency_seconds_count") <= 6
    assert 'nanochat_time_to_first_token_seconds_bucket{le="+Inf"}' in after
    assert 'nanochat_requests_finished_total{finished_reason="length"}' in after
    assert metric(after, "kv_cache_blocks_total") == stats.kv_blocks_total > 0
    assert metric(after, "num_requests_running") == 0 and metric(after, "requests_in_flight") == 0
    assert 0 <= metric(after, "prefix_cache_hit_rate") <= 1
    assert "# TYPE nanochat_engine_restarts_total counter" in after


PROMPT_IDS = [5, 17, 42, 8, 99, 23, 61]


def hf_log_softmax(hf, prompt: list[int], generated: list[int]):
    """log_softmax of the transformers model's logits at each generated position."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(generated)]


def test_logprobs_are_the_models_log_softmax_before_any_penalty(server, hf_models):
    import torch

    for extra in ({}, {"repetition_penalty": 1.5, "presence_penalty": 1.0}):
        sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=4, **extra)
        reply = server.aclient.client.submit(PROMPT_IDS, sp).result(60)
        expected = hf_log_softmax(hf_models("llama"), PROMPT_IDS, reply.token_ids)
        assert len(reply.logprobs) == 5
        for row, token, got in zip(expected, reply.token_ids, reply.logprobs):
            top = torch.topk(row, 4)
            # within the engine's fp32 agreement with transformers (its logits: 1e-4; the log-sum-exp adds some)
            assert abs(got.logprob - float(row[token])) < 5e-4
            assert [i for _, _, i in got.top] == top.indices.tolist()
            assert [v for _, v, _ in got.top] == pytest.approx(top.values.tolist(), abs=5e-4)
            if not extra:   # greedy over the model's own distribution
                assert token == got.top[0][2]


def test_logprobs_through_the_sdk(server, hf_models):
    sdk = server.sdk()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, logprobs=True,
              top_logprobs=2, extra_body={"ignore_eos": True})
    whole = sdk.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8")) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) and entry.logprob <= 0
    chunks = list(sdk.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    # The second request prefills only past the prefix cache: the tiny fp32 model's linears run on torch's GEMM,
    # whose rounding depends on the number of rows (AVX-512 MKL), so its log-probabilities may move by an ulp.
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], rel=1e-6, abs=1e-6)
    plain = sdk.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content

    done = sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == done.choices[0].text
    parts = list(sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=4, temperature=0, logprobs=3,
                                        stream=True, extra_body={"ignore_eos": True}))
    assert [x for p in parts if p.choices[0].logprobs for x in p.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs
    assert [x for p in parts if p.choices[0].logprobs for x in p.choices[0].logprobs.text_offset] == lp.text_offset


# ---------------------------------------------------------------------------------- tools
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_tools_reach_the_qwen3_template(tiny_models):
    from test_chat_template import QWEN3_TEMPLATE   # the real Qwen3 chat template text

    from nanochat.engine.serve.session import ChatSession
    from nanochat.models.text.chat_template import CHATML_TEMPLATE, ChatTemplate
    from nanochat.models.formats.loader import load

    tok = load(str(tiny_models["llama"])).tokenizer
    template = ChatTemplate(QWEN3_TEMPLATE, eos_token="<|im_end|>")
    assert template.takes_tools() and not ChatTemplate(CHATML_TEMPLATE).takes_tools()
    session = ChatSession(tok, template, system_prompt="Be brief.")
    first = tok.decode(session.prepare_turn("the weather in Paris?", {"tools": TOOLS}))
    assert first == template.render([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "the weather in Paris?"}],
                                    add_generation_prompt=True, tools=TOOLS)
    assert "<tools>" in first and json.dumps(TOOLS[0]) in first


class Scripted:
    """A request stream that plays canned model output (the tiny models write no tool calls)."""

    def __init__(self, pieces: list[str]):
        from nanochat.engine.output import Reply, RequestStats, TokenEvent

        self.reply, self.lost, self.request_id = Reply(), False, "scripted"
        self.batches = [[TokenEvent("scripted", i, piece)] for i, piece in enumerate(pieces)]
        self.batches.append([TokenEvent("scripted", None, "", True, "stop",
                                        RequestStats(prompt_tokens=9, completion_tokens=len(pieces)))])

    async def next_events(self):
        events = self.batches.pop(0)
        for e in events:
            self.reply.add(e)
        return events

    def cancel(self):
        pass


def play(server, monkeypatch, pieces: list[str], tools: bool = False) -> list[tuple]:
    """Canned model output (`pieces`) for every turn the server submits from now on, the model said to render tools
    when `tools`; returns what each submit is given: (its session's history, the turn's messages, the template's
    variables)."""
    import dataclasses

    given = []

    async def submit_turns(sessions, user, samplings, template_kwargs=None):
        given.append((sessions[0].history, user, template_kwargs))
        return [Scripted(pieces) for _ in sessions]

    if tools:
        monkeypatch.setattr(server.aclient.client, "model", dataclasses.replace(server.aclient.model, tools=True))
    monkeypatch.setattr(server.aclient, "submit_turns", submit_turns)
    return given


THINKING = ["<think>", "\nweighing", " it\n", "</think>", "\n\nParis."]   # canned: a reasoning reply
CALLING = ["Let me check.", "\n<tool", '_call>\n{"name": "get_', 'weather", "arguments": {"city": "Paris"}}\n</tool',
           "_call>"]


def test_tool_calls_are_parsed_from_the_reply(server, monkeypatch):
    import dataclasses

    sdk = server.sdk()
    hi = [{"role": "user", "content": "the weather in Paris?"}]
    with pytest.raises(openai.BadRequestError) as plain:   # the tiny model's ChatML template has no tools section
        sdk.chat.completions.create(model=MODEL, messages=hi, tools=TOOLS)
    assert "does not render tools" in plain.value.body["message"]
    with pytest.raises(openai.BadRequestError) as forced:
        sdk.chat.completions.create(model=MODEL, messages=hi, tools=TOOLS, tool_choice="required")
    assert "does not render tools" in forced.value.body["message"]

    given = []

    async def submit_turns(sessions, user, samplings, template_kwargs=None):
        given.append(template_kwargs)
        return [Scripted(CALLING) for _ in sessions]

    monkeypatch.setattr(server.aclient.client, "model", dataclasses.replace(server.aclient.model, tools=True))
    monkeypatch.setattr(server.aclient, "submit_turns", submit_turns)
    whole = sdk.chat.completions.create(model=MODEL, messages=hi, tools=TOOLS)
    assert given[-1] == {"tools": TOOLS}
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(sdk.chat.completions.create(model=MODEL, messages=hi, tools=TOOLS, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert content == "Let me check.\n" and len(calls) == 1 and calls[0].index == 0
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # tool_choice "none": no tools in the prompt, and the reply is text
    whole = sdk.chat.completions.create(model=MODEL, messages=hi, tools=TOOLS, tool_choice="none")
    assert given[-1] is None and whole.choices[0].message.content == "".join(CALLING)
    assert whole.choices[0].finish_reason == "stop" and not whole.choices[0].message.tool_calls


def test_the_tool_call_parser_holds_back_only_what_may_be_a_tag():
    from nanochat.app.tool_calls import ToolCallParser, split

    text = "".join(CALLING) + " done <tool_call>not json</tool_call> <tool"
    content, calls = split(text)
    assert content == "Let me check.\n done <tool_call>not json</tool_call> <tool" and len(calls) == 1
    parser = ToolCallParser()
    shown, found = zip(*(parser.feed(ch) for ch in text))
    assert "".join(shown) + parser.finish() == content and sum(len(f) for f in found) == 1
    assert parser.feed("a <")[0] == "a " and parser.feed("b")[0] == "<b"


CALLS = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
         {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]
# what a Qwen model writes for CALLS, which is also how the Qwen3 template renders them
WROTE = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}   # as a client sends one
RESULTS = [{"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "call_1"},
           {"role": "tool", "content": '{"celsius": 25}', "tool_call_id": "call_2"}]


def test_tool_results_continue_a_session_as_the_template_renders_the_transcript(tiny_models):
    """With the real Qwen3 template and canned replies: each turn's incremental rendering (tool results
    after the calls the model wrote, then a user message) gives the text the template gives the whole
    transcript; a transcript whose calls a client built as tool_calls renders to the same ids."""
    from test_chat_template import QWEN3_TEMPLATE

    from nanochat.engine.serve.session import ChatSession
    from nanochat.models.text.chat_template import ChatTemplate
    from nanochat.models.formats.loader import load

    tok = load(str(tiny_models["llama"])).tokenizer
    template = ChatTemplate(QWEN3_TEMPLATE, eos_token="<|im_end|>")
    kw = {"tools": TOOLS}
    system = [{"role": "system", "content": "Be brief."}]
    asked = {"role": "user", "content": "the weather in Paris and Rome?"}
    answer, thanks = "21 °C in Paris, 25 °C in Rome.", {"role": "user", "content": "and tomorrow?"}

    session = ChatSession(tok, template, system_prompt="Be brief.")
    first = session.prepare_turn([asked], kw)
    session.complete_turn(WROTE, tok.encode(WROTE, add_special_tokens=False))   # the generated ids, then <|im_end|>
    second = session.prepare_turn(RESULTS, kw)
    assert second[:len(first)] == first
    called = [asked, {"role": "assistant", "content": WROTE}, *RESULTS]
    text = tok.decode(second)
    assert text == template.render(system + called, add_generation_prompt=True, **kw)
    assert text.endswith("<|im_start|>user\n<tool_response>\n{\"celsius\": 21}\n</tool_response>\n<tool_response>\n"
                         "{\"celsius\": 25}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    session.complete_turn(answer, tok.encode(answer, add_special_tokens=False))
    third = session.prepare_turn([thanks], kw)
    transcript = called + [{"role": "assistant", "content": answer}, thanks]
    assert tok.decode(third) == template.render(system + transcript, add_generation_prompt=True, **kw)
    assert session.transcript_messages == transcript[:-1]

    # the calls as a client sends them back: rendered by the template's own tool_calls handling
    built = [asked, {"role": "assistant", "content": "Let me check.", "tool_calls": CALLS}, *RESULTS,
             {"role": "assistant", "content": answer}]
    rebuilt = ChatSession.from_history(tok, template, "Be brief.", built, template_kwargs=kw)
    again = rebuilt.prepare_turn([thanks], kw)
    assert tok.decode(again) == template.render(system + built + [thanks], add_generation_prompt=True, **kw)
    assert again == third and rebuilt.turn_starts == session.turn_starts
    assert rebuilt.transcript_messages == built


def test_system_messages_lead_or_join_their_users_turn():
    """The leading system and developer messages are the system prompt; a later one joins the user's turn it belongs
    to (the one before it, else the next); user messages in a row are one turn."""
    from nanochat.app.openai_api import parse_messages

    system, history, turn = parse_messages([
        {"role": "system", "content": "A."}, {"role": "developer", "content": "B."},
        {"role": "user", "content": "hi"}, {"role": "system", "content": "C."}, {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "D."}, {"role": "user", "content": "more"},
        {"role": "user", "content": "and more"}], 20)
    assert system == "A.\n\nB."
    assert history == [{"role": "user", "content": "hi\n\nC."}, {"role": "assistant", "content": "ok"}]
    assert turn == [{"role": "user", "content": "D.\n\nmore"}, {"role": "user", "content": "and more"}]


def test_a_reply_that_called_tools_is_known_by_its_text_and_calls():
    """The assistant message a client sends back, whole or rebuilt from a stream's deltas (its content
    then keeps the whitespace before the calls), finds the session that holds the reply as written."""
    from nanochat.app.openai_api import Conversations, parse_messages

    asked = {"role": "user", "content": "the weather in Paris and Rome?"}
    kept = Conversations._key(None, [asked, {"role": "assistant", "content": WROTE}], TOOLS)
    sent = [{"id": f"call_{i}", "type": "function",
             "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
            for i, c in enumerate(CALLS)]
    for content in ("Let me check.", "Let me check.\n"):
        _, history, turn = parse_messages([asked, {"role": "assistant", "content": content, "tool_calls": sent},
                                           *RESULTS], 9)
        assert turn == RESULTS and Conversations._key(None, history, TOOLS) == kept
    sent[1]["function"]["arguments"] = '{"city": "Oslo"}'
    _, history, _ = parse_messages([asked, {"role": "assistant", "content": None, "tool_calls": sent}, *RESULTS], 9)
    assert Conversations._key(None, history, TOOLS) != kept


def test_a_tool_result_goes_back_through_the_sdk_and_prefills_only_itself(tiny_models, tmp_path, monkeypatch):
    """A tiny model under the Qwen3 template (in this process), its sampler made to write two calls: the
    SDK sends the results back with the reply's message; the engine's next prompt is the template's
    rendering of the whole transcript with the reply as the model wrote it, and all but the results come
    from the KV cache. A transcript whose calls the client made up itself renders them through the template."""
    import shutil

    from test_chat_template import QWEN3_TEMPLATE

    from nanochat.engine.llm_engine import LLMEngine
    from nanochat.engine.sampler import Sampler
    from nanochat.models.text.chat_template import ChatTemplate
    from nanochat.models.formats.loader import load

    folder = shutil.copytree(tiny_models["llama"], tmp_path / "qwen3-template")
    for name, changes in (("tokenizer_config.json", {"chat_template": QWEN3_TEMPLATE}),
                          ("config.json", {"max_position_embeddings": 2048})):   # room for the tools' prompt
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()), **changes}))
    client = EngineClient(in_process=True)
    # No speculation: a verified proposal would not pass through the scripted sampler below.
    client.load_model(str(folder), **{**ENGINE, "max_model_len": 2048, "speculative": "off"})
    tok = load(str(folder)).tokenizer
    template = ChatTemplate(QWEN3_TEMPLATE, eos_token="<|im_end|>")
    wrote = WROTE.replace('{"city": "Paris"}', '{"city":"Paris"}')   # not how the template would write it
    forced = tok.encode(wrote, add_special_tokens=False) + [tok.token_to_id("<|im_end|>")]
    sample, add = Sampler.__call__, LLMEngine.add_request
    prompts = []

    def scripted(self, logits, params, *args):
        return [forced.pop(0) if forced else token for token in sample(self, logits, params, *args)]

    def recorded(self, prompt, *args, **kwargs):
        prompts.append(prompt)
        return add(self, prompt, *args, **kwargs)

    monkeypatch.setattr(Sampler, "__call__", scripted)
    monkeypatch.setattr(LLMEngine, "add_request", recorded)
    srv = Server(client)
    try:
        sdk = srv.sdk()
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "the weather in Paris and Rome?"}]
        called = sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=256,
                                             temperature=0)
        message = called.choices[0].message
        assert called.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
        assert [json.loads(c.function.arguments) for c in message.tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]
        results = [{"role": "tool", "tool_call_id": c.id, "content": r["content"]}
                   for c, r in zip(message.tool_calls, RESULTS)]
        follow = sdk.chat.completions.create(model=MODEL, messages=messages + [message] + results, tools=TOOLS,
                                             max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert follow.choices[0].finish_reason == "length" and not forced
        transcript = messages + [{"role": "assistant", "content": wrote}, *RESULTS]
        assert tok.decode(prompts[-1]) == template.render(transcript, add_generation_prompt=True, tools=TOOLS)
        previous = called.usage.prompt_tokens + called.usage.completion_tokens
        assert follow.usage.prompt_tokens_details.cached_tokens >= previous - BLOCK, (previous, follow.usage)

        # a call the server never wrote (another conversation): the template renders it
        oslo, result = {"name": "get_weather", "arguments": {"city": "Oslo"}}, RESULTS[0]
        sent = {"id": "call_1", "type": "function", "function": {**oslo, "arguments": json.dumps(oslo["arguments"])}}
        sdk.chat.completions.create(model=MODEL, messages=[messages[1], {"role": "assistant", "content": None,
                                                                         "tool_calls": [sent]}, result],
                                    tools=TOOLS, max_tokens=2, temperature=0)
        made_up = [messages[1], {"role": "assistant", "content": "", "tool_calls": [{**sent, "function": oslo}]},
                   result]
        assert tok.decode(prompts[-1]) == template.render(made_up, add_generation_prompt=True, tools=TOOLS)
    finally:
        srv.stop()
        client.shutdown()


def _qwen3_template_client(tiny_models, tmp_path) -> tuple[EngineClient, int]:
    """The tiny llama under the real Qwen3 template (it renders tools), in this process; and its <|im_end|>."""
    import shutil

    from test_chat_template import QWEN3_TEMPLATE

    folder = shutil.copytree(tiny_models["llama"], tmp_path / "qwen3-template")
    for name, changes in (("tokenizer_config.json", {"chat_template": QWEN3_TEMPLATE}),
                          ("config.json", {"max_position_embeddings": 2048})):   # room for the tools' prompt
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()), **changes}))
    client = EngineClient(in_process=True)
    client.load_model(str(folder), **{**ENGINE, "max_model_len": 2048})
    return client, json.loads((folder / "config.json").read_text())["eos_token_id"]


CITIES = [{"type": "function", "function": {"name": "get_weather", "parameters": {
              "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}}},
          {"type": "function", "function": {"name": "get_time", "parameters": {
              "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
              "additionalProperties": False}}}]


def test_tool_choice_forces_a_call_of_the_tools_or_of_the_named_one(tiny_models, tmp_path):
    """tool_choice "required" and a named function hold the random model's reply to calls with valid arguments
    (whole and streamed); its response_format gives way (a call has no JSON answer); bad tool_choices are 400s.
    (The random model would write calls until max_tokens: a bias on <|im_end|> ends a reply where the grammar first
    allows it.)"""
    client, im_end = _qwen3_template_client(tiny_models, tmp_path)
    srv = Server(client)
    try:
        sdk = srv.sdk()
        hi = [{"role": "user", "content": "the time in Paris?"}]
        named = {"type": "function", "function": {"name": "get_time"}}
        for choice in ("required", named):
            for stream in (False, True):
                kw = dict(model=MODEL, messages=hi, tools=CITIES, tool_choice=choice, max_tokens=200, temperature=0,
                          response_format={"type": "json_object"}, logit_bias={str(im_end): 100})
                if stream:
                    chunks = list(sdk.chat.completions.create(**kw, stream=True))
                    content = "".join(c.choices[0].delta.content or "" for c in chunks)
                    calls = [t.function for c in chunks for t in c.choices[0].delta.tool_calls or []]
                    finish = chunks[-1].choices[0].finish_reason
                else:
                    whole = sdk.chat.completions.create(**kw).choices[0]
                    content, calls = whole.message.content, [t.function for t in whole.message.tool_calls or []]
                    finish = whole.finish_reason
                assert not (content or "").strip() and finish == "tool_calls" and len(calls) == 1, (choice, content)
                assert (calls[0].name, json.loads(calls[0].arguments)) in \
                    [("get_weather", {"city": c}) for c in ("Paris", "Rome")] + \
                    [("get_time", {"zone": z}) for z in ("UTC", "CET")], calls
                assert choice == "required" or calls[0].name == "get_time"
        # without parallel calls a forced call ends the reply by itself (no bias)
        whole = sdk.chat.completions.create(model=MODEL, messages=hi, tools=CITIES, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=200, temperature=0).choices[0]
        assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
        for body, words in (({"tool_choice": "always"}, 'tool_choice must be "auto", "none", "required" or'),
                            ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                             'tool_choice names "nope", which is not among the tools'),
                            ({"tool_choice": "required", "tools": None}, "the request gives no tools"),
                            ({"parallel_tool_calls": "no"}, "parallel_tool_calls must be true or false"),
                            ({"tool_choice": "required", "grammar": 'root ::= "x"'},
                             "grammar and a forced tool call cannot both hold a reply"),
                            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
                             "tools must be a list of"),
                            ({"tool_choice": "required", "tools": [{"type": "function", "function": {
                                "name": "f", "parameters": {"type": "nope"}}}]},
                             'the parameters of tool "f" cannot be followed: Invalid type: nope')):
            status, answer = raw(srv, "POST", "/v1/chat/completions",
                                 json.dumps({"model": MODEL, "messages": hi, "tools": CITIES, **body}))
            assert status == 400 and words in answer["error"]["message"], answer
    finally:
        srv.stop()
        client.shutdown()


# ---------------------------------------------------------------------------------- errors
def test_sdk_error_statuses(server):
    sdk = server.sdk()
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError) as bad_key:
        server.sdk("wrong").chat.completions.create(model=MODEL, messages=hi)
    assert bad_key.value.status_code == 401 and bad_key.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.chat.completions.create(model="gpt-4o", messages=hi)
    assert "does not exist" in unknown.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=MODEL, messages=hi, temperature=0.001)
    assert bad.value.body["message"] == "temperature must be 0 (greedy) or from 0.01 up, got 0.001"   # the CLI's words
    with pytest.raises(openai.BadRequestError) as long:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "fox " * 400}])
    assert long.value.body["code"] == "context_length_exceeded" and "context holds 256" in long.value.body["message"]
    with pytest.raises(openai.BadRequestError) as many:
        sdk.chat.completions.create(model=MODEL, messages=hi * 10)
    assert "too many messages" in many.value.body["message"]
    # max_tokens past the context is clamped to it: the reply ends where the context does
    far = sdk.chat.completions.create(model=MODEL, messages=hi, max_tokens=10 ** 6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert far.choices[0].finish_reason == "length"
    assert far.usage.prompt_tokens + far.usage.completion_tokens == ENGINE["max_model_len"]
    status, body = raw(server, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["message"].startswith("no such endpoint")


@pytest.mark.parametrize("payload, words", [
    (b'{"messages": [', "not valid JSON"),
    (b'[1, 2]', "must be a JSON object"),
    (json.dumps({"messages": "hi"}), "messages must be a non-empty list"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}), "messages[0].content must be a string"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "messages[0].role must be"),
    (json.dumps({"messages": [{"role": "assistant", "content": "x"}]}), "must be a user message"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), "temperature must be"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), "max_tokens must be a positive"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}), "stream must be true or false"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": [""]}), "stop must be"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 4}), "n must be an integer from 1 to 3"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}),
     "top_logprobs must be an integer from 0 to 20"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), "top_logprobs needs logprobs"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}),
     "the last message must be the user's or a tool result"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, RESULTS[0]]}),
     "a tool message must answer an assistant message's tool_calls"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]},
                              {"role": "user", "content": "y"}]}), "messages[2] must be a tool message"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": "{oops"}}]}, RESULTS[0]]}),
     "messages[1].tool_calls[0].function.arguments must be a JSON object's text"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]},
                              {"role": "tool", "content": "4"}]}), "messages[2].tool_call_id must be a string"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]},
                              RESULTS[0]]}),
     "does not render tools: it cannot take their calls or results"),   # the tiny model's ChatML template
    # what would change the reply and cannot be honoured: an error, not a reply that ignores it
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                                                                                     "json_schema": {"name": "a"}}}),
     "response_format json_schema needs its schema"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}),
     'response_format "yaml" is not supported'),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "response_format": "json"}),
     "this response_format is not supported"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                 "json_schema": {"name": "a", "schema": {"type": "object", "properties": {"n": {"type": "nope"}}}}}}),
     "json_schema cannot be followed"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}),
     "logit_bias must be an object mapping token ids to numbers"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 500}}), "from -100 to 100"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999999": 1}}),
     "past the vocabulary"),
])


def test_malformed_requests_are_400(server, payload, words):
    status, body = raw(server, "POST", "/v1/chat/completions", payload)
    assert status == 400 and words in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error"


def test_a_text_response_format_is_served_and_completions_options_it_cannot_honour_are_400(server):
    status, body = raw(server, "POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "response_format": {"type": "text"}}))
    # served as plain text: the reply's two tokens (a random tiny model's may decode to no visible text)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert body["usage"]["completion_tokens"] == 2 and isinstance(body["choices"][0]["message"]["content"], str)
    for extra, words in (({"suffix": "end"}, "no fill-in-the-middle tokens"),   # tests/test_fim.py: a model with them
                         ({"best_of": 3}, "best_of is not supported")):
        status, body = raw(server, "POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2, **extra}))
        assert status == 400 and words in body["error"]["message"], body
    status, body = raw(server, "POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2, "best_of": 1}))
    assert status == 200, body


def test_an_oversized_body_is_413_and_the_key_guards_all_but_health(server):
    status, body = raw(server, "POST", "/v1/chat/completions", b"x" * (LIMITS["max_body_bytes"] + 1))
    assert status == 413 and "larger than" in body["error"]["message"]
    status, body = raw(server, "GET", "/v1/models", key=None)
    assert status == 401
    status, body = raw(server, "GET", "/health", key=None)   # no key needed
    assert status == 200 and body["status"] == "ok"


# ---------------------------------------------------------------------------------- many clients
def test_a_client_that_disconnects_frees_its_blocks_and_a_full_queue_is_429(server):
    """The queue is held full by stopping the engine (SIGSTOP) as soon as the server has admitted the last
    request, so no reply can end first however slow the machine; the clients then go away mid-reply."""
    baseline = wait_idle(server).kv_blocks_used
    client, api = server.aclient.client, server.app.state.api
    conns = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=60) for _ in range(LIMITS["max_queue"])]

    def send(conn):
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**LONG, "stream": True}),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        try:
            conn.getresponse().readline()
        except OSError:   # closed below, mid-reply
            pass

    threads = [threading.Thread(target=send, args=(conn,), daemon=True) for conn in conns]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while api.in_flight < LIMITS["max_queue"]:
        assert time.monotonic() < deadline, "the server did not admit the requests"
        time.sleep(0.001)
    os.kill(client.pid, signal.SIGSTOP)
    try:
        with pytest.raises(openai.RateLimitError) as full:
            server.sdk().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert full.value.body["code"] == "queue_full"
        for conn in conns:   # the clients go away mid-reply
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
    finally:
        os.kill(client.pid, signal.SIGCONT)
    stats = wait_idle(server, baseline, within=5)
    assert stats.kv_blocks_used <= baseline
    deadline = time.monotonic() + 5
    while api.in_flight:
        assert time.monotonic() < deadline, "the server still counts the requests"
        time.sleep(0.01)
    for t in threads:
        t.join(5)


def test_an_engine_crash_ends_the_stream_with_an_error_and_the_next_request_succeeds(server):
    sdk = server.sdk()
    client = server.aclient.client
    old = client.pid
    stream = sdk.chat.completions.create(model=MODEL, stream=True, **{k: v for k, v in LONG.items()
                                                                       if k not in ("model", "ignore_eos")},
                                         extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    os.kill(old, signal.SIGKILL)
    with pytest.raises(openai.APIError) as died:
        for _ in stream:
            pass
    assert "killed by SIGKILL" in str(died.value.message)
    status, body = raw(server, "POST", "/v1/chat/completions", json.dumps(LONG | {"max_tokens": 2}))
    assert status == 503 and body["error"]["code"] == "engine_restarting"   # loading takes seconds
    deadline = time.monotonic() + 60
    while raw(server, "GET", "/health")[0] != 200:
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.1)
    again = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert again.usage.completion_tokens >= 1 and client.pid != old
    assert server.aclient.restarts == 1


# ---------------------------------------------------------------------------------- the command
def test_the_command_line(tiny_models, tmp_path):
    env = {**os.environ, "NANOCHAT_HOME": str(tmp_path)}
    bad = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "serve", "--port", "http"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--port" in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "serve", "--port", str(port)], env=env,
                              capture_output=True, text=True, timeout=60)
    assert busy.returncode == 2 and "cannot listen" in busy.stderr and busy.stderr.count("\n") == 1

    proc = subprocess.Popen([sys.executable, "-m", "nanochat.app.cli", "serve", "--model", str(tiny_models["llama"]),
                             "--host", "0.0.0.0", "--port", "0", "--max-model-len", "256",
                             "--served-model-name", "local", "claude-haiku"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        assert "serving local (" in first and "/v1" in first, first
        assert "without --api-key" in proc.stderr.readline()
        port = int(first.rsplit(":", 1)[1].split("/")[0])
        deadline = time.monotonic() + 30
        while True:
            try:   # the socket listens from the start; uvicorn answers once it runs
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        # the first name is the one listed (first: the loaded model; then the catalog's, the built-in one among
        # them); requests may name any of them, or the model's path
        models = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-").models.list()
        assert models.data[0].id == "local" and "claude-haiku" not in [m.id for m in models.data]
        for name in ("local", "claude-haiku", str(tiny_models["llama"])):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/messages", json.dumps({"model": name, "max_tokens": 1, "messages": [
                {"role": "user", "content": "hi"}]}), {"Content-Type": "application/json"})
            answer = conn.getresponse()
            assert answer.status == 200 and json.loads(answer.read())["model"] == "local"
    finally:
        proc.send_signal(signal.SIGINT)   # how a server is stopped: not an error
        assert proc.wait(30) == 0
    assert proc.stderr.read().strip().endswith("stopped")


def test_the_speculative_field_reaches_the_request_and_bad_values_are_400(tiny_models):
    """`speculative` in a request body picks the request's proposer (off here: the engine proposes nothing for it,
    and greedy replies are the same either way); other values are 400 with the rule in words. A fresh engine:
    its step costs (which decide whether speculation pays) measured by this test alone."""
    client = EngineClient()
    client.load_model(str(tiny_models["llama"]), **ENGINE, speculative="ngram")
    server = Server(client)
    try:
        _speculative_field(server)
    finally:
        server.stop()
        client.shutdown()


def _speculative_field(server):
    sdk = server.sdk()
    repeat = "Repeat exactly: 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9 5 6 7 8 9"
    replies, proposed = {}, {}
    for mode in ("off", "ngram"):
        before = wait_idle(server).total_spec_proposed
        done = sdk.completions.create(model=MODEL, prompt=repeat, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True, "speculative": mode})
        replies[mode] = done.choices[0].text
        proposed[mode] = wait_idle(server).total_spec_proposed - before
    assert proposed["off"] == 0 and proposed["ngram"] > 0
    assert replies["off"] == replies["ngram"]
    for value, words in (("fast", "speculative must be off, ngram or draft, got \"fast\""),
                         (1, "speculative must be off, ngram or draft, got 1"),
                         ("draft", "speculative draft needs a draft model: start nanochat serve with --speculative")):
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/completions", {"prompt": "x"})):
            status, answer = raw(server, "POST", path, json.dumps({**body, "speculative": value}))
            assert status == 400 and words in answer["error"]["message"], (path, answer)
            assert answer["error"]["param"] == "speculative"


def test_tokenize_and_detokenize_as_llama_cpp_and_vllm_take_them(server, tiny_models):
    """Text to ids (llama.cpp's {"content"} without BOS by default, vLLM's {"prompt"} with it), a chat's prompt
    (the ids a chat completion prefills), and back."""
    from nanochat.models.formats.loader import load

    tokenizer = load(str(tiny_models["llama"])).tokenizer
    bare = tokenizer.encode("hello there", add_special_tokens=False)
    status, answer = raw(server, "POST", "/tokenize", json.dumps({"content": "hello there"}))
    assert status == 200 and answer["tokens"] == bare and answer["count"] == len(bare)
    assert answer["max_model_len"] == ENGINE["max_model_len"]
    status, answer = raw(server, "POST", "/tokenize", json.dumps({"model": MODEL, "prompt": "hello there"}))
    assert answer["tokens"] == tokenizer.encode("hello there", add_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    status, answer = raw(server, "POST", "/tokenize", json.dumps({"messages": messages}))
    chat = server.sdk().chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert status == 200 and answer["count"] == chat.usage.prompt_tokens
    status, back = raw(server, "POST", "/detokenize", json.dumps({"tokens": answer["tokens"]}))
    assert status == 200 and back["content"] == back["prompt"] == tokenizer.decode(answer["tokens"],
                                                                                   skip_special_tokens=False)
    assert "Be brief." in back["content"] and "hi" in back["content"]
    for path, body, words in (("/tokenize", {"content": 5}, "content must be a string"),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens must be"),
                              ("/detokenize", {"tokens": [1, "x"]}, "tokens must be a list of token ids"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "outside the vocabulary")):
        status, answer = raw(server, "POST", path, json.dumps(body))
        assert status == 400 and words in answer["error"]["message"], answer


def test_web_pages_of_other_origins_are_refused_and_local_ones_get_cors(server):
    """The guard stands in front of every endpoint of the real server (tests/test_http_guard.py checks it alone)."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    got, answer = raw(server, "POST", "/v1/chat/completions", body, headers={"Origin": "https://evil.example"})
    assert got == 403 and "--allowed-origins" in answer["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/api/chat", body=body, headers={"Authorization": f"Bearer {KEY}",
                                                          "Origin": "http://localhost:3000"})
    response = conn.getresponse()
    response.read()
    conn.close()
    assert response.status == 200 and response.getheader("access-control-allow-origin") == "http://localhost:3000"
