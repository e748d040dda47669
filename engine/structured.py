"""Structured output: a request's reply held to a JSON schema (OpenAI's `response_format`), token by token.

llguidance (the grammar engine vLLM, SGLang and llama.cpp use) compiles the schema and, at each step, gives the
set of tokens that keep the reply a prefix of a valid document; the other tokens' logits are set to -inf
before penalties, bias, temperature, top-k and top-p, so a sampled reply follows the model's distribution
restricted to valid continuations and a greedy one takes the likeliest valid token. The reply ends at the
end-of-turn token once the document is complete, or as soon as the grammar admits nothing more. A speculative
step's rows are masked along its proposals (`mask_along`), so verification keeps only what the grammar allows.
A reasoning model thinks freely first: the document is held from its </think> on (`Constraint`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# Whitespace between JSON tokens: a space, or a newline and up to 20 spaces or tabs (llama.cpp's json grammar).
# Pretty-printed documents fit; unbounded whitespace would let a model pad a reply to max_tokens and never close it.
WHITESPACE = r"(?:\x20|\x0A[\x20\x09]{0,20})"


def canonical_schema(schema) -> str:
    """A JSON schema (a dict, or its JSON text) as compact JSON text: SamplingParams keeps it as a
    string (hashable, picklable). A schema must be an object or a boolean."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"))   # key order kept: a model writes properties in it


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids) -> object:
    """llguidance's view of the engine's tokenizer (each token's bytes, from the tokenizers library's own
    description of it): built once per engine, ~0.2 s for a 150k vocabulary. vocab_size: the logits' width
    (ids past the tokenizer's are never allowed)."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_ids))


# Where a reply stands: it may still open a thinking block, is inside one, or is the document.
START, THINKING, DOCUMENT = "start", "thinking", "document"


class Constraint:
    """One request's grammar state: which tokens may come next (`mask`) and the tokens it has taken (`advance`).

    A reasoning model's thinking is left free: `think` = (the <think> id, the </think> id). A reply may open with
    <think> (or start inside the block when the prompt opened it), and the document is held from </think> on, as
    vLLM's reasoning parsers do; a reply that does not think is held from its first token."""

    def __init__(self, grammar_tokenizer, schema: str, think: tuple[int, int] | None = None,
                 prompt_ids: list[int] = ()):
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": WHITESPACE})
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, grammar_tokenizer)
        if failed:
            raise ValueError(f"json_schema cannot be followed: {messages[0].splitlines()[0]}")
        self.matcher = LLMatcher(grammar_tokenizer, grammar, log_level=0)   # (its warnings would go to stderr)
        if self.matcher.is_error():
            raise ValueError(f"json_schema cannot be followed: {self.matcher.get_error().splitlines()[0]}")
        self.vocab_size = grammar_tokenizer.vocab_size
        self._bits = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)
        self.think = think
        self.phase = DOCUMENT
        if think is not None:
            opened, closed = (max((i for i, t in enumerate(prompt_ids) if t == tag), default=-1) for tag in think)
            self.phase = THINKING if opened > closed else START

    def allowed(self) -> np.ndarray | None:
        """A bool per token id: whether it may come next (None: anything may, inside the thinking)."""
        from llguidance.numpy import fill_next_token_bitmask

        if self.phase == THINKING:
            return None
        fill_next_token_bitmask(self.matcher, self._bits)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size].view(bool)
        if self.phase == START:
            allowed[self.think[0]] = True
        return allowed

    def mask(self, row: torch.Tensor) -> None:
        """Set the logits of the tokens that may not come next to -inf, in place (row: [V], V >= vocab_size). On
        the CPU through numpy: torch's masked_fill_ cost ~0.5 ms a step here, an OpenMP wake-up included."""
        import torch

        allowed = self.allowed()
        if allowed is None:
            return
        banned = ~allowed
        if row.device.type == "cpu":
            values = row.numpy()   # a view of the engine's logits
            np.putmask(values[:self.vocab_size], banned, -np.inf)
            values[self.vocab_size:] = -np.inf
            return
        with torch.inference_mode():   # the engine's logits are inference tensors
            row[:self.vocab_size].masked_fill_(torch.from_numpy(banned).to(row.device), float("-inf"))
            row[self.vocab_size:] = float("-inf")

    def mask_along(self, rows: torch.Tensor, draft: list[int]) -> None:
        """A speculative step's rows ([k + 1, V]): row j masked as the grammar stands after draft[:j], so that
        verification accepts a proposal only where the grammar allows it. Rows past a proposal the grammar refuses
        are left as they are (verification rejects that proposal, and uses no row after it). The state ends as it
        began."""
        phase, taken = self.phase, 0
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
        self.phase = phase
        if taken:
            self.matcher.rollback(taken)

    def _turn(self, token: int) -> bool:
        """Outside the document: take `token` if it opens or closes the thinking (or is thinking); False when it
        is neither and so belongs to the document."""
        if self.phase == START:
            if token != self.think[0]:
                self.phase = DOCUMENT
                return False
            self.phase = THINKING
        elif token == self.think[1]:
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
