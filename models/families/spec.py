"""What sets one model family apart, in one declarative description read by both weight sources (config.json
and GGUF metadata / tensor names), the loader and the weight maps. Anything a description leaves at its default
is Llama's. Each family has its own file under models/families/; models/families/registry.py lists them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

# llama.cpp's tensor names (GGUF base name -> HF module path; ".weight" / ".bias" is carried over).
GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
DENSE_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# MoE blocks: routers and the shared expert (routed experts, ffn_*_exps, are split per expert by the GGUF source).
MOE_BLOCK_TENSORS = {
    **DENSE_BLOCK_TENSORS,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


@dataclass(frozen=True)
class FamilySpec:
    """One family: its names on both sources, the model class that builds it, its options and tensor layout."""

    name: str                 # ModelConfig.arch: the config.json model_type
    model: type               # the nn.Module built from (ModelConfig, WeightLoader, block_size, max_positions)
    hf_types: tuple[str, ...] = ()    # other config.json model_types read as this family (a wrapper's text model)
    gguf_arch: str | None = None      # GGUF general.architecture (None: llama.cpp writes it as another family)
    moe: bool = False                 # routed experts and routers (config: num_experts; GGUF: ffn_*_exps)
    hybrid: bool = False              # Gated DeltaNet layers beside gated attention (models/families/qwen3_next.py)
    encoder: bool = False             # reads its input both ways, makes embeddings only (models/families/bert.py)
    absolute_positions: bool = False  # a learned position table instead of RoPE (BERT)

    # --- options, on both sources
    attention_bias: bool = False      # bias on q/k/v (Qwen2)
    qk_norm: bool = False             # per-head RMSNorm on q and k before RoPE (Qwen3)
    # config.json's sliding_window applies to: "all" layers (Mistral, Phi-3), the layers config.json's layer_types
    # call "sliding_attention" (SmolLM3, Qwen2: transformers' use_sliding_window), or "none". GGUF files say
    # which layers by attention.sliding_window and swa_pattern below.
    sliding_window: str = "layer_types"
    # Every n-th layer without RoPE (SmolLM3): transformers' default where config.json lists no no_rope_layers,
    # and llama.cpp's fixed rule.
    no_rope_interval: int = 0
    # Gemma 3: norms on the attention and MLP outputs as well (four a layer); the embeddings times
    # sqrt(hidden_size); the windowed layers' own RoPE base, unscaled; final_logit_softcapping.
    sandwich_norms: bool = False
    embed_scale: bool = False
    local_rope: bool = False
    logit_softcapping: bool = False
    activations: tuple[str, ...] = ("silu",)   # config.json hidden_act values accepted; GGUF files: the first
    # MoE routing weights renormalised over the chosen experts: the default where the file does not say, and
    # whether that default is the rule whatever the file says (Qwen3.5 MoE).
    norm_topk_prob: bool = True
    norm_topk_fixed: bool = False
    # gpt-oss: attention sinks, top-k before the router's softmax, the experts' clamped SwiGLU (ModelConfig's
    # fields of the same names).
    attention_sinks: bool = False
    moe_router: str = "softmax_topk"
    expert_act: str = "silu"

    # --- config.json only
    norm_zero_centred: bool = False   # RMSNorm weights w scale by 1 + w (GGUF converters store 1 + w)
    query_pre_attn_scalar: bool = False   # attention scale query_pre_attn_scalar ** -0.5 (Gemma 3)
    # Values transformers assumes where config.json has none (Gemma 3's text_config lists few), and the RoPE
    # base (which may come from rope_parameters instead).
    defaults: Mapping[str, Any] = field(default_factory=dict)
    rope_theta: float = 10000.0
    # Checkpoint tensors holding several of Llama's, in row order (module names inside a layer): Phi-3's.
    hf_fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Checkpoint tensors stored in another layout than the one the model reads (gpt-oss's interleaved, transposed
    # or MXFP4 experts): (stored names, the ModelConfig) -> {our name: (stored names read, function of them)}.
    hf_views: Callable[[Collection[str], Any], dict[str, tuple[tuple[str, ...], Callable]]] | None = None
    # Checkpoint tensor names laid out otherwise than Llama's: stored name -> ours, or None for one never read.
    hf_name: Callable[[str], str | None] | None = None
    # config.json keys named otherwise than transformers' Llama config: theirs -> ours (Nomic BERT's n_embd, ...).
    hf_keys: Mapping[str, str] = field(default_factory=dict)
    # config.json keys whose every other value is a variant this family's code does not implement: key -> the value
    # it does (an absent key is taken as that value).
    hf_requires: Mapping[str, Any] = field(default_factory=dict)

    # --- GGUF only
    block_tensors: Mapping[str, str] = field(default_factory=lambda: DENSE_BLOCK_TENSORS)
    global_tensors: Mapping[str, str] = field(default_factory=lambda: GLOBAL_TENSORS)
    permute_qk: bool = False          # the converter permuted attn_q / attn_k rows (ggml's interleaved RoPE)
    # Block tensors holding several HF ones in row order (Phi-3's attn_qkv, and ffn_up = gate|up).
    split_tensors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    tiled_v_heads: bool = False       # value heads stored in tiled order (Qwen3.5)
    partial_rope: bool = False        # rope.dimension_count may be below the head size
    # llama.cpp's layer pattern when the file has no attention.sliding_window_pattern: every n-th layer global,
    # the others windowed (0: every layer windowed).
    swa_pattern: int = 0
    # llama.cpp's attention scale from (layers, hidden, heads, head_dim); None: head_dim ** -0.5.
    attention_scale: Callable[[int, int, int, int], float] | None = None
