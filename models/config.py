"""Model hyper-parameters, whatever the weight source (config.json or GGUF metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Dense families share one implementation (models/dense.py) and differ only by flags.
DENSE_ARCHS = {"llama", "qwen2", "qwen3"}
MOE_ARCHS = {"qwen3_moe"}
# Hybrid Gated DeltaNet + gated attention families (models/qwen3_next.py).
HYBRID_ARCHS = {"qwen3_next", "qwen3_5_moe", "qwen3_5"}
# Text-only model_type names of multimodal wrappers -> our arch name.
TEXT_ARCH_ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe", "qwen3_5_text": "qwen3_5"}


def layer_types_from_interval(num_layers: int, interval: int) -> tuple[str, ...]:
    """Hybrid layout: every `interval`-th layer is full attention, the others Gated DeltaNet."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))


@dataclass(frozen=True)
class ModelConfig:
    arch: str                      # "llama" | "qwen2" | "qwen3" (HF model_type)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # HF rope_scaling dict (e.g. llama3), or None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # qwen2: bias on q/k/v
    qk_norm: bool = False          # qwen3: per-head RMSNorm on q and k before RoPE
    torch_dtype: str = "bfloat16"  # checkpoint dtype name
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""                 # human-readable model name
    # --- MoE (qwen3_moe, qwen3_next, qwen3_5_moe); num_experts == 0 means dense MLPs
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0   # 0: no shared expert
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # --- hybrid (Gated DeltaNet) layers; empty layer_types means all full attention
    layer_types: tuple[str, ...] = ()          # "full_attention" | "linear_attention" per layer
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 1.0         # RoPE on the first head_dim * factor dims
    attn_output_gate: bool = False             # q_proj holds [query | gate] per head
    norm_zero_centred: bool = False            # HF hybrid checkpoints: RMSNorm scales by (1 + w)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "") -> "ModelConfig":
        """Build from a Hugging Face config.json dict (llama / qwen2 / qwen3 / qwen3_moe / qwen3_next /
        qwen3_5(_moe)); multimodal wrappers keep the text model's config under `text_config`."""
        if isinstance(cfg.get("text_config"), dict):
            text = cfg["text_config"]
            outer = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
            merged = {**outer, **text}
            # The wrapper owns the output head and generation ids when it states them.
            for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
                if key in outer:
                    merged[key] = outer[key]
            merged["model_type"] = outer.get("model_type") or text.get("model_type", "")
            cfg = merged
        arch = cfg.get("model_type", "")
        arch = TEXT_ARCH_ALIASES.get(arch, arch)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # transformers 5 writes RoPE settings under `rope_parameters`; older configs use top-level keys.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        rope_scaling = cfg.get("rope_scaling") or rope_params or None
        if rope_scaling and (rope_scaling.get("rope_type") or rope_scaling.get("type")) in (None, "default", "mrope"):
            rope_scaling = None   # plain RoPE (mRoPE is plain RoPE for text: all position ids are equal)
        partial = cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0
        hybrid = arch in HYBRID_ARCHS
        num_layers = cfg["num_hidden_layers"]
        layer_types = tuple(cfg.get("layer_types") or ())
        if hybrid and not layer_types:
            layer_types = layer_types_from_interval(num_layers, cfg.get("full_attention_interval", 4))
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"] if not num_experts else cfg.get("intermediate_size") or 0,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe") or hybrid,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            num_experts=num_experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
            # transformers' defaults: off for Qwen3-MoE, on for Qwen3-Next; Qwen3.5/3.6 always renormalise.
            norm_topk_prob=bool(cfg.get("norm_topk_prob", arch != "qwen3_moe")) if arch != "qwen3_5_moe" else True,
            decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            layer_types=layer_types,
            linear_num_key_heads=cfg.get("linear_num_key_heads") or 0,
            linear_num_value_heads=cfg.get("linear_num_value_heads") or 0,
            linear_key_head_dim=cfg.get("linear_key_head_dim") or 0,
            linear_value_head_dim=cfg.get("linear_value_head_dim") or 0,
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim") or 4,
            partial_rotary_factor=float(partial),
            attn_output_gate=hybrid,
            norm_zero_centred=hybrid,
        )
