"""`nanochat bench`: batch throughput (nano-vllm's bench.py workload) or the multi-turn chat bench.

    nanochat bench --tier fast                     8 requests of up to 64 + 64 tokens
    nanochat bench --tier heavy --json             16 x (512 + 512), 3 measured iterations, JSON on stdout
    nanochat bench --workload nano-vllm            bench.py exactly: 256 requests, lengths up to 1024
    nanochat bench --multi-turn --turns 8          resident-KV conversation vs a full replay

Tables go to stdout, the progress bar to stderr (not with --quiet). Exit codes: 0 ok, 1 runtime
error, 2 usage error, 130 interrupted; errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

from nanochat.app.errors import EXIT_OK, UsageError, one_line, run_guarded, run_standalone

PROG = "nanochat bench"
DTYPES = ("auto", "float32", "fp32", "float16", "fp16", "half", "bfloat16", "bf16")


def _int_at_least(raw: str, least: int, kind: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {raw!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be a {kind} integer, got {raw!r}")
    return value


def _positive(raw: str) -> int:
    return _int_at_least(raw, 1, "positive")


def _non_negative(raw: str) -> int:
    return _int_at_least(raw, 0, "non-negative")


def _positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {raw!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {raw!r}")
    return value


def _device(raw: str) -> str:
    if raw in ("cpu", "cuda", "auto") or (raw.startswith("cuda:") and raw[5:].isdigit()):
        return raw
    raise argparse.ArgumentTypeError(f"must be cpu, cuda, cuda:N or auto, got {raw!r}")


def _shared(parser, *flags, **kw) -> None:
    """Options the top-level `nanochat` parser also has: SUPPRESS keeps `nanochat --model M bench`."""
    kw.setdefault("default", argparse.SUPPRESS)
    try:
        parser.add_argument(*flags, **kw)
    except argparse.ArgumentError:
        pass


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    from nanochat.engine.bench import TIERS, WORKLOADS

    p = subparsers.add_parser("bench", help="measure throughput, TTFT and TPOT on a synthetic workload",
                              description="Benchmark the engine on random token ids (nano-vllm's bench.py "
                                          "workload) or on a synthetic multi-turn chat.")
    _shared(p, "--model", "-m", metavar="PATH|HUB_ID", help="model to load (default: the built-in SmolLM2)")
    _shared(p, "--device", type=_device, metavar="DEVICE", help="cpu, cuda, cuda:N or auto (default: settings)")
    _shared(p, "--dtype", choices=DTYPES, help="compute dtype (auto: fp32 on CPU, bf16 on CUDA)")
    _shared(p, "--max-model-len", type=_positive, metavar="N", help="context length (default: from the tier)")
    _shared(p, "--kv-cache-gib", type=_positive_float, metavar="GIB", help="CPU KV-cache budget")
    _shared(p, "--seed", type=_non_negative, metavar="N", help="workload seed (default 0)")
    _shared(p, "--json", action="store_true", help="print one JSON object on stdout instead of tables")
    _shared(p, "--quiet", "-q", action="store_true", help="no progress bar on stderr")
    g = p.add_argument_group("workload")
    g.add_argument("--tier", choices=sorted(TIERS), default=None,
                   help="preset: fast (8 x 64+64), normal (16 x 256+256), heavy (16 x 512+512, 3 iters); "
                        "default fast")
    g.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="random (the tier's sizes) or nano-vllm (bench.py: 256 x up to 1024+1024)")
    g.add_argument("--num-seqs", type=_positive, metavar="N", help="requests per iteration")
    g.add_argument("--max-input-len", type=_positive, metavar="N", help="longest prompt")
    g.add_argument("--max-output-len", type=_positive, metavar="N", help="longest reply")
    g.add_argument("--max-batched-tokens", type=_positive, metavar="N",
                   help="tokens per engine step (default: num-seqs x max-input-len, at least max-model-len)")
    g.add_argument("--warmup", type=_non_negative, metavar="N", help="unmeasured iterations first")
    g.add_argument("--iters", type=_positive, metavar="N", help="measured iterations")
    g.add_argument("--fixed-lengths", action="store_true", default=None,
                   help="every prompt and reply at the maximum length")
    g.add_argument("--threads", type=_positive, metavar="N", help="CPU threads (torch.set_num_threads)")
    m = p.add_argument_group("multi-turn")
    m.add_argument("--multi-turn", action="store_true", help="a chat whose KV stays resident, vs a full replay")
    m.add_argument("--turns", type=_positive, default=8, metavar="N", help="turns per conversation (8)")
    m.add_argument("--user-tokens", type=_positive, default=64, metavar="N", help="tokens per user message (64)")
    m.add_argument("--reply-tokens", type=_positive, default=64, metavar="N", help="tokens per reply (64)")
    m.add_argument("--sessions", type=_positive, default=1, metavar="N", help="concurrent conversations (1)")
    p.set_defaults(func=run_bench_cli)
    return p


# ---------------------------------------------------------------------------------- options
def _opt(args, name: str, default=None):
    value = getattr(args, name, None)
    return default if value is None else value


def _settings_value(args, name: str):
    settings = getattr(args, "settings", None)
    return getattr(settings, name, None) if settings is not None else None


def build_spec(args):
    from nanochat.engine.bench import spec_from

    if args.multi_turn and (args.workload == "nano-vllm"):
        raise UsageError("--multi-turn and --workload nano-vllm do not go together")
    try:
        return spec_from(args.tier, num_seqs=args.num_seqs, max_input_len=args.max_input_len,
                         max_output_len=args.max_output_len, max_model_len=_opt(args, "max_model_len"),
                         max_batched_tokens=args.max_batched_tokens, warmup=args.warmup, iters=args.iters,
                         seed=_opt(args, "seed"), fixed_lengths=args.fixed_lengths, workload=args.workload)
    except ValueError as e:
        raise UsageError(str(e)) from None


def resolve_model(args) -> str:
    model = _opt(args, "model") or _settings_value(args, "default_model")
    try:
        from nanochat.models.catalog import resolve_default_model
    except ImportError:
        if not model:
            raise UsageError("no model given: pass --model PATH|HUB_ID") from None
        return model
    return resolve_default_model(model)


def engine_config(args) -> dict:
    cfg = {"device": _opt(args, "device") or _settings_value(args, "device") or "auto",
           "dtype": _opt(args, "dtype") or _settings_value(args, "dtype"),
           "kv_cache_gib": _opt(args, "kv_cache_gib") or _settings_value(args, "kv_cache_gib"),
           "cpu_threads": args.threads}
    return {k: v for k, v in cfg.items() if v is not None}


# ---------------------------------------------------------------------------------- progress
class _ProgressBar:
    """A rich progress bar on stderr fed by BenchProgress callbacks (a no-op when quiet)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.progress = None
        self.tasks: dict[tuple[str, int], int] = {}

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn)

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("tok"), TimeElapsedColumn(), console=Console(stderr=True),
                                     transient=True, redirect_stdout=False, redirect_stderr=False)
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()

    def status(self, text: str) -> None:
        if self.progress is not None:
            self.tasks[("status", 0)] = self.progress.add_task(text, total=None)

    def __call__(self, p) -> None:
        if self.progress is None:
            return
        key = (p.phase, p.index)
        if key not in self.tasks:
            for task in list(self.progress.tasks):   # one line at a time: hide finished phases
                self.progress.update(task.id, visible=False)
            label = {"warmup": "warmup", "measure": "iteration", "turn": "turn", "replay": "replay turn"}[p.phase]
            self.tasks[key] = self.progress.add_task(f"{label} {p.index + 1}/{p.count}", total=p.total_tokens)
        self.progress.update(self.tasks[key], completed=p.done_tokens)


# ---------------------------------------------------------------------------------- output
def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_report(report, console) -> None:
    from rich.table import Table

    spec = report.spec
    eq = "=" if spec.fixed_lengths else "<="
    what = f"tier {spec.tier}" if spec.tier and spec.workload == "random" else f"workload {spec.workload}"
    console.print(f"[bold]{report.model}[/] on {report.device} ({what}): {spec.num_seqs} requests, "
                  f"input {eq}{spec.max_input_len}, output {eq}{spec.max_output_len} tokens")
    table = Table(title="throughput", title_justify="left")
    for col in ("iter", "generated", "time s", "tok/s", "prefill tok/s", "decode tok/s", "preempt"):
        table.add_column(col, justify="right")
    rows = [(str(it.iteration + 1), it.to_dict()) for it in report.iterations] + [("mean", report.mean)]
    for label, d in rows:
        table.add_row(label, _fmt(d["generated_tokens"], 0), _fmt(d["elapsed_s"], 2), _fmt(d["throughput_tok_s"]),
                      _fmt(d["prefill_tok_s"]), _fmt(d["decode_tok_s"]), _fmt(d["preemptions"], 0),
                      style="bold" if label == "mean" else None)
    console.print(table)
    lat = Table(title="latency (ms)", title_justify="left")
    for col in ("iter", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p90", "TPOT p99"):
        lat.add_column(col, justify="right")
    for label, d in rows:
        t, o = d["ttft_ms"], d["tpot_ms"]
        lat.add_row(label, _fmt(t["p50"]), _fmt(t["p90"]), _fmt(t["p99"]), _fmt(o["p50"], 2), _fmt(o["p90"], 2),
                    _fmt(o["p99"], 2), style="bold" if label == "mean" else None)
    console.print(lat)


def print_multi_turn(report, console) -> None:
    from rich.table import Table

    s = report.settings
    console.print(f"[bold]{report.model}[/] on {report.device}: {s['turns']} turns of {s['user_tokens']} user + "
                  f"{s['reply_tokens']} reply tokens, {s['sessions']} session(s)")
    table = Table(title="multi-turn chat: resident KV vs full replay", title_justify="left")
    for col in ("turn", "history", "cached", "prefilled", "TTFT ms", "replay prefilled", "replay TTFT ms"):
        table.add_column(col, justify="right")
    for i, t in enumerate(report.turns):
        r = report.replay[i] if i < len(report.replay) else None
        table.add_row(str(t.turn), _fmt(t.prompt_tokens, 0), _fmt(t.cached_tokens, 0), _fmt(t.prefilled_tokens, 0),
                      _fmt(t.ttft_ms), _fmt(r.prefilled_tokens if r else None, 0), _fmt(r.ttft_ms if r else None))
    console.print(table)
    if report.last_turn_speedup is not None:
        console.print(f"last turn: replay TTFT / resident TTFT = [bold]{report.last_turn_speedup:.2f}x[/]")


# ---------------------------------------------------------------------------------- command
def _run(args) -> int:
    from rich.console import Console

    from nanochat.engine import bench

    spec = build_spec(args)
    model = resolve_model(args)
    config = engine_config(args)
    quiet = bool(_opt(args, "quiet", False))
    as_json = bool(_opt(args, "json", False))
    with _ProgressBar(not quiet) as bar:
        bar.status(f"loading {model}")
        if args.multi_turn:
            from nanochat.models.loader import load

            loaded = load(model)   # the tokenizer tells how long the chat framing is
            spec = _multi_turn_spec(args, spec, bench.chat_overhead(loaded.tokenizer))
            engine = bench.make_bench_engine(model, spec, loaded=loaded, **config)
            report = bench.run_multi_turn(engine, turns=args.turns, user_tokens=args.user_tokens,
                                          reply_tokens=args.reply_tokens, sessions=args.sessions,
                                          seed=spec.seed, progress=bar)
        else:
            engine = bench.make_bench_engine(model, spec, **config)
            report = bench.run_bench(engine, spec, progress=bar)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        console = Console()
        (print_multi_turn if args.multi_turn else print_report)(report, console)
    return EXIT_OK


def _multi_turn_spec(args, spec, overhead: int):
    """Sequence cap = sessions; the context must hold the whole conversation."""
    from dataclasses import replace

    from nanochat.engine.bench import multi_turn_context

    need = multi_turn_context(args.turns, args.user_tokens, args.reply_tokens, overhead)
    given = _opt(args, "max_model_len")
    if given is not None and given < need:
        raise UsageError(f"--max-model-len {given} is too small for {args.turns} turns of "
                         f"{args.user_tokens} + {args.reply_tokens} tokens (needs about {need})")
    max_len = given or need
    return replace(spec, num_seqs=args.sessions, max_model_len=max_len,
                   max_input_len=min(spec.max_input_len, max_len // 2),
                   max_output_len=min(spec.max_output_len, max_len // 2),
                   max_batched_tokens=args.max_batched_tokens or max(max_len, args.sessions * args.user_tokens))


# ModelLoadError, RequestError, BenchError, MemoryError, ... on one line: an OSError as its str(),
# out of memory with bench's advice
_one_line = partial(one_line, oom_advice="a smaller tier or --kv-cache-gib", os_filename=False)


def run_bench_cli(args) -> int:
    """Run `nanochat bench` for parsed `args`; returns the exit code (errors are one line on stderr)."""
    from nanochat.engine.bench import BenchCancelled

    return run_guarded(lambda: _run(args), PROG, describe=_one_line, interrupts=(KeyboardInterrupt, BenchCancelled))


run_bench = run_bench_cli   # the name app/cli.py's dispatch imports


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (python -m nanochat.app.bench_cli ...), used when app/cli.py is absent."""
    return run_standalone("bench", add_bench_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
