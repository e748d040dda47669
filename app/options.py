"""What every command line shares: value checks, the engine options, and how a flag, the settings
file and the engine's defaults combine.

One rule for every command (`nanochat`, run, repl, info, bench, the TUI): a flag given on the command
line wins, else the settings file's value (app/settings.py; its defaults when there is no file, so
the device is "cpu" unless the settings say otherwise), else, for what neither names, the engine's own
default (engine/config.py). `engine_config` and `sampling_options` apply it.

The value checks serve both argparse (`arg_type(rule)`: a bad flag is a one-line usage error) and the
settings file (`accepts(rule, value)`: a bad value is ignored with a warning). The dtype names and the
device check are the engine's (engine/config.py, which imports no torch), so the command line, the
settings file and Config accept the same values.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, NamedTuple

from nanochat.engine.config import DEVICES, DTYPES, valid_device

DTYPE_NAMES = ("auto", *DTYPES)


# ---------------------------------------------------------------------------------- value checks
class Rule(NamedTuple):
    """A number's type (int or float), its range check and the range in words."""
    cast: type
    ok: Callable[[float], bool]
    text: str


POSITIVE_INT = Rule(int, lambda v: v > 0, "a positive integer")
NON_NEGATIVE_INT = Rule(int, lambda v: v >= 0, "a non-negative integer")
TOP_K = Rule(int, lambda v: v >= -1, "-1 (off) or a positive integer")
TEMPERATURE = Rule(float, lambda v: 0 <= v < math.inf, ">= 0")
TOP_P = Rule(float, lambda v: 0 < v <= 1, "in (0, 1]")
POSITIVE_FLOAT = Rule(float, lambda v: 0 < v < math.inf, "> 0")
SEED = Rule(int, lambda v: 0 <= v < 2 ** 64, "an integer from 0 to 2**64 - 1")


def accepts(rule: Rule, value) -> bool:
    """Whether a value read from JSON satisfies `rule` (an int where the rule wants an int; no bools)."""
    kinds = (int,) if rule.cast is int else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool) and rule.ok(value)


def arg_type(rule: Rule):
    """An argparse `type=` for `rule`: a bad value is a usage error naming the flag."""
    label = "an integer" if rule.cast is int else "a number"

    def parse(raw: str):
        try:
            value = rule.cast(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {label}, got {raw!r}") from None
        if not rule.ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule.text}, got {raw!r}")
        return value

    parse.__name__ = label
    return parse


positive_int = arg_type(POSITIVE_INT)
non_negative_int = arg_type(NON_NEGATIVE_INT)
top_k_int = arg_type(TOP_K)
temperature_float = arg_type(TEMPERATURE)
top_p_float = arg_type(TOP_P)
positive_float = arg_type(POSITIVE_FLOAT)
seed_int = arg_type(SEED)


def device_name(raw: str) -> str:
    """argparse `type=` for --device."""
    if valid_device(raw):
        return raw
    raise argparse.ArgumentTypeError(f"must be {DEVICES}, got {raw!r}")


# ---------------------------------------------------------------------------------- flags
def add_option(parser, suppress: bool, *flags, **kw) -> None:
    """Add a flag unless the parser has it already. suppress: a subcommand's copy of a top-level flag,
    whose SUPPRESS default keeps `nanochat --model M run` from resetting M."""
    kw.setdefault("default", argparse.SUPPRESS if suppress else None)
    try:
        parser.add_argument(*flags, **kw)
    except argparse.ArgumentError:
        pass   # declared already (a subcommand's own help for it)


def add_engine_options(parser, suppress: bool = False) -> None:
    """The flags that choose and configure the engine (every command that loads a model)."""
    add_option(parser, suppress, "--model", "-m", metavar="PATH|HUB_ID",
               help="a .gguf file, a Hugging Face model folder or hub id (default: settings, else built-in SmolLM2)")
    add_option(parser, suppress, "--device", type=device_name, metavar="DEVICE",
               help=f"{DEVICES} (default: settings, else cpu)")
    add_option(parser, suppress, "--dtype", choices=DTYPE_NAMES, help="compute dtype (auto: fp32 on CPU, bf16 on CUDA)")
    add_option(parser, suppress, "--max-model-len", type=positive_int, metavar="N", help="context length in tokens")
    add_option(parser, suppress, "--kv-cache-gib", type=positive_float, metavar="GIB", help="CPU KV-cache budget")
    add_option(parser, suppress, "--dequantize", action="store_true", default=argparse.SUPPRESS if suppress else False,
               help="materialise GGUF weights as dense tensors (more memory, exact fp32/bf16 maths)")
    add_option(parser, suppress, "--quantize", choices=["q8_0"],
               help="quantize a Hugging Face checkpoint's linears to Q8_0 at load (~4x less memory than fp32, "
                    "the fast CPU path)")


# ---------------------------------------------------------------------------------- merging
def pick(args, name: str, default):
    """args.<name> when given (not None, not absent), else `default`."""
    value = getattr(args, name, None)
    return default if value is None else value


def resolve_model(args, settings) -> str:
    """--model, else the settings' default model, else the built-in one (ModelLoadError when none)."""
    from nanochat.models.catalog import resolve_default_model

    return resolve_default_model(getattr(args, "model", None) or settings.default_model)


def engine_config(args, settings, **extra) -> dict:
    """The engine's keyword arguments: each flag over its settings value; what both leave None is left
    to the engine. `extra`: a command's own engine options (the bench's cpu_threads), None values dropped."""
    cfg = {"device": pick(args, "device", settings.device), "dtype": pick(args, "dtype", settings.dtype),
           "max_model_len": pick(args, "max_model_len", settings.max_model_len),
           "kv_cache_gib": pick(args, "kv_cache_gib", settings.kv_cache_gib),
           "dequantize": True if getattr(args, "dequantize", False) else None,
           "quantize": getattr(args, "quantize", None), **extra}
    return {k: v for k, v in cfg.items() if v is not None}


def sampling_options(args, settings) -> dict:
    """SamplingParams keyword arguments: each flag over its settings value (--seed and --ignore-eos
    have none)."""
    opts = {"temperature": pick(args, "temperature", settings.temperature),
            "top_p": pick(args, "top_p", settings.top_p), "top_k": pick(args, "top_k", settings.top_k),
            "max_tokens": pick(args, "max_tokens", settings.max_tokens), "seed": getattr(args, "seed", None)}
    if getattr(args, "ignore_eos", False):
        opts["ignore_eos"] = True
    return opts
