"""engine/serve/bench.py and `nanochat bench`: tiers and overrides, the nano-vllm workload, report schema,
tiny-model runs (counts, cancellation, multi-turn cache reuse), and the CLI."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading

import pytest

from nanochat.engine import LLMEngine
from nanochat.engine.serve.bench import (TIERS, BenchCancelled, BenchError, BenchRunner, BenchSpec, make_bench_engine,
                                   make_workload, percentile, run_bench, run_multi_turn, spec_from)

ARCH = "qwen3"
SMALL = dict(num_seqs=3, max_input_len=16, max_output_len=8, fixed_lengths=True)


# ---------------------------------------------------------------------------------- specs
def test_tier_presets():
    fast, normal, heavy = (spec_from(t) for t in ("fast", "normal", "heavy"))
    assert (fast.num_seqs, fast.max_model_len, fast.max_input_len, fast.max_output_len, fast.warmup, fast.iters) \
        == (8, 128, 64, 64, 0, 1)
    assert (normal.num_seqs, normal.max_model_len, normal.max_input_len, normal.max_output_len, normal.warmup,
            normal.iters) == (16, 512, 256, 256, 1, 1)
    assert (heavy.num_seqs, heavy.max_model_len, heavy.max_input_len, heavy.max_output_len, heavy.warmup,
            heavy.iters) == (16, 1024, 512, 512, 1, 3)
    assert spec_from() == fast and set(TIERS) == {"fast", "normal", "heavy"}


def test_overrides_win_over_the_tier():
    s = spec_from("heavy", num_seqs=2, iters=1, warmup=0, seed=7, max_output_len=100, fixed_lengths=True,
                  max_batched_tokens=None)
    assert (s.num_seqs, s.iters, s.warmup, s.seed, s.max_output_len, s.fixed_lengths) == (2, 1, 0, 7, 100, True)
    assert s.max_input_len == 512 and s.max_model_len == 1024 and s.tier == "heavy"
    # max_model_len grows to fit unless given explicitly
    assert spec_from("fast", max_input_len=200).max_model_len == 264
    with pytest.raises(ValueError, match="exceeds max-model-len 128"):
        spec_from("fast", max_input_len=200, max_model_len=128)
    with pytest.raises(ValueError, match="tier must be one of"):
        spec_from("turbo")
    with pytest.raises(ValueError, match="num-seqs must be a positive integer"):
        spec_from("fast", num_seqs=0)
    with pytest.raises(ValueError, match="workload"):
        spec_from("fast", workload="other")


def test_nano_vllm_preset():
    s = spec_from("heavy", workload="nano-vllm")
    assert (s.num_seqs, s.max_input_len, s.max_output_len, s.max_model_len, s.seed) == (256, 1024, 1024, 4096, 0)
    assert spec_from(workload="nano-vllm", num_seqs=4).num_seqs == 4   # still overridable


def test_max_batched_tokens_rule():
    assert spec_from("fast").batched_tokens == 8 * 64
    assert spec_from("fast", num_seqs=1, max_input_len=16).batched_tokens == 128   # at least max_model_len
    assert spec_from("heavy").batched_tokens == 16 * 512
    assert spec_from("fast", max_batched_tokens=32).batched_tokens == 32          # explicit value kept
    assert spec_from("fast").to_dict()["max_batched_tokens"] == 512


# ---------------------------------------------------------------------------------- workload
def bench_py_reference(num_seqs=256, max_input_len=1024, max_output_len=1024):
    """nano-vllm's bench.py workload, drawn from the global `random` exactly as that script does."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))]
               for _ in range(num_seqs)]
    lengths = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, lengths


def test_nano_vllm_workload_is_bench_py():
    state = random.getstate()
    try:
        prompts, lengths = bench_py_reference()
    finally:
        random.setstate(state)
    w = make_workload(spec_from(workload="nano-vllm"), vocab_size=151936)
    assert w.prompts == prompts
    assert [p.max_tokens for p in w.params] == lengths
    assert all(p.temperature == 0.6 and p.ignore_eos for p in w.params)


def test_workload_lengths_and_vocab():
    short = make_workload(spec_from("fast", seed=3), vocab_size=50)
    assert all(1 <= len(p) <= 64 for p in short.prompts) and all(1 <= sp.max_tokens <= 64 for sp in short.params)
    assert all(0 <= t < 50 for p in short.prompts for t in p)
    normal = make_workload(spec_from("normal"), vocab_size=32000)
    assert all(100 <= len(p) <= 256 for p in normal.prompts)
    fixed = make_workload(spec_from("fast", fixed_lengths=True), vocab_size=320)
    assert {len(p) for p in fixed.prompts} == {64} and fixed.expected_tokens == 8 * 64
    assert make_workload(spec_from("fast"), 320).prompts == make_workload(spec_from("fast"), 320).prompts
    assert make_workload(spec_from("fast"), 320, seed=1).prompts != make_workload(spec_from("fast"), 320).prompts


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 9.0, 3.0, 7.5, 2.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None and percentile([4.0], 99) == 4.0


# ---------------------------------------------------------------------------------- tiny-model runs
@pytest.fixture(scope="module")
def engine(tiny_models):
    spec = spec_from("fast", **SMALL)
    return make_bench_engine(str(tiny_models[ARCH]), spec, dtype="float32")


def test_make_bench_engine_takes_limits_from_the_spec(engine):
    cfg = engine.config
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.max_num_batched_tokens) == (3, 128, 128)


def test_nano_vllm_warmup_is_one_short_request(engine):
    from nanochat.engine.serve.bench import nano_vllm_warmup

    w = nano_vllm_warmup(engine.tokenizer)
    assert w.prompts == [engine.tokenizer.encode("Benchmark: ")]
    assert [(p.max_tokens, p.temperature, p.ignore_eos) for p in w.params] == [(64, 1.0, False)]


def test_tiny_run_counts_and_schema(engine):
    spec = spec_from("fast", warmup=1, iters=2, **SMALL)
    seen = []
    report = run_bench(engine, spec, progress=seen.append)
    assert len(report.iterations) == 2   # the warmup is not counted
    for it in report.iterations:
        assert it.num_requests == 3 and it.prompt_tokens == 3 * 16 and it.cached_tokens == 0
        assert it.generated_tokens == 3 * 8
        assert it.prefill_tokens == 3 * 16 and it.decode_tokens == 3 * 7
        assert it.elapsed_s > 0 and it.throughput_tok_s == pytest.approx(24 / it.elapsed_s)
        assert it.ttft_ms["p50"] <= it.ttft_ms["p90"] <= it.ttft_ms["p99"]
        assert it.tpot_ms["p50"] > 0 and it.prefill_tok_s > 0 and it.decode_tok_s > 0
    assert {p.phase for p in seen} == {"warmup", "measure"}
    last = [p for p in seen if p.phase == "measure" and p.index == 1][-1]
    assert last.done_tokens == last.total_tokens == 24 and last.finished_requests == 3
    d = json.loads(json.dumps(report.to_dict()))
    assert {"spec", "model", "device", "iterations", "mean"} <= set(d)
    assert d["spec"]["num_seqs"] == 3 and d["spec"]["max_batched_tokens"] == 128 and d["device"] == "cpu"
    assert d["model"] == ARCH and len(d["iterations"]) == 2
    assert d["mean"]["generated_tokens"] == 24 and d["mean"]["iterations"] == 2
    assert set(d["mean"]["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    engine.block_manager.check_invariants()
    assert not engine.has_unfinished()


def test_the_report_shows_a_hostile_model_name_as_text(engine):
    """A model's name comes from its file: on a terminal its escape sequences are shown, not obeyed, and
    its brackets are not rich markup."""
    import io

    from rich.console import Console

    from nanochat.app.bench_cli import print_report
    report = run_bench(engine, spec_from("fast", warmup=0, iters=1, **SMALL))
    report.model = "evil\x1b]2;PWNED\x07[/]\x9b31m"
    out = io.StringIO()
    print_report(report, Console(file=out, force_terminal=True, width=200))
    shown = out.getvalue()
    assert "\x1b]" not in shown and "\x07" not in shown and "\x9b" not in shown
    assert "evil␛]2;PWNED␇[/]<U+009B>31m" in re.sub(r"\x1b\[[0-9;]*m", "", shown)


def test_step_by_step_and_cancel(engine):
    spec = spec_from("fast", **SMALL)
    runner = BenchRunner(engine, spec)
    steps = 0
    while runner.step():
        steps += 1
    assert steps == 7 and runner.report.iterations[0].generated_tokens == 24
    cancel = threading.Event()

    def stop_after_some(p):
        if p.done_tokens >= 6:
            cancel.set()

    with pytest.raises(BenchCancelled):
        run_bench(engine, spec, progress=stop_after_some, cancel=cancel)
    assert not engine.has_unfinished()

    def fail(p):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_bench(engine, spec, progress=fail)
    assert not engine.has_unfinished()
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


def test_bench_refuses_a_busy_engine_or_a_short_context(engine):
    with pytest.raises(BenchError, match="max_model_len"):
        run_bench(engine, spec_from("fast", max_input_len=100, max_output_len=100, num_seqs=1))
    from nanochat.engine import SamplingParams
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    try:
        with pytest.raises(BenchError, match="busy"):
            run_bench(engine, spec_from("fast", **SMALL))
    finally:
        engine.abort(rid)


def test_multi_turn_reuses_the_history(tiny_models):
    eng = LLMEngine(str(tiny_models[ARCH]), dtype="float32", max_model_len=256, max_num_seqs=2)
    report = run_multi_turn(eng, turns=3, user_tokens=16, reply_tokens=8, sessions=2, seed=1)
    turns = report.turns
    assert [t.turn for t in turns] == [1, 2, 3]
    assert turns[0].cached_tokens == 0
    assert turns[0].prompt_tokens < turns[1].prompt_tokens < turns[2].prompt_tokens
    assert 0 < turns[1].cached_tokens < turns[2].cached_tokens
    for t in turns[1:]:   # the whole previous history is cached, up to whole blocks
        assert t.prefilled_tokens < 16 + 8 + 16 + 16
    assert [r.cached_tokens for r in report.replay] == [0, 0, 0]
    assert [r.prompt_tokens for r in report.replay] == [t.prompt_tokens for t in turns]
    assert [r.prefilled_tokens for r in report.replay] == [t.prompt_tokens for t in turns]
    assert report.last_turn_speedup is not None and report.last_turn_speedup > 0
    d = json.loads(json.dumps(report.to_dict()))
    assert d["settings"]["sessions"] == 2 and len(d["turns"]) == len(d["replay"]) == 3
    assert eng.block_manager.sessions == {} and not eng.has_unfinished()
    eng.block_manager.check_invariants()
    with pytest.raises(BenchError, match="context"):
        run_multi_turn(eng, turns=20, user_tokens=16, reply_tokens=8, replay=False)


# ---------------------------------------------------------------------------------- CLI
def parse(argv):
    from nanochat.app.bench_cli import add_bench_parser

    parser = argparse.ArgumentParser(prog="nanochat")
    sub = parser.add_subparsers(dest="command")
    add_bench_parser(sub)
    return parser.parse_args(["bench", *argv])


def test_flag_parsing():
    from nanochat.app.bench_cli import build_spec, run_bench_cli
    from nanochat.app.options import engine_config
    from nanochat.app.settings import Settings

    args = parse(["--model", "m.gguf", "--tier", "normal", "--num-seqs", "4", "--max-input-len", "32",
                  "--max-output-len", "16", "--max-batched-tokens", "64", "--warmup", "0", "--iters", "2",
                  "--seed", "5", "--fixed-lengths", "--json", "--quiet", "--device", "cpu", "--threads", "2"])
    assert args.func is run_bench_cli and args.model == "m.gguf" and args.json and args.quiet
    spec = build_spec(args)
    assert (spec.num_seqs, spec.max_input_len, spec.max_output_len, spec.max_batched_tokens, spec.warmup,
            spec.iters, spec.seed, spec.fixed_lengths, spec.max_model_len) == (4, 32, 16, 64, 0, 2, 5, True, 512)
    assert engine_config(args, Settings(), cpu_threads=args.threads) == \
        {"device": "cpu", "dtype": "auto", "cpu_threads": 2}
    plain = parse([])
    assert build_spec(plain) == spec_from("fast") and not hasattr(plain, "model")   # SUPPRESS: keeps top-level
    mt = parse(["--multi-turn", "--turns", "3", "--user-tokens", "8", "--reply-tokens", "4", "--sessions", "2"])
    assert mt.multi_turn and (mt.turns, mt.user_tokens, mt.reply_tokens, mt.sessions) == (3, 8, 4, 2)
    assert parse(["--workload", "nano-vllm"]).workload == "nano-vllm"
    with pytest.raises(SystemExit):
        parse(["--tier", "turbo"])
    with pytest.raises(SystemExit):
        parse(["--num-seqs", "0"])


def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    from nanochat.app.cli import main

    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path))
    assert main(["bench", "--model", str(tmp_path / "nope.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanochat bench: error:") and "nope.gguf" in err and "\n" not in err
    assert main(["bench", "--max-input-len", "100", "--max-model-len", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "exceeds max-model-len" in err and "\n" not in err


def test_cli_subprocess_json(tiny_models, tmp_path):
    env = dict(os.environ, NANOCHAT_HOME=str(tmp_path / "home"))
    base = [sys.executable, "-m", "nanochat.app.cli", "bench", "--model", str(tiny_models[ARCH]), "--device", "cpu",
            "--json", "--quiet"]
    r = subprocess.run(base + ["--num-seqs", "2", "--max-input-len", "8", "--max-output-len", "4", "--fixed-lengths",
                               "--threads", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["spec"]["num_seqs"] == 2 and d["iterations"][0]["generated_tokens"] == 8
    assert d["mean"]["generated_tokens"] == 8 and d["engine"]["threads"] == 1
    r = subprocess.run(base + ["--multi-turn", "--turns", "2", "--user-tokens", "8", "--reply-tokens", "4"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert [t["turn"] for t in d["turns"]] == [1, 2] and d["replay"][1]["cached_tokens"] == 0


def test_bench_spec_dataclass_validation():
    with pytest.raises(ValueError, match="warmup"):
        BenchSpec(warmup=-1)
    assert BenchSpec().batched_tokens == 8 * 64


# ---------------------------------------------------------------------------------- speculative decoding
def test_a_variant_draws_other_ids_of_the_same_lengths_and_the_proposer_reaches_every_request():
    from dataclasses import replace

    base = spec_from("fast", seed=2)
    a, b = make_workload(base, 320), make_workload(replace(base, variant=1, speculative="off"), 320)
    assert [len(p) for p in a.prompts] == [len(p) for p in b.prompts] and a.prompts != b.prompts
    assert [p.max_tokens for p in a.params] == [p.max_tokens for p in b.params]
    assert {p.speculative for p in a.params} == {None} and {p.speculative for p in b.params} == {"off"}
    with pytest.raises(ValueError, match="speculative must be off, ngram or draft"):
        BenchSpec(speculative="fast")


def test_a_run_counts_its_proposals_and_tokens_per_step(engine):
    from dataclasses import replace

    spec = spec_from("fast", **SMALL)
    off = run_bench(engine, replace(spec, speculative="off")).iterations[0]
    assert (off.spec_proposed, off.spec_accepted, off.spec_tokens_per_step) == (0, 0, 1.0)
    engine._propose = lambda seq, room: [1] * min(room, 3)   # proposals the model mostly rejects
    try:
        it = run_bench(engine, replace(spec, speculative="ngram", variant=1)).iterations[0]
    finally:
        del engine._propose
    assert it.spec_proposed > 0 and 0 <= it.spec_accepted <= it.spec_proposed
    decoded = it.generated_tokens - it.num_requests          # the first tokens came from the prefill
    assert it.spec_tokens_per_step == pytest.approx(decoded / (decoded - it.spec_accepted))
    assert it.cached_tokens == 0                              # the variant's prompts are not the first run's
    engine.block_manager.check_invariants()


def test_cli_compares_speculation_with_off(tiny_models, tmp_path, capsys, monkeypatch):
    from nanochat.app.cli import main

    # wide enough that the table never squeezes a column (it cut "1.00" to "1." once the figures were wider)
    env = dict(os.environ, NANOCHAT_HOME=str(tmp_path / "home"), COLUMNS="200")
    base = [sys.executable, "-m", "nanochat.app.cli", "bench", "--model", str(tiny_models[ARCH]), "--device", "cpu",
            "--quiet", "--num-seqs", "2", "--max-input-len", "8", "--max-output-len", "12", "--fixed-lengths"]
    r = subprocess.run(base + ["--speculative", "ngram", "--json"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["mode"] == "ngram" and d["off"]["spec"]["speculative"] == "off"
    assert d["speculative"]["spec"]["speculative"] == "ngram" and d["speculative"]["spec"]["variant"] == 1
    assert d["off"]["mean"]["spec_proposed"] == 0 and d["off"]["mean"]["spec_tokens_per_step"] == 1.0
    assert d["speculative"]["mean"]["generated_tokens"] == d["off"]["mean"]["generated_tokens"] == 24
    assert d["throughput_ratio"] == pytest.approx(d["speculative"]["mean"]["throughput_tok_s"]
                                                  / d["off"]["mean"]["throughput_tok_s"])
    r = subprocess.run(base + ["--speculative", "ngram"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["off"], ["ngram"])}
    assert set(rows) == {"off", "ngram"} and rows["off"][-1] == "1.00"
    assert re.search(r"ngram / off: \d+\.\d\dx tok/s, \d+\.\d\dx decode tok/s", r.stdout)
    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path / "home"))
    assert main(["bench", "--multi-turn", "--speculative", "ngram"]) == 2
    assert "--multi-turn's seeded turns never speculate" in capsys.readouterr().err


def test_the_speculative_comparison_names_the_requests_proposer():
    """--speculative auto and ngram compare prompt lookup with off; a model's path compares its drafts; off and no
    flag compare nothing."""
    from types import SimpleNamespace

    from nanochat.app.bench_cli import comparison_mode

    def mode(value):
        return comparison_mode(SimpleNamespace(speculative=value, multi_turn=False))

    assert [mode(v) for v in ("auto", "ngram", "/models/draft.gguf", "off", None)] == \
        ["ngram", "ngram", "draft", None, None]
