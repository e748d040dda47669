"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3 attention (q/k norm, NeoX RoPE) with sparse MoE MLPs.

Layers listed in mlp_only_layers, or off the decoder_sparse_step grid, keep a dense MLP. The same decoder
serves gpt-oss (models/families/gpt_oss.py): its differences are options of the attention (windows, sinks,
biases) and of the MoE block (router, expert activation, biases).
"""

from __future__ import annotations

import torch
from torch import nn

from nanochat.models.layers.attention import AttentionBackend, AttnMetadata
from nanochat.models.config import ModelConfig
from nanochat.models.families.dense import DenseAttention
from nanochat.models.families.spec import MOE_BLOCK_TENSORS, FamilySpec
from nanochat.models.layers.fused_forward import FusedForward
from nanochat.models.layers.common import GatedMLP, RMSNorm, RotaryEmbedding, WeightLoader, embedding_and_head, head_logits
from nanochat.models.layers.moe import SparseMoeBlock


def load_mlp(cfg: ModelConfig, w: WeightLoader, i: int) -> nn.Module:
    prefix = f"model.layers.{i}.mlp"
    return SparseMoeBlock(cfg, w, prefix) if cfg.is_moe_layer(i) else GatedMLP(w, prefix)


class MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, i: int, backend, rotary):
        super().__init__()
        p = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(w.dense(f"{p}.input_layernorm.weight"), cfg.rms_norm_eps)
        self.self_attn = DenseAttention(cfg, w, f"{p}.self_attn", backend, rotary, cfg.layer_windows[i])
        self.post_attention_layernorm = RMSNorm(w.dense(f"{p}.post_attention_layernorm.weight"), cfg.rms_norm_eps)
        self.mlp = load_mlp(cfg, w, i)

    # the fused step's view of the layer (models/layers/fused_forward.py): no output norms
    attn_out_norm = mlp_out_norm = None

    @property
    def mlp_norm(self) -> RMSNorm:
        return self.post_attention_layernorm

    def forward(self, positions, x, meta):
        h = x + self.self_attn(positions, self.input_layernorm(x), meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class MoeForCausalLM(nn.Module):
    is_hybrid = False

    def __init__(self, cfg: ModelConfig, w: WeightLoader, block_size: int, max_positions: int):
        super().__init__()
        self.config, self.tp = cfg, w.tp
        self.backend = AttentionBackend(w.device, block_size)
        self.rotary = RotaryEmbedding(cfg, cfg.head_dim, max_positions, w.device)
        self.embed_tokens, self.lm_head = embedding_and_head(cfg, w)
        self.layers = nn.ModuleList(MoeDecoderLayer(cfg, w, i, self.backend, self.rotary)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(w.dense("model.norm.weight"), cfg.rms_norm_eps)
        self.fused = FusedForward(self, w.kernels)

    def attention_layers(self) -> list[DenseAttention]:
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.fused.usable():
            return self.fused.run(x, positions, meta)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return head_logits(self.lm_head, hidden)


# transformers' default: no renormalisation of the routing weights for Qwen3-MoE (GGUF files: llama.cpp's default,
# on, unless the file says otherwise).
QWEN3_MOE = FamilySpec("qwen3_moe", MoeForCausalLM, gguf_arch="qwen3moe", moe=True, qk_norm=True,
                       sliding_window="none", norm_topk_prob=False, block_tensors=MOE_BLOCK_TENSORS)
