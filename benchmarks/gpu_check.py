"""The GPU check's steps (benchmarks/gpu_check.sh runs this in its venv): one JSON report.

    python benchmarks/gpu_check.py REPORT.json [--budget SECONDS]

1. the machine: GPUs, driver, torch / triton / flash-attn versions;
2. the CPU's C++ kernels built (the tests compare with the CPU), then the GPU tests (tests/test_gpu.py:
   Triton kernels compiled for real against the torch references, CUDA graphs against eager, windowed models against the CPU, flash-attn, the expert offload's CUDA side,
   TP over NCCL on two GPUs);
3. nano-vllm's bench.py workload (256 sequences, prompt and reply lengths 100-1024, max_model_len 4096)
   on Qwen3-0.6B's shapes with random bf16 weights, at TP 1 and, with two GPUs or more, TP 2;
4. where a decode step of that workload spends its time (benchmarks/gpu_profile.py): the host's phases and
   the device's top kernels.

Each step has a share of the time budget and the report says what ran, what passed and how long it
took; a step that fails or runs out of time is recorded, and the next one still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Qwen3-0.6B's config.json (the shapes; the weights are random)
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "attention_bias": False, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def machine() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    for name in ("triton", "flash_attn", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except Exception as e:   # not installed, or broken: say so
            info[name] = f"absent ({type(e).__name__})"
    try:
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                             "--format=csv,noheader"], capture_output=True, text=True,
                                            timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    return info


def gpu_tests(timeout: float, log: Path, select: str | None = None) -> dict:
    """Runs tests/test_gpu.py (those `select`, a pytest -k expression, names); pytest's whole output goes to
    `log` (the report keeps its last lines). A test gets at most 120 s: one that hangs is a failure, not the
    end of the run."""
    junit = Path(tempfile.mkdtemp()) / "junit.xml"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_gpu.py", "-v", "--durations=15",
                               "-p", "no:cacheprovider", "-m", "gpu", f"--junitxml={junit}", "-o", "addopts=", "--timeout", "120",
                               *(("-k", select) if select else ())],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        # what it printed so far (bytes, whatever text= said); a test past its --timeout has its stack on stderr
        log.write_text("".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                               for x in (e.stdout, e.stderr)))
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "seconds": round(time.monotonic() - started)}
    log.write_text(proc.stdout + proc.stderr)
    result = {"ok": proc.returncode == 0, "seconds": round(time.monotonic() - started, 1),
              "tail": proc.stdout.strip().splitlines()[-3:]}
    if junit.exists():
        tests = []
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, message = "passed", None
            for kind in ("failure", "error", "skipped"):
                node = case.find(kind)
                if node is not None:
                    outcome, message = kind, (node.get("message") or "")[:800]
            tests.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)),
                          **({"message": message} if message else {})})
        result["tests"] = tests
        result["counts"] = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failure", "error", "skipped")}
    return result


def cpu_kernels(timeout: float) -> dict:
    """Builds the CPU's C++ kernels ahead (kernels/cpp_build.py): a fresh machine compiles them once."""
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "nanochat.kernels.cpp_build"], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    out = {"ok": proc.returncode == 0, "seconds": round(time.monotonic() - started, 1)}
    if proc.returncode:
        out["stderr"] = proc.stderr.strip().splitlines()[-5:]
    return out


def random_qwen3(folder: Path) -> Path:
    """Qwen3-0.6B's shapes with random bf16 weights, and a small tokenizer (the bench sends token ids)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    c = QWEN3_06B
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rnd(c["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors.update({
            f"{p}.self_attn.q_proj.weight": rnd(q, h), f"{p}.self_attn.k_proj.weight": rnd(kv, h),
            f"{p}.self_attn.v_proj.weight": rnd(kv, h), f"{p}.self_attn.o_proj.weight": rnd(h, q),
            f"{p}.self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            f"{p}.self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
            f"{p}.mlp.gate_proj.weight": rnd(inter, h), f"{p}.mlp.up_proj.weight": rnd(inter, h),
            f"{p}.mlp.down_proj.weight": rnd(h, inter),
            f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(c))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(["hello world, the quick brown fox"] * 4,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return folder


def bench(model: Path, tp: int, timeout: float, device: str = "cuda", num_seqs: int | None = None) -> dict:
    cmd = [str(Path(sys.executable).parent / "nanochat"), "bench", "--workload", "nano-vllm", "--model", str(model),
           "--device", device, "--json", "--quiet", "--tensor-parallel-size", str(tp)]
    if num_seqs is not None:   # a smoke run of this script (--smoke)
        cmd += ["--num-seqs", str(num_seqs), "--max-input-len", "32", "--max-output-len", "8"]
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, NANOCHAT_HOME=str(model.parent / "home")))
    except subprocess.TimeoutExpired:
        return {"ok": False, "tp": tp, "error": f"timed out after {timeout:.0f} s"}
    out = {"ok": proc.returncode == 0, "tp": tp, "seconds": round(time.monotonic() - started, 1)}
    try:
        out["result"] = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out["stdout"] = proc.stdout[-2000:]
    if proc.returncode:
        out["stderr"] = proc.stderr.strip().splitlines()[-5:]
    return out


def step_profile(model: Path, timeout: float, smoke: bool) -> dict:
    """benchmarks/gpu_profile.py on the bench's model: the host's phases and the device's top kernels."""
    cmd = [sys.executable, "benchmarks/gpu_profile.py", str(model), "--json"]
    if smoke:
        cmd += ["--device", "cpu", "--num-seqs", "2", "--steps", "2"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    try:
        return {"ok": proc.returncode == 0, **json.loads(proc.stdout.strip().splitlines()[-1])}
    except (json.JSONDecodeError, IndexError):
        return {"ok": False, "stderr": proc.stderr.strip().splitlines()[-5:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report")
    ap.add_argument("--budget", type=float, default=420, help="seconds for all the steps (default 420)")
    ap.add_argument("--tests", metavar="EXPR", help="only the GPU tests this pytest -k expression selects")
    ap.add_argument("--smoke", action="store_true",
                    help="check this script on a machine without a GPU: the bench step on the CPU, 2 short sequences")
    args = ap.parse_args()
    started = time.monotonic()
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

    def save() -> None:
        report["seconds"] = round(time.monotonic() - started, 1)
        Path(args.report).write_text(json.dumps(report, indent=2))

    def left() -> float:
        return args.budget - (time.monotonic() - started)

    import torch
    report["machine"] = machine()
    save()
    if not torch.cuda.is_available() and not args.smoke:
        report["error"] = "torch sees no CUDA device"
        save()
        return 1
    # The tests that compare with the CPU need its C++ kernels: built once here, not inside a test's time limit.
    report["cpu_kernels"] = cpu_kernels(max(60.0, 0.3 * left()))
    save()
    report["gpu_tests"] = gpu_tests(max(60.0, 0.5 * left()), Path(args.report).with_suffix(".tests.log"),
                                    args.tests)
    save()
    with tempfile.TemporaryDirectory() as tmp:
        model = random_qwen3(Path(tmp) / "qwen3-0.6b-random")
        sizes = [1, 2] if torch.cuda.device_count() >= 2 or args.smoke else [1]
        report["bench"] = []
        for i, tp in enumerate(sizes):
            profiled = tp == 1     # then where its decode step's time goes: 60 s kept for that
            timeout = max(30.0, (left() - 60 * profiled) / (len(sizes) - i) - 5)
            report["bench"].append(bench(model, tp, timeout, *(("cpu", 2) if args.smoke else ())))
            save()
            if profiled:
                report["profile"] = step_profile(model, max(60.0, left() / (len(sizes) - i) - 5), args.smoke)
                save()
    ok = report["gpu_tests"].get("ok") and all(b["ok"] for b in report["bench"])
    report["ok"] = bool(ok)
    save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
