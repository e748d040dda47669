"""The project's one GGUF reader: metadata, tensor infos and zero-copy tensor data over a read-only mmap.

gguf.GGUFReader builds a numpy view for every element of every metadata array (seconds to tens of
seconds on a 150k-token vocabulary) and trusts length fields (a corrupt array length makes it loop
~2**64 times). Here a string array is decoded in one call after one walk over its lengths, a
numeric array with one np.frombuffer, and every length or count is checked against the bytes left
before it is used: a file that is not a readable GGUF raises GGUFError (a ValueError) with a
one-line message that starts with the path, never struct.error / IndexError / UnicodeDecodeError.

Only little-endian GGUF v2 / v3 is read. Every string (keys, values, tensor names) is decoded as
UTF-8 with errors="replace". Metadata values are Python int / float / bool / str scalars, list[str]
for string arrays, numpy arrays (owned copies, independent of the mmap) for numeric arrays, and lists
of those for nested arrays; `to_python` turns any of them into plain Python lists.

Tensor data are views over the file's mmap with the dtype / shape gguf.GGUFReader gives
(`ReaderTensor.data`): F32 / F16 / F64 / I8..I64 as typed arrays in torch order; BF16 and quantized
types as raw uint8 rows [..., bytes_per_row]. The mmap stays open while any view of it is alive.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType

DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
_PREAMBLE = 24                 # magic, version, tensor count, kv count
_MAX_NESTING = 8               # nested arrays: a depth limit instead of a RecursionError on crafted files
_MIN_KV_BYTES = 13             # key length, value type, one-byte value
_MIN_TENSOR_INFO_BYTES = 24    # name length, n_dims, type, offset

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_TYPE_AND_OFFSET = struct.Struct("<IQ")
_SCALARS = {int(vt): struct.Struct(code) for vt, code in (
    (VT.UINT8, "<B"), (VT.INT8, "<b"), (VT.UINT16, "<H"), (VT.INT16, "<h"), (VT.UINT32, "<I"),
    (VT.INT32, "<i"), (VT.FLOAT32, "<f"), (VT.BOOL, "<?"), (VT.UINT64, "<Q"), (VT.INT64, "<q"),
    (VT.FLOAT64, "<d"))}
_ARRAY_DTYPES = {int(vt): np.dtype(code) for vt, code in (
    (VT.UINT8, "u1"), (VT.INT8, "i1"), (VT.UINT16, "<u2"), (VT.INT16, "<i2"), (VT.UINT32, "<u4"),
    (VT.INT32, "<i4"), (VT.FLOAT32, "<f4"), (VT.BOOL, "?"), (VT.UINT64, "<u8"), (VT.INT64, "<i8"),
    (VT.FLOAT64, "<f8"))}
_STRING, _ARRAY = int(VT.STRING), int(VT.ARRAY)
# Tensor types served as typed arrays (as gguf.GGUFReader does); all others as raw uint8 rows.
_TENSOR_DTYPES = {T.F32: np.dtype("<f4"), T.F16: np.dtype("<f2"), T.F64: np.dtype("<f8"),
                  T.I8: np.dtype("i1"), T.I16: np.dtype("<i2"), T.I32: np.dtype("<i4"), T.I64: np.dtype("<i8")}


class GGUFError(ValueError):
    """The file is not a readable little-endian GGUF v2/v3 (one-line message, starting with the path)."""


class _Corrupt(Exception):
    """A bad header field (the detail only); reported as GGUFError "truncated or corrupt GGUF header"."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: ReaderTensor's field names and meanings, with `shape` as a tuple."""

    name: str
    tensor_type: gguf.GGMLQuantizationType   # an IntEnum: int(t.tensor_type) is the raw ggml type
    shape: tuple[int, ...]                   # GGUF order: the row (innermost) dimension first
    n_elements: int
    n_bytes: int
    data_offset: int                         # absolute byte offset of the data in the file
    data: np.ndarray = field(repr=False, compare=False)   # read-only view over the mmap

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return self.shape[::-1]


def to_python(value: Any) -> Any:
    """A metadata value with numpy arrays as lists (nested arrays as nested lists)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        # items of one array share a type, so the first tells whether any need converting
        return [to_python(v) for v in value] if value and not isinstance(value[0], str) else list(value)
    return value


class _Cursor:
    """Bounds-checked little-endian reads over the header; raises _Corrupt."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf, pos: int):
        self.buf, self.pos, self.end = buf, pos, len(buf)

    def take(self, n: int) -> int:
        start = self.pos
        if n > self.end - start:
            raise _Corrupt(f"field at byte {start} runs past the end of the file")
        self.pos = start + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self.take(8))[0]

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        return str(self.buf[start:start + n], "utf-8", "replace")

    def value(self, vtype: int) -> tuple[Any, tuple[int, ...]]:
        """(value, GGUF value types: (vtype,), or (ARRAY, item type...) for arrays)."""
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return scalar.unpack_from(self.buf, self.take(scalar.size))[0], (vtype,)
        if vtype == _STRING:
            return self.string(), (vtype,)
        if vtype == _ARRAY:
            return self.array(0)
        raise _Corrupt(f"unknown metadata value type {vtype} at byte {self.pos - 4}")

    def array(self, depth: int) -> tuple[Any, tuple[int, ...]]:
        """(items, types) of an array whose value-type field has been read; `depth` counts nesting."""
        itype, count = self.u32(), self.u64()
        dtype = _ARRAY_DTYPES.get(itype)
        if dtype is not None:
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).copy(), (_ARRAY, itype)
        if itype not in (_STRING, _ARRAY):
            raise _Corrupt(f"unknown array item type {itype} at byte {self.pos - 12}")
        if count > (self.end - self.pos) // 8:   # every string or array item takes >= 8 bytes
            raise _Corrupt(f"array of {count} items at byte {self.pos} exceeds the file")
        if itype == _STRING:
            return self.strings(count), (_ARRAY, _STRING)
        if depth >= _MAX_NESTING:
            raise _Corrupt(f"arrays nested deeper than {_MAX_NESTING} at byte {self.pos}")
        items, inner = [], (_ARRAY,)
        for i in range(count):
            item, types = self.array(depth + 1)
            items.append(item)
            if i == 0:
                inner = types
        return items, (_ARRAY, *inner)

    def strings(self, count: int) -> list[str]:
        """`count` strings (a vocabulary, merges): one bounds-checked walk over the length fields, then
        the items decoded in one call, each length field's last byte (0: no string is 2**56 bytes long)
        left in as the separator. Items that hold a NUL themselves are decoded one by one instead."""
        buf, start, end = self.buf, self.pos, self.end
        unpack = _U64.unpack_from
        fields = [0] * count   # where each length field starts
        pos = start
        # A memoryview makes unpack_from faster; `with` releases it on the way out, errors included (the
        # mmap cannot be closed while a view of it is alive).
        with memoryview(buf) as view:
            try:
                for i in range(count):   # a length past the end makes the next unpack (or the check below) fail
                    fields[i] = pos
                    pos += 8 + unpack(view, pos)[0]
            except (struct.error, OverflowError):   # OverflowError: a length near 2**64
                bad = fields[i] if fields[i] <= end else fields[i - 1]   # or the field whose length sent us there
                raise _Corrupt(f"field at byte {bad} runs past the end of the file") from None
        if pos > end:
            raise _Corrupt(f"field at byte {fields[-1]} runs past the end of the file")
        self.pos = pos
        if count == 0:
            return []
        region = np.frombuffer(buf, np.uint8, pos - start, start)
        at = np.asarray(fields, dtype=np.int64) - start
        keep = np.ones(len(region), dtype=bool)
        keep[(at[:, None] + np.arange(7)).ravel()] = False
        keep[7] = False   # no separator before the first item
        packed = region[keep]
        if np.count_nonzero(packed == 0) != count - 1:   # a NUL inside an item
            return [str(buf[a + 8:b], "utf-8", "replace") for a, b in zip(fields, fields[1:] + [pos])]
        return packed.tobytes().decode("utf-8", "replace").split("\0")

    def metadata(self, n_kv: int, until: Collection[str] = ()) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
        if n_kv > (self.end - self.pos) // _MIN_KV_BYTES:
            raise _Corrupt(f"metadata count {n_kv} does not fit in the file")
        values: dict[str, Any] = {}
        types: dict[str, tuple[int, ...]] = {}
        missing = set(until)
        for _ in range(n_kv):
            at = self.pos
            key = self.string()
            if key in values:
                raise _Corrupt(f"duplicate metadata key {key!r} at byte {at}")
            values[key], types[key] = self.value(self.u32())
            if missing:
                missing.discard(key)
                if not missing:
                    break
        return values, types

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        n_dims = self.u32()
        if n_dims > MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.take(8 * n_dims))
        ggml_type, offset = _TYPE_AND_OFFSET.unpack_from(self.buf, self.take(_TYPE_AND_OFFSET.size))
        return name, dims, ggml_type, offset


def _open_checked(path: str) -> tuple[mmap.mmap, int, int]:
    """The file's read-only mmap after the preamble checks, with its tensor and metadata counts."""
    with open(path, "rb") as f:
        head = f.read(_PREAMBLE)
        if not head:
            raise GGUFError(f"{path}: empty file, not a GGUF model")
        if head[:4] != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (bad magic {head[:4]!r})")
        if len(head) < _PREAMBLE:
            raise GGUFError(f"{path}: truncated GGUF file ({len(head)} bytes)")
        version = _U32.unpack_from(head, 4)[0]
        if version not in (2, 3):
            if struct.unpack_from(">I", head, 4)[0] in (1, 2, 3):   # a small version number, byte-swapped
                raise GGUFError(f"{path}: big-endian GGUF files are not supported (convert it little-endian "
                                "with llama.cpp's gguf tools)")
            raise GGUFError(f"{path}: unsupported GGUF version {version} (need 2 or 3; the file is corrupt "
                            "or from a newer llama.cpp)")
        n_tensors, n_kv = _U64.unpack_from(head, 8)[0], _U64.unpack_from(head, 16)[0]
        return _map(f), n_tensors, n_kv


def _map(f) -> mmap.mmap:
    """The file mapped read-only, asking for huge pages: a decode step streams gigabytes of weights where
    they lie (the experts of a MoE model), and read in 2 MiB folios they cost one TLB entry per 2 MiB
    instead of 512 (where the kernel and file system support it; elsewhere the advice is ignored)."""
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return mm


def _corrupt(path: str, e: _Corrupt) -> GGUFError:
    return GGUFError(f"{path}: truncated or corrupt GGUF header ({e})")


def read_metadata(path: str | os.PathLike, until: Collection[str] = ()) -> dict[str, Any]:
    """The metadata only (no tensor infos; the file is closed on return). With `until`, reading
    stops once all those keys have been read (cheap when they precede the vocabulary arrays)."""
    path = os.fspath(path)
    mm, _, n_kv = _open_checked(path)
    with mm:
        try:
            return _Cursor(mm, _PREAMBLE).metadata(n_kv, until)[0]
        except _Corrupt as e:
            raise _corrupt(path, e) from None


@dataclass(frozen=True)
class _Layout:
    """A checked tensor info, before the mmap is exported to numpy (so a bad file can close it)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    dims: tuple[int, ...]
    n_elements: int
    n_bytes: int
    start: int
    dtype: np.dtype
    view_shape: tuple[int, ...]


class GGUFFile:
    """A parsed GGUF file. Attributes: `path`, `size`, `version`, `metadata` {key: value},
    `types` {key: GGUF value types, as GGUFReader's field.types}, `alignment`, `data_offset`
    (start of the tensor data section), `tensors` {name: TensorInfo} in file order, and `data`
    (the whole file as a read-only uint8 array over the mmap)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        mm, n_tensors, n_kv = _open_checked(self.path)
        self.size = len(mm)
        self.version = _U32.unpack_from(mm, 4)[0]
        try:
            layouts = self._parse(mm, n_tensors, n_kv)
        except _Corrupt as e:
            mm.close()   # nothing views the map yet: do not leave it open behind the error
            raise _corrupt(self.path, e) from None
        except GGUFError:
            mm.close()
            raise
        self._mm = mm
        self.data = np.frombuffer(mm, np.uint8)
        self.tensors = {t.name: TensorInfo(t.name, t.tensor_type, t.dims, t.n_elements, t.n_bytes, t.start,
                                           self.data[t.start:t.start + t.n_bytes].view(t.dtype).reshape(t.view_shape))
                        for t in layouts}

    def get(self, key: str, default: Any = None) -> Any:
        """One metadata value (numeric arrays as numpy arrays), or `default` when absent."""
        return self.metadata.get(key, default)

    def release(self, name: str) -> None:
        """Drop tensor `name`'s pages from this process's memory (they stay in the page cache, and a later
        read maps them again): for tensors copied elsewhere at load, such as weights repacked for the
        kernels, so the file's pages and the copy are not both counted."""
        t = self.tensors[name]
        page = mmap.PAGESIZE
        lo, hi = -(-t.data_offset // page) * page, (t.data_offset + t.n_bytes) // page * page
        if hi > lo and hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def _parse(self, mm: mmap.mmap, n_tensors: int, n_kv: int) -> list[_Layout]:
        cur = _Cursor(mm, _PREAMBLE)
        self.metadata, self.types = cur.metadata(n_kv)
        self.alignment = self._alignment()
        if n_tensors > (cur.end - cur.pos) // _MIN_TENSOR_INFO_BYTES:
            raise _Corrupt(f"tensor count {n_tensors} does not fit in the file")
        infos = [cur.tensor_info() for _ in range(n_tensors)]
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        layouts, names = [], set()
        for info in infos:
            layout = self._layout(*info)
            if layout.name in names:
                raise _Corrupt(f"duplicate tensor name {layout.name!r}")
            names.add(layout.name)
            layouts.append(layout)
        self._check_packing(layouts)
        return layouts

    def _check_packing(self, layouts: list[_Layout]) -> None:
        """Tensor data must tile the data section as GGUF writers lay it out: each tensor at an aligned
        offset, right after the previous one (padding to the alignment only), none overlapping and no
        unused bytes. A changed data offset, or a type or shape that does not match the bytes a tensor
        was written with, breaks the tiling; without this check it would read a neighbour's bytes."""
        align, expected, previous = self.alignment, self.data_offset, None
        for t in sorted(layouts, key=lambda t: (t.start, t.n_bytes)):
            offset = t.start - self.data_offset
            what = (f"tensor {t.name} ({t.tensor_type.name}, dims {list(t.dims)}, {t.n_bytes:,} bytes "
                    f"at offset {offset:,})")
            if offset % align:
                raise GGUFError(f"{self.path}: {what} is not aligned to {align} bytes; the file is corrupt")
            if t.start < expected:
                raise GGUFError(f"{self.path}: {what} overlaps the data of tensor {previous.name}; a data offset, "
                                f"type or shape in the file is wrong (corrupt file)")
            if t.start > expected:
                after = f"after tensor {previous.name}" if previous else "at the start of the data"
                raise GGUFError(f"{self.path}: {t.start - expected:,} unused bytes {after}, before {what}; a data "
                                f"offset, type or shape in the file is wrong (corrupt file)")
            expected = -(-(t.start + t.n_bytes) // align) * align
            previous = t
        if previous is not None and self.size > expected:
            raise GGUFError(f"{self.path}: {self.size - expected:,} unused bytes after the last tensor "
                            f"({previous.name}, {previous.tensor_type.name}, dims {list(previous.dims)}); a type "
                            f"or shape in the file is wrong, or the file has extra data (corrupt file)")

    def _alignment(self) -> int:
        if "general.alignment" not in self.types:
            return DEFAULT_ALIGNMENT
        align = self.metadata["general.alignment"]
        if self.types["general.alignment"] != (int(VT.UINT32),):
            raise _Corrupt("general.alignment is not a uint32")
        if align == 0 or align & (align - 1):
            raise _Corrupt(f"general.alignment {align} is not a power of two")
        return align

    def _layout(self, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> _Layout:
        try:
            ttype = T(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            raise _Corrupt(f"tensor {name!r} has unknown type {raw_type}") from None
        n_elements = math.prod(dims)
        n_bytes = n_elements * type_size // block
        start = self.data_offset + offset
        if start + n_bytes > self.size:
            raise GGUFError(f"{self.path}: truncated GGUF file (tensor {name} ends at byte {start + n_bytes}, "
                            f"file has {self.size})")
        shape = dims[::-1]
        dtype = _TENSOR_DTYPES.get(ttype)
        if dtype is None:   # BF16 and quantized types: raw bytes, one row of blocks per innermost row
            row = dims[0] if dims else 1
            if row % block:
                raise _Corrupt(f"tensor {name!r} rows of {row} elements are not a multiple of "
                               f"the {ttype.name} block size {block}")
            dtype, shape = np.dtype(np.uint8), (*shape[:-1], row // block * type_size)
        return _Layout(name, ttype, tuple(dims), n_elements, n_bytes, start, dtype, shape)

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"
