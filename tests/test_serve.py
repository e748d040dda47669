"""`nanochat serve`: the OpenAI-compatible server, driven by the real `openai` SDK and by raw HTTP.

One server (uvicorn in a thread, the engine in its own process, a tiny model) serves the module; each
test leaves it idle. The engine-crash test kills that engine, and the server restarts it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
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
    def __init__(self, client: EngineClient):
        self.aclient = AsyncEngineClient(client)
        self.sock = bind("127.0.0.1", 0)
        self.url = url_of(self.sock, "127.0.0.1")
        self.port = self.sock.getsockname()[1]
        self.log: list[str] = []
        self.app = build_app(self.aclient, ServerConfig(model_id=MODEL, api_key=KEY, log=self.log.append, **LIMITS))
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
    client = EngineClient()
    client.load_model(str(tiny_models["llama"]), **ENGINE)
    srv = Server(client)
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


def open_stream(server, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streaming request whose first token event has arrived."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(2):   # the role chunk, then the first text
        assert response.readline().startswith(b"data: ")
        response.readline()
    return conn, response


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


def test_each_turn_prefills_only_its_new_message(server):
    sdk = server.sdk()
    messages = [{"role": "system", "content": "You are terse."}]
    previous = None
    for turn in range(4):
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
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}), "n must be 1"),
])
def test_malformed_requests_are_400(server, payload, words):
    status, body = raw(server, "POST", "/v1/chat/completions", payload)
    assert status == 400 and words in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error"


def test_an_oversized_body_is_413_and_the_key_guards_all_but_health(server):
    status, body = raw(server, "POST", "/v1/chat/completions", b"x" * (LIMITS["max_body_bytes"] + 1))
    assert status == 413 and "larger than" in body["error"]["message"]
    status, body = raw(server, "GET", "/v1/models", key=None)
    assert status == 401
    status, body = raw(server, "GET", "/health", key=None)   # no key needed
    assert status == 200 and body["status"] == "ok"


# ---------------------------------------------------------------------------------- many clients
def test_a_client_that_disconnects_frees_its_blocks_and_a_full_queue_is_429(server):
    baseline = wait_idle(server).kv_blocks_used
    streams = [open_stream(server, LONG) for _ in range(LIMITS["max_queue"])]
    busy = server.aclient.client.stats(fresh=True)
    assert busy.kv_blocks_used > baseline and busy.running == LIMITS["max_queue"]
    with pytest.raises(openai.RateLimitError) as full:
        server.sdk().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert full.value.body["code"] == "queue_full"
    for conn, response in streams:   # the clients go away mid-reply
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    stats = wait_idle(server, baseline, within=5)
    assert stats.kv_blocks_used <= baseline
    assert server.app.state.api.in_flight == 0


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
                             "--host", "0.0.0.0", "--port", "0", "--max-model-len", "256"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        assert "serving" in first and str(tiny_models["llama"]) in first and "/v1" in first, first
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
    finally:
        proc.send_signal(signal.SIGINT)   # how a server is stopped: not an error
        assert proc.wait(30) == 0
    assert proc.stderr.read().strip().endswith("stopped")
