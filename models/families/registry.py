"""The one list of the families nanochat loads. A new family is a FamilySpec in its own file plus a line here;
the lookups read the list when called (a test may register a family for a while by replacing it)."""

from __future__ import annotations

from nanochat.models.config import ModelConfig, merge_text_config
from nanochat.models.families import bert, gemma3, gpt_oss, llama, phi3, qwen2, qwen3, qwen3_moe, qwen3_next, smollm3
from nanochat.models.families.spec import FamilySpec

FAMILIES: list[FamilySpec] = [
    llama.LLAMA,
    llama.MISTRAL,
    qwen2.QWEN2,
    qwen3.QWEN3,
    smollm3.SMOLLM3,
    phi3.PHI3,
    gemma3.GEMMA3,
    qwen3_moe.QWEN3_MOE,
    gpt_oss.GPT_OSS,
    qwen3_next.QWEN3_NEXT,
    qwen3_next.QWEN3_5_MOE,
    qwen3_next.QWEN3_5,
    bert.BERT,
    bert.NOMIC_BERT,
]


def family(name: str) -> FamilySpec:
    """The family of a ModelConfig.arch."""
    found = next((f for f in FAMILIES if f.name == name), None)
    if found is None:
        raise KeyError(f"no model family {name!r}")
    return found


def by_hf_type(model_type: str) -> FamilySpec | None:
    """The family a config.json model_type belongs to, or None."""
    return next((f for f in FAMILIES if model_type == f.name or model_type in f.hf_types), None)


def by_gguf_arch(arch: str) -> FamilySpec | None:
    """The family of a GGUF general.architecture, or None."""
    return next((f for f in FAMILIES if f.gguf_arch is not None and f.gguf_arch == arch), None)


def hf_types() -> list[str]:
    """Every config.json model_type nanochat reads, sorted."""
    return sorted({t for f in FAMILIES for t in (f.name, *f.hf_types)})


def gguf_archs() -> list[str]:
    """Every GGUF general.architecture nanochat reads, sorted."""
    return sorted({f.gguf_arch for f in FAMILIES if f.gguf_arch is not None})


def hf_config(cfg: dict, name: str = "") -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json dict (a multimodal wrapper's text model included)."""
    cfg = merge_text_config(cfg)
    found = by_hf_type(cfg.get("model_type", ""))
    if found is None:
        raise ValueError(f"model_type {cfg.get('model_type')!r} is not supported")
    return ModelConfig.from_hf_dict(cfg, found, name)
