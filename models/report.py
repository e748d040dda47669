"""What a built model runs on: each weight's type and kernel backend, and whether the CPU fast path
(models/layers/fused_forward.py) applies, with the reason when it does not. `nanochat info` prints it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass
class ModelReport:
    name: str
    arch: str
    layers: int
    hidden: int
    vocab: int
    parameters: int
    weight_bytes: int                     # bytes the linears, embedding and head hold in memory
    projections: dict[str, str]           # "q_proj" -> "Q5_0 q8", counted over all layers
    head: str
    embedding: str
    fused: bool                           # the whole-stack CPU kernel runs every step
    why_not: str | None = None
    isa: str | None = None                # the CPU kernels' code path ("avx512-vnni", "avx2", "scalar")
    attention: str | None = None          # per-layer attention options, when a family has any (attention_layout)
    extra: dict[str, str] = field(default_factory=dict)   # engine-level lines (KV cache, load time)
    sampling_defaults: dict = field(default_factory=dict)  # SamplingParams keywords the model recommends
    card_sampling: dict = field(default_factory=dict)      # those of them from its model card, not its file

    def lines(self) -> list[tuple[str, str]]:
        path = "fused whole-stack CPU kernel" if self.fused else f"module by module ({self.why_not})"
        rows = [("model", f"{self.name} ({self.arch}, {self.layers} layers, hidden {self.hidden}, "
                          f"vocab {self.vocab:,})"),
                ("parameters", f"{self.parameters / 1e6:,.1f} M, {self.weight_bytes / 2**20:,.1f} MiB in memory"),
                ("forward", path)]
        if self.attention:
            rows.append(("attention", self.attention))
        if self.isa:
            rows.append(("CPU kernels", self.isa))
        rows += [(f"  {name}", desc) for name, desc in self.projections.items()]
        rows += [("lm_head", self.head), ("embedding", self.embedding)]
        rows += list(self.extra.items())
        stated = " · ".join(f"{name} {value:g}" for name, value in self.sampling_defaults.items()
                            if name not in self.card_sampling)
        card = " · ".join(f"{name} {value:g}" for name, value in self.card_sampling.items())
        value = stated or "none stated in the model file"
        rows.append(("sampling defaults", f"{value}; its model card's: {card}" if card else value))
        return rows


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe_linear(lin) -> tuple[str, int, int]:
    """'TYPE backend' (segments joined by '+'), parameters, bytes in memory."""
    from nanochat.kernels import gguf_quants as gq

    parts = lin.quant_parts()
    if not parts:
        w = lin.weight
        return f"dense {dtype_name(w.dtype)}", w.numel(), w.numel() * w.element_size()
    types = "+".join(gq.type_name(p.ggml_type) for p in parts)
    backends = sorted({p.backend for p in parts})
    params = sum(p.out_features * p.in_features for p in parts)
    return f"{types} {'/'.join(backends)}", params, sum(p.nbytes() for p in parts)


def attention_layout(cfg) -> str | None:
    """Sliding windows, NoPE layers, partial and LongRoPE in one line (None for plain full attention)."""
    n = cfg.num_hidden_layers
    parts = ["both ways: each position reads its whole input (an encoder)"] if cfg.encoder else []
    for window in sorted({w for w in cfg.layer_windows if w}):
        count = sum(w == window for w in cfg.layer_windows)
        parts.append(f"sliding window {window:,} on {count} of {n} layers")
    if cfg.local_rope_theta and any(cfg.layer_windows):
        parts.append(f"RoPE base {cfg.local_rope_theta:,g} on the windowed layers, {cfg.rope_theta:,g} on the others")
    if not all(cfg.layer_rope) and not cfg.encoder:
        parts.append(f"no RoPE on {sum(not r for r in cfg.layer_rope)} of {n} layers")
    if cfg.rotary_dim != cfg.head_dim and not cfg.encoder:
        parts.append(f"RoPE on {cfg.rotary_dim} of {cfg.head_dim} head dims")
    if (cfg.rope_scaling or {}).get("rope_type") == "longrope":
        parts.append(f"LongRoPE (long factors from position {cfg.rope_scaling['original_max_position_embeddings']:,})")
    return "; ".join(parts) or None


def describe(model) -> ModelReport:
    """The report of a built model (any family: the projections found in its layers are listed)."""
    cfg = model.config
    counts: dict[str, Counter] = {}
    params = nbytes = 0
    from nanochat.models.layers.common import Linear

    for layer in model.layers:
        for name, module in layer.named_modules():
            if not isinstance(module, Linear):
                continue
            desc, p, b = _describe_linear(module)
            key = name.rsplit(".", 1)[-1]
            counts.setdefault(f"experts.{key}" if ".experts." in name else key, Counter())[desc] += 1
            params, nbytes = params + p, nbytes + b
    projections = {name: ", ".join(f"{d}" + (f" x{n}" if len(c) > 1 else "") for d, n in c.most_common())
                   for name, c in counts.items()}
    lm_head = getattr(model, "lm_head", None)
    head, hp, hb = ("none (embeddings only)", 0, 0) if lm_head is None else _describe_linear(lm_head)
    emb = model.embed_tokens
    if emb.packed is not None:
        embedding = "shared with lm_head (rows dequantized on lookup)"
        ep, eb = 0, 0   # counted with the head
    elif emb.quant is not None:
        from nanochat.kernels import gguf_quants as gq
        embedding = f"{gq.type_name(emb.quant.ggml_type)} rows from the file, dequantized on lookup"
        ep, eb = emb.quant.shape[0] * emb.quant.shape[1], 0   # a view of the memory map, read row by row
    else:
        embedding = f"{dtype_name(emb.weight.dtype)} table"
        ep, eb = emb.weight.numel(), emb.weight.numel() * emb.weight.element_size()
    fused = getattr(model, "fused", None)   # the whole-stack CPU kernel, where the model class has one
    isa = None
    if next(model.parameters(), torch.empty(0)).device.type == "cpu":
        from nanochat.kernels import cpu_qgemv
        isa = cpu_qgemv.simd_level() if cpu_qgemv.available() else None
    return ModelReport(
        name=cfg.name, arch=cfg.arch, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
        parameters=params + hp + ep, weight_bytes=nbytes + hb + eb,
        projections=projections, head=head, embedding=embedding,
        fused=fused is not None and fused.usable(),
        why_not="no fused kernel for this family" if fused is None else fused.why_not, isa=isa,
        attention=attention_layout(cfg))
