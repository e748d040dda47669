"""Fill in the middle (models/text/fim.py): a code model's prompt for the text between a prefix and a suffix, as
llama.cpp's server builds it, served as the suffix of /v1/completions and of Ollama's /api/generate."""

from __future__ import annotations

import json

import pytest

from nanochat.models.text.fim import FimTokens, infill_ids, stated_fim
from nanochat.models.text.tokenizer import load_tokenizer

from conftest import SPECIALS, make_hf_model

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|file_sep|>"]
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    """The tiny llama with Qwen2.5-Coder's FIM tokens among its special tokens."""
    return make_hf_model("llama", tmp_path_factory.mktemp("fim") / "llama", seed=7, specials=SPECIALS + FIM)


def test_the_prompt_is_prefix_suffix_middle_with_the_code_as_plain_text(fim_model, tiny_models):
    tok = load_tokenizer(fim_model)
    pre, suf, mid, pad, sep = (tok.token_to_id(t) for t in FIM)
    assert tok.fim == FimTokens(pre, suf, mid, (pad, sep))   # found by their spellings
    code = "x = '<|fim_middle|>'"   # a special token's spelling inside the code stays text
    ids = infill_ids(tok, code, SUFFIX, 200)
    plain = tok.encode(code, add_special_tokens=False, parse_special=False)
    assert ids == [pre, *plain, suf, *tok.encode(SUFFIX, add_special_tokens=False), mid] and mid not in plain
    assert tok.encode(code, add_special_tokens=False).count(mid) == 1   # elsewhere spellings are the tokens
    with pytest.raises(ValueError, match="no fill-in-the-middle tokens"):
        infill_ids(load_tokenizer(tiny_models["llama"]), PREFIX, SUFFIX, 200)


def test_long_text_keeps_the_prefix_tail_and_the_suffix_head(fim_model):
    tok = load_tokenizer(fim_model)
    before = tok.encode(PREFIX * 20, add_special_tokens=False)
    after = tok.encode(SUFFIX * 20, add_special_tokens=False)
    ids = infill_ids(tok, PREFIX * 20, SUFFIX * 20, 43)   # 40 tokens of text: the suffix gets a quarter
    assert len(ids) == 43 and ids[1:31] == before[-30:] and ids[32:42] == after[:10]
    short = infill_ids(tok, "x", SUFFIX * 20, 43)       # a short prefix leaves the rest to the suffix
    assert len(short) == 43 and short[3:42] == after[:39]
    with pytest.raises(ValueError, match="no room"):
        infill_ids(tok, PREFIX, SUFFIX, 3)


def test_a_ggufs_stated_fim_tokens_come_first():
    meta = {"tokenizer.ggml.fim_pre_token_id": 5, "tokenizer.ggml.fim_suf_token_id": 6,
            "tokenizer.ggml.fim_mid_token_id": 7, "tokenizer.ggml.fim_pad_token_id": 8}
    assert stated_fim(meta, 100) == FimTokens(5, 6, 7, (8,))
    assert stated_fim({**meta, "tokenizer.ggml.fim_mid_token_id": 100}, 100) is None   # out of the vocabulary
    assert stated_fim({}, 100) is None


pytest.importorskip("uvicorn")
pytest.importorskip("ollama")


@pytest.fixture(scope="module")
def fim_server(fim_model):
    from nanochat.engine.serve.client import EngineClient
    from test_serve import ENGINE, Server

    client = EngineClient()
    client.load_model(str(fim_model), **ENGINE)
    srv = Server(client)
    yield srv
    srv.stop()
    client.shutdown()


def test_a_completion_with_a_suffix_writes_the_middle(fim_model, fim_server):
    from test_serve import MODEL, raw

    tok = load_tokenizer(fim_model)
    ids = infill_ids(tok, PREFIX, SUFFIX, 200)
    sdk = fim_server.sdk()
    want = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    got = sdk.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
    assert got.choices[0].text == want.choices[0].text and got.usage.prompt_tokens == len(ids)
    # the FIM padding ends a middle, as llama.cpp counts it (a +100 bias makes it the first token)
    pad = str(tok.token_to_id("<|fim_pad|>"))
    ended = sdk.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0,
                                   logit_bias={pad: 100})
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1

    import ollama
    from test_serve import KEY

    client = ollama.Client(host=fim_server.url, headers={"Authorization": f"Bearer {KEY}"})
    middle = client.generate(model=MODEL, prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 8})
    assert middle.response == want.choices[0].text and middle.prompt_eval_count == len(ids)
    status, body = raw(fim_server, "POST", "/v1/completions", json.dumps({"prompt": [1, 2], "suffix": "x"}))
    assert status == 400 and "suffix needs a text prompt" in body["error"]["message"]
    status, body = raw(fim_server, "POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "suffix": "x"}))
    assert status == 400 and "suffix (fill in the middle) is for /v1/completions" in body["error"]["message"]


def test_a_model_without_fim_tokens_refuses_a_suffix(server):
    from test_serve import MODEL, raw

    status, body = raw(server, "POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "suffix": "y"}))
    assert status == 400 and "no fill-in-the-middle tokens" in body["error"]["message"]
    status, body = raw(server, "POST", "/api/generate", json.dumps({"model": MODEL, "prompt": "x", "suffix": "y"}))
    assert status == 400 and "no fill-in-the-middle tokens" in body["error"]


from test_serve import server   # noqa: E402,F401 (the fixture: the tiny llama, no FIM tokens)
