"""nanochat against its peers on the same GGUF file, the same thread count and the same workload.

    .venv/bin/python benchmarks/peers.py [--model FILE.gguf] [--threads 2] [--repeats 3] [--json]
        [--peer-python /path/to/venv/bin/python] [--peers llama.cpp,transformers]

Peers:
  llama.cpp     through llama-cpp-python, run in `--peer-python` (a separate virtualenv: installing
                llama-cpp-python compiles llama.cpp, ~20 min on 2 cores) by benchmarks/llamacpp_worker.py,
                which talks JSON over a pipe. n_threads = n_threads_batch = --threads.
  transformers  `generate` on the same GGUF (gguf_file=..., dequantized to fp32) by
                benchmarks/transformers_worker.py in a process of its own (this interpreter),
                torch.set_num_threads(--threads).
Each peer runs with the environment this script was given, not with nanochat's own defaults.

Metrics (median over --repeats, engines alternating inside each repeat; the same token ids for every
engine within a repeat, new ids each repeat so no prefix cache helps):
  decode tok/s   single stream: --decode-tokens greedy tokens after a short prompt, timed from the
                 first token to the last ((n - 1) / time)
  prompt tok/s   prompt processing: a --prompt-tokens prompt to its first token (tokens / TTFT)
  batch tok/s    nanochat's `bench --tier fast` workload (8 requests, up to 64 + 64 tokens): nanochat
                 batches them, llama.cpp serves them one after another (single stream)
Ratios are nanochat / peer: above 1 nanochat is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# transformers' GGUF conversion bar ignores its logging switches; tqdm reads this when imported.
os.environ.setdefault("TQDM_DISABLE", "1")
HERE = Path(__file__).resolve().parent
INSTALL_HINT = ("llama.cpp peer skipped: llama-cpp-python is not importable by {python}. Install it into a "
                "separate virtualenv (it compiles llama.cpp: ~20 min on 2 cores; never in CI):\n"
                "    python3 -m venv /work/peers-venv\n"
                "    CMAKE_ARGS=\"-DGGML_NATIVE=ON\" /work/peers-venv/bin/pip install numpy llama-cpp-python\n"
                "then pass --peer-python /work/peers-venv/bin/python (or set NANOCHAT_PEER_PYTHON).")
METRICS = {"decode": "decode tok/s (1 stream)", "prompt": "prompt tok/s", "batch": "batch tok/s (fast tier)"}
ENGINES = ("nanochat", "llama.cpp", "transformers")


class PeerError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------- workloads
@dataclass
class Round:
    """The token ids of one repeat, shared by every engine."""

    decode_prompt: list[int]
    prompt: list[int]
    batch: list[tuple[list[int], int]]     # (prompt ids, output length) for the fast tier


def make_round(seed: int, args, vocab: int) -> Round:
    from nanochat.engine.bench import make_workload, spec_from

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(min(vocab, 10001)) for _ in range(n)]   # noqa: E731
    w = make_workload(spec_from("fast", seed=seed), vocab)
    return Round(ids(args.decode_prompt_tokens), ids(args.prompt_tokens),
                 [(p, sp.max_tokens) for p, sp in zip(w.prompts, w.params)])


# ---------------------------------------------------------------------------------- engines
class NanochatRunner:
    name = "nanochat"

    def __init__(self, model: str, threads: int, args):
        from nanochat.engine import LLMEngine
        from nanochat.engine.bench import spec_from

        self.spec = spec_from("fast")
        ctx = max(args.prompt_tokens, args.decode_prompt_tokens + args.decode_tokens, self.spec.max_model_len) + 16
        self.engine = LLMEngine(model, device="cpu", cpu_threads=threads, max_model_len=ctx,
                                max_num_seqs=self.spec.num_seqs,
                                max_num_batched_tokens=max(self.spec.batched_tokens, args.prompt_tokens))
        self.vocab = self.engine.model_config.vocab_size

    def _run_one(self, ids: list[int], n: int):
        from nanochat.engine import SamplingParams

        rid = self.engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        out = []
        while True:
            for ev in self.engine.step():
                if ev.request_id != rid:
                    continue
                if ev.token_id is not None:
                    out.append(ev.token_id)
                if ev.finished:
                    if ev.finish_reason == "error":
                        raise PeerError(f"nanochat: {ev.error}")
                    return ev.stats, out

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        stats, out = self._run_one(ids, n)
        return stats.decode_tok_s, out

    def prompt(self, ids: list[int]) -> float:
        return len(ids) / self._run_one(ids, 1)[0].ttft

    def batch(self, rnd: Round, seed: int) -> float:
        from dataclasses import replace

        from nanochat.engine.bench import run_bench

        report = run_bench(self.engine, replace(self.spec, seed=seed))
        return report.iterations[0].throughput_tok_s

    def close(self) -> None:
        pass


class WorkerRunner:
    """A peer in a process of its own (llamacpp_worker.py / transformers_worker.py, see
    worker_protocol.py), started with the environment this script was given: nanochat's own
    defaults (OMP_WAIT_POLICY, set on import) must not change the peers' speed."""

    def __init__(self, name: str, worker: Path, python: str, load: dict):
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1, env=peer_env())
        info = self._call({"cmd": "load", **load})
        self.version, self.vocab = info["version"], info["n_vocab"]

    def _call(self, req: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.log.seek(0)
            tail = [ln for ln in self.log.read().splitlines() if ln.strip()][-1:] or ["no output"]
            raise PeerError(f"{self.name} worker died: {tail[0]}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(f"{self.name}: {reply['error']}")
        return reply

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int]]:
        r = self._call({"cmd": "decode", "ids": ids, "n": n})
        return r["tokens"] / r["seconds"], r["ids"]

    def prompt(self, ids: list[int]) -> float:
        return len(ids) / self._call({"cmd": "prefill", "ids": ids})["seconds"]

    def batch(self, rnd: Round, seed: int) -> float | None:
        if self.name != "llama.cpp":
            return None   # transformers: HF generate has no continuous batching to compare
        r = self._call({"cmd": "serve", "requests": [[ids, n] for ids, n in rnd.batch]})
        return r["tokens"] / r["seconds"]

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


def peer_env() -> dict[str, str]:
    import nanochat

    env = dict(os.environ)
    if nanochat.OMP_WAIT_POLICY_DEFAULTED:
        env.pop("OMP_WAIT_POLICY", None)
    return env


# ---------------------------------------------------------------------------------- the run
@dataclass
class Results:
    runs: dict = field(default_factory=lambda: {m: {} for m in METRICS})
    versions: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    # greedy decode runs: how many leading tokens each peer shares with nanochat (a sanity check
    # that every engine ran the same model on the same ids; bf16/int4 rounding may split them late)
    agreement: dict = field(default_factory=dict)

    def add(self, metric: str, engine: str, value: float | None) -> None:
        if value is not None:
            self.runs[metric].setdefault(engine, []).append(value)

    def median(self, metric: str, engine: str) -> float | None:
        vals = self.runs[metric].get(engine)
        return statistics.median(vals) if vals else None

    def best(self, metric: str, engine: str) -> float | None:
        vals = self.runs[metric].get(engine)
        return max(vals) if vals else None

    def ratio(self, metric: str, peer: str, of=None) -> float | None:
        of = of or self.median
        ours, theirs = of(metric, "nanochat"), of(metric, peer)
        return ours / theirs if ours and theirs else None


def _peer_python(args) -> str:
    return args.peer_python or os.environ.get("NANOCHAT_PEER_PYTHON") or sys.executable


def _has_llama_cpp(python: str) -> bool:
    try:
        r = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def start_engines(args, log) -> tuple[list, Results]:
    import torch

    res = Results()
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    engines = []
    log(f"loading nanochat ({args.model})")
    engines.append(NanochatRunner(args.model, args.threads, args))
    res.versions["nanochat"] = "engine"
    res.versions["torch"] = torch.__version__
    if "llama.cpp" in peers:
        python = _peer_python(args)
        if _has_llama_cpp(python):
            log(f"loading llama.cpp ({python})")
            ctx = max(args.prompt_tokens, args.decode_prompt_tokens + args.decode_tokens, 128) + 16
            runner = WorkerRunner("llama.cpp", HERE / "llamacpp_worker.py", python,
                                  {"model": args.model, "threads": args.threads, "n_ctx": ctx})
            engines.append(runner)
            res.versions["llama.cpp"] = f"llama-cpp-python {runner.version}"
        else:
            res.skipped["llama.cpp"] = INSTALL_HINT.format(python=python)
            log(res.skipped["llama.cpp"] if args.json else "llama.cpp peer skipped (see below)")
    if "transformers" in peers:
        try:
            log("loading transformers (GGUF dequantized to fp32)")
            runner = WorkerRunner("transformers", HERE / "transformers_worker.py", sys.executable,
                                  {"model": args.model, "threads": args.threads})
            engines.append(runner)
            res.versions["transformers"] = runner.version
        except PeerError as e:
            res.skipped["transformers"] = f"transformers peer skipped: {e}"
            log(res.skipped["transformers"])
    return engines, res


def measure(engines: list, res: Results, args, log) -> None:
    vocab = min(e.vocab for e in engines)
    warm = make_round(10_000, args, vocab)
    for e in engines:   # one-time costs (allocation, first kernels) out of the measurements
        e.decode(warm.decode_prompt, 4)
        e.prompt(warm.prompt[:32])
    for r in range(args.repeats):
        rnd = make_round(r, args, vocab)
        order = engines if r % 2 == 0 else list(reversed(engines))   # alternate who goes first
        greedy = {}
        for e in order:
            t0 = time.perf_counter()
            tok_s, greedy[e.name] = e.decode(rnd.decode_prompt, args.decode_tokens)
            res.add("decode", e.name, tok_s)
            res.add("prompt", e.name, e.prompt(rnd.prompt))
            if not args.skip_batch:
                res.add("batch", e.name, e.batch(rnd, r))
            log(f"repeat {r + 1}/{args.repeats}: {e.name} done in {time.perf_counter() - t0:.1f} s")
        for name, ids in greedy.items():
            if name != "nanochat":
                res.agreement.setdefault(name, []).append(_common_prefix(greedy["nanochat"], ids))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def report_dict(res: Results, args, engines) -> dict:
    names = [e.name for e in engines]
    metrics = {}
    for m, label in METRICS.items():
        metrics[m] = {"label": label, "unit": "tok/s",
                      "engines": {n: {"median": res.median(m, n), "best": res.best(m, n),
                                      "runs": res.runs[m].get(n, [])} for n in names},
                      "ratio": {p: res.ratio(m, p) for p in names if p != "nanochat"},
                      "ratio_best": {p: res.ratio(m, p, res.best) for p in names if p != "nanochat"}}
    return {"model": os.path.basename(args.model), "threads": args.threads, "repeats": args.repeats,
            "decode_tokens": args.decode_tokens, "prompt_tokens": args.prompt_tokens, "versions": res.versions,
            "metrics": metrics, "greedy_agreement": res.agreement, "skipped": res.skipped}


def _table(d: dict, stat: str, ratio_key: str) -> list[str]:
    engines = list(next(iter(d["metrics"].values()))["engines"])
    peers = [e for e in engines if e != "nanochat"]
    head = ["metric"] + engines + [f"nanochat/{p}" for p in peers]
    rows = []
    for m in d["metrics"].values():
        cells = [m["label"]]
        cells += ["-" if m["engines"][e][stat] is None else f"{m['engines'][e][stat]:.1f}" for e in engines]
        cells += ["-" if m[ratio_key][p] is None else f"{m[ratio_key][p]:.2f}x" for p in peers]
        rows.append(cells)
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    return ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in [head] + rows]


def print_table(d: dict) -> None:
    print(f"{d['model']}, {d['threads']} threads, {d['repeats']} repeats "
          f"(decode: {d['decode_tokens']} tokens; prompt: {d['prompt_tokens']} tokens)")
    print("median:")
    print("\n".join(_table(d, "median", "ratio")))
    print("best (the least disturbed run, on a busy machine the better guide):")
    print("\n".join(_table(d, "best", "ratio_best")))
    for name, runs in d["greedy_agreement"].items():
        print(f"greedy tokens shared with {name}: {runs} of {d['decode_tokens']} (per repeat)")
    for name, why in d["skipped"].items():
        print(f"\n{why}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF file (default: the built-in SmolLM2-135M Q4_1)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every engine (2)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per engine, alternating (3)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated for decode tok/s (128)")
    p.add_argument("--decode-prompt-tokens", type=int, default=16, help="prompt before the decode run (16)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for prompt tok/s (512)")
    p.add_argument("--peers", default="llama.cpp,transformers", help="comma-separated: llama.cpp,transformers")
    p.add_argument("--peer-python", help="interpreter with llama-cpp-python (default: $NANOCHAT_PEER_PYTHON, "
                                         "else this one)")
    p.add_argument("--skip-batch", action="store_true", help="leave out the fast-tier batch measurement")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = p.parse_args(argv)
    if args.model is None:
        from nanochat.models.catalog import resolve_default_model
        args.model = resolve_default_model(None)
    if not str(args.model).endswith(".gguf"):
        p.error("--model must be a .gguf file (every engine loads the same file)")
    for name in ("threads", "repeats", "decode_tokens", "decode_prompt_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    engines = []
    try:
        engines, res = start_engines(args, log)
        measure(engines, res, args, log)
        d = report_dict(res, args, engines)
    except PeerError as e:
        print(f"peers: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        for e in engines:
            e.close()
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print_table(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
