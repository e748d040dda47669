"""Hugging Face checkpoint folders: config.json, *.safetensors (sharded or not), tokenizer files.

Hub ids (`Qwen/Qwen3-0.6B`) are resolved through huggingface_hub's cache, downloading when online.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from nanochat.models.config import check_config, expected_shapes, fused_rows, required_tensors
from nanochat.models.errors import ModelLoadError
from nanochat.models.families import registry
from nanochat.models.formats.hf_text import FolderText, read_json
from nanochat.models.formats.hub_gguf import hub_cache_dir, hub_endpoint, hub_error
from nanochat.models.formats.weights import weight_type

# Multimodal checkpoints keep the text model under `model.language_model.` (Qwen3.5/3.6, Gemma 3 from
# transformers 4.52 on) or `language_model.model.` (Gemma 3 before); we expose it under the plain text names
# (`model.`) and hide the vision towers, projectors and the multi-token-prediction head.
_PREFIX_MAP = (("model.language_model.", "model."), ("language_model.model.", "model."),
               ("language_model.lm_head.", "lm_head."),
               # a base model saved alone (transformers' AutoModel: embedding models such as Qwen3-Embedding)
               ("embed_tokens.", "model.embed_tokens."), ("layers.", "model.layers."), ("norm.", "model.norm."))
_SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.", "vision_tower.", "model.vision_tower.",
                     "multi_modal_projector.", "model.multi_modal_projector.")
# safetensors dtypes the model code reads as weights (anything else would be reinterpreted as floats).
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# safetensors dtype -> torch's name for it (the inventory's dtypes, as a torch tensor's).
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _torch_dtype(dtype: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype name, None where torch has none."""
    found = getattr(torch, _DTYPE_NAMES.get(dtype, ""), None)
    return found if isinstance(found, torch.dtype) else None


def canonical_name(stored: str, family=None) -> str | None:
    """Our (text-model HF) name for a checkpoint tensor name, or None for tensors we never use; `family`: the
    FamilySpec, whose own name map (hf_name) wins where it has one."""
    if family is not None and family.hf_name is not None:
        return family.hf_name(stored)
    if stored.startswith(_SKIPPED_PREFIXES):
        return None
    for old, new in _PREFIX_MAP:
        if stored.startswith(old):
            return new + stored[len(old):]
    return stored


class HFSource(FolderText):
    """WeightSource over a Hugging Face folder (see models/formats/weights.py); its tokenizer side is FolderText's."""

    kind = "hf"

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        root = Path(path)
        if not root.is_dir():
            raise ModelLoadError(f"{root}: not a model folder")
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{root}: no config.json (not a Hugging Face model folder)")
        raw = read_json(cfg_path)
        # A wrapper of a supported text model keeps its config under text_config; from_hf_dict merges
        # text_config itself when the wrapper is a family we know (Qwen3.5/3.6).
        supported = registry.hf_types()
        raw = raw.get("text_config", raw) if raw.get("model_type") not in supported else raw
        arch = raw.get("model_type")
        if arch not in supported:
            raise ModelLoadError(f"{cfg_path}: unsupported architecture {arch!r} "
                                 f"(supported: {', '.join(supported)})")
        try:
            self.config = registry.hf_config(raw, name=root.name)
        except KeyError as e:
            raise ModelLoadError(f"{cfg_path}: missing key {e}") from None
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ModelLoadError(f"{cfg_path}: bad value ({e})") from None
        check_config(self.config, str(cfg_path))
        self.family = registry.family(self.config.arch)
        self.root = root
        self._where = self._index_tensors(root, self.family)
        self.file_size = sum(f.stat().st_size for f in {f for f, _ in self._where.values()})
        self._parts = self._split_fused()
        # A family's views of tensors stored in another layout (gpt-oss's experts): the stored ones are read
        # through them only, a few kept while a layer's experts are read one by one.
        self._views = self.family.hf_views(self._where.keys(), self.config) if self.family.hf_views else {}
        self._hidden = {s for stored, _ in self._views.values() for s in stored}
        self._recent: dict[str, torch.Tensor] = {}
        self._handles: dict[Path, object] = {}
        self._layouts: dict[Path, dict[str, tuple[str, list[int], int]]] = {}
        self._check_tensors(cfg_path)

    def _handle(self, f: Path):
        if f not in self._handles:
            try:
                self._handles[f] = safe_open(f, "pt")
            except Exception as e:   # safetensors raises several error types for bad headers
                raise ModelLoadError(f"{f}: corrupt safetensors file ({e})") from None
        return self._handles[f]

    def _layout(self, f: Path) -> dict[str, tuple[str, list[int], int]]:
        """Each tensor of file `f`: (dtype, shape, its first byte in the file), from the header safe_open checked
        (offsets within the file, sizes that fit the shapes)."""
        if f not in self._layouts:
            self._handle(f)
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
            self._layouts[f] = {name: (t["dtype"], t["shape"], 8 + size + t["data_offsets"][0])
                                for name, t in header.items() if name != "__metadata__"}
        return self._layouts[f]

    def _entry(self, f: Path, stored: str) -> tuple[str, list[int], int]:
        """(dtype, shape, first byte in the file) of stored tensor `stored` of file `f`."""
        try:
            return self._layout(f)[stored]
        except KeyError:
            raise ModelLoadError(f"{f}: cannot read tensor {stored!r} (not in the file)") from None

    def _read(self, f: Path, stored: str, start: int = 0, rows: int | None = None) -> torch.Tensor:
        """Stored tensor `stored` (rows [start, start + rows) of it) read into memory of its own. safe_open's
        tensors are views of its map of the file, whose pages stayed resident beside the packed copies the
        kernels made of them, at the load's peak and after it (benchmarks/README.md, "Hugging Face folders on
        the CPU kernels"); a read copy goes once it is packed."""
        dtype, shape, first = self._entry(f, stored)
        torch_dtype = _torch_dtype(dtype)
        if torch_dtype is None:   # a type torch has no name for: the library's own reading
            t = self._handle(f).get_slice(stored)
            return t[start:start + rows] if rows is not None else t[:]
        rows = (shape[0] - start if shape else 0) if rows is None else rows
        out = torch.empty((rows, *shape[1:]) if shape else (), dtype=torch_dtype)
        data = out.view(-1).view(torch.uint8).numpy()
        with open(f, "rb") as fh:
            fh.seek(first + start * math.prod(shape[1:]) * out.element_size())
            if fh.readinto(data) != data.nbytes:
                raise ModelLoadError(f"{f}: tensor {stored!r} runs past the end of the file")
        return out

    def _check_tensors(self, cfg_path: Path) -> None:
        """Every tensor the model reads is present, a float type, and of the shape config.json implies
        (read from the safetensors headers: no tensor data is touched)."""
        cfg = self.config
        have = set(self.tensor_names())
        missing = next((n for n in required_tensors(cfg, have) if n not in have), None)
        if missing is not None:
            raise ModelLoadError(f"{self.root}: tensor {missing} is missing; a {cfg.arch} model with "
                                 f"{cfg.num_hidden_layers} layers needs it (incomplete checkpoint?)")
        for name, (f, stored) in self._where.items():
            expected = None if name in self._hidden else expected_shapes(cfg, name)
            if expected is None:
                continue
            dtype, shape, _ = self._entry(f, stored)
            shape = tuple(shape)
            shapes, why = expected
            if shape not in shapes:
                want = " or ".join(str(list(x)) for x in shapes)
                raise ModelLoadError(f"{f}: tensor {stored} has shape {list(shape)}, expected {want} ({why}, "
                                     f"from {cfg_path.name}); the checkpoint does not match its config")
            if dtype not in _FLOAT_DTYPES:
                raise ModelLoadError(f"{f}: tensor {stored} has dtype {dtype}; supported: {', '.join(_FLOAT_DTYPES)}")

    @staticmethod
    def _index_tensors(root: Path, family=None) -> dict[str, tuple[Path, str]]:
        """Our tensor name -> (file, name stored in that file)."""
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map", {})
            stored = {name: root / fname for name, fname in weight_map.items()}
            for f in set(stored.values()):
                if not f.is_file():
                    raise ModelLoadError(f"{f}: shard listed in {index.name} is missing")
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"{root}: no *.safetensors weights")
            stored = {}
            for f in files:
                try:
                    with safe_open(f, "pt") as handle:
                        stored.update({name: f for name in handle.keys()})
                except Exception as e:   # safetensors raises several error types for bad headers
                    raise ModelLoadError(f"{f}: corrupt safetensors file ({e})") from None
        where = {}
        for name, f in stored.items():
            ours = canonical_name(name, family)
            if ours is not None:
                where[ours] = (f, name)
        return where

    def _split_fused(self) -> dict[str, tuple[str, int, int]]:
        """A family's fused checkpoint tensors (Phi-3's qkv_proj, gate_up_proj) served as the Llama tensors
        they hold: name -> (fused tensor, first row, rows)."""
        fused = self.family.hf_fused
        parts = {}
        for name in self._where if fused else ():
            m = re.fullmatch(r"(model\.layers\.\d+)\.(.+)\.weight", name)
            modules = fused.get(m.group(2)) if m else None
            start = 0
            for module, rows in zip(modules or (), fused_rows(self.config, modules or ())):
                parts[f"{m.group(1)}.{module}.weight"] = (name, start, rows)
                start += rows
        return parts

    def tensor_names(self) -> list[str]:
        return [*(n for n in self._where if n not in self._hidden), *self._parts, *self._views]

    def get(self, name: str) -> torch.Tensor:
        if name in self._views:
            stored, view = self._views[name]
            return view(*(self._stored(n) for n in stored))
        if name in self._parts:
            fused, start, rows = self._parts[name]
            f, stored = self._where[fused]
            return self._read(f, stored, start, rows)
        if name not in self._where:
            raise ModelLoadError(f"{self.root}: tensor {name!r} not found in the checkpoint")
        f, stored = self._where[name]
        try:
            return self._read(f, stored)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{f}: cannot read tensor {stored!r} ({e})") from None

    def peek(self, name: str) -> tuple[int | torch.dtype, tuple[int, ...]]:
        """`name`'s dtype (a GGML type for a family's view of blocks) and shape as `get` serves it, from the
        safetensors header: nothing is read (a read is a copy, which a load that finds the packed tiles in the pack
        cache never needs)."""
        if name in self._parts:
            fused, _, rows = self._parts[name]
            dtype, shape = self.peek(fused)
            return dtype, (rows, *shape[1:])
        if name in self._where and name not in self._hidden:
            f, stored = self._where[name]
            dtype, shape, _ = self._entry(f, stored)
            torch_dtype = _torch_dtype(dtype)
            if torch_dtype is not None:
                return torch_dtype, tuple(int(d) for d in shape)
        w = self.get(name)   # a family's view, a type torch has no name for, or a missing name (get's error)
        return weight_type(w), tuple(w.shape)

    def _stored(self, name: str) -> torch.Tensor:
        """A tensor behind a view, the last few kept (a layer's experts are read one at a time)."""
        if name not in self._recent:
            layer = re.match(r"model\.layers\.\d+\.|", name).group()
            if len(self._recent) >= 8 or any(not n.startswith(layer) for n in self._recent):
                self._recent.clear()   # another layer's: the views read a layer's tensors together
            f, stored = self._where[name]
            try:
                self._recent[name] = self._read(f, stored)
            except ModelLoadError:
                raise
            except Exception as e:
                raise ModelLoadError(f"{f}: cannot read tensor {stored!r} ({e})") from None
        return self._recent[name]

    def inventory(self) -> dict[str, dict]:
        """Shape, dtype and shard of every stored tensor, from the safetensors headers (no tensor is read); a
        part of a fused tensor has no shard of its own."""
        out = {}
        for name in [*self._where, *self._parts]:
            if name in self._parts:
                fused, _, rows = self._parts[name]
                stored = self._header(fused)
                out[name] = {"shape": [rows, *stored["shape"][1:]], "dtype": stored["dtype"]}
            else:
                out[name] = self._header(name)
        return out

    def _header(self, name: str) -> dict:
        f, stored = self._where[name]
        dtype, shape, _ = self._entry(f, stored)
        return {"shape": [int(d) for d in shape], "dtype": _DTYPE_NAMES.get(dtype, dtype.lower()),
                "file": str(f.relative_to(self.root))}

    def expert_stack(self, prefix: str, proj: str) -> None:
        """Checkpoints store experts one tensor each (or fused gate|up): no 3-D stacks to map."""
        return None

    def release(self, name: str) -> None:
        """Nothing to drop: tensors are read into memory of their own (`_read`), not served from a kept map (the
        few kept for views go when the views of another layer are read)."""

    def describe(self) -> dict:
        return {"kind": self.kind, "name": self.root.name, "arch": self.config.arch, "dtype": self.config.torch_dtype}

    def eos_ids(self) -> tuple[int, ...]:
        return (*self.config.eos_token_ids, *self.generation_eos_ids())


def resolve_hub_id(model: str) -> str:
    """Local folder for a hub id: the HF cache if present, else a download (needs network)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt"]
    # read now: huggingface_hub reads HF_HUB_CACHE and HF_ENDPOINT when it is imported
    cache_dir, endpoint = str(hub_cache_dir()), hub_endpoint()
    try:
        return snapshot_download(model, allow_patterns=patterns, local_files_only=True, cache_dir=cache_dir)
    except Exception:
        pass
    try:
        return snapshot_download(model, allow_patterns=patterns, cache_dir=cache_dir, endpoint=endpoint)
    except Exception as e:
        raise hub_error(model, e, "it is not a local path, nor in the cache") from None
