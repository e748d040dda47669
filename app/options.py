"""What every command line shares: value checks, the engine options, and how a flag, the settings
file and the engine's defaults combine.

One rule for every command (`nanochat`, run, repl, info, bench, the TUI): a flag given on the command
line wins, else the settings file's value (app/settings.py; its defaults when there is no file, so
the device is "cpu" unless the settings say otherwise), else, for what neither names, the engine's own
default (engine/config.py). `engine_config` and `sampling_options` apply it. Sampling settings that
neither names come from the model file where it recommends them, else from CHAT_DEFAULTS
(`effective_sampling`, once the model is loaded).

The value rules are the engine's (engine/rules.py; with the dtype names and the device check of
engine/config.py, none of which imports torch): argparse reads them through `arg_type(rule)` (a bad flag
is a one-line usage error), the settings file through `accepts` (a bad value is ignored with a warning),
and SamplingParams and Config check with them, so every place accepts the same values.
"""

from __future__ import annotations

import argparse
import os

from nanochat.app.errors import UsageError
from nanochat.engine.config import DEVICES, DTYPES, Config, names_a_model, valid_device
from nanochat.engine.rules import (KV_CACHE_GIB, NON_NEGATIVE_INT, PENALTY, POOLINGS, POSITIVE_INT, REASONING_EFFORT,
                                   REPETITION_PENALTY, SAMPLING_RULES, SEED, SPECULATIVE, SPECULATIVE_K, TEMPERATURE,
                                   TEMPLATE_RULES, THREADS, TOP_K, TOP_P, Rule, accepts, shown)
from nanochat.engine.sampling_params import ANY_OBJECT, SamplingParams

DTYPE_NAMES = ("auto", *DTYPES)

# The bench builds every prompt in memory before the first step, so sizes past these hang it after the
# model loaded (--num-seqs 10**100): 2**20 tokens is past every supported model's context.
BENCH_TOKENS = Rule(int, lambda v: 1 <= v <= 2 ** 20, "from 1 to 1048576 (tokens)")
BENCH_COUNT = Rule(int, lambda v: 1 <= v <= 2 ** 16, "from 1 to 65536")
BENCH_WARMUP = Rule(int, lambda v: 0 <= v <= 2 ** 16, "from 0 to 65536")


def arg_type(rule: Rule):
    """An argparse `type=` for `rule`: a bad value is a usage error naming the flag."""
    label = {int: "an integer", str: "a word"}.get(rule.cast, "a number")

    def parse(raw: str):
        try:
            value = rule.cast(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {label}, got {shown(raw)}") from None
        if not rule.ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule.text}, got {shown(raw)}")
        return value

    parse.__name__ = label
    return parse


positive_int = arg_type(POSITIVE_INT)
non_negative_int = arg_type(NON_NEGATIVE_INT)
top_k_int = arg_type(TOP_K)
temperature_float = arg_type(TEMPERATURE)
top_p_float = arg_type(TOP_P)
repetition_penalty_float = arg_type(REPETITION_PENALTY)
penalty_float = arg_type(PENALTY)
kv_cache_gib_float = arg_type(KV_CACHE_GIB)
seed_int = arg_type(SEED)
threads_int = arg_type(THREADS)
bench_tokens_int = arg_type(BENCH_TOKENS)
bench_count_int = arg_type(BENCH_COUNT)
bench_warmup_int = arg_type(BENCH_WARMUP)
reasoning_effort_word = arg_type(REASONING_EFFORT)
speculative_k_int = arg_type(SPECULATIVE_K)

# SamplingParams fields a chat (/set) or an API request may state that are not sampling: the request's
# speculative proposer (off, ngram, or the engine's draft model).
REQUEST_RULES = {"speculative": SPECULATIVE}
# SamplingParams fields a chat (/set) may state that hold its replies, as --json-schema and --grammar hold a
# one-shot's: their values are texts (a schema, a grammar), checked by SamplingParams, not by a rule.
REPLY_FORMATS = ("json_schema", "grammar")


def speculative_arg(raw: str) -> str:
    """argparse `type=` for --speculative: auto, off, ngram (any case), or what Config accepts as a draft model
    (engine/config.py names_a_model: a .gguf file, a model folder, a hub id), passed through."""
    word = raw.strip().lower()
    if word in ("auto", "off", "ngram"):
        return word
    if word in ("draft", "on"):
        raise argparse.ArgumentTypeError(f"say which proposer: ngram, or a draft model's path or hub id, got {shown(raw)}")
    if names_a_model(raw):
        return raw
    why = "" if not word else " (no such file)" if not os.path.exists(os.path.expanduser(raw)) \
        else " (not a .gguf file or a model folder)"
    raise argparse.ArgumentTypeError(f"must be auto, off, ngram or a draft model's path or hub id, got {shown(raw)}{why}")


def speculative_refusal(mode: str | None, modes: tuple, command: str = "nanochat") -> str | None:
    """Why a request's proposer `mode` (None: the engine's) cannot run on an engine whose requests may pick
    `modes` (ModelInfo.speculative_modes), in one line; None when it can. `command`: what the user starts, for
    the advice."""
    if mode is None or mode in modes:
        return None
    if mode == "draft":
        return f"speculative draft needs a draft model: start {command} with --speculative PATH_TO_DRAFT"
    return "this model cannot speculate (its recurrent state cannot be cut back to the accepted tokens)"


def device_name(raw: str) -> str:
    """argparse `type=` for --device."""
    if valid_device(raw):
        return raw
    raise argparse.ArgumentTypeError(f"must be {DEVICES}, got {shown(raw)}")


def argv_text(raw: str) -> str:
    """argparse `type=` for free text (--prompt, --system): bytes that are not UTF-8 (kept by Python as
    surrogates) become U+FFFD, as everywhere else nanochat reads text, so they cannot fail later."""
    return raw.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def json_schema_arg(raw: str) -> str:
    """argparse `type=` for --json-schema: `object` (any JSON object), @FILE (a schema file) or the schema's JSON
    text; checked here as JSON (whether it can be followed is the engine's check, at the request)."""
    return ANY_OBJECT if raw == "object" else _held_arg(raw, "json_schema")


def grammar_arg(raw: str) -> str:
    """argparse `type=` for --grammar: @FILE (a grammar file) or the grammar's text, GBNF or Lark (whether it can
    be followed is the engine's check, at the request)."""
    return _held_arg(raw, "grammar")


def held_reply_value(name: str, raw: str) -> str:
    """--json-schema's or --grammar's value (`name`: the SamplingParams field), from what a user typed (/set);
    ValueError with one line when it is refused."""
    try:
        return (json_schema_arg if name == "json_schema" else grammar_arg)(raw)
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None


def _held_arg(raw: str, field: str) -> str:
    """What holds a one-shot's reply (SamplingParams' json_schema or grammar), from its text or @FILE."""
    if raw.startswith("@"):
        try:
            with open(os.path.expanduser(raw[1:]), encoding="utf-8") as f:
                raw = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"cannot read {shown(raw[1:])} ({e.__class__.__name__})") from None
    try:
        return getattr(SamplingParams(**{field: raw}), field)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def name_arg(raw: str) -> str:
    """argparse `type=` for --model and --out: an empty value (`--model "$UNSET"`) is refused, not read
    as "the default"."""
    if raw.strip():
        return raw
    raise argparse.ArgumentTypeError("must not be empty")


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
    add_option(parser, suppress, "--model", "-m", type=name_arg, metavar="PATH|HUB_ID",
               help="a .gguf file, a Hugging Face model folder or hub id (default: settings, else built-in SmolLM2)")
    add_option(parser, suppress, "--device", type=device_name, metavar="DEVICE",
               help=f"{DEVICES} (default: settings, else cpu)")
    add_option(parser, suppress, "--dtype", choices=DTYPE_NAMES, help="compute dtype (auto: fp32 on CPU, bf16 on CUDA)")
    add_option(parser, suppress, "--max-model-len", type=positive_int, metavar="N", help="context length in tokens")
    add_option(parser, suppress, "--kv-cache-gib", type=kv_cache_gib_float, metavar="GIB", help="CPU KV-cache budget")
    add_option(parser, suppress, "--dequantize", action="store_true", default=argparse.SUPPRESS if suppress else False,
               help="materialise GGUF weights as dense tensors (more memory, exact fp32/bf16 maths)")
    add_option(parser, suppress, "--tensor-parallel-size", "-tp", type=positive_int, metavar="N",
               help="split the model over N ranks (GPUs, or CPU processes); under torchrun, its WORLD_SIZE")
    add_option(parser, suppress, "--speculative", type=speculative_arg, metavar="auto|ngram|off|PATH",
               help="speculative decoding: auto (the default: prompt lookup where it is exact, weights on the CPU "
                    "kernels), ngram (prompt lookup), off, or a draft model's path or hub id (same tokenizer)")
    add_option(parser, suppress, "--speculative-k", type=speculative_k_int, metavar="N",
               help=f"most tokens proposed per step ({SPECULATIVE_K.text}; default 8)")
    add_option(parser, suppress, "--chat-template", type=name_arg, metavar="FILE",
               help="a Jinja chat template file to use instead of the model's (one that renders tools, say)")
    add_option(parser, suppress, "--pooling", choices=["auto", *POOLINGS],
               help="embeddings' pooling of the final hidden states when a request names none (auto: the model's "
                    "files' own, else mean)")
    add_option(parser, suppress, "--quantize", choices=["q8_0"],
               help="quantize a Hugging Face checkpoint's linears to Q8_0 at load (~4x less memory than fp32, "
                    "the fast CPU path)")


# ---------------------------------------------------------------------------------- merging
def pick(args, name: str, default):
    """args.<name> when given (not None, not absent), else `default`."""
    value = getattr(args, name, None)
    return default if value is None else value


def resolve_model(args, settings) -> str:
    """--model, else the settings' default model, else the built-in one (ModelLoadError when none). A hub GGUF
    (`REPO:QUANT`) is fetched first, with progress on stderr unless --quiet."""
    from nanochat.app.fetch import materialize
    from nanochat.models.formats.catalog import resolve_default_model

    model = getattr(args, "model", None) or settings.default_model
    return resolve_default_model(materialize(model, quiet=bool(getattr(args, "quiet", False))))


def engine_config(args, settings, **extra) -> dict:
    """The engine's keyword arguments: each flag over its settings value; what both leave None is left
    to the engine. `extra`: a command's own engine options (the bench's cpu_threads and limits; they win),
    None values dropped. Checked here with the engine's own Config, environment included, so a bad
    NANO_VLLM_* value or flag combination is a usage error before any engine starts (UsageError)."""
    cfg = {"device": pick(args, "device", settings.device), "dtype": pick(args, "dtype", settings.dtype),
           "max_model_len": pick(args, "max_model_len", settings.max_model_len),
           "kv_cache_gib": pick(args, "kv_cache_gib", settings.kv_cache_gib),
           "dequantize": True if getattr(args, "dequantize", False) else None,
           "quantize": getattr(args, "quantize", None),
           "speculative": pick(args, "speculative", settings.speculative),
           "speculative_k": pick(args, "speculative_k", settings.speculative_k),
           "tensor_parallel_size": getattr(args, "tensor_parallel_size", None),
           "pooling": getattr(args, "pooling", None),
           "chat_template": _absolute(getattr(args, "chat_template", None)), **extra}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    try:
        Config.create("", **cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return cfg


def model_config(engine_config: dict, model: str, template_model: str | None) -> dict:
    """The engine options to load `model` with: --chat-template's file only for the model it was given with
    (`template_model`); a model switched to renders with its own template."""
    if model == template_model:
        return dict(engine_config)
    return {k: v for k, v in engine_config.items() if k != "chat_template"}


def _absolute(path: str | None) -> str | None:
    """A path given on the command line, as the engine process (another working directory, perhaps) finds it."""
    return None if path is None else os.path.abspath(os.path.expanduser(path))


# What a chat samples with where neither the user nor the model file says (SamplingParams' own defaults,
# 1.0 and 64 tokens, suit the API, not a chat).
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 512}


# Chat settings that are variables of the chat template, not sampling: /think on|off sets
# enable_thinking, which reasoning models' templates (Qwen3, SmolLM3) read.
TEMPLATE_SWITCHES = {"think": "enable_thinking"}


def on_off(raw: str) -> bool:
    """A switch typed as text: on/off (yes/no, true/false, 1/0); ValueError with one line otherwise."""
    value = {"on": True, "yes": True, "true": True, "1": True,
             "off": False, "no": False, "false": False, "0": False}.get(raw.strip().lower())
    if value is None:
        raise ValueError(f"expected on or off, got {shown(raw)}")
    return value


def template_variables(settings: dict) -> dict:
    """The chat template variables a chat's settings set: its switches (/think) and its TEMPLATE_RULES
    settings (/set reasoning_effort). A value its rule refuses is ignored: a damaged settings value."""
    switches = {variable: settings[name] for name, variable in TEMPLATE_SWITCHES.items()
                if isinstance(settings.get(name), bool)}
    return {**switches, **{name: settings[name] for name, rule in TEMPLATE_RULES.items()
                           if name in settings and accepts(rule, settings[name])}}


def sampling_options(args, settings) -> dict:
    """The SamplingParams keyword arguments the user states: each flag over its settings value (--seed and
    --ignore-eos have none); what neither states is left out, for `effective_sampling` to fill."""
    opts = {name: pick(args, name, getattr(settings, name)) for name in SAMPLING_RULES if name != "seed"}
    opts["seed"] = getattr(args, "seed", None)
    if getattr(args, "ignore_eos", False):
        opts["ignore_eos"] = True
    opts["json_schema"] = getattr(args, "json_schema", None)   # one-shots only
    opts["grammar"] = getattr(args, "grammar", None)
    opts = {k: v for k, v in opts.items() if v is not None}
    try:   # every command checks them before it loads a model
        SamplingParams(**effective_sampling(opts))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return opts


def effective_sampling(stated: dict, recommended: dict | None = None) -> dict:
    """What a turn samples with: what the user states, over what the model file recommends, over
    CHAT_DEFAULTS."""
    return {**CHAT_DEFAULTS, **(recommended or {}), **stated}
