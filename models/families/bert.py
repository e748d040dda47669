"""BERT encoders: the embedding models that read a text both ways. BERT itself (MiniLM, BGE, mxbai-embed, Snowflake
Arctic Embed, E5) and Nomic BERT (nomic-embed-text). Each position attends to every position of its own input; the
token embedding (plus the token-type-0 row) LayerNorm-ed; per layer x = LN(x + attn(x)), x = LN(x + mlp(x)).
BERT: learned absolute positions added to the embeddings, biases everywhere, an MLP up -> GELU (erf) -> down.
Nomic BERT: RoPE on q and k instead, no biases, a SwiGLU MLP. No output head: the final hidden states are what the
pooling reads. The engine runs an input in one chunk and keeps no KV cache for it (engine/scheduler.py)."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from nanochat.models.config import ModelConfig
from nanochat.models.families.spec import FamilySpec
from nanochat.models.layers.attention import AttnMetadata
from nanochat.models.layers.common import Linear, RotaryEmbedding, WeightLoader, token_embedding

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

# llama.cpp's names (GGUF base name -> our module path; ".weight" / ".bias" is carried over).
BERT_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "position_embd": "model.embed_positions",
    "token_types": "model.embed_types",
    "token_embd_norm": "model.embed_norm",
}
BERT_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_output_norm": "post_attention_layernorm",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "layer_output_norm": "post_feedforward_layernorm",
}
NOMIC_BLOCK_TENSORS = {**BERT_BLOCK_TENSORS, "ffn_gate": "mlp.gate_proj"}
# transformers' BertModel names (a task model's `bert.` prefix dropped) -> ours.
_HF_NAMES = (
    (r"embeddings\.word_embeddings\.", "model.embed_tokens."),
    (r"embeddings\.position_embeddings\.", "model.embed_positions."),
    (r"embeddings\.token_type_embeddings\.", "model.embed_types."),
    (r"embeddings\.LayerNorm\.", "model.embed_norm."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.", r"model.layers.\1.self_attn.q_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.", r"model.layers.\1.self_attn.k_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.", r"model.layers.\1.self_attn.v_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"model.layers.\1.self_attn.o_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.", r"model.layers.\1.mlp.up_proj."),
    (r"encoder\.layer\.(\d+)\.output\.dense\.", r"model.layers.\1.mlp.down_proj."),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"model.layers.\1.post_feedforward_layernorm."),
)
# NomicBertModel names -> ours, as nomic-ai publishes them and transformers saves them (its own module names exist only
# in memory); Wqkv is served as q, k, v (FamilySpec.hf_fused).
_NOMIC_HF_NAMES = (
    (r"embeddings\.word_embeddings\.", "model.embed_tokens."),
    (r"embeddings\.token_type_embeddings\.", "model.embed_types."),
    (r"emb_ln\.", "model.embed_norm."),
    (r"encoder\.layers\.(\d+)\.attn\.Wqkv\.", r"model.layers.\1.self_attn.qkv_proj."),
    (r"encoder\.layers\.(\d+)\.attn\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"encoder\.layers\.(\d+)\.norm1\.", r"model.layers.\1.post_attention_layernorm."),
    (r"encoder\.layers\.(\d+)\.mlp\.fc11\.", r"model.layers.\1.mlp.up_proj."),
    (r"encoder\.layers\.(\d+)\.mlp\.fc12\.", r"model.layers.\1.mlp.gate_proj."),
    (r"encoder\.layers\.(\d+)\.mlp\.fc2\.", r"model.layers.\1.mlp.down_proj."),
    (r"encoder\.layers\.(\d+)\.norm2\.", r"model.layers.\1.post_feedforward_layernorm."),
)


def _renamer(table):
    compiled = [(re.compile(pattern), repl) for pattern, repl in table]

    def rename(stored: str) -> str | None:
        """Our name for a checkpoint tensor (None: one the encoder never reads: a pooler's, a task head's)."""
        stored = stored.removeprefix("bert.")
        for pattern, repl in compiled:
            if pattern.match(stored):
                return pattern.sub(repl, stored, count=1)
        return None
    return rename


class LayerNorm(nn.Module):
    def __init__(self, w: WeightLoader, prefix: str, eps: float):
        super().__init__()
        self.weight = nn.Parameter(w.dense(f"{prefix}.weight", torch.float32), requires_grad=False)
        self.bias = nn.Parameter(w.dense(f"{prefix}.bias", torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def _linear(w: WeightLoader, prefix: str, names: list[str], bias: bool) -> Linear:
    """One Linear for the row-concatenation of `names` (q|k|v, gate|up), with their biases if the model has them."""
    b = torch.cat([w.dense(f"{prefix}.{n}.bias", torch.float32) for n in names]) if bias else None
    return Linear(w.linear_weight([f"{prefix}.{n}.weight" for n in names]), b)


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, w: WeightLoader, i: int, rotary: RotaryEmbedding | None):
        super().__init__()
        p, bias = f"model.layers.{i}", cfg.attention_bias
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.rotary = rotary
        self.qkv_proj = _linear(w, f"{p}.self_attn", ["q_proj", "k_proj", "v_proj"], bias)
        self.o_proj = _linear(w, f"{p}.self_attn", ["o_proj"], bias)
        self.post_attention_layernorm = LayerNorm(w, f"{p}.post_attention_layernorm", cfg.rms_norm_eps)
        self.gated = cfg.hidden_act == "silu"   # SwiGLU: silu(gate x) * up x; else GELU(up x)
        self.up_proj = _linear(w, f"{p}.mlp", ["gate_proj", "up_proj"] if self.gated else ["up_proj"], bias)
        self.down_proj = _linear(w, f"{p}.mlp", ["down_proj"], bias)
        self.post_feedforward_layernorm = LayerNorm(w, f"{p}.post_feedforward_layernorm", cfg.rms_norm_eps)

    def attention(self, x: torch.Tensor, positions: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """Each input's positions attend to all of that input's positions (bounds: cu_seqlens)."""
        n, width = x.shape[0], self.num_heads * self.head_dim
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=x.dtype)
        for a, b in zip(bounds, bounds[1:]):
            # [1, heads, len, dim]: the shape torch's fused CPU attention takes (a third faster than its fallback)
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, scale=self.scale)[0].transpose(0, 1)
        return self.o_proj(out.view(n, width))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down_proj(F.gelu(self.up_proj(x)))
        gate, up = self.up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        x = self.post_attention_layernorm(x + self.attention(x, positions, bounds))
        return self.post_feedforward_layernorm(x + self.mlp(x))


class BertModel(nn.Module):
    """The encoder: forward returns the final hidden states; there are no logits and no KV cache."""

    def __init__(self, cfg: ModelConfig, w: WeightLoader, block_size: int, max_positions: int):
        super().__init__()
        self.config, self.tp = cfg, w.tp
        self.embed_tokens = token_embedding(w, "model.embed_tokens.weight")
        # learned absolute positions (BERT), else RoPE in every layer (Nomic BERT)
        rope = any(cfg.layer_rope)
        self.embed_positions = None if rope else nn.Parameter(
            w.dense("model.embed_positions.weight", torch.float32), requires_grad=False)
        rotary = RotaryEmbedding(cfg, cfg.rotary_dim, max_positions, w.device) if rope else None
        # Every input is one segment (type 0), as llama.cpp and the sentence-transformers models use them.
        types = w.optional("model.embed_types.weight")
        self.embed_type0 = None if types is None else nn.Parameter(types[0].float().clone(), requires_grad=False)
        self.embed_norm = LayerNorm(w, "model.embed_norm", cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg, w, i, rotary) for i in range(cfg.num_hidden_layers))

    def attention_layers(self) -> list:
        return []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        bounds = meta.host_lists[0] if meta.host_lists is not None else meta.cu_seqlens_q.tolist()
        x = self.embed_tokens(input_ids).float()
        if self.embed_positions is not None:
            x = x + self.embed_positions[positions]
        if self.embed_type0 is not None:
            x = x + self.embed_type0
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, positions, bounds)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> None:
        return None


BERT = FamilySpec("bert", BertModel, gguf_arch="bert", encoder=True, absolute_positions=True, attention_bias=True,
                  activations=("gelu",), block_tensors=BERT_BLOCK_TENSORS, global_tensors=BERT_GLOBAL_TENSORS,
                  hf_name=_renamer(_HF_NAMES), hf_requires={"position_embedding_type": "absolute"})
# config.json: nomic-ai's own keys; n_positions as llama.cpp's converter reads it (the v1 / v1.5 models state 8192 but
# were trained for 2048: max_trained_positions).
NOMIC_BERT = FamilySpec(
    "nomic_bert", BertModel, gguf_arch="nomic-bert", encoder=True, activations=("swiglu", "silu"),
    block_tensors=NOMIC_BLOCK_TENSORS, global_tensors=BERT_GLOBAL_TENSORS, split_tensors={"attn_qkv": QKV},
    hf_name=_renamer(_NOMIC_HF_NAMES), hf_fused={"self_attn.qkv_proj": QKV},
    hf_keys={"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
             "n_inner": "intermediate_size", "layer_norm_epsilon": "layer_norm_eps",
             "n_positions": "max_position_embeddings", "rotary_emb_base": "rope_theta",
             "activation_function": "hidden_act"},
    hf_requires={"rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_scaling_factor": None,
                 "prenorm": False, "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
                 "moe_every_n_layers": None},
    rope_theta=1000.0)
