"""Tokenizers for nanochat, built from a GGUF file's metadata or a Hugging Face tokenizer.json.

Runtime code uses only the `tokenizers` library (never transformers). A GGUF carries no
tokenizer.json: it stores the vocabulary, merges, token types and special ids under llama.cpp's
key names, and names the pre-tokenizer (`tokenizer.ggml.pre`) whose split regexes live in
llama.cpp's source. We rebuild the same byte-level BPE from those pieces; SentencePiece ('llama')
vocabularies are built in tokenizer_spm.py.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from nanochat.models.formats.gguf_file import GGUFFile, read_metadata, to_python
from nanochat.models.text.fim import FimTokens, find_fim, stated_fim
from nanochat.models.text.tokenizer_spm import build_spm
from nanochat.models.text.tokenizer_wpm import build_wpm

log = logging.getLogger(__name__)

# nano-vllm's tokenizer override, read by load_tokenizer when a model loads. Not a Config field: it
# says which files make up the model (like the model path), and models load before and without an
# engine (the chat front ends, `nanochat bench --multi-turn`, convert-model).
TOKENIZER_PATH_ENV = "NANO_VLLM_TOKENIZER_PATH"

# llama.cpp token types (gguf.TokenType)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


class UnsupportedTokenizerError(ValueError):
    """The file describes a tokenizer model we cannot build (e.g. T5's unigram 't5')."""


# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, per `tokenizer.ggml.pre`, as llama.cpp's llm_tokenizer_bpe applies them.
# Each entry is a list of regexes applied one after the other: every regex splits the pieces the
# previous one produced, keeping both matches and the unmatched gaps (= tokenizers' Split
# "isolated"). Where llama.cpp rewrote `(?i:...)` into `[sS]` classes for std::regex, we use the
# original tokenizer.json spelling, which Oniguruma (the `tokenizers` regex engine) supports.
# ---------------------------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_DEFAULT_SPLITS = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]


def _group(names: str, splits: list[str], ignore_merges: bool = False, add_bos: bool = False) -> dict:
    spec = {"splits": splits, "ignore_merges": ignore_merges, "add_bos": add_bos}
    return {name: spec for name in names.split()}


# name -> splits, and the flags llama.cpp sets for that pre-type (add_bos is only the default
# used when the file has no tokenizer.ggml.add_bos_token).
PRE_TOKENIZERS: dict[str, dict] = {
    **_group("default", _DEFAULT_SPLITS),
    **_group("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", [_LLAMA3],
             ignore_merges=True, add_bos=True),
    **_group("dbrx smaug-bpe glm4 chatglm-bpe", [_LLAMA3]),
    **_group("qwen2 deepseek-r1-qwen kormo megrez stablelm2 hunyuan grok-2", [_QWEN2]),
    **_group("qwen35", [_QWEN35]),
    **_group("smollm starcoder refact command-r codeshell exaone minerva-7b", [r"\p{N}", _GPT2]),
    **_group("gpt2 gpt-2 phi-2 jina-es jina-de gigachat jina-v1-en jina-v2-es jina-v2-de jina-v2-code "
             "roberta-bpe a.x-4.0 mellum mpt olmo jais trillion granite-docling exaone4", [_GPT2]),
    **_group("gpt-4o llama4 minimax-m2", [_GPT4O]),
    **_group("tekken", [_TEKKEN], ignore_merges=True, add_bos=True),
    **_group("falcon", [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]),
}


def _byte_level_pre_tokenizer(splits: list[str]):
    steps = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in splits]
    # The regexes already split the text; ByteLevel only maps bytes to its printable alphabet.
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the byte-level alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_CHARS = bytes_to_unicode()
_BYTE_ALPHABET = frozenset(_BYTE_CHARS.values())


def _spell_byte_level(token: str) -> str:
    """A normal token in byte-level spelling; tokens stored as raw text (rare) are re-spelled."""
    if set(token) <= _BYTE_ALPHABET:
        return token
    return "".join(_BYTE_CHARS[b] for b in token.encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# GGUF metadata
# ---------------------------------------------------------------------------------------------

def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (no tensors), arrays as plain Python lists."""
    return {k: to_python(v) for k, v in read_metadata(path).items()}


def _metadata_from(source) -> Mapping[str, Any]:
    """A metadata mapping from a path, a GGUFFile, a gguf.GGUFReader, or a mapping already extracted
    (numeric arrays may be numpy arrays or lists)."""
    if isinstance(source, (str, os.PathLike)):
        return read_metadata(source)
    if isinstance(source, GGUFFile):
        return source.metadata
    if isinstance(source, Mapping):
        return source
    fields = getattr(source, "fields", None)
    if fields is None:
        raise TypeError("expected a GGUF path, a GGUFFile, a gguf.GGUFReader or a metadata dict, "
                        f"got {type(source).__name__}")
    keep = ("tokenizer.", "general.architecture", "general.name")  # the name: llama.cpp's Phi-3 rule
    return {k: f.contents() for k, f in fields.items() if k.startswith(keep)}


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token facts the engine needs.

    BOS and EOS are added here (not by a tokenizers post-processor), so `add_bos` / `add_eos` are the
    single switches. Special tokens written in the text (e.g. `<|im_start|>`) always encode to their
    own id. `decoder(ids, skip_special_tokens)` replaces the backend's decoder when given.
    """

    def __init__(self, backend: _HFTokenizer, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None,
                 add_bos: bool = False, add_eos: bool = False, chat_template: str | None = None,
                 name: str = "", decoder: Callable[[list[int], bool], str] | None = None,
                 fim: FimTokens | None = None, appended_id: int | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        # add_eos appends the EOS, or `appended_id` where a folder's post-processor appends another token
        # (Qwen3-Embedding: <|endoftext|>, its EOS being <|im_end|>)
        self.appended_id = appended_id if appended_id is not None else eos_token_id
        self.add_bos = bool(add_bos) and bos_token_id is not None
        self.add_eos = bool(add_eos) and self.appended_id is not None
        self._decoder = decoder
        self.chat_template = chat_template
        self.name = name
        self.bos_token = self.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token = self.id_to_token(eos_token_id) if eos_token_id is not None else None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        # fill-in-the-middle tokens: as the file states them, else by their spellings (models/text/fim.py)
        self.fim = fim or find_fim(self.token_to_id)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name or 'unnamed'}, vocab={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, add_bos={self.add_bos})")

    # -- core API ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """`parse_special`: special tokens' spellings in the text are those tokens (off: plain text)."""
        if parse_special:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        else:
            self.backend.encode_special_tokens = True
            try:
                ids = self.backend.encode(text, add_special_tokens=False).ids
            finally:
                self.backend.encode_special_tokens = False
        if add_special_tokens and self.add_bos:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos:
            ids.append(self.appended_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if self._decoder is not None:
            return self._decoder(ids, skip_special_tokens)
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json (the backend only; BOS/EOS facts live in tokenizer_config.json)."""
        self.backend.save(str(path))

    def tokenizer_config(self) -> dict:
        """The tokenizer_config.json fields from_file reads back."""
        cfg = {"bos_token": self.bos_token, "eos_token": self.eos_token, "add_bos_token": self.add_bos}
        if self.add_eos:
            cfg["add_eos_token"] = True
            if self.appended_id != self.eos_token_id:
                cfg["appended_token"] = self.id_to_token(self.appended_id)
        if self.pad_token_id is not None:
            cfg["pad_token"] = self.id_to_token(self.pad_token_id)
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        return cfg

    # -- constructors -----------------------------------------------------------------------

    @classmethod
    def from_file(cls, tokenizer_json_path: str | os.PathLike, tokenizer_config: dict | None = None) -> "Tokenizer":
        """From a Hugging Face tokenizer.json. `tokenizer_config` is the tokenizer_config.json dict;
        when None, the tokenizer_config.json beside the file is read if there is one."""
        path = Path(tokenizer_json_path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {path}")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"{path}: cannot load tokenizer.json: {exc}") from exc
        if tokenizer_config is None:
            tokenizer_config = _read_tokenizer_config(path.parent)
        tokenizer_config = dict(tokenizer_config)
        if "chat_template" not in tokenizer_config:
            jinja = path.parent / "chat_template.jinja"
            if jinja.is_file():
                tokenizer_config["chat_template"] = jinja.read_text(encoding="utf-8")
        return cls._from_backend(backend, tokenizer_config, name=str(path))

    @classmethod
    def _from_backend(cls, backend: _HFTokenizer, cfg: dict, name: str = "") -> "Tokenizer":
        def tid(key):
            tok = _token_content(cfg.get(key))
            return backend.token_to_id(tok) if tok is not None else None

        # An encoder's tokenizer (BERT) starts its inputs with a [CLS] token and names no BOS.
        bos_id = tid("bos_token") if tid("bos_token") is not None else tid("cls_token")
        add_bos, add_eos, appended = cfg.get("add_bos_token"), cfg.get("add_eos_token"), tid("appended_token")
        if add_bos is None or add_eos is None:
            # No flag: trust the tokenizer.json post-processor (llama3 adds <|begin_of_text|> there; an embedding
            # model may end every input with a token of its own).
            plain = backend.encode("a", add_special_tokens=False).ids
            probe = backend.encode("a", add_special_tokens=True).ids
            if add_bos is None:
                add_bos = bos_id is not None and len(probe) > 1 and probe[0] == bos_id
            if add_eos is None and len(probe) > len(plain) and probe[-len(plain) - 1:-1] == plain \
                    and probe[-1] in {i for i, t in backend.get_added_tokens_decoder().items() if t.special}:
                add_eos, appended = True, probe[-1]
        return cls(backend, bos_token_id=bos_id, eos_token_id=tid("eos_token"), pad_token_id=tid("pad_token"),
                   add_bos=bool(add_bos), add_eos=bool(add_eos), appended_id=appended,
                   chat_template=_pick_chat_template(cfg.get("chat_template")), name=name)

    @classmethod
    def from_gguf(cls, source, name: str = "", cache: bool = False) -> "Tokenizer":
        """From GGUF metadata: a .gguf path, a GGUFFile, a gguf.GGUFReader, or a dict of its fields. cache: keep
        a SentencePiece vocabulary's merges on disk (models/text/tokenizer_spm.py)."""
        meta = _metadata_from(source)
        if not name:
            name = str(source) if isinstance(source, (str, os.PathLike)) else \
                source.path if isinstance(source, GGUFFile) else "gguf"
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise UnsupportedTokenizerError(f"{name}: no tokenizer in GGUF metadata (tokenizer.ggml.model missing)")
        if model == "llama":
            spm = build_spm(meta, name, cache)
            return cls(spm.backend, bos_token_id=spm.bos_token_id, eos_token_id=spm.eos_token_id,
                       pad_token_id=spm.pad_token_id, add_bos=spm.add_bos, add_eos=spm.add_eos,
                       chat_template=meta.get("tokenizer.chat_template"), name=name, decoder=spm.decode,
                       fim=stated_fim(meta, spm.backend.get_vocab_size(with_added_tokens=True)))
        if model == "bert":
            wpm = build_wpm(meta, name)
            return cls(wpm.backend, bos_token_id=wpm.bos_token_id, eos_token_id=wpm.eos_token_id,
                       pad_token_id=wpm.pad_token_id, add_bos=wpm.add_bos, add_eos=wpm.add_eos,
                       appended_id=wpm.appended_id, name=name)
        if model != "gpt2":
            raise UnsupportedTokenizerError(
                f"{name}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2', "
                f"SentencePiece 'llama' and WordPiece 'bert'); put a tokenizer.json beside the file or set "
                f"{TOKENIZER_PATH_ENV}")
        tokens = list(meta.get("tokenizer.ggml.tokens") or [])
        merges = meta.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ValueError(f"{name}: GGUF byte-level BPE needs tokenizer.ggml.tokens and tokenizer.ggml.merges")
        types = meta.get("tokenizer.ggml.token_type")
        types = [TOKEN_TYPE_NORMAL] * len(tokens) if types is None else to_python(types)
        pre_name = meta.get("tokenizer.ggml.pre") or "default"
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            # llama.cpp does the same: warn and fall back to its default regexes.
            log.warning("%s: unknown pre-tokenizer %r, using 'default'", name, pre_name)
            pre = PRE_TOKENIZERS["default"]

        backend = _build_byte_level_bpe(tokens, types, merges, pre)

        def special(key):
            val = meta.get(f"tokenizer.ggml.{key}")
            return int(val) if val is not None and 0 <= int(val) < len(tokens) else None

        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        # add_eos: embedding models' files (Qwen3-Embedding ends every input with <|endoftext|>), as llama.cpp reads it
        return cls(backend, bos_token_id=special("bos_token_id"), eos_token_id=special("eos_token_id"),
                   pad_token_id=special("padding_token_id"), add_eos=meta.get("tokenizer.ggml.add_eos_token") is True,
                   add_bos=pre["add_bos"] if add_bos is None else bool(add_bos),
                   chat_template=meta.get("tokenizer.chat_template"), name=name, fim=stated_fim(meta, len(tokens)))


def _build_byte_level_bpe(tokens: list[str], types, merges: list[str], pre: dict) -> _HFTokenizer:
    # Whole-list operations where a file is as usual (every token already byte-level spelled, no merge
    # starting with a space): a 150k vocabulary is not walked token by token in Python.
    n = min(len(tokens), len(types))
    names = list(tokens[:n])
    for i in [i for i, tok in enumerate(names) if not tok]:
        names[i] = f"[EMPTY_{i}]"  # llama.cpp's name for empty entries
    kinds = np.asarray(types[:n])
    raw = np.flatnonzero((kinds == TOKEN_TYPE_CONTROL) | (kinds == TOKEN_TYPE_USER_DEFINED)).tolist()
    # Control and user-defined tokens are stored as the raw text to match in the input, not in byte-level
    # spelling; a normal token stored as raw text (rare) is re-spelled.
    normal = list(names)
    for i in raw:
        normal[i] = ""
    if not set("".join(normal)) <= _BYTE_ALPHABET:
        keep = set(raw)
        names = [tok if i in keep else _spell_byte_level(tok) for i, tok in enumerate(names)]
    vocab = dict(zip(names, range(n)))  # a duplicate keeps the last id, as llama.cpp's token_to_id does
    added = [AddedToken(names[i], special=int(kinds[i]) == TOKEN_TYPE_CONTROL, normalized=False) for i in raw]
    pairs = list(map(tuple, map(str.split, merges, repeat(" "), repeat(1))))
    if sum(map(len, pairs)) != 2 * len(pairs) or any(map(str.startswith, merges, repeat(" "))):
        pairs = [_split_merge(merge) for merge in merges]   # a merge without a space, or starting with one
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre["ignore_merges"], fuse_unk=False)
    backend = _HFTokenizer(bpe)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre["splits"])
    backend.decoder = decoders.ByteLevel()
    # Control tokens are special (skipped by skip_special_tokens); user-defined ones (e.g. <think>)
    # are matched whole too but decode as text, like llama.cpp.
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend


def _split_merge(merge: str) -> tuple[str, str]:
    cut = merge.find(" ", 1)  # llama.cpp splits at the first space after the first character
    if cut < 0:
        raise ValueError(f"bad BPE merge {merge!r} in GGUF metadata")
    return merge[:cut], merge[cut + 1:]


def _token_content(value) -> str | None:
    """tokenizer_config.json writes a token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_chat_template(value) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


def _read_tokenizer_config(folder: Path) -> dict:
    cfg_path = folder / "tokenizer_config.json"
    if not cfg_path.is_file():
        return {}
    try:
        return json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{cfg_path}: cannot read tokenizer config: {exc}") from exc


def _find_tokenizer_json(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".json":
        return path
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    return None


def load_tokenizer(path: str | os.PathLike, parsed: GGUFFile | None = None, cache: bool = False) -> Tokenizer:
    """The tokenizer for a model path: a .gguf file or a folder with tokenizer.json.

    Overrides, strongest first: env NANO_VLLM_TOKENIZER_PATH (a tokenizer.json or a folder with
    one), then a tokenizer.json beside a .gguf file. With an override, BOS/EOS and the chat
    template come from the tokenizer_config.json beside it, else from the GGUF metadata.
    `parsed` is the GGUF at `path` when the caller has already parsed it (it is not read again).
    cache: see Tokenizer.from_gguf.
    """
    path = Path(path)
    override = None
    env = os.environ.get(TOKENIZER_PATH_ENV)
    if env:
        override = _find_tokenizer_json(Path(env))
        if override is None:
            raise FileNotFoundError(f"{TOKENIZER_PATH_ENV}={env}: no tokenizer.json there")
    is_gguf = parsed is not None or (path.is_file() and path.suffix.lower() == ".gguf")
    gguf_meta = parsed if parsed is not None else path
    if override is None and is_gguf and (path.parent / "tokenizer.json").is_file():
        override = path.parent / "tokenizer.json"

    if override is not None:
        cfg = _read_tokenizer_config(override.parent)
        if is_gguf:
            # Fill what the folder does not say from the GGUF (which it is meant to tokenize for).
            for key, val in _gguf_tokenizer_config(_metadata_from(gguf_meta)).items():
                cfg.setdefault(key, val)
        return Tokenizer.from_file(override, cfg)
    if is_gguf:
        return Tokenizer.from_gguf(gguf_meta, name=str(path), cache=cache)
    found = _find_tokenizer_json(path)
    if found is None:
        raise FileNotFoundError(f"{path}: neither a .gguf file nor a folder with tokenizer.json")
    return Tokenizer.from_file(found)


def _gguf_tokenizer_config(meta: Mapping[str, Any]) -> dict:
    """tokenizer_config.json-style facts (special tokens as text, add_bos, template) from GGUF metadata."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg = {}
    for key, field in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")):
        tid = meta.get(f"tokenizer.ggml.{field}")
        if tid is not None and 0 <= tid < len(tokens):
            cfg[key] = tokens[tid]
    if meta.get("tokenizer.ggml.add_bos_token") is not None:
        cfg["add_bos_token"] = bool(meta["tokenizer.ggml.add_bos_token"])
    if meta.get("tokenizer.chat_template"):
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


# ---------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Decodes a short window (the last finalised tokens plus the pending ones) and emits only text
    that is final: while the window's text ends in U+FFFD a multi-byte character is still
    incomplete, so it is held back. The deltas concatenate to decode(all generated ids), less an
    incomplete character at the very end; call flush() at the end to get anything still held. With
    `prompt_ids` they are the text the reply adds after the prompt's: for SentencePiece vocabularies
    that keeps the reply's leading space, which decode() drops at the start of a text.
    """

    _CONTEXT = 4  # prompt tokens kept as left context

    def __init__(self, tokenizer: Tokenizer, prompt_ids=None, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        ctx = list(prompt_ids or [])[-self._CONTEXT:]
        if ctx and self._decode(ctx).endswith("\ufffd"):
            ctx = []  # a prompt ending mid-character would swallow our first bytes
        self._ids: list[int] = ctx
        self._prefix = 0          # start of the decoded window
        self._read = len(ctx)     # tokens before this are already emitted
        self.generated_ids: list[int] = []

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        self.generated_ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is still held back, less a character whose last bytes never came (a reply cut by its
        token limit mid-character would otherwise end in U+FFFD). An incomplete character decodes to one
        U+FFFD; any before it stand for invalid bytes the model did produce, and stay."""
        text = self._emit(final=True)
        return text[:-1] if text.endswith("\ufffd") else text

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if not final and (text.endswith("\ufffd") or len(text) <= len(before)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]
