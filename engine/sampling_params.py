"""Per-request sampling settings."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from nanochat.engine.rules import LOGPROBS, SAMPLING_RULES, SPECULATIVE, check, shown

# SamplingParams.json_schema for OpenAI's {"type": "json_object"}: any JSON object.
ANY_OBJECT = '{"type":"object"}'
# Whitespace between the tokens of a held JSON document (a schema's, or a grammar's %json): a space, or a newline
# and up to 20 spaces or tabs (llama.cpp's json grammar). Pretty-printed documents fit; unbounded whitespace would
# let a model pad a reply to max_tokens and never close it.
JSON_WHITESPACE = r"(?:\x20|\x0A[\x20\x09]{0,20})"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 or 0: disabled
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()        # stop strings (not included in the output text)
    seed: int | None = None
    # Penalties (engine/sampler.py apply_penalties has the definitions): the defaults are off.
    repetition_penalty: float = 1.0   # > 0; HF/CTRL, over prompt + generated tokens
    presence_penalty: float = 0.0     # [-2, 2]; OpenAI/vLLM, over generated tokens
    frequency_penalty: float = 0.0    # [-2, 2]; OpenAI/vLLM, over generated tokens
    # None: none; k: each token's log-probability and the k most likely tokens' (engine/sampler.py token_logprobs)
    logprobs: int | None = None
    # Speculative decoding's proposer for this request: off, ngram or draft; None: the engine's (Config.speculative).
    # It changes speed only: greedy tokens are the same, sampled ones follow the same distribution.
    speculative: str | None = None
    # Added to the logits of these token ids before sampling or greedy, after the penalties (OpenAI's logit_bias:
    # -100 bans a token, 100 all but forces it). A {id: bias} dict is kept as sorted (id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The reply is a JSON document valid under this JSON schema (a dict, or its JSON text; kept as compact JSON
    # text): engine/structured.py. ANY_OBJECT is OpenAI's json_object mode.
    json_schema: str | None = None
    # The answer follows this grammar, as json_schema's does (a model's thinking stays free): llguidance's Lark
    # dialect or llama.cpp's GBNF (engine/structured.py). One that names harmony's channels (<|channel|>) holds a
    # harmony model's whole reply: nanochat serve's forced tool calls.
    grammar: str | None = None

    def __post_init__(self):
        # Accept lists for convenience, keep the object hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        for name, rule in SAMPLING_RULES.items():
            value = getattr(self, name)
            if value is not None or name != "seed":
                check(name, rule, value)
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {shown(self.stop_token_ids)}")
        if any((not isinstance(s, str)) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {shown(self.stop)}")
        if self.logprobs is not None:
            check("logprobs", LOGPROBS, self.logprobs)
        if self.speculative is not None:
            check("speculative", SPECULATIVE, self.speculative)
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _canonical_schema(self.json_schema))
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise ValueError(f"grammar must be a Lark grammar's text, got {shown(self.grammar)}")
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("json_schema and grammar cannot both hold a reply")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Any penalty is on: the sampler needs this request's token ids."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _canonical_schema(schema) -> str:
    """A JSON schema (a dict, or its JSON text) as compact JSON text (hashable, picklable). A schema must be an
    object or a boolean."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"))   # key order kept: a model writes properties in it


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, checked: ids non-negative integers, biases in [-100, 100]."""
    pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
    out = {}
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"logit_bias must map token ids to numbers, got {shown(bias)}")
        token, value = pair
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {shown(token)}")
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                or not -100 <= value <= 100):
            raise ValueError(f"logit_bias values must be numbers from -100 to 100, got {shown(value)}")
        out[token] = float(value)
    return tuple(sorted(out.items()))
