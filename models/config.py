"""Model hyper-parameters, whatever the weight source (config.json or GGUF metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Dense families share one implementation (models/dense.py) and differ only by flags.
DENSE_ARCHS = {"llama", "qwen2", "qwen3"}


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
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "") -> "ModelConfig":
        """Build from a Hugging Face config.json dict (llama / qwen2 / qwen3)."""
        arch = cfg.get("model_type", "")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # transformers 5 moved rope_theta / rope_scaling under rope_parameters
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )
