"""The models of benchmarks/peers.py's matrix, made at benchmark time and cached (never committed).

    .venv/bin/python benchmarks/matrix_models.py --list
    .venv/bin/python benchmarks/matrix_models.py --make [NAME ...] [--models-dir DIR] [--peer-python PY]
    .venv/bin/python benchmarks/matrix_models.py --check [NAME ...]   # make, then load each in both engines

Families:
  smollm2-*     the built-in SmolLM2-135M-Instruct Q4_1 GGUF as is (smollm2-q4_1), and requantized from
                it by llama.cpp's own quantizer (llama_model_quantize with allow_requantize) to
                Q4_K_M, Q5_K_M, Q6_K, Q8_0 and Q4_0. SmolLM2's width (576) is not a multiple of 256,
                so llama.cpp's K-quant mixes fall back to Q5_0 / Q5_1 / Q8_0 for most of its tensors
                (it says so on stderr): that is llama.cpp's file, and the one both engines load.
  qwen3-0.6b-*  a Qwen3 checkpoint with Qwen3-0.6B's shapes and random weights (normal, std 0.02;
                norms 1), written here with the `gguf` package at F16 (norms F32), with a made-up
                151,936-token gpt2-style byte-level BPE (256 byte tokens, 151,387 merged tokens with
                matching merges, Qwen's special tokens, ChatML template); then quantized by
                llama.cpp to Q4_K_M, Q5_K_M, Q6_K, Q8_0 and Q4_0. The text it generates is garbage:
                these files measure speed, not quality.

The cache: --models-dir, else $NANOCHAT_HOME/cache/peer-models, else the platformdirs user cache dir
nanochat/peer-models (kernels/cpp_build.py's cache_root()). A file is written under a temporary
name and renamed when complete, so an interrupted run never leaves a half file behind.
Quantization runs in the interpreter that has llama-cpp-python (--peer-python, or
$NANOCHAT_PEER_PYTHON), through `llamacpp_worker.py quantize`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
QUANTS = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str           # "smollm2" | "qwen3-0.6b"
    quant: str            # "q4_1", "q4_k_m", ..., "f16"
    source: str | None    # the model it is quantized from (None: the built-in file / written here)

    @property
    def filename(self) -> str:
        stem = {"smollm2": "SmolLM2-135M-Instruct", "qwen3-0.6b": "Qwen3-0.6B-random"}[self.family]
        return f"{stem}.{self.quant.upper()}.gguf"


def _specs() -> dict[str, ModelSpec]:
    out = {"smollm2-q4_1": ModelSpec("smollm2-q4_1", "smollm2", "q4_1", None)}
    out.update({f"smollm2-{q}": ModelSpec(f"smollm2-{q}", "smollm2", q, "smollm2-q4_1") for q in QUANTS})
    out["qwen3-0.6b-f16"] = ModelSpec("qwen3-0.6b-f16", "qwen3-0.6b", "f16", None)
    out.update({f"qwen3-0.6b-{q}": ModelSpec(f"qwen3-0.6b-{q}", "qwen3-0.6b", q, "qwen3-0.6b-f16") for q in QUANTS})
    return out


MODELS = _specs()
# --matrix: every model but the F16 source (1.2 GB, not a format anyone chats with on a CPU)
MATRIX = [n for n in MODELS if n != "qwen3-0.6b-f16"]


def default_models_dir() -> Path:
    from nanochat.kernels.cpp_build import cache_root

    return cache_root() / "peer-models"


def peer_python(given: str | None = None) -> str:
    return given or os.environ.get("NANOCHAT_PEER_PYTHON") or sys.executable


def resolve_names(text: str) -> list[str]:
    """`a,b,c` (names, or families like `smollm2` / `qwen3-0.6b` for all their quants) -> names."""
    names: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if item in MODELS:
            found = [item]
        else:
            found = [n for n in MATRIX if MODELS[n].family == item]
        if not found:
            raise ValueError(f"unknown model {item!r}; known: {', '.join(MODELS)}")
        names += [n for n in found if n not in names]
    return names


def ensure_model(name: str, models_dir: Path, python: str, threads: int = 2,
                 log: Callable[[str], None] = lambda m: None) -> Path:
    """The path of model `name`, made (and the models it is made from) when it is not cached yet."""
    spec = MODELS[name]
    if spec.name == "smollm2-q4_1":
        from nanochat.models.catalog import resolve_default_model

        return Path(resolve_default_model(None))
    path = Path(models_dir) / spec.filename
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".part{os.getpid()}")
    t0 = time.perf_counter()
    try:
        if spec.source is None:
            log(f"writing {path.name} (random weights, Qwen3-0.6B shapes)")
            write_qwen3_random(tmp)
        else:
            src = ensure_model(spec.source, models_dir, python, threads, log)
            log(f"quantizing {src.name} -> {path.name} (llama.cpp, {threads} threads)")
            quantize(src, tmp, spec.quant, python, threads)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    log(f"  {path.name}: {path.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - t0:.0f} s")
    return path


def quantize(src: Path, dst: Path, quant: str, python: str, threads: int) -> None:
    """llama.cpp's quantizer (llama_model_quantize) in the peer interpreter."""
    r = subprocess.run([python, str(HERE / "llamacpp_worker.py"), "quantize", str(src), str(dst), quant,
                        str(threads)], capture_output=True, text=True)
    if r.returncode != 0:
        tail = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-3:]
        raise RuntimeError(f"llama.cpp could not quantize {src.name} to {quant} with {python}: "
                           + (" | ".join(tail) or f"exit {r.returncode}"))


# ---------------------------------------------------------------------------------- Qwen3, random
QWEN3_0_6B = dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                  vocab=151_936, context=40_960, rope_theta=1_000_000.0, rms_eps=1e-6)
# Qwen2/3's added tokens from id 151643 on: <|...|> are CONTROL, the tag-like ones USER_DEFINED (as
# llama.cpp's converter writes them); ids above them up to the vocab size are [PADn], UNUSED.
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
QWEN_FIRST_SPECIAL = 151_643
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                   "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def bpe_vocab(vocab_size: int, first_special: int, specials: list[str]) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a made-up byte-level BPE: the 256 byte tokens, then every pair
    of bytes (the letters and the space first), then triples of the most common characters, up to
    `first_special`; then `specials`; then [PADn] up to `vocab_size`. Each merged token has its merge."""
    import gguf

    from nanochat.models.tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    common = [" "] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    common += [str(d) for d in range(10)] + list("\n.,'-!?:;()\"")
    order = [ord(c) for c in common] + [b for b in range(256) if chr(b) not in common]
    chars = [table[b] for b in order]           # all 256, most common first
    tokens = [table[b] for b in range(256)]
    merges: list[str] = []
    budget = first_special - 256
    for a in chars:
        for b in chars:
            merges.append(f"{a} {b}")
            tokens.append(a + b)
    top = chars[:45]
    done = False
    for a in top:
        for b in top:
            for c in top:
                if len(merges) >= budget:
                    done = True
                    break
                merges.append(f"{a}{b} {c}")
                tokens.append(a + b + c)
            if done:
                break
        if done:
            break
    if len(merges) > budget:
        del merges[budget:], tokens[first_special:]
    if len(tokens) != first_special:
        raise ValueError(f"made {len(tokens)} BPE tokens, wanted {first_special}")
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    for s in specials:
        tokens.append(s)
        types.append(int(gguf.TokenType.CONTROL if s.startswith("<|") else gguf.TokenType.USER_DEFINED))
    while len(tokens) < vocab_size:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(int(gguf.TokenType.UNUSED))
    return tokens, merges, types


def write_qwen3_random(path: str | os.PathLike, seed: int = 0, std: float = 0.02, **shape) -> Path:
    """A qwen3 GGUF with random weights (F16 matrices, F32 norms), streamed tensor by tensor."""
    import gguf
    import numpy as np

    s = {**QWEN3_0_6B, **shape}
    h, hd, nh, nkv, ff = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"], s["intermediate"]
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s["vocab"], h))]
    for i in range(s["layers"]):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (h,)), (p + "attn_q.weight", (nh * hd, h)),
                    (p + "attn_k.weight", (nkv * hd, h)), (p + "attn_v.weight", (nkv * hd, h)),
                    (p + "attn_output.weight", (h, nh * hd)), (p + "attn_q_norm.weight", (hd,)),
                    (p + "attn_k_norm.weight", (hd,)), (p + "ffn_norm.weight", (h,)),
                    (p + "ffn_gate.weight", (ff, h)), (p + "ffn_up.weight", (ff, h)), (p + "ffn_down.weight", (h, ff))]
    tensors.append(("output_norm.weight", (h,)))   # tied embeddings: no output.weight

    w = gguf.GGUFWriter(None, "qwen3")
    w.add_name("Qwen3-0.6B-shaped random weights (nanochat benchmarks)")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    w.add_context_length(s["context"])
    w.add_embedding_length(h)
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(ff)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["rms_eps"])
    first_special = min(QWEN_FIRST_SPECIAL, s["vocab"] - len(QWEN_SPECIAL))
    tokens, merges, types = bpe_vocab(s["vocab"], first_special, QWEN_SPECIAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(first_special + QWEN_SPECIAL.index("<|im_end|>"))
    w.add_pad_token_id(first_special)
    w.add_bos_token_id(first_special)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    for name, shp in tensors:
        f16 = len(shp) == 2
        w.add_tensor_info(name, shp, np.dtype(np.float16 if f16 else np.float32),
                          int(np.prod(shp)) * (2 if f16 else 4))
    w.write_header_to_file(Path(path))
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in tensors:
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, dtype=np.float32))
        else:
            x = rng.standard_normal(shp, dtype=np.float32)
            x *= std
            w.write_tensor_data(x.astype(np.float16))
            del x
    w.close()
    return Path(path)


# ---------------------------------------------------------------------------------- load checks
def check_nanochat(path: Path, timeout: float = 600) -> str | None:
    """None when `nanochat --model FILE --prompt hi --max-tokens 4 --device cpu` works, else the error."""
    exe = Path(sys.executable).with_name("nanochat")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "nanochat.app.cli"]
    r = subprocess.run(cmd + ["--model", str(path), "--prompt", "hi", "--max-tokens", "4", "--device", "cpu"],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode == 0:
        return None
    tail = [ln for ln in r.stderr.splitlines() if ln.strip()][-2:]
    return " | ".join(tail) or f"exit {r.returncode}"


def check_llamacpp(path: Path, python: str, timeout: float = 600) -> str | None:
    """None when `Llama(model_path=FILE)` loads in the peer interpreter, else the error."""
    r = subprocess.run([python, str(HERE / "llamacpp_worker.py"), "check", str(path)],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode == 0:
        return None
    tail = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-2:]
    return " | ".join(tail) or f"exit {r.returncode}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="models (default: the whole matrix); families work too")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--list", action="store_true", help="list the models and their cached files")
    g.add_argument("--make", action="store_true", help="make the models that are not cached yet")
    g.add_argument("--check", action="store_true", help="make them, then load each in nanochat and llama.cpp")
    p.add_argument("--models-dir", type=Path, help="cache (default: $NANOCHAT_HOME/cache/peer-models or "
                                                   "the user cache dir nanochat/peer-models)")
    p.add_argument("--peer-python", help="interpreter with llama-cpp-python (default: $NANOCHAT_PEER_PYTHON)")
    p.add_argument("--threads", type=int, default=2, help="quantizer threads (2)")
    p.add_argument("--json", action="store_true", help="--check: one JSON object on stdout")
    args = p.parse_args(argv)
    names = resolve_names(",".join(args.names)) if args.names else list(MATRIX)
    models_dir = args.models_dir or default_models_dir()
    python = peer_python(args.peer_python)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.list or not (args.make or args.check):
        for n in MODELS:
            spec = MODELS[n]
            builtin = spec.source is None and spec.family == "smollm2"
            path = ensure_model(n, models_dir, python) if builtin else Path(models_dir) / spec.filename
            state = (f"{path.stat().st_size / 2**20:.0f} MiB" if path.is_file() else "not made yet") \
                + (" (built-in)" if builtin else "")
            print(f"{n:20s} {state:>23s}  {'' if n in MATRIX else '(not in --matrix) '}{path}")
        return 0
    results = {}
    for n in names:
        try:
            path = ensure_model(n, models_dir, python, args.threads, log)
        except Exception as e:
            results[n] = {"file": None, "error": f"{type(e).__name__}: {e}"}
            log(f"{n}: cannot be made: {e}")
            continue
        results[n] = {"file": str(path)}
        if args.check:
            for engine, fn in (("nanochat", lambda: check_nanochat(path)),
                               ("llama.cpp", lambda: check_llamacpp(path, python))):
                err = fn()
                results[n][engine] = "ok" if err is None else err
                log(f"{n}: {engine} {'loads it' if err is None else 'FAILS: ' + err}")
    if args.json:
        print(json.dumps(results, indent=2))
    elif args.check:
        for n, r in results.items():
            print(f"{n:20s} nanochat: {r.get('nanochat', '-')}; llama.cpp: {r.get('llama.cpp', '-')}"
                  + (f"; {r['error']}" if "error" in r else ""))
    bad = [n for n, r in results.items() if "error" in r or any(r.get(e, "ok") != "ok" for e in ("nanochat", "llama.cpp"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
