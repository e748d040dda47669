"""nanochat side of benchmarks/peers.py, in a process of its own like the peers' workers.

A fresh process per model: `load` times LLM(model, ...) construction in a process that has imported
nanochat (and torch) but loaded nothing yet, the same moment llama.cpp's worker times Llama(...).
Same line protocol as llamacpp_worker.py (worker_protocol.py): one JSON request per line on stdin,
one reply per line on stdout.

    {"cmd": "load", "model": PATH, "threads": N, "max_model_len": N, "max_num_seqs": N,
     "max_num_batched_tokens": N[, "config": {...}]}   -> {"version", "n_vocab", "load_s", "isa"}
    {"cmd": "prefill", "ids": [...]}                   -> {"seconds"} (the prompt to its first token)
    {"cmd": "decode", "ids": [...], "n": N}            -> {"seconds", "tokens", "ids"} (timed after the
                                                          first token; greedy, ignore_eos)
    {"cmd": "bench", "seed": N}                        -> {"tok_s"}: `nanochat bench --tier fast`'s workload
                                                          (run_bench) on this engine
    {"cmd": "multi_turn", "turns": N, "user_tokens": N, "reply_tokens": N, "seed": N}
                                                       -> {"ttft_ms": [per turn], "ratio": last / first}:
                                                          `nanochat bench --multi-turn`'s conversation
                                                          (run_multi_turn, resident KV) without its replay
    {"cmd": "quit"}

ISA: NANOCHAT_CPU_ISA=avx2|scalar in the environment makes the engine load that build of its CPU kernels
(Config.cpu_isa). "isa" is nanochat.kernels.cpu_qgemv.simd_level() after the load.
"""

from __future__ import annotations

import sys
import time

STATE: dict = {}


def kernel_isa() -> str:
    """The CPU kernels' code path, or why there is none."""
    from nanochat.kernels import cpu_qgemv

    if not cpu_qgemv.available():
        return "none (kernels not built: torch fallback)"
    return cpu_qgemv.simd_level()


def cmd_load(req: dict) -> dict:
    from nanochat.engine import LLM

    threads = int(req["threads"])
    config = dict(device="cpu", cpu_threads=threads, max_model_len=int(req.get("max_model_len", 4096)))
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if req.get(key):
            config[key] = int(req[key])
    config.update(req.get("config") or {})   # any other engine option (benchmarks/hf_folder.py: quant_backend)
    t0 = time.perf_counter()
    llm = LLM(req["model"], **config)
    load_s = time.perf_counter() - t0
    STATE["engine"] = llm.engine
    try:
        from importlib.metadata import version
        ver = version("nanochat")
    except Exception:
        ver = "?"
    return {"version": ver, "n_vocab": llm.engine.model_config.vocab_size, "load_s": load_s, "isa": kernel_isa()}


def _run_one(ids: list[int], n: int):
    from nanochat.engine import SamplingParams

    engine = STATE["engine"]
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out = []
    while True:
        for ev in engine.step():
            if ev.request_id != rid:
                continue
            if ev.token_id is not None:
                out.append(ev.token_id)
            if ev.finished:
                if ev.finish_reason == "error":
                    raise RuntimeError(ev.error)
                return ev.stats, out


def cmd_prefill(req: dict) -> dict:
    stats, _ = _run_one(req["ids"], 1)
    return {"seconds": stats.ttft}


def cmd_decode(req: dict) -> dict:
    n = int(req["n"])
    stats, out = _run_one(req["ids"], n)
    return {"seconds": (n - 1) / stats.decode_tok_s, "tokens": n - 1, "ids": out}


def cmd_bench(req: dict) -> dict:
    from nanochat.engine.serve.bench import run_bench, spec_from

    report = run_bench(STATE["engine"], spec_from("fast", seed=int(req.get("seed", 0))))
    return {"tok_s": report.iterations[0].throughput_tok_s}


def cmd_multi_turn(req: dict) -> dict:
    from nanochat.engine.serve.bench import run_multi_turn

    report = run_multi_turn(STATE["engine"], turns=int(req.get("turns", 8)), user_tokens=int(req.get("user_tokens", 64)),
                            reply_tokens=int(req.get("reply_tokens", 64)), sessions=1, seed=int(req.get("seed", 0)),
                            replay=False)
    ttfts = [t.ttft_ms for t in report.turns]
    return {"ttft_ms": ttfts, "ratio": ttfts[-1] / ttfts[0] if ttfts and ttfts[0] else None,
            "chatml": report.settings.get("chatml")}


COMMANDS = {"load": cmd_load, "prefill": cmd_prefill, "decode": cmd_decode, "bench": cmd_bench,
            "multi_turn": cmd_multi_turn}


if __name__ == "__main__":
    import os

    from nanochat.engine.config import engine_process_env   # (no torch yet)

    os.environ.update(engine_process_env())   # as the app's engine process runs
    import nanochat.engine  # noqa: F401,E402  (torch and the engine imported before any timed load)
    from worker_protocol import serve   # beside this file (the script's directory is on sys.path)

    sys.exit(serve(COMMANDS))
