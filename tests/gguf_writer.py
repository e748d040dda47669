"""Test helper: write tiny GGUF files from Hugging Face state dicts, as llama.cpp's converter would.

    write_gguf_from_hf(model, path, "llama", gguf.GGMLQuantizationType.Q8_0)

`model` is a transformers model, a folder with config.json + *.safetensors, or a
(state_dict, config) pair (config: dict or PretrainedConfig). Linears (and by default the
embedding / LM head) are quantized with `gguf.quants.quantize`; norms and biases are F32.
For types gguf-py cannot quantize (K-quants), pass `quantizer(x) -> (raw_uint8_blocks, qtype)`
(or None to fall back to the default type), e.g. a packer from tests/kquant_pack.py:

    quantizer=lambda x: (pack_q4_k(x), gguf.GGMLQuantizationType.Q4_K)

MoE and hybrid archs ("qwen3moe", "qwen3next", "qwen35moe", "qwen35") get llama.cpp's converter
transforms (convert_hf_to_gguf.py, Qwen2MoeModel / Qwen3NextModel / _LinearAttentionVReorderBase):
experts stacked into 3-D `ffn_{gate,up,down}_exps` [E, out, in], +1 on every norm except the GDN
output norm (`linear_attn.norm`), `ssm_a = -exp(A_log)`, `dt_bias -> ssm_dt.bias`, conv1d squeezed
to [C, K], Qwen3-Next's per-key-head `in_proj_qkvz` regrouped into `attn_qkv` [q; k; v] + `attn_gate`,
`in_proj_ba -> ssm_ba` as is, and for qwen35* value heads reordered from grouped to tiled order
(rows of the v part of qkv / conv1d, z, b, a, A_log, dt_bias; columns of out_proj). Expert types:
`expert_qtype` (K-quants packed with tests/kquant_pack.py); routers, conv1d and rows that do not
fill whole blocks stay F32.

The name tables here are written independently of nanochat.models.formats.gguf_source on purpose: they are
the oracle the loader is checked against.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import gguf
import numpy as np
import torch

from nanochat.models.text.tokenizer import bytes_to_unicode

T = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
Quantizer = Callable[[np.ndarray], "tuple[np.ndarray, gguf.GGMLQuantizationType] | None"]

# HF module -> llama.cpp tensor base name.
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # Phi-3's fused projections, stored fused by llama.cpp (ffn_up holds gate|up)
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
}
PERMUTED_ARCHS = ("llama", "smollm3")   # llama.cpp's converter permutes their q/k rows (LlamaModel)
# Gemma 3 (Gemma3Model): four norms a layer, its post_attention_layernorm on the attention output.
_GEMMA3_BLOCK = {**_BLOCK, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


# MoE / hybrid archs: HF module (after "model.layers.N.") -> GGUF base name.
_MOE_BLOCK = {
    **_BLOCK,
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_HYBRID_BLOCK = {
    **_MOE_BLOCK,
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}
HYBRID_ARCHS = ("qwen3next", "qwen35moe", "qwen35")
MOE_ARCHS = ("qwen3moe", "qwen3next", "qwen35moe", "gpt-oss")
# gpt-oss (GptOssModel): its router and sinks, post_attention_norm before the MLP; experts in their own layout
# (convert_moe_state).
_GPT_OSS_BLOCK = {**_MOE_BLOCK, "post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp",
                  "self_attn.sinks": "attn_sinks"}
_KEEP_F32 = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d")


@dataclass(frozen=True)
class MetaValue:
    """A metadata value with its exact GGUF type (for copying keys between files)."""

    value: Any
    vtype: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None


def gguf_name(hf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp's name for an HF tensor name, or None when it has no GGUF counterpart."""
    module, _, kind = hf_name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{kind}"
    block = _GEMMA3_BLOCK if arch == "gemma3" else _BLOCK
    parts = module.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in block:
        return f"blk.{parts[2]}.{block[parts[3]]}.{kind}"
    return None


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row permutation of attn_q/attn_k (HF rotate-half -> ggml interleaved pairs)."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def read_metadata(path: str | os.PathLike, prefix: str = "tokenizer.") -> dict[str, MetaValue]:
    """Typed copy of every metadata key starting with `prefix` (e.g. SmolLM2's tokenizer)."""
    reader = gguf.GGUFReader(path)
    out = {}
    for key, f in reader.fields.items():
        if key.startswith(prefix) and f.types:
            sub = f.types[-1] if f.types[0] == VT.ARRAY else None
            out[key] = MetaValue(f.contents(), f.types[0], sub)
    return out


def byte_tokenizer_metadata(vocab_size: int, bos: int | None, eos: int | None) -> dict[str, MetaValue]:
    """A minimal gpt2-style byte-level vocab: ids 0..255 are bytes, the rest control tokens."""
    table = bytes_to_unicode()
    tokens = [table[b] for b in range(min(vocab_size, 256))]
    tokens += [f"<|extra_{i}|>" for i in range(256, vocab_size)]
    types = [int(gguf.TokenType.NORMAL)] * min(vocab_size, 256) + [int(gguf.TokenType.CONTROL)] * max(0, vocab_size - 256)
    meta = {
        "tokenizer.ggml.model": MetaValue("gpt2", VT.STRING),
        "tokenizer.ggml.pre": MetaValue("default", VT.STRING),
        "tokenizer.ggml.tokens": MetaValue(tokens, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.token_type": MetaValue(types, VT.ARRAY, VT.INT32),
    }
    if bos is not None:
        meta["tokenizer.ggml.bos_token_id"] = MetaValue(int(bos), VT.UINT32)
    if eos is not None:
        meta["tokenizer.ggml.eos_token_id"] = MetaValue(int(eos), VT.UINT32)
    return meta


def train_sentencepiece(lines: list[str], vocab_size: int, user_defined: tuple[str, ...] = (), **options):
    """A SentencePiece BPE model trained in memory (a SentencePieceProcessor), Llama-style: byte fallback,
    no normalization, spaces kept as they are (runs of them can be pieces), every digit its own piece.
    `options` override the trainer's."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, **{
            "model_type": "bpe", "vocab_size": vocab_size, "byte_fallback": True, "character_coverage": 1.0,
            "normalization_rule_name": "identity", "remove_extra_whitespaces": False, "split_digits": True,
            "allow_whitespace_only_pieces": True, "user_defined_symbols": list(user_defined), "minloglevel": 2,
            **options})
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def sentencepiece_tokenizer_metadata(sp, user_defined: tuple[str, ...] = (), **flags: bool) -> dict[str, MetaValue]:
    """A SentencePiece model's vocabulary as llama.cpp's converter writes it (_create_vocab_sentencepiece):
    pieces, scores, and types unknown / control / unused / byte, else normal. `user_defined` pieces (those
    the converter finds in tokenizer_config.json's added_tokens_decoder) become USER_DEFINED, with "▁" as
    spaces and score -1000. `flags`: add_space_prefix, add_bos_token, add_eos_token ... (tokenizer.ggml.*)."""
    TT = gguf.TokenType
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece, kind = sp.id_to_piece(i), TT.NORMAL
        if sp.is_unknown(i):
            kind = TT.UNKNOWN
        elif sp.is_control(i):
            kind = TT.CONTROL
        elif sp.is_unused(i):
            kind = TT.UNUSED
        elif sp.is_byte(i):
            kind = TT.BYTE
        score = sp.get_score(i)
        if piece in user_defined:
            piece, kind, score = piece.replace("\u2581", " "), TT.USER_DEFINED, -1000.0
        tokens.append(piece)
        scores.append(score)
        types.append(int(kind))
    meta = {
        "tokenizer.ggml.model": MetaValue("llama", VT.STRING),
        "tokenizer.ggml.pre": MetaValue("default", VT.STRING),
        "tokenizer.ggml.tokens": MetaValue(tokens, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.scores": MetaValue(scores, VT.ARRAY, VT.FLOAT32),
        "tokenizer.ggml.token_type": MetaValue(types, VT.ARRAY, VT.INT32),
    }
    for key, tid in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unknown", sp.unk_id()), ("padding", sp.pad_id())):
        if tid >= 0:
            meta[f"tokenizer.ggml.{key}_token_id"] = MetaValue(tid, VT.UINT32)
    for key, value in flags.items():
        meta[f"tokenizer.ggml.{key}"] = MetaValue(bool(value), VT.BOOL)
    return meta


def write_vocab_gguf(path: str | os.PathLike, tokenizer: Mapping[str, Any], arch: str = "llama",
                     name: str = "tiny-vocab") -> Path:
    """A GGUF with a vocabulary, the hyperparameters llama.cpp reads before it (vocab_only loads need
    them) and one tiny tensor: enough for llama.cpp's and nanochat's tokenizers, not for a model."""
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_name(name)
    for add, value in ((w.add_context_length, 64), (w.add_embedding_length, 8), (w.add_block_count, 1),
                       (w.add_feed_forward_length, 16), (w.add_head_count, 1), (w.add_head_count_kv, 1)):
        add(value)
    w.add_layer_norm_rms_eps(1e-6)
    _add_meta(w, tokenizer)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def llama3_rope_factors(head_dim: int, theta: float, scaling: Mapping[str, Any]) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as rope_freqs.weight for llama3 rope."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _load_source(source: Any) -> tuple[dict[str, torch.Tensor], dict]:
    if isinstance(source, (str, os.PathLike)):
        from safetensors.torch import load_file

        folder = Path(source)
        cfg = json.loads((folder / "config.json").read_text())
        state: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            state.update(load_file(f))
        return state, cfg
    if isinstance(source, tuple):
        state, cfg = source
    else:  # a transformers model
        state, cfg = source.state_dict(), source.config
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    return dict(state), dict(cfg)


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict) from either transformers 4 (rope_theta/rope_scaling) or 5 (rope_parameters; Gemma 3's
    per layer type: the global layers')."""
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def _file_type(qtype: T) -> int:
    ft = gguf.LlamaFileType
    by_name = {"F32": ft.ALL_F32, "F16": ft.MOSTLY_F16, "BF16": ft.MOSTLY_BF16}
    if qtype.name in by_name:
        return int(by_name[qtype.name])
    for suffix in ("", "_M", "_S"):  # K-quants only exist as _S/_M mixes
        if hasattr(ft, f"MOSTLY_{qtype.name}{suffix}"):
            return int(getattr(ft, f"MOSTLY_{qtype.name}{suffix}"))
    return int(ft.GUESSED)


def _add_meta(w: gguf.GGUFWriter, meta: Mapping[str, Any]) -> None:
    for key, v in meta.items():
        if isinstance(v, MetaValue):
            w.add_key_value(key, v.value, v.vtype, v.sub_type)
        elif isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_array(key, list(v))


def write_gguf_from_hf(
    source: Any,
    out_path: str | os.PathLike,
    arch: str,
    qtype_for_linears: T = T.F32,
    *,
    embed_qtype: T | None = None,
    output_qtype: T | None = None,
    tensor_qtypes: Mapping[str, T] | None = None,
    quantizer: Quantizer | None = None,
    tokenizer: Mapping[str, Any] | str | None = "bytes",
    chat_template: str | None = None,
    name: str = "tiny-test-model",
    extra_metadata: Mapping[str, Any] | None = None,
    raw_tensors: Mapping[str, tuple[np.ndarray, T]] | None = None,
    skip_tensors: tuple[str, ...] = (),
    expert_qtype: T | None = None,
    gguf_arch: str | None = None,
) -> Path:
    """Write `source` as a GGUF file for `arch` ("llama" and "smollm3" permute q/k rows like llama.cpp;
    "phi3" gets its LongRoPE factor tensors and partial rotary dims as llama.cpp's Phi3MiniModel writes them;
    "gemma3" its norm names, 1 + w in every norm and its window / local RoPE / soft-capping keys as Gemma3Model
    writes them; a sliding_window in the config becomes {arch}.attention.sliding_window).

    qtype_for_linears: type of 2-D weights; embed_qtype / output_qtype override it for
    token_embd / output, tensor_qtypes per GGUF name. quantizer: packs 2-D tensors that have no
    explicit override (returns (uint8 [rows, bytes_per_row], qtype) or None for the default).
    tokenizer: "bytes" (a minimal byte-level gpt2 vocab), None (no tokenizer keys), or a dict of
    metadata (e.g. read_metadata(smollm2_path)) copied verbatim. extra_metadata: more keys
    (plain values or MetaValue). raw_tensors: GGUF name -> (raw uint8 blocks, type) written
    as is, replacing or adding tensors. skip_tensors: GGUF names to leave out.
    expert_qtype (MoE archs): type of the ffn_*_exps tensors (default qtype_for_linears).
    gguf_arch: the general.architecture (and metadata key prefix) written, when not `arch` (whose converter
    rules the file follows).
    """
    state, cfg = _load_source(source)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = cfg["vocab_size"]
    tied = bool(cfg.get("tie_word_embeddings", False))
    theta, scaling = _rope(cfg)

    w = gguf.GGUFWriter(os.fspath(out_path), gguf_arch or arch)
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(hidden)
    if cfg.get("intermediate_size"):
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(theta)
    w.add_file_type(_file_type(qtype_for_linears))
    if arch in PERMUTED_ARCHS:
        w.add_vocab_size(vocab)
        w.add_rope_dimension_count(head_dim)
    if cfg.get("sliding_window") and arch in ("llama", "phi3"):
        w.add_sliding_window(int(cfg["sliding_window"]))
    if arch == "gemma3":
        _add_gemma3_metadata(w, cfg)
    moe_like = arch in MOE_ARCHS or arch in HYBRID_ARCHS
    if moe_like:
        _add_moe_metadata(w, cfg, arch, head_dim)

    extra_tensors: dict[str, np.ndarray] = {}
    if arch == "phi3":
        _add_phi3_rope(w, cfg, head_dim, extra_tensors)
        scaling = None   # LongRoPE: written above
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            extra_tensors["rope_freqs.weight"] = llama3_rope_factors(head_dim, theta, scaling)
        else:
            w.add_rope_scaling_type(gguf.RopeScalingType(kind))
            w.add_rope_scaling_factor(float(scaling["factor"]))
            if "original_max_position_embeddings" in scaling:
                w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))

    if tokenizer == "bytes":
        eos = cfg.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        tokenizer = byte_tokenizer_metadata(vocab, cfg.get("bos_token_id"), eos)
    if tokenizer:
        _add_meta(w, tokenizer)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if extra_metadata:
        _add_meta(w, extra_metadata)

    overrides = dict(tensor_qtypes or {})
    if embed_qtype is not None:
        overrides.setdefault("token_embd.weight", embed_qtype)
    if output_qtype is not None:
        overrides.setdefault("output.weight", output_qtype)
    raw = dict(raw_tensors or {})

    if moe_like:
        for gname, x in convert_moe_state(state, cfg, arch).items():
            if gname in skip_tensors or gname in raw or (gname == "output.weight" and tied):
                continue
            qtype = overrides.get(gname) or _moe_qtype(gname, x, qtype_for_linears, expert_qtype)
            _add_tensor(w, gname, x, qtype, qtype_for_linears, None)
        state = {}

    for hf_name, tensor in state.items():
        gname = gguf_name(hf_name, arch)
        if gname is None or gname in skip_tensors or gname in raw:
            continue
        if gname == "output.weight" and tied:
            continue
        x = tensor.detach().to(torch.float32).numpy()
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            x = x + 1.0   # the converter stores Gemma3RMSNorm's 1 + w
        if arch in PERMUTED_ARCHS and gname.split(".")[-2] in ("attn_q", "attn_k"):
            x = permute_qk(x, heads if ".attn_q." in gname else kv_heads)
        _add_tensor(w, gname, x, overrides.get(gname), qtype_for_linears, quantizer)
    for gname, x in extra_tensors.items():
        w.add_tensor(gname, x)
    for gname, (blocks, qtype) in raw.items():
        w.add_tensor(gname, np.ascontiguousarray(blocks, dtype=np.uint8), raw_dtype=qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out_path)


def _add_gemma3_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    """What Gemma3Model.set_gguf_parameters adds (no layer pattern: llama.cpp assumes every 6th layer global)."""
    assert cfg.get("attn_logit_softcapping") is None
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if cfg.get("sliding_window_pattern") != 1:
        w.add_sliding_window(int(cfg["sliding_window"]))
    local = ((cfg.get("rope_parameters") or {}).get("sliding_attention") or {}).get("rope_theta") \
        or cfg.get("rope_local_base_freq")
    if local is not None:
        w.add_rope_freq_base_swa(float(local))


def _add_phi3_rope(w: gguf.GGUFWriter, cfg: dict, head_dim: int, extra: dict[str, np.ndarray]) -> None:
    """Phi-3's RoPE keys and LongRoPE tensors, as llama.cpp's Phi3MiniModel writes them."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(int(partial * head_dim))
    orig = params.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(int(orig))
    if params.get("long_factor"):
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
        extra["rope_factors_long.weight"] = np.asarray(params["long_factor"], dtype=np.float32)
        extra["rope_factors_short.weight"] = np.asarray(params["short_factor"], dtype=np.float32)


def _add_tensor(w: gguf.GGUFWriter, gname: str, x: np.ndarray, override: T | None,
                default: T, quantizer: Quantizer | None) -> None:
    if x.ndim == 1:  # norms and biases stay F32, as in llama.cpp
        w.add_tensor(gname, np.ascontiguousarray(x, dtype=np.float32))
        return
    if override is None and quantizer is not None:
        packed = quantizer(np.ascontiguousarray(x))
        if packed is not None:
            blocks, qtype = packed
            w.add_tensor(gname, np.ascontiguousarray(blocks, dtype=np.uint8), raw_dtype=qtype)
            return
    qtype = override if override is not None else default
    if qtype in _K_TYPES:  # gguf-py cannot quantize K-quants: use the test packer
        from kquant_pack import quantize_k

        w.add_tensor(gname, quantize_k(int(qtype), x), raw_dtype=qtype)
        return
    data = gguf.quants.quantize(np.ascontiguousarray(x), qtype)
    if qtype in (T.F32, T.F16):
        w.add_tensor(gname, data)
    else:
        w.add_tensor(gname, data, raw_dtype=qtype)


_K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


# ---------------------------------------------------------------- MoE / hybrid archs (llama.cpp's transforms)


def _add_moe_metadata(w: gguf.GGUFWriter, cfg: dict, arch: str, head_dim: int) -> None:
    if arch in MOE_ARCHS:
        w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        if arch == "gpt-oss":   # GptOssModel: the window (every second layer, llama.cpp's rule), YaRN's betas
            w.add_sliding_window(int(cfg["sliding_window"]))
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            w.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
            w.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        if arch == "qwen3moe" and cfg.get("norm_topk_prob") is not None:
            # llama.cpp's qwen3moe graph always renormalises; the key keeps tiny test models exact.
            w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    if arch in HYBRID_ARCHS:
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(_attention_interval(cfg))
        params = cfg.get("rope_parameters") or {}
        partial = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.25
        w.add_rope_dimension_count(int(head_dim * partial))


def _attention_interval(cfg: dict) -> int:
    types = cfg.get("layer_types")
    if not types:
        return int(cfg.get("full_attention_interval") or 4)
    interval = types.index("full_attention") + 1
    expect = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types))]
    if list(types) != expect:
        raise ValueError(f"layer_types {types} do not follow a full_attention_interval")
    return interval


def _moe_qtype(gname: str, x: np.ndarray, linears: T, experts: T | None) -> T:
    """llama.cpp-like choices: experts as asked, routers / conv / vectors F32, others `linears`."""
    base = gname.split(".")[-2] if gname.startswith("blk.") else gname.split(".")[0]
    qtype = (experts or linears) if base.endswith("_exps") else linears
    if x.ndim == 1 or base in _KEEP_F32 or gname.endswith(".bias"):   # gpt-oss's expert biases are 2-D
        return T.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if x.shape[-1] % block == 0 else T.F32


def _tile_heads(x: np.ndarray, axis: int, nk: int, r: int, head: int) -> np.ndarray:
    """qwen35*: value heads along `axis` from grouped order (kh, i) to tiled order (i, kh)."""
    shape = x.shape
    y = x.reshape(shape[:axis] + (nk, r, head) + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(y, axis, axis + 1)).reshape(shape)


def convert_moe_state(state: Mapping[str, torch.Tensor], cfg: dict, arch: str) -> dict[str, np.ndarray]:
    """HF tensors -> GGUF tensors (float32, torch order), transformed like llama.cpp's converter."""
    hybrid = arch in HYBRID_ARCHS
    table = _HYBRID_BLOCK if hybrid else _GPT_OSS_BLOCK if arch == "gpt-oss" else _MOE_BLOCK
    nk, nv = cfg.get("linear_num_key_heads") or 0, cfg.get("linear_num_value_heads") or 0
    dk, dv = cfg.get("linear_key_head_dim") or 0, cfg.get("linear_value_head_dim") or 0
    tile = arch in ("qwen35moe", "qwen35") and nk and nv != nk
    r = nv // nk if nk else 1
    out: dict[str, np.ndarray] = {}
    per_expert: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for hf_name, tensor in state.items():
        name = hf_name.replace("model.language_model.", "model.", 1)
        if name.startswith(("model.visual.", "mtp.")):
            continue
        x = tensor.detach().to(torch.float32).numpy()
        if hybrid and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + 1.0   # GGUF stores the zero-centred norms as 1 + w
        module, _, kind = name.rpartition(".")
        if module in _GLOBAL:
            out[f"{_GLOBAL[module]}.{kind}"] = x
            continue
        parts = name.split(".", 3)
        if len(parts) < 4 or parts[:2] != ["model", "layers"]:
            continue
        blk, rest = f"blk.{parts[2]}", parts[3]
        if arch == "gpt-oss" and rest.startswith("mlp.experts."):
            # [E, in, out] with gate|up interleaved along out (even gate, odd up); biases [E, out]
            if rest == "mlp.experts.gate_up_proj":
                x = np.ascontiguousarray(x.transpose(0, 2, 1))
                out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = x[:, 0::2], x[:, 1::2]
            elif rest == "mlp.experts.down_proj":
                out[f"{blk}.ffn_down_exps.weight"] = np.ascontiguousarray(x.transpose(0, 2, 1))
            elif rest == "mlp.experts.gate_up_proj_bias":
                out[f"{blk}.ffn_gate_exps.bias"], out[f"{blk}.ffn_up_exps.bias"] = x[:, 0::2], x[:, 1::2]
            elif rest == "mlp.experts.down_proj_bias":
                out[f"{blk}.ffn_down_exps.bias"] = x
            continue
        if arch == "gpt-oss" and rest == "self_attn.sinks":
            out[f"{blk}.attn_sinks.weight"] = x
            continue
        if rest == "mlp.experts.gate_up_proj":          # fused [E, 2I, H]: gate = first I rows
            half = x.shape[1] // 2
            out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = x[:, :half], x[:, half:]
            continue
        if rest == "mlp.experts.down_proj":
            out[f"{blk}.ffn_down_exps.weight"] = x
            continue
        if rest.startswith("mlp.experts."):             # per-expert checkpoints: stack them
            _, _, e, proj, _ = rest.split(".")
            per_expert.setdefault((blk, proj.split("_")[0]), {})[int(e)] = x
            continue
        if hybrid and rest.startswith("linear_attn."):
            if tile:
                x = _tile_linear_attn(rest, x, nk, r, dk, dv)
            if rest == "linear_attn.A_log":
                out[f"{blk}.ssm_a"] = -np.exp(x)
                continue
            if rest == "linear_attn.dt_bias":
                out[f"{blk}.ssm_dt.bias"] = x
                continue
            if rest == "linear_attn.conv1d.weight":
                x = x.reshape(x.shape[0], -1)           # [C, 1, K] -> [C, K]
            if rest == "linear_attn.in_proj_qkvz.weight":
                q, k, v, z = np.split(x.reshape(nk, -1, x.shape[-1]),
                                      np.cumsum([dk, dk, r * dv])[:3], axis=1)
                flat = lambda a: a.reshape(-1, x.shape[-1])  # noqa: E731
                out[f"{blk}.attn_qkv.weight"] = np.concatenate([flat(q), flat(k), flat(v)])
                out[f"{blk}.attn_gate.weight"] = flat(z)
                continue
        sub, _, kind = rest.rpartition(".")
        if sub in table:
            out[f"{blk}.{table[sub]}.{kind}"] = x
    for (blk, proj), mats in per_expert.items():
        out[f"{blk}.ffn_{proj}_exps.weight"] = np.stack([mats[e] for e in sorted(mats)])
    return out


def _tile_linear_attn(rest: str, x: np.ndarray, nk: int, r: int, dk: int, dv: int) -> np.ndarray:
    if rest in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        qk = 2 * nk * dk
        return np.concatenate([x[:qk], _tile_heads(x[qk:], 0, nk, r, dv)])
    if rest == "linear_attn.in_proj_z.weight":
        return _tile_heads(x, 0, nk, r, dv)
    if rest in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"):
        return _tile_heads(x, 0, nk, r, 1)
    if rest in ("linear_attn.A_log", "linear_attn.dt_bias"):
        return _tile_heads(x.reshape(-1, 1), 0, nk, r, 1).reshape(-1)
    if rest == "linear_attn.out_proj.weight":
        return _tile_heads(x, 1, nk, r, dv)
    return x
