"""The models of benchmarks/peers.py's matrix, made at benchmark time and cached (never committed).

    .venv/bin/python benchmarks/matrix_models.py --list
    .venv/bin/python benchmarks/matrix_models.py --make [NAME ...] [--models-dir DIR] [--peer-python PY]
    .venv/bin/python benchmarks/matrix_models.py --check [NAME ...]   # make, then load each in both engines

Families:
  smollm2-*     the built-in SmolLM2-135M-Instruct Q4_1 GGUF as is (smollm2-q4_1), and requantized from
                it by llama.cpp's own quantizer (llama_model_quantize with allow_requantize) to
                Q4_K_M, Q5_K_M, Q6_K, Q8_0 and Q4_0. SmolLM2's width (576) is not a multiple of 256,
                so llama.cpp's K-quant mixes fall back to Q5_0 / Q5_1 / Q8_0 for most of its tensors
                (it says so on stderr): that is llama.cpp's file, and the one both engines load. Also
                widened to F16 (smollm2-f16: the same weights at 16 bits, as the model is published;
                not in --matrix, ask for it by name).
  qwen3-0.6b-*  a Qwen3 checkpoint with Qwen3-0.6B's shapes and random weights (normal, std 0.02;
                norms 1), written here with the `gguf` package at F16 (norms F32), with a made-up
                151,936-token gpt2-style byte-level BPE (256 byte tokens, 151,387 merged tokens with
                matching merges, Qwen's special tokens, ChatML template); then quantized by
                llama.cpp to Q4_K_M, Q5_K_M, Q6_K, Q8_0 and Q4_0.
  phi3-mini-*   a phi3 checkpoint with Phi-3-mini-4k-instruct's shapes (hidden 3072, 32 layers, 32 heads and
                32 KV heads of 96, FFN 8192, rope theta 1e4, rms eps 1e-5, window 2047, context 4096) laid
                out as llama.cpp's converter writes phi3 (attn_qkv = q|k|v, ffn_up = gate|up, untied
                output), random weights as above; a made-up 32,064-piece SentencePiece vocabulary
                (spm_vocab: <unk> <s> </s>, the 256 <0xNN> byte-fallback tokens, pieces with scores, then
                Phi-3's added tokens <|endoftext|> ... <|user|> from id 32000 and [PADn]), Phi-3's chat
                template; F16 (7.6 GB), then Q4_K_M by llama.cpp.
  gpt-oss-20b-mxfp4  a gpt-oss file with gpt-oss-20b's shapes (hidden 2880, 24 layers, 64 heads and 8 KV heads of
                64, 32 experts of width 2880 with 4 used, window 128 on every other layer, YaRN) and random
                weights in the published file's types (experts MXFP4, other matrices Q8_0; 12 GB), written
                here directly; a made-up 201,088-token byte-level BPE with harmony's special tokens. Not in
                --matrix: ask for it by name.
  gemma3-1b-*   a gemma3 checkpoint with Gemma 3 1B's shapes (hidden 1152, 26 layers, 4 heads and 1 KV head
                of 256, FFN 6912, window 512 on 5 layers of every 6, rope bases 1e4 local / 1e6 global,
                query_pre_attn_scalar 256, four norms per layer and q/k norms, tied embeddings, context
                32768) as llama.cpp's converter writes gemma3 (norms stored as 1 + w: ones here), random
                weights; a made-up 262,144-piece SentencePiece vocabulary without a space prefix (Gemma's
                <pad> <eos> <bos> <unk>, control tokens up to <start_of_turn> 105 / <end_of_turn> 106),
                Gemma 3's chat template; F16, then Q4_K_M by llama.cpp.
The text these random files generate is garbage: they measure speed, not quality. The made-up
SentencePiece vocabularies are 8,000 pieces trained on made-up text (tests/gguf_writer.py's
train_sentencepiece) and pieces joining two of those, so that merges reach every piece.

The cache: --models-dir, else $NANOCHAT_HOME/cache/peer-models, else the platformdirs user cache dir
nanochat/peer-models (kernels/cpp_build.py's cache_root()). A file is written under a temporary
name and renamed when complete, so an interrupted run never leaves a half file behind.
Quantization runs in the interpreter that has llama-cpp-python (--peer-python, or
$NANOCHAT_PEER_PYTHON), through `llamacpp_worker.py quantize`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "tests"))   # gguf_writer's SentencePiece helpers
QUANTS = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0")


# family -> (file stem, the quantizations made from its source)
FAMILIES = {"smollm2": ("SmolLM2-135M-Instruct", QUANTS + ("f16",)), "qwen3-0.6b": ("Qwen3-0.6B-random", QUANTS),
            "phi3-mini": ("Phi-3-mini-4k-random", ("q4_k_m",)), "gemma3-1b": ("Gemma-3-1B-random", ("q4_k_m",)),
            "gpt-oss-20b": ("gpt-oss-20b-random", ())}
# Families written in their final types (no F16 source, no llama.cpp quantization): gpt-oss as published.
WRITTEN_AS_IS = {"gpt-oss-20b": "mxfp4"}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str           # a key of FAMILIES
    quant: str            # "q4_1", "q4_k_m", ..., "f16"
    source: str | None    # the model it is quantized from (None: the built-in file / written here)

    @property
    def filename(self) -> str:
        return f"{FAMILIES[self.family][0]}.{self.quant.upper()}.gguf"


def _specs() -> dict[str, ModelSpec]:
    out = {}
    for family, (_, quants) in FAMILIES.items():
        # SmolLM2's source is the built-in Q4_1 file; the random-weight families are written at F16
        src = f"{family}-q4_1" if family == "smollm2" else f"{family}-{WRITTEN_AS_IS.get(family, 'f16')}"
        out[src] = ModelSpec(src, family, src.rpartition("-")[2], None)
        out.update({f"{family}-{q}": ModelSpec(f"{family}-{q}", family, q, src) for q in quants})
    return out


MODELS = _specs()
# --matrix: every model but the F16 files (the random families' sources, 1.2-7.6 GB, and SmolLM2's) and gpt-oss-20b
# (12 GB; --models gpt-oss-20b)
MATRIX = [n for n in MODELS if MODELS[n].quant != "f16" and MODELS[n].family not in WRITTEN_AS_IS]


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
        from nanochat.models.formats.catalog import resolve_default_model

        return Path(resolve_default_model(None))
    path = Path(models_dir) / spec.filename
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".part{os.getpid()}")
    t0 = time.perf_counter()
    try:
        if spec.source is None:
            write, shapes = RANDOM_WRITERS[spec.family]
            log(f"writing {path.name} (random weights, {shapes} shapes)")
            write(tmp)
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


# llama.cpp's own converter, from the llama-cpp-python source distribution's vendored llama.cpp. It checks a
# tokenizer against the hashes of known ones; the benchmarks' made-up tokenizers are none of them, so the run names
# the pre-tokenizer (only ids are ever fed to the files it writes).
LLAMA_CPP_SRC = Path("/work/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp")
_CONVERT = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {root!r} + "/gguf-py")
import convert_hf_to_gguf as c
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
c.main()
"""


def convert_hf(folder: Path, out: Path, outtype: str, llama_cpp: Path, pre: str) -> Path:
    """A Hugging Face folder as a GGUF written by llama.cpp's convert_hf_to_gguf.py (`llama_cpp`: its source tree)
    at `outtype` (f32, bf16, ...), telling it the pre-tokenizer `pre`."""
    script = _CONVERT.format(root=str(llama_cpp), pre=pre)
    subprocess.run([sys.executable, "-c", script, str(folder), "--outfile", str(out), "--outtype", outtype],
                   check=True, capture_output=True, text=True)
    return out


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

    from nanochat.models.text.tokenizer import bytes_to_unicode

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
    top = chars[:45]   # enough triples for Qwen's vocabulary; more for larger ones (o200k)
    while len(top) ** 3 < budget - len(merges) and len(top) < len(chars):
        top = chars[:len(top) + 1]
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


def _dense_writer(arch: str, name: str, s: dict, h: int, ff: int, nh: int, nkv: int, hd: int, file_type=None):
    """A GGUFWriter for a file of `arch` (F16 unless `file_type` says) with the shape keys every family writes."""
    import gguf

    w = gguf.GGUFWriter(None, arch)
    w.add_name(name)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if file_type is None else file_type))
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
    return w


def _qk_norm_attention(p: str, h: int, hd: int, nh: int, nkv: int) -> list[tuple[str, tuple[int, ...]]]:
    """One layer's attention tensors with q/k norms (Qwen3, Gemma 3), in llama.cpp's names and order."""
    return [(p + "attn_norm.weight", (h,)), (p + "attn_q.weight", (nh * hd, h)), (p + "attn_k.weight", (nkv * hd, h)),
            (p + "attn_v.weight", (nkv * hd, h)), (p + "attn_output.weight", (h, nh * hd)),
            (p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,))]


def write_qwen3_random(path: str | os.PathLike, seed: int = 0, std: float = 0.02, **shape) -> Path:
    """A qwen3 GGUF with random weights (F16 matrices, F32 norms), streamed tensor by tensor."""
    s = {**QWEN3_0_6B, **shape}
    h, hd, nh, nkv, ff = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"], s["intermediate"]
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s["vocab"], h))]
    for i in range(s["layers"]):
        p = f"blk.{i}."
        tensors += _qk_norm_attention(p, h, hd, nh, nkv) + [
            (p + "ffn_norm.weight", (h,)), (p + "ffn_gate.weight", (ff, h)), (p + "ffn_up.weight", (ff, h)),
            (p + "ffn_down.weight", (h, ff))]
    tensors.append(("output_norm.weight", (h,)))   # tied embeddings: no output.weight

    w = _dense_writer("qwen3", "Qwen3-0.6B-shaped random weights (nanochat benchmarks)", s, h, ff, nh, nkv, hd)
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
    return write_random_tensors(w, path, tensors, seed, std)


def write_random_tensors(w, path: str | os.PathLike, tensors: list[tuple[str, tuple[int, ...]]],
                         seed: int, std: float) -> Path:
    """Finish GGUFWriter `w` (metadata added) at `path`: `tensors` (name, numpy shape) in order, matrices
    F16 normal(0, std), vectors (the norms) F32 ones; streamed tensor by tensor, each drawn in row chunks so
    that a 262k-row embedding never exists as float32 in full."""
    import numpy as np

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
            continue
        x = np.empty(shp, dtype=np.float16)
        step = max(1, (1 << 24) // shp[1])
        for r in range(0, shp[0], step):
            part = rng.standard_normal((min(step, shp[0] - r), shp[1]), dtype=np.float32)
            part *= std
            x[r:r + step] = part
        w.write_tensor_data(x)
        del x
    w.close()
    return Path(path)


# ---------------------------------------------------------------------------------- SentencePiece, made up
SPM_TRAINED = 8000   # pieces actually trained; the rest of a vocabulary are pairs of them


def made_up_corpus(lines: int = 20_000, seed: int = 0) -> list[str]:
    """Sentences of made-up words (consonant-vowel syllables, Zipf-distributed), with digits and punctuation."""
    rng = random.Random(seed)
    cons, vowels = "bcdfghjklmnpqrstvwxyz", "aeiou"
    lexicon = ["".join(rng.choice(cons) + rng.choice(vowels) + (rng.choice(cons) if rng.random() < 0.4 else "")
                       for _ in range(rng.randint(1, 4))) for _ in range(20_000)]
    weights = [1 / (i + 1) for i in range(len(lexicon))]
    out = []
    for _ in range(lines):
        words = rng.choices(lexicon, weights, k=rng.randint(4, 16))
        out.append(" ".join(words).capitalize() + rng.choice(".,?!")
                   + (f" {rng.randint(0, 99_999)}" if rng.random() < 0.2 else ""))
    return out


def spm_vocab(n_pieces: int, trainer: dict | None = None, **flags: bool) -> dict:
    """tokenizer.* metadata of a made-up SentencePiece vocabulary of `n_pieces`, as llama.cpp's converter
    writes one (tests/gguf_writer.py's helpers): a BPE model with byte fallback trained on made_up_corpus()
    (`trainer`: more SentencePiece trainer options, e.g. special ids and control symbols), then filled up
    with pieces that are two trained pieces joined (the second not a word start: pieces stay inside words,
    as SentencePiece's are), so that merges reach them, each scored below the last.
    `flags`: tokenizer.ggml.add_space_prefix, add_bos_token ..."""
    import gguf
    from gguf_writer import sentencepiece_tokenizer_metadata, train_sentencepiece

    sp = train_sentencepiece(made_up_corpus(), SPM_TRAINED, **(trainer or {}))
    meta = sentencepiece_tokenizer_metadata(sp, **flags)
    tokens, scores, types = (meta[f"tokenizer.ggml.{k}"].value for k in ("tokens", "scores", "token_type"))
    normal = [t for t, k in zip(tokens, types) if k == gguf.TokenType.NORMAL]
    inner = [t for t in normal if not t.startswith("\u2581")]
    side = math.isqrt(2 * (n_pieces - len(tokens))) + 1   # twice the pairs needed: some joins exist already
    seen, low = set(tokens), min(scores)
    for a, b in itertools.product(normal[:side], inner[:side]):
        if len(tokens) == n_pieces:
            break
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
            scores.append(low - len(tokens))
            types.append(int(gguf.TokenType.NORMAL))
    if len(tokens) != n_pieces:
        raise ValueError(f"made {len(tokens)} SentencePiece pieces, wanted {n_pieces}")
    return meta


def _add_tokenizer(w, meta: dict, chat_template: str) -> None:
    for key, v in meta.items():
        w.add_key_value(key, v.value, v.vtype, v.sub_type)
    w.add_chat_template(chat_template)


# ---------------------------------------------------------------------------------- Phi-3-mini, random
PHI3_MINI = dict(hidden=3072, layers=32, heads=32, kv_heads=32, head_dim=96, intermediate=8192, vocab=32_064,
                 context=4096, rope_theta=10_000.0, rms_eps=1e-5, sliding_window=2047)
# Phi-3's added tokens from id 32000 on (added_tokens.json), CONTROL as the converter writes them (their
# tokenizer_config says special); [PADn] up to the vocab size, UNUSED.
PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
              "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
PHI3_FIRST_ADDED = 32_000
PHI3_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + "
                 "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + "
                 "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + "
                 "message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")


def write_phi3_random(path: str | os.PathLike, seed: int = 0, std: float = 0.02) -> Path:
    """A phi3 GGUF with Phi-3-mini-4k-instruct's shapes and random weights, laid out as llama.cpp's
    converter (Phi3MiniModel) writes it: fused attn_qkv [q; k; v] and ffn_up [gate; up], untied output."""
    import gguf

    from gguf_writer import MetaValue

    s = PHI3_MINI
    h, hd, nh, nkv, ff = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"], s["intermediate"]
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s["vocab"], h))]
    for i in range(s["layers"]):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (h,)), (p + "attn_qkv.weight", ((nh + 2 * nkv) * hd, h)),
                    (p + "attn_output.weight", (h, nh * hd)), (p + "ffn_norm.weight", (h,)),
                    (p + "ffn_up.weight", (2 * ff, h)), (p + "ffn_down.weight", (h, ff))]
    tensors += [("output_norm.weight", (h,)), ("output.weight", (s["vocab"], h))]

    w = gguf.GGUFWriter(None, "phi3")
    # llama.cpp keys its Phi-3 tokenizer rule (special tokens strip the whitespace after them) on the name
    w.add_name("Phi-3-mini-4k-instruct-shaped random weights (nanochat benchmarks)")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    w.add_context_length(s["context"])
    w.add_rope_scaling_orig_ctx_len(s["context"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(ff)
    w.add_block_count(s["layers"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(s["rms_eps"])
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(s["rope_theta"])
    w.add_sliding_window(s["sliding_window"])
    meta = spm_vocab(PHI3_FIRST_ADDED, add_bos_token=False, add_eos_token=False)
    tokens, scores, types = (meta[f"tokenizer.ggml.{k}"].value for k in ("tokens", "scores", "token_type"))
    for i in range(PHI3_FIRST_ADDED, s["vocab"]):
        added = i - PHI3_FIRST_ADDED < len(PHI3_ADDED)
        tokens.append(PHI3_ADDED[i - PHI3_FIRST_ADDED] if added else f"[PAD{i}]")
        scores.append(-1000.0 if added else -10000.0)
        types.append(int(gguf.TokenType.CONTROL if added else gguf.TokenType.UNUSED))
    eos = PHI3_FIRST_ADDED + PHI3_ADDED.index("<|endoftext|>")
    for key in ("eos_token_id", "padding_token_id"):
        meta[f"tokenizer.ggml.{key}"] = MetaValue(eos, gguf.GGUFValueType.UINT32)
    _add_tokenizer(w, meta, PHI3_TEMPLATE)
    return write_random_tensors(w, path, tensors, seed, std)


# ---------------------------------------------------------------------------------- Gemma 3 1B, random
GEMMA3_1B = dict(hidden=1152, layers=26, heads=4, kv_heads=1, head_dim=256, intermediate=6912, vocab=262_144,
                 context=32_768, rope_theta=1_000_000.0, rms_eps=1e-6, sliding_window=512)
# Gemma's ids 0-3 and control tokens 4-106 (<start_of_turn> 105, <end_of_turn> 106), as in its tokenizer.model
GEMMA_TRAINER = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                     bos_piece="<bos>", add_dummy_prefix=False,
                     control_symbols=["<mask>", "[multimodal]"] + [f"<unused{i}>" for i in range(99)]
                     + ["<start_of_turn>", "<end_of_turn>"])
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def write_gemma3_random(path: str | os.PathLike, seed: int = 0, std: float = 0.02) -> Path:
    """A gemma3 GGUF with Gemma 3 1B's shapes and random weights, as llama.cpp's converter (Gemma3Model)
    writes it: four norms per layer (stored as 1 + w, so ones here are w = 0), q/k norms, tied embeddings.
    Like the converter it writes neither the window pattern nor the local rope base: llama.cpp's gemma3
    defaults are Gemma's (every 6th layer global, the others windowed; local base 10000), and its
    attention scale 1/sqrt(head_dim) is Gemma 3 1B's query_pre_attn_scalar (256)."""
    s = GEMMA3_1B
    h, hd, nh, nkv, ff = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"], s["intermediate"]
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s["vocab"], h))]
    for i in range(s["layers"]):
        p = f"blk.{i}."
        tensors += _qk_norm_attention(p, h, hd, nh, nkv) + [
            (p + "post_attention_norm.weight", (h,)), (p + "ffn_norm.weight", (h,)), (p + "ffn_gate.weight", (ff, h)),
            (p + "ffn_up.weight", (ff, h)), (p + "ffn_down.weight", (h, ff)), (p + "post_ffw_norm.weight", (h,))]
    tensors.append(("output_norm.weight", (h,)))

    w = _dense_writer("gemma3", "Gemma-3-1B-shaped random weights (nanochat benchmarks)", s, h, ff, nh, nkv, hd)
    w.add_sliding_window(s["sliding_window"])
    meta = spm_vocab(s["vocab"], GEMMA_TRAINER, add_space_prefix=False, add_bos_token=True, add_eos_token=False)
    _add_tokenizer(w, meta, GEMMA3_TEMPLATE)
    return write_random_tensors(w, path, tensors, seed, std)


GPT_OSS_20B = dict(hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64, experts=32, experts_used=4,
                   expert_width=2880, vocab=201_088, window=128, context=131_072, rope_theta=150_000.0,
                   rope_factor=32.0, rope_original_context=4096, rms_eps=1e-5)
# o200k_harmony's special tokens from id 199,998 (the rest of the ids up to the vocabulary size are reserved)
HARMONY_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>",
                   "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
                   "<|reserved_200009|>", "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>"]
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def _random_blocks(rng, qtype: int, shape: tuple[int, ...], std: float):
    """Random GGML blocks of `shape` (the last dim in values) as uint8 rows: Q8_0 (int8 values, one f16 scale
    a block) or MXFP4 (random E2M1 nibbles, one E8M0 exponent a block), values of about `std`."""
    import gguf
    import numpy as np

    n_blocks = int(np.prod(shape)) // 32
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        d = np.full((n_blocks, 1), np.float16(std / 73.0)).view(np.uint8)   # uniform int8: rms 73
        qs = rng.integers(-127, 128, size=(n_blocks, 32), dtype=np.int8).view(np.uint8)
    else:   # MXFP4: E2M1 magnitudes have rms 2.9 at exponent 0 (e = 127)
        e = 127 + int(round(np.log2(std / 2.9)))
        d = np.full((n_blocks, 1), e, dtype=np.uint8)
        qs = rng.integers(0, 256, size=(n_blocks, 16), dtype=np.uint8)
    return np.concatenate([d, qs], axis=1).reshape(*shape[:-1], -1)


def write_gpt_oss_random(path: str | os.PathLike, seed: int = 0, std: float = 0.02) -> Path:
    """A gpt-oss GGUF with gpt-oss-20b's shapes and random weights, in the published file's types: the routed
    experts MXFP4, the other matrices Q8_0, the router, norms, biases and sinks F32; llama.cpp's converter's
    names and keys (GptOssModel). A made-up 201,088-token byte-level BPE with harmony's special tokens."""
    import gguf
    import numpy as np

    s, Q = GPT_OSS_20B, gguf.GGMLQuantizationType
    h, hd, nh, nkv, e, ff = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"], s["experts"], s["expert_width"]
    tensors: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (s["vocab"], h), Q.Q8_0)]
    for i in range(s["layers"]):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (h,), Q.F32)]
        for name, rows in (("attn_q", nh * hd), ("attn_k", nkv * hd), ("attn_v", nkv * hd)):
            tensors += [(p + name + ".weight", (rows, h), Q.Q8_0), (p + name + ".bias", (rows,), Q.F32)]
        tensors += [(p + "attn_output.weight", (h, nh * hd), Q.Q8_0), (p + "attn_output.bias", (h,), Q.F32),
                    (p + "attn_sinks.weight", (nh,), Q.F32), (p + "post_attention_norm.weight", (h,), Q.F32),
                    (p + "ffn_gate_inp.weight", (e, h), Q.F32), (p + "ffn_gate_inp.bias", (e,), Q.F32)]
        for name, shape in (("ffn_gate_exps", (e, ff, h)), ("ffn_up_exps", (e, ff, h)), ("ffn_down_exps", (e, h, ff))):
            tensors += [(p + name + ".weight", shape, Q.MXFP4), (p + name + ".bias", shape[:2], Q.F32)]
    tensors += [("output_norm.weight", (h,), Q.F32), ("output.weight", (s["vocab"], h), Q.Q8_0)]

    w = _dense_writer("gpt-oss", "gpt-oss-20b-shaped random weights (nanochat benchmarks)", s, h, ff, nh, nkv, hd,
                      gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_expert_count(e)
    w.add_expert_used_count(s["experts_used"])
    w.add_expert_feed_forward_length(ff)
    w.add_sliding_window(s["window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(s["rope_factor"])
    w.add_rope_scaling_orig_ctx_len(s["rope_original_context"])
    first_special = 199_998
    tokens, merges, types = bpe_vocab(s["vocab"], first_special, HARMONY_SPECIAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(first_special)
    w.add_eos_token_id(first_special + HARMONY_SPECIAL.index("<|return|>"))
    w.add_pad_token_id(first_special + HARMONY_SPECIAL.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(HARMONY_TEMPLATE)

    for name, shp, qtype in tensors:
        if qtype == Q.F32:
            w.add_tensor_info(name, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
        else:
            elems, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shp[:-1], shp[-1] // elems * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    w.write_header_to_file(Path(path))
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp, qtype in tensors:
        if qtype != Q.F32:
            w.write_tensor_data(_random_blocks(rng, qtype, shp, std))
        elif name.endswith("norm.weight"):
            w.write_tensor_data(np.ones(shp, dtype=np.float32))
        else:   # router, biases, sinks
            w.write_tensor_data((rng.standard_normal(shp, dtype=np.float32) * std).astype(np.float32))
    w.close()
    return Path(path)


# family -> (writer of its source file, whose shapes)
RANDOM_WRITERS = {"qwen3-0.6b": (write_qwen3_random, "Qwen3-0.6B"), "phi3-mini": (write_phi3_random, "Phi-3-mini-4k"),
                  "gemma3-1b": (write_gemma3_random, "Gemma 3 1B"), "gpt-oss-20b": (write_gpt_oss_random, "gpt-oss-20b")}


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
