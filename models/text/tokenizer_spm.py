"""SentencePiece ('llama') vocabularies from GGUF metadata, tokenizing as llama.cpp does.

llama.cpp does not run SentencePiece on these files. Its llm_tokenizer_spm escapes spaces to "▁",
splits the text into characters and repeatedly merges the adjacent pair whose concatenation is the
vocabulary entry with the highest score (the leftmost pair on equal scores); a symbol left outside
the vocabulary becomes its <0xNN> byte tokens. A `tokenizers` BPE with one merge per split of each
entry into two entries, ranked by the entry's score, makes the same merges. Equal scores are the one
place where the two can part: BPE orders them by rank, llama.cpp by position. SentencePiece-trained
vocabularies give their normal pieces distinct scores; among equal ones the longer left part ranks
first, which reproduces llama.cpp's left-to-right growth of runs of one character (e.g. spaces).

Building the merges is the slow part of loading a large vocabulary (Gemma 3's 262k entries); with `cache`,
build_spm keeps them on disk beside the pack cache (models/formats/pack_cache.py) for the next load.

Control, unknown and user-defined tokens are matched in the raw text first (llama.cpp's special-token
partition), and every text piece after one, or at the start, gets the "▁" prefix when
`tokenizer.ggml.add_space_prefix` is set (default true; Gemma files set it false).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

# gguf.TokenType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # "▁", SentencePiece's escaped space


@dataclass(frozen=True)
class SpmVocab:
    backend: Tokenizer
    decode: "SpmDecoder"
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    add_bos: bool
    add_eos: bool


def build_spm(meta: Mapping[str, Any], name: str, cache: bool = False) -> SpmVocab:
    """The tokenizer of a GGUF whose tokenizer.ggml.model is 'llama'. ValueError names what is wrong.
    cache: read the merges from the on-disk cache, or write them there (see _cached_merges)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{name}: tokenizer.ggml.tokens is missing or not a list of strings")
    n = len(tokens)
    scores = _per_token(meta, "tokenizer.ggml.scores", n, name, np.float32, 0.0)
    types = _per_token(meta, "tokenizer.ggml.token_type", n, name, np.int32, NORMAL)
    tokens = [tok or f"[EMPTY_{i}]" for i, tok in enumerate(tokens)]  # llama.cpp's name for empty entries
    vocab = dict(zip(tokens, range(n)))
    if len(vocab) != n:
        i = next(i for i, tok in enumerate(tokens) if vocab[tok] != i)
        raise ValueError(f"{name}: tokenizer.ggml.tokens repeats {tokens[i]!r} (ids {i} and {vocab[tokens[i]]})")
    byte_ids = np.flatnonzero(types == BYTE).tolist()
    for i in byte_ids:
        if not (len(tokens[i]) == 6 and tokens[i].startswith("<0x") and tokens[i].endswith(">")
                and all(c in "0123456789ABCDEFabcdef" for c in tokens[i][3:5])):
            raise ValueError(f"{name}: byte token {i} is {tokens[i]!r}, not <0xNN>")

    def special(key: str, default: int | None) -> int | None:
        val = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(val, (int, np.integer)) and 0 <= val < n:
            return int(val)
        # llama.cpp: the SPM defaults (unk 0, bos 1, eos 2) where the key is absent or out of range
        return default if default is not None and default < n else None

    def flag(key: str, default: bool) -> bool:
        val = meta.get(f"tokenizer.ggml.{key}")
        return default if val is None else bool(val)

    unk_id = special("unknown_token_id", 0)
    add_space_prefix = flag("add_space_prefix", True)
    # llama.cpp reads tokenizer.ggml.remove_extra_whitespaces too but applies it only to T5 (UGM)
    # vocabularies: honouring it here would make ids differ from llama.cpp's for the same file.
    rstrip = _rstrip_specials(meta, tokens, types)

    ids = _cached_merges(tokens, vocab, scores) if cache else _merges(vocab, scores)
    token = tokens.__getitem__
    merges = list(zip(map(token, ids[:, 0].tolist()), map(token, ids[:, 1].tolist())))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                   unk_token=tokens[unk_id] if unk_id is not None else None, ignore_merges=False))
    escape = [normalizers.Replace(" ", SPACE)]
    backend.normalizer = normalizers.Sequence(escape + [normalizers.Prepend(SPACE)] if add_space_prefix else escape)
    # For tokenizer.json export (convert-model); decode() uses SpmDecoder, which reads bytes as llama.cpp does.
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    # llama.cpp matches control, unknown and user-defined tokens in the raw text before anything else;
    # the first two are special (dropped by skip_special_tokens), user-defined ones decode as text.
    added = [AddedToken(tokens[i], special=int(types[i]) != USER_DEFINED, normalized=False, rstrip=i in rstrip)
             for i in np.flatnonzero(np.isin(types, (CONTROL, UNKNOWN, USER_DEFINED))).tolist()]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return SpmVocab(backend, SpmDecoder(tokens, types, add_space_prefix),
                    bos_token_id=special("bos_token_id", 1), eos_token_id=special("eos_token_id", 2),
                    pad_token_id=special("padding_token_id", None),
                    add_bos=flag("add_bos_token", True), add_eos=flag("add_eos_token", False))


def _per_token(meta: Mapping[str, Any], key: str, n: int, name: str, dtype, default) -> np.ndarray:
    """One number per token (llama.cpp refuses fewer entries than tokens, and ignores extra ones)."""
    val = meta.get(key)
    if val is None:
        return np.full(n, default, dtype=dtype)
    try:
        arr = np.asarray(val, dtype=dtype)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 1:
        raise ValueError(f"{name}: {key} is not a list of numbers")
    if len(arr) < n:
        raise ValueError(f"{name}: {key} has {len(arr)} entries for {n} tokens")
    return arr[:n]


def _merges(vocab: dict[str, int], scores: np.ndarray) -> np.ndarray:
    """Every split of an entry into two entries, best entry score first (see the module docstring), as the
    [n, 2] ids of the two parts. llama.cpp merges into any entry its text matches, whatever its type, so all
    types take part."""
    score = scores.tolist()
    get = vocab.get
    ranked = []
    for tok, i in vocab.items():
        for k in range(1, len(tok)):
            left = get(tok[:k])
            if left is not None:
                right = get(tok[k:])
                if right is not None:
                    ranked.append((-score[i], -k, i, left, right))
    ranked.sort()
    return np.fromiter((x for r in ranked for x in r[3:]), dtype="<i4", count=2 * len(ranked)).reshape(-1, 2)


def _cached_merges(tokens: list[str], vocab: dict[str, int], scores: np.ndarray) -> np.ndarray:
    """_merges, kept on disk. The key covers all _merges reads (the entries and their scores) and this file's
    code, so another vocabulary or another rule never reads stale merges; a file that is not whole or names
    ids outside the vocabulary is built anew."""
    from nanochat.models.formats import pack_cache

    key = hashlib.sha256(Path(__file__).read_bytes())
    key.update(np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens)).tobytes())
    key.update("".join(tokens).encode("utf-8", "surrogatepass"))
    key.update(scores.astype("<f4").tobytes())
    name = f"{key.hexdigest()[:24]}.nc-merges"
    data = pack_cache.read_cached(name)
    if data is not None and len(data) % 8 == 0:
        ids = np.frombuffer(data, dtype="<i4").reshape(-1, 2)
        if not ids.size or (ids.min() >= 0 and ids.max() < len(tokens)):
            return ids
    ids = _merges(vocab, scores)
    pack_cache.write_cached(name, ids.tobytes())
    return ids


def _rstrip_specials(meta: Mapping[str, Any], tokens: list[str], types: np.ndarray) -> set[int]:
    """llama.cpp's Phi-3 rule (by model name): its special tokens swallow the whitespace after them,
    except <unk>, <s> and <|endoftext|>."""
    model_name = str(meta.get("general.name") or "").lower()
    if "phi-3" not in model_name and "phi3" not in model_name:
        return set()
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    specials = np.flatnonzero(np.isin(types, (CONTROL, UNKNOWN, USER_DEFINED))).tolist()
    return {i for i in specials if tokens[i] not in keep} | {i for i, t in enumerate(tokens) if t == "</s>"}


class SpmDecoder:
    """ids -> text as llama.cpp's token_to_piece writes the bytes: normal tokens with "▁" as spaces,
    byte tokens as their byte, control/unknown/user-defined tokens as their text, unused ones as
    nothing. The bytes are read as UTF-8 with one U+FFFD per invalid or incomplete sequence (what
    the streaming detokenizer relies on); with add_space_prefix one leading space is dropped, as
    SentencePiece does (after skipped special tokens, so decode(encode(text)) == text)."""

    def __init__(self, tokens: list[str], types: np.ndarray, strip_space: bool):
        kinds = types.tolist()
        pieces = []
        for tok, kind in zip(tokens, kinds):
            if kind == NORMAL:
                pieces.append(tok.replace(SPACE, " ").encode("utf-8"))
            elif kind == BYTE:
                pieces.append(bytes([int(tok[3:5], 16)]))
            elif kind in (CONTROL, UNKNOWN, USER_DEFINED):
                pieces.append(tok.encode("utf-8"))
            else:
                pieces.append(b"")
        self.pieces = pieces
        self.special = frozenset(i for i, kind in enumerate(kinds) if kind in (CONTROL, UNKNOWN))
        self.strip_space = strip_space

    def __call__(self, ids, skip_special_tokens: bool = False) -> str:
        pieces, n = self.pieces, len(self.pieces)
        skip = self.special if skip_special_tokens else ()
        text = b"".join([pieces[i] for i in map(int, ids) if 0 <= i < n and i not in skip]).decode("utf-8", "replace")
        return text[1:] if self.strip_space and text.startswith(" ") else text
