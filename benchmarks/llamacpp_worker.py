"""llama.cpp side of benchmarks/peers.py, run in an interpreter that has llama-cpp-python.

Stand-alone on purpose: it imports neither nanochat nor torch, so it runs in a separate virtualenv
(llama-cpp-python compiles llama.cpp at install time).

Without arguments it serves the line protocol: one JSON object per line on stdin, one JSON reply per
line on stdout (errors as {"error": "..."}).

    {"cmd": "load", "model": PATH, "threads": N, "n_ctx": N}  -> {"version", "n_vocab", "load_s", "isa",
                                                                  "system_info"} (load_s: Llama(...) alone)
    {"cmd": "prefill", "ids": [...]}                           -> {"seconds"}
    {"cmd": "decode", "ids": [...], "n": N}                    -> {"seconds", "tokens", "ids"} (timed after the
                                                                  first token; ids: the n greedy tokens)
    {"cmd": "serve", "requests": [[ids, n], ...]}              -> {"seconds", "tokens"} (one after another)
    {"cmd": "lookup_generate", "ids": [...], "n": N, "stop_ids": [...], "lookup": K, "json_schema": S,
     "grammar": G}
                                                               -> {"seconds", "tokens", "ids"}: greedy through
                                                                  Llama.generate, with prompt-lookup decoding
                                                                  (LlamaPromptLookupDecoding, K proposed tokens)
                                                                  when K > 0, plainly when 0; stops at stop_ids;
                                                                  held to JSON schema S (llama.cpp's GBNF) or to
                                                                  the GBNF grammar G if given
    {"cmd": "multi_turn", "turns": N, "user_tokens": N, "reply_tokens": N, "seed": N, "id_max": N}
                                                               -> {"ttft_ms": [per turn], "ratio": last / first}
    {"cmd": "quit"}

Generation is greedy (argmax of the last logits), and never stops early (EOS is ignored), so the
token counts match nanochat's ignore_eos runs.

With arguments it runs one job and exits (each in a fresh process):

    llamacpp_worker.py oneshot MODEL [--prompt Hi] [--max-tokens 8] [--threads N] [--n-ctx 4096]
        load the model and answer one chat message (the GGUF's chat template, greedy, end-of-generation
        tokens banned so that exactly --max-tokens tokens come out, as `nanochat --ignore-eos`); prints
        {"tokens", "load_s", "isa"} on stdout. peers.py times the whole process and its peak RSS.
    llamacpp_worker.py quantize IN OUT TYPE [THREADS]
        llama.cpp's quantizer (llama_model_quantize, allow_requantize) to TYPE: q4_0, q4_1, q5_0, q5_1,
        q8_0, q4_k_m, q5_k_m, q6_k, ... (a LLAMA_FTYPE_MOSTLY_* name)
    llamacpp_worker.py check MODEL      Llama(model_path=MODEL) loads (exit 0) or the error (exit 1)
    llamacpp_worker.py isa              the ISA summary and llama_print_system_info() as JSON
"""

from __future__ import annotations

import json
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


def system_info() -> dict:
    """{"isa": "avx512-vnni" | "avx512" | "avx2" | ..., "system_info": llama_print_system_info()}: the
    features the CPU backend was built with (GGML_NATIVE: the build machine's)."""
    import llama_cpp

    raw = llama_cpp.llama_print_system_info()
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    flags = {}
    for part in text.replace("|", "\n").splitlines():
        key, sep, val = part.partition("=")
        if sep:
            flags[key.strip().split(":")[-1].strip()] = val.strip() == "1"
    if flags.get("AVX512"):
        isa = "avx512-vnni" if flags.get("AVX512_VNNI") else "avx512"
    elif flags.get("AVX2"):
        isa = "avx2-vnni" if flags.get("AVX_VNNI") else "avx2"
    elif flags.get("NEON"):
        isa = "neon"
    else:
        isa = "scalar" if flags else "?"
    return {"isa": isa, "system_info": " ".join(text.split())}


def _llama(model: str, threads: int, n_ctx: int):
    import llama_cpp

    return llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                           n_threads_batch=threads, logits_all=False, verbose=False)


def cmd_load(req: dict) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = _llama(req["model"], int(req["threads"]), int(req.get("n_ctx", 2048)))
    load_s = time.perf_counter() - t0
    STATE["llm"], STATE["n_vocab"] = llm, llm.n_vocab()
    return {"version": getattr(llama_cpp, "__version__", "?"), "n_vocab": llm.n_vocab(), "load_s": load_s,
            **system_info()}


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


def _chat_shape(llm) -> tuple[list[int], list[int], list[int]]:
    """ChatML framing ids around a turn (user head, user tail + assistant head, reply tail), as
    nanochat's bench frames its synthetic turns; empty when the vocabulary has no ChatML tokens."""
    enc = lambda text: llm.tokenize(text.encode(), add_bos=False, special=True)  # noqa: E731
    start, end = enc("<|im_start|>"), enc("<|im_end|>")
    if len(start) != 1 or len(end) != 1:
        return [], [], []
    return start + enc("user\n"), end + enc("\n") + start + enc("assistant\n"), end + enc("\n")


def cmd_multi_turn(req: dict) -> dict:
    """One conversation whose KV stays in the context between turns (each turn evaluates only its new
    tokens after the ones already there): per turn, a user message of random ids in ChatML framing,
    then `reply_tokens` greedy tokens. TTFT: from the turn's first new token to its first reply token."""
    import random

    llm, rng = STATE["llm"], random.Random(int(req.get("seed", 0)))
    turns, user, reply = int(req.get("turns", 8)), int(req.get("user_tokens", 64)), int(req.get("reply_tokens", 64))
    vocab = min(STATE["n_vocab"], int(req.get("id_max", 10000)) + 1)
    head, tail, reply_tail = _chat_shape(llm)
    llm.reset()
    _fresh_eval(llm, [rng.randrange(vocab) for _ in range(user)])   # warm-up, as nanochat's bench does
    _argmax_last(llm)
    llm.reset()
    pending, ttfts = [], []
    for _ in range(turns):
        new = pending + head + [rng.randrange(vocab) for _ in range(user)] + tail
        t0 = time.perf_counter()
        llm.eval(new)   # after llm.n_tokens: the history's KV is reused
        out = [_argmax_last(llm)]
        ttfts.append((time.perf_counter() - t0) * 1000)
        for _ in range(reply - 1):
            llm.eval([out[-1]])
            out.append(_argmax_last(llm))
        pending = [out[-1]] + reply_tail   # the last reply token is not in the KV yet
    return {"ttft_ms": ttfts, "ratio": ttfts[-1] / ttfts[0] if ttfts[0] else None}


def cmd_lookup_generate(req: dict) -> dict:
    """llama-cpp-python's own generation loop, plain or with its prompt-lookup decoding (a Llama of its own per
    K: the draft model is fixed at construction); timed from the first token to the last."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    k = int(req.get("lookup", 0))
    key = ("lookup", k)
    if key not in STATE:
        base = STATE["llm"]
        STATE[key] = llama_cpp.Llama(model_path=base.model_path, n_ctx=base.n_ctx(), n_batch=512,
                                     n_threads=base.n_threads, n_threads_batch=base.n_threads, verbose=False,
                                     draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None)
    llm, stop = STATE[key], set(req.get("stop_ids", []))
    grammar = None
    if req.get("json_schema"):   # llama.cpp's own JSON-schema grammar (GBNF), as its server builds for response_format
        grammar = llama_cpp.LlamaGrammar.from_json_schema(req["json_schema"], verbose=False)
    elif req.get("grammar"):
        grammar = llama_cpp.LlamaGrammar.from_string(req["grammar"], verbose=False)
    out, t_first = [], None
    for token in llm.generate(req["ids"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True,
                              grammar=grammar):
        if t_first is None:
            t_first = time.perf_counter()
        out.append(int(token))
        if token in stop or len(out) >= int(req["n"]):
            break
    return {"seconds": time.perf_counter() - t_first, "tokens": len(out) - 1, "ids": out}


COMMANDS = {"load": cmd_load, "prefill": cmd_prefill, "decode": cmd_decode, "serve": cmd_serve,
            "multi_turn": cmd_multi_turn, "lookup_generate": cmd_lookup_generate}


# ---------------------------------------------------------------------------------- one-off jobs
def _eog_ids(llm) -> list[int]:
    """End-of-generation tokens to ban: EOS, EOT and the usual chat end markers, when single tokens."""
    import llama_cpp

    ids = {llm.token_eos()}
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    ids.add(llama_cpp.llama_vocab_eot(vocab))
    for text in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        toks = llm.tokenize(text.encode(), add_bos=False, special=True)
        if len(toks) == 1:
            ids.add(toks[0])
    return sorted(i for i in ids if 0 <= i < llm.n_vocab() and llama_cpp.llama_vocab_is_eog(vocab, i))


def job_oneshot(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="llamacpp_worker.py oneshot")
    p.add_argument("model")
    p.add_argument("--prompt", default="Hi")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=4096)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    llm = _llama(a.model, a.threads, a.n_ctx)
    load_s = time.perf_counter() - t0
    out = llm.create_chat_completion(messages=[{"role": "user", "content": a.prompt}], max_tokens=a.max_tokens,
                                     temperature=0.0, logit_bias={i: -1e9 for i in _eog_ids(llm)})
    sys.stderr.write(out["choices"][0]["message"]["content"] + "\n")
    print(json.dumps({"tokens": out["usage"]["completion_tokens"], "load_s": load_s, **system_info()}))
    return 0


def job_quantize(argv: list[str]) -> int:
    import ctypes

    import llama_cpp

    src, dst, kind = argv[0], argv[1], argv[2].upper()
    threads = int(argv[3]) if len(argv) > 3 else 0
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}", None)
    if ftype is None:
        print(f"unknown quantization type {argv[2]!r}", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize({src}, {dst}, {kind}) returned {rc}", file=sys.stderr)
        return 1
    return 0


def job_check(argv: list[str]) -> int:
    try:
        llm = _llama(argv[0], 1, 512)
    except Exception as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"n_vocab": llm.n_vocab()}))
    return 0


def job_isa(argv: list[str]) -> int:
    print(json.dumps(system_info()))
    return 0


JOBS = {"oneshot": job_oneshot, "quantize": job_quantize, "check": job_check, "isa": job_isa}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        if sys.argv[1] not in JOBS:
            print(f"usage: llamacpp_worker.py [{' | '.join(JOBS)}] ...", file=sys.stderr)
            sys.exit(2)
        sys.exit(JOBS[sys.argv[1]](sys.argv[2:]))
    from worker_protocol import serve   # beside this file (the script's directory is on sys.path)

    sys.exit(serve(COMMANDS))
