"""nanochat on a Hugging Face folder (safetensors, bf16) against transformers on the same folder, llama.cpp on a BF16
GGUF of it, and nanochat's former path for dense weights (torch's GEMM on weights widened to fp32).

    .venv/bin/python benchmarks/hf_folder.py [--model DIR] [--llama-cpp SRC] [--peer-python PY] [--repeats 3]
        [--threads 2] [--isa avx2] [--json]

Model: --model DIR, else a folder with Qwen3-0.6B's shapes and random bf16 weights (transformers' own init, seed 0),
made on first use under the peer-models cache; its tokenizer is the test suite's small BPE (ids are fed, never text).
llama.cpp: the folder converted to a BF16 GGUF by llama.cpp's convert_hf_to_gguf.py (--llama-cpp: the llama.cpp
vendored in the llama-cpp-python source distribution), cached beside the folder; left out when neither is at hand.

Engines, each in a process of its own (benchmarks/peers.py's workers):
  nanochat            LLM(folder, speculative="off"): dense weights on the CPU kernels in the checkpoint's own type
                      (plain decoding: the weights' path alone; a random model's repetitive text would flatter
                      prompt lookup, which benchmarks/speculative.py measures on real text)
  nanochat torch-GEMM the same with quant_backend="dense": the weights widened to fp32, torch's GEMM (the path HF
                      folders took before 2026-12-05)
  transformers        from_pretrained(folder) in the checkpoint's dtype (bf16), and in fp32
  llama.cpp           the BF16 GGUF, n_threads = n_threads_batch = --threads

Rows (median over --repeats; engines alternate inside each repeat, the same ids for every engine):
  decode tok/s  --decode-tokens greedy tokens after a 16-token prompt, from the first token to the last
  prompt tok/s  a --prompt-tokens prompt to its first token
  load s        the engine's construction in its worker (imports excluded)
  peak RSS MB   the worker's peak resident set at the end (VmHWM: imports, weights, caches)
Ratios are nanochat's over each other engine's (RSS and load: lower is better).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests"), str(HERE)]

import matrix_models  # noqa: E402
import peers  # noqa: E402

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
                 rms_norm_eps=1e-6)
ROWS = {"decode": True, "prompt": True, "load": False, "rss": False}   # row -> higher is better


def make_folder(out: Path) -> Path:
    """Qwen3-0.6B's shapes, random bf16 weights, the suite's tokenizer and ChatML template."""
    if (out / "config.json").exists():
        return out
    import torch
    import transformers
    from conftest import build_tokenizer, save_tiny

    torch.manual_seed(0)
    tok = build_tokenizer(320)
    cfg = transformers.Qwen3Config(**QWEN3_06B, bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"))
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    save_tiny(model, tok, out)
    return out


def convert(folder: Path, llama_cpp: Path) -> Path | None:
    """The folder as a BF16 GGUF by llama.cpp's converter, cached beside it; None without the converter."""
    out = folder.with_name(folder.name + ".BF16.gguf")   # beside it: the folder stays a plain HF folder
    if out.exists():
        return out
    if not (llama_cpp / "convert_hf_to_gguf.py").exists():
        return None
    return matrix_models.convert_hf(folder, out, "bf16", llama_cpp, "qwen2")


def peak_rss_mb(w: peers.WorkerRunner) -> float:
    for line in Path(f"/proc/{w.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start(args, folder: Path, gguf: Path | None) -> list[peers.WorkerRunner]:
    ctx = args.prompt_tokens + 64
    nc_env = peers.nanochat_env(args)
    plain = {"speculative": "off"}   # the weights' path alone (a random model's loops would flatter prompt lookup)
    plans = [("nanochat", "nanochat_worker.py", sys.executable,
              {"model": str(folder), "max_model_len": ctx, "config": plain}, nc_env),
             ("nanochat torch-GEMM", "nanochat_worker.py", sys.executable,
              {"model": str(folder), "max_model_len": ctx, "config": {**plain, "quant_backend": "dense"}}, nc_env),
             ("transformers bf16", "transformers_worker.py", sys.executable, {"model": str(folder)},
              peers.peer_env(args)),
             ("transformers fp32", "transformers_worker.py", sys.executable,
              {"model": str(folder), "dtype": "float32"}, peers.peer_env(args))]
    if gguf is not None:
        plans.append(("llama.cpp", "llamacpp_worker.py", matrix_models.peer_python(args.peer_python),
                      {"model": str(gguf), "n_ctx": ctx}, peers.peer_env(args)))
    engines = []
    for name, worker, python, load, env in plans:
        print(f"loading {name}", file=sys.stderr)
        engines.append(peers.WorkerRunner(name, HERE / worker, python, {**load, "threads": args.threads}, env))
    return engines


def run(args) -> dict:
    import random

    folder = Path(args.model) if args.model else make_folder(
        matrix_models.default_models_dir() / "Qwen3-0.6B-random-hf")
    gguf = convert(folder, Path(args.llama_cpp))
    results: dict[str, dict[str, list[float]]] = {row: {} for row in ROWS}
    engines = start(args, folder, gguf)
    try:
        for e in engines:
            results["load"][e.name] = [e.info["load_s"]]
            e.decode([1, 2, 3, 4], 4)   # one-time costs out of the measurements
        for r in range(args.repeats):
            rng = random.Random(r)
            short = [rng.randrange(300) for _ in range(16)]
            long = [rng.randrange(300) for _ in range(args.prompt_tokens)]
            for e in engines if r % 2 == 0 else engines[::-1]:
                results["decode"].setdefault(e.name, []).append(e.decode(short, args.decode_tokens)[0])
                results["prompt"].setdefault(e.name, []).append(e.prompt(long))
                print(f"repeat {r + 1}/{args.repeats}: {e.name}", file=sys.stderr)
        for e in engines:
            results["rss"][e.name] = [peak_rss_mb(e)]
        isa = engines[0].info.get("isa")
    finally:
        for e in engines:
            e.close()
    return {"model": str(folder), "gguf": str(gguf) if gguf else None, "threads": args.threads, "isa": isa,
            "median": {row: {n: statistics.median(v) for n, v in per.items()} for row, per in results.items()},
            "runs": results}


def table(out: dict) -> str:
    med = out["median"]
    names = list(med["decode"])
    lines = [f"model {out['model']} · threads {out['threads']} · nanochat kernels {out['isa']}",
             "| row | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for row, unit in (("decode", "tok/s"), ("prompt", "tok/s"), ("load", "s"), ("rss", "MB")):
        cells = []
        for n in names:
            v = med[row][n]
            ratio = "" if n == "nanochat" else f" ({med[row]['nanochat'] / v:.2f}x)"
            cells.append(f"{v:.1f}{ratio}" if row != "load" else f"{v:.2f}{ratio}")
        lines.append(f"| {row} {unit} | " + " | ".join(cells) + " |")
    lines.append("(x): nanochat's value over that engine's")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face folder (default: the random Qwen3-0.6B-shaped one, made once)")
    p.add_argument("--llama-cpp", default=str(matrix_models.LLAMA_CPP_SRC),
                   help="llama.cpp source tree with convert_hf_to_gguf.py (for the llama.cpp column)")
    p.add_argument("--peer-python", help="interpreter with llama-cpp-python (default: $NANOCHAT_PEER_PYTHON)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--isa", choices=("avx2", "scalar"), help="force nanochat's kernels to this code path")
    p.add_argument("--peer-env", action="append", help="KEY=VALUE for the peers only (see peers.py)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = run(args)
    print(json.dumps(out, indent=1) if args.json else table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
