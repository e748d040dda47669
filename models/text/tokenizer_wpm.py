"""WordPiece ('bert') vocabularies from GGUF metadata, tokenizing as llama.cpp's WPM tokenizer does.

llama.cpp's converter writes a BERT vocabulary with "phantom spaces": a word-initial piece `the` as `▁the`, a
continuation `##ing` as `ing`, control tokens ([CLS], [SEP], ...) as they are. Its tokenizer splits the text into
words at whitespace, punctuation, ASCII symbols and CJK characters (after lowercasing and stripping accents where
tokenizer.ggml.normalizer.* say so: lowercase off unless stated, accents stripped when lowercasing unless stated),
then takes the longest vocabulary piece at each point of "▁" + word; a word it cannot cover is one [UNK]. That is
BERT's own pipeline (BertNormalizer, BertPreTokenizer, WordPiece with "##" continuations) on the vocabulary spelled
back, which `tokenizers` runs. Inputs are [CLS] text [SEP] (add_bos_token; add_sep_token or add_eos_token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

CONTROL = 3   # gguf.TokenType.CONTROL
SPACE = "\u2581"


@dataclass(frozen=True)
class WpmVocab:
    backend: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    appended_id: int | None   # [SEP]: what ends every input
    add_bos: bool
    add_eos: bool


def build_wpm(meta: Mapping[str, Any], name: str) -> WpmVocab:
    """The tokenizer of a GGUF whose tokenizer.ggml.model is 'bert'. ValueError names what is wrong."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{name}: tokenizer.ggml.tokens is missing or not a list of strings")
    types = meta.get("tokenizer.ggml.token_type")
    types = [1] * len(tokens) if types is None else list(types)
    if len(types) != len(tokens):
        raise ValueError(f"{name}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")

    def special(key: str, default: int | None) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}", default)
        return v if isinstance(v, int) and 0 <= v < len(tokens) else None

    unk = special("unknown_token_id", 100)
    if unk is None:
        raise ValueError(f"{name}: a WordPiece vocabulary needs its unknown token (tokenizer.ggml.unknown_token_id)")
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        vocab.setdefault(_piece(tok, kind), i)
    backend = Tokenizer(models.WordPiece(vocab, unk_token=_piece(tokens[unk], types[unk]),
                                         continuing_subword_prefix="##", max_input_chars_per_word=1 << 30))
    lowercase = meta.get("tokenizer.ggml.normalizer.lowercase") is True
    strip = meta.get("tokenizer.ggml.normalizer.strip_accents", lowercase) is True
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=strip,
                                                    lowercase=lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                                for tok, kind in zip(tokens, types) if kind == CONTROL])
    # llama.cpp frames every input [CLS] ... [SEP] whatever the add_*_token flags say.
    bos, sep = special("bos_token_id", 101), special("seperator_token_id", 102)
    if bos is None or sep is None:
        raise ValueError(f"{name}: a WordPiece vocabulary needs its [CLS] and [SEP] tokens "
                         "(tokenizer.ggml.bos_token_id, tokenizer.ggml.seperator_token_id)")
    eos = special("eos_token_id", None)
    return WpmVocab(backend, bos_token_id=bos, eos_token_id=sep if eos is None else eos,
                    pad_token_id=special("padding_token_id", 0), appended_id=sep, add_bos=True, add_eos=True)


def _piece(tok: str, kind: int) -> str:
    """A vocabulary entry as BERT spells it: a phantom-space word start bare, a continuation after "##"."""
    return tok if kind == CONTROL else tok[1:] if tok.startswith(SPACE) else "##" + tok
