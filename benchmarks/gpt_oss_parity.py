"""gpt-oss against llama.cpp on files made by llama.cpp's own converter: greedy tokens, token for token.

    .venv/bin/python benchmarks/gpt_oss_parity.py [--peer-python PY] [--llama-cpp DIR] [--tokens 48]

A tiny random GptOssForCausalLM (tests/test_gpt_oss.py's: windows, sinks, biases, YaRN, clamped SwiGLU) is saved
as transformers saves it and as published (MXFP4 experts), and each folder is converted by llama.cpp's
convert_hf_to_gguf.py (from the llama-cpp-python source distribution) at F32 / as is. Both engines then decode
greedily from the same prompt ids in worker processes of their own (benchmarks/peers.py's), and the token lists
are compared. The converter checks a tokenizer against the hashes of known ones; the test tokenizer is none of
them, so the run tells it the pre-tokenizer is gpt-4o's (gpt-oss's own): only ids are fed, never text.
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

DEFAULT_LLAMA_CPP = Path("/work/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp")
CONVERT = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {root!r} + "/gguf-py")
import convert_hf_to_gguf as c
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-4o"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
c.main()
"""


def convert(folder: Path, out: Path, outtype: str, llama_cpp: Path) -> Path:
    script = CONVERT.format(root=str(llama_cpp))
    subprocess.run([sys.executable, "-c", script, str(folder), "--outfile", str(out), "--outtype", outtype],
                   check=True, capture_output=True, text=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer-python", help="the interpreter with llama-cpp-python (default: $NANOCHAT_PEER_PYTHON)")
    p.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA_CPP, help="llama.cpp source tree (converter)")
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
        files = {"f32 (from the fp32 checkpoint)": convert(plain, root / "f32.gguf", "f32", args.llama_cpp),
                 "MXFP4 experts (from the published layout)":
                     convert(mxfp4_checkpoint(plain, root / "mxfp4"), root / "mxfp4.gguf", "f32", args.llama_cpp)}
        for what, path in files.items():
            engines = [peers.start_worker(e, str(path), run_args) for e in ("nanochat", "llama.cpp")]
            try:
                for ids in prompts:
                    ours, theirs = (e.decode(ids, args.tokens)[1] for e in engines)
                    same = peers._common_prefix(ours, theirs)
                    failed += same != args.tokens
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
