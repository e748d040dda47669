"""GGML block types: ids, names and block sizes (no torch: the lean one-shot path reads them too)."""

from __future__ import annotations

# ggml_type ids (gguf.GGMLQuantizationType values), spelled out so this module needs no gguf import.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 = 0, 1, 2, 3, 6, 7, 8, 9
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30
MXFP4 = 39

TYPE_NAMES: dict[int, str] = {
    F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0",
    Q5_1: "Q5_1", Q8_0: "Q8_0", Q8_1: "Q8_1", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K",
    Q5_K: "Q5_K", Q6_K: "Q6_K", MXFP4: "MXFP4",
}

QK_K = 256
# ggml_type -> (elements per block, bytes per block). Q8_1 is 36 bytes (f16 d, f16 s, 32 x i8)
# as in current ggml; gguf-py's GGML_QUANT_SIZES still lists the old 40-byte float layout.
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    F32: (1, 4), F16: (1, 2), BF16: (1, 2),
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34), Q8_1: (32, 36),
    Q2_K: (QK_K, 84), Q3_K: (QK_K, 110), Q4_K: (QK_K, 144), Q5_K: (QK_K, 176), Q6_K: (QK_K, 210),
    MXFP4: (32, 17),
}
# MXFP4's E2M1 values doubled (ggml's kvalues_mxfp4): integers, so the kernels dot them exactly.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
SUPPORTED_TYPES: frozenset[int] = frozenset(BLOCK_SIZES)


class UnsupportedQuantError(ValueError):
    """A tensor uses a GGML type this package cannot dequantize."""


def type_name(ggml_type: int) -> str:
    if ggml_type in TYPE_NAMES:
        return TYPE_NAMES[ggml_type]
    try:
        import gguf

        return gguf.GGMLQuantizationType(ggml_type).name
    except Exception:  # unknown id or gguf missing: the number still identifies it
        return f"type {ggml_type}"


def check_supported(ggml_type: int, tensor_name: str = "<tensor>") -> None:
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(TYPE_NAMES[t] for t in sorted(SUPPORTED_TYPES))
        raise UnsupportedQuantError(
            f"tensor {tensor_name!r} uses GGML type {type_name(ggml_type)} ({ggml_type}), "
            f"which nanochat cannot dequantize (supported: {supported})"
        )


def row_bytes(ggml_type: int, in_features: int) -> int:
    elems, nbytes = BLOCK_SIZES[ggml_type]
    if in_features % elems:
        raise ValueError(
            f"row length {in_features} is not a multiple of the {type_name(ggml_type)} block size {elems}"
        )
    return in_features // elems * nbytes
