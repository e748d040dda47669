"""SmolLM3: Llama with every fourth layer left without RoPE (NoPE)."""

from nanochat.models.families.dense import DenseForCausalLM
from nanochat.models.families.spec import FamilySpec

SMOLLM3 = FamilySpec("smollm3", DenseForCausalLM, gguf_arch="smollm3", permute_qk=True, no_rope_interval=4)
