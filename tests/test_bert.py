"""BERT encoders (models/families/bert.py): a tiny random BertModel made with transformers at test time, loaded from
its folder and from GGUF files laid out as llama.cpp's converter writes them (phantom-space WordPiece vocabulary,
its tensor names), checked against transformers' last_hidden_state; the WordPiece tokenizer of a GGUF against the
folder's; the engine's whole-input steps, refusals, and `nanochat serve`'s /v1/embeddings."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from nanochat.engine import LLM
from nanochat.engine.output import RequestError
from nanochat.engine.pooling import PoolingParams
from nanochat.engine.sampling_params import SamplingParams
from nanochat.models.errors import ModelLoadError

from conftest import make_bert_folder

T = gguf.GGMLQuantizationType
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXTS = ["Hello world!", "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
         "Naïve CAFÉ résumé, 数字 🙂 and [CLS] in the text", "  tabs\tnew\nlines  42 3.14 don't-stop (x) {y}"]
CONTEXT = 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A 2-layer BertModel (hidden 64) with a WordPiece vocabulary trained on a small corpus."""
    return make_bert_folder(tmp_path_factory.mktemp("bert"), context=CONTEXT)


@pytest.fixture(scope="module")
def nomic(tmp_path_factory):
    """A 2-layer NomicBertModel (hidden 64) laid out as nomic-embed-text is published."""
    return make_bert_folder(tmp_path_factory.mktemp("nomic"), nomic=True)


@pytest.fixture(scope="module")
def hf(folder):
    import transformers
    return transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok(folder):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(folder)


NAMES = {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
         "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm",
         "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
         "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
         "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
         # Nomic BERT
         "emb_ln": "token_embd_norm", "attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output",
         "norm1": "attn_output_norm", "mlp.fc11": "ffn_up", "mlp.fc12": "ffn_gate", "mlp.fc2": "ffn_down",
         "norm2": "layer_output_norm"}


def write_bert_gguf(folder, path, qtype=T.F32, dequantized: dict | None = None, lowercase: bool | None = True):
    """The folder as llama.cpp's convert_hf_to_gguf.py writes a BertModel or NomicBertModel: phantom-space vocabulary
    ("▁word", continuations without "##", control tokens as they are), its tensor names, 2-D weights in `qtype`
    (norms, biases and the position and token-type tables F32). `dequantized`: filled with each matrix as the file
    holds it. lowercase: tokenizer.ggml.normalizer.lowercase (None: not written, as older converters did)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    nomic = cfg["model_type"] == "nomic_bert"
    arch = "nomic-bert" if nomic else "bert"
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t in SPECIALS else 1 for t in tokens]
    phantom = [t if k == 3 else t[2:] if t.startswith("##") else "\u2581" + t for t, k in zip(tokens, types)]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-" + arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    if nomic:
        w.add_rope_freq_base(cfg["rotary_emb_base"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_file_type(int(qtype) if qtype in (T.F32, T.F16) else 7)
    w.add_token_type_count(cfg["type_vocab_size"])
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(phantom)
    w.add_token_types(types)
    for key, tok in (("bos", "[CLS]"), ("eos", "[SEP]"), ("unk", "[UNK]"), ("sep", "[SEP]"), ("pad", "[PAD]"),
                     ("mask", "[MASK]")):
        getattr(w, f"add_{key}_token_id" if key != "sep" else "add_sep_token_id")(vocab[tok])
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(False)
    if lowercase is not None:
        w.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)
    names = NAMES
    for name, x in load_file(folder / "model.safetensors").items():
        if name.startswith("pooler."):
            continue
        module, kind = name.rsplit(".", 1)
        layer = None
        if module.startswith(("encoder.layer.", "encoder.layers.")):
            _, _, layer, module = module.split(".", 3)
        gname = (f"blk.{layer}." if layer is not None else "") + names[module] + f".{kind}"
        x = x.float().numpy()
        if x.ndim == 1 or names[module] in ("position_embd", "token_types"):
            w.add_tensor(gname, np.ascontiguousarray(x, dtype=np.float32))
            continue
        data = gguf.quants.quantize(np.ascontiguousarray(x), qtype)
        if dequantized is not None:
            dequantized[name] = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(x.shape).copy())
        w.add_tensor(gname, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference(hf, ids: list[int], pooling: str, normalize: bool = False) -> torch.Tensor:
    with torch.no_grad():
        h = hf(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
    v = h.mean(0) if pooling == "mean" else h[0]
    return v / v.norm() if normalize else v


def _check(llm, hf, hf_tok, tol: float, pooling: str = "mean") -> None:
    results = llm.embed(TEXTS, PoolingParams(pooling, normalize=False))
    for text, r in zip(TEXTS, results):
        ids = hf_tok(text).input_ids
        assert llm.tokenizer.encode(text) == ids, text
        assert r.stats.prompt_tokens == len(ids)
        got = torch.tensor(r.embedding, dtype=torch.float64)
        assert float((got - reference(hf, ids, pooling)).abs().max()) < tol, (text, pooling)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_folder_embeds_as_transformers_does(folder, hf, hf_tok, pooling):
    llm = LLM(str(folder))
    _check(llm, hf, hf_tok, 1e-5, pooling)
    assert llm.engine.block_manager.stats().used == 0


def test_pooling_option_overrides_the_models_own(folder, hf, hf_tok):
    """--pooling (Config.pooling) is what a request naming no pooling gets, and what the served model states; auto
    keeps the files' own (a BERT folder states none: mean); a bad value is a one-line usage error."""
    import subprocess
    import sys

    from nanochat.engine.serve.client import EngineClient

    llm = LLM(str(folder), pooling="cls")
    text = TEXTS[0]
    got = torch.tensor(llm.embed([text])[0].embedding, dtype=torch.float64)
    want = reference(hf, hf_tok(text).input_ids, "cls", normalize=True)
    assert float((got - want).abs().max()) < 1e-5
    assert dict(llm.engine.describe().lines())["embeddings"] == "cls pooling (--pooling; the model's files state none)"
    assert LLM(str(folder), pooling="auto").engine.pooling == "mean"
    client = EngineClient()
    try:   # what /v1/embeddings and /api/embed pool with when serving
        assert client.load_model(str(folder), pooling="cls").pooling == "cls"
    finally:
        client.shutdown()
    with pytest.raises(ValueError, match="pooling must be auto, mean, cls or last, got 'max'"):
        LLM(str(folder), pooling="max")
    r = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "serve", "--model", str(folder), "--pooling", "max"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--pooling: invalid choice: 'max'" in r.stderr and "Traceback" not in r.stderr


def test_a_gguf_embeds_and_tokenizes_as_the_folder_does(folder, hf, hf_tok, tmp_path):
    path = write_bert_gguf(folder, tmp_path / "bert-f32.gguf")
    llm = LLM(str(path))
    _check(llm, hf, hf_tok, 1e-5)
    _check(llm, hf, hf_tok, 1e-5, "cls")
    # the words the vocabulary cannot cover are one [UNK] each, as llama.cpp and transformers have them
    for text in ["Ünïcödé ÀÉÎ straße", "مرحبا ﬁ ½ Ⅻ", "a-b_c.d,e;f:g!h?i(j)k[l]m{n}o<p>q|r~s^t`u$v+w=x",
                 "\u00a0nbsp\u2003em ctrl\x07char", ""]:
        assert llm.tokenizer.encode(text) == hf_tok(text).input_ids, text
    # llama.cpp has no longest-word limit (transformers makes a word over 100 characters one [UNK])
    long = llm.tokenizer.encode("x" * 150)
    assert len(long) > 3 and hf_tok.unk_token_id not in long
    assert llm.tokenizer.decode(llm.tokenizer.encode("the quick brown fox"), skip_special_tokens=True) == \
        "the quick brown fox"


def test_a_cased_gguf_vocabulary_keeps_case_and_accents(folder, tmp_path):
    """Without tokenizer.ggml.normalizer.lowercase (older files, cased models) llama.cpp neither lowercases nor strips
    accents: a word the lowercase vocabulary spells only in lower case is then [UNK]."""
    from nanochat.models.text.tokenizer import Tokenizer

    lower = Tokenizer.from_gguf(write_bert_gguf(folder, tmp_path / "lower.gguf"))
    cased = Tokenizer.from_gguf(write_bert_gguf(folder, tmp_path / "cased.gguf", lowercase=None))
    unk = lower.token_to_id("[UNK]")
    assert cased.encode("hello world") == lower.encode("Hello World") == lower.encode("hello world")
    assert cased.encode("Hello World")[1:-1] == [unk, unk]
    assert unk not in lower.encode("café") and cased.encode("café") != lower.encode("café")


def test_a_q8_0_gguf_is_the_reference_on_its_own_weights(folder, hf, hf_tok, tmp_path):
    """Q8_0 matrices against transformers running the same (dequantized) matrices: the kernels' error alone."""
    import transformers

    dequantized: dict[str, torch.Tensor] = {}
    path = write_bert_gguf(folder, tmp_path / "bert-q8.gguf", T.Q8_0, dequantized)
    ref = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    state = ref.state_dict()
    for name, x in dequantized.items():
        state[name].copy_(x)
    _check(LLM(str(path)), ref, hf_tok, 2e-4)
    # and close to the unquantized model
    got = LLM(str(path)).embed(TEXTS[1])[0].embedding
    assert float(torch.nn.functional.cosine_similarity(
        torch.tensor(got, dtype=torch.float64), reference(hf, hf_tok(TEXTS[1]).input_ids, "mean"), dim=0)) > 0.999


@pytest.mark.parametrize("kind", ["folder", "gguf", "q8_0"])
def test_nomic_bert_embeds_as_transformers_does(nomic, kind, tmp_path):
    """Nomic BERT (RoPE, SwiGLU, fused qkv, no biases) from nomic-ai's layout and from GGUF, against transformers'
    NomicBertModel reading the same folder (Q8_0: on the file's own dequantized matrices)."""
    import transformers

    ref = transformers.AutoModel.from_pretrained(nomic, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(nomic)
    path, tol = nomic, 1e-5
    if kind != "folder":
        dequantized: dict[str, torch.Tensor] = {}
        path = write_bert_gguf(nomic, tmp_path / f"nomic-{kind}.gguf", T.Q8_0 if kind == "q8_0" else T.F32,
                               dequantized)
        if kind == "q8_0":
            # transformers' module names for what the file holds (its loader renames nomic-ai's the same way)
            state, tol = ref.state_dict(), 2e-4
            for i in range(2):
                q, k, v = dequantized.pop(f"encoder.layers.{i}.attn.Wqkv.weight").chunk(3)
                state[f"layers.{i}.self_attn.q_proj.weight"].copy_(q)
                state[f"layers.{i}.self_attn.k_proj.weight"].copy_(k)
                state[f"layers.{i}.self_attn.v_proj.weight"].copy_(v)
                for theirs, ours in (("attn.out_proj", "self_attn.o_proj"), ("mlp.fc11", "mlp.up_proj"),
                                     ("mlp.fc12", "mlp.gate_proj"), ("mlp.fc2", "mlp.down_proj")):
                    state[f"layers.{i}.{ours}.weight"].copy_(dequantized.pop(f"encoder.layers.{i}.{theirs}.weight"))
            state["embeddings.word_embeddings.weight"].copy_(dequantized.pop("embeddings.word_embeddings.weight"))
            assert not dequantized
    llm = LLM(str(path))
    assert llm.engine.model_config.max_position_embeddings == 2048   # 8192 stated, 2048 trained
    _check(llm, ref, tok, tol)
    _check(llm, ref, tok, tol, "cls")


def test_inputs_run_whole_in_steps_of_their_own_and_batch_exactly(folder, hf, hf_tok):
    """A step budget smaller than the batch: every input still runs in one chunk (an encoder's positions read what
    follows them), in as many steps as needed; batched vectors equal one-by-one ones."""
    llm = LLM(str(folder), max_num_batched_tokens=32)
    assert llm.engine.embedding_limit == 32
    texts = [t for t in TEXTS if len(hf_tok(t).input_ids) <= 32] * 3
    together = llm.embed(texts)
    alone = [llm.embed(t)[0] for t in texts]
    assert [r.embedding for r in together] == [r.embedding for r in alone]
    for text, r in zip(texts, together):
        ref = reference(hf, hf_tok(text).input_ids, "mean", normalize=True)
        assert float((torch.tensor(r.embedding, dtype=torch.float64) - ref).abs().max()) < 1e-5
    long = "the quick brown fox " * 20
    with pytest.raises(RequestError, match="the context holds 32 .max_num_batched_tokens."):
        llm.embed(long)
    cut = llm.engine
    rid = cut.add_embedding(long, truncate=True)
    events = []
    while cut.has_unfinished():
        events += cut.step()
    assert [e.finished for e in events if e.request_id == rid] == [True]
    assert events[-1].stats.prompt_tokens == 32
    assert cut.block_manager.stats().used == 0


def test_an_encoder_writes_no_text_and_says_so(folder):
    llm = LLM(str(folder))
    with pytest.raises(RequestError, match="is an embedding model: it writes no text"):
        llm.engine.add_request("hello", SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    lines = dict(llm.engine.describe().lines())
    assert lines["lm_head"] == "none (embeddings only)"
    assert lines["attention"].startswith("both ways")
    assert lines["KV cache"].startswith("none")
    assert llm.engine.embedding_model and llm.engine.pooling == "mean"
    with pytest.raises(ValueError, match="without tensor parallelism"):
        LLM(str(folder), tensor_parallel_size=2)


def test_front_ends_say_an_encoder_writes_no_text(folder, tmp_path):
    """The client's ModelInfo says so; the TUI's gauges label the model "embeddings only" before any message is sent;
    the REPL stops at once with the one-line reason (exit 1) instead of refusing every message."""
    import os
    import subprocess
    import sys
    from types import SimpleNamespace

    from nanochat.app.controller import EngineState
    from nanochat.app.tui.app import engine_labels
    from nanochat.engine.serve.client import EngineClient
    from nanochat.engine.serve.protocol import ModelInfo

    client = EngineClient()
    try:
        info = client.load_model(str(folder))
    finally:
        client.shutdown()
    assert not info.writes_text and info.embedding_model
    chat = ModelInfo(model="chat", arch="qwen3", device="cpu", dtype="float32", max_model_len=64, load_seconds=0.0)
    labels = {i.arch: engine_labels(SimpleNamespace(engine_state=EngineState.READY, model=i))[1] for i in (info, chat)}
    assert labels == {"bert": "bert · cpu · float32 · embeddings only", "qwen3": "qwen3 · cpu · float32"}
    r = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "repl", "--model", str(folder)], input="hello\n",
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, NANOCHAT_HOME=str(tmp_path / "home")))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith("is an embedding model: it writes no text (ask it for embeddings: "
                                                       "LLM.embed, or /v1/embeddings of `nanochat serve`)")
    assert "user: hello" not in r.stdout


def test_embed_command_prints_the_engines_vectors(folder, tmp_path):
    """`nanochat embed`: a JSON line per text (arguments, else stdin's non-blank lines) with the vector LLM.embed
    gives; --dimensions / --no-normalize / --truncate as the API's; a refused input is one line, exit 1, no vectors."""
    import os
    import subprocess
    import sys

    def embed(*args, stdin=None):
        r = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "embed", "--model", str(folder), "-q", *args],
                           input=stdin, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, NANOCHAT_HOME=str(tmp_path / "home")))
        assert "Traceback" not in r.stderr
        return r.returncode, [json.loads(line) for line in r.stdout.splitlines()], r.stderr

    llm = LLM(str(folder))
    texts = TEXTS[:3]
    rc, rows, _ = embed(*texts)
    want = llm.embed(texts)
    assert rc == 0 and [r["index"] for r in rows] == [0, 1, 2]
    assert [r["embedding"] for r in rows] == [w.embedding for w in want]
    assert [r["tokens"] for r in rows] == [w.stats.prompt_tokens for w in want]
    rc, rows, _ = embed("--dimensions", "8", "--no-normalize", stdin=f"{texts[0]}\n\n  \n{texts[1]}\n")
    raw = llm.embed(texts[:2], PoolingParams("mean", normalize=False, dimensions=8))
    assert rc == 0 and [r["embedding"] for r in rows] == [w.embedding for w in raw]
    long = " ".join(["word"] * (2 * CONTEXT))
    rc, rows, err = embed(texts[0], long)
    assert rc == 1 and rows == [] and err.startswith("nanochat embed: error: input 2: ") and len(err.splitlines()) == 1
    rc, rows, _ = embed(long, "--truncate")
    assert rc == 0 and rows[0]["tokens"] == CONTEXT
    rc, rows, err = embed(stdin="\n \n")
    assert rc == 2 and rows == [] and "nothing to embed" in err


def test_bad_encoder_files_are_one_line_errors(folder, tmp_path):
    import shutil

    relative = tmp_path / "relative"
    shutil.copytree(folder, relative)
    cfg = json.loads((relative / "config.json").read_text())
    (relative / "config.json").write_text(json.dumps({**cfg, "position_embedding_type": "relative_key"}))
    with pytest.raises(ModelLoadError, match="position_embedding_type 'relative_key' is not supported"):
        LLM(str(relative))
    path = write_bert_gguf(folder, tmp_path / "bert.gguf")
    reader = gguf.GGUFReader(str(path))
    broken = tmp_path / "no-norm.gguf"
    w = gguf.GGUFWriter(str(broken), "bert")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        w.add_key_value(field.name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                        else None)
    for t in reader.tensors:
        if t.name != "blk.1.layer_output_norm.bias":
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                         raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"tensor blk\.1\.layer_output_norm\.bias is missing"):
        LLM(str(broken))


def test_served_embeddings_and_refused_chat(folder, hf, hf_tok):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from nanochat.engine.serve.client import EngineClient
    from test_serve import ENGINE, Server, raw

    from conftest import gone

    client = EngineClient()
    client.load_model(str(folder), **ENGINE)
    srv = Server(client)
    try:
        got = srv.sdk().embeddings.create(model="tiny", input=TEXTS[:2])
        assert got.usage.prompt_tokens == sum(len(hf_tok(t).input_ids) for t in TEXTS[:2])
        for text, d in zip(TEXTS, got.data):
            ref = reference(hf, hf_tok(text).input_ids, "mean", normalize=True)
            assert float((torch.tensor(d.embedding, dtype=torch.float64) - ref).abs().max()) < 1e-5
        status, answer = raw(srv, "POST", "/v1/chat/completions",
                             json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}))
        assert status == 400 and "embedding model" in answer["error"]["message"]
        status, shown = raw(srv, "POST", "/api/show", json.dumps({"model": "tiny"}))
        assert status == 200 and shown["capabilities"] == ["embedding"]
    finally:
        srv.stop()
        pid = client.pid
        client.shutdown()
        assert gone(pid)
