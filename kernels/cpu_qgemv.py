"""Linear layers on the CPU for GGML weights: the compiled kernels of csrc/qgemv.cpp.

y = x @ W^T (+ bias) for W in GGML blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
MXFP4) or dense (F32, F16, BF16). For the block types each row of x is quantized per call to int8 blocks of
32 (scale d = amax / 127), the dot products run in integer arithmetic (AVX-512 VNNI, AVX2, NEON with or
without SDOT, or scalar C++) and are scaled per block in fp32. The result is x_hat @ W^T to fp32 rounding
(~1e-6 relative), x_hat being x on the activation grid:

    |y - x @ W^T| <= sum over 32-blocks b of err_b * sum_{i in b} |W[o, i]|,
    levels=1 (llama.cpp's scheme):  err_b = amax_b(x) / 254      (int8 codes)
    levels=2 (the default):         err_b = amax_b(x) / 32512    (int8 codes + int8 residual codes)

One level moves a model's logits visibly over its layers; two levels dot the residual x - d q (grid
d / 256) with the same unpacked weights as well: ~15-bit activations, for little time in decode
(memory-bound) and more in prefill (benchmarks/README.md).

Dense weights are exact, and so is their maths: fp32 x (not quantized; `levels` does not apply),
fp32 FMA accumulation, |y - x @ W^T| within fp32 rounding of sum_i |x_i| |W[o, i]|.

`pack(qw)` repacks the raw blocks once at load into tiles of 16 rows with the same number of bytes
(plus the padding of the last tile to 16 rows), `pack_dense(t)` a float tensor; `matmul(x, packed,
...)` runs a call; `dequantize_rows(packed, ids)` reads rows back (an embedding lookup on a weight
tied to the LM head: one copy). Outputs are bit-identical across the SIMD paths and independent of
the other rows of the batch. The routed MoE experts (kernels/moe_cpu.py) run on the same kernels
straight from the raw rows, with the same products.

The library is built on first use (kernels/cpp_build.py: g++ or clang and ninja, cached per source and CPU,
`native_flags()`) and called through ctypes (plain C ABI, no torch headers). Threads: each call's
`threads` (KernelOptions.threads), else torch.get_num_threads() (the CPU count without torch); the kernels run
on a small pool of their own (not OpenMP), where the caller never waits for a worker that has not started yet, so a call
on a busy machine degrades to the 1-thread time instead of stalling for a scheduler tick. Each thread
streams large contiguous shares of the weight, prefetched in software. When the compiler is missing,
`available()` is False (after one warning) and callers fall back to the int4 backend.

torch is imported only by the functions that take or make torch tensors: the `*_raw` calls take addresses
(the lean one-shot path, engine/lean.py, drives them with numpy buffers), and the torch calls are thin on top.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from nanochat.kernels import ggml_types as gq
from nanochat.kernels.cpp_build import LazyLibrary, arm_features, build_library
from nanochat.kernels.qweight import QuantWeight, Shaped

if TYPE_CHECKING:
    import torch

# dense weight types -> the dtype name of their values
DENSE_TYPES = {gq.F32: "float32", gq.F16: "float16", gq.BF16: "bfloat16"}
KERNEL_TYPES = frozenset({gq.Q4_0, gq.Q4_1, gq.Q5_0, gq.Q5_1, gq.Q8_0, gq.Q2_K, gq.Q3_K, gq.Q4_K, gq.Q5_K, gq.Q6_K,
                          gq.MXFP4, *DENSE_TYPES})
ROWS_PER_TILE = 16
# simd.h's NC_ISA levels: two ladders above scalar, x86-64 (1, 2) and AArch64 (3..5).
SIMD_LEVELS = {0: "scalar", 1: "avx2", 2: "avx512-vnni", 3: "neon", 4: "neon-dotprod", 5: "neon-i8mm"}
# decoder.cpp (the fused decode step, kernels/cpu_decoder.py) and moe.cpp (routed experts,
# kernels/moe_cpu.py) share this library and its thread pool.
_SOURCES = [Path(__file__).parent / "csrc" / f for f in ("qgemv.cpp", "decoder.cpp", "moe.cpp")]
_ERRORS = {1: "unsupported weight type", 2: "the input size is not a multiple of the block size",
           3: "row id out of range"}


# ---------------------------------------------------------------- the compiled extension

_kernels = LazyLibrary()
DEFAULT_LEVELS = 2   # activation quantization when a caller names none (KernelOptions.act_levels)


# -ffp-contract=off: the scalar path must round like the SIMD paths (bit-identical outputs).
_FLAGS = ["-O3", "-std=c++20", "-ffp-contract=off"]


def _load_extension() -> ctypes.CDLL:
    """Build (or reuse the cached build of) the library and bind its C functions. Raises on failure."""
    # This CPU's flags first; a plain build (scalar on x86, baseline NEON on AArch64) if the compiler rejects them.
    variants = [("nanochat_qgemv", _FLAGS + native_flags(), ["-pthread"]),
                ("nanochat_qgemv_plain", _FLAGS, ["-pthread"])]
    return _bind(ctypes.CDLL(build_library(_SOURCES, variants)))


def native_flags(system: str | None = None, machine: str | None = None,
                 features: frozenset[str] | None = None) -> list[str]:
    """The target flags of this machine's build (defaults: platform.system(), platform.machine(), arm_features()).
    x86-64: -march=native. AArch64 Linux (g++ or clang): -mcpu=native. macOS on Apple Silicon: Apple's clang takes
    no -march=native, so -mcpu=apple-m1 (Armv8.5 with dotprod: every Apple Silicon CPU), plus +i8mm where the CPU
    reports FEAT_I8MM (M2 and later). No OpenMP anywhere: the kernels run on their own thread pool."""
    system = system or platform.system()
    machine = (machine or platform.machine()).lower()
    if machine not in ARM_MACHINES:
        return ["-march=native"]
    if system != "Darwin":
        return ["-mcpu=native"]
    features = arm_features(system) if features is None else features
    return ["-mcpu=apple-m1+i8mm" if "i8mm" in features else "-mcpu=apple-m1"]


def build_variant(name: str, arch_flags: list[str]) -> ctypes.CDLL:
    """The library compiled for other CPU features (tests: the AVX2 and scalar code of csrc/*.cpp on a
    machine whose native build takes the AVX-512 paths), loaded beside the native one."""
    return _bind(ctypes.CDLL(build_library(_SOURCES, [(f"nanochat_qgemv_{name}", _FLAGS + arch_flags,
                                                       ["-pthread"])])))


# Builds for a lower ISA than the machine's (benchmarks, and tests on an AVX-512 machine), per architecture.
# AArch64 always has NEON (so a build with no -m flags is not scalar there): NC_NO_SIMD makes simd.h pick scalar.
ISA_FLAGS = {"avx2": ["-mavx2", "-mfma", "-mf16c"], "scalar": []}
ARM_ISA_FLAGS = {"neon-i8mm": ["-march=armv8.6-a+i8mm"], "neon-dotprod": ["-march=armv8.2-a+dotprod"],
                 "neon": ["-march=armv8-a"], "scalar": ["-march=armv8-a", "-DNC_NO_SIMD"]}
ARM_MACHINES = ("aarch64", "arm64")


def isa_flags(machine: str | None = None) -> dict[str, list[str]]:
    """The lower ISA builds `use_isa` offers on this machine (default platform.machine()), by name."""
    return ARM_ISA_FLAGS if (machine or platform.machine()).lower() in ARM_MACHINES else ISA_FLAGS


def use_isa(isa: str) -> None:
    """Make the kernels of a lower ISA build (x86: "avx2", "scalar"; AArch64: "neon-dotprod", "neon", "scalar")
    the ones every caller gets, as on a CPU that has no more than that. The tile layout is the same for every
    build, so weights packed by another build stay valid."""
    flags = isa_flags()
    if isa not in flags:
        raise ValueError(f"unknown CPU ISA {isa!r} (have {', '.join(flags)})")
    _kernels.replace(build_variant(isa, flags[isa]))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.nc_qg_matmul.argtypes = [c_int, p, i64, i64, p, c_int, i64, i64, p, c_int, i64, p, c_int, c_int]
    lib.nc_qg_matmul_packed.argtypes = None  # called with a prebuilt c_void_p: no per-call conversion
    lib.nc_qg_repack.argtypes = [c_int, p, i64, i64, i64, p, c_int]
    lib.nc_qg_packed_bytes.argtypes = [c_int, i64, i64]
    lib.nc_qg_packed_bytes.restype = i64
    lib.nc_qg_dequantized_acts.argtypes = [p, i64, i64, c_int, p]
    lib.nc_qg_dequant_rows.argtypes = [c_int, p, i64, i64, p, i64, p]
    lib.nc_qg_set_simd.argtypes = [c_int]
    lib.nc_qg_set_simd.restype = None
    lib.nc_qg_matmul_rows.argtypes = [c_int, p, i64, i64, i64, p, i64, i64, p, i64, c_int, c_int]
    lib.nc_moe_forward.argtypes = [p, i64, i64, p, p, i64, i64, p, p, p, p, c_int, ctypes.c_float, ctypes.c_float,
                                   p, p, p, c_int, c_int]
    lib.nc_dec_forward.argtypes = [p, p, i64, p, p, i64, p, p, i64, p, p, p, i64, c_int, c_int]
    lib.nc_dec_attention.argtypes = [p, i64, i64, i64, p, p, i64, p, p, p, c_int, i64, i64, i64, i64, ctypes.c_float,
                                     i64, p, p, c_int]
    lib.nc_dec_activation.argtypes = [c_int, p, i64, p, i64, i64, i64, p, i64, c_int]
    lib.nc_gdn_recurrent.argtypes = [p, p, p, p, p, i64, i64, p, p, p, i64, i64, i64, p, p, c_int]
    for fn in ("nc_dec_forward", "nc_dec_attention", "nc_dec_activation", "nc_gdn_recurrent", "nc_dec_header_fields",
               "nc_dec_layer_fields", "nc_dec_moe_fields", "nc_qg_matmul", "nc_qg_matmul_packed", "nc_qg_repack", "nc_qg_dequantized_acts",
               "nc_qg_dequant_rows", "nc_qg_simd", "nc_qg_simd_compiled", "nc_qg_matmul_rows", "nc_moe_forward",
               "nc_qg_last_threads"):
        getattr(lib, fn).restype = c_int
    return lib


def extension() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (after one warning) when they cannot be built."""
    return _kernels.get(_load_extension, "nanochat: the CPU int8 matmul kernels could not be built ({error}); "
                        "quantized linears use torch's int4 kernel instead, routed MoE experts dequantize + matmul "
                        "in torch (slower). Install g++ and ninja to fix it.")


def available() -> bool:
    return extension() is not None


def _need() -> ctypes.CDLL:
    lib = extension()
    if lib is None:
        raise RuntimeError(f"the CPU int8 matmul kernels are not available ({_kernels.error})")
    return lib


def simd_level() -> str:
    """The code path in use: "avx512-vnni", "avx2", "neon-i8mm", "neon-dotprod", "neon" or "scalar"."""
    return SIMD_LEVELS[_need().nc_qg_simd()]


def simd_compiled() -> str:
    """The best code path the loaded build has ("scalar": a CPU with neither AVX2 nor NEON, or a forced scalar
    build), whatever set_simd_level chose."""
    return SIMD_LEVELS[_need().nc_qg_simd_compiled()]


def set_simd_level(level: str | None) -> None:
    """Force a lower code path of this build's ladder, or scalar (tests); None restores the best compiled one."""
    lib = _need()
    best = lib.nc_qg_simd_compiled()
    want = best if level is None else {v: k for k, v in SIMD_LEVELS.items()}[level]
    if want > best or (want and (want >= 3) != (best >= 3)):
        raise ValueError(f"{level} is not compiled in (best: {SIMD_LEVELS[best]})")
    lib.nc_qg_set_simd(want)


def _check(rc: int, what: str) -> None:
    if rc:
        raise ValueError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


# ---------------------------------------------------------------- weights


@dataclass
class PackedWeight(Shaped):
    """A weight repacked for the kernels: uint8 `data` [ceil(out / 16), packed bytes per tile row], a torch
    tensor or a numpy array (the lean path's, mapped from the pack cache)."""

    ggml_type: int
    shape: tuple[int, int]
    data: object


def packed_bytes(ggml_type: int, out_features: int, in_features: int) -> int:
    """Bytes of the packed layout: the raw blocks' size (dense: the values'), with the rows padded to a
    multiple of 16."""
    rows = -(-out_features // ROWS_PER_TILE) * ROWS_PER_TILE
    return rows * gq.row_bytes(ggml_type, in_features)


def pack(qw: QuantWeight, tensor_name: str = "<tensor>") -> PackedWeight:
    """Repack a GGML weight into the kernels' tile layout. `qw.data` is the raw rows as uint8
    [out, bytes_per_row]: the blocks for the quantized types, the little-endian values for F32 / F16 /
    BF16 ([out, 4 * in] / [out, 2 * in]; `pack_dense` takes a float tensor instead)."""
    import torch

    lib = _need()
    t = qw.ggml_type
    if t not in KERNEL_TYPES:
        raise ValueError(f"tensor {tensor_name!r}: no CPU kernel for {gq.type_name(t)} "
                         f"(have {sorted(gq.type_name(k) for k in KERNEL_TYPES)})")
    out_f, in_f = qw.shape
    if in_f % gq.BLOCK_SIZES[t][0]:
        raise ValueError(f"tensor {tensor_name!r}: row length {in_f} is not a multiple of the "
                         f"{gq.type_name(t)} block size {gq.BLOCK_SIZES[t][0]}")
    data = qw.data.cpu()
    if data.stride(-1) != 1:
        data = data.contiguous()
    tiles = -(-out_f // ROWS_PER_TILE)
    out = torch.empty(tiles, packed_bytes(t, out_f, in_f) // tiles, dtype=torch.uint8)
    _check(lib.nc_qg_repack(t, data.data_ptr(), out_f, in_f, data.stride(0), out.data_ptr(), num_threads()),
           f"tensor {tensor_name!r}")
    return PackedWeight(t, (out_f, in_f), out)


def pack_dense(t: torch.Tensor, ggml_type: int | None = None, tensor_name: str = "<tensor>") -> PackedWeight:
    """Pack a float weight [out, in] (float32, float16 or bfloat16) as F32 / F16 / BF16 (default: the type
    of t's dtype; another type rounds the values to it once, here)."""
    import torch

    if t.dim() != 2 or not t.is_floating_point():
        raise ValueError(f"tensor {tensor_name!r}: pack_dense needs a 2-D float tensor, got {t.dtype} {list(t.shape)}")
    if ggml_type is None:
        ggml_type = {v: k for k, v in DENSE_TYPES.items()}.get(str(t.dtype).removeprefix("torch."), gq.F32)
    if ggml_type not in DENSE_TYPES:
        raise ValueError(f"tensor {tensor_name!r}: pack_dense packs F32, F16 or BF16, not {gq.type_name(ggml_type)}")
    t = t.detach().cpu().to(getattr(torch, DENSE_TYPES[ggml_type]))
    if t.stride(-1) != 1:
        t = t.contiguous()
    return pack(QuantWeight(ggml_type, tuple(t.shape), t.view(torch.uint8)), tensor_name)


def dequantize_rows(w: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a packed weight as float32 [*ids.shape, in], equal to gguf's dequantization of the raw
    rows (an embedding lookup that needs no second copy of a tied LM head). ValueError for an id out of
    range."""
    import torch

    flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    out = torch.empty(flat.numel(), w.in_features, dtype=torch.float32)
    dequantize_rows_raw(w, flat.data_ptr(), flat.numel(), out.data_ptr())
    return out.view(*ids.shape, w.in_features)


def dequantize_rows_raw(w: PackedWeight, ids_ptr: int, n: int, out_ptr: int) -> None:
    """`dequantize_rows` on addresses: n int64 row ids at ids_ptr -> float32 [n, in] at out_ptr. w.data is
    any contiguous buffer (see data_address)."""
    _check(_need().nc_qg_dequant_rows(w.ggml_type, data_address(w.data), w.out_features, w.in_features, ids_ptr, n,
                                      out_ptr),
           f"rows of a {gq.type_name(w.ggml_type)} {list(w.shape)} weight")


def data_address(buf) -> int:
    """The address of a contiguous CPU buffer: a torch tensor or a numpy array (neither is imported here)."""
    ptr = getattr(buf, "data_ptr", None)
    return ptr() if ptr is not None else buf.ctypes.data


# ---------------------------------------------------------------- matmul


def num_threads(threads: int | None = None) -> int:
    """`threads`, else torch.get_num_threads() (the engine sets torch's count to its own); in a process that
    has not loaded torch (the lean one-shot passes its count), the CPU count."""
    if threads:
        return threads
    import sys
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else (os.cpu_count() or 1)


def matmul(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, levels: int | None = None,
           threads: int | None = None) -> torch.Tensor:
    """y [n, out] = x [n, in] @ W^T (+ bias); x float32 or bfloat16, y in out_dtype (float32 or
    bfloat16; default x's dtype, float32 for other input dtypes); `levels` of activation
    quantization (1 or 2, default DEFAULT_LEVELS; dense weights take x unquantized); `threads` of the pool
    (default torch.get_num_threads())."""
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"int8 matmul: input {list(x.shape)} does not fit the weight {list(w.shape)}")
    if levels not in (None, 1, 2):
        raise ValueError(f"activation levels must be 1 or 2, got {levels}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return linear(x, w.ggml_type, w.data, w.out_features, bias, out_dtype, levels, threads)


def linear(x: torch.Tensor, ggml_type: int, data: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           levels: int | None = None, threads: int | None = None) -> torch.Tensor:
    """`matmul` on the fields of a PackedWeight, for the per-token hot path (x: [n, in], checked by the
    caller)."""
    import torch

    io_dtypes = (torch.float32, torch.bfloat16)
    if x.dtype not in io_dtypes:
        x = x.float()
    if not x.is_cpu or not (x.is_contiguous() or x.stride(-1) == 1):
        x = x.cpu().contiguous()
    out_dtype = out_dtype or x.dtype
    if out_dtype not in io_dtypes:
        raise ValueError(f"int8 matmul: output dtype must be float32 or bfloat16, got {out_dtype}")
    n, k = x.shape
    y = torch.empty(n, out_features, dtype=out_dtype)
    bias_ptr = 0
    if bias is not None:
        if bias.dtype != torch.float32 or not bias.is_contiguous():
            bias = bias.float().contiguous()
        bias_ptr = bias.data_ptr()
    linear_raw(ggml_type, data.data_ptr(), out_features, k, x.data_ptr(), x.dtype == torch.bfloat16, n, x.stride(0),
               y.data_ptr(), out_dtype == torch.bfloat16, out_features, bias_ptr, levels,
               threads or torch.get_num_threads())
    return y


def linear_raw(ggml_type: int, w_ptr: int, out_features: int, k: int, x_ptr: int, x_bf16: bool, n: int,
               x_stride: int, y_ptr: int, y_bf16: bool, y_stride: int, bias_ptr: int = 0, levels: int | None = None,
               threads: int | None = None) -> None:
    """`linear` on addresses: y [n, out] (row stride y_stride) = x [n, k] (row stride x_stride) @ W^T (+ bias fp32
    [out] at bias_ptr, 0: none); x and y float32, or bfloat16 where the flag says so."""
    lib = _kernels.lib or _need()
    args, ptr = _call_args()
    args[0:14] = array("q", (ggml_type, w_ptr, out_features, k, x_ptr, x_bf16, n, x_stride, y_ptr, y_bf16, y_stride,
                             bias_ptr, (levels or DEFAULT_LEVELS) == 2, num_threads(threads)))
    rc = lib.nc_qg_matmul_packed(ptr)
    if rc:
        _check(rc, f"{gq.type_name(ggml_type)} matmul")


_tls = threading.local()


def _call_args() -> tuple[array, ctypes.c_void_p]:
    """This thread's argument block for nc_qg_matmul_packed and a ready pointer to it."""
    try:
        return _tls.args
    except AttributeError:
        buf = array("q", [0] * 14)
        _tls.args = (buf, ctypes.c_void_p(buf.buffer_info()[0]))
        return _tls.args


def dequantized_activations(x: torch.Tensor, levels: int | None = None) -> torch.Tensor:
    """x [n, k] as the kernels see it (float32): the codes times their block scale."""
    import torch

    lib = _need()
    x = x.detach().to(torch.float32).contiguous().cpu()
    out = torch.empty_like(x)
    _check(lib.nc_qg_dequantized_acts(x.data_ptr(), x.shape[0], x.shape[1], (levels or DEFAULT_LEVELS) == 2,
                                      out.data_ptr()), "activations")
    return out

