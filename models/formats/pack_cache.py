"""Packed kernel weights of a model file, kept on disk so that the next load maps them instead of
repacking them; and beside them, other things a load is slow to build (read_cached / write_cached).

The CPU kernels read weights repacked into 16-row tiles (kernels/cpu_qgemv.py). Repacking a 0.5B model
takes seconds and holds a second copy in anonymous memory; llama.cpp maps its file and starts at once.
The first load of a file writes every packed tensor into one cache file; later loads map that file
(read-only pages shared with the page cache, so memory grows only with the pages the kernels touch).

A cache file is keyed by the model's identity (real path, size, modification time of the GGUF file, or of a
Hugging Face folder's config.json and safetensors files) and the kernel sources (the tile layout is theirs), so
an edited model or a new kernel build never reads stale tiles.
Layout: magic, u64 index length, a JSON index {name: [offset, [ggml type, rows,
cols], tile shape]}, then the tensors at 64-byte
aligned offsets (from the first aligned byte after the index). Writes go to a temporary file renamed into place (concurrent loads are safe).

torch is imported only where tiles are handed out or taken in as torch tensors: the lean one-shot
(engine/lean.py) maps the same tiles as numpy arrays (`lookup_array`) and reads the plan the engine kept beside
them (`write_arrays` / `read_arrays`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import struct
import warnings
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

MAGIC = b"NCPACK01"
ALIGN = 64
# The newest cache files are kept up to this many bytes in all (the file just written always stays);
# older ones are deleted when a new one is written.
KEEP_BYTES = 16 << 30
# The same for the other cache files, per kind (file name suffix).
KEEP_OTHER_BYTES = 256 << 20
BLOB_MAGIC = b"NCBLOB01"
# What a load says while it packs a file the cache does not hold yet (3.5 s for a 0.5B model on 2 cores).
REPACKING = "repacking the weights for the CPU kernels (first load of this model, a few seconds)…"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def cache_dir() -> Path:
    from nanochat.kernels.cpp_build import cache_root
    return cache_root() / "packed"


def usable(options) -> bool:
    """Whether a load with these KernelOptions packs for the q8 kernels, the only tiles the cache holds."""
    from nanochat.kernels import cpu_qgemv
    return options.quant_backend in ("auto", "q8") and cpu_qgemv.available()


def _identity_files(model_path: str) -> list[str]:
    """The files whose bytes the packed tiles come from: a GGUF file, or a Hugging Face folder's config.json (it
    says how fused tensors split) and weight files."""
    if not os.path.isdir(model_path):
        return [model_path]
    root = Path(model_path)
    return [str(f) for f in [root / "config.json", *sorted(root.glob("*.safetensors"))] if f.is_file()]


def cache_key(model_path: str) -> str:
    from nanochat import kernels

    h = hashlib.sha256()
    for f in _identity_files(model_path):
        st = os.stat(f)
        h.update(f"{os.path.realpath(f)}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update((Path(kernels.__file__).parent / "csrc" / "qgemv.cpp").read_bytes())   # owns the tile layout
    return h.hexdigest()[:24]


class PackCache:
    """`lookup` maps a tensor's packed tiles from the cache file; `add` records tiles this load packed;
    `save` writes the file when anything was added."""

    def __init__(self, model_path: str, root: Path | None = None, part: str = ""):
        """part: which share of the model this load packs (a tensor-parallel rank's), kept in a file of its own so
        that the ranks do not overwrite each other's."""
        self.root = root or cache_dir()
        self.key = cache_key(model_path)
        self.path = self.root / f"{self.key}{part}.nc-packed"
        self._index: dict[str, tuple[int, list[int], list[int]]] = {}   # name -> offset, [type, rows, cols], tiles
        self._map: mmap.mmap | None = None
        self._used: dict[str, tuple[list[int], torch.Tensor]] = {}   # every tensor of this load
        self._packed_here = False   # some tensor of this load was not in the file: save() rewrites it
        self._open()

    @property
    def missing(self) -> bool:
        """No usable cache file: this load packs every weight (and writes one)."""
        return self._map is None

    def _open(self) -> None:
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return   # no cache yet (or an empty file): pack and write one
        try:
            if self._map[:8] != MAGIC:
                raise ValueError("bad magic")
            (n,) = struct.unpack_from("<Q", self._map, 8)
            index = json.loads(bytes(self._map[16:16 + n]))
            start = _aligned(16 + n)
            self._index = {k: (start + int(v[0]), [int(d) for d in v[1]], [int(d) for d in v[2]])
                           for k, v in index.items()}
            for name, (off, _, tile_shape) in self._index.items():
                if off + math.prod(tile_shape) > len(self._map):
                    raise ValueError(f"{name} runs past the end")
            os.utime(self.path)   # recently used: kept by the pruning in save()
        except (ValueError, TypeError, IndexError, struct.error, UnicodeDecodeError):
            self._map.close()
            self._map = None      # a damaged file is rewritten
            self._index = {}

    def lookup(self, name: str, ggml_type: int, shape: tuple[int, int]) -> torch.Tensor | None:
        """The packed tiles of tensor `name` (a ggml_type weight of `shape`) from the cache file, or None."""
        import torch

        tiles = self.lookup_array(name, ggml_type, shape)
        if tiles is None:
            return None
        with warnings.catch_warnings():   # a read-only map: the kernels never write weights
            warnings.simplefilter("ignore", UserWarning)
            tiles = torch.from_numpy(tiles)
        self._used[name] = ([int(ggml_type), *shape], tiles)
        return tiles

    def lookup_array(self, name: str, ggml_type: int, shape: tuple[int, int]) -> np.ndarray | None:
        """`lookup` as a read-only numpy array over the map (not recorded for `save`)."""
        hit = self._index.get(name)
        if hit is None or self._map is None or hit[1] != [int(ggml_type), *shape]:
            return None
        off, _, tile_shape = hit
        return np.frombuffer(self._map, dtype=np.uint8, count=math.prod(tile_shape), offset=off).reshape(tile_shape)

    def name_of(self, tiles) -> str | None:
        """The name under which this load holds these tiles (a torch tensor: looked up by address), or None."""
        ptr = tiles.data_ptr()
        return next((name for name, (_, t) in self._used.items() if t.data_ptr() == ptr), None)

    def add(self, name: str, ggml_type: int, shape: tuple[int, int], tiles: torch.Tensor) -> None:
        """Tiles this load packed itself: the cache file is (re)written with them by `save()`."""
        self._packed_here = True
        self._used[name] = ([int(ggml_type), *shape], tiles)

    def save(self) -> None:
        """Write every tensor of this load when any of them had to be packed. Best effort: a read-only or
        full disk only means the next load packs again."""
        if not self._packed_here:
            return
        index, off = {}, 0
        for name, (meta, t) in self._used.items():
            index[name] = [off, meta, list(t.shape)]
            off += _aligned(t.numel())
        header = json.dumps(index, separators=(",", ":")).encode()
        start = _aligned(16 + len(header))
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(header)) + header)
                for name, (_, t) in self._used.items():
                    f.seek(start + index[name][0])
                    f.write(memoryview(t.contiguous().numpy()))
            os.replace(tmp, self.path)
            _prune(self.root, "*.nc-packed", KEEP_BYTES)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def _prune(root: Path, pattern: str, keep: int) -> None:
    """Delete the oldest files matching `pattern` beyond `keep` bytes in all (the newest one always stays)."""
    files = sorted(root.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    total = 0
    for i, f in enumerate(files):
        total += f.stat().st_size
        if i and total > keep:
            f.unlink(missing_ok=True)


def write_arrays(name: str, meta: dict, arrays: dict[str, np.ndarray]) -> None:
    """Keep a JSON-able `meta` and named numpy arrays under `name` (write_cached): [u64 header length, JSON
    header {"meta", "arrays": {name: [offset, dtype, shape]}}, the arrays at ALIGN-byte offsets]."""
    index, off = {}, 0
    for key, a in arrays.items():
        index[key] = [off, a.dtype.str, list(a.shape)]
        off += _aligned(a.nbytes)
    header = json.dumps({"meta": meta, "arrays": index}, separators=(",", ":")).encode()
    start = _aligned(8 + len(header))
    body = bytearray(start + off)
    body[:8 + len(header)] = struct.pack("<Q", len(header)) + header
    for key, a in arrays.items():
        at = start + index[key][0]
        body[at:at + a.nbytes] = np.ascontiguousarray(a).tobytes()
    write_cached(name, bytes(body))


def read_arrays(name: str) -> tuple[dict, dict[str, np.ndarray]] | None:
    """What write_arrays kept under `name` (read-only arrays over one buffer), or None when absent or damaged."""
    blob = read_cached(name)
    if blob is None:
        return None
    try:
        (n,) = struct.unpack_from("<Q", blob, 0)
        header = json.loads(blob[8:8 + n])
        start = _aligned(8 + n)
        arrays = {key: np.frombuffer(blob, dtype=np.dtype(dt), count=math.prod(shape), offset=start + off)
                  .reshape(shape) for key, (off, dt, shape) in header["arrays"].items()}
        return header["meta"], arrays
    except (ValueError, TypeError, KeyError, struct.error, UnicodeDecodeError):
        return None


def read_cached(name: str) -> bytes | None:
    """What write_cached kept under `name` (a file name in cache_dir(): key + suffix), or None when there is
    no such file or it is not whole (a damaged file reads as absent, so the caller builds anew)."""
    path = cache_dir() / name
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    head = len(BLOB_MAGIC) + 32
    if blob[:len(BLOB_MAGIC)] != BLOB_MAGIC or hashlib.sha256(blob[head:]).digest() != blob[len(BLOB_MAGIC):head]:
        return None
    with contextlib.suppress(OSError):
        os.utime(path)   # recently used: kept by the pruning
    return blob[head:]


def write_cached(name: str, data: bytes) -> None:
    """Keep `data` under `name` for read_cached: written whole or not at all (a temporary file renamed into
    place), with a checksum. Best effort: a read-only or full disk only means the next load builds again."""
    root = cache_dir()
    path = root / name
    tmp = path.with_name(f"{name}.tmp{os.getpid()}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(BLOB_MAGIC + hashlib.sha256(data).digest() + data)
        os.replace(tmp, path)
        _prune(root, "*" + path.suffix, KEEP_OTHER_BYTES)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
