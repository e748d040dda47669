"""Gemma 3 (text): RMSNorms scaling by 1 + w and four of them a layer, GeGLU, scaled embeddings, its own
attention scale, windowed layers with their own RoPE base, soft-capped logits."""

from nanochat.models.families.dense import DenseForCausalLM
from nanochat.models.families.spec import DENSE_BLOCK_TENSORS, FamilySpec

# ffn_norm is its pre_feedforward_layernorm; post_attention_norm the attention output's (HF post_attention_layernorm).
GEMMA3_BLOCK_TENSORS = {
    **DENSE_BLOCK_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gemma3_attention_scale(layers: int, hidden: int, heads: int, head_dim: int) -> float:
    """llama.cpp's rule (after gemma_pytorch): Gemma 3 27B (62 layers) scales by (hidden / heads) ** -0.5, the
    others by head_dim ** -0.5, as their query_pre_attn_scalar says in config.json."""
    return (hidden / heads if layers == 62 else head_dim) ** -0.5


# config.json defaults: Gemma3TextConfig's; sliding_window_pattern is transformers' rule when layer_types is absent.
# GGUF: without attention.sliding_window_pattern, llama.cpp makes every sixth layer global.
GEMMA3 = FamilySpec(
    "gemma3_text", DenseForCausalLM, hf_types=("gemma3",), gguf_arch="gemma3", qk_norm=True,
    norm_zero_centred=True, sandwich_norms=True, embed_scale=True, local_rope=True, query_pre_attn_scalar=True,
    logit_softcapping=True, activations=("gelu_pytorch_tanh", "gelu_tanh"),
    defaults={"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
              "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
              "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True,
              "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6},
    rope_theta=1_000_000.0, block_tensors=GEMMA3_BLOCK_TENSORS, swa_pattern=6, attention_scale=gemma3_attention_scale)
