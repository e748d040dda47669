"""Model hyper-parameters, whatever the weight source (config.json or GGUF metadata), and what they
imply: `check_config` range-checks them and `expected_shapes` / `required_tensors` say which tensors,
of which shapes, the model code reads (so a source can refuse a file before any kernel sees it)."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanochat.models.errors import ModelLoadError

if TYPE_CHECKING:
    from nanochat.models.families.spec import FamilySpec


# The MLP's activation (ModelConfig.hidden_act) for each config.json name of it: a decoder's gated MLP takes silu
# (SwiGLU; an encoder's "swiglu") or gelu_tanh (GeGLU); "gelu" is BERT's ungated MLP with the erf GELU.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu",
               "swiglu": "silu"}


def merge_text_config(cfg: dict) -> dict:
    """A multimodal wrapper's config.json with its text model's config (`text_config`) merged in."""
    if not isinstance(cfg.get("text_config"), dict):
        return cfg
    text = cfg["text_config"]
    outer = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    merged = {**outer, **text}
    # The wrapper owns the output head and generation ids when it states them.
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in outer:
            merged[key] = outer[key]
    merged["model_type"] = outer.get("model_type") or text.get("model_type", "")
    return merged


def layer_types_from_interval(num_layers: int, interval: int) -> tuple[str, ...]:
    """Hybrid layout: every `interval`-th layer is full attention, the others Gated DeltaNet."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))


@dataclass(frozen=True)
class ModelConfig:
    arch: str                      # the family's name (models/families/registry.py): the HF model_type
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6     # the norms' epsilon (an encoder's LayerNorms: config.json's layer_norm_eps)
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
    # Per layer (filled to one entry per layer when not given): the attention window, 0 = full attention,
    # else W (a query at position p sees keys p - W + 1 .. p, as transformers' sliding-window mask); and
    # whether the layer applies RoPE (SmolLM3's NoPE layers do not).
    layer_windows: tuple[int, ...] = ()
    layer_rope: tuple[bool, ...] = ()
    # Family options (models/families/spec.py): the gated MLP's activation ("silu" | "gelu_tanh"); RMSNorms on the
    # attention and MLP outputs before their residual adds; the factor on the embeddings; the attention
    # scale (0: head_dim ** -0.5); the RoPE base of the windowed layers, unscaled (0: the global RoPE);
    # tanh soft-capping of the logits at +-final_logit_softcapping (0: none).
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    attention_scale: float = 0.0
    local_rope_theta: float = 0.0
    final_logit_softcapping: float = 0.0
    # gpt-oss: a learned per-head logit in every attention softmax (attention sinks); the router's top-k taken
    # on its logits, then softmax over the chosen ("topk_softmax"; else softmax, then top-k); the experts'
    # clamped SwiGLU ("swiglu_oai": (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)).
    attention_sinks: bool = False
    moe_router: str = "softmax_topk"
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # An encoder (BERT): every position reads every position of its input; no output head (embeddings only).
    encoder: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        n = self.num_hidden_layers if isinstance(self.num_hidden_layers, int) else 0
        if not self.layer_windows and 0 < n <= MAX_LAYERS:
            object.__setattr__(self, "layer_windows", (0,) * n)
        if not self.layer_rope and 0 < n <= MAX_LAYERS:
            object.__setattr__(self, "layer_rope", (True,) * n)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf_dict(cls, cfg: dict, family: FamilySpec, name: str = "") -> "ModelConfig":
        """Build from a Hugging Face config.json dict (a wrapper's text_config merged: merge_text_config)
        of `family` (models/families/registry.py `hf_config` finds it)."""
        arch = family.name
        # a family's own key names count where transformers' are absent
        cfg = {**family.defaults, **{family.hf_keys[k]: v for k, v in cfg.items() if k in family.hf_keys}, **cfg}
        if isinstance(cfg.get("max_trained_positions"), int) and isinstance(cfg.get("max_position_embeddings"), int):
            # Nomic BERT states 8192 positions but was trained for 2048, as llama.cpp's converter reads it
            cfg["max_position_embeddings"] = min(cfg["max_position_embeddings"], cfg["max_trained_positions"])
        heads = cfg["num_attention_heads"]
        if not cfg.get("head_dim") and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
            raise ValueError(f"num_attention_heads is {heads!r}; it must be a positive integer")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # transformers 5 writes RoPE settings under `rope_parameters`; older configs use top-level keys. Gemma 3
        # keeps one dict per layer type there: the global layers' and the windowed layers'.
        rope_params = cfg.get("rope_parameters") or {}
        per_type = rope_params if isinstance(rope_params.get("full_attention"), dict) else None
        if per_type is not None:
            rope_params = per_type["full_attention"]
        rope_theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or family.rope_theta
        rope_scaling = cfg.get("rope_scaling") or rope_params or None
        if rope_scaling and (rope_scaling.get("rope_type") or rope_scaling.get("type")) in (None, "default", "mrope"):
            rope_scaling = None   # plain RoPE (mRoPE is plain RoPE for text: all position ids are equal)
        partial = cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0
        hybrid = family.hybrid
        num_layers = cfg["num_hidden_layers"]
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 0 < num_layers <= MAX_LAYERS:
            raise ValueError(f"num_hidden_layers is {num_layers!r}; it must be a positive integer up to {MAX_LAYERS}")
        layer_types = tuple(cfg.get("layer_types") or ())
        if hybrid and not layer_types:
            layer_types = layer_types_from_interval(num_layers, cfg.get("full_attention_interval", 4))
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        per_layer = {**_layer_options(cfg, family, num_layers), **_family_options(cfg, family, per_type)}
        if rope_scaling and (rope_scaling.get("rope_type") or rope_scaling.get("type")) in LONGROPE:
            rope_scaling = _longrope(cfg, rope_scaling)
        norm_topk = family.norm_topk_prob if family.norm_topk_fixed else \
            bool(cfg.get("norm_topk_prob", family.norm_topk_prob))
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"] if not num_experts else cfg.get("intermediate_size") or 0,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", cfg.get("layer_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family.attention_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=family.qk_norm,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            num_experts=num_experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
            # gpt-oss and Mixtral name the experts' width intermediate_size
            moe_intermediate_size=cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size") or 0
                                                                       if num_experts else 0),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
            norm_topk_prob=norm_topk,
            decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            layer_types=layer_types,
            **per_layer,
            linear_num_key_heads=cfg.get("linear_num_key_heads") or 0,
            linear_num_value_heads=cfg.get("linear_num_value_heads") or 0,
            linear_key_head_dim=cfg.get("linear_key_head_dim") or 0,
            linear_value_head_dim=cfg.get("linear_value_head_dim") or 0,
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim") or 4,
            partial_rotary_factor=float(partial),
            attn_output_gate=hybrid,
            norm_zero_centred=family.norm_zero_centred,
            encoder=family.encoder,
        )


LONGROPE = ("longrope", "su")   # "su": Phi-3's first name for LongRoPE


def fused_rows(cfg: "ModelConfig", modules: tuple[str, ...]) -> list[int]:
    """The rows of each module (a part of a family's fused tensor, e.g. self_attn.k_proj) in a fused tensor."""
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "mlp.gate_proj": inter,
            "mlp.up_proj": inter}
    return [rows[m] for m in modules]


def _layer_options(cfg: dict, family: FamilySpec, num_layers: int) -> dict:
    """layer_windows and layer_rope from config.json, as transformers reads them."""
    rope = (not family.absolute_positions,) * num_layers
    if family.no_rope_interval:
        flags = cfg.get("no_rope_layers")
        if flags is None:   # transformers' default: every no_rope_layer_interval-th layer without RoPE
            interval = cfg.get("no_rope_layer_interval") or family.no_rope_interval
            flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
        if not isinstance(flags, list) or len(flags) != num_layers:
            raise ValueError(f"no_rope_layers must list one 0/1 flag per layer ({num_layers})")
        rope = tuple(bool(f) for f in flags)
    window = cfg.get("sliding_window")
    if family.sliding_window == "none" or window is None or cfg.get("use_sliding_window") is False:
        return {"layer_windows": (0,) * num_layers, "layer_rope": rope}
    if family.sliding_window == "all":
        return {"layer_windows": (window,) * num_layers, "layer_rope": rope}
    types = cfg.get("layer_types")
    if types is None and family.no_rope_interval and cfg.get("use_sliding_window"):
        types = ["full_attention" if r else "sliding_attention" for r in rope]   # SmolLM3's default
    pattern = cfg.get("sliding_window_pattern")
    if types is None and pattern is not None:   # Gemma 3's default: every pattern-th layer global
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"sliding_window_pattern is {pattern!r}; it must be a positive integer")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if types is None:
        return {"layer_windows": (0,) * num_layers, "layer_rope": rope}
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"layer_types must list one type per layer ({num_layers})")
    return {"layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types), "layer_rope": rope}


def _family_options(cfg: dict, family: FamilySpec, per_type: dict | None) -> dict:
    """A family's activation, extra norms, embedding and attention scales, windowed layers' RoPE and
    logit soft-capping from config.json, as transformers reads them; one-line ValueErrors for what is not
    supported."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or family.activations[0]
    if act not in family.activations:
        raise ValueError(f"hidden activation {act!r} is not supported for {family.name} "
                         f"(supported: {', '.join(family.activations)})")
    out: dict[str, Any] = {"hidden_act": ACTIVATIONS[act], "sandwich_norms": family.sandwich_norms}
    if family.embed_scale:
        out["embed_scale"] = cfg["hidden_size"] ** 0.5
    if family.query_pre_attn_scalar:
        scalar = cfg.get("query_pre_attn_scalar")
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not 0 < scalar < math.inf:
            raise ValueError(f"query_pre_attn_scalar is {scalar!r}; it must be a positive number")
        out["attention_scale"] = scalar ** -0.5
    if family.local_rope:
        local = (per_type or {}).get("sliding_attention") or {}
        if (local.get("rope_type") or local.get("type") or "default") != "default":
            raise ValueError("RoPE scaling on the sliding-window layers (rope_parameters['sliding_attention']) "
                             "is not supported")
        out["local_rope_theta"] = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping (Gemma 2's soft-capped attention scores) is not supported")
    for key, value in family.hf_requires.items():
        if cfg.get(key, value) != value:
            raise ValueError(f"{key} {cfg[key]!r} is not supported for {family.name} (only {value!r})")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an embedding model, not a causal LM) is not supported")
    if family.moe_router != "softmax_topk" or family.expert_act != "silu" or family.attention_sinks:
        out.update(attention_sinks=family.attention_sinks, moe_router=family.moe_router, expert_act=family.expert_act,
                   swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    if family.logit_softcapping and cfg.get("final_logit_softcapping") is not None:
        cap = cfg["final_logit_softcapping"]
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
            raise ValueError(f"final_logit_softcapping is {cap!r}; it must be a positive number or null")
        out["final_logit_softcapping"] = float(cap)
    return out


def _longrope(cfg: dict, scaling: dict) -> dict:
    """LongRoPE (Phi-3) as transformers' _compute_longrope_parameters reads it: short and long factors per
    frequency, the pretraining context (from the scaling dict or config.json), and the factor on cos and sin."""
    orig = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not isinstance(orig, int) or orig < 2:
        raise ValueError(f"LongRoPE needs original_max_position_embeddings (an integer above 1), not {orig!r}")
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = scaling.get("factor") or cfg.get("max_position_embeddings", 4096) / orig
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return {"rope_type": "longrope", "short_factor": list(scaling.get("short_factor") or []),
            "long_factor": list(scaling.get("long_factor") or []), "original_max_position_embeddings": orig,
            "attention_factor": float(attention)}


# ---------------------------------------------------------------------------------- range checks

# Bounds before anything loops over layers or experts (real models: about 100 layers, 512 experts).
MAX_LAYERS = 4096
MAX_EXPERTS = 65536

# RoPE scaling types models/layers/common.py implements.
ROPE_SCALING_TYPES = ("linear", "llama3", "freq_factors", "longrope", "yarn")
MAX_CONTEXT = 2**30


class _Checker:
    """Raises ModelLoadError "<where>: <key> is <value>; <what is needed>" for the first bad value;
    `keys` maps ModelConfig fields to the names the source uses (GGUF metadata keys, config.json keys)."""

    def __init__(self, cfg: ModelConfig, where: str, keys: Mapping[str, str]):
        self.cfg, self.where, self.keys = cfg, where, keys

    def key(self, name: str) -> str:
        return self.keys.get(name, name)

    def fail(self, name: str, need: str, value=None, shown: str | None = None) -> None:
        """`value` (default: the field's) is shown with repr; `shown` is a description used as is."""
        if shown is None:
            shown = repr(getattr(self.cfg, name) if value is None else value)
        raise ModelLoadError(f"{self.where}: {self.key(name)} is {shown}; {need} (the file is corrupt or "
                             "was converted wrongly)")

    def positive(self, *names: str) -> None:
        for name in names:
            v = getattr(self.cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                self.fail(name, "it must be a positive integer")

    def number(self, name: str, low: float, high: float, need: str) -> None:
        v = getattr(self.cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not low < v < high:
            self.fail(name, need)


def check_config(cfg: ModelConfig, where: str, keys: Mapping[str, str] | None = None) -> None:
    """Range-check the hyper-parameters the model code divides by, allocates with or exponentiates;
    ModelLoadError names `where` (the file) and the key."""
    c = _Checker(cfg, where, keys or {})
    c.positive("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "max_position_embeddings")
    if cfg.num_hidden_layers > MAX_LAYERS:
        c.fail("num_hidden_layers", f"at most {MAX_LAYERS} layers are supported")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        c.fail("num_attention_heads", f"it must be a multiple of {c.key('num_key_value_heads')} "
                                      f"({cfg.num_key_value_heads})")
    if cfg.max_position_embeddings > MAX_CONTEXT:
        c.fail("max_position_embeddings", f"at most {MAX_CONTEXT:,} positions are supported")
    c.number("rms_norm_eps", 0.0, 1.0, "it must be a small positive number such as 1e-6")
    c.number("rope_theta", 1.0, math.inf, "it must be a finite number above 1 (typically 10000 or more)")
    if cfg.local_rope_theta:
        c.number("local_rope_theta", 1.0, math.inf, "it must be a finite number above 1 (typically 10000)")
    if cfg.final_logit_softcapping:
        c.number("final_logit_softcapping", 0.0, math.inf, "it must be a finite positive number")
    c.number("embed_scale", 0.0, math.inf, "it must be a finite positive number")
    if cfg.attention_scale:
        c.number("attention_scale", 0.0, math.inf, "it must be a finite positive number")
    if not 0.0 < cfg.partial_rotary_factor <= 1.0 or cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
        full = cfg.partial_rotary_factor == 1.0
        c.fail("head_dim" if full else "partial_rotary_factor",
               f"RoPE needs an even number of rotary dimensions, from 2 up to head_dim {cfg.head_dim}",
               value=cfg.head_dim, shown=None if full else f"{cfg.rotary_dim} rotary dimensions")
    _check_rope_scaling(c)
    _check_token_ids(c)
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        c.positive("intermediate_size")
    if cfg.num_experts:
        c.positive("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        if cfg.num_experts > MAX_EXPERTS:
            c.fail("num_experts", f"at most {MAX_EXPERTS} experts are supported")
        if cfg.num_experts_per_tok > cfg.num_experts:
            c.fail("num_experts_per_tok", f"it must be at most {c.key('num_experts')} ({cfg.num_experts})")
        if cfg.shared_expert_intermediate_size < 0:
            c.fail("shared_expert_intermediate_size", "it must be 0 (no shared expert) or positive")
    if "linear_attention" in cfg.layer_types:
        c.positive("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                   "linear_conv_kernel_dim")
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            c.fail("linear_num_value_heads", f"it must be a multiple of {c.key('linear_num_key_heads')} "
                                             f"({cfg.linear_num_key_heads})")
    if len(cfg.layer_windows) != cfg.num_hidden_layers or any(
            isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in cfg.layer_windows):
        c.fail("layer_windows", f"it must give one window (0 or a positive integer) per layer "
                                f"({cfg.num_hidden_layers})", shown=repr(cfg.layer_windows)[:60])
    if len(cfg.layer_rope) != cfg.num_hidden_layers:
        c.fail("layer_rope", f"it must give one RoPE flag per layer ({cfg.num_hidden_layers})",
               shown=f"{len(cfg.layer_rope)} entries long")
    if cfg.layer_types and len(cfg.layer_types) != cfg.num_hidden_layers:
        c.fail("layer_types", f"it must list one type per layer ({cfg.num_hidden_layers})",
               shown=f"{len(cfg.layer_types)} entries long")


def _check_rope_scaling(c: _Checker) -> None:
    scaling = c.cfg.rope_scaling
    if not scaling:
        return
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind not in ROPE_SCALING_TYPES:
        c.fail("rope_scaling", f"supported RoPE scaling types: {', '.join(ROPE_SCALING_TYPES)}", value=kind)
    factor = scaling.get("factor")
    if kind in ("linear", "llama3", "yarn") and not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        c.fail("rope_scaling", "its factor must be a finite positive number", value=factor)
    if kind == "longrope":
        half = c.cfg.rotary_dim // 2
        for key in ("short_factor", "long_factor"):
            factors = scaling.get(key) or []
            if len(factors) != half:
                c.fail("rope_scaling", f"its {key} needs {half} factors (half the rotary dims)",
                       shown=f"{len(factors)} factors long")
            if not all(isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in factors):
                c.fail("rope_scaling", f"its {key} must hold finite positive numbers", shown="a list with a bad factor")
        attention = scaling.get("attention_factor")
        if isinstance(attention, bool) or not isinstance(attention, (int, float)) or not 0 < attention < math.inf:
            c.fail("rope_scaling", "its attention_factor must be a finite positive number", value=attention)
    if kind == "yarn":
        orig = scaling.get("original_max_position_embeddings")
        if isinstance(orig, bool) or not isinstance(orig, (int, float)) or not 1 < orig < math.inf:
            c.fail("rope_scaling", "its original_max_position_embeddings must be a number above 1", value=orig)
        for key in ("beta_fast", "beta_slow", "attention_factor"):
            v = scaling.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
                c.fail("rope_scaling", f"its {key} must be a finite positive number", value=v)
    if kind == "freq_factors":
        factors = scaling.get("freq_factors") or []
        if len(factors) != c.cfg.rotary_dim // 2:
            c.fail("rope_scaling", f"it needs {c.cfg.rotary_dim // 2} frequency factors (half the rotary dims)",
                   shown=f"{len(factors)} factors long")
        if not all(isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in factors):
            c.fail("rope_scaling", "frequency factors must be finite positive numbers",
                   shown="a list with a bad factor")


def _check_token_ids(c: _Checker) -> None:
    vocab = c.cfg.vocab_size
    for name, ids in (("bos_token_id", () if c.cfg.bos_token_id is None else (c.cfg.bos_token_id,)),
                      ("eos_token_ids", c.cfg.eos_token_ids)):
        for tid in ids:
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab:
                c.fail(name, f"token ids must be below the vocabulary size {vocab}", value=tid)


# ---------------------------------------------------------------------------------- tensor shapes

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"experts\.(\d+)\.(gate|up|down)_proj\.weight")

Shapes = tuple[tuple[tuple[int, ...], ...], str]   # (acceptable torch shapes, how they follow from the config)


def expected_shapes(cfg: ModelConfig, name: str) -> Shapes | None:
    """The torch-order shape(s) the model code needs for tensor `name` (HF naming) and why, or None for
    a tensor it does not read (or does not know)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    if cfg.encoder:
        return _encoder_shapes(cfg, name)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return ((v, h),), f"vocab_size {v} x hidden_size {h}"
    if name == "model.norm.weight":
        return ((h,),), f"hidden_size {h}"
    m = _LAYER_RE.fullmatch(name)
    if m is None or int(m.group(1)) >= cfg.num_hidden_layers:
        return None
    i, rest = int(m.group(1)), m.group(2)
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
                "post_feedforward_layernorm.weight"):
        return ((h,),), f"hidden_size {h}"
    if rest.startswith("self_attn."):
        return _attention_shapes(cfg).get(rest[len("self_attn."):])
    if rest.startswith("linear_attn."):
        return _linear_attention_shapes(cfg).get(rest[len("linear_attn."):])
    if rest.startswith("mlp."):
        return _mlp_shapes(cfg, i, rest[len("mlp."):])
    return None


def _encoder_shapes(cfg: ModelConfig, name: str) -> Shapes | None:
    """An encoder's tensors (models/families/bert.py)."""
    h, i, p = cfg.hidden_size, cfg.intermediate_size, cfg.max_position_embeddings
    hidden: Shapes = ((h,),), f"hidden_size {h}"
    wide: Shapes = (((i, h),), f"intermediate_size {i} by hidden_size {h}")
    top = {"model.embed_tokens.weight": (((cfg.vocab_size, h),), f"vocab_size {cfg.vocab_size} x hidden_size {h}"),
           "model.embed_positions.weight": (((p, h),), f"max_position_embeddings {p} x hidden_size {h}"),
           "model.embed_types.weight": (tuple((t, h) for t in range(1, 17)), f"token types x hidden_size {h}"),
           "model.embed_norm.weight": hidden, "model.embed_norm.bias": hidden}
    if name in top:
        return top[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or int(m.group(1)) >= cfg.num_hidden_layers:
        return None
    rest = m.group(2)
    square: Shapes = ((h, h),), f"hidden_size {h} x hidden_size {h}"
    return {**{f"self_attn.{x}_proj.weight": square for x in "qkvo"},
            **{f"self_attn.{x}_proj.bias": hidden for x in "qkvo"},
            **{f"{n}.{k}": hidden for n in ("post_attention_layernorm", "post_feedforward_layernorm")
               for k in ("weight", "bias")},
            "self_attn.qkv_proj.weight": (((3 * h, h),), f"3 x hidden_size {h} by hidden_size {h}"),
            "mlp.up_proj.weight": wide, "mlp.gate_proj.weight": wide,
            "mlp.up_proj.bias": (((i,),), f"intermediate_size {i}"),
            "mlp.down_proj.weight": (((h, i),), f"hidden_size {h} by intermediate_size {i}"),
            "mlp.down_proj.bias": hidden}.get(rest)


def _encoder_tensors(cfg: ModelConfig) -> Iterator[str]:
    """An encoder's tensors: the position table without RoPE (BERT), biases where it has them, a gate for SwiGLU."""
    yield "model.embed_tokens.weight"
    if not any(cfg.layer_rope):
        yield "model.embed_positions.weight"
    yield from ("model.embed_norm.weight", "model.embed_norm.bias")
    linears = (*(f"self_attn.{x}_proj" for x in "qkvo"), "mlp.up_proj", "mlp.down_proj")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        yield from (f"{p}.{m}.weight" for m in linears)
        if cfg.hidden_act == "silu":
            yield f"{p}.mlp.gate_proj.weight"
        if cfg.attention_bias:
            yield from (f"{p}.{m}.bias" for m in linears)
        yield from (f"{p}.{n}.{k}" for n in ("post_attention_layernorm", "post_feedforward_layernorm")
                    for k in ("weight", "bias"))


def _attention_shapes(cfg: ModelConfig) -> dict[str, Shapes]:
    h, hd = cfg.hidden_size, cfg.head_dim
    gate = 2 if cfg.attn_output_gate else 1
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    q_why = f"num_attention_heads {cfg.num_attention_heads} x head_dim {hd}"
    q_why += " x 2 (output gate)" if gate == 2 else ""
    kv_why = f"num_key_value_heads {cfg.num_key_value_heads} x head_dim {hd}"
    return {
        "q_proj.weight": (((q * gate, h),), f"{q_why}, by hidden_size {h}"),
        "k_proj.weight": (((kv, h),), f"{kv_why}, by hidden_size {h}"),
        "v_proj.weight": (((kv, h),), f"{kv_why}, by hidden_size {h}"),
        "o_proj.weight": (((h, q),), f"hidden_size {h} by {q_why.replace(' x 2 (output gate)', '')}"),
        "q_proj.bias": (((q * gate,),), q_why),
        "o_proj.bias": (((h,),), f"hidden_size {h}"),
        "sinks.weight": (((cfg.num_attention_heads,),), f"num_attention_heads {cfg.num_attention_heads}"),
        "k_proj.bias": (((kv,),), kv_why),
        "v_proj.bias": (((kv,),), kv_why),
        "q_norm.weight": (((hd,),), f"head_dim {hd}"),
        "k_norm.weight": (((hd,),), f"head_dim {hd}"),
        "qkv_proj.weight": (((q + 2 * kv, h),), f"{q_why} plus 2 x {kv_why}, by hidden_size {h}"),
    }


def _linear_attention_shapes(cfg: ModelConfig) -> dict[str, Shapes]:
    h = cfg.hidden_size
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv, kernel = 2 * nk * dk + nv * dv, cfg.linear_conv_kernel_dim
    heads = f"{nk} key heads x {dk} and {nv} value heads x {dv}"
    return {
        "in_proj_qkv.weight": (((conv, h),), f"q, k, v of {heads}, by hidden_size {h}"),
        "in_proj_z.weight": (((nv * dv, h),), f"{nv} value heads x {dv}, by hidden_size {h}"),
        "in_proj_b.weight": (((nv, h),), f"{nv} value heads by hidden_size {h}"),
        "in_proj_a.weight": (((nv, h),), f"{nv} value heads by hidden_size {h}"),
        "in_proj_qkvz.weight": (((conv + nv * dv, h),), f"q, k, v, z of {heads}, by hidden_size {h}"),
        "in_proj_ba.weight": (((2 * nv, h),), f"b and a of {nv} value heads, by hidden_size {h}"),
        "conv1d.weight": (((conv, kernel), (conv, 1, kernel)), f"q, k, v channels of {heads}, by kernel {kernel}"),
        "A_log": (((nv,),), f"{nv} value heads"),
        "dt_bias": (((nv,),), f"{nv} value heads"),
        "norm.weight": (((dv,),), f"value head dim {dv}"),
        "out_proj.weight": (((h, nv * dv),), f"hidden_size {h} by {nv} value heads x {dv}"),
    }


def _mlp_shapes(cfg: ModelConfig, layer: int, rest: str) -> Shapes | None:
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        i = cfg.intermediate_size
        return {"gate_proj.weight": (((i, h),), f"intermediate_size {i} by hidden_size {h}"),
                "up_proj.weight": (((i, h),), f"intermediate_size {i} by hidden_size {h}"),
                "down_proj.weight": (((h, i),), f"hidden_size {h} by intermediate_size {i}"),
                "gate_up_proj.weight": (((2 * i, h),), f"2 x intermediate_size {i} by hidden_size {h}")}.get(rest)
    e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    m = _EXPERT_RE.fullmatch(rest)
    if m is not None:
        if int(m.group(1)) >= e:
            return ((),), f"num_experts {e} (expert {m.group(1)} is one too many)"
        shape = (h, i) if m.group(2) == "down" else (i, h)
        return (shape,), f"moe_intermediate_size {i} and hidden_size {h}"
    return {"gate.weight": (((e, h),), f"num_experts {e} by hidden_size {h}"),
            "gate.bias": (((e,),), f"num_experts {e}"),
            "experts.gate_proj.bias": (((e, i),), f"num_experts {e} by moe_intermediate_size {i}"),
            "experts.up_proj.bias": (((e, i),), f"num_experts {e} by moe_intermediate_size {i}"),
            "experts.down_proj.bias": (((e, h),), f"num_experts {e} by hidden_size {h}"),
            "experts.gate_up_proj": (((e, 2 * i, h),),
                                     f"num_experts {e}, 2 x moe_intermediate_size {i}, hidden_size {h}"),
            "experts.down_proj": (((e, h, i),), f"num_experts {e}, hidden_size {h}, moe_intermediate_size {i}"),
            "shared_expert.gate_proj.weight": (((s, h),), f"shared_expert_intermediate_size {s} by hidden_size {h}"),
            "shared_expert.up_proj.weight": (((s, h),), f"shared_expert_intermediate_size {s} by hidden_size {h}"),
            "shared_expert.down_proj.weight": (((h, s),), f"hidden_size {h} by shared_expert_intermediate_size {s}"),
            "shared_expert_gate.weight": (((1, h), (h,)), f"one gate by hidden_size {h}")}.get(rest)


def required_tensors(cfg: ModelConfig, names: Collection[str]) -> Iterator[str]:
    """The tensors (HF naming) the model code reads for this config, in load order (a generator: a
    caller looking for the first missing one stops there); `names` (what the source has) picks between
    equivalent layouts (fused or per-expert experts, grouped or split GDN projections)."""
    if cfg.encoder:
        yield from _encoder_tensors(cfg)
        return
    yield from ("model.embed_tokens.weight", "model.norm.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        yield from (f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight")
        if cfg.sandwich_norms:
            yield from (f"{p}.pre_feedforward_layernorm.weight", f"{p}.post_feedforward_layernorm.weight")
        if cfg.layer_type(i) == "linear_attention":
            a = f"{p}.linear_attn"
            grouped = f"{a}.in_proj_qkvz.weight" in names
            parts = (("in_proj_qkvz", "in_proj_ba") if grouped
                     else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
            yield from (f"{a}.{x}.weight" for x in (*parts, "conv1d", "norm", "out_proj"))
            yield from (f"{a}.A_log", f"{a}.dt_bias")
        else:
            a = f"{p}.self_attn"
            yield from (f"{a}.{x}_proj.weight" for x in "qkvo")
            if cfg.qk_norm:
                yield from (f"{a}.{x}_norm.weight" for x in "qk")
            if cfg.attention_bias:
                yield from (f"{a}.{x}_proj.bias" for x in "qkv")
            if cfg.attention_sinks:
                yield f"{a}.sinks.weight"
        m = f"{p}.mlp"
        if not cfg.is_moe_layer(i):
            yield from (f"{m}.{x}_proj.weight" for x in ("gate", "up", "down"))
            continue
        yield f"{m}.gate.weight"
        if f"{m}.experts.gate_up_proj" in names:
            yield from (f"{m}.experts.gate_up_proj", f"{m}.experts.down_proj")
        else:
            yield from (f"{m}.experts.{e}.{x}_proj.weight"
                        for e in range(cfg.num_experts) for x in ("gate", "up", "down"))
        if cfg.shared_expert_intermediate_size:
            yield from (f"{m}.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down"))
            yield f"{m}.shared_expert_gate.weight"
