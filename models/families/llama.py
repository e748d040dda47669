"""Llama, and Mistral: Llama with a sliding window on every layer (llama.cpp writes Mistral files as llama,
the window in attention.sliding_window)."""

from nanochat.models.families.dense import DenseForCausalLM
from nanochat.models.families.spec import FamilySpec

LLAMA = FamilySpec("llama", DenseForCausalLM, gguf_arch="llama", permute_qk=True, sliding_window="none")
MISTRAL = FamilySpec("mistral", DenseForCausalLM, sliding_window="all")
