"""Benchmark workloads for the engine: batch throughput (nano-vllm's bench.py) and multi-turn chat.

Pure engine code, no printing: it runs inside the engine process (EngineClient.bench), where
`run_bench` / `run_multi_turn` drive the LLMEngine to the end, report progress through a callback
and stop at a `threading.Event`.

Workload (compatible with nano-vllm's bench.py): a `random.Random(seed)` draws, per request, the
input length `randint(100, max_input_len)` then the prompt ids `randint(0, 10000)`, and after all
prompts the output lengths `randint(100, max_output_len)`; every request samples at temperature
0.6 with ignore_eos, so it generates exactly its output length. Below 100 the lengths are drawn
from [1, max] instead. Measured iteration i uses seed + i (iteration 0 is bench.py's workload),
warmup iterations use other seeds, so no iteration hits blocks cached by an earlier one.

Speculative decoding: `speculative` names the requests' proposer (SamplingParams.speculative; None: the
engine's), and the report counts its proposals. A comparison runs the spec twice on one engine, the second
time with another `variant`: the same lengths, other prompt ids, so it finds none of the first run's prompts
in the prefix cache.
"""

from __future__ import annotations

import itertools
import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable

from nanochat.engine.output import Reply
from nanochat.engine.rules import SPECULATIVE, accepts
from nanochat.engine.sampling_params import SamplingParams

WORKLOADS = ("random", "nano-vllm")
PROMPT_ID_MAX = 10000           # bench.py draws prompt ids from [0, 10000]
MIN_RANDOM_LEN = 100            # bench.py draws lengths from [100, max]
NANO_VLLM_BATCHED_TOKENS = 16384   # nano-vllm's Config default (bench.py does not set it)
_WARMUP_SEED_STRIDE = 1_000_003


class BenchCancelled(Exception):
    """The cancel event was set; the bench's requests were aborted."""


class BenchError(RuntimeError):
    """The engine cannot run this bench (busy, context too small, a request failed)."""


# ---------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class Tier:
    name: str
    num_seqs: int
    max_model_len: int
    max_input_len: int
    max_output_len: int
    warmup: int
    iters: int


TIERS = {
    "fast": Tier("fast", 8, 128, 64, 64, 0, 1),
    "normal": Tier("normal", 16, 512, 256, 256, 1, 1),
    "heavy": Tier("heavy", 16, 1024, 512, 512, 1, 3),
}
DEFAULT_TIER = "fast"

# nano-vllm's bench.py: 256 requests, lengths up to 1024, max_model_len 4096, one warmup request.
NANO_VLLM_PRESET = dict(num_seqs=256, max_input_len=1024, max_output_len=1024, max_model_len=4096,
                        max_batched_tokens=NANO_VLLM_BATCHED_TOKENS, warmup=1, iters=1, seed=0)


@dataclass(frozen=True)
class BenchSpec:
    num_seqs: int = 8
    max_input_len: int = 64
    max_output_len: int = 64
    max_model_len: int = 128
    max_batched_tokens: int | None = None   # None: num_seqs * max_input_len, at least max_model_len
    warmup: int = 0
    iters: int = 1
    seed: int = 0
    fixed_lengths: bool = False
    workload: str = "random"
    tier: str | None = None                 # informational: the preset it came from
    speculative: str | None = None          # the requests' proposer: off, ngram or draft; None: the engine's
    variant: int = 0                        # > 0: other prompt ids of the same lengths (a second run's)

    def __post_init__(self):
        for name in ("num_seqs", "max_input_len", "max_output_len", "max_model_len", "iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("warmup", "seed", "variant"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.max_batched_tokens is not None and (not isinstance(self.max_batched_tokens, int)
                                                    or self.max_batched_tokens < 1):
            raise ValueError(f"max-batched-tokens must be a positive integer, got {self.max_batched_tokens!r}")
        if self.speculative is not None and not accepts(SPECULATIVE, self.speculative):
            raise ValueError(f"speculative must be {SPECULATIVE.text}, got {self.speculative!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.max_input_len + self.max_output_len > self.max_model_len:
            raise ValueError(f"max-input-len + max-output-len ({self.max_input_len} + {self.max_output_len}) "
                             f"exceeds max-model-len {self.max_model_len}")

    @property
    def batched_tokens(self) -> int:
        """The engine's per-step token budget for this spec."""
        if self.max_batched_tokens is not None:
            return self.max_batched_tokens
        return max(self.num_seqs * self.max_input_len, self.max_model_len)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["max_batched_tokens"] = self.batched_tokens
        return d


def spec_from(tier: str | None = None, **overrides) -> BenchSpec:
    """A spec from a tier preset (default "fast"); overrides that are not None win.

    workload="nano-vllm" replaces the tier with bench.py's settings. When max_model_len is not
    given it grows to hold max_input_len + max_output_len."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    known = {f.name for f in fields(BenchSpec)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown bench option(s): {', '.join(sorted(unknown))}")
    name = tier or DEFAULT_TIER
    if name not in TIERS:
        raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {name!r}")
    t = TIERS[name]
    base = dict(num_seqs=t.num_seqs, max_input_len=t.max_input_len, max_output_len=t.max_output_len,
                max_model_len=t.max_model_len, warmup=t.warmup, iters=t.iters, tier=name)
    if overrides.get("workload") == "nano-vllm":
        base = dict(NANO_VLLM_PRESET, tier=None)
    values = {**base, **overrides}
    if "max_model_len" not in overrides:
        values["max_model_len"] = max(values["max_model_len"], values["max_input_len"] + values["max_output_len"])
    return BenchSpec(**values)


# ---------------------------------------------------------------------------------- workload
@dataclass
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def expected_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)


def _length(rng: random.Random, maximum: int, fixed: bool) -> int:
    if fixed:
        return maximum
    return rng.randint(MIN_RANDOM_LEN if maximum >= MIN_RANDOM_LEN else 1, maximum)


def make_workload(spec: BenchSpec, vocab_size: int, seed: int | None = None) -> Workload:
    """The requests of one iteration, drawn in bench.py's order (all prompts, then all output lengths)."""
    seed = spec.seed if seed is None else seed
    rng = random.Random(seed)
    # A variant draws its ids apart, and the lengths as the spec's own workload does.
    ids = rng if not spec.variant else random.Random(f"{seed}/{spec.variant}")
    prompts = []
    for _ in range(spec.num_seqs):
        n = _length(rng, spec.max_input_len, spec.fixed_lengths)
        drawn = [rng.randint(0, PROMPT_ID_MAX) for _ in range(n)]
        if ids is not rng:
            drawn = [ids.randint(0, PROMPT_ID_MAX) for _ in range(n)]
        # Ids at or above a small test vocabulary are folded into it (real vocabularies are > 10000).
        prompts.append([t % vocab_size for t in drawn])
    params = [SamplingParams(temperature=0.6, ignore_eos=True, speculative=spec.speculative,
                             max_tokens=_length(rng, spec.max_output_len, spec.fixed_lengths))
              for _ in range(spec.num_seqs)]
    return Workload(prompts, params)


def nano_vllm_warmup(tokenizer) -> Workload:
    """bench.py's warmup: one "Benchmark: " prompt with default sampling (64 tokens at temperature 1)."""
    return Workload([tokenizer.encode("Benchmark: ")], [SamplingParams(max_tokens=64)])


# ---------------------------------------------------------------------------------- results
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _summary_ms(values_s: list[float]) -> dict:
    ms = [v * 1000 for v in values_s]
    return {"mean": sum(ms) / len(ms) if ms else None,
            "p50": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


@dataclass
class IterationResult:
    iteration: int
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    elapsed_s: float
    throughput_tok_s: float          # generated tokens / elapsed
    prefill_tokens: int              # tokens prefilled by the engine (recomputation included)
    prefill_time_s: float
    prefill_tok_s: float
    decode_tokens: int
    decode_time_s: float
    decode_tok_s: float
    ttft_ms: dict                    # {"mean", "p50", "p90", "p99"}
    tpot_ms: dict                    # per request (elapsed - ttft) / (n - 1)
    preemptions: int
    spec_proposed: int = 0           # speculative decoding: tokens proposed, and accepted
    spec_accepted: int = 0
    spec_tokens_per_step: float = 1.0   # decode tokens a request got per step of the model (1: no speculation)

    def to_dict(self) -> dict:
        return asdict(self)


_MEAN_FIELDS = ("generated_tokens", "elapsed_s", "throughput_tok_s", "prefill_tok_s", "decode_tok_s",
                "prompt_tokens", "cached_tokens", "prefill_tokens", "decode_tokens", "prefill_time_s",
                "decode_time_s", "preemptions", "spec_proposed", "spec_accepted", "spec_tokens_per_step")


def mean_of(iterations: list[IterationResult]) -> dict:
    """Field-wise mean over iterations (percentiles averaged per key)."""
    if not iterations:
        return {}
    n = len(iterations)
    out: dict = {"iterations": n}
    for name in _MEAN_FIELDS:
        out[name] = sum(getattr(it, name) for it in iterations) / n
    for name in ("ttft_ms", "tpot_ms"):
        out[name] = {}
        for key in ("mean", "p50", "p90", "p99"):
            vals = [getattr(it, name)[key] for it in iterations if getattr(it, name)[key] is not None]
            out[name][key] = sum(vals) / len(vals) if vals else None
    return out


@dataclass
class BenchReport:
    spec: BenchSpec
    model: str
    device: str
    engine: dict
    iterations: list[IterationResult] = field(default_factory=list)

    @property
    def mean(self) -> dict:
        return mean_of(self.iterations)

    def to_dict(self) -> dict:
        return {"spec": self.spec.to_dict(), "model": self.model, "device": self.device, "engine": self.engine,
                "iterations": [it.to_dict() for it in self.iterations], "mean": self.mean}


@dataclass
class BenchProgress:
    """What a progress callback receives (after every engine step and at phase boundaries)."""

    phase: str                 # "warmup" | "measure" | "turn" | "replay"
    index: int                 # iteration (or turn) within the phase, 0-based
    count: int                 # iterations (or turns) in the phase
    done_tokens: int           # generated so far in this iteration / turn
    total_tokens: int          # expected in this iteration / turn
    finished_requests: int
    total_requests: int
    elapsed_s: float           # since this iteration / turn started


ProgressFn = Callable[[BenchProgress], None]


# ---------------------------------------------------------------------------------- engine plumbing
def engine_summary(engine) -> dict:
    import torch

    cfg = engine.config
    return {"max_num_seqs": cfg.max_num_seqs, "max_model_len": cfg.max_model_len,
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "kvcache_block_size": cfg.kvcache_block_size,
            "num_kvcache_blocks": len(engine.block_manager.blocks),
            "enable_prefix_caching": cfg.enable_prefix_caching, "dtype": str(engine.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads() if engine.device.type == "cpu" else None}


def model_name(engine) -> str:
    """The model file or folder name (GGUF general.name is often a training-run id), else the config's."""
    import os

    path = str(engine.config.model or "").rstrip("/")
    return os.path.basename(path) or getattr(engine.model_config, "name", "") or "model"


def engine_limits(spec: BenchSpec) -> dict:
    """Engine config for a bench: the sequence cap, context and step budget come from `spec`."""
    return dict(max_num_seqs=spec.num_seqs, max_model_len=spec.max_model_len,
                max_num_batched_tokens=spec.batched_tokens)


def make_bench_engine(model: str, spec: BenchSpec, **config):
    """An in-process LLMEngine for `spec` (its limits win over config): tests and scripts."""
    from nanochat.engine.llm_engine import LLMEngine

    return LLMEngine(model, **{**config, **engine_limits(spec)})


def _check_idle(engine) -> None:
    if engine.has_unfinished():
        raise BenchError("the engine is busy with other requests; wait for them to finish")


@dataclass
class _Timing:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0

    def step(self, engine) -> list:
        p0, d0 = engine.total_prefill_tokens, engine.total_decode_tokens
        t0 = time.perf_counter()
        events = engine.step()
        dt = time.perf_counter() - t0
        p, d = engine.total_prefill_tokens - p0, engine.total_decode_tokens - d0
        if p + d:   # split a mixed step's time by token share, as the engine's own gauges do
            self.prefill_time += dt * p / (p + d)
            self.decode_time += dt * d / (p + d)
        self.prefill_tokens += p
        self.decode_tokens += d
        return events


_batch_ids = itertools.count(1)   # unique request ids across batches


class _Batch:
    """One batch of requests in flight on an engine, stepped to completion."""

    def __init__(self, engine, prompts, params, session_ids=None, prefix: str = "bench"):
        self.engine = engine
        self.timing = _Timing()
        self.total_tokens = sum(p.max_tokens for p in params)
        self.done_tokens = 0
        self.replies: dict[str, Reply] = {}
        self.order: list[str] = []
        self.preempt0 = engine.scheduler.num_preemptions
        self.start, self.end = time.perf_counter(), None
        session_ids = session_ids or [None] * len(prompts)
        try:
            for i, (ids, sp, sid) in enumerate(zip(prompts, params, session_ids)):
                rid = f"{prefix}-{next(_batch_ids)}-{i}"
                engine.add_request(ids, sp, request_id=rid, session_id=sid)
                self.order.append(rid)
                self.replies[rid] = Reply()
        except Exception:
            self.abort()
            raise

    @property
    def num_finished(self) -> int:
        return sum(1 for r in self.replies.values() if r.done)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.order)

    def step(self) -> None:
        for ev in self.timing.step(self.engine):
            reply = self.replies.get(ev.request_id)
            if reply is None or reply.done:
                continue   # not ours (the bench runs on an idle engine, but be safe)
            self.done_tokens += ev.token_id is not None
            if reply.add(ev).done and ev.finish_reason == "error":
                self.abort()
                raise BenchError(ev.error or "a bench request failed")
        if self.finished:
            self.end = time.perf_counter()

    def abort(self) -> None:
        for rid, reply in self.replies.items():
            if not reply.done:
                self.engine.abort(rid)

    @property
    def elapsed(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def stats(self) -> list:
        return [self.replies[rid].stats for rid in self.order]



def _iteration_result(index: int, batch: _Batch) -> IterationResult:
    stats = batch.stats()
    generated = sum(s.completion_tokens for s in stats)
    ttfts = [s.ttft for s in stats if s.ttft is not None]
    tpots = [(s.elapsed - s.ttft) / (s.completion_tokens - 1)
             for s in stats if s.ttft is not None and s.completion_tokens > 1]
    # Each decode step gives a request one token of the model's and its accepted proposals; the first token
    # came from the prefill.
    decoded = sum(max(0, s.completion_tokens - 1) for s in stats)
    accepted = sum(s.spec_accepted for s in stats)
    t = batch.timing
    return IterationResult(
        iteration=index, num_requests=len(stats), prompt_tokens=sum(s.prompt_tokens for s in stats),
        cached_tokens=sum(s.cached_tokens for s in stats), generated_tokens=generated,
        elapsed_s=batch.elapsed, throughput_tok_s=generated / batch.elapsed if batch.elapsed else 0.0,
        prefill_tokens=t.prefill_tokens, prefill_time_s=t.prefill_time,
        prefill_tok_s=t.prefill_tokens / t.prefill_time if t.prefill_time else 0.0,
        decode_tokens=t.decode_tokens, decode_time_s=t.decode_time,
        decode_tok_s=t.decode_tokens / t.decode_time if t.decode_time else 0.0,
        ttft_ms=_summary_ms(ttfts), tpot_ms=_summary_ms(tpots),
        preemptions=batch.engine.scheduler.num_preemptions - batch.preempt0,
        spec_proposed=sum(s.spec_proposed for s in stats), spec_accepted=accepted,
        spec_tokens_per_step=decoded / (decoded - accepted) if decoded > accepted else 1.0)


# ---------------------------------------------------------------------------------- batch bench
class BenchRunner:
    """A bench run one engine step at a time: `while runner.step(): ...`, then `runner.report`.

    Must run on the thread that owns the engine (the engine process's loop). `cancel()` aborts the
    requests in flight and makes the next `step` raise BenchCancelled."""

    def __init__(self, engine, spec: BenchSpec, progress: ProgressFn | None = None,
                 cancel: threading.Event | None = None):
        _check_idle(engine)
        limit = engine.config.max_model_len
        if spec.max_input_len + spec.max_output_len > limit:
            raise BenchError(f"the engine's context is {limit} tokens (max_model_len), but the bench needs "
                             f"{spec.max_input_len} + {spec.max_output_len}; lower --max-input-len/--max-output-len")
        self.engine, self.spec = engine, spec
        self.progress_fn, self.cancel_event = progress, cancel or threading.Event()
        self.vocab = engine.model_config.vocab_size
        self.phases = [("warmup", i) for i in range(spec.warmup)] + [("measure", i) for i in range(spec.iters)]
        self.report = BenchReport(spec, model_name(engine), str(engine.device), engine_summary(engine))
        self._phase = 0
        self._batch: _Batch | None = None

    def workload(self, phase: str, index: int) -> Workload:
        if phase == "warmup":
            if self.spec.workload == "nano-vllm":
                return nano_vllm_warmup(self.engine.tokenizer)
            return make_workload(self.spec, self.vocab, self.spec.seed + _WARMUP_SEED_STRIDE * (index + 1))
        return make_workload(self.spec, self.vocab, self.spec.seed + index)

    @property
    def done(self) -> bool:
        return self._phase >= len(self.phases)

    def cancel(self) -> None:
        self.cancel_event.set()

    def abort(self) -> None:
        """Drop the requests in flight (after a failure or an interrupt); the engine is idle again."""
        if self._batch is not None:
            self._batch.abort()
            self._batch = None

    def step(self) -> bool:
        """Advance by one engine step; False once every iteration has run."""
        if self.cancel_event.is_set():
            self.abort()
            raise BenchCancelled("bench cancelled")
        if self.done:
            return False
        phase, index = self.phases[self._phase]
        if self._batch is None:
            w = self.workload(phase, index)
            self._batch = _Batch(self.engine, w.prompts, w.params)
            self._notify(phase, index)
        try:
            self._batch.step()
        except BaseException:   # an engine error or an interrupt: leave no request behind
            self.abort()
            raise
        self._notify(phase, index)
        if self._batch.finished:
            if phase == "measure":
                self.report.iterations.append(_iteration_result(index, self._batch))
            self._batch = None
            self._phase += 1
        return not self.done

    def _notify(self, phase: str, index: int) -> None:
        if self.progress_fn is None or self._batch is None:
            return
        b = self._batch
        count = self.spec.warmup if phase == "warmup" else self.spec.iters
        self.progress_fn(BenchProgress(phase, index, count, b.done_tokens, b.total_tokens, b.num_finished,
                                       len(b.order), b.elapsed))


def run_bench(engine, spec: BenchSpec, progress: ProgressFn | None = None,
              cancel: threading.Event | None = None) -> BenchReport:
    """Run `spec` on an idle engine: warmup iterations (not counted), then the measured ones."""
    runner = BenchRunner(engine, spec, progress, cancel)
    try:
        while runner.step():
            pass
    except BaseException:   # KeyboardInterrupt, an engine error: leave no request behind
        runner.abort()
        raise
    return runner.report


# ---------------------------------------------------------------------------------- multi-turn bench
@dataclass
class TurnResult:
    turn: int
    prompt_tokens: float      # history + new message (mean over sessions)
    cached_tokens: float
    prefilled_tokens: float
    ttft_ms: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class MultiTurnReport:
    model: str
    device: str
    settings: dict
    turns: list[TurnResult]
    replay: list[TurnResult]          # same prompts, prefix caching off (empty when skipped)

    @property
    def last_turn_speedup(self) -> float | None:
        """Replay TTFT / resident-KV TTFT on the last turn (how much the cached history saves)."""
        if not self.turns or not self.replay or not self.turns[-1].ttft_ms:
            return None
        return self.replay[-1].ttft_ms / self.turns[-1].ttft_ms

    def to_dict(self) -> dict:
        return {"model": self.model, "device": self.device, "settings": self.settings,
                "turns": [t.to_dict() for t in self.turns], "replay": [t.to_dict() for t in self.replay],
                "last_turn_ttft_ratio": self.last_turn_speedup}


@dataclass
class _ChatShape:
    """ChatML-like framing ids around random content (empty when the vocabulary lacks ChatML tokens)."""

    user_head: list[int]
    user_tail: list[int]       # end of the user turn + the assistant header
    reply_tail: list[int]      # end of the assistant turn

    @classmethod
    def of(cls, tokenizer) -> "_ChatShape":
        start, end = _token_id(tokenizer, "<|im_start|>"), _token_id(tokenizer, "<|im_end|>")
        if start is None or end is None:
            return cls([], [], [])
        enc = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        return cls([start] + enc("user\n"), [end] + enc("\n") + [start] + enc("assistant\n"), [end] + enc("\n"))

    @property
    def overhead(self) -> int:
        return len(self.user_head) + len(self.user_tail) + len(self.reply_tail)


def _token_id(tokenizer, token: str) -> int | None:
    try:
        return tokenizer.token_to_id(token)
    except Exception:
        return None


CHAT_OVERHEAD_BOUND = 32   # framing tokens per turn, a bound (real ChatML tokenizers need ~10)


def multi_turn_context(turns: int, user_tokens: int, reply_tokens: int,
                       overhead: int = CHAT_OVERHEAD_BOUND) -> int:
    """Context length a multi-turn run needs (the last turn's prompt plus its reply), by default with
    room for any usual chat framing, so it can be chosen before the model's tokenizer is at hand."""
    return turns * (user_tokens + reply_tokens + overhead) + 1


def run_multi_turn(engine, turns: int = 8, user_tokens: int = 64, reply_tokens: int = 64, sessions: int = 1,
                   seed: int = 0, progress: ProgressFn | None = None, cancel: threading.Event | None = None,
                   replay=True, warmup: bool = True) -> MultiTurnReport:
    """Synthetic conversations whose KV stays resident between turns (session ids), then the same
    prompts replayed on an engine with prefix caching off (`replay`: True builds one sharing the
    weights source, an LLMEngine uses that one, False skips the replay).

    Turn t's prompt = the previous prompt + the previous reply + a new user message of random ids.
    `warmup` first runs one short unrelated request on each engine (one-time costs out of turn 1)."""
    for name, value in (("turns", turns), ("user_tokens", user_tokens), ("reply_tokens", reply_tokens),
                        ("sessions", sessions)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
    _check_idle(engine)
    cancel = cancel or threading.Event()
    shape = _ChatShape.of(engine.tokenizer)
    need = turns * (user_tokens + reply_tokens + shape.overhead)
    if need > engine.config.max_model_len:
        raise BenchError(f"{turns} turns of {user_tokens} + {reply_tokens} tokens need a {need}-token context, "
                         f"the engine has {engine.config.max_model_len}; use fewer --turns or shorter turns")
    rng = random.Random(seed)
    vocab = min(engine.model_config.vocab_size, PROMPT_ID_MAX + 1)
    histories: list[list[int]] = [[] for _ in range(sessions)]
    session_ids = [f"bench-chat-{next(_batch_ids)}-{s}" for s in range(sessions)]
    prompts_by_turn: list[list[list[int]]] = []
    results: list[TurnResult] = []
    if warmup:
        _warm(engine, rng, vocab, user_tokens, cancel)
    try:
        for t in range(turns):
            prompts = []
            for s in range(sessions):
                user = [rng.randrange(vocab) for _ in range(user_tokens)]
                histories[s] = histories[s] + shape.user_head + user + shape.user_tail
                prompts.append(list(histories[s]))
            prompts_by_turn.append(prompts)
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=reply_tokens,
                                     seed=seed * 1000 + t * sessions + s) for s in range(sessions)]
            batch = _run_batch(engine, prompts, params, session_ids, "turn", t, turns, progress, cancel)
            for s, rid in enumerate(batch.order):
                histories[s] = histories[s] + batch.replies[rid].token_ids + shape.reply_tail
            results.append(_turn_result(t, batch))
    finally:
        for sid in session_ids:
            engine.release_session(sid)
    replayed = []
    if replay is not False:
        other = _replay_engine(engine, sessions, max(len(h) for h in histories)) if replay is True else replay
        if warmup:
            _warm(other, random.Random(seed + 1), vocab, user_tokens, cancel)
        for t, prompts in enumerate(prompts_by_turn):
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1) for _ in prompts]
            batch = _run_batch(other, prompts, params, None, "replay", t, turns, progress, cancel)
            replayed.append(_turn_result(t, batch))
    settings = {"turns": turns, "user_tokens": user_tokens, "reply_tokens": reply_tokens, "sessions": sessions,
                "seed": seed, "chatml": bool(shape.overhead)}
    return MultiTurnReport(model_name(engine), str(engine.device), settings, results, replayed)


def _run_batch(engine, prompts, params, session_ids, phase, index, count, progress, cancel) -> _Batch:
    batch = _Batch(engine, prompts, params, session_ids, prefix=f"bench-{phase}")
    try:
        while not batch.finished:
            if cancel.is_set():
                raise BenchCancelled("bench cancelled")
            batch.step()
            if progress is not None:
                progress(BenchProgress(phase, index, count, batch.done_tokens, batch.total_tokens,
                                       batch.num_finished, len(batch.order), batch.elapsed))
    except BaseException:
        batch.abort()
        raise
    return batch


def _warm(engine, rng: random.Random, vocab: int, n: int, cancel) -> None:
    prompt = [rng.randrange(vocab) for _ in range(n)]
    _run_batch(engine, [prompt], [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2)], None,
               "warmup", 0, 1, None, cancel)


def _turn_result(t: int, batch: _Batch) -> TurnResult:
    stats = batch.stats()
    n = len(stats)
    ttfts = [s.ttft for s in stats if s.ttft is not None]
    return TurnResult(turn=t + 1, prompt_tokens=sum(s.prompt_tokens for s in stats) / n,
                      cached_tokens=sum(s.cached_tokens for s in stats) / n,
                      prefilled_tokens=sum(s.prompt_tokens - s.cached_tokens for s in stats) / n,
                      ttft_ms=1000 * sum(ttfts) / len(ttfts) if ttfts else 0.0)


def _replay_engine(engine, sessions: int, longest: int):
    """A second engine on the same weights source with prefix caching off and a KV cache just big
    enough for the replay (so it fits beside the first one on a GPU)."""
    from nanochat.engine.llm_engine import LLMEngine

    bs = engine.config.kvcache_block_size
    blocks = sessions * ((longest + 1 + bs - 1) // bs) + 1
    cfg = replace(engine.config, enable_prefix_caching=False, num_kvcache_blocks=blocks,
                  max_num_seqs=max(sessions, 1))
    return LLMEngine(engine.config.model, config=cfg, loaded=engine.loaded)
