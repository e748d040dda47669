"""llama.cpp side of benchmarks/peers.py, run in an interpreter that has llama-cpp-python.

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout (errors as
{"error": "..."}). Stand-alone on purpose: it imports neither nanochat nor torch, so it runs in
a separate virtualenv (llama-cpp-python compiles llama.cpp at install time).

    {"cmd": "load", "model": PATH, "threads": N, "n_ctx": N}  -> {"version", "n_vocab"}
    {"cmd": "prefill", "ids": [...]}                           -> {"seconds"}
    {"cmd": "decode", "ids": [...], "n": N}                    -> {"seconds", "tokens", "ids"} (timed after the
                                                                  first token; ids: the n greedy tokens)
    {"cmd": "serve", "requests": [[ids, n], ...]}              -> {"seconds", "tokens"} (one after another)
    {"cmd": "quit"}

Generation is greedy (argmax of the last logits), and never stops early (EOS is ignored), so the
token counts match nanochat's ignore_eos runs.
"""

from __future__ import annotations

import sys
import time

STATE: dict = {}


def _argmax_last(llm) -> int:
    """Greedy token from the last evaluated position (logits_all=False keeps only that row;
    llama-cpp-python 0.3.x no longer copies it into `llm.scores`, so read it from the context)."""
    import llama_cpp
    import numpy as np

    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.ctypeslib.as_array(row, shape=(STATE["n_vocab"],)).argmax())


def _fresh_eval(llm, ids: list[int]) -> None:
    llm.reset()            # n_tokens = 0: eval() then drops the old KV beyond position 0
    llm.eval(ids)


def cmd_load(req: dict) -> dict:
    import llama_cpp

    threads = int(req["threads"])
    llm = llama_cpp.Llama(model_path=req["model"], n_ctx=int(req.get("n_ctx", 2048)), n_batch=512,
                          n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
    STATE["llm"], STATE["n_vocab"] = llm, llm.n_vocab()
    return {"version": getattr(llama_cpp, "__version__", "?"), "n_vocab": llm.n_vocab()}


def cmd_prefill(req: dict) -> dict:
    llm = STATE["llm"]
    t0 = time.perf_counter()
    _fresh_eval(llm, req["ids"])
    _argmax_last(llm)     # the first token, as the other engines produce it
    return {"seconds": time.perf_counter() - t0}


def _generate(llm, ids: list[int], n: int) -> tuple[float, list[int]]:
    """(seconds from the first token to the n-th, the n greedy tokens)."""
    _fresh_eval(llm, ids)
    out = [_argmax_last(llm)]
    t_first = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([out[-1]])
        out.append(_argmax_last(llm))
    return time.perf_counter() - t_first, out


def cmd_decode(req: dict) -> dict:
    n = int(req["n"])
    seconds, ids = _generate(STATE["llm"], req["ids"], n)
    return {"seconds": seconds, "tokens": n - 1, "ids": ids}


def cmd_serve(req: dict) -> dict:
    t0 = time.perf_counter()
    tokens = 0
    for ids, n in req["requests"]:
        _generate(STATE["llm"], ids, int(n))
        tokens += int(n)
    return {"seconds": time.perf_counter() - t0, "tokens": tokens}


COMMANDS = {"load": cmd_load, "prefill": cmd_prefill, "decode": cmd_decode, "serve": cmd_serve}


if __name__ == "__main__":
    from worker_protocol import serve   # beside this file (the script's directory is on sys.path)

    sys.exit(serve(COMMANDS))
