"""Phi-3 / Phi-4-mini: fused q|k|v and gate|up tensors (in both checkpoint formats), partial RoPE, LongRoPE and
a sliding window on every layer."""

from nanochat.models.families.dense import DenseForCausalLM
from nanochat.models.families.spec import FamilySpec

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")

PHI3 = FamilySpec("phi3", DenseForCausalLM, gguf_arch="phi3", sliding_window="all",
                  hf_fused={"self_attn.qkv_proj": QKV, "mlp.gate_up_proj": GATE_UP},
                  split_tensors={"attn_qkv": QKV, "ffn_up": GATE_UP}, partial_rope=True)
