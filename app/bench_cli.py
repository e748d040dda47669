"""`nanochat bench`: batch throughput (nano-vllm's bench.py workload) or the multi-turn chat bench.

    nanochat bench --tier fast                     8 requests of up to 64 + 64 tokens
    nanochat bench --tier heavy --json             16 x (512 + 512), 3 measured iterations, JSON on stdout
    nanochat bench --workload nano-vllm            bench.py exactly: 256 requests, lengths up to 1024
    nanochat bench --multi-turn --turns 8          resident-KV conversation vs a full replay
    nanochat bench --speculative ngram             the workload without speculation, then with it, side by side

Tables go to stdout, the progress bar to stderr (not with --quiet). Exit codes: 0 ok, 1 runtime
error, 2 usage error, 130 interrupted; errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from functools import partial

from nanochat.app.errors import EXIT_OK, UsageError, one_line, run_guarded
from nanochat.app.terminal_text import sanitize
from nanochat.app.options import (add_engine_options, add_option, bench_count_int, bench_tokens_int,
                                  bench_warmup_int, engine_config, non_negative_int, pick, positive_int,
                                  resolve_model, speculative_arg, threads_int)

PROG = "nanochat bench"


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    from nanochat.engine.serve.bench import TIERS, WORKLOADS

    p = subparsers.add_parser("bench", help="measure throughput, TTFT and TPOT on a synthetic workload",
                              description="Benchmark the engine on random token ids (nano-vllm's bench.py "
                                          "workload) or on a synthetic multi-turn chat.")
    # flags the top-level parser has too, with the bench's meaning (SUPPRESS keeps `nanochat --seed 1 bench`)
    add_option(p, True, "--max-model-len", type=positive_int, metavar="N",
               help="context length (default: from the tier)")
    add_option(p, True, "--seed", type=non_negative_int, metavar="N", help="workload seed (default 0)")
    add_option(p, True, "--json", action="store_true", help="print one JSON object on stdout instead of tables")
    add_option(p, True, "--quiet", "-q", action="store_true", help="no progress bar on stderr")
    add_option(p, True, "--speculative", type=speculative_arg, metavar="auto|ngram|off|PATH",
               help="the engine's speculative decoding, and a comparison: the workload without speculation, then "
                    "with ngram or the draft model PATH, side by side (off: one run without)")
    add_engine_options(p, suppress=True)
    g = p.add_argument_group("workload")
    g.add_argument("--tier", choices=sorted(TIERS), default=None,
                   help="preset: fast (8 x 64+64), normal (16 x 256+256), heavy (16 x 512+512, 3 iters); "
                        "default fast")
    g.add_argument("--workload", choices=WORKLOADS, default=None,
                   help="random (the tier's sizes) or nano-vllm (bench.py: 256 x up to 1024+1024)")
    g.add_argument("--num-seqs", type=bench_count_int, metavar="N", help="requests per iteration")
    g.add_argument("--max-input-len", type=bench_tokens_int, metavar="N", help="longest prompt")
    g.add_argument("--max-output-len", type=bench_tokens_int, metavar="N", help="longest reply")
    g.add_argument("--max-batched-tokens", type=positive_int, metavar="N",
                   help="tokens per engine step (default: num-seqs x max-input-len, at least max-model-len)")
    g.add_argument("--warmup", type=bench_warmup_int, metavar="N", help="unmeasured iterations first")
    g.add_argument("--iters", type=bench_count_int, metavar="N", help="measured iterations")
    g.add_argument("--fixed-lengths", action="store_true", default=None,
                   help="every prompt and reply at the maximum length")
    g.add_argument("--threads", type=threads_int, metavar="N", help="CPU threads (torch's and the MoE expert kernels')")
    m = p.add_argument_group("multi-turn")
    m.add_argument("--multi-turn", action="store_true", help="a chat whose KV stays resident, vs a full replay")
    m.add_argument("--turns", type=bench_count_int, default=8, metavar="N", help="turns per conversation (8)")
    m.add_argument("--user-tokens", type=bench_tokens_int, default=64, metavar="N", help="tokens per user message (64)")
    m.add_argument("--reply-tokens", type=bench_tokens_int, default=64, metavar="N", help="tokens per reply (64)")
    m.add_argument("--sessions", type=bench_count_int, default=1, metavar="N", help="concurrent conversations (1)")
    p.set_defaults(func=run_bench_cli)
    return p


# ---------------------------------------------------------------------------------- options
def build_spec(args):
    from nanochat.engine.serve.bench import spec_from

    if args.multi_turn and (args.workload == "nano-vllm"):
        raise UsageError("--multi-turn and --workload nano-vllm do not go together")
    try:
        return spec_from(args.tier, num_seqs=args.num_seqs, max_input_len=args.max_input_len,
                         max_output_len=args.max_output_len, max_model_len=pick(args, "max_model_len", None),
                         max_batched_tokens=args.max_batched_tokens, warmup=args.warmup, iters=args.iters,
                         seed=pick(args, "seed", None), fixed_lengths=args.fixed_lengths, workload=args.workload)
    except ValueError as e:
        raise UsageError(str(e)) from None


# ---------------------------------------------------------------------------------- progress
class _ProgressBar:
    """A rich progress bar on stderr fed by BenchProgress callbacks (a no-op when quiet)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.progress = None
        self.tasks: dict[tuple[str, str, int], int] = {}
        self.run = ""   # which run of a comparison ("off", "ngram"): its lines apart from the other's

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
        """One line saying what happens before the bench runs (a load, a kernel compile during it)."""
        if self.progress is None:
            return
        text = _shown(text)   # it quotes a model's path
        task = self.tasks.get(("", "status", 0))
        if task is None:
            self.tasks[("", "status", 0)] = self.progress.add_task(text, total=None)
        else:
            self.progress.update(task, description=text)

    def __call__(self, p) -> None:
        if self.progress is None:
            return
        key = (self.run, p.phase, p.index)
        if key not in self.tasks:
            for task in list(self.progress.tasks):   # one line at a time: hide finished phases
                self.progress.update(task.id, visible=False)
            label = {"warmup": "warmup", "measure": "iteration", "turn": "turn", "replay": "replay turn"}[p.phase]
            run = f"speculative {self.run}: " if self.run else ""
            self.tasks[key] = self.progress.add_task(f"{run}{label} {p.index + 1}/{p.count}", total=p.total_tokens)
        self.progress.update(self.tasks[key], completed=p.done_tokens)


# ---------------------------------------------------------------------------------- output
def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _shown(name: str) -> str:
    """A model's name (from its file) inside rich markup: sanitized, its brackets not markup."""
    from rich.markup import escape
    return escape(sanitize(name))


def print_report(report, console) -> None:
    from rich.table import Table

    spec = report.spec
    eq = "=" if spec.fixed_lengths else "<="
    what = f"tier {spec.tier}" if spec.tier and spec.workload == "random" else f"workload {spec.workload}"
    console.print(f"[bold]{_shown(report.model)}[/] on {report.device} ({what}): {spec.num_seqs} requests, "
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


def speedup(report, baseline, key: str) -> float | None:
    """`report`'s mean `key` over `baseline`'s (None where the baseline has none)."""
    base = baseline.mean.get(key)
    return report.mean.get(key, 0.0) / base if base else None


def print_comparison(baseline, report, mode: str, console) -> None:
    """The workload without speculation and with `mode`, one row each (means over the measured iterations), and
    what speculation changed."""
    from rich import box
    from rich.table import Table

    spec = report.spec
    eq = "=" if spec.fixed_lengths else "<="
    what = f"tier {spec.tier}" if spec.tier and spec.workload == "random" else f"workload {spec.workload}"
    console.print(f"[bold]{_shown(report.model)}[/] on {report.device} ({what}): {spec.num_seqs} requests, "
                  f"input {eq}{spec.max_input_len}, output {eq}{spec.max_output_len} tokens")
    table = Table(title="speculative decoding (decode in tok/s, TPOT in ms)", title_justify="left",
                  box=box.SIMPLE_HEAD)   # eight columns in 80
    for col in ("proposer", "tokens", "tok/s", "decode", "TPOT p50", "proposed", "accepted", "tok/step"):
        table.add_column(col, justify="right", no_wrap=True, min_width=len(col))
    for label, r in (("off", baseline), (mode, report)):
        d = r.mean
        proposed = d.get("spec_proposed") or 0
        table.add_row(label, _fmt(d["generated_tokens"], 0), _fmt(d["throughput_tok_s"]), _fmt(d["decode_tok_s"]),
                      _fmt(d["tpot_ms"]["p50"], 2), _fmt(proposed, 0),
                      f"{d['spec_accepted'] / proposed * 100:.0f}%" if proposed else "-",
                      _fmt(d.get("spec_tokens_per_step"), 2))
    console.print(table)
    ratio, decode = speedup(report, baseline, "throughput_tok_s"), speedup(report, baseline, "decode_tok_s")
    console.print(f"{mode} / off: [bold]{_fmt(ratio, 2)}x[/] tok/s, {_fmt(decode, 2)}x decode tok/s")


def print_multi_turn(report, console) -> None:
    from rich.table import Table

    s = report.settings
    console.print(f"[bold]{_shown(report.model)}[/] on {report.device}: {s['turns']} turns of {s['user_tokens']} user + "
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

    from nanochat.engine.serve.bench import engine_limits
    from nanochat.engine.serve.client import EngineClient

    spec = build_spec(args)
    mode = comparison_mode(args)
    settings = args.settings
    model = resolve_model(args, settings)
    if args.multi_turn:
        spec = _multi_turn_spec(args, spec)
    # The spec's limits (sequence cap, context, step budget) win over the settings' max_model_len.
    config = engine_config(args, settings, cpu_threads=args.threads, **engine_limits(spec))
    quiet = bool(pick(args, "quiet", False))
    as_json = bool(pick(args, "json", False))
    client = EngineClient()
    try:
        with _ProgressBar(not quiet) as bar:
            bar.status(f"loading {model}")
            client.load_model(model, status=lambda text: bar.status(f"loading {model}: {text}"), **config)
            progress = lambda p, stats: bar(p)   # noqa: E731 -- the engine's stats are for the TUI
            if args.multi_turn:
                report = client.bench(progress=progress, multi_turn=dict(
                    turns=args.turns, user_tokens=args.user_tokens, reply_tokens=args.reply_tokens,
                    sessions=args.sessions, seed=spec.seed))
            elif mode is not None:
                bar.run = "off"   # warmed up first, so neither run pays the engine's first steps
                baseline = client.bench(replace(spec, speculative="off", warmup=max(spec.warmup, 1)),
                                        progress=progress)
                bar.run = mode
                report = client.bench(replace(spec, speculative=mode, variant=1), progress=progress)
            else:
                report = client.bench(spec, progress=progress)
    finally:
        client.shutdown()
    if as_json:
        data = report.to_dict() if mode is None else {
            "mode": mode, "off": baseline.to_dict(), "speculative": report.to_dict(),
            "throughput_ratio": speedup(report, baseline, "throughput_tok_s"),
            "decode_ratio": speedup(report, baseline, "decode_tok_s")}
        print(json.dumps(data, indent=2))
    elif mode is not None:
        print_comparison(baseline, report, mode, Console())
    else:
        console = Console()
        (print_multi_turn if args.multi_turn else print_report)(report, console)
    return EXIT_OK


def comparison_mode(args) -> str | None:
    """The requests' proposer a `--speculative` flag compares with off (ngram, or draft for a draft model's
    path); None: no comparison (no flag, or off)."""
    engine = getattr(args, "speculative", None)
    if engine is None or engine == "off":
        return None
    if args.multi_turn:
        raise UsageError("--speculative compares the batch workload; --multi-turn's seeded turns never speculate")
    return "ngram" if engine in ("auto", "ngram") else "draft"   # anything else names a draft model


def _multi_turn_spec(args, spec):
    """Sequence cap = sessions; the context must hold the whole conversation (the engine checks a
    --max-model-len given here against the chat framing of the model's own tokens)."""

    from nanochat.engine.serve.bench import multi_turn_context

    max_len = pick(args, "max_model_len", None) or multi_turn_context(args.turns, args.user_tokens,
                                                                       args.reply_tokens)
    return replace(spec, num_seqs=args.sessions, max_model_len=max_len,
                   max_input_len=min(spec.max_input_len, max_len // 2),
                   max_output_len=min(spec.max_output_len, max_len // 2),
                   max_batched_tokens=args.max_batched_tokens or max(max_len, args.sessions * args.user_tokens))


# ModelLoadError, RequestError, BenchError, MemoryError, ... on one line: an OSError as its str(),
# out of memory with bench's advice
_describe = partial(one_line, oom_advice="a smaller tier or --kv-cache-gib", os_filename=False)


def run_bench_cli(args) -> int:
    """Run `nanochat bench` for parsed `args`; returns the exit code (errors are one line on stderr)."""
    from nanochat.engine.serve.bench import BenchCancelled

    return run_guarded(lambda: _run(args), PROG, describe=_describe, interrupts=(KeyboardInterrupt, BenchCancelled))
