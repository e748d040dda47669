"""Hybrid Qwen3-Next / Qwen3.5 / Qwen3.6 models: Gated DeltaNet layers + gated full attention.

layer_types[i] picks the token mixer: "linear_attention" (Gated DeltaNet, state per sequence) or
"full_attention" (gated attention over the paged KV cache). Every layer's MLP is a sparse MoE
(qwen3_next, qwen3_5_moe) or a dense gated MLP (qwen3_5 dense, mlp_only_layers).

- Norms: HF checkpoints store zero-centred RMSNorm weights (scale = 1 + w) for the layer, final and
  q/k norms (cfg.norm_zero_centred; GGUF converters already added the 1). The GDN output norm is a
  plain-weight gated RMSNorm: rmsnorm(o) * w * silu(z) per value head.
- Gated attention: q_proj rows hold [query | gate] per head; q/k norm, partial NeoX RoPE on the first
  head_dim * partial_rotary_factor dims, then attn * sigmoid(gate) before o_proj. (Qwen3.5's mRoPE
  reduces to this for text: its three position ids are equal.)
- Gated DeltaNet: one fused input projection -> [q k v] (causal depthwise conv + silu), z, b, a;
  beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the delta rule itself lives in
  nanochat.kernels.gated_delta (torch) / triton_gated_delta (GPU). Qwen3-Next's fused in_proj_qkvz /
  in_proj_ba are laid out per key head ([q k v_group z_group] for each); Qwen3.5 has separate
  in_proj_qkv / in_proj_z / in_proj_b / in_proj_a.

State: the model owns a pool of state slots (allocate_state); a step's AttnMetadata says which slot each
sequence uses (state_slots) and whether the chunk starts the sequence (state_fresh). Each GDN layer reads
the slot's conv and recurrent state at the start of the chunk and writes them back at its end, so a
prompt may arrive in several chunks across steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanochat.kernels import gated_delta as gd
from nanochat.kernels.cpu_decoder import activation
from nanochat.models.layers.attention import AttentionBackend, AttnMetadata
from nanochat.models.config import ModelConfig
from nanochat.models.layers.common import Linear, RMSNorm, RotaryEmbedding, WeightLoader, embedding_and_head, head_logits, \
    norm_weight
from nanochat.models.parallel.sharding import head_shard, split
from nanochat.models.families.qwen3_moe import load_mlp
from nanochat.models.families.spec import MOE_BLOCK_TENSORS, FamilySpec


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@dataclass
class StateStep:
    """What the GDN layers of one forward need: ragged layout and the state slot of each sequence."""

    cu_seqlens: torch.Tensor     # [B+1] int32
    slots: torch.Tensor          # [B] int64
    fresh: torch.Tensor          # [B] bool
    max_q_len: int

    @classmethod
    def from_meta(cls, meta: AttnMetadata) -> "StateStep":
        if meta.state_slots is None:
            raise ValueError("hybrid model: AttnMetadata.state_slots is required (one state slot per sequence)")
        fresh = meta.state_fresh
        if fresh is None:   # a chunk that starts at position 0 starts the sequence
            q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]
            fresh = meta.context_lens == q_lens
        return cls(meta.cu_seqlens_q, meta.state_slots.long(), fresh.bool(), meta.max_q_len)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, prefix: str, backend: AttentionBackend,
                 rotary: RotaryEmbedding):
        super().__init__()
        hd = self.head_dim = cfg.head_dim
        o_name = f"{prefix}.o_proj.weight"
        shard = head_shard(w.tp, cfg.num_attention_heads, cfg.num_key_value_heads, hd, w.align([o_name]), prefix)
        self.num_heads, self.num_kv_heads = shard.q_count, shard.kv_count
        self.gated = cfg.attn_output_gate
        q_rows = self.head_dim * (2 if self.gated else 1)    # [query | gate] per head
        self.q_size = self.num_heads * q_rows
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        rows = cols = None
        if w.tp.on:
            kv = [(shard.kv_start * hd, self.kv_size)]
            rows, cols = [[(shard.q_start * q_rows, self.q_size)], kv, kv], (shard.q_start * hd, self.num_heads * hd)
        self.qkv_proj = Linear(w.linear_weight([f"{prefix}.{p}_proj.weight" for p in "qkv"], rows))
        self.o_proj = Linear(w.linear_weight([o_name], cols=cols), reduce=w.tp if w.tp.on else None)
        self.q_norm = RMSNorm(norm_weight(cfg, w, f"{prefix}.q_norm.weight"), cfg.rms_norm_eps)
        self.k_norm = RMSNorm(norm_weight(cfg, w, f"{prefix}.k_norm.weight"), cfg.rms_norm_eps)
        self.backend, self.rotary = backend, rotary
        self.k_cache = self.v_cache = None   # assigned by the model runner

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.reshape(n, self.num_heads, -1)
        q, gate = (qg[..., :hd], qg[..., hd:]) if self.gated else (qg, None)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(n, self.num_kv_heads, hd))
        q, k = self.rotary(positions, q, k)
        o = self.backend(q, k, v.reshape(n, self.num_kv_heads, hd), self.k_cache, self.v_cache, meta, self.scale)
        o = o.reshape(n, self.num_heads * hd)
        if gate is not None:
            o = o * activation("sigmoid", gate.reshape(n, -1))
        return self.o_proj(o)


class GatedDeltaNet(nn.Module):
    """Tensor parallel: split by key heads, each with its value heads (the state, the conv channels and
    the projections' rows of those heads); out_proj is row-parallel over the value heads."""

    def __init__(self, cfg: ModelConfig, w: WeightLoader, prefix: str):
        super().__init__()
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if not (nk and nv and dk and dv) or nv % nk:
            raise ValueError(f"{prefix}: bad Gated DeltaNet shape (key heads {nk}, value heads {nv}, "
                             f"dims {dk}/{dv})")
        r = nv // nk
        out_name = f"{prefix}.out_proj.weight"
        k0, kn = self._key_heads(w, nk, r * dv, w.align([out_name]), prefix)
        self.nk, self.nv = kn, kn * r
        self.key_dim, self.value_dim = self.nk * dk, self.nv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.grouped = f"{prefix}.in_proj_qkvz.weight" in w.names
        parts = (["in_proj_qkvz", "in_proj_ba"] if self.grouped
                 else ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])
        # This rank's rows of each input projection: mixed q|k|v (and conv channels) by head, z/b/a by value head.
        full_key = nk * dk
        mixed = [(k0 * dk, kn * dk), (full_key + k0 * dk, kn * dk), (2 * full_key + k0 * r * dv, kn * r * dv)]
        value = [(k0 * r, kn * r)]
        rows = out_cols = None
        if w.tp.on:
            out_cols = (k0 * r * dv, kn * r * dv)
            if self.grouped:   # Qwen3-Next: per key head [q k v z] rows, then [b a] rows
                rows = [[(k0 * (2 * dk + 2 * r * dv), kn * (2 * dk + 2 * r * dv))], [(k0 * 2 * r, kn * 2 * r)]]
            else:
                rows = [mixed, [out_cols], value, value]
        self.in_proj = Linear(w.linear_weight([f"{prefix}.{p}.weight" for p in parts], rows))
        tp = w.tp.on
        conv = w.dense(f"{prefix}.conv1d.weight", torch.float32, rows=mixed if tp else None)
        self.conv_weight = nn.Parameter(conv.reshape(self.conv_dim, self.kernel_size), requires_grad=False)
        self.neg_a = nn.Parameter(-w.dense(f"{prefix}.A_log", torch.float32, rows=value if tp else None).exp(),
                                  requires_grad=False)
        self.dt_bias = nn.Parameter(w.dense(f"{prefix}.dt_bias", torch.float32, rows=value if tp else None),
                                    requires_grad=False)
        self.norm_weight = nn.Parameter(w.dense(f"{prefix}.norm.weight", torch.float32), requires_grad=False)
        self.out_proj = Linear(w.linear_weight([out_name], cols=out_cols), reduce=w.tp if tp else None)
        self.use_triton = w.device.type == "cuda" and triton_available()
        self.conv_state = self.recurrent_state = None   # assigned by the model's allocate_state

    @staticmethod
    def _key_heads(w: WeightLoader, nk: int, value_cols: int, align: int, prefix: str) -> tuple[int, int]:
        """(first, count) of this rank's key heads, in units whose out_proj columns end on a block."""
        if not w.tp.on:
            return 0, nk
        unit = next((u for u in range(1, nk + 1) if nk % u == 0 and (u * value_cols) % align == 0), nk)
        if nk // unit < w.tp.size or (unit * value_cols) % align:
            raise ValueError(f"{prefix}: {nk} Gated DeltaNet key heads cannot be split over {w.tp.size} ranks "
                             f"on {align}-element block boundaries")
        start, count = split(nk // unit, w.tp.size, w.tp.rank)
        return start * unit, count * unit

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (num_slots, self.conv_dim, self.kernel_size - 1), (num_slots, self.nv, self.dk, self.dv)

    def _split(self, proj: torch.Tensor):
        """Fused projection -> mixed qkv [n, conv_dim], z [n, nv, dv], b, a [n, nv]."""
        n = proj.shape[0]
        if not self.grouped:
            mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.nv, self.nv], dim=-1)
            return mixed, z.reshape(n, self.nv, self.dv), b, a
        # Qwen3-Next: per key head [q, k, v for its value heads, z for its value heads], then [b, a].
        r = self.nv // self.nk
        qkvz, ba = proj.split([2 * self.key_dim + 2 * self.value_dim, 2 * self.nv], dim=-1)
        q, k, v, z = qkvz.reshape(n, self.nk, -1).split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        b, a = ba.reshape(n, self.nk, 2 * r).split([r, r], dim=-1)
        return mixed, z.reshape(n, self.nv, self.dv), b.reshape(n, self.nv), a.reshape(n, self.nv)

    def _delta_rule(self, q, k, v, g, beta, step: StateStep) -> torch.Tensor:
        args = (q, k, v, g, beta, step.cu_seqlens, self.recurrent_state, step.slots, step.fresh)
        if self.use_triton:
            from nanochat.kernels import triton_gated_delta as tgd
            if step.max_q_len == 1:
                return tgd.recurrent_gated_delta_rule_triton(*args)
            return tgd.chunk_gated_delta_rule_triton(*args)
        return gd.gated_delta_rule(*args)

    def forward(self, x: torch.Tensor, step: StateStep) -> torch.Tensor:
        if self.conv_state is None:
            raise RuntimeError("hybrid model: call allocate_state() before running it")
        n = x.shape[0]
        mixed, z, b, a = self._split(self.in_proj(x))
        mixed = gd.causal_conv1d_varlen(mixed, self.conv_weight, step.cu_seqlens, self.conv_state,
                                        step.slots, step.fresh)
        q = mixed[:, :self.key_dim].view(n, self.nk, self.dk)
        k = mixed[:, self.key_dim:2 * self.key_dim].view(n, self.nk, self.dk)
        v = mixed[:, 2 * self.key_dim:].view(n, self.nv, self.dv)
        g = self.neg_a * activation("softplus", a.float() + self.dt_bias)
        beta = activation("sigmoid", b.float())
        o = self._delta_rule(q, k, v, g.contiguous(), beta.contiguous(), step).to(x.dtype)
        # Gated RMSNorm per value head with a plain weight: rmsnorm(o) * w * silu(z).
        o = F.rms_norm(o.float(), (self.dv,), eps=self.eps) * self.norm_weight * activation("silu", z.float())
        return self.out_proj(o.to(x.dtype).reshape(n, self.value_dim))


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, i: int, backend, rotary):
        super().__init__()
        p = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(norm_weight(cfg, w, f"{p}.input_layernorm.weight"), cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(norm_weight(cfg, w, f"{p}.post_attention_layernorm.weight"),
                                                cfg.rms_norm_eps)
        self.is_linear = cfg.layer_type(i) == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, w, f"{p}.linear_attn")
        else:
            self.self_attn = GatedAttention(cfg, w, f"{p}.self_attn", backend, rotary)
        self.mlp = load_mlp(cfg, w, i)

    def forward(self, positions, x, meta: AttnMetadata, step: StateStep):
        h = self.input_layernorm(x)
        h = self.linear_attn(h, step) if self.is_linear else self.self_attn(positions, h, meta)
        h = x + h
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextForCausalLM(nn.Module):
    """qwen3_next, qwen3_5_moe (= Qwen3.6-MoE) and qwen3_5 (dense MLP) text models."""

    is_hybrid = True

    def __init__(self, cfg: ModelConfig, w: WeightLoader, block_size: int, max_positions: int):
        super().__init__()
        if not cfg.layer_types:
            raise ValueError(f"{cfg.arch}: hybrid model config has no layer_types")
        self.config, self.tp = cfg, w.tp
        self.dtype = w.dtype
        self.backend = AttentionBackend(w.device, block_size)
        self.rotary = RotaryEmbedding(cfg, cfg.rotary_dim, max_positions, w.device)
        self.embed_tokens, self.lm_head = embedding_and_head(cfg, w)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, w, i, self.backend, self.rotary)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(norm_weight(cfg, w, "model.norm.weight"), cfg.rms_norm_eps)
        self.num_state_slots = 0

    # ------------------------------------------------------------------ engine interface
    def attention_layers(self) -> list[GatedAttention]:
        """Only the full-attention layers have a paged KV cache."""
        return [layer.self_attn for layer in self.layers if not layer.is_linear]

    def gdn_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.layers if layer.is_linear]

    def hybrid_state_spec(self) -> int:
        """Bytes of one state slot (conv + recurrent state of every GDN layer)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for layer in self.gdn_layers():
            conv, rec = layer.state_shapes(1)
            total += conv[1] * conv[2] * elem + rec[1] * rec[2] * rec[3] * 4
        return total

    def allocate_state(self, num_slots: int, device) -> None:
        """Per GDN layer: conv_state [num_slots, conv_dim, K-1] (model dtype) and
        recurrent_state [num_slots, nv, dk, dv] (fp32), zero-filled."""
        for layer in self.gdn_layers():
            conv, rec = layer.state_shapes(num_slots)
            layer.conv_state = torch.zeros(conv, dtype=self.dtype, device=device)
            layer.recurrent_state = torch.zeros(rec, dtype=torch.float32, device=device)
        self.num_state_slots = num_slots

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Snapshot / restore: slot dst gets slot src's conv and recurrent states."""
        for layer in self.gdn_layers():
            layer.conv_state[dst_slot].copy_(layer.conv_state[src_slot])
            layer.recurrent_state[dst_slot].copy_(layer.recurrent_state[src_slot])

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        step = StateStep.from_meta(meta)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, meta, step)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return head_logits(self.lm_head, hidden)


# GGUF: Qwen3-Next's and Qwen3.5's block tensors (the GGUF source splits ssm_ba and serves ssm_a as A_log).
HYBRID_BLOCK_TENSORS = {
    **MOE_BLOCK_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_HYBRID = dict(hybrid=True, qk_norm=True, norm_zero_centred=True, sliding_window="none",
               block_tensors=HYBRID_BLOCK_TENSORS)
QWEN3_NEXT = FamilySpec("qwen3_next", Qwen3NextForCausalLM, gguf_arch="qwen3next", moe=True, **_HYBRID)
# Qwen3.5 / 3.6: multimodal wrappers (their text models' names too); MoE routing always renormalised.
QWEN3_5_MOE = FamilySpec("qwen3_5_moe", Qwen3NextForCausalLM, hf_types=("qwen3_5_moe_text",), gguf_arch="qwen35moe",
                         moe=True, norm_topk_fixed=True, tiled_v_heads=True, **_HYBRID)
QWEN3_5 = FamilySpec("qwen3_5", Qwen3NextForCausalLM, hf_types=("qwen3_5_text",), gguf_arch="qwen35",
                     tiled_v_heads=True, **_HYBRID)
