"""The models `nanochat serve` answers for (app/serve_models.py): the loaded one and the catalog's, loaded when a
request names one, after the requests in flight end; a failed load keeps the previous model."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from nanochat.app.serve_models import Roster, Served, catalog_models   # noqa: E402
from nanochat.models.formats.catalog import ModelEntry, describe_path   # noqa: E402

from test_serve import ENGINE, KEY, MODEL, Server, raw   # noqa: E402


def test_the_catalog_adds_each_model_once_by_its_file_or_folder_name():
    loaded = Served("tiny", "/m/tiny", ("/m/tiny",))
    entries = [ModelEntry("x", "/m/a.gguf", "gguf"), ModelEntry("y", "/other/a.gguf", "gguf"),
               ModelEntry("Qwen/Qwen3-0.6B", "/hub/snap", "hf", origin="hub"), ModelEntry("t", "/m/tiny", "hf")]
    assert [(m.id, m.path) for m in catalog_models(loaded, entries)] == \
        [("a.gguf", "/m/a.gguf"), ("Qwen/Qwen3-0.6B", "/hub/snap")]


def test_a_switch_waits_for_the_requests_holding_the_model_and_a_failed_load_keeps_it():
    async def scenario():
        a, b = Served("a", "/a"), Served("b", "/b", ("/b",))   # b as the catalog names it
        roster = Roster(a, discover=lambda: [ModelEntry("b", "/b", "gguf")])
        assert await roster.find("b:latest") == b and await roster.find(None) == a and await roster.find("c") is None
        loads, order = [], []

        async def load(path):
            loads.append(path)
            await asyncio.sleep(0.01)

        await roster.use(a, load)                       # a request on a, in flight
        switch = asyncio.ensure_future(roster.use(b, load))
        await asyncio.sleep(0.05)
        assert loads == [] and not switch.done()        # b waits for it
        late = asyncio.ensure_future(roster.use(a, load))   # a request for a after the switch began waits too
        await asyncio.sleep(0.01)
        order.append("a released")
        roster.release()
        await switch
        assert loads == ["/b"] and roster.loaded == b and roster.models == [b, a]
        roster.release()                                # the request on b is over
        await late                                      # ... and a loads again for the late one
        assert loads == ["/b", "/a"] and roster.loaded == a
        roster.release()

        async def broken(path):
            raise RuntimeError("no such file")

        with pytest.raises(RuntimeError):
            await roster.use(b, broken)
        assert roster.loaded == a and roster.holds == 0
        await roster.use(a, broken)                     # the loaded model needs no load
        roster.release()

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def two_models(tiny_models, tmp_path_factory):
    """A server started on the tiny llama whose catalog holds the tiny qwen3 and a broken GGUF."""
    from nanochat.engine.serve.client import EngineClient

    broken = tmp_path_factory.mktemp("broken") / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    client = EngineClient()
    client.load_model(str(tiny_models["llama"]), **ENGINE)
    others = [describe_path(tiny_models["qwen3"]), ModelEntry("broken", str(broken), "gguf")]
    srv = Server(client, model_path=str(tiny_models["llama"]), discover=lambda: others, engine_config=ENGINE)
    yield srv
    srv.stop()
    client.shutdown()


def test_a_request_naming_another_model_loads_it(two_models, tiny_models):
    srv, sdk = two_models, two_models.sdk()
    assert [(m.id, m.model_extra["loaded"]) for m in sdk.models.list().data] == \
        [(MODEL, True), ("qwen3", False), ("broken.gguf", False)]
    ask = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    first = sdk.chat.completions.create(model=MODEL, **ask).choices[0].message.content
    other = sdk.chat.completions.create(model="qwen3", **ask)
    assert other.model == "qwen3" and srv.aclient.model.arch == "qwen3"
    assert any(line == f"loading {tiny_models['qwen3']}" for line in srv.log)
    assert [m.id for m in sdk.models.list().data][0] == "qwen3"
    status, ps = raw(srv, "GET", "/api/ps")
    assert status == 200 and [m["name"] for m in ps["models"]] == ["qwen3"]
    again = sdk.chat.completions.create(model=MODEL, **ask)   # back to the first: the same reply as before
    assert again.choices[0].message.content == first and srv.aclient.model.arch == "llama"

    status, answer = raw(srv, "POST", "/v1/chat/completions", json.dumps({"model": "broken.gguf", **ask}))
    assert status == 500 and answer["error"]["message"].startswith("cannot load the model")
    assert sdk.chat.completions.create(model=MODEL, **ask).choices[0].message.content == first   # still loaded
    status, answer = raw(srv, "POST", "/v1/chat/completions", json.dumps({"model": "nope", **ask}))
    assert status == 404 and "and 2 more (GET /v1/models)" in answer["error"]["message"]


def test_a_reply_in_flight_ends_before_another_model_loads(two_models):
    sdk = two_models.sdk()
    streamed, switched = [], {}
    stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=200,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    streamed.append(next(iter(stream)))

    def other():
        switched["asked"] = time.monotonic()
        switched["reply"] = sdk.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=2, temperature=0)

    thread = threading.Thread(target=other)
    thread.start()
    for chunk in stream:
        streamed.append(chunk)
    ended = time.monotonic()
    thread.join(60)
    assert switched["asked"] < ended   # the other model was asked for while this reply streamed
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert streamed[-1].choices[0].finish_reason == "length" and text   # not cut by the switch
    assert switched["reply"].model == "qwen3" and switched["reply"].usage.completion_tokens == 2
    sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)


def test_tags_and_show_describe_every_model_and_ps_the_loaded_one(two_models):
    pytest.importorskip("ollama")
    import ollama

    srv = two_models
    client = ollama.Client(host=srv.url, headers={"Authorization": f"Bearer {KEY}"})
    srv.sdk().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert [m.model for m in client.list().models] == [MODEL, "qwen3", "broken.gguf"]
    assert [m.model for m in client.ps().models] == [MODEL]
    shown = client.show("qwen3")   # not loaded: its folder's facts; what its template can do is known once loaded
    assert shown.details.family == "qwen3" and shown.capabilities == ["completion"]
    assert "qwen3.context_length" not in shown.modelinfo
    assert client.show(MODEL).modelinfo["llama.context_length"] == srv.aclient.model.max_model_len
