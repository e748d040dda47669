"""Embeddings: a prompt's final hidden states pooled into one vector (engine/pooling.py), checked against
transformers' last_hidden_state, through the engine (batched, chunked, preempted, prefix-cached), the model files'
pooling (GGUF {arch}.pooling_type, a sentence-transformers folder's Pooling module, a post-processor's trailing
token), and `nanochat serve`'s /v1/embeddings (the openai SDK), /api/embed (the ollama SDK) and /api/embeddings."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from nanochat.engine import LLM
from nanochat.engine.pooling import PoolingParams

from conftest import gone

TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps",
         "Hello there! How are you today?",
         "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 2]
TOL = 2e-4   # fp16 KV cache against transformers' fp32 attention, on unit-length vectors


@pytest.fixture(scope="module")
def hf_base(tiny_models):
    """transformers' base model (no head) of the tiny qwen3: the oracle's last_hidden_state."""
    import transformers
    return transformers.AutoModel.from_pretrained(tiny_models["qwen3"], dtype=torch.float32).eval()


def reference(hf, ids: list[int], pooling: str, normalize: bool = True, dimensions: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0].double()
    v = {"mean": h.mean(0), "last": h[-1], "cls": h[0]}[pooling]
    if dimensions:
        v = v[:dimensions]
    return v / v.norm() if normalize else v


@pytest.fixture(scope="module")
def llm(tiny_models):
    # a small step budget: the longer inputs run in several chunks
    return LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=256, max_num_batched_tokens=16)


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_each_pooling_matches_transformers_over_chunked_batches(llm, hf_base, pooling):
    results = llm.embed(TEXTS, PoolingParams(pooling))
    for text, r in zip(TEXTS, results):
        ids = llm.tokenizer.encode(text)
        assert r.stats.prompt_tokens == len(ids)
        ref = reference(hf_base, ids, pooling)
        got = torch.tensor(r.embedding, dtype=torch.float64)
        assert got.shape == ref.shape and abs(float(got.norm()) - 1.0) < 1e-6
        assert float((got - ref).abs().max()) < TOL, pooling
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.stats().used == 0


def test_dimensions_and_unnormalized_vectors(llm, hf_base):
    ids = llm.tokenizer.encode(TEXTS[1])
    short = torch.tensor(llm.embed(ids, PoolingParams("mean", dimensions=10))[0].embedding, dtype=torch.float64)
    assert short.shape == (10,) and float((short - reference(hf_base, ids, "mean", dimensions=10)).abs().max()) < TOL
    raw = torch.tensor(llm.embed(ids, PoolingParams("last", normalize=False))[0].embedding, dtype=torch.float64)
    ref = reference(hf_base, ids, "last", normalize=False)
    assert float((raw - ref).abs().max()) < TOL * float(ref.norm())
    with pytest.raises(ValueError, match="dimensions is 65"):
        llm.embed(ids, PoolingParams("mean", dimensions=65))
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams("max")


def test_a_last_pooling_reuses_the_prefix_cache_and_mean_does_not(llm):
    text = TEXTS[2]
    first = llm.embed(text, PoolingParams("last"))[0]
    again = llm.embed(text, PoolingParams("last"))[0]
    assert again.stats.cached_tokens >= 16 and again.embedding == first.embedding
    mean = llm.embed(text, PoolingParams("mean"))[0]
    assert mean.stats.cached_tokens == 0


def test_embeddings_batch_with_generation_and_survive_preemption(tiny_models, hf_base):
    """A KV cache of a few blocks and a small step budget: a reply admitted first grows into the blocks a long
    input holds and preempts it; every embedding is still transformers', the reply the one it makes alone, and no
    block is left behind."""
    from nanochat.engine.sampling_params import SamplingParams

    small = LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=128, max_num_batched_tokens=4,
                kvcache_block_size=16, num_kvcache_blocks=7)
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    alone = small.generate(["Hello there!"], sp)[0].token_ids
    engine = small.engine
    gen = engine.add_request("Hello there!", sp)
    events = engine.step()
    order = [2, 0, 1]   # the long input first: it takes the free blocks while the reply is short
    embeds = [engine.add_embedding(TEXTS[i], PoolingParams("mean")) for i in order]
    done, tokens = {}, []
    while len(done) < 4:
        for ev in events + engine.step():
            if ev.request_id == gen and ev.token_id is not None:
                tokens.append(ev.token_id)
            if ev.finished:
                done[ev.request_id] = ev
        events = []
    assert engine.scheduler.num_preemptions > 0
    assert tokens == alone
    for rid, i in zip(embeds, order):
        ids = small.tokenizer.encode(TEXTS[i])
        got = torch.tensor(done[rid].embedding, dtype=torch.float64)
        assert float((got - reference(hf_base, ids, "mean")).abs().max()) < TOL
    engine.block_manager.check_invariants()
    assert engine.block_manager.stats().used == 0


def test_bad_inputs_are_one_line_errors_and_leave_nothing_behind(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="the context holds 256"):
        llm.embed([list(range(10))] + [[5] * 300])
    assert llm.embed([[5] * 300], truncate=True)[0].stats.prompt_tokens == 256
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed([[10 ** 6]])
    assert llm.engine.block_manager.stats().used == 0 and not llm.engine.requests


# ---------------------------------------------------------------------------------- the files' pooling
def _sentence_transformers(folder, mode: str) -> None:
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_lasttoken": mode == "last"}))


def test_an_embedding_folder_pools_and_ends_its_inputs_as_transformers_does(tiny_models, hf_base, tmp_path):
    """Qwen3-Embedding's shape: a sentence-transformers folder with last-token pooling, whose tokenizer.json
    post-processor ends every input with <|endoftext|> (its EOS being <|im_end|>)."""
    import transformers
    from tokenizers import Tokenizer, processors

    folder = tmp_path / "embedder"
    shutil.copytree(tiny_models["qwen3"], folder)
    _sentence_transformers(folder, "last")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    end = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1",
                                                       special_tokens=[("<|endoftext|>", end)])
    tok.save(str(folder / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(folder)

    embedder = LLM(str(folder), dtype="float32", max_model_len=256)
    assert embedder.engine.pooling == "last" and embedder.engine.embedding_model
    for text in TEXTS:
        ids = embedder.tokenizer.encode(text)
        assert ids == theirs(text)["input_ids"] and ids[-1] == end
        got = torch.tensor(embedder.embed(text)[0].embedding, dtype=torch.float64)
        assert float((got - reference(hf_base, ids, "last")).abs().max()) < TOL
    # a chat model's folder states no pooling: mean, as Ollama pools one
    assert LLM(str(tiny_models["qwen3"]), dtype="float32", max_model_len=64).engine.pooling == "mean"


def test_a_base_model_folder_loads_without_a_head(tiny_models, hf_base, tmp_path):
    """transformers' AutoModel saves a base model's tensors without the `model.` prefix and without lm_head (as
    embedding checkpoints are published): its embeddings are the base model's."""
    folder = tmp_path / "base"
    hf_base.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_models["qwen3"] / name, folder / name)
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" in f.keys() and not any(k.startswith(("model.", "lm_head")) for k in f.keys())
    base = LLM(str(folder), dtype="float32", max_model_len=128)
    ids = base.tokenizer.encode(TEXTS[0])
    got = torch.tensor(base.embed(ids, PoolingParams("last"))[0].embedding, dtype=torch.float64)
    assert float((got - reference(hf_base, ids, "last")).abs().max()) < TOL


def test_a_gguf_states_its_pooling(tiny_models, hf_base, tmp_path):
    import gguf
    from tests.gguf_writer import write_gguf_from_hf
    from tests.test_families import tokenizer_metadata

    path = write_gguf_from_hf(tiny_models["qwen3"], tmp_path / "embed.gguf", "qwen3", gguf.GGMLQuantizationType.F32,
                              tokenizer=tokenizer_metadata(tiny_models["qwen3"]), extra_metadata={"qwen3.pooling_type": 3, "tokenizer.ggml.add_eos_token": True})
    embedder = LLM(str(path), dtype="float32", max_model_len=128)
    assert embedder.engine.pooling == "last" and embedder.engine.embedding_model
    ids = embedder.tokenizer.encode(TEXTS[1])
    assert ids[-1] == embedder.tokenizer.eos_token_id   # llama.cpp ends the input with EOS where the file says so
    got = torch.tensor(embedder.embed(ids)[0].embedding, dtype=torch.float64)
    assert float((got - reference(hf_base, ids, "last")).abs().max()) < TOL


# ---------------------------------------------------------------------------------- nanochat serve
@pytest.fixture(scope="module")
def served(tiny_models):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from nanochat.engine.serve.client import EngineClient
    from test_serve import ENGINE, Server

    client = EngineClient()
    client.load_model(str(tiny_models["qwen3"]), **ENGINE)
    srv = Server(client)
    yield srv
    srv.stop()
    pid = client.pid
    client.shutdown()
    assert gone(pid)


def test_v1_embeddings_through_the_openai_sdk(served, hf_base, tiny_models):
    from nanochat.models.text.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tiny_models["qwen3"] / "tokenizer.json")
    sdk = served.sdk()
    got = sdk.embeddings.create(model="tiny", input=TEXTS)   # the SDK asks for base64 and decodes it
    assert [d.index for d in got.data] == [0, 1, 2]
    assert got.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    for text, d in zip(TEXTS, got.data):
        ref = reference(hf_base, tok.encode(text), "mean")
        assert float((torch.tensor(d.embedding, dtype=torch.float64) - ref).abs().max()) < TOL
    floats = sdk.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float", dimensions=8)
    assert len(floats.data[0].embedding) == 8
    assert float((torch.tensor(floats.data[0].embedding, dtype=torch.float64)
                  - reference(hf_base, tok.encode(TEXTS[0]), "mean", dimensions=8)).abs().max()) < TOL
    ids = tok.encode(TEXTS[1])
    by_ids = sdk.embeddings.create(model="tiny", input=[ids, ids[:3]], encoding_format="float")
    assert by_ids.usage.prompt_tokens == len(ids) + 3


def test_v1_embeddings_errors(served):
    from test_serve import raw, wait_idle

    def post(body):
        return raw(served, "POST", "/v1/embeddings", json.dumps({"model": "tiny", **body}))

    for body, words in [({}, "input is required"), ({"input": ""}, "empty"), ({"input": ["a", ""]}, "input[1] is empty"),
                        ({"input": [1.5]}, "input must be"), ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
                        ({"input": "a", "dimensions": 0}, "dimensions must be"),
                        ({"input": "a", "dimensions": 65}, "have 64 values"),
                        ({"input": ["a"] * 2049}, "at most 2048"),
                        ({"input": [[7] * 300]}, "the context holds 256")]:
        status, answer = post(body)
        assert status == 400 and words in answer["error"]["message"], (body, answer)
    status, answer = post({"input": "a", "model": "nope"})
    assert status == 404
    assert wait_idle(served).kv_blocks_used == 0


def test_ollama_embed_and_embeddings(served, hf_base, tiny_models):
    ollama = pytest.importorskip("ollama")
    from nanochat.models.text.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tiny_models["qwen3"] / "tokenizer.json")
    client = ollama.Client(host=served.url, headers={"Authorization": "Bearer test-key"})
    got = client.embed(model="tiny", input=TEXTS[:2])
    assert got.model == "tiny" and got.prompt_eval_count == sum(len(tok.encode(t)) for t in TEXTS[:2])
    for text, vector in zip(TEXTS, got.embeddings):
        ref = reference(hf_base, tok.encode(text), "mean")
        assert float((torch.tensor(vector, dtype=torch.float64) - ref).abs().max()) < TOL
    # truncate (Ollama's default): a text longer than the context keeps its first tokens
    long = "The quick brown fox jumps over the lazy dog. " * 60
    assert client.embed(model="tiny", input=long).prompt_eval_count == 256
    with pytest.raises(ollama.ResponseError, match="the context holds 256"):
        client.embed(model="tiny", input=long, truncate=False)
    legacy = client.embeddings(model="tiny", prompt=TEXTS[0])   # not normalized
    ref = reference(hf_base, tok.encode(TEXTS[0]), "mean", normalize=False)
    vector = torch.tensor(legacy.embedding, dtype=torch.float64)
    assert float((vector - ref).abs().max()) < TOL * float(ref.norm()) and abs(float(vector.norm()) - 1) > 1e-3
    assert "embedding" not in client.show("tiny").capabilities
    # no input: Ollama's load request
    from test_serve import raw
    assert raw(served, "POST", "/api/embed", json.dumps({"model": "tiny"})) == (200, {"model": "tiny", "embeddings": []})
    assert raw(served, "POST", "/api/embeddings", json.dumps({"model": "tiny"})) == (200, {"embedding": []})
