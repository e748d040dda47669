"""Qwen2 / Qwen2.5: Llama with a bias on q, k and v."""

from nanochat.models.families.dense import DenseForCausalLM
from nanochat.models.families.spec import FamilySpec

QWEN2 = FamilySpec("qwen2", DenseForCausalLM, gguf_arch="qwen2", attention_bias=True)
