"""Dense decoder-only models (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Phi-3): one implementation, flags for
the differences (models/config.py FAMILIES).

Qwen2 = Llama + bias on q/k/v; Qwen3 = Llama + per-head RMSNorm on q and k before RoPE; per layer, an
attention window (Mistral, Phi-3) and RoPE on or off (SmolLM3's NoPE layers). q/k/v and gate/up are fused
into one matmul each (fewer kernel launches per layer).
"""

from __future__ import annotations

import torch
from torch import nn

from nanochat.models.attention import AttentionBackend, AttnMetadata
from nanochat.models.config import ModelConfig
from nanochat.models.fused_forward import FusedForward
from nanochat.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, WeightLoader, embedding_and_head, \
    head_logits
from nanochat.models.parallel import head_shard


class DenseAttention(nn.Module):
    """Tensor parallel: this rank's KV heads with their query heads (models/parallel.head_shard)."""

    def __init__(self, cfg: ModelConfig, w: WeightLoader, prefix: str, backend: AttentionBackend,
                 rotary: RotaryEmbedding | None, window: int = 0):
        super().__init__()
        hd = self.head_dim = cfg.head_dim
        o_name = f"{prefix}.o_proj.weight"
        shard = head_shard(w.tp, cfg.num_attention_heads, cfg.num_key_value_heads, hd, w.align([o_name]), prefix)
        self.num_heads, self.num_kv_heads = shard.q_count, shard.kv_count
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        names = [f"{prefix}.{p}_proj.weight" for p in "qkv"]
        rows = cols = None
        if w.tp.on:
            kv = [(shard.kv_start * hd, self.kv_size)]
            rows, cols = [[(shard.q_start * hd, self.q_size)], kv, kv], (shard.q_start * hd, self.q_size)
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([w.dense(f"{prefix}.{p}_proj.bias", rows=r)
                              for p, r in zip("qkv", rows or [None] * 3)])
        self.qkv_proj = Linear(w.linear_weight(names, rows), bias)
        self.o_proj = Linear(w.linear_weight([o_name], cols=cols), reduce=w.tp if w.tp.on else None)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(w.dense(f"{prefix}.q_norm.weight"), cfg.rms_norm_eps)
            self.k_norm = RMSNorm(w.dense(f"{prefix}.k_norm.weight"), cfg.rms_norm_eps)
        self.backend, self.rotary, self.window = backend, rotary, window   # rotary None: no RoPE (NoPE layer)
        self.k_cache = self.v_cache = None   # assigned by the model runner

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(n, self.num_kv_heads, self.head_dim)
        if self.rotary is None:
            q = qkv[:, :self.q_size].view(n, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:qk_size].view(n, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
        elif self.q_norm is None:
            # q and k are adjacent in the fused output: rotate both heads' sets in one pass.
            qk = self.rotary.rotate(positions, qkv[:, :qk_size].view(n, self.num_heads + self.num_kv_heads,
                                                                   self.head_dim))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = qkv[:, :self.q_size].view(n, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:qk_size].view(n, self.num_kv_heads, self.head_dim)
            q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k))
        o = self.backend(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.window)
        return self.o_proj(o.reshape(n, self.q_size))


class DenseDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, i: int, backend, rotary):
        super().__init__()
        p = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(w.dense(f"{p}.input_layernorm.weight"), cfg.rms_norm_eps)
        self.self_attn = DenseAttention(cfg, w, f"{p}.self_attn", backend, rotary if cfg.layer_rope[i] else None,
                                        cfg.layer_windows[i])
        self.post_attention_layernorm = RMSNorm(w.dense(f"{p}.post_attention_layernorm.weight"), cfg.rms_norm_eps)
        self.mlp = GatedMLP(w, f"{p}.mlp")

    def forward(self, positions, x, meta):
        h = x + self.self_attn(positions, self.input_layernorm(x), meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class DenseForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, block_size: int, max_positions: int):
        super().__init__()
        self.config, self.tp = cfg, w.tp
        self.backend = AttentionBackend(w.device, block_size)
        self.rotary = RotaryEmbedding(cfg, cfg.rotary_dim, max_positions, w.device)
        self.embed_tokens, self.lm_head = embedding_and_head(cfg, w)
        self.layers = nn.ModuleList(DenseDecoderLayer(cfg, w, i, self.backend, self.rotary)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(w.dense("model.norm.weight"), cfg.rms_norm_eps)
        self.fused = FusedForward(self)

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
