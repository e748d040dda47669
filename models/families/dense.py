"""Dense decoder-only models (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Phi-3, Gemma 3): one implementation, options
for the differences (each family's FamilySpec, models/families/<family>.py, read into ModelConfig).

Qwen2 = Llama + bias on q/k/v; Qwen3 = Llama + per-head RMSNorm on q and k before RoPE; per layer, an
attention window (Mistral, Phi-3, Gemma 3's local layers) with its own RoPE table where the family has one
(Gemma 3) and RoPE on or off (SmolLM3's NoPE layers). Gemma 3 adds RMSNorms on the attention and MLP outputs
before their residual adds, GeGLU, scaled embeddings, its own attention scale and soft-capped logits. q/k/v and
gate/up are fused into one matmul each (fewer kernel launches per layer).
"""

from __future__ import annotations

import torch
from torch import nn

from dataclasses import replace

from nanochat.kernels.cpu_decoder import activation
from nanochat.models.layers.attention import AttentionBackend, AttnMetadata
from nanochat.models.config import ModelConfig
from nanochat.models.layers.fused_forward import FusedForward
from nanochat.models.layers.common import GatedMLP, Linear, RMSNorm, RotaryEmbedding, WeightLoader, embedding_and_head, \
    head_logits, norm_weight
from nanochat.models.parallel.sharding import head_shard


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
        self.scale = cfg.attention_scale or self.head_dim ** -0.5
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
        # An output bias (gpt-oss, Llama's attention_bias) is added before the ranks' partial sums are reduced:
        # rank 0's alone carries it.
        o_bias = f"{prefix}.o_proj.bias"
        o_bias = w.dense(o_bias) if o_bias in w.names and w.tp.rank == 0 else None
        self.o_proj = Linear(w.linear_weight([o_name], cols=cols), o_bias, reduce=w.tp if w.tp.on else None)
        # gpt-oss's per-head sink logits (fp32, this rank's query heads)
        self.sinks: torch.Tensor | None = None
        if cfg.attention_sinks:
            sinks = w.dense(f"{prefix}.sinks.weight", torch.float32)
            self.sinks = sinks[shard.q_start:shard.q_start + self.num_heads].contiguous()
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(norm_weight(cfg, w, f"{prefix}.q_norm.weight"), cfg.rms_norm_eps)
            self.k_norm = RMSNorm(norm_weight(cfg, w, f"{prefix}.k_norm.weight"), cfg.rms_norm_eps)
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
        o = self.backend(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.window, sinks=self.sinks)
        return self.o_proj(o.reshape(n, self.q_size))


class DenseDecoderLayer(nn.Module):
    """x += attn_out_norm(attn(input_layernorm(x))); x += mlp_out_norm(mlp(mlp_norm(x))), the output norms only
    with cfg.sandwich_norms. The modules keep the checkpoint's names (the weight maps read them): the pre-MLP
    norm is Llama's post_attention_layernorm, Gemma 3's pre_feedforward_layernorm (its post_attention_layernorm
    is the attention output's)."""

    def __init__(self, cfg: ModelConfig, w: WeightLoader, i: int, backend, rotary):
        super().__init__()
        p = f"model.layers.{i}"

        def norm(name):
            return RMSNorm(norm_weight(cfg, w, f"{p}.{name}.weight"), cfg.rms_norm_eps)

        self.sandwich = cfg.sandwich_norms
        self.input_layernorm = norm("input_layernorm")
        self.self_attn = DenseAttention(cfg, w, f"{p}.self_attn", backend, rotary, cfg.layer_windows[i])
        self.post_attention_layernorm = norm("post_attention_layernorm")
        if self.sandwich:
            self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
            self.post_feedforward_layernorm = norm("post_feedforward_layernorm")
        self.mlp = GatedMLP(w, f"{p}.mlp", act=cfg.hidden_act)

    @property
    def attn_out_norm(self) -> RMSNorm | None:
        return self.post_attention_layernorm if self.sandwich else None

    @property
    def mlp_norm(self) -> RMSNorm:
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    @property
    def mlp_out_norm(self) -> RMSNorm | None:
        return self.post_feedforward_layernorm if self.sandwich else None

    def forward(self, positions, x, meta):
        a = self.self_attn(positions, self.input_layernorm(x), meta)
        h = x + (self.post_attention_layernorm(a) if self.sandwich else a)
        m = self.mlp(self.mlp_norm(h))
        return h + (self.post_feedforward_layernorm(m) if self.sandwich else m)


class DenseForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, block_size: int, max_positions: int):
        super().__init__()
        self.config, self.tp = cfg, w.tp
        self.backend = AttentionBackend(w.device, block_size)
        self.rotary = RotaryEmbedding(cfg, cfg.rotary_dim, max_positions, w.device)
        # The windowed layers' own RoPE (Gemma 3: another base, unscaled).
        self.local_rotary = None if not cfg.local_rope_theta else RotaryEmbedding(
            replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None), cfg.rotary_dim, max_positions, w.device)
        self.embed_tokens, self.lm_head = embedding_and_head(cfg, w)
        self.embed_scale = cfg.embed_scale
        self.layers = nn.ModuleList(DenseDecoderLayer(cfg, w, i, self.backend, self.layer_rotary(cfg, i))
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(norm_weight(cfg, w, "model.norm.weight"), cfg.rms_norm_eps)
        self.softcap = cfg.final_logit_softcapping
        self.fused = FusedForward(self, w.kernels)

    def layer_rotary(self, cfg: ModelConfig, i: int) -> RotaryEmbedding | None:
        if not cfg.layer_rope[i]:
            return None
        return self.local_rotary if self.local_rotary is not None and cfg.layer_windows[i] else self.rotary

    def attention_layers(self) -> list[DenseAttention]:
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:   # as transformers: the factor rounded to the activations' dtype
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if self.fused.usable():
            return self.fused.run(x, positions, meta)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = head_logits(self.lm_head, hidden)
        if not self.softcap or logits is None:
            return logits
        # cap * tanh(logits / cap), each value on its own (the library's tanh: a row's logits never depend on
        # the rows beside it)
        return activation("tanh", logits / self.softcap) * self.softcap
