"""GGUF weight source: config from metadata, HF-named tensors as memmap views.

Dense tensors (F32/F16/BF16) come back as torch tensors that share memory with the
file's read-only memory map (never modify them in place: copy or move them to a device
first). Quantized 2-D tensors come back as `QuantWeight` whose `data` is a uint8 view of
the raw GGML blocks, one row of blocks per output feature.

llama.cpp's converter permutes the rows of attn_q / attn_k for arch `llama` (ggml's
interleaved-pair RoPE); `get` undoes it so q_proj / k_proj match the HF checkpoint and
work with rotate-half RoPE. The permutation moves whole rows, so quantized blocks are
permuted exactly (a copy of those two tensors only).

Llama-3 style RoPE scaling is stored by llama.cpp as a `rope_freqs.weight` tensor rather than
as metadata. It is exposed as `config.rope_scaling = {"rope_type": "freq_factors",
"freq_factors": [...]}` (head_dim/2 floats): the rotary inverse frequencies are
`inv_freq[i] = 1 / (rope_theta ** (2i / head_dim) * freq_factors[i])`, which equals HF's
llama3 rope. The raw tensor stays reachable with `get_gguf("rope_freqs.weight")`.

MoE and hybrid archs (qwen3moe, qwen3next, qwen35moe, qwen35) undo llama.cpp's converter transforms so
the model code sees HF names and values:
- routed experts `ffn_{gate,up,down}_exps` [E, out, in] (or fused `ffn_gate_up_exps`) are served per
  expert as `mlp.experts.{e}.{gate,up,down}_proj.weight` (QuantWeight views of the raw rows, no copy);
  `expert_stack(prefix, proj)` gives the whole 3-D tensor for the host expert kernels;
- `ssm_a` (= -exp(A_log)) -> `A_log = log(-ssm_a)`; `ssm_dt.bias` -> `dt_bias`; `ssm_conv1d` [C, K];
- Qwen3-Next `ssm_ba` (b and a per key head) -> `in_proj_b` / `in_proj_a`; `attn_qkv` / `attn_gate`
  -> `in_proj_qkv` / `in_proj_z` (the model's split-projection path);
- qwen35*: value heads were reordered from grouped (by key head) to tiled order when nk != nv;
  rows (v part of attn_qkv and conv1d, attn_gate, ssm_beta/alpha, ssm_a, ssm_dt) are put back in
  grouped order, and ssm_out's input columns too (whole blocks when head_v_dim is a multiple of the
  block size, else that one tensor is dequantized);
- norms: GGUF already holds 1 + w, so the config says norm_zero_centred=False.
Layers without a router (`ffn_gate_inp`) are dense MLP layers (config.mlp_only_layers).
"""

from __future__ import annotations

import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch

from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.moe_cpu import StackedWeight
from nanochat.kernels.qweight import QuantWeight
from nanochat.models.config import (ACTIVATIONS, MAX_EXPERTS, ModelConfig, check_config, expected_shapes, fused_rows,
                                    layer_types_from_interval, required_tensors)
from nanochat.models.families import registry
from nanochat.models.formats.gguf_file import GGUFError, GGUFFile, to_python
from nanochat.models.formats.weights import dtype_name, weight_type

T = gguf.GGMLQuantizationType


from nanochat.models.errors import ModelLoadError, missing_path  # noqa: E402  (re-exported for callers)


# The types the kernels read (kernels/gguf_quants.py's one table).
SUPPORTED_TYPES = frozenset(T(t) for t in gq.SUPPORTED_TYPES)

# GGUF block tensors whose HF name is not module + ".weight"/".bias" (hybrid archs).
HYBRID_SPECIAL = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
# Routed experts: GGUF base name -> the projections it holds.
EXPERT_TENSORS = {"ffn_gate_exps": ("gate",), "ffn_up_exps": ("up",), "ffn_down_exps": ("down",),
                  "ffn_gate_up_exps": ("gate", "up")}
# qwen35*: how each tensor's value heads were tiled (see _untile): rows of the v part only
# ("qkv": attn_qkv and conv1d hold q, k, v), all rows ("rows", head_v_dim rows per head; "heads":
# one row per value head), or input columns ("cols").
TILED_V_TENSORS = {"attn_qkv": "qkv", "ssm_conv1d": "qkv", "attn_gate": "rows", "ssm_out": "cols",
                   "ssm_beta": "heads", "ssm_alpha": "heads", "ssm_a": "heads", "ssm_dt": "heads"}


@dataclass(frozen=True)
class _Ref:
    """Where an HF-named tensor comes from: a GGUF tensor and how to turn it into the HF tensor."""

    gguf: str
    kind: str = "plain"   # plain | a_log | ba_b | ba_a | expert | rows
    expert: int = 0       # kind "expert": which expert
    part: int = 0         # kind "expert": row block of a fused gate|up tensor (0 gate, 1 up); "rows": which part
    parts: int = 1


# {arch}.pooling_type -> how an embedding pools the final hidden states (llama.cpp's enum).
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
# SamplingParams name -> general.sampling.* key (min_p has no SamplingParams counterpart).
_SAMPLING_KEYS = {
    "temperature": gguf.Keys.General.SAMPLING_TEMP,
    "top_p": gguf.Keys.General.SAMPLING_TOP_P,
    "top_k": gguf.Keys.General.SAMPLING_TOP_K,
    "repetition_penalty": gguf.Keys.General.SAMPLING_PENALTY_REPEAT,
}
_FLOAT32 = (int(gguf.GGUFValueType.FLOAT32),)

# Checkpoint dtype reported for unquantized files; quantized ones keep the bf16 default.
_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

_MISSING = object()

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)(?:\.(weight|bias))?$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def grouped_from_tiled(nk: int, r: int, head: int) -> torch.Tensor:
    """Index that puts qwen35* tiled value heads back in HF's grouped order: grouped row
    (kh*r + i)*head + d comes from tiled row (i*nk + kh)*head + d."""
    return torch.arange(nk * r * head).reshape(r, nk, head).transpose(0, 1).reshape(-1)


def unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row index r_hf -> row in the GGUF tensor, inverting llama.cpp's q/k permutation.

    llama.cpp stores row h*hd + 2j + i from HF row h*hd + i*hd/2 + j (i in {0,1})."""
    if n_rows % (2 * n_head):
        raise ValueError(f"{n_rows} rows do not split into {n_head} heads of even size")
    idx = torch.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2)
    return idx.transpose(1, 2).reshape(-1)


def _from_numpy(arr: np.ndarray) -> torch.Tensor:
    # The memmap is read-only; torch warns about that once per call. The views are shared
    # on purpose (no copy); callers must not write into them.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class GGUFSource:
    """WeightSource over a single GGUF file (see models/formats/weights.py for the naming)."""

    kind = "gguf"

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.reader = self._open(self.path)   # the parsed file (metadata, tensor infos, mmap)
        self.file_size = self.reader.size
        self.arch = self._str_meta("general.architecture")
        if self.arch is None:
            raise ModelLoadError(f"{self.path}: GGUF has no general.architecture")
        self.family = registry.by_gguf_arch(self.arch)
        if self.family is None:
            raise ModelLoadError(
                f"{self.path}: unsupported GGUF architecture '{self.arch}' "
                f"(supported: {', '.join(registry.gguf_archs())})")
        self._tensors = self.reader.tensors
        self._n_layers: int | None = None
        self._check_tensors()
        self._hf_to_gguf = self._map_names()
        self.config = self._build_config()
        check_config(self.config, self.path, self._config_keys())
        self._check_shapes()

    # ---- opening and validation ----

    @staticmethod
    def _open(path: str) -> GGUFFile:
        if not os.path.exists(path):
            raise missing_path(path)
        if not os.path.isfile(path):
            raise ModelLoadError(f"{path}: not a regular file")
        try:
            return GGUFFile(path)
        except GGUFError as e:  # already one line naming the file
            raise ModelLoadError(str(e)) from None
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None

    def _check_tensors(self) -> None:
        """Types of the tensors the model reads (GGUFFile has checked that the data of every tensor tiles
        the file: in bounds, aligned, no overlap, sizes matching types and shapes)."""
        for t in self._tensors.values():
            if self._hf_name(t.name) is not None and t.tensor_type not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name} has unsupported type {t.tensor_type.name} "
                    f"(supported: {', '.join(sorted(x.name for x in SUPPORTED_TYPES))})")

    def _check_shapes(self) -> None:
        """Every tensor the model reads is present, with the shape its config implies; one line naming
        the tensor, what was expected and what was found."""
        cfg = self.config
        blocks = self._int("block_count")
        for name in self._tensors:
            m = _BLOCK_RE.match(name)
            if m is not None and int(m.group(1)) >= blocks:
                raise ModelLoadError(f"{self.path}: tensor {name} belongs to layer {m.group(1)}, but "
                                     f"{self.arch}.block_count is {blocks} (the file is corrupt)")
        checked: set[str] = set()
        for hf_name, ref in self._hf_to_gguf.items():
            if ref.gguf in checked:
                continue
            checked.add(ref.gguf)
            expected = self._stored_shapes(hf_name, ref)
            if expected is None:
                continue
            shapes, why = expected
            t = self._tensors[ref.gguf]
            if t.torch_shape not in shapes:
                want = " or ".join(str(list(x)) for x in shapes)
                raise ModelLoadError(f"{self.path}: tensor {t.name} has shape {list(t.torch_shape)}, expected {want} "
                                     f"({why}; torch order, GGUF dims are reversed); the file is corrupt or "
                                     "was converted wrongly")
        missing = next((n for n in required_tensors(cfg, self._hf_to_gguf) if n not in self._hf_to_gguf), None)
        if missing is not None:
            raise ModelLoadError(f"{self.path}: tensor {self._gguf_name_for(missing)} is missing; a {self.arch} "
                                 f"model with {cfg.num_hidden_layers} layers needs it (the file is incomplete or "
                                 "corrupt)")

    def _stored_shapes(self, hf_name: str, ref: _Ref):
        """(acceptable torch shapes of GGUF tensor ref.gguf, why), from the shape of what it serves."""
        served = expected_shapes(self.config, hf_name)
        if served is None:
            return None
        shapes, why = served
        if ref.kind in ("ba_b", "ba_a"):   # one tensor holds b and a
            return tuple((2 * s[0], *s[1:]) for s in shapes), why.replace("value heads", "value heads x 2 (b and a)", 1)
        if ref.kind == "expert":           # [E, parts x rows, cols] holds every expert's rows
            e = self.config.num_experts
            return tuple((e, ref.parts * s[0], *s[1:]) for s in shapes if s), f"num_experts {e}, {why}"
        if ref.kind == "rows":             # the fused tensor: every part's rows
            modules = self.family.split_tensors[_BLOCK_RE.match(ref.gguf).group(2)]
            rows = sum(fused_rows(self.config, modules))
            return tuple((rows, *s[1:]) for s in shapes), f"{' + '.join(modules)} rows, {why}"
        return shapes, why

    def _gguf_name_for(self, hf_name: str) -> str:
        """The GGUF tensor that would serve `hf_name` (for messages about a missing one)."""
        for gguf_base, module in self.family.global_tensors.items():
            if hf_name.startswith(module + "."):
                return f"{gguf_base}{hf_name[len(module):]}"
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
        if m is None:
            return hf_name
        layer, rest = m.groups()
        if e := re.fullmatch(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight", rest):
            return f"blk.{layer}.ffn_{e.group(1)}_exps.weight"
        for gguf_base, hf in HYBRID_SPECIAL.items():
            if rest == hf:
                return f"blk.{layer}.{gguf_base}"
        for gguf_base, module in self.family.block_tensors.items():
            if rest.startswith(module + "."):
                return f"blk.{layer}.{gguf_base}{rest[len(module):]}"
        return hf_name

    # ---- names ----

    def _refs_for(self, gguf_name: str) -> list[tuple[str, _Ref]]:
        """The HF names served from one GGUF tensor (none for GGUF-only extras)."""
        if m := _BLOCK_RE.match(gguf_name):
            layer, base, kind = m.groups()
            if int(layer) >= self._num_layers():
                return []   # nextn / MTP blocks
            prefix = f"model.layers.{layer}"
            family = self.family
            if family.hybrid:
                special = HYBRID_SPECIAL.get(base if kind is None else f"{base}.{kind}")
                if special is not None:
                    return [(f"{prefix}.{special}", _Ref(gguf_name, "a_log" if base == "ssm_a" else "plain"))]
                if base == "ssm_ba" and kind == "weight":
                    return [(f"{prefix}.linear_attn.in_proj_b.weight", _Ref(gguf_name, "ba_b")),
                            (f"{prefix}.linear_attn.in_proj_a.weight", _Ref(gguf_name, "ba_a"))]
            if family.moe and base in EXPERT_TENSORS and kind == "weight":
                projs = EXPERT_TENSORS[base]
                dims = self._tensors[gguf_name].shape
                if len(dims) != 3:
                    raise ModelLoadError(f"{self.path}: expert tensor {gguf_name} has dims {list(dims)}, expected "
                                         "3 dims [in, out, experts] (the file is corrupt)")
                n_experts = int(dims[-1])   # GGUF dims are reversed
                if not 0 < n_experts <= MAX_EXPERTS:
                    raise ModelLoadError(f"{self.path}: expert tensor {gguf_name} holds {n_experts} experts "
                                         f"(expected 1 to {MAX_EXPERTS}; the file is corrupt)")
                return [(f"{prefix}.mlp.experts.{e}.{p}_proj.weight", _Ref(gguf_name, "expert", e, i, len(projs)))
                        for e in range(n_experts) for i, p in enumerate(projs)]
            if base in family.split_tensors and kind == "weight":
                modules = family.split_tensors[base]
                return [(f"{prefix}.{module}.weight", _Ref(gguf_name, "rows", part=i, parts=len(modules)))
                        for i, module in enumerate(modules)]
            module = family.block_tensors.get(base)
            if module is None or kind is None:
                return []
            return [(f"{prefix}.{module}.{kind}", _Ref(gguf_name))]
        if m := _GLOBAL_RE.match(gguf_name):
            module = self.family.global_tensors.get(m.group(1))
            return [] if module is None else [(f"{module}.{m.group(2)}", _Ref(gguf_name))]
        return []

    def _hf_name(self, gguf_name: str) -> str | None:
        refs = self._refs_for(gguf_name)
        return refs[0][0] if refs else None

    def _map_names(self) -> dict[str, _Ref]:
        mapping = {}
        for name in self._tensors:
            mapping.update(self._refs_for(name))
        return mapping

    def tensor_names(self) -> list[str]:
        """HF names of every tensor the model uses (GGUF-only extras are left out)."""
        return list(self._hf_to_gguf)

    def gguf_tensor_names(self) -> list[str]:
        """Every tensor in the file, GGUF naming."""
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._hf_to_gguf

    def inventory(self) -> dict[str, dict]:
        """Shape and type of every tensor served, with the GGUF tensor it is (gguf_name) and the converter's
        transform undone on it, where it is one tensor as stored."""
        out = {}
        for name, ref in self._hf_to_gguf.items():
            if ref.kind != "plain":   # a part, a slice or a function of a stored tensor: as served
                t = self.get(name)
                out[name] = {"shape": [int(d) for d in t.shape], "dtype": dtype_name(t)}
                continue
            # The stored tensor (a memmap view) has the served shape and type: the q/k un-permutation only
            # reorders rows, and skipping it avoids copying those tensors.
            t = self.get_gguf(ref.gguf)
            entry = {"shape": [int(d) for d in t.shape], "dtype": dtype_name(t), "gguf_name": ref.gguf}
            if self.family.permute_qk and self._qk_heads(ref.gguf):
                entry["transform"] = "unpermute_qk"
            out[name] = entry
        return out

    def describe(self) -> dict:
        return {"kind": self.kind, "name": os.path.basename(self.path), "arch": self.config.arch,
                "gguf_arch": self.arch, "file_type": self.quant_summary()}

    # ---- tensors ----

    def get(self, name: str) -> torch.Tensor | QuantWeight:
        """The tensor with HF name `name`, with the converter's transforms undone (q/k row order for
        llama; A_log, b/a split, value-head order and per-expert slices for the MoE / hybrid archs)."""
        ref = self._hf_to_gguf.get(name)
        if ref is None:
            raise KeyError(f"{self.path}: no tensor {name!r} in this GGUF")
        if ref.kind == "expert":
            return self._expert_stack(ref.gguf, ref.part, ref.parts).expert(ref.expert)
        w = self.get_gguf(ref.gguf)
        if self.family.permute_qk:
            heads = self._qk_heads(ref.gguf)
            if heads:
                w = self._unpermute(w, heads)
        if self.family.tiled_v_heads:
            w = self._untile(ref.gguf, w)
        if ref.kind == "a_log":
            return torch.log(-w.float())
        if ref.kind in ("ba_b", "ba_a"):
            return self._split_ba(w, ref.kind == "ba_a")
        if ref.kind == "rows":
            rows = fused_rows(self.config, self.family.split_tensors[_BLOCK_RE.match(ref.gguf).group(2)])
            start = sum(rows[:ref.part])
            if isinstance(w, QuantWeight):
                return QuantWeight(w.ggml_type, (rows[ref.part], w.shape[1]), w.data[start:start + rows[ref.part]])
            return w[start:start + rows[ref.part]]
        if name.endswith("shared_expert_gate.weight") and isinstance(w, torch.Tensor) and w.dim() == 1:
            w = w.unsqueeze(0)   # llama.cpp may store the [1, H] gate as a vector
        return w

    def expert_stack(self, prefix: str, proj: str) -> StackedWeight | None:
        """Projection `proj` ("gate" | "up" | "down") of every routed expert under `prefix`
        ("model.layers.{i}.mlp.experts") as one [E, out, in] StackedWeight over the memory map
        (no copy), or None when the layer has no such GGUF tensor."""
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts", prefix)
        if m is None or not self.family.moe:
            return None
        for base, projs in EXPERT_TENSORS.items():
            gname = f"blk.{m.group(1)}.{base}.weight"
            if proj in projs and gname in self._tensors:
                return self._expert_stack(gname, projs.index(proj), len(projs))
        return None

    def _expert_stack(self, gguf_name: str, part: int, parts: int) -> StackedWeight:
        t = self._tensors[gguf_name]
        shape = t.torch_shape
        if len(shape) != 3:
            raise ModelLoadError(f"{self.path}: expert tensor {gguf_name} is {len(shape)}-D, expected 3-D")
        e, rows, cols = shape
        if rows % parts:
            raise ModelLoadError(f"{self.path}: fused expert tensor {gguf_name} has an odd row count {rows}")
        data = _from_numpy(t.data)
        if t.tensor_type == T.BF16:
            data = data.view(torch.bfloat16)
        step = rows // parts
        return StackedWeight(int(t.tensor_type), (e, step, cols), data[:, part * step:(part + 1) * step])

    def peek(self, name: str) -> tuple[int | torch.dtype, tuple[int, ...]]:
        """`name`'s type (a GGML type for blocks, else a torch dtype) and shape as `get` serves it. The tensor itself
        is a view of the file's map, so looking is serving, except for llama's q/k rows, which `get` copies to undo
        their permutation: that only reorders rows, so the stored view answers."""
        ref = self._hf_to_gguf.get(name)
        plain_qk = (ref is not None and ref.kind == "plain" and self.family.permute_qk
                    and not self.family.tiled_v_heads and self._qk_heads(ref.gguf))
        w = self.get_gguf(ref.gguf) if plain_qk else self.get(name)
        return weight_type(w), tuple(w.shape)

    def release(self, name: str) -> None:
        """Let the memory map drop the pages of HF-named tensor `name` (copied elsewhere at load)."""
        ref = self._hf_to_gguf.get(name)
        if ref is not None and ref.kind == "plain":
            self.reader.release(ref.gguf)

    def get_gguf(self, gguf_name: str) -> torch.Tensor | QuantWeight:
        """A tensor by its GGUF name, exactly as stored (no q/k un-permutation)."""
        t = self._tensors.get(gguf_name)
        if t is None:
            raise KeyError(f"{self.path}: no tensor {gguf_name!r} in this GGUF")
        ttype = t.tensor_type
        if ttype not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{self.path}: tensor {t.name} has unsupported type {ttype.name}")
        if ttype in (T.F32, T.F16):
            return _from_numpy(t.data)
        if ttype == T.BF16:  # the reader yields raw bytes [..., 2*n]
            return _from_numpy(t.data).view(torch.bfloat16)
        shape = t.torch_shape
        if len(shape) == 1:  # quantized vectors are rare and small: dequantize them
            deq = gguf.quants.dequantize(np.asarray(t.data), ttype)
            return torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32)).reshape(shape)
        if len(shape) != 2:
            raise ModelLoadError(f"{self.path}: tensor {t.name} is a {len(shape)}-D {ttype.name} "
                                 f"tensor; only 2-D quantized weights are supported")
        return QuantWeight(int(ttype), shape, _from_numpy(t.data))

    def _qk_heads(self, gguf_name: str) -> int:
        m = _BLOCK_RE.match(gguf_name)
        if m is None:
            return 0
        if m.group(2) == "attn_q":
            return self.config.num_attention_heads
        if m.group(2) == "attn_k":
            return self.config.num_key_value_heads
        return 0

    @staticmethod
    def _unpermute(w: torch.Tensor | QuantWeight, n_head: int) -> torch.Tensor | QuantWeight:
        if isinstance(w, QuantWeight):
            perm = unpermute_rows(w.data.shape[0], n_head)
            return QuantWeight(w.ggml_type, w.shape, w.data[perm])
        return w[unpermute_rows(w.shape[0], n_head)]

    def _split_ba(self, w: torch.Tensor | QuantWeight, alpha: bool) -> torch.Tensor | QuantWeight:
        """Qwen3-Next in_proj_ba rows: per key head [b for its r value heads, a for them]."""
        nk, nv = self.config.linear_num_key_heads, self.config.linear_num_value_heads
        r = nv // nk
        rows = (torch.arange(nk).unsqueeze(1) * 2 * r + torch.arange(r) + (r if alpha else 0)).reshape(-1)
        if isinstance(w, QuantWeight):
            return QuantWeight(w.ggml_type, (nv, w.shape[1]), w.data[rows])
        return w[rows]

    def _untile(self, gguf_name: str, w: torch.Tensor | QuantWeight) -> torch.Tensor | QuantWeight:
        """qwen35*: value heads back from tiled order (i*nk + kh) to grouped order (kh*r + i)."""
        m = _BLOCK_RE.match(gguf_name)
        how = TILED_V_TENSORS.get(m.group(2)) if m else None
        cfg = self.config
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if how is None or nk == nv:
            return w
        head = 1 if how == "heads" else cfg.linear_value_head_dim
        perm = grouped_from_tiled(nk, nv // nk, head)
        if how == "qkv":
            perm = torch.cat([torch.arange(2 * nk * cfg.linear_key_head_dim), perm + 2 * nk * cfg.linear_key_head_dim])
        if how != "cols":
            if isinstance(w, QuantWeight):
                return QuantWeight(w.ggml_type, w.shape, w.data[perm])
            return w[perm]
        if isinstance(w, QuantWeight):
            elems, nbytes = gq.BLOCK_SIZES[w.ggml_type]
            if head % elems == 0:   # whole blocks move: permute them inside each row
                blocks = w.data.reshape(w.shape[0], nv, head // elems * nbytes)
                idx = perm.view(nv, head)[:, 0] // head
                return QuantWeight(w.ggml_type, w.shape, blocks[:, idx].reshape(w.data.shape))
            w = gq.dequantize(w, torch.float32)   # blocks straddle heads: this tensor goes dense
        return w[:, perm]

    # ---- metadata ----

    def metadata(self, key: str, default: Any = None) -> Any:
        """A metadata value (str, int, float, bool, or list), or `default` when absent."""
        v = self.reader.get(key, _MISSING)
        return default if v is _MISSING else to_python(v)

    def _str_meta(self, key: str) -> str | None:
        v = self.metadata(key)
        return v if isinstance(v, str) else None

    def _arch_meta(self, suffix: str, default: Any = None, required: bool = False) -> Any:
        key = f"{self.arch}.{suffix}"
        v = self.metadata(key, default)
        if v is None and required:
            raise ModelLoadError(f"{self.path}: missing metadata key {key}")
        if isinstance(v, list):  # per-layer arrays: dense models need one value
            if not v or any(isinstance(x, list) for x in v) or len(set(v)) != 1:
                raise ModelLoadError(f"{self.path}: per-layer values in {key} are not supported")
            v = v[0]
        return v

    def _number(self, key: str, v: Any, integer: bool) -> Any:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            shown = repr(v) if len(repr(v)) < 60 else repr(v)[:57] + "..."
            kind = "an integer" if integer else "a number"
            raise ModelLoadError(f"{self.path}: metadata {key} is {shown}, expected {kind} (the file is corrupt)")
        return v

    def _int(self, suffix: str, default: Any = None, required: bool = False, minimum: int | None = None) -> int | None:
        """An integer {arch}.* value; `minimum` for the ones later values are divided by."""
        key = f"{self.arch}.{suffix}"
        v = self._number(key, self._arch_meta(suffix, default, required), integer=True)
        if v is not None and minimum is not None and v < minimum:
            raise ModelLoadError(f"{self.path}: metadata {key} is {v}, expected at least {minimum} "
                                 "(the file is corrupt)")
        return v

    def _float(self, suffix: str, default: Any = None) -> float | None:
        v = self._number(f"{self.arch}.{suffix}", self._arch_meta(suffix, default), integer=False)
        return None if v is None else float(v)

    def _token_id(self, key: str) -> int | None:
        return self._number(key, self.metadata(key), integer=True)

    def _config_keys(self) -> dict[str, str]:
        """ModelConfig fields -> the metadata keys they come from (for check_config's messages)."""
        a = self.arch
        keys = {"vocab_size": f"{a}.vocab_size (or the number of tokens)",
                "hidden_size": f"{a}.embedding_length", "intermediate_size": f"{a}.feed_forward_length",
                "num_hidden_layers": f"{a}.block_count", "num_attention_heads": f"{a}.attention.head_count",
                "num_key_value_heads": f"{a}.attention.head_count_kv", "head_dim": f"{a}.attention.key_length",
                "rms_norm_eps": f"{a}.attention.layer_norm_{'' if self.family.encoder else 'rms_'}epsilon",
                "rope_theta": f"{a}.rope.freq_base",
                "max_position_embeddings": f"{a}.context_length", "rope_scaling": f"{a}.rope.scaling",
                "partial_rotary_factor": f"{a}.rope.dimension_count", "bos_token_id": "tokenizer.ggml.bos_token_id",
                "eos_token_ids": "tokenizer.ggml.eos_token_id", "num_experts": f"{a}.expert_count",
                "num_experts_per_tok": f"{a}.expert_used_count",
                "moe_intermediate_size": f"{a}.expert_feed_forward_length",
                "shared_expert_intermediate_size": f"{a}.expert_shared_feed_forward_length",
                "linear_num_key_heads": f"{a}.ssm.group_count", "linear_num_value_heads": f"{a}.ssm.time_step_rank",
                "linear_key_head_dim": f"{a}.ssm.state_size", "linear_value_head_dim": f"{a}.ssm.inner_size",
                "linear_conv_kernel_dim": f"{a}.ssm.conv_kernel", "layer_types": f"{a}.full_attention_interval",
                "local_rope_theta": f"{a}.rope.freq_base_swa",
                "final_logit_softcapping": f"{a}.final_logit_softcapping"}
        if "rope_freqs.weight" in self._tensors:
            keys["rope_scaling"] = "tensor rope_freqs.weight"
        return keys

    def _build_config(self) -> ModelConfig:
        hidden = self._int("embedding_length", required=True, minimum=1)
        heads = self._int("attention.head_count", required=True, minimum=1)
        kv_heads = self._int("attention.head_count_kv", heads)
        key_length = self._int("attention.key_length", minimum=1)
        if key_length is None and hidden % heads:
            raise ModelLoadError(f"{self.path}: {self.arch}.embedding_length {hidden} is not a multiple of "
                                 f"{self.arch}.attention.head_count {heads}, and there is no "
                                 f"{self.arch}.attention.key_length (the file is corrupt)")
        head_dim = key_length if key_length is not None else hidden // heads
        rope_dim = self._int("rope.dimension_count")
        if rope_dim is not None and rope_dim != head_dim and not (self.family.hybrid or self.family.partial_rope):
            raise ModelLoadError(f"{self.path}: {self.arch}.rope.dimension_count {rope_dim} differs from the head "
                                 f"size {head_dim}; partial RoPE is not supported for {self.arch}")
        value_length = self._int("attention.value_length", head_dim)
        if value_length != head_dim:
            raise ModelLoadError(f"{self.path}: {self.arch}.attention.value_length {value_length} differs from the "
                                 f"key length {head_dim}; only equal key and value head sizes are supported")
        # As llama.cpp: the vocabulary is the tokenizer's (the embedding must have a row for each token).
        vocab = self._int("vocab_size")
        tokens = self.reader.get("tokenizer.ggml.tokens")
        self._check_token_lists(tokens, vocab)
        if vocab is None and isinstance(tokens, list) and tokens:
            vocab = len(tokens)
        embd = self._tensors.get("token_embd.weight")
        if vocab is None and embd is not None and len(embd.shape) == 2:
            vocab = int(embd.shape[-1])  # GGUF dims are reversed: [hidden, vocab]
        bos = self._token_id("tokenizer.ggml.bos_token_id")
        eos_ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            v = self._token_id(f"tokenizer.ggml.{key}")
            if v is not None and v not in eos_ids:
                eos_ids.append(v)
        ffn = self._int("feed_forward_length", required=not self.family.moe)
        return ModelConfig(
            arch=self.family.name,
            vocab_size=vocab or 0,
            hidden_size=hidden,
            intermediate_size=ffn or 0,
            num_hidden_layers=self._num_layers(),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            # an encoder's LayerNorms: attention.layer_norm_epsilon
            rms_norm_eps=self._float("attention.layer_norm_epsilon" if self.family.encoder
                                     else "attention.layer_norm_rms_epsilon", 1e-6),
            encoder=self.family.encoder,
            rope_theta=self._float("rope.freq_base", 10000.0),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=self._int("context_length", 4096),
            tie_word_embeddings="output.weight" not in self._tensors,
            attention_bias=self.family.attention_bias or self._any_layer_has("attn_q.bias"),
            qk_norm=self._any_layer_has("attn_q_norm.weight"),
            torch_dtype=_DTYPE_NAMES.get(self.quant_summary(), "bfloat16"),
            bos_token_id=bos,
            eos_token_ids=tuple(eos_ids),
            name=self._str_meta("general.name") or os.path.basename(self.path),
            extra={
                "gguf_arch": self.arch,
                "gguf_file_type": self.metadata("general.file_type"),
                "rope_dimension_count": self._arch_meta("rope.dimension_count"),
            },
            **self._moe_config(),
            **self._hybrid_config(head_dim),
            **self._dense_layers(head_dim, rope_dim),
        )

    def _dense_layers(self, head_dim: int, rope_dim: int | None) -> dict[str, Any]:
        """Per-layer attention windows and RoPE flags, partial RoPE, and the family's options (as llama.cpp
        reads them) of the attention-only archs (dense and MoE)."""
        if self.family.hybrid:
            return {}
        n = self._num_layers()
        window = self._int("attention.sliding_window", 0, minimum=0) or 0
        every = self.family.no_rope_interval   # llama.cpp's fixed rule, not a metadata key
        rope = not self.family.absolute_positions
        windowed = self._swa_layers(n) if window else (False,) * n
        out: dict[str, Any] = {"layer_windows": tuple(window if w else 0 for w in windowed),
                               "layer_rope": tuple(rope and (not every or (i + 1) % every != 0) for i in range(n))}
        if self.family.partial_rope and rope_dim is not None:
            out["partial_rotary_factor"] = rope_dim / head_dim
        family = self.family
        hidden, heads = self._int("embedding_length"), self._int("attention.head_count")
        out.update(hidden_act=ACTIVATIONS[family.activations[0]], sandwich_norms=family.sandwich_norms,
                   embed_scale=hidden ** 0.5 if family.embed_scale else 1.0)
        if family.attention_scale is not None:
            out["attention_scale"] = family.attention_scale(n, hidden, heads, head_dim)
        if family.local_rope and any(windowed):
            out["local_rope_theta"] = self._float("rope.freq_base_swa", 10000.0)
        if family.logit_softcapping:
            out["final_logit_softcapping"] = self._float("final_logit_softcapping", 0.0)
        # gpt-oss; llama.cpp fixes its SwiGLU's alpha and limit in code (ModelConfig's defaults)
        out.update(attention_sinks=family.attention_sinks, moe_router=family.moe_router, expert_act=family.expert_act)
        return out

    def _swa_layers(self, n: int) -> tuple[bool, ...]:
        """Which layers the sliding window applies to, as llama.cpp's load_swa_pattern: a per-layer array of
        attention.sliding_window_pattern, or its n (every n-th layer global), else the arch's default."""
        if not self.family.swa_pattern:
            return (True,) * n
        key = f"{self.arch}.attention.sliding_window_pattern"
        pattern = self.metadata(key, self.family.swa_pattern)
        if isinstance(pattern, list):
            if len(pattern) != n or not all(isinstance(v, bool) for v in pattern):
                raise ModelLoadError(f"{self.path}: metadata {key} must list one boolean per layer ({n}) "
                                     "(the file is corrupt)")
            return tuple(pattern)
        pattern = self._number(key, pattern, integer=True)
        if pattern < 0:
            raise ModelLoadError(f"{self.path}: metadata {key} is {pattern}, expected at least 0 (the file is corrupt)")
        return tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(n))

    def _check_token_lists(self, tokens, vocab: int | None) -> None:
        """The token list, its per-token arrays and {arch}.vocab_size agree on the vocabulary size."""
        if not isinstance(tokens, list) or not tokens:
            return
        if vocab is not None and vocab != len(tokens):
            raise ModelLoadError(f"{self.path}: {self.arch}.vocab_size is {vocab}, but tokenizer.ggml.tokens has "
                                 f"{len(tokens)} tokens (the file is corrupt)")
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            values = self.reader.get(key)
            if values is not None and len(values) != len(tokens):
                raise ModelLoadError(f"{self.path}: {key} has {len(values)} entries for {len(tokens)} tokens "
                                     "(the file is corrupt)")

    def _num_layers(self) -> int:
        """Decoder layers: block_count less the trailing multi-token-prediction (nextn) blocks that
        llama.cpp's Qwen3.5 converter appends (their tensors are not served)."""
        if self._n_layers is None:
            blocks = self._int("block_count", required=True, minimum=1)
            if blocks > len(self._tensors):   # every layer has tensors: a bound before anything loops over layers
                raise ModelLoadError(f"{self.path}: {self.arch}.block_count is {blocks}, but the file has only "
                                     f"{len(self._tensors)} tensors (the file is corrupt)")
            nextn = self._int("nextn_predict_layers", 0, minimum=0) or 0
            if nextn >= blocks:
                raise ModelLoadError(f"{self.path}: {self.arch}.nextn_predict_layers {nextn} leaves no decoder layer "
                                     f"of {self.arch}.block_count {blocks} (the file is corrupt)")
            self._n_layers = blocks - nextn
        return self._n_layers

    def _any_layer_has(self, suffix: str) -> bool:
        return any(n.startswith("blk.") and n.endswith("." + suffix) for n in self._tensors)

    def _moe_config(self) -> dict[str, Any]:
        if not self.family.moe:
            return {}
        n_layers = self._num_layers()
        experts = self._int("expert_count", required=True)
        # Layers without a router keep a dense MLP (Qwen3-MoE mlp_only_layers); GGUF has no key for it.
        dense = tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in self._tensors)
        # llama.cpp renormalises unless the file says otherwise
        norm = self.family.norm_topk_prob if self.family.norm_topk_fixed else \
            bool(self._arch_meta("expert_weights_norm", True))
        return dict(
            num_experts=experts,
            num_experts_per_tok=self._int("expert_used_count", required=True),
            moe_intermediate_size=self._int("expert_feed_forward_length", required=True),
            shared_expert_intermediate_size=self._int("expert_shared_feed_forward_length", 0) or 0,
            norm_topk_prob=norm,
            mlp_only_layers=dense,
        )

    def _hybrid_config(self, head_dim: int) -> dict[str, Any]:
        if not self.family.hybrid:
            return {}
        n_layers = self._num_layers()
        interval = self._int("full_attention_interval", 4, minimum=1)
        layer_types = layer_types_from_interval(n_layers, interval)
        for i, kind in enumerate(layer_types):
            if (f"blk.{i}.ssm_out.weight" in self._tensors) != (kind == "linear_attention"):
                raise ModelLoadError(f"{self.path}: layer {i} tensors do not match {self.arch}."
                                     f"full_attention_interval={interval} (expected {kind})")
        nv = self._int("ssm.time_step_rank", required=True, minimum=1)
        inner = self._int("ssm.inner_size", required=True, minimum=1)
        if inner % nv:
            raise ModelLoadError(f"{self.path}: ssm.inner_size {inner} is not a multiple of "
                                 f"ssm.time_step_rank {nv}")
        rope_dim = self._int("rope.dimension_count", head_dim, minimum=1)
        return dict(
            layer_types=layer_types,
            linear_num_key_heads=self._int("ssm.group_count", required=True),
            linear_num_value_heads=nv,
            linear_key_head_dim=self._int("ssm.state_size", required=True),
            linear_value_head_dim=inner // nv,
            linear_conv_kernel_dim=self._int("ssm.conv_kernel", 4),
            partial_rotary_factor=rope_dim / head_dim,
            attn_output_gate=True,
            norm_zero_centred=False,   # the converter stored 1 + w (the GDN norm is plain in both)
        )

    def _rope_scaling(self) -> dict | None:
        if "rope_factors_long.weight" in self._tensors:   # LongRoPE (phi3), as llama.cpp's converter stores it
            factors = {}
            for key in ("short", "long"):
                t = self.get_gguf(f"rope_factors_{key}.weight") if f"rope_factors_{key}.weight" in self._tensors \
                    else None
                if not isinstance(t, torch.Tensor) or t.dim() != 1:
                    raise ModelLoadError(f"{self.path}: LongRoPE needs 1-D float tensors rope_factors_long.weight "
                                         "and rope_factors_short.weight")
                factors[f"{key}_factor"] = t.float().tolist()
            orig = self._int("rope.scaling.original_context_length", required=True, minimum=2)
            return {"rope_type": "longrope", **factors, "original_max_position_embeddings": orig,
                    "attention_factor": self._float("rope.scaling.attn_factor", 1.0)}
        if "rope_freqs.weight" in self._tensors:
            freqs = self.get_gguf("rope_freqs.weight")
            if not isinstance(freqs, torch.Tensor) or freqs.dim() != 1:
                raise ModelLoadError(f"{self.path}: rope_freqs.weight must be a 1-D float tensor")
            return {"rope_type": "freq_factors", "freq_factors": freqs.float().tolist()}
        kind = self._arch_meta("rope.scaling.type")
        if kind in (None, "none"):
            return None
        out: dict[str, Any] = {"rope_type": kind}
        for suffix, hf_key in (("factor", "factor"),
                               ("original_context_length", "original_max_position_embeddings"),
                               ("attn_factor", "attention_factor"),
                               ("yarn_beta_fast", "beta_fast"),
                               ("yarn_beta_slow", "beta_slow")):
            key = f"rope.scaling.{suffix}"
            v = self._number(f"{self.arch}.{key}", self._arch_meta(key), integer=False)
            if v is not None:
                out[hf_key] = v
        if kind == "yarn":
            out["truncate"] = True   # ggml_rope_yarn_corr_dims rounds the correction range out, always
        return out

    # ---- tokenizer side ----

    def tokenizer(self, cache: bool = False):
        """The tokenizer from the tokenizer.ggml.* metadata (or a tokenizer.json beside the file; see
        models/text/tokenizer.load_tokenizer). cache: keep what is slow to build on disk for the next load."""
        from nanochat.models.text.tokenizer import load_tokenizer

        try:
            return load_tokenizer(self.path, self.reader, cache=cache)   # reuses the parsed metadata
        except Exception as e:   # bad tokenizer.ggml.* values: TypeError, IndexError, the tokenizers library's own
            message = " ".join(str(e).split())
            if isinstance(e, (ModelLoadError, OSError)) or (isinstance(e, ValueError) and self.path in message):
                raise
            raise ModelLoadError(f"{self.path}: cannot build the tokenizer from its metadata "
                                 f"({type(e).__name__}: {message[:200]})") from None

    def tokenizer_json(self) -> str | None:
        return None  # built from tokenizer.ggml.* metadata by models/text/tokenizer.py

    def chat_template(self) -> str | None:
        return self._str_meta("tokenizer.chat_template")

    def chat_template_origin(self) -> str:
        return self.path

    def eos_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    def stated_sampling(self) -> dict:
        """The general.sampling.* settings the file states (SamplingParams names, values unchecked)."""
        stated = {}
        for name, key in _SAMPLING_KEYS.items():
            value = self.metadata(key)   # the metadata parsed at load, not a second read of the file
            if isinstance(value, float) and self.reader.types.get(key) == _FLOAT32:
                value = float(str(np.float32(value)))   # 0.6 as written, not float32's 0.6000000238418579
            if value is not None:
                stated[name] = value
        return stated

    def stated_pooling(self) -> str | None:
        """{arch}.pooling_type (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4 rank)."""
        value = self.metadata(f"{self.arch}.pooling_type")
        return POOLING_TYPES.get(value) if isinstance(value, int) and not isinstance(value, bool) else None

    def quant_summary(self) -> str:
        """The dominant tensor type by element count over the 2-D and 3-D (expert) weights (e.g. "Q4_1")."""
        counts: Counter[str] = Counter()
        for gname in {ref.gguf for ref in self._hf_to_gguf.values()}:
            t = self._tensors[gname]
            if len(t.shape) >= 2:
                counts[t.tensor_type.name] += int(t.n_elements)
        return counts.most_common(1)[0][0] if counts else "none"

    def __repr__(self) -> str:
        return f"GGUFSource({self.path!r}, arch={self.arch}, {self.quant_summary()})"
