"""Weight maps: a deterministic plan from checkpoint tensor names to the engine's (fused) parameters.

The engine fuses some projections into one matmul (models/families/dense.py): q, k, v rows are concatenated
into `qkv_proj` (biases too, for Qwen2), gate and up into `gate_up_proj`; everything else is taken
one-to-one, and a tied LM head is read from the embedding. A plan spells that out per target:

    {"format": "nanochat.weight-map", "version": 1,
     "source":  {"kind": "hf" | "gguf", "name": ..., "arch": ..., ...},
     "config":  {...the hyper-parameters the layout depends on...},
     "tensors": {source name: {"shape": [...], "dtype": "bfloat16" | "Q4_1" | ..., "file": shard,
                               "gguf_name": "blk.0.attn_q.weight", "transform": "unpermute_qk"}},
     "targets": {engine name: {"op": "copy" | "concat" | "stack", "sources": [names], "dim": 0,
                               "shape": [...], "dtype": ...}},
     "unused":  [source names no target reads]}

Source names are the WeightSource's Hugging Face names (a GGUF source already renames its tensors and
undoes llama.cpp's q/k row permutation; `gguf_name` and `transform` record that). Shapes are torch
order ([out, in]); a quantized tensor's shape is its logical shape. A target's dtype is the common
dtype of its sources: a GGML type name when every source has that type (rows of GGML blocks are
independent, so concatenation is a byte-level row concatenation), else the dense checkpoint dtype, or
"float32" when types are mixed (the loader dequantizes them). "stack" (MoE experts, one new leading
dim) fits the same schema; a stack source may be a list of names, concatenated along rows first (an
MoE layer's fused w13 = stack over experts of concat(gate_e, up_e)). `plan_json` writes sorted keys with a fixed indent: byte-identical runs.

`apply_plan(plan, source)` produces the target tensors, as the model loader builds them.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from nanochat.kernels.qweight import QuantWeight
from nanochat.models.errors import ModelLoadError
from nanochat.models.formats.weights import dtype_name

PLAN_FORMAT = "nanochat.weight-map"
PLAN_VERSION = 1
OPS = ("copy", "concat", "stack")
DEFAULT_PLAN_NAME = "weights-map.json"

_DENSE_DTYPES = {"float64", "float32", "float16", "bfloat16"}


def _shape(t) -> list[int]:
    return [int(d) for d in t.shape]


# ---------------------------------------------------------------------------------- layout rules
def dense_layout(cfg, names: set[str]) -> list[tuple[str, str, list[str]]]:
    """(target, op, sources) for the dense families, exactly as models/families/dense.py loads them."""
    rules = [("model.embed_tokens.weight", "copy", ["model.embed_tokens.weight"])]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        a, m = f"{p}.self_attn", f"{p}.mlp"
        rules.append((f"{p}.input_layernorm.weight", "copy", [f"{p}.input_layernorm.weight"]))
        rules.append((f"{a}.qkv_proj.weight", "concat", [f"{a}.{x}_proj.weight" for x in "qkv"]))
        if cfg.attention_bias:
            rules.append((f"{a}.qkv_proj.bias", "concat", [f"{a}.{x}_proj.bias" for x in "qkv"]))
        rules.append((f"{a}.o_proj.weight", "copy", [f"{a}.o_proj.weight"]))
        if cfg.qk_norm:
            rules.append((f"{a}.q_norm.weight", "copy", [f"{a}.q_norm.weight"]))
            rules.append((f"{a}.k_norm.weight", "copy", [f"{a}.k_norm.weight"]))
        rules.append((f"{p}.post_attention_layernorm.weight", "copy", [f"{p}.post_attention_layernorm.weight"]))
        if cfg.sandwich_norms:   # Gemma 3 GGUF files
            rules += [(f"{p}.{n}.weight", "copy", [f"{p}.{n}.weight"])
                      for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")]
        rules.append((f"{m}.gate_up_proj.weight", "concat", [f"{m}.gate_proj.weight", f"{m}.up_proj.weight"]))
        rules.append((f"{m}.down_proj.weight", "copy", [f"{m}.down_proj.weight"]))
    rules.append(("model.norm.weight", "copy", ["model.norm.weight"]))
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in names
    rules.append(("lm_head.weight", "copy", ["model.embed_tokens.weight" if tied else "lm_head.weight"]))
    return rules


def layout_for(cfg, names: set[str]) -> list[tuple[str, str, list[str]]]:
    from nanochat.models.families import registry
    from nanochat.models.families.dense import DenseForCausalLM

    dense = sorted(f.name for f in registry.FAMILIES if f.model is DenseForCausalLM)
    if cfg.arch in dense and cfg.norm_zero_centred:   # the loader adds 1 to those norms; a plan only copies
        raise ModelLoadError(f"no weight map for {cfg.arch!r} yet (its checkpoint stores RMSNorm scales as 1 + w)")
    if cfg.arch in dense:
        return dense_layout(cfg, names)
    raise ModelLoadError(f"no weight map for architecture {cfg.arch!r} yet (supported: {', '.join(dense)})")


def _is_quant(dtype: str) -> bool:
    return dtype not in _DENSE_DTYPES and dtype[:1].isupper()


def _target_dtype(dtypes: list[str]) -> str:
    if len(set(dtypes)) == 1:
        return dtypes[0]
    if any(_is_quant(d) for d in dtypes):
        return "float32"   # mixed GGML types: the loader dequantizes
    return str(functools.reduce(torch.promote_types, [getattr(torch, d) for d in dtypes])).removeprefix("torch.")


def _target_shape(op: str, shapes: list[list[int]], dim: int, target: str) -> list[int]:
    first = shapes[0]
    if op == "copy":
        return list(first)
    if op == "stack":
        if any(s != first for s in shapes):
            raise ModelLoadError(f"{target}: cannot stack tensors of shapes {shapes}")
        return first[:dim] + [len(shapes)] + first[dim:]
    rest = [s[:dim] + s[dim + 1:] for s in shapes]
    if any(r != rest[0] or len(s) != len(first) for r, s in zip(rest, shapes)):
        raise ModelLoadError(f"{target}: cannot concatenate tensors of shapes {shapes} along dim {dim}")
    return first[:dim] + [sum(s[dim] for s in shapes)] + first[dim + 1:]


def build_plan(source) -> dict:
    """The weight map of a WeightSource (HFSource or GGUFSource)."""
    described, tensors = source.describe(), source.inventory()
    cfg = source.config
    targets = {}
    used: set[str] = set()
    for target, op, sources in layout_for(cfg, set(tensors)):
        missing = [s for s in sources if s not in tensors]
        if missing:
            raise ModelLoadError(f"{described['name']}: tensor {missing[0]!r} (needed for {target}) "
                                 "is not in the checkpoint")
        used.update(sources)
        shapes = [tensors[s]["shape"] for s in sources]
        dtypes = [tensors[s]["dtype"] for s in sources]
        targets[target] = {"op": op, "sources": list(sources), "dim": 0,
                           "shape": _target_shape(op, shapes, 0, target), "dtype": _target_dtype(dtypes)}
    config = {"arch": cfg.arch, "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
              "vocab_size": cfg.vocab_size, "tie_word_embeddings": bool(cfg.tie_word_embeddings),
              "attention_bias": bool(cfg.attention_bias), "qk_norm": bool(cfg.qk_norm)}
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "source": described, "config": config,
            "tensors": tensors, "targets": targets, "unused": sorted(set(tensors) - used)}


def make_plan(model: str) -> dict:
    """The weight map of a model reference (.gguf file, HF folder or hub id)."""
    from nanochat.models.formats.loader import open_source

    return build_plan(open_source(model))


# ---------------------------------------------------------------------------------- serialisation
def plan_json(plan: dict) -> str:
    return json.dumps(plan, sort_keys=True, indent=2, ensure_ascii=True) + "\n"


def write_plan(plan: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(plan_json(plan))
    os.replace(tmp, path)   # never leave a half-written plan behind
    return path


def read_plan(path: str | os.PathLike) -> dict:
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the weight map ({e.__class__.__name__}: {e})") from None
    check_plan(plan, str(path))
    return plan


def check_plan(plan: dict, where: str = "weight map") -> None:
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise ValueError(f"{where}: not a nanochat weight map")
    if plan.get("version") != PLAN_VERSION:
        raise ValueError(f"{where}: weight map version {plan.get('version')!r}, expected {PLAN_VERSION}")
    for name, t in plan.get("targets", {}).items():
        if t.get("op") not in OPS:
            raise ValueError(f"{where}: target {name!r} has unknown op {t.get('op')!r}")
        if not t.get("sources"):
            raise ValueError(f"{where}: target {name!r} has no sources")


def engine_param_name(target: str) -> str:
    """The target's name among the model module's parameters (DenseForCausalLM has no `model.`)."""
    return target.removeprefix("model.")


# ---------------------------------------------------------------------------------- applying a plan
def _fetch(source, plan: dict, name: str):
    t = source.get(name)
    expect = plan["tensors"].get(name)
    if expect is not None and (_shape(t) != expect["shape"] or dtype_name(t) != expect["dtype"]):
        raise ValueError(f"tensor {name!r} is {dtype_name(t)} {_shape(t)} but the weight map says "
                         f"{expect['dtype']} {expect['shape']}; rebuild the map (nanochat convert-model)")
    return t


def _dense(t) -> torch.Tensor:
    if isinstance(t, QuantWeight):
        from nanochat.kernels.gguf_quants import dequantize
        return dequantize(t, torch.float32)
    return t


def apply_plan(plan: dict, source, dequantize: bool = False, dtype: torch.dtype | None = None,
               only: list[str] | None = None) -> dict[str, torch.Tensor | QuantWeight]:
    """Build the plan's target tensors from `source`.

    Quantized targets (every source of one GGML type) come back as a QuantWeight (concat: rows of
    blocks concatenated; stack: a uint8 tensor [n, rows, bytes_per_row]) unless `dequantize`; dense
    ones as tensors in the target's dtype (or `dtype`). `only` limits the work to some targets.

    A "stack" source may itself be a list of names, concatenated along rows first: an MoE layer's
    fused w13 is stack over experts of concat(gate_e, up_e)."""
    check_plan(plan)
    out = {}
    for name in (only if only is not None else plan["targets"]):
        spec = plan["targets"][name]
        op, dim = spec["op"], spec.get("dim", 0)
        keep_quant = not dequantize and _is_quant(spec["dtype"])
        parts = []
        for entry in spec["sources"]:
            if isinstance(entry, list):   # a row-concatenated group (stack only)
                group = [_fetch(source, plan, s) for s in entry]
                parts.append(_join(group, "concat", 0, name, keep_quant, dtype, spec["dtype"]))
            else:
                parts.append(_fetch(source, plan, entry))
        out[name] = _join(parts, op, dim, name, keep_quant, dtype, spec["dtype"])
        if list(out[name].shape) != spec["shape"]:
            raise ValueError(f"target {name!r}: built shape {list(out[name].shape)}, the map says {spec['shape']}")
    return out


def _join(parts: list, op: str, dim: int, name: str, keep_quant: bool, dtype, plan_dtype: str):
    if keep_quant and all(isinstance(p, QuantWeight) for p in parts):
        return _join_quant(op, parts, dim, name)
    want = dtype or (torch.float32 if _is_quant(plan_dtype) else getattr(torch, plan_dtype))
    dense = [_dense(p).to(want) for p in parts]
    if op == "copy":
        return dense[0]
    return torch.cat(dense, dim) if op == "concat" else torch.stack(dense, dim)


def _join_quant(op: str, parts: list[QuantWeight], dim: int, name: str):
    if op == "copy":
        return parts[0]
    if op == "stack":
        return torch.stack([p.data for p in parts], dim)
    if dim != 0:
        raise ValueError(f"target {name!r}: quantized tensors concatenate along rows (dim 0) only")
    rows = sum(p.shape[0] for p in parts)
    return QuantWeight(parts[0].ggml_type, (rows, parts[0].shape[1]), torch.cat([p.data for p in parts]))
