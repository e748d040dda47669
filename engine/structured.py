"""Structured output: a request's reply held to a JSON schema (OpenAI's `response_format`) or to a grammar (a tool
call that `tool_choice` forces), token by token.

llguidance (the grammar engine vLLM, SGLang and llama.cpp use) compiles the schema and, at each step, gives the
set of tokens that keep the reply a prefix of a valid document; the other tokens' logits are set to -inf
before penalties, bias, temperature, top-k and top-p, so a sampled reply follows the model's distribution
restricted to valid continuations and a greedy one takes the likeliest valid token. The reply ends at the
end-of-turn token once the document is complete, or as soon as the grammar admits nothing more. A speculative
step's rows are masked along its proposals (`mask_along`), so verification keeps only what the grammar allows.
A reasoning model thinks freely first, and a harmony model writes its analysis: the document is held from the
answer on (`Lead`). A grammar (llguidance's Lark dialect, which names special tokens as `<|end|>` and inlines
schemas as `%json {...}`, or llama.cpp's GBNF) holds the answer the same way, unless it names harmony's channels
itself (a forced tool call's grammar): then it holds the whole reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from nanochat.engine.sampling_params import JSON_WHITESPACE
from nanochat.models.text.harmony import ANSWER_HEADER, CHANNEL

if TYPE_CHECKING:
    import torch


class Grammars:
    """An engine's structured output: each held request's Constraint, over the engine's tokenizer as llguidance sees
    it (built on first use, ~0.2 s for a 150k vocabulary) and what its model writes before an answer (`lead`)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, harmony: bool):
        self._tokenizer, self._vocab_size, self._eos_ids, self._harmony = tokenizer, vocab_size, eos_ids, harmony
        self._llg = None

    @property
    def tokenizer(self):
        if self._llg is None:
            self._llg = grammar_tokenizer(self._tokenizer, self._vocab_size, self._eos_ids)
        return self._llg

    def constraint(self, sp, prompt_ids: list[int]) -> Constraint | None:
        """A json_schema or grammar request's state (None for others); ValueError: one that cannot be followed."""
        if sp.grammar is not None:
            return Constraint(self.tokenizer, lark_grammar(sp.grammar), self.lead(answer=CHANNEL not in sp.grammar),
                              prompt_ids, what="grammar")
        if sp.json_schema is not None:
            return Constraint(self.tokenizer, schema_grammar(sp.json_schema), self.lead(), prompt_ids)
        return None

    def lead(self, answer: bool = True) -> Lead | None:
        """What this model writes before what a request holds, left free: a reasoning model's <think> block; a harmony
        model's analysis up to its final channel's message, unless what is held is not the `answer` (a grammar that
        names harmony's channels holds the whole reply); None for other models."""
        if self._harmony:
            return Lead(tuple(self._tokenizer.encode(ANSWER_HEADER, add_special_tokens=False))) if answer else None
        think = [self._tokenizer.token_to_id(t) for t in ("<think>", "</think>")]
        return None if None in think else Lead((think[1],), opener=think[0])


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids) -> object:
    """llguidance's view of the engine's tokenizer (each token's bytes, from the tokenizers library's own
    description of it): built once per engine, ~0.2 s for a 150k vocabulary. vocab_size: the logits' width
    (ids past the tokenizer's are never allowed)."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_ids))


# Where a reply stands: it may still open its lead (a thinking block), is inside the lead, or is the document.
START, LEAD, DOCUMENT = "start", "lead", "document"


@dataclass(frozen=True)
class Lead:
    """What a reply writes before its document, unmasked: a reasoning model's thinking (`opener` <think>, the
    marker </think>; a reply that does not open with it is the document at once), or a harmony reply's analysis
    (no opener: everything until the marker <|channel|>final<|message|>). As vLLM's reasoning parsers, the
    document is held from the marker on."""

    marker: tuple[int, ...]
    opener: int | None = None


def schema_grammar(schema: str) -> str:
    """llguidance's grammar for a JSON schema as SamplingParams keeps it (compact JSON text)."""
    from llguidance import LLMatcher

    if schema == "false":
        raise ValueError("json_schema false admits no document")
    try:   # (a boolean schema takes no options: true is the empty schema, any JSON value)
        return LLMatcher.grammar_from_json_schema("{}" if schema == "true" else schema,
                                                  defaults={"whitespace_pattern": JSON_WHITESPACE})
    except ValueError as e:
        raise ValueError(f"json_schema cannot be followed: {str(e).splitlines()[0]}") from None


def lark_grammar(text: str) -> str:
    """llguidance's grammar for a grammar in its Lark dialect or in llama.cpp's GBNF (`root ::= ...`)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return LLMatcher.grammar_from_lark(any_to_lark(text))
    except Exception as e:   # (the GBNF converter raises its own error type)
        raise ValueError(f"grammar cannot be followed: {str(e).splitlines()[0]}") from None


class Constraint:
    """One request's grammar state: which tokens may come next (`mask`) and the tokens it has taken (`advance`).
    grammar: llguidance's (schema_grammar, lark_grammar), `what` named in its errors; lead: what may come before
    the document (None: the reply is the document from its first token); prompt_ids: the prompt's, whose end may
    have opened the lead already (Qwen3-Thinking's template opens <think>)."""

    def __init__(self, grammar_tokenizer, grammar: str, lead: Lead | None = None, prompt_ids: list[int] = (),
                 what: str = "json_schema"):
        from llguidance import LLMatcher

        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, grammar_tokenizer)
        if failed:
            raise ValueError(f"{what} cannot be followed: {messages[0].splitlines()[0]}")
        self.matcher = LLMatcher(grammar_tokenizer, grammar, log_level=0)   # (its warnings would go to stderr)
        if self.matcher.is_error():
            raise ValueError(f"{what} cannot be followed: {self.matcher.get_error().splitlines()[0]}")
        self.vocab_size = grammar_tokenizer.vocab_size
        self._bits = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)
        self.lead = lead
        self.phase, self._tail = DOCUMENT, ()   # _tail: the lead's last tokens, to find its marker
        if lead is not None and lead.opener is None:
            self.phase = LEAD
        elif lead is not None:
            opened = max((i for i, t in enumerate(prompt_ids) if t == lead.opener), default=-1)
            closed = max((i for i, t in enumerate(prompt_ids) if t == lead.marker[-1]), default=-1)
            self.phase = LEAD if opened > closed else START

    def allowed(self) -> np.ndarray | None:
        """A bool per token id: whether it may come next (None: anything may, inside the lead)."""
        from llguidance.numpy import fill_next_token_bitmask

        if self.phase == LEAD:
            return None
        fill_next_token_bitmask(self.matcher, self._bits)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size].view(bool)
        if self.phase == START:
            allowed[self.lead.opener] = True
        return allowed

    def mask(self, row: torch.Tensor | np.ndarray) -> None:
        """Set the logits of the tokens that may not come next to -inf, in place (row: [V], V >= vocab_size; a
        tensor, or the lean engine's numpy row). On the CPU through numpy: torch's masked_fill_ cost ~0.5 ms a step
        here, an OpenMP wake-up included."""
        allowed = self.allowed()
        if allowed is None:
            return
        banned = ~allowed
        if isinstance(row, np.ndarray) or row.device.type == "cpu":
            values = row if isinstance(row, np.ndarray) else row.numpy()   # a view of the engine's logits
            np.putmask(values[:self.vocab_size], banned, -np.inf)
            values[self.vocab_size:] = -np.inf
            return
        import torch

        with torch.inference_mode():   # the engine's logits are inference tensors
            row[:self.vocab_size].masked_fill_(torch.from_numpy(banned).to(row.device), float("-inf"))
            row[self.vocab_size:] = float("-inf")

    def mask_along(self, rows: torch.Tensor, draft: list[int]) -> None:
        """A speculative step's rows ([k + 1, V]): row j masked as the grammar stands after draft[:j], so that
        verification accepts a proposal only where the grammar allows it. Rows past a proposal the grammar refuses
        are left as they are (verification rejects that proposal, and uses no row after it). The state ends as it
        began."""
        phase, tail, taken = self.phase, self._tail, 0
        for j, row in enumerate(rows):
            self.mask(row)
            if j == len(draft):
                break
            if self.phase != DOCUMENT and self._turn(draft[j]):
                continue
            if not self.matcher.validate_tokens([draft[j]]):
                break
            self.matcher.consume_token(draft[j])
            taken += 1
        self.phase, self._tail = phase, tail
        if taken:
            self.matcher.rollback(taken)

    def _turn(self, token: int) -> bool:
        """Outside the document: take `token` if it opens the lead or is part of it (the marker ending it); False
        when it belongs to the document."""
        if self.phase == START:
            if token != self.lead.opener:
                self.phase = DOCUMENT
                return False
            self.phase = LEAD
        marker = self.lead.marker
        self._tail = (*self._tail, token)[-len(marker):]
        if self._tail == marker:
            self.phase = DOCUMENT
        return True

    def advance(self, token: int) -> bool:
        """Take a sampled token; True when the reply must end here (the document is complete and nothing may
        follow it). A token the mask did not allow is an error (the sampler never draws one)."""
        if self.phase != DOCUMENT and self._turn(token):
            return False
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"token {token} broke the reply's JSON schema: {self.matcher.get_error()}")
        return self.matcher.is_stopped()
