"""The weight-source interface: what every loader (HF folder, GGUF file) yields, and all its callers may ask."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from nanochat.kernels.qweight import QuantWeight
from nanochat.models.config import ModelConfig

if TYPE_CHECKING:
    from nanochat.kernels.moe_cpu import StackedWeight
    from nanochat.models.families.spec import FamilySpec
    from nanochat.models.text.tokenizer import Tokenizer

Weight = torch.Tensor | QuantWeight


class WeightSource(Protocol):
    """Tensors are named as in Hugging Face checkpoints (torch order, [out, in]):
    model.embed_tokens.weight, model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias for qwen2),
    model.layers.{i}.self_attn.{q,k}_norm.weight, model.layers.{i}.mlp.{gate,up,down}_proj.weight,
    model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight
    (absent when tied). Dense tensors are torch tensors; quantized ones are QuantWeight."""

    kind: str               # "gguf" | "hf"
    path: str
    config: ModelConfig
    family: FamilySpec      # models/families/
    file_size: int          # bytes of the weight files

    def tensor_names(self) -> list[str]: ...

    def inventory(self) -> dict[str, dict]:
        """Every tensor name -> {"shape": [...] (torch order), "dtype": a torch dtype name or a GGML type
        name (dtype_name)}, plus where the source knows it: "file" (a safetensors shard), "gguf_name" and
        "transform" (what the GGUF source undoes). No tensor data is copied."""

    def get(self, name: str) -> Weight: ...

    def peek(self, name: str) -> tuple[int | torch.dtype, tuple[int, ...]]:
        """The type (a GGML type for blocks, else a torch dtype) and shape `get(name)` would have, without a copy
        of the data where the source can tell them from its header."""

    def expert_stack(self, prefix: str, proj: str) -> StackedWeight | None:
        """Projection `proj` of every routed expert under `prefix` as one [E, out, in] tensor of the source's
        own (no copy), or None where it has none."""

    def release(self, name: str) -> None:
        """Tensor `name` was copied elsewhere: the source may drop the memory it holds for it."""

    def describe(self) -> dict:
        """kind, name, arch and what identifies the weights (a weight map's `source` entry)."""

    def tokenizer(self, cache: bool = False) -> Tokenizer:
        """The model's tokenizer; cache: keep what is slow to build on disk for the next load."""

    def tokenizer_json(self) -> str | None:
        """A tokenizer.json string when the source carries one, else None."""

    def chat_template(self) -> str | None: ...

    def chat_template_origin(self) -> str:
        """The file the chat template comes from (named in template errors)."""

    def eos_ids(self) -> tuple[int, ...]:
        """Token ids that end a reply, as the model's files state them."""

    def stated_sampling(self) -> dict:
        """The sampling settings the files recommend (SamplingParams names, values not checked)."""

    def stated_pooling(self) -> str | None:
        """How the files say to pool the final hidden states into one embedding ("mean", "cls", "last", or "none" /
        "rank" for what has no such vector), None when they do not say (a chat model)."""


def weight_type(t: Weight) -> int | torch.dtype:
    """A QuantWeight's GGML type, a tensor's torch dtype (what WeightSource.peek answers)."""
    return t.ggml_type if isinstance(t, QuantWeight) else t.dtype


def dtype_name(t: Weight) -> str:
    """"float32" for a torch tensor, the GGML type name ("Q4_1") for a QuantWeight."""
    if isinstance(t, QuantWeight):
        return t.type_name
    return str(t.dtype).removeprefix("torch.")
