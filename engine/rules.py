"""The one table of value rules for every option a user can state: SamplingParams and Config check
their fields with it, and the front ends read the same rules for argparse, settings.json, `/set` and
the HTTP API (app/options.py), so every place accepts the same values and words a refusal the same way.
Imports no torch."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple


def shown(value, limit: int = 60) -> str:
    """repr(value) for a one-line message, cut after `limit` characters (a 100 kB value stays readable)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class Rule(NamedTuple):
    """A value's type (int, float, or str for a word from a list), its check and the allowed values in words."""
    cast: type
    ok: Callable[[float], bool]
    text: str


def accepts(rule: Rule, value) -> bool:
    """Whether a value (from Python or JSON) satisfies `rule`: an int where the rule wants an int, no
    bools, no NaN."""
    kinds = (int,) if rule.cast is int else (str,) if rule.cast is str else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool) and bool(rule.ok(value))


def check(name: str, rule: Rule, value) -> None:
    """ValueError("<name> must be <rule>, got <value>") unless `rule` accepts `value`."""
    if not accepts(rule, value):
        raise ValueError(f"{name} must be {rule.text}, got {shown(value)}")


# Below this the logits / temperature overflow (1e-300 made the sampler's softmax NaN); vLLM's floor
# too. Such a temperature is greedy in all but name, and 0 says so.
MIN_TEMPERATURE = 0.01
MAX_LOGPROBS = 20   # alternatives per token a request may ask for (OpenAI's top_logprobs limit)
MAX_CPU_THREADS = 1024          # 100000 threads crashed the engine process (SIGSEGV); 10**100 overflowed torch
MAX_KV_CACHE_GIB = 2 ** 20      # 1 PiB, past any machine; the budget in bytes (x 2**30) must stay a finite float
MAX_TP = 64

POSITIVE_INT = Rule(int, lambda v: v > 0, "a positive integer")
NON_NEGATIVE_INT = Rule(int, lambda v: v >= 0, "a non-negative integer")
TOP_K = Rule(int, lambda v: v >= -1, "-1 or 0 (off) or a positive integer")
TEMPERATURE = Rule(float, lambda v: v == 0 or MIN_TEMPERATURE <= v < math.inf,
                   f"0 (greedy) or from {MIN_TEMPERATURE} up")
TOP_P = Rule(float, lambda v: 0 < v <= 1, "in (0, 1]")
REPETITION_PENALTY = Rule(float, lambda v: 0 < v < math.inf, "a number > 0 (1 is off)")
PENALTY = Rule(float, lambda v: -2 <= v <= 2, "from -2 to 2 (0 is off)")   # presence, frequency (OpenAI's range)
SEED = Rule(int, lambda v: 0 <= v < 2 ** 64, "an integer from 0 to 2**64 - 1")
LOGPROBS = Rule(int, lambda v: 0 <= v <= MAX_LOGPROBS, f"an integer from 0 to {MAX_LOGPROBS}")   # alternatives per token
KV_CACHE_GIB = Rule(float, lambda v: 0 < v <= MAX_KV_CACHE_GIB, f"> 0 and at most {MAX_KV_CACHE_GIB} (1 PiB)")
THREADS = Rule(int, lambda v: 1 <= v <= MAX_CPU_THREADS, f"from 1 to {MAX_CPU_THREADS}")
TP_SIZE = Rule(int, lambda v: 1 <= v <= MAX_TP, f"from 1 to {MAX_TP}")
FRACTION = Rule(float, lambda v: 0 < v <= 1, "in (0, 1]")

# Speculative decoding (engine/speculative.py): a request's proposer; the engine's is one of these or a draft
# model's path (Config.speculative).
SPECULATIVE_MODES = ("off", "ngram", "draft")
SPECULATIVE = Rule(str, lambda v: v in SPECULATIVE_MODES, "off, ngram or draft")
POOLINGS = ("mean", "cls", "last")   # how an embedding pools a prompt's final hidden states (engine/pooling.py)
POOLING = Rule(str, lambda v: v in POOLINGS, "one of mean, cls, last")
SPECULATIVE_K = Rule(int, lambda v: 1 <= v <= 32, "from 1 to 32")

# Every sampling setting a user can state (flags, settings.json, a chat's /set, the HTTP API).
SAMPLING_RULES = {"temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K, "seed": SEED,
                  "max_tokens": POSITIVE_INT, "repetition_penalty": REPETITION_PENALTY,
                  "presence_penalty": PENALTY, "frequency_penalty": PENALTY}

# Chat settings that are chat template variables, not sampling (a chat's /set, a one-shot's flag):
# reasoning_effort is what gpt-oss's harmony template writes into its system message ("Reasoning: high").
REASONING_EFFORTS = ("low", "medium", "high")
REASONING_EFFORT = Rule(str, lambda v: v in REASONING_EFFORTS, "low, medium or high")
TEMPLATE_RULES = {"reasoning_effort": REASONING_EFFORT}
