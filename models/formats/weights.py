"""The weight-source interface: what every loader (HF folder, GGUF file) yields."""

from __future__ import annotations

from typing import Protocol

import torch

from nanochat.kernels.qweight import QuantWeight
from nanochat.models.config import ModelConfig

Weight = torch.Tensor | QuantWeight


class WeightSource(Protocol):
    """Tensors are named as in Hugging Face checkpoints (torch order, [out, in]):
    model.embed_tokens.weight, model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias for qwen2),
    model.layers.{i}.self_attn.{q,k}_norm.weight, model.layers.{i}.mlp.{gate,up,down}_proj.weight,
    model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight
    (absent when tied). Dense tensors are torch tensors; quantized ones are QuantWeight."""

    path: str
    config: ModelConfig

    def tensor_names(self) -> list[str]: ...

    def get(self, name: str) -> Weight: ...

    def tokenizer_json(self) -> str | None:
        """A tokenizer.json string when the source carries one, else None."""

    def chat_template(self) -> str | None: ...
