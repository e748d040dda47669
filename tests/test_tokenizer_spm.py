"""SentencePiece ('llama') GGUF vocabularies against SentencePiece itself and a port of llama.cpp's
tokenizer, on a model trained here (byte fallback, user-defined symbols) and written as llama.cpp's
converter writes it. llama.cpp's own ids: benchmarks/tokenizer_parity.py."""

from __future__ import annotations

import heapq
import random
import re

import gguf
import pytest

from conftest import make_hf_model
from gguf_writer import (MetaValue, sentencepiece_tokenizer_metadata, train_sentencepiece, write_gguf_from_hf,
                         write_vocab_gguf)
from nanochat.models.text.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

pytest.importorskip("sentencepiece")

TRAIN = ("The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.\n"
         "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # three\n"
         "Hello there! How are you today? I am fine, thank you. 12345 67890 3.14159\n"
         "caf\u00e9 na\u00efve \u00fcber \u4f60\u597d \u4e16\u754c \U0001f600 tab\tseparated\n").splitlines() * 20
USER_DEFINED = ("<sep>", "<tool>")
CORPUS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", " leading space", "   three leading",
    "trailing   ", "multiple   spaces  here", "tabs\tand\t\ttabs", "new\nlines\n\n\nand\r\nCRLF",
    "digits 0123456789 and 3.14159", "emoji \U0001f600\U0001f44d\U0001f3fd \U0001f1eb\U0001f1f7",
    "CJK \u4f60\u597d\u4e16\u754c \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4",
    "unseen \u2603 \u00df \u03a9 \u2211 characters",
    "\x00\x01 control bytes", "", " ", "\n", "caf\u00e9 na\u00efve \u00fcber", "def f(x):\n    return x  # ok\n",
    "<s>starts with BOS", "a<sep>b", "x <tool> y<sep>", "</s> eos inside</s>", "<unk> unknown", "<s><s>",
    "<sep> <sep>  <sep>", "\u2581 a literal lower block",
]
SPECIALS = ("<unk>", "<s>", "</s>") + USER_DEFINED


@pytest.fixture(scope="module")
def sp():
    return train_sentencepiece(TRAIN, 400, USER_DEFINED)


@pytest.fixture(scope="module")
def sp_no_prefix():
    """Gemma-style: no dummy prefix (the GGUF says add_space_prefix false)."""
    return train_sentencepiece(TRAIN, 400, USER_DEFINED, add_dummy_prefix=False)


@pytest.fixture(scope="module")
def tok(sp, tmp_path_factory):
    path = write_vocab_gguf(tmp_path_factory.mktemp("spm") / "vocab.gguf",
                            sentencepiece_tokenizer_metadata(sp, USER_DEFINED))
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def tok_no_prefix(sp_no_prefix):
    return Tokenizer.from_gguf(plain_meta(sp_no_prefix, add_space_prefix=False))


def plain_meta(sp, **flags) -> dict:
    """The GGUF metadata of `sp` as from_gguf takes it from a dict (no file)."""
    return {k: v.value for k, v in sentencepiece_tokenizer_metadata(sp, USER_DEFINED, **flags).items()}


def expected_ids(sp, text: str) -> list[int]:
    """llama.cpp's ids from SentencePiece: special and user-defined tokens are cut out of the text first,
    and each piece of text between them is encoded on its own (so each gets the dummy prefix)."""
    out = []
    for part in re.split("(" + "|".join(map(re.escape, SPECIALS)) + ")", text):
        if part in SPECIALS:
            out.append(sp.piece_to_id(part))
        elif part:
            out += sp.encode(part)
    return out


def test_ids_equal_sentencepiece(sp, tok):
    for text in CORPUS:
        ids = expected_ids(sp, text)
        assert tok.encode(text, add_special_tokens=False) == ids, text
        assert tok.encode(text) == [1] + ids  # llama files add BOS by default
    assert tok.add_bos and (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    # The corpus does reach byte fallback, multi-space pieces and the user-defined symbols.
    ids = tok.encode("".join(CORPUS))
    assert tok.token_to_id("<0xE2>") in ids and tok.token_to_id("<sep>") in ids
    assert any(t.startswith("\u2581\u2581") for t in map(tok.id_to_token, ids))


def test_ids_equal_sentencepiece_without_space_prefix(sp_no_prefix, tok_no_prefix):
    for text in CORPUS:
        assert tok_no_prefix.encode(text, add_special_tokens=False) == expected_ids(sp_no_prefix, text), text
    ids = tok_no_prefix.encode(" two  spaces")
    assert tok_no_prefix.decode(ids, skip_special_tokens=True) == " two  spaces"   # no prefix, nothing stripped


def test_text_after_a_special_token_gets_the_space_prefix(tok):
    # llama.cpp prefixes every piece of text that follows a special token, not only the first.
    pieces = [tok.id_to_token(i) for i in tok.encode("a<sep>b</s>c", add_special_tokens=False)]
    assert pieces == ["\u2581a", "<sep>", "\u2581b", "</s>", "\u2581c"]
    assert tok.special_ids == {tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>")}  # not <sep>


def test_decode(sp, tok):
    for text in CORPUS:
        ids = tok.encode(text)
        if "<unk>" not in text:   # SentencePiece writes <unk> as " \u2047 "
            assert tok.decode(ids, skip_special_tokens=True) == sp.decode(ids), text
        if not any(s in text for s in SPECIALS + ("\u2581",)):
            assert tok.decode(ids, skip_special_tokens=True) == text
            assert tok.decode(ids[1:]) == text
    ids = tok.encode("a<sep>b</s>")
    assert tok.decode(ids) == "<s> a<sep> b</s>"   # control text kept unless skipped; the strip is at the start
    assert tok.decode(ids, skip_special_tokens=True) == "a<sep> b"
    assert tok.decode([tok.token_to_id("<0xC3>"), tok.token_to_id("<0xA9>")]) == "\u00e9"
    assert tok.decode([tok.token_to_id("<0xC3>")]) == "\ufffd"


def _stream(detok, ids):
    deltas = [detok.add(i) for i in ids]
    return deltas, "".join(deltas) + detok.flush()


@pytest.mark.parametrize("skip", [False, True])
def test_streaming_equals_decode(tok, skip):
    for text in CORPUS:
        ids = tok.encode(text)
        deltas, joined = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
        assert joined == tok.decode(ids, skip_special_tokens=skip), text
        assert all("\ufffd" not in d for d in deltas)
    # An emoji outside the vocabulary is four byte tokens: held back until its last byte.
    ids = tok.encode("ok \U0001f680 done", add_special_tokens=False)
    at = ids.index(tok.token_to_id("<0xF0>"))
    deltas, _ = _stream(IncrementalDetokenizer(tok), ids)
    assert deltas[at:at + 4] == ["", "", "", "\U0001f680"]


def test_streaming_random_ids_equals_decode(tok):
    """Any id stream (spaces, bytes that do not form characters, special tokens anywhere): the deltas add up
    to decode(ids), less one U+FFFD for a character cut at the end."""
    rng = random.Random(0)
    pool = list(range(tok.vocab_size))
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            _, joined = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
            full = tok.decode(ids, skip_special_tokens=skip)
            assert joined in (full, full[:-1]) and (joined == full or full.endswith("\ufffd")), ids


def test_streaming_after_a_prompt_keeps_the_space(tok):
    """With prompt context the reply's first space separates it from the prompt, so it is kept (decode
    alone drops it); the deltas are what the reply adds to the decoded prompt."""
    prompt, reply = tok.encode("How are you?"), tok.encode("I am fine \U0001f680", add_special_tokens=False)
    _, joined = _stream(IncrementalDetokenizer(tok, prompt_ids=prompt), reply)
    assert joined == " I am fine \U0001f680" and tok.decode(reply) == joined[1:]
    assert tok.decode(prompt + reply, skip_special_tokens=True) == "How are you?" + joined


def test_flags_and_defaults(sp):
    meta = plain_meta(sp)
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id"):
        del meta[f"tokenizer.ggml.{key}"]
    tok = Tokenizer.from_gguf(meta)   # llama.cpp's defaults: unk 0, bos 1, eos 2, add BOS, no EOS
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos, tok.add_eos) == (1, 2, True, False)
    meta.update({"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True,
                 "tokenizer.ggml.eos_token_id": 10 ** 6})   # out of range: the default
    tok = Tokenizer.from_gguf(meta)
    assert tok.encode("hi") == sp.encode("hi") + [2]
    assert tok.tokenizer_config()["add_eos_token"] is True


def test_phi3_special_tokens_swallow_the_whitespace_after_them(sp):
    meta = plain_meta(sp)
    text = "<sep>\n hi</s>\nthere<s> x"
    plain = Tokenizer.from_gguf(meta).encode(text, add_special_tokens=False)
    assert plain == expected_ids(sp, text)
    phi3 = Tokenizer.from_gguf({**meta, "general.name": "Phi-3 mini"}).encode(text, add_special_tokens=False)
    assert phi3 == expected_ids(sp, "<sep>hi</s>there<s> x")   # all but <s> and <unk> (llama.cpp's rule)


# ----------------------------------------------------------------- merges against llama.cpp's algorithm


def llama_cpp_spm(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's llm_tokenizer_spm_session.tokenize, ported: merge the adjacent pair whose concatenation
    is the best-scoring entry (leftmost on ties) until none is left; then bytes for what is not an entry."""
    sym = [[c, i - 1, i + 1] for i, c in enumerate(text)]   # text, prev, next
    if sym:
        sym[-1][2] = -1
    queue = []

    def push(left, right):
        if left >= 0 and right >= 0 and (t := sym[left][0] + sym[right][0]) in vocab:
            heapq.heappush(queue, (-scores[vocab[t]], left, right, len(t)))

    for i in range(1, len(sym)):
        push(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        a, b = sym[left], sym[right]
        if not a[0] or not b[0] or len(a[0]) + len(b[0]) != size:
            continue   # stale: one side was merged since
        a[0], b[0], a[2] = a[0] + b[0], "", b[2]
        if b[2] >= 0:
            sym[b[2]][1] = left
        push(a[1], left)
        push(left, a[2])
    out, i = [], 0 if sym else -1
    while i >= 0:
        t = sym[i][0]
        out += [vocab[t]] if t in vocab else [vocab[f"<0x{b:02X}>"] for b in t.encode()]
        i = sym[i][2]
    return out


def _random_vocab(rng, letters, n, distinct):
    tokens = [f"<0x{b:02X}>" for b in range(256)] + list(letters)
    while len(tokens) < 256 + len(letters) + n:
        t = rng.choice(tokens[256:]) + rng.choice(tokens[256:])
        if t not in tokens:
            tokens.append(t)
    # scores unrelated to the order the entries were made in (not monotone along merges)
    scores = [0.0] * 256 + [-1000.0] * len(letters) + [
        float(-rng.randrange(10 ** 6 if distinct else 3)) for _ in range(n)]
    types = [6] * 256 + [1] * (len(tokens) - 256)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.add_space_prefix": False}


def test_merges_reproduce_llama_cpp_on_distinct_scores():
    rng = random.Random(1)
    for _ in range(20):
        meta = _random_vocab(rng, "ab\u2581c", 40, distinct=True)
        tok = Tokenizer.from_gguf(meta)
        vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
        for _ in range(50):
            text = "".join(rng.choice("ab cd") for _ in range(rng.randint(1, 16)))
            expected = llama_cpp_spm(text.replace(" ", "\u2581"), vocab, meta["tokenizer.ggml.scores"])
            assert tok.encode(text, add_special_tokens=False) == expected, text


def test_equal_scores_grow_runs_from_the_left_like_llama_cpp():
    """Runs of one character whose entries share a score (e.g. whitespace tokens): llama.cpp grows the
    leftmost symbol first, and ranking the longer left part first does the same."""
    tokens = [f"<0x{b:02X}>" for b in range(256)] + ["\u2581" * k for k in range(1, 5)] + ["x"]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 256 + [-1.0] * 4 + [-2.0],
            "tokenizer.ggml.token_type": [6] * 256 + [1] * 5, "tokenizer.ggml.add_space_prefix": False}
    tok = Tokenizer.from_gguf(meta)
    vocab = {t: i for i, t in enumerate(tokens)}
    for n in range(1, 12):
        text = " " * n + "x"
        assert tok.encode(text, add_special_tokens=False) == llama_cpp_spm(
            text.replace(" ", "\u2581"), vocab, meta["tokenizer.ggml.scores"]), n


# ------------------------------------------------------------------------------------------ merges cache


@pytest.fixture
def merges_cache(tmp_path, monkeypatch):
    """The cache folder, empty, under tmp_path; and a count of the merges actually built."""
    from nanochat.models.formats import pack_cache
    from nanochat.models.text import tokenizer_spm

    monkeypatch.setattr(pack_cache, "cache_dir", lambda: tmp_path / "cache")
    built = []
    build = tokenizer_spm._merges
    monkeypatch.setattr(tokenizer_spm, "_merges", lambda *a: built.append(1) or build(*a))
    return tmp_path / "cache", built


def test_cached_merges_give_the_same_ids_and_are_not_built_again(sp, merges_cache):
    folder, built = merges_cache
    meta = plain_meta(sp)
    plain = Tokenizer.from_gguf(meta)
    assert len(built) == 1 and not folder.exists()   # no cache asked: nothing written
    first = Tokenizer.from_gguf(meta, cache=True)
    assert len(built) == 2 and len(list(folder.glob("*.nc-merges"))) == 1
    second = Tokenizer.from_gguf(meta, cache=True)
    assert len(built) == 2   # read from the file
    for text in CORPUS:
        assert plain.encode(text) == first.encode(text) == second.encode(text), text


def test_a_damaged_merges_file_is_built_anew(sp, merges_cache):
    folder, built = merges_cache
    meta = plain_meta(sp)
    expected = [Tokenizer.from_gguf(meta, cache=True).encode(text) for text in CORPUS]
    [path] = folder.glob("*.nc-merges")
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[-5] ^= 1
    for damaged in (good[:-3], bytes(flipped), b"", b"NCBLOB01" + b"\0" * 40):
        path.write_bytes(damaged)
        n = len(built)
        assert [Tokenizer.from_gguf(meta, cache=True).encode(text) for text in CORPUS] == expected
        assert len(built) == n + 1 and path.read_bytes() == good   # built and written again


def test_another_vocabulary_or_merges_rule_is_another_cache_file(sp, merges_cache, tmp_path, monkeypatch):
    from nanochat.models.text import tokenizer_spm

    folder, built = merges_cache
    meta = plain_meta(sp)
    Tokenizer.from_gguf(meta, cache=True)
    scores = list(meta["tokenizer.ggml.scores"])
    scores[300] += 1.0
    Tokenizer.from_gguf({**meta, "tokenizer.ggml.scores": scores}, cache=True)
    edited = tmp_path / "tokenizer_spm.py"
    edited.write_text(open(tokenizer_spm.__file__).read() + "\n# another rule\n")
    monkeypatch.setattr(tokenizer_spm, "__file__", str(edited))
    Tokenizer.from_gguf(meta, cache=True)
    assert len(built) == 3 and len(list(folder.glob("*.nc-merges"))) == 3


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("change,message", [
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens is missing or not a list of strings"),
    ({"tokenizer.ggml.tokens": 7}, "tokenizer.ggml.tokens is missing or not a list of strings"),
    ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens is missing"),
    ({"tokenizer.ggml.scores": [0.0] * 3}, "tokenizer.ggml.scores has 3 entries for 400 tokens"),
    ({"tokenizer.ggml.scores": ["x"] * 400}, "tokenizer.ggml.scores is not a list of numbers"),
    ({"tokenizer.ggml.token_type": [[1]] * 400}, "tokenizer.ggml.token_type is not a list of numbers"),
    ({"tokenizer.ggml.tokens": ["a"] * 400}, "repeats 'a' \\(ids 0 and 399\\)"),
], ids=["missing", "not-a-list", "empty", "short-scores", "bad-scores", "bad-types", "duplicates"])
def test_a_bad_vocabulary_is_a_one_line_value_error(sp, change, message):
    meta = {**plain_meta(sp), **change}
    with pytest.raises(ValueError, match=f"^model.gguf: .*{message}") as err:
        Tokenizer.from_gguf(meta, name="model.gguf")
    assert "\n" not in str(err.value)


def test_a_misspelled_byte_token_is_named(sp, tmp_path):
    meta = sentencepiece_tokenizer_metadata(sp, USER_DEFINED)
    tokens = list(meta["tokenizer.ggml.tokens"].value)
    tokens[sp.piece_to_id("<0x41>")] = "<0xZZ>"
    meta["tokenizer.ggml.tokens"] = MetaValue(tokens, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    path = write_vocab_gguf(tmp_path / "bad.gguf", meta)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: byte token {sp.piece_to_id('<0x41>')} is '<0xZZ>'"):
        load_tokenizer(path)


# --------------------------------------------------------------------------- tokenizer.json folders


def _llama2_style_json(tok, folder, form: str):
    """tok's vocabulary as a Hugging Face folder: Llama 2's tokenizer.json (Prepend/Replace normalizer, as
    Tokenizer.save writes it), or the newer Metaspace pre-tokenizer with a Replace/ByteFallback/Strip
    decoder or a ByteFallback + Metaspace decoder."""
    from tokenizers import decoders, pre_tokenizers

    backend = tok.backend
    if form != "prepend":
        backend = type(backend).from_str(backend.to_str())
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
            if form == "metaspace" else
            [decoders.ByteFallback(), decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)])
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}')
    return folder


@pytest.mark.parametrize("form", ["prepend", "metaspace", "metaspace-decoder"])
def test_sentencepiece_style_tokenizer_json(sp, tok, tmp_path, form):
    hf = load_tokenizer(_llama2_style_json(tok, tmp_path / "hf", form))
    assert (hf.bos_token_id, hf.eos_token_id, hf.add_bos) == (1, 2, True)
    for text in CORPUS:
        if any(s in text for s in SPECIALS) or (form != "prepend" and text.startswith((" ", "\u2581"))):
            continue   # Metaspace ("first") prefixes neither text after a special token nor text that starts
            # with a space (llama.cpp and SentencePiece do)
        ids = hf.encode(text)
        assert ids == [1] + sp.encode(text), text
        if "\u2581" not in text:
            assert hf.decode(ids, skip_special_tokens=True) == text
        for start in (0, 1):   # also a window that does not start at BOS
            deltas, joined = _stream(IncrementalDetokenizer(hf), ids[start:])
            assert joined == hf.decode(ids[start:]) and all("\ufffd" not in d for d in deltas)


# ------------------------------------------------------------------------------------- end to end


def test_tiny_llama_gguf_with_a_sentencepiece_vocabulary_generates(sp, tmp_path):
    from nanochat.engine import LLM, SamplingParams

    src = make_hf_model("llama", tmp_path / "hf", seed=7, vocab_size=sp.get_piece_size())
    path = write_gguf_from_hf(src, tmp_path / "model.gguf", "llama",   # no tokenizer.json beside it
                              tokenizer=sentencepiece_tokenizer_metadata(sp, USER_DEFINED))
    llm = LLM(str(path), dtype="float32", max_model_len=128)
    prompt = "Hello there! \u4f60\u597d"
    assert llm.tokenizer.encode(prompt) == [1] + sp.encode(prompt)
    for n in (1, 7, 24):
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        assert len(out.token_ids) == n
        full = llm.tokenizer.decode(out.token_ids)
        assert out.text in (full, full[:-1]) and (out.text == full or full.endswith("\ufffd"))


def test_an_engine_keeps_the_merges_with_the_pack_cache(sp, merges_cache, tmp_path):
    from nanochat.engine import LLMEngine

    _, built = merges_cache
    src = make_hf_model("llama", tmp_path / "hf", seed=7, vocab_size=sp.get_piece_size())
    path = write_gguf_from_hf(src, tmp_path / "model.gguf", "llama",
                              tokenizer=sentencepiece_tokenizer_metadata(sp, USER_DEFINED))
    prompt = "Hello there! \u4f60\u597d"
    for pack_cache in (True, True, False):
        engine = LLMEngine(str(path), dtype="float32", max_model_len=64, pack_cache=pack_cache)
        assert engine.tokenizer.encode(prompt) == [1] + sp.encode(prompt)
    assert len(built) == 2   # the first load and the one without the cache
