"""nanochat against its peers on the same GGUF files, the same thread count and the same workload.

    .venv/bin/python benchmarks/peers.py [--model FILE.gguf | --matrix | --models a,b,...] [--threads 2]
        [--repeats 3] [--json] [--peer-python /path/to/venv/bin/python] [--peers llama.cpp,transformers]
        [--isa avx2] [--models-dir DIR] [--rows decode,prompt,...]

Models: --model FILE runs one file (default: the built-in SmolLM2-135M Q4_1); --matrix runs every model
of benchmarks/matrix_models.py (SmolLM2 in six quantizations, a random-weight Qwen3-0.6B in five,
random-weight Phi-3-mini and Gemma 3 1B in Q4_K_M), --models picks some of them (names or families: `smollm2,qwen3-0.6b-q4_k_m`). The matrix's files are
made on first use (llama.cpp's quantizer, in --peer-python) and cached under --models-dir.

Engines, each in a process of its own, speaking JSON lines over a pipe (worker_protocol.py):
  nanochat      benchmarks/nanochat_worker.py in this interpreter (LLM(...), device cpu, cpu_threads).
  llama.cpp     llama-cpp-python in `--peer-python` (a separate virtualenv: installing llama-cpp-python
                compiles llama.cpp, ~20 min on 2 cores) by benchmarks/llamacpp_worker.py.
                n_threads = n_threads_batch = --threads.
  transformers  `generate` on the same GGUF (gguf_file=..., dequantized to fp32) by
                benchmarks/transformers_worker.py (this interpreter), torch.set_num_threads(--threads).
                Optional: on by default for --model, off for the matrix (slow on 151k-token vocabularies).
The peers run with the environment this script was given, not with nanochat's own defaults.

Rows (median over --repeats; engines alternate inside each repeat, the same token ids for every engine
within a repeat, new ids each repeat so no prefix cache helps), with the target for nanochat:
  decode tok/s   one stream: --decode-tokens greedy tokens after a short prompt, timed from the first
                 token to the last ((n - 1) / time)                                  target >= 1.0x
  prompt tok/s   a --prompt-tokens prompt to its first token (tokens / TTFT)        target >= 1.0x
  batch tok/s    nanochat's `bench --tier fast` workload (8 requests, up to 64 + 64 tokens): nanochat
                 batches them, llama.cpp serves them one after another (one stream)  target >= 2x
  load s         LLM(model) / Llama(model_path) construction in a fresh process, context --n-ctx
                 (4096), imports excluded                                           target <= 1.5x
  one-shot s     a whole fresh process: `nanochat --model FILE --prompt Hi --max-tokens 8 --device cpu
                 --max-model-len 4096` vs `llamacpp_worker.py oneshot` (Llama(...) + one chat
                 completion of 8 tokens)                                            target <= 2x
  peak RSS MB    the peak resident set of that one-shot process (wait4's ru_maxrss)  target <= 1.5x
  multi-turn     `nanochat bench --multi-turn`'s conversation (resident KV, --turns 8), turn-8 TTFT /
                 turn-1 TTFT; llama.cpp holds the same shape of conversation in its context (the
                 history's KV reused, each turn evaluating only its new tokens) as a reference
                                                                                    target <= 1.5
Ratios are nanochat / llama.cpp. Each table names the CPU ISA of each engine: nanochat's kernels
(cpu_qgemv.simd_level(); --isa avx2 forces their AVX2 path) and llama.cpp's build
(llama_print_system_info()).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# transformers' GGUF conversion bar ignores its logging switches; tqdm reads this when imported.
os.environ.setdefault("TQDM_DISABLE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import matrix_models  # noqa: E402  (beside this file)

INSTALL_HINT = ("llama.cpp peer skipped: llama-cpp-python is not importable by {python}. Install it into a "
                "separate virtualenv (it compiles llama.cpp: ~20 min on 2 cores; never in CI):\n"
                "    python3 -m venv /work/peers-venv\n"
                "    CMAKE_ARGS=\"-DGGML_NATIVE=ON\" /work/peers-venv/bin/pip install numpy llama-cpp-python\n"
                "then pass --peer-python /work/peers-venv/bin/python (or set NANOCHAT_PEER_PYTHON).")
ENGINES = ("nanochat", "llama.cpp", "transformers")
PEER = "llama.cpp"     # the peer the ratios and targets are against


@dataclass(frozen=True)
class Row:
    label: str
    unit: str
    higher: bool          # a higher figure is better
    target: float
    on: str = "ratio"     # "ratio": nanochat / llama.cpp meets the target; "value": nanochat's own figure
    digits: int = 1

    def target_text(self) -> str:
        op = ">=" if self.higher else "<="
        return f"{op} {self.target:.1f}" + ("x" if self.on == "ratio" else "")

    def met(self, x: float | None) -> bool | None:
        if x is None:
            return None
        return x >= self.target if self.higher else x <= self.target


ROWS = {
    "decode": Row("decode tok/s (1 stream)", "tok/s", True, 1.0),
    "prompt": Row("prompt tok/s", "tok/s", True, 1.0),
    "batch": Row("batch tok/s (fast tier; llama.cpp 1 stream)", "tok/s", True, 2.0),
    "load": Row("load s", "s", False, 1.5, digits=2),
    "oneshot": Row("one-shot s", "s", False, 2.0, digits=2),
    "rss": Row("peak RSS MB (one-shot)", "MB", False, 1.5, digits=0),
    "multiturn": Row("multi-turn TTFT turn{turns}/turn1", "x", False, 1.5, on="value", digits=2),
}
WORKER_ROWS = ("decode", "prompt", "batch", "multiturn")   # measured by the long-lived workers
PROCESS_ROWS = ("load", "oneshot", "rss")                  # measured on fresh processes
ONESHOT_SHIM = """import sys
from nanochat.app.cli import main
sys.exit(main(sys.argv[1:]))
"""


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
    from nanochat.engine.serve.bench import make_workload, spec_from

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(min(vocab, 10001)) for _ in range(n)]   # noqa: E731
    w = make_workload(spec_from("fast", seed=seed), vocab)
    return Round(ids(args.decode_prompt_tokens), ids(args.prompt_tokens),
                 [(p, sp.max_tokens) for p, sp in zip(w.prompts, w.params)])


# ---------------------------------------------------------------------------------- engines
class WorkerRunner:
    """An engine in a process of its own (nanochat_worker.py / llamacpp_worker.py /
    transformers_worker.py, see worker_protocol.py)."""

    def __init__(self, name: str, worker: Path, python: str, load: dict, env: dict[str, str]):
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1, env=env)
        try:
            self.info = self._call({"cmd": "load", **load})
        except BaseException:
            self.close()
            raise
        self.version, self.vocab = self.info["version"], self.info["n_vocab"]

    def _call(self, req: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, ValueError):
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
        if self.name == "nanochat":
            return self._call({"cmd": "bench", "seed": seed})["tok_s"]
        if self.name != "llama.cpp":
            return None   # transformers: HF generate has no continuous batching to compare
        r = self._call({"cmd": "serve", "requests": [[ids, n] for ids, n in rnd.batch]})
        return r["tokens"] / r["seconds"]

    def multi_turn(self, args, seed: int) -> dict | None:
        if self.name == "transformers":
            return None
        from nanochat.engine.serve.bench import PROMPT_ID_MAX
        return self._call({"cmd": "multi_turn", "turns": args.turns, "user_tokens": args.turn_tokens,
                           "reply_tokens": args.reply_tokens, "seed": seed, "id_max": PROMPT_ID_MAX})

    def close(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait()


def peer_env(args=None) -> dict[str, str]:
    """The environment this script was given, for the peers (nanochat's engine-process defaults, such as
    OMP_WAIT_POLICY=PASSIVE, go to nanochat's worker alone: on an idle machine PASSIVE slows llama.cpp's
    OpenMP build down, benchmarks/README.md); then --peer-env KEY=VALUE (KEY= unsets)."""
    env = dict(os.environ)
    env.pop("NANOCHAT_CPU_ISA", None)
    for item in getattr(args, "peer_env", None) or []:
        key, _, value = item.partition("=")
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    return env


def nanochat_env(args) -> dict[str, str]:
    env = dict(os.environ)
    env["NANO_VLLM_CPU_THREADS"] = str(args.threads)   # the one-shot CLI has no --threads
    if args.isa:
        env["NANOCHAT_CPU_ISA"] = args.isa   # the engine loads that build of its kernels
    return env


# ---------------------------------------------------------------------------------- results
@dataclass
class Results:
    runs: dict = field(default_factory=lambda: {m: {} for m in ROWS})
    versions: dict = field(default_factory=dict)
    isa: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)      # per-row details (multi-turn TTFTs, one-shot tokens)
    # greedy decode runs: how many leading tokens each peer shares with nanochat (a sanity check
    # that every engine ran the same model on the same ids; bf16/int4 rounding may split them late)
    agreement: dict = field(default_factory=dict)

    def add(self, row: str, engine: str, value: float | None) -> None:
        if value is not None:
            self.runs[row].setdefault(engine, []).append(value)

    def stat(self, row: str, engine: str, kind: str) -> float | None:
        vals = self.runs[row].get(engine)
        if not vals:
            return None
        if kind == "median":
            return statistics.median(vals)
        return max(vals) if ROWS[row].higher else min(vals)

    def ratio(self, row: str, peer: str, kind: str) -> float | None:
        ours, theirs = self.stat(row, "nanochat", kind), self.stat(row, peer, kind)
        return ours / theirs if ours and theirs else None


def _has_llama_cpp(python: str) -> bool:
    try:
        r = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _context(args) -> int:
    """One context length for every engine: --n-ctx, grown to fit the workloads."""
    from nanochat.engine.serve.bench import multi_turn_context

    need = max(args.prompt_tokens + 1, args.decode_prompt_tokens + args.decode_tokens,
               multi_turn_context(args.turns, args.turn_tokens, args.reply_tokens, 16))
    return max(args.n_ctx, need + 16)


# ---------------------------------------------------------------------------------- the run
def load_request(engine: str, path: str, args) -> dict:
    """The worker's load request: one context length for every engine (--n-ctx, grown to fit)."""
    from nanochat.engine.serve.bench import spec_from

    ctx = _context(args)
    if engine == "nanochat":
        spec = spec_from("fast")
        return {"model": path, "threads": args.threads, "max_model_len": ctx, "max_num_seqs": spec.num_seqs,
                "max_num_batched_tokens": max(spec.batched_tokens, args.prompt_tokens)}
    if engine == "llama.cpp":
        return {"model": path, "threads": args.threads, "n_ctx": ctx}
    return {"model": path, "threads": args.threads}


def start_worker(engine: str, path: str, args) -> WorkerRunner:
    if engine == "nanochat":
        return WorkerRunner(engine, HERE / "nanochat_worker.py", sys.executable, load_request(engine, path, args),
                            nanochat_env(args))
    if engine == "llama.cpp":
        return WorkerRunner(engine, HERE / "llamacpp_worker.py", matrix_models.peer_python(args.peer_python),
                            load_request(engine, path, args), peer_env(args))
    return WorkerRunner(engine, HERE / "transformers_worker.py", sys.executable, load_request(engine, path, args),
                        peer_env(args))


def start_engines(path: str, args, res: Results, peers: list[str], log) -> list[WorkerRunner]:
    import torch

    engines: list[WorkerRunner] = []
    try:
        log(f"loading nanochat ({Path(path).name})")
        nc = start_worker("nanochat", path, args)
        engines.append(nc)
        res.add("load", "nanochat", nc.info["load_s"])
        res.isa["nanochat"] = nc.info["isa"]
        res.versions["nanochat"] = nc.version
        res.versions["torch"] = torch.__version__
        if "llama.cpp" in peers:
            python = matrix_models.peer_python(args.peer_python)
            if _has_llama_cpp(python):
                log(f"loading llama.cpp ({python})")
                try:
                    lc = start_worker("llama.cpp", path, args)
                    engines.append(lc)
                    res.add("load", "llama.cpp", lc.info["load_s"])
                    res.isa["llama.cpp"] = lc.info["isa"]
                    res.isa["llama.cpp system_info"] = lc.info["system_info"]
                    res.versions["llama.cpp"] = f"llama-cpp-python {lc.version}"
                except PeerError as e:
                    res.skipped["llama.cpp"] = f"llama.cpp could not load it: {e}"
                    log(res.skipped["llama.cpp"])
            else:
                res.skipped["llama.cpp"] = INSTALL_HINT.format(python=python)
                log(res.skipped["llama.cpp"] if args.json else "llama.cpp peer skipped (see below)")
        if "transformers" in peers:
            try:
                log("loading transformers (GGUF dequantized to fp32)")
                tf = start_worker("transformers", path, args)
                engines.append(tf)
                res.add("load", "transformers", tf.info.get("load_s"))
                res.versions["transformers"] = tf.version
            except PeerError as e:
                res.skipped["transformers"] = f"transformers peer skipped: {e}"
                log(res.skipped["transformers"])
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines


def measure(engines: list[WorkerRunner], res: Results, args, log) -> None:
    rows = args.rows
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
            if "decode" in rows:
                tok_s, greedy[e.name] = e.decode(rnd.decode_prompt, args.decode_tokens)
                res.add("decode", e.name, tok_s)
            if "prompt" in rows:
                res.add("prompt", e.name, e.prompt(rnd.prompt))
            if "batch" in rows:
                res.add("batch", e.name, e.batch(rnd, r))
            if "multiturn" in rows:
                mt = e.multi_turn(args, r)
                if mt is not None:
                    res.add("multiturn", e.name, mt["ratio"])
                    res.extra.setdefault("multiturn_ttft_ms", []).append(mt["ttft_ms"])
            log(f"repeat {r + 1}/{args.repeats}: {e.name} done in {time.perf_counter() - t0:.1f} s")
        if "nanochat" in greedy:
            for name, ids in greedy.items():
                if name != "nanochat":
                    res.agreement.setdefault(name, []).append(_common_prefix(greedy["nanochat"], ids))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_process(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MB, stdout) of a whole process; raises PeerError when it fails."""
    with tempfile.TemporaryFile(mode="w+") as out, tempfile.TemporaryFile(mode="w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)   # this child's own rusage (ru_maxrss: KiB on Linux)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            tail = [ln for ln in err.read().splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
            raise PeerError(f"{Path(cmd[0]).name} exited {proc.returncode}: {tail[0]}")
        out.seek(0)
        return wall, usage.ru_maxrss * 1024 / 1e6, out.read()


def oneshot_command(engine: str, path: str, args) -> tuple[list[str], dict[str, str]]:
    ctx = str(args.n_ctx)
    if engine == "nanochat":
        exe = Path(sys.executable).with_name("nanochat")
        head = [str(exe)] if exe.exists() and not args.isa else [sys.executable, "-c", ONESHOT_SHIM]
        return head + ["--model", path, "--prompt", args.oneshot_prompt, "--max-tokens", str(args.oneshot_tokens),
                       "--device", "cpu", "--max-model-len", ctx, "--temperature", "0", "--ignore-eos",
                       "--quiet"], nanochat_env(args)
    python = matrix_models.peer_python(args.peer_python)
    return [python, str(HERE / "llamacpp_worker.py"), "oneshot", path, "--prompt", args.oneshot_prompt,
            "--max-tokens", str(args.oneshot_tokens), "--threads", str(args.threads), "--n-ctx", ctx], peer_env(args)


def fresh_load(engine: str, path: str, args) -> float:
    w = start_worker(engine, path, args)
    w.close()
    return w.info["load_s"]


def measure_processes(path: str, engines: list[str], res: Results, args, log) -> None:
    """Fresh processes: load time (repeats after the first; the first came from the long-lived
    workers), and the one-shot's wall time and peak RSS, engines alternating."""
    for r in range(args.repeats):
        order = engines if r % 2 == 0 else list(reversed(engines))
        for e in order:
            try:
                if "load" in args.rows and r > 0:
                    res.add("load", e, fresh_load(e, path, args))
                if "oneshot" in args.rows or "rss" in args.rows:
                    cmd, env = oneshot_command(e, path, args)
                    wall, rss, out = run_process(cmd, env, args.timeout)
                    res.add("oneshot", e, wall)
                    res.add("rss", e, rss)
                    if e == "llama.cpp":
                        res.extra.setdefault("llama.cpp_oneshot_tokens", []).append(json.loads(out)["tokens"])
                log(f"repeat {r + 1}/{args.repeats}: {e} fresh-process rows done")
            except PeerError as err:
                res.errors.append(f"{e} (fresh process): {err}")
                log(f"{e}: {err}")


def run_model(name: str, path: str, args, log) -> dict:
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    res = Results()
    res.extra["loadavg_before"] = os.getloadavg()[0]
    _prime_page_cache(path)
    engines: list[WorkerRunner] = []
    try:
        engines = start_engines(path, args, res, peers, log)
        if any(r in args.rows for r in WORKER_ROWS):
            measure(engines, res, args, log)
    except PeerError as e:
        res.errors.append(str(e))
        log(f"{name}: {e}")
    finally:
        names = [e.name for e in engines]
        for e in engines:
            e.close()
    if engines and any(r in args.rows for r in PROCESS_ROWS):
        measure_processes(path, [n for n in names if n in ("nanochat", "llama.cpp")], res, args, log)
    res.extra["loadavg_after"] = os.getloadavg()[0]
    return report_dict(name, path, res, args, names or ["nanochat"])


def _prime_page_cache(path: str) -> None:
    """Read the file once, so that whichever engine loads first does not pay the disk for the other."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


# ---------------------------------------------------------------------------------- output
def report_dict(name: str, path: str, res: Results, args, names: list[str]) -> dict:
    peers = [n for n in names if n != "nanochat"]
    metrics = {}
    for key, row in ROWS.items():
        if key not in args.rows:
            continue
        ratio = {p: res.ratio(key, p, "median") for p in peers}
        ratio_best = {p: res.ratio(key, p, "best") for p in peers}
        mine = res.stat(key, "nanochat", "median")
        judged = mine if row.on == "value" else ratio.get(PEER)
        metrics[key] = {
            "label": row.label.format(turns=args.turns), "unit": row.unit, "higher_is_better": row.higher,
            "engines": {n: {"median": res.stat(key, n, "median"), "best": res.stat(key, n, "best"),
                            "runs": res.runs[key].get(n, [])} for n in names},
            "ratio": ratio if row.on == "ratio" else {}, "ratio_best": ratio_best if row.on == "ratio" else {},
            "target": row.target_text(), "target_on": row.on, "met": row.met(judged),
            "met_best": row.met(res.stat(key, "nanochat", "best") if row.on == "value" else ratio_best.get(PEER)),
            "isa": {n: res.isa.get(n) for n in names if n in res.isa},
        }
    return {"name": name, "model": os.path.basename(path), "file": path, "threads": args.threads,
            "peer_env": args.peer_env or [],
            "repeats": args.repeats, "isa": res.isa, "isa_requested": args.isa, "versions": res.versions,
            "metrics": metrics, "details": res.extra, "greedy_agreement": res.agreement,
            "skipped": res.skipped, "errors": res.errors}


def _fmt(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _isa_header(d: dict) -> str:
    isa = d["isa"]
    text = f"ISA: nanochat {isa.get('nanochat', '?')}"
    if "llama.cpp" in isa:
        text += f", llama.cpp {isa['llama.cpp']}"
        want = d["isa_requested"]
        if want and not isa["llama.cpp"].startswith(want):
            text += f" (not {want}: build a peer venv without AVX-512, see benchmarks/README.md)"
    return text


def _busy_note(d: dict) -> str:
    """A warning when other jobs loaded the machine (1-minute load average above the CPU count)."""
    cpus = os.cpu_count() or 1
    load = max(d["details"].get("loadavg_before", 0), d["details"].get("loadavg_after", 0))
    if load <= cpus:
        return ""
    if any(e.startswith("OMP_WAIT_POLICY=") for e in d.get("peer_env") or []):
        return f" Machine busy: load average {load:.1f} on {cpus} CPUs."
    return (f" Machine busy: load average {load:.1f} on {cpus} CPUs; spin-waiting engines (llama.cpp's "
            f"OpenMP) suffer most, compare with --peer-env OMP_WAIT_POLICY=PASSIVE.")


def markdown_table(d: dict, stat: str = "median") -> list[str]:
    names = list(next(iter(d["metrics"].values()))["engines"]) if d["metrics"] else ["nanochat"]
    others = [n for n in names if n not in ("nanochat", PEER)]
    rkey, mkey = ("ratio", "met") if stat == "median" else ("ratio_best", "met_best")
    head = ["metric", "nanochat", PEER, f"nanochat/{PEER}", "target", "met"]
    for o in others:
        head += [o, f"nanochat/{o}"]
    title = d["model"] if d["name"] == d["model"] else f"{d['name']}: {d['model']}"
    lines = [f"### {title} ({d['threads']} threads, {d['repeats']} repeats, {stat})",
             "", _isa_header(d) + "." + _busy_note(d), "", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] + ["---:"] * 3 + ["---", "---"] + ["---:"] * 2 * len(others)) + "|"]
    for key, m in d["metrics"].items():
        digits = ROWS[key].digits
        val = lambda n: _fmt(m["engines"].get(n, {}).get(stat), digits)   # noqa: E731
        ratio = m[rkey].get(PEER)
        met = m[mkey]
        cells = [m["label"], val("nanochat"), val(PEER), "-" if ratio is None else f"{ratio:.2f}x",
                 m["target"], "-" if met is None else ("yes" if met else "**no**")]
        for o in others:
            r = m[rkey].get(o)
            cells += [val(o), "-" if r is None else f"{r:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary_table(models: list[dict], stat: str = "median") -> list[str]:
    """One line per model: the judged figure of each row (ratio, or nanochat's value) and whether it met."""
    keys = [k for k in ROWS if any(k in d["metrics"] for d in models)]
    rkey, mkey = ("ratio", "met") if stat == "median" else ("ratio_best", "met_best")
    lines = ["### summary (" + stat + "; ratio nanochat/llama.cpp, multi-turn: nanochat's turn ratio)", "",
             "| model | ISA | " + " | ".join(k for k in keys) + " | met |",
             "|---|---|" + "---:|" * len(keys) + "---:|"]
    for d in models:
        cells, met, total = [d["name"], f"{d['isa'].get('nanochat', '?')} / {d['isa'].get(PEER, '-')}"], 0, 0
        for k in keys:
            m = d["metrics"].get(k)
            if m is None:
                cells.append("-")
                continue
            x = m["engines"]["nanochat"][stat] if m["target_on"] == "value" else m[rkey].get(PEER)
            ok = m[mkey]
            total += ok is not None
            met += bool(ok)
            cells.append("-" if x is None else f"{x:.2f}" + ("" if ok is None else (" ✓" if ok else " ✗")))
        cells.append(f"{met}/{total}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def print_report(report: dict, stat: str) -> None:
    for d in report["models"]:
        print("\n".join(markdown_table(d, stat)))
        for name, runs in d["greedy_agreement"].items():
            print(f"\ngreedy tokens shared with {name}: {runs} of {report['settings']['decode_tokens']} (per repeat)")
        for why in d["skipped"].values():
            print(f"\n{why}")
        for err in d["errors"]:
            print(f"\nerror: {err}")
        print()
    if len(report["models"]) > 1:
        print("\n".join(summary_table(report["models"], stat)))
    for name, err in report["not_run"].items():
        print(f"\n{name}: not run: {err}")


# ---------------------------------------------------------------------------------- command line
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", help="one GGUF file, or a matrix model name (default: the built-in "
                                       "SmolLM2-135M Q4_1)")
    which.add_argument("--matrix", action="store_true", help="every model of benchmarks/matrix_models.py")
    which.add_argument("--models", help="comma-separated matrix models or families, e.g. "
                                        "smollm2-q4_1,qwen3-0.6b-q4_k_m (see matrix_models.py --list)")
    p.add_argument("--models-dir", type=Path, help="where the matrix's files are made and cached (default: "
                                                   "$NANOCHAT_HOME/cache/peer-models or the user cache dir)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for every engine (2)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per engine, alternating (3)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated for decode tok/s (128)")
    p.add_argument("--decode-prompt-tokens", type=int, default=16, help="prompt before the decode run (16)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for prompt tok/s (512)")
    p.add_argument("--n-ctx", type=int, default=4096, help="context length of every engine and one-shot (4096)")
    p.add_argument("--oneshot-tokens", type=int, default=8, help="tokens the one-shot generates (8)")
    p.add_argument("--oneshot-prompt", default="Hi", help="the one-shot's message (Hi)")
    p.add_argument("--turns", type=int, default=8, help="multi-turn: turns (8)")
    p.add_argument("--turn-tokens", type=int, default=64, help="multi-turn: user tokens per turn (64)")
    p.add_argument("--reply-tokens", type=int, default=64, help="multi-turn: reply tokens per turn (64)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"rows to measure ({','.join(ROWS)})")
    p.add_argument("--skip-batch", action="store_true", help="leave out the fast-tier batch row")
    p.add_argument("--peers", help="comma-separated: llama.cpp,transformers (default: both for --model, "
                                   "llama.cpp for the matrix)")
    p.add_argument("--peer-python", help="interpreter with llama-cpp-python (default: $NANOCHAT_PEER_PYTHON, "
                                         "else this one)")
    p.add_argument("--peer-env", action="append", metavar="KEY=VALUE",
                   help="set (KEY= unsets) a variable for the peers only, e.g. OMP_WAIT_POLICY=PASSIVE on a "
                        "machine busy with other jobs, where llama.cpp's OpenMP spin-waiting collapses; repeatable")
    p.add_argument("--isa", choices=["avx2", "scalar"], help="force nanochat's kernels to this code path "
                   "(NANOCHAT_CPU_ISA); llama.cpp's is fixed at build time (--peer-python)")
    p.add_argument("--stat", choices=["median", "best"], default="median",
                   help="what the tables show (best: the least disturbed run; --json has both)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before a one-shot process is killed")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = p.parse_args(argv)
    for name in ("threads", "repeats", "decode_tokens", "decode_prompt_tokens", "prompt_tokens", "n_ctx",
                 "oneshot_tokens", "turns", "turn_tokens", "reply_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2")
    for item in args.peer_env or []:
        if "=" not in item or not item.partition("=")[0]:
            p.error(f"--peer-env wants KEY=VALUE, got {item!r}")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown row(s) {', '.join(unknown)}; known: {', '.join(ROWS)}")
    args.rows = [r for r in rows if not (args.skip_batch and r == "batch")]
    if args.matrix or args.models:
        try:
            args.names = list(matrix_models.MATRIX) if args.matrix else matrix_models.resolve_names(args.models)
        except ValueError as e:
            p.error(str(e))
    elif args.model in matrix_models.MODELS:
        args.names = [args.model]
    else:
        if args.model is None:
            from nanochat.models.formats.catalog import resolve_default_model
            args.model = resolve_default_model(None)
        if not str(args.model).endswith(".gguf"):
            p.error("--model must be a .gguf file or a matrix model name (every engine loads the same file)")
        args.names = None
    if args.peers is None:
        args.peers = "llama.cpp" if args.names and len(args.names) > 1 else "llama.cpp,transformers"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import nanochat
    from nanochat.kernels import cpu_qgemv
    cpu_qgemv.available()   # build the kernels once here (cached), not inside a timed load
    # An installed package has its bytecode (pip compiles it); a source checkout run with
    # PYTHONDONTWRITEBYTECODE=1 would compile nanochat's modules again in every timed process.
    compileall.compile_dir(str(Path(nanochat.__file__).parent), quiet=1, rx=re.compile(r"[/\\](tests|\.venv)[/\\]"))
    if args.names:
        models_dir = args.models_dir or matrix_models.default_models_dir()
        python = matrix_models.peer_python(args.peer_python)
        todo = []
        for n in args.names:
            try:
                todo.append((n, str(matrix_models.ensure_model(n, models_dir, python, args.threads, log))))
            except Exception as e:
                todo.append((n, e))
    else:
        todo = [(os.path.basename(args.model), str(args.model))]
    models, not_run = [], {}
    try:
        for name, path in todo:
            if isinstance(path, Exception):
                not_run[name] = f"{type(path).__name__}: {path}"
                log(f"{name}: cannot be made: {path}")
                continue
            log(f"== {name}")
            models.append(run_model(name, path, args, log))
    except KeyboardInterrupt:
        return 130
    report = {"threads": args.threads, "repeats": args.repeats, "isa_requested": args.isa,
              "settings": {k: getattr(args, k) for k in ("decode_tokens", "decode_prompt_tokens", "prompt_tokens",
                                                         "n_ctx", "oneshot_tokens", "oneshot_prompt", "turns",
                                                         "turn_tokens", "reply_tokens", "peers", "rows",
                                                         "peer_env")},
              "targets": {k: r.target_text() for k, r in ROWS.items()},
              "models": models, "not_run": not_run}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, args.stat)
    return 1 if not models or not_run or any(d["errors"] for d in models) else 0


if __name__ == "__main__":
    sys.exit(main())
