"""gpt-oss against llama.cpp on files made by llama.cpp's own converter: greedy tokens, and logits against the exact ones.

    .venv/bin/python benchmarks/gpt_oss_parity.py [--peer-python PY] [--llama-cpp DIR] [--tokens 48]

A tiny random GptOssForCausalLM (tests/test_gpt_oss.py's: windows, sinks, biases, YaRN, clamped SwiGLU) is saved
as transformers saves it and as published (MXFP4 experts), and each folder is converted by llama.cpp's
convert_hf_to_gguf.py (from the llama-cpp-python source distribution) at F32 / as is. Both engines then decode
greedily from the same prompt ids in worker processes of their own (benchmarks/peers.py's), and the token lists
are compared, and each engine's logits over a prompt against the exact ones (transformers in fp32 with the
file's own weights: the MXFP4 values, YaRN's range rounded out as llama.cpp rounds it). MXFP4 greedy tokens part
where llama.cpp's rounding of the activations (Q8_0, per 32 values) moves a logit past a close second: the logit
errors say which engine moved. The converter checks a tokenizer against the hashes of known ones; the test tokenizer is none of
them, so the run tells it the pre-tokenizer is gpt-4o's (gpt-oss's own; matrix_models.convert_hf): only ids are fed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests"), str(HERE)]   # tests.conftest, gguf_writer

import matrix_models  # noqa: E402


def convert(folder: Path, out: Path, outtype: str, llama_cpp: Path) -> Path:
    return matrix_models.convert_hf(folder, out, outtype, llama_cpp, "gpt-4o")   # gpt-oss's own pre-tokenizer


LLAMA_LOGITS = """
import json, sys
import numpy as np
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, logits_all=True, n_threads=2, verbose=False)
ids = json.loads(sys.argv[2])
llm.eval(ids)
np.save(sys.argv[3], np.array(llm.scores[:len(ids)], dtype=np.float32))
"""


def logit_errors(path: Path, folder: Path, mxfp4: Path | None, ids: list[int], python: str, tmp: Path) -> dict:
    """max |logit - exact| over every row of `ids`, for nanochat and llama.cpp on the file `path`."""
    import json

    import numpy as np
    import torch
    import transformers

    from nanochat.engine import LLMEngine, SamplingParams
    from test_gpt_oss import dequantized_oracle

    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"]["truncate"] = True   # as llama.cpp computes YaRN
    exact_dir = tmp / f"exact-{path.stem}"
    exact_dir.mkdir()
    for f in folder.iterdir():
        if f.name != "config.json":
            (exact_dir / f.name).symlink_to(f)
    (exact_dir / "config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(exact_dir, dtype=torch.float32).eval()
    if mxfp4 is not None:
        hf = dequantized_oracle(hf, mxfp4)
    with torch.no_grad():
        exact = hf(torch.tensor([ids])).logits[0]
    subprocess.run([python, "-c", LLAMA_LOGITS, str(path), json.dumps(ids), str(tmp / "llama.npy")], check=True,
                   capture_output=True)
    theirs = torch.from_numpy(np.load(tmp / "llama.npy"))
    engine = LLMEngine(str(path), dtype="float32", max_model_len=256, kv_cache_dtype="float32")
    engine.add_request(ids[:1], SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True))
    ours = []
    for token in [*ids[1:], None]:   # every row's logits: the prompt's tokens forced one by one
        chunks = engine.scheduler.schedule()
        ours.append(engine.runner.run(chunks).logits[0].clone())
        if token is not None:
            chunks[0].seq.num_computed_tokens = chunks[0].end
            chunks[0].seq.append_token(token)
    return {"nanochat": (torch.stack(ours) - exact).abs().max().item(),
            "llama.cpp": (theirs - exact).abs().max().item(), "max |logit|": exact.abs().max().item()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer-python", help="the interpreter with llama-cpp-python (default: $NANOCHAT_PEER_PYTHON)")
    p.add_argument("--llama-cpp", type=Path, default=matrix_models.LLAMA_CPP_SRC, help="llama.cpp source tree (converter)")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt (48)")
    args = p.parse_args(argv)
    import peers
    from test_gpt_oss import make_gpt_oss, mxfp4_checkpoint

    run_args = peers.parse_args(["--threads", "2", "--n-ctx", "256", "--turns", "1"]
                                + (["--peer-python", args.peer_python] if args.peer_python else []))
    prompts = [list(range(5, 25)), [7, 300, 12, 45, 45, 45, 2, 99], list(range(100, 160))]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plain = make_gpt_oss(root / "hf")
        mx = mxfp4_checkpoint(plain, root / "mxfp4")
        files = {"f32 (from the fp32 checkpoint)": (convert(plain, root / "f32.gguf", "f32", args.llama_cpp), None),
                 "MXFP4 experts (from the published layout)":
                     (convert(mx, root / "mxfp4.gguf", "f32", args.llama_cpp), mx)}
        for what, (path, quantized) in files.items():
            errors = logit_errors(path, plain, quantized, prompts[0] + prompts[1],
                                  peers.matrix_models.peer_python(run_args.peer_python), root)
            print(f"{what}: max |logit - exact| over {len(prompts[0] + prompts[1])} rows: nanochat "
                  f"{errors['nanochat']:.2g}, llama.cpp {errors['llama.cpp']:.2g} (max |logit| "
                  f"{errors['max |logit|']:.2g})")
            failed += errors["nanochat"] > max(errors["llama.cpp"], 1e-3)
            engines = [peers.start_worker(e, str(path), run_args) for e in ("nanochat", "llama.cpp")]
            try:
                for ids in prompts:
                    ours, theirs = (e.decode(ids, args.tokens)[1] for e in engines)
                    same = peers._common_prefix(ours, theirs)
                    failed += quantized is None and same != args.tokens   # exact weights: every token
                    print(f"{what}: prompt of {len(ids)}: {same}/{args.tokens} greedy tokens equal"
                          + ("" if same == args.tokens else f" (nanochat {ours[same:same + 4]}, "
                                                              f"llama.cpp {theirs[same:same + 4]})"))
            finally:
                for e in engines:
                    e.close()
    print("llama.cpp", engines[1].version, "| ISA:", os.environ.get("NANOCHAT_CPU_ISA", "native"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
