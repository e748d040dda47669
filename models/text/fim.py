"""Fill in the middle: a code model's prompt for the text between a prefix and a suffix (an editor's completion at
the cursor), as llama.cpp's server builds it for /infill: [BOS] <PRE> prefix <SUF> suffix <MID>, the model then
writing the middle. Prefix and suffix are encoded as plain text (special-token spellings in the code stay text).

A model's FIM tokens are the ones its GGUF states (tokenizer.ggml.fim_*_token_id, written by llama.cpp's converter),
else found by their spellings in the vocabulary, the families llama.cpp knows: Qwen2.5-Coder and Qwen3
(<|fim_prefix|>), StarCoder, SmolLM and Granite (<fim_prefix>), CodeLlama (▁<PRE>), DeepSeek-Coder (<｜fim▁begin｜>),
CodeGemma (<|fim_prefix|>), Codestral ([PREFIX]). The tokens that end a middle besides the model's end of text
(the FIM padding, repository and file separators) stop the reply, as llama.cpp counts them as end of generation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<｜fim▁begin｜>", "<|code_prefix|>",
          "[PREFIX]")
SUFFIX = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<｜fim▁hole｜>", "<|code_suffix|>",
          "[SUFFIX]")
MIDDLE = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<｜fim▁end｜>", "<|code_middle|>",
          "[MIDDLE]")
ENDS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|repo_name|>", "<repo_name>", "<reponame>", "<|file_sep|>",
        "<file_sep>", "<|file_separator|>", "<EOT>", "▁<EOT>")
_STATED = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.fim_mid_token_id")
_STATED_ENDS = ("tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.fim_rep_token_id",
                "tokenizer.ggml.fim_sep_token_id")


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...] = ()   # tokens that end the middle besides the end of text


def stated_fim(meta: Mapping[str, Any], vocab_size: int) -> FimTokens | None:
    """The FIM tokens a GGUF's metadata states, or None."""
    def valid(key):
        value = meta.get(key)
        return int(value) if value is not None and 0 <= int(value) < vocab_size else None

    ids = [valid(key) for key in _STATED]
    if None in ids:
        return None
    return FimTokens(*ids, tuple(i for i in map(valid, _STATED_ENDS) if i is not None))


def find_fim(token_to_id) -> FimTokens | None:
    """The FIM tokens found by their spellings (`token_to_id`: a tokenizer's lookup), or None."""
    def first(spellings):
        return next((i for i in map(token_to_id, spellings) if i is not None), None)

    ids = [first(PREFIX), first(SUFFIX), first(MIDDLE)]
    if None in ids:
        return None
    return FimTokens(*ids, tuple(dict.fromkeys(i for i in map(token_to_id, ENDS) if i is not None)))


def infill_ids(tokenizer, prefix: str, suffix: str, budget: int) -> list[int]:
    """The prompt ids for the middle between `prefix` and `suffix`, at most `budget` tokens: when the text is
    longer, the suffix keeps its first quarter of the budget and the prefix its last tokens, as llama.cpp cuts
    them. ValueError when the model has no FIM tokens."""
    fim = tokenizer.fim
    if fim is None:
        raise ValueError("this model has no fill-in-the-middle tokens (code models such as Qwen2.5-Coder, "
                         "StarCoder or CodeLlama have them): suffix cannot be used")
    head = [tokenizer.bos_token_id] if tokenizer.add_bos else []
    room = budget - len(head) - 3
    if room < 1:
        raise ValueError(f"no room for a fill-in-the-middle prompt in {budget} tokens")
    before = tokenizer.encode(prefix, add_special_tokens=False, parse_special=False)
    after = tokenizer.encode(suffix, add_special_tokens=False, parse_special=False)
    after = after[:max(min(len(after), room // 4), room - len(before))]
    before = before[max(0, len(before) - (room - len(after))):]
    return head + [fim.prefix, *before, fim.suffix, *after, fim.middle]
