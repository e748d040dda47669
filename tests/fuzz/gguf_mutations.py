"""Seeded mutations of a small GGUF model file, each with what a correct loader must do with it.

A file is parsed once (with gguf-py's reader, independent of the loader under test) into a `Layout`
(header, key/values, tensor infos, data section), mutated at that level and written back with
`serialize`, which lays the data section out as GGUF writers do (aligned after the header). Each
mutation says whether the result is still a consistent model file:

    "fail"    the file is inconsistent (a shape, type, offset, count or hyper-parameter that does not
              fit): the loader must refuse it with a clean one-line error;
    "either"  the file is still consistent (a changed name, template, context length, weight bytes,
              two same-size tensors swapped...): loading may succeed, or fail cleanly.

The oracle is written from the GGUF format and the architecture's rules, not from the loader's code.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import gguf

T = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType

_SCALAR = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
           VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}
_INT_TYPES = (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64)
_FLOAT_TYPES = (VT.FLOAT32, VT.FLOAT64)
# Tensor types nanochat runs (a spec of the project: dense floats and the GGML quants it has kernels for).
RUNNABLE_TYPES = {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q8_1,
                  T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}


@dataclass(frozen=True)
class KV:
    key: str
    vtype: int
    value: Any
    itype: int | None = None      # item type of an array


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]        # GGUF order
    ttype: int
    offset: int                   # relative to the data section


@dataclass
class Layout:
    version: int
    kvs: list[KV]
    tensors: list[Tensor]
    data: bytes
    magic: bytes = b"GGUF"
    n_kv: int | None = None       # header counts; None: the real ones
    n_tensors: int | None = None
    tail: bytes = b""             # appended after the data section

    def copy(self, **changes) -> "Layout":
        return replace(self, kvs=list(self.kvs), tensors=list(self.tensors), **changes)

    def kv(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    @property
    def alignment(self) -> int:
        kv = self.kv("general.alignment")
        if kv is None or kv.vtype != VT.UINT32 or not isinstance(kv.value, int) or kv.value <= 0 \
                or kv.value & (kv.value - 1):
            return 32
        return kv.value


def parse(raw_path) -> Layout:
    r = gguf.GGUFReader(raw_path)
    kvs = []
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = f.types[0]
        if vtype == VT.ARRAY:
            kvs.append(KV(key, VT.ARRAY, list(f.contents()), f.types[-1]))
        else:
            kvs.append(KV(key, vtype, f.contents()))
    tensors = [Tensor(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset - r.data_offset))
               for t in r.tensors]
    raw = open(raw_path, "rb").read()
    version = struct.unpack_from("<I", raw, 4)[0]
    return Layout(version, kvs, tensors, raw[r.data_offset:])


def _string(text: str | bytes) -> bytes:
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value: Any, itype: int | None) -> bytes:
    if vtype == VT.STRING:
        return _string(value)
    if vtype == VT.ARRAY:
        items = b"".join(_value(itype, v, None) for v in value)
        return struct.pack("<IQ", itype, len(value)) + items
    return struct.pack(_SCALAR[vtype], value)


def serialize(layout: Layout) -> bytes:
    out = [layout.magic, struct.pack("<I", layout.version),
           struct.pack("<Q", len(layout.tensors) if layout.n_tensors is None else layout.n_tensors),
           struct.pack("<Q", len(layout.kvs) if layout.n_kv is None else layout.n_kv)]
    for kv in layout.kvs:
        out.append(_string(kv.key) + struct.pack("<I", kv.vtype) + _value(kv.vtype, kv.value, kv.itype))
    for t in layout.tensors:
        out.append(_string(t.name) + struct.pack(f"<I{len(t.dims)}QIQ", len(t.dims), *t.dims, t.ttype, t.offset))
    head = b"".join(out)
    head += b"\0" * (-len(head) % layout.alignment)
    return head + layout.data + layout.tail


# ---------------------------------------------------------------------------------- the layout oracle

def tensor_bytes(t: Tensor) -> int | None:
    """The data size of a tensor, or None when its type / row length is not a valid GGML layout."""
    try:
        block, size = gguf.GGML_QUANT_SIZES[T(t.ttype)]
    except (ValueError, KeyError):
        return None
    if len(t.dims) > 4:
        return None
    n = math.prod(t.dims)
    row = t.dims[0] if t.dims else 1
    if row % block:
        return None
    return n * size // block


def tiles(layout: Layout) -> bool:
    """Whether the tensors' data tile the data section exactly as GGUF writers lay it out (aligned,
    back to back, padding only, nothing past the end, nothing unused after the last one)."""
    align = layout.alignment
    spans = []
    for t in layout.tensors:
        n = tensor_bytes(t)
        if n is None:
            return False
        spans.append((t.offset, n))
    pos = 0
    for offset, n in sorted(spans):
        if offset != pos:
            return False
        pos = -(-(offset + n) // align) * align
    size = len(layout.data) + len(layout.tail)
    return max((o + n for o, n in spans), default=0) <= size <= pos


# ---------------------------------------------------------------------------------- mutations

@dataclass
class Case:
    what: str
    layout: Layout
    expect: str        # "fail" | "either"
    raw: bytes | None = None   # when the mutation is on the serialized bytes

    def content(self) -> bytes:
        return self.raw if self.raw is not None else serialize(self.layout)


@dataclass
class Model:
    """What the base file is: its arch and the hyper-parameters the oracle needs."""

    arch: str
    vocab: int
    shape_keys: tuple[str, ...] = field(default=())   # keys whose value fixes tensor shapes
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)   # integer keys free within [low, high]


def _special_ints(rng: random.Random, orig: int) -> list[int]:
    return [0, 1, orig + 1, max(orig - 1, 0), orig * 2, 2**31 - 1, 2**32 - 1, rng.randrange(2**32)]


def _special_floats(orig: float) -> list[float]:
    return [0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e30, -1e-6, orig * 2, orig / 2, 1.5]


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fits(vtype: int, value) -> bool:
    if vtype in _FLOAT_TYPES:
        return isinstance(value, float)
    if vtype == VT.BOOL:
        return isinstance(value, bool)
    fmt = _SCALAR.get(vtype)
    if fmt is None or not isinstance(value, int):
        return False
    try:
        struct.pack(fmt, value)
    except struct.error:
        return False
    return True


class Mutator:
    """Seeded mutations of one base file. `next()` gives a Case."""

    def __init__(self, base: Layout, model: Model, seed: int):
        self.base, self.model, self.rng = base, model, random.Random(seed)
        self.kinds: list[tuple[Callable[[], Case], int]] = [
            (self.header, 6), (self.hyper_parameter, 22), (self.other_value, 8), (self.value_type, 6),
            (self.drop_key, 8), (self.duplicate_key, 2), (self.tensor_dims, 10), (self.tensor_type, 10),
            (self.tensor_offset, 10), (self.tensor_name, 6), (self.data_bytes, 5), (self.truncate, 4),
            (self.alignment, 3)]

    def next(self) -> Case:
        funcs, weights = zip(*self.kinds)
        return self.rng.choices(funcs, weights)[0]()

    # -- helpers
    def _key(self, suffix: str) -> str:
        return f"{self.model.arch}.{suffix}"

    def _with_kv(self, kv: KV, new: KV | None) -> Layout:
        layout = self.base.copy()
        i = layout.kvs.index(kv)
        if new is None:
            del layout.kvs[i]
        else:
            layout.kvs[i] = new
        return layout

    def _value_ok(self, key: str, value) -> bool | None:
        """Whether `value` is a consistent value of `key` for this model (None: a key the model ignores)."""
        a = self.model.arch
        orig = self.base.kv(key)
        if key in self.model.ranges:
            low, high = self.model.ranges[key]
            return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        if key in self.model.shape_keys:
            return isinstance(value, int) and not isinstance(value, bool) and orig is not None and value == orig.value
        if key == f"{a}.context_length":
            return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 2**30
        if key == f"{a}.rope.freq_base":
            return _real(value) and value > 1
        if key == f"{a}.attention.layer_norm_rms_epsilon":
            return _real(value) and 0 < value < 1
        if key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < self.model.vocab
        if key == "general.architecture":
            return value == a
        if key == "general.alignment":
            return None   # decided by the tiling
        return None

    # -- the mutation kinds
    def header(self) -> Case:
        choice = self.rng.randrange(6)
        if choice == 0:
            version = self.rng.choice([0, 1, 4, 0x80000000, 0x03000000, 0x00030000, self.rng.randrange(2**32)])
            return Case(f"version {version:#x}", self.base.copy(version=version), "fail")
        if choice == 1:
            return Case("version 2", self.base.copy(version=2), "either")
        if choice == 2:
            n = len(self.base.kvs) + self.rng.choice([-1, 1, 2**40, -len(self.base.kvs)])
            return Case(f"kv count {n}", self.base.copy(n_kv=n), "fail")
        if choice == 3:
            n = len(self.base.tensors) + self.rng.choice([-1, 1, 2**40])
            return Case(f"tensor count {n}", self.base.copy(n_tensors=n), "fail")
        if choice == 4:
            return Case("tensor count 0", self.base.copy(n_tensors=0), "fail")
        magic = bytearray(b"GGUF")
        magic[self.rng.randrange(4)] ^= 1 << self.rng.randrange(8)
        return Case(f"magic {bytes(magic)!r}", self.base.copy(magic=bytes(magic)), "fail")

    def hyper_parameter(self) -> Case:
        numeric = [kv for kv in self.base.kvs if kv.vtype in _INT_TYPES + _FLOAT_TYPES]
        kv = self.rng.choice(numeric)
        if kv.vtype in _FLOAT_TYPES:
            value = self.rng.choice(_special_floats(kv.value))
        else:
            value = self.rng.choice(_special_ints(self.rng, kv.value))
        if not _fits(kv.vtype, value):
            return self.hyper_parameter()
        new = KV(kv.key, kv.vtype, value)
        layout = self._with_kv(kv, new)
        ok = self._value_ok(kv.key, value)
        if kv.key == "general.alignment":
            ok = value > 0 and not value & (value - 1) and tiles(layout)
        return Case(f"{kv.key} = {value!r}", layout, "either" if ok in (True, None) or value == kv.value else "fail")

    def other_value(self) -> Case:
        """Strings, booleans and arrays: names and templates are free; the vocabulary fixes the embedding."""
        kv = self.rng.choice([kv for kv in self.base.kvs if kv.vtype in (VT.STRING, VT.BOOL, VT.ARRAY)])
        if kv.vtype == VT.BOOL:
            return Case(f"{kv.key} flipped", self._with_kv(kv, replace(kv, value=not kv.value)), "either")
        if kv.vtype == VT.STRING:
            value = self.rng.choice(["", "x", kv.value + "\u00e9", "{{ messages }}", "{% for %}", "z" * 10000,
                                     kv.value[::-1]])
            new = replace(kv, value=value)
            if kv.key == "general.architecture":
                return Case(f"architecture {value!r}", self._with_kv(kv, new),
                            "either" if value == kv.value else "fail")
            if kv.key == "tokenizer.ggml.model":
                return Case(f"tokenizer model {value!r}", self._with_kv(kv, new),
                            "either" if value == kv.value else "fail")
            return Case(f"{kv.key} = {value[:20]!r}", self._with_kv(kv, new), "either")
        items = list(kv.value)
        choice = self.rng.randrange(4)
        if kv.key == "tokenizer.ggml.tokens":
            if choice == 0 and items:
                return Case("one token fewer", self._with_kv(kv, replace(kv, value=items[:-1])), "fail")
            if choice == 1:
                return Case("one token more", self._with_kv(kv, replace(kv, value=items + ["<extra>"])), "fail")
            if choice == 2:
                return Case("no tokens", self._with_kv(kv, replace(kv, value=[])), "fail")
            i = self.rng.randrange(len(items))
            items[i] = items[i] + "q"
            return Case(f"token {i} respelt", self._with_kv(kv, replace(kv, value=items)), "either")
        if kv.key == "tokenizer.ggml.token_type":   # one per token: a different count is inconsistent
            if choice == 0 and items:
                return Case("one token type fewer", self._with_kv(kv, replace(kv, value=items[:-1])), "either")
            i = self.rng.randrange(len(items)) if items else 0
            if items:
                items[i] = self.rng.choice([1, 2, 3, 4, 5, 6, 99, -1])
            return Case(f"token type {i} changed", self._with_kv(kv, replace(kv, value=items)), "either")
        if choice == 0 and items:
            return Case(f"{kv.key} one item fewer", self._with_kv(kv, replace(kv, value=items[:-1])), "either")
        return Case(f"{kv.key} emptied", self._with_kv(kv, replace(kv, value=[])), "either")

    def value_type(self) -> Case:
        kv = self.rng.choice([kv for kv in self.base.kvs if kv.vtype in _INT_TYPES + _FLOAT_TYPES])
        if kv.vtype in _INT_TYPES:
            vtype = self.rng.choice([t for t in _INT_TYPES + (VT.FLOAT32, VT.STRING) if t != kv.vtype])
        else:
            vtype = self.rng.choice([VT.FLOAT64, VT.UINT32, VT.STRING])
        value = kv.value
        if vtype == VT.STRING:
            value = str(kv.value)
        elif vtype in _FLOAT_TYPES:
            value = float(kv.value)
        elif vtype in _INT_TYPES:
            value = int(kv.value) if math.isfinite(kv.value) else 0
        if vtype != VT.STRING and not _fits(vtype, value):
            return self.value_type()
        layout = self._with_kv(kv, KV(kv.key, vtype, value))
        read = self._value_ok(kv.key, kv.value)
        int_key = kv.vtype in _INT_TYPES
        if kv.key == "general.alignment":
            expect = "fail"                       # must be a uint32
        elif read is None and kv.key not in self.model.shape_keys:
            expect = "either"                     # a key the loader does not read as a number
        elif vtype == VT.STRING:
            expect = "fail"
        elif int_key and vtype in _FLOAT_TYPES:
            expect = "fail"                       # counts and sizes are integers
        elif not int_key and vtype in _INT_TYPES and value != kv.value:
            expect = "either" if self._value_ok(kv.key, value) else "fail"
        else:
            expect = "either"
        return Case(f"{kv.key} as {VT(vtype).name} {value!r}", layout, expect)

    def drop_key(self) -> Case:
        kv = self.rng.choice(self.base.kvs)
        a = self.model.arch
        optional = {
            f"{a}.context_length": True, f"{a}.rope.freq_base": True, f"{a}.attention.layer_norm_rms_epsilon": True,
            "general.name": True, "general.file_type": True, "tokenizer.chat_template": True,
            "tokenizer.ggml.bos_token_id": True, "tokenizer.ggml.eos_token_id": True, "tokenizer.ggml.pre": True,
            "tokenizer.ggml.token_type": True, "general.alignment": True, f"{a}.rope.dimension_count": True,
            f"{a}.attention.value_length": True, "general.quantization_version": True,
            f"{a}.expert_weights_norm": True,
        }
        defaults_hold = {
            f"{a}.attention.head_count_kv": self._same(f"{a}.attention.head_count_kv", f"{a}.attention.head_count"),
            f"{a}.attention.key_length": self._key_length_default_holds(),
            f"{a}.vocab_size": True,   # the tokenizer gives the vocabulary
        }
        ok = optional.get(kv.key, defaults_hold.get(kv.key, False))
        rename = self.rng.random() < 0.3
        layout = self._with_kv(kv, KV(kv.key + "_", kv.vtype, kv.value, kv.itype) if rename else None)
        if kv.key == "general.alignment":
            ok = tiles(layout)
        return Case(f"{'renamed' if rename else 'dropped'} {kv.key}", layout, "either" if ok else "fail")

    def _same(self, key: str, other: str) -> bool:
        a, b = self.base.kv(key), self.base.kv(other)
        return a is not None and b is not None and a.value == b.value

    def _key_length_default_holds(self) -> bool:
        a = self.model.arch
        hidden, heads, kl = (self.base.kv(f"{a}.{k}") for k in ("embedding_length", "attention.head_count",
                                                                 "attention.key_length"))
        return bool(hidden and heads and kl and hidden.value // heads.value == kl.value)

    def duplicate_key(self) -> Case:
        layout = self.base.copy()
        kv = self.rng.choice(layout.kvs)
        layout.kvs.insert(self.rng.randrange(len(layout.kvs) + 1), kv)
        return Case(f"duplicate {kv.key}", layout, "fail")

    def _pick_tensor(self) -> tuple[int, Tensor]:
        i = self.rng.randrange(len(self.base.tensors))
        return i, self.base.tensors[i]

    def _with_tensor(self, i: int, t: Tensor) -> Layout:
        layout = self.base.copy()
        layout.tensors[i] = t
        return layout

    def tensor_dims(self) -> Case:
        i, t = self._pick_tensor()
        dims = list(t.dims)
        choice = self.rng.randrange(5)
        if choice == 0:
            j = self.rng.randrange(len(dims))
            dims[j] += self.rng.choice([-1, 1, 32, -32 if dims[j] > 32 else 1])
        elif choice == 1 and len(dims) == 2:
            dims = dims[::-1]
        elif choice == 2:
            dims = dims + [1]
        elif choice == 3 and len(dims) == 2 and dims[1] % 2 == 0:
            dims = [dims[0] * 2, dims[1] // 2]          # same element count and bytes, another shape
        else:
            dims = dims[:-1] if len(dims) > 1 else dims + [2]
        new = replace(t, dims=tuple(dims))
        return Case(f"{t.name} dims {list(dims)}", self._with_tensor(i, new),
                    "either" if new.dims == t.dims else "fail")

    def tensor_type(self) -> Case:
        i, t = self._pick_tensor()
        ttype = self.rng.choice([int(x) for x in T if x != t.ttype] + [200, 2**31])
        new = replace(t, ttype=ttype)
        layout = self._with_tensor(i, new)
        ok = ttype in {int(x) for x in RUNNABLE_TYPES} and tiles(layout)
        return Case(f"{t.name} type {ttype}", layout, "either" if ok else "fail")

    def tensor_offset(self) -> Case:
        i, t = self._pick_tensor()
        align = self.base.alignment
        choice = self.rng.randrange(5)
        if choice == 0:
            offset = t.offset + self.rng.choice([-align, align, 2 * align])
        elif choice == 1:
            offset = t.offset + self.rng.choice([-1, 1, 3, 16])
        elif choice == 2:
            offset = self.rng.choice([0, 2**63, 2**64 - align, len(self.base.data)])
        elif choice == 3:
            offset = self.rng.choice(self.base.tensors).offset
        else:   # swap with another tensor
            j = self.rng.randrange(len(self.base.tensors))
            other = self.base.tensors[j]
            layout = self.base.copy()
            layout.tensors[i], layout.tensors[j] = replace(t, offset=other.offset), replace(other, offset=t.offset)
            return Case(f"offsets of {t.name} and {other.name} swapped", layout, "either" if tiles(layout) else "fail")
        offset %= 2**64
        layout = self._with_tensor(i, replace(t, offset=offset))
        return Case(f"{t.name} offset {offset}", layout, "either" if tiles(layout) else "fail")

    def tensor_name(self) -> Case:
        i, t = self._pick_tensor()
        choice = self.rng.randrange(3)
        if choice == 0:
            name = t.name.replace("blk.", "blk.9", 1) if t.name.startswith("blk.") else t.name + "x"
            # without output.weight the head is tied to the embedding: still a runnable model
            expect = "either" if t.name == "output.weight" else "fail"
            return Case(f"{t.name} renamed {name}", self._with_tensor(i, replace(t, name=name)), expect)
        if choice == 1:
            other = self.rng.choice([x for x in self.base.tensors if x.name != t.name])
            return Case(f"{t.name} renamed {other.name}", self._with_tensor(i, replace(t, name=other.name)), "fail")
        # swap the names of two tensors of the same dims and type: a consistent (if wrong) file
        same = [j for j, x in enumerate(self.base.tensors) if j != i and x.dims == t.dims and x.ttype == t.ttype]
        if not same:
            return self.tensor_name()
        j = self.rng.choice(same)
        layout = self.base.copy()
        other = layout.tensors[j]
        layout.tensors[i], layout.tensors[j] = replace(t, name=other.name), replace(other, name=t.name)
        return Case(f"names of {t.name} and {other.name} swapped", layout, "either")

    def data_bytes(self) -> Case:
        data = bytearray(self.base.data)
        for _ in range(self.rng.randrange(1, 64)):
            data[self.rng.randrange(len(data))] = self.rng.randrange(256)
        return Case("tensor data bytes changed", self.base.copy(data=bytes(data)), "either")

    def truncate(self) -> Case:
        raw = serialize(self.base)
        end = max(t.offset + tensor_bytes(t) for t in self.base.tensors) + len(raw) - len(self.base.data)
        cut = self.rng.choice([self.rng.randrange(len(raw)), end - 1, self.rng.randrange(24)])
        return Case(f"cut at byte {cut}", self.base, "fail" if cut < end else "either", raw=raw[:cut])

    def alignment(self) -> Case:
        value = self.rng.choice([16, 64, 8, 1, 48, 0])
        layout = self.base.copy()
        kv = layout.kv("general.alignment")
        new = KV("general.alignment", VT.UINT32, value)
        if kv is None:
            layout.kvs.append(new)
        else:
            layout.kvs[layout.kvs.index(kv)] = new
        ok = value > 0 and not value & (value - 1) and tiles(layout)
        return Case(f"general.alignment {value}", layout, "either" if ok else "fail")


def tail_case(base: Layout, extra: bytes) -> Case:
    """Bytes appended after the last tensor (past its padding)."""
    layout = base.copy(tail=extra)
    return Case(f"{len(extra)} bytes appended", layout, "either" if tiles(layout) else "fail")

