"""Qwen3: Llama with a per-head RMSNorm on q and k before RoPE."""

from nanochat.models.families.dense import DenseForCausalLM
from nanochat.models.families.spec import FamilySpec

QWEN3 = FamilySpec("qwen3", DenseForCausalLM, gguf_arch="qwen3", qk_norm=True)
