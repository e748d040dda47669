"""Routed MoE experts on the host CPU, computed from GGML blocks where they lie (e.g. a GGUF memory map).

`HostExperts(gate, up, down)` holds one projection of every expert each (a `StackedWeight`:
[experts, out, in], quantized rows as raw uint8 blocks) and computes, for hidden states x [T, H] and
the router's top-k ids / weights [T, k]:

    out[t] = sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t),   e = ids[t, j]

Two backends:
- "kernel": the compiled extension (kernels/csrc/moe_cpu.cpp) for Q4_K, Q5_K, Q6_K and Q8_0 weights.
  Activations are quantized per row on the fly to int8 (blocks of 256 with an fp32 scale and
  16-element sums for the K-quants, "Q8_K"; blocks of 32 for Q8_0), the dot products run in integer
  arithmetic (AVX2, AVX-512 VNNI when the compiler targets it), and each selected expert's rows are
  read once per call, unpacked once per 4 tokens routed to that expert. Error vs an fp32 matmul on
  the dequantized weights: the activation rounding, at most amax/254 per element of a block (about
  0.6% relative rms for Gaussian rows; 1-2% for a whole expert FFN, whose silu(gate)*up is rounded too).
- "torch": dequantizes the selected experts per call and uses fp32 matmuls (a loop over active
  experts). Used for other weight types, dense experts, and when the extension cannot be built
  (no compiler / ninja), with a one-time warning.

The extension is built on first use with torch.utils.cpp_extension.load (g++ and ninja needed),
cached under $NANOCHAT_KERNEL_DIR, $NANOCHAT_HOME/cache or the platformdirs user cache dir, and called
through ctypes (plain C ABI, so the build needs no torch headers and takes seconds). It runs an OpenMP
team of `cpu_threads()` threads: the engine's cpu_threads (env NANO_VLLM_CPU_THREADS) once it set them
with `set_threads`, default half the logical CPUs (at least 1).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nanochat.kernels import cpu_qgemv
from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.cpu_decoder import activation
from nanochat.kernels.cpp_build import LazyLibrary, build_library
from nanochat.kernels.qweight import QuantWeight

KERNEL_TYPES = frozenset({gq.Q8_0, gq.Q4_K, gq.Q5_K, gq.Q6_K})
DENSE_TYPES = frozenset({gq.F32, gq.F16, gq.BF16})
_SOURCE = Path(__file__).parent / "csrc" / "moe_cpu.cpp"
_ERRORS = {1: "unsupported weight type", 2: "shapes do not match the block size", 3: "expert id out of range"}


class _Mat(ctypes.Structure):
    """Mirror of NcMat in moe_cpu.cpp: one projection of every expert."""

    _fields_ = [("type", ctypes.c_int32), ("reserved", ctypes.c_int32), ("data", ctypes.c_void_p),
                ("expert_stride", ctypes.c_int64), ("row_stride", ctypes.c_int64),
                ("rows", ctypes.c_int64), ("cols", ctypes.c_int64)]


@dataclass
class StackedWeight:
    """One projection of every expert: shape (experts, out_features, in_features), torch order.

    Quantized: `data` is uint8 [E, out, bytes_per_row] of raw GGML blocks; rows may be strided
    (a view over a fused gate|up tensor) but each row's bytes are contiguous. Dense (F32/F16/BF16):
    `data` is the float tensor [E, out, in]."""

    ggml_type: int
    shape: tuple[int, int, int]
    data: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def out_features(self) -> int:
        return self.shape[1]

    @property
    def in_features(self) -> int:
        return self.shape[2]

    @property
    def quantized(self) -> bool:
        return self.ggml_type not in DENSE_TYPES

    def expert(self, e: int) -> QuantWeight | torch.Tensor:
        if self.quantized:
            return QuantWeight(self.ggml_type, self.shape[1:], self.data[e])
        return self.data[e]

    def dense_expert(self, e: int) -> torch.Tensor:
        """Expert e's weight [out, in] in float32 (dequantized when quantized)."""
        if self.quantized:
            return gq.dequantize_raw(self.ggml_type, self.data[e], self.shape[1:], torch.float32)
        return self.data[e].float()

    def nbytes(self) -> int:
        e, out, inp = self.shape
        if self.quantized:
            return e * out * gq.row_bytes(self.ggml_type, inp)
        return e * out * inp * self.data.element_size()

    def check(self, name: str = "<experts>") -> None:
        e, out, inp = self.shape
        if self.quantized:
            gq.check_supported(self.ggml_type, name)
            want = (e, out, gq.row_bytes(self.ggml_type, inp))
            if tuple(self.data.shape) != want or self.data.dtype != torch.uint8 or self.data.stride(-1) != 1:
                raise ValueError(f"{name}: {gq.type_name(self.ggml_type)} experts {list(self.shape)} need uint8 "
                                 f"rows of shape {list(want)}, got {self.data.dtype} {list(self.data.shape)}")
        elif tuple(self.data.shape) != self.shape:
            raise ValueError(f"{name}: dense experts {list(self.shape)} got a tensor {list(self.data.shape)}")


# ---------------------------------------------------------------- threads


_threads: int | None = None


def set_threads(n: int | None) -> None:
    """Threads for the host expert kernels from now on; None: the default, half the logical CPUs. The
    engine sets it at start-up from Config.cpu_threads (env NANO_VLLM_CPU_THREADS)."""
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _threads = n


def cpu_threads() -> int:
    """Threads for the host expert kernels: as set_threads set them, else half the logical CPUs (>= 1)."""
    return _threads or max(1, (os.cpu_count() or 2) // 2)


# ---------------------------------------------------------------- the compiled extension

_kernels = LazyLibrary()


def _load_extension() -> ctypes.CDLL:
    """Build (or reuse the cached build of) the library and bind its C functions. Raises on failure."""
    # -march=native + OpenMP first; a plain build if the compiler rejects either.
    variants = [("nanochat_moe_cpu", ["-O3", "-march=native", "-fopenmp"], ["-fopenmp"]),
                ("nanochat_moe_cpu_plain", ["-O3"], [])]
    return _bind(ctypes.CDLL(build_library(_SOURCE, variants)))


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.nc_moe_forward.argtypes = [p, i64, i64, p, p, i64, i64, ctypes.POINTER(_Mat), ctypes.POINTER(_Mat),
                                   ctypes.POINTER(_Mat), p, c_int]
    lib.nc_quant_matmul.argtypes = [c_int, p, i64, i64, i64, p, i64, p, c_int]
    lib.nc_dequantized_acts.argtypes = [c_int, p, i64, i64, p]
    lib.nc_omp_threads.argtypes = [c_int]
    lib.nc_set_simd.argtypes = [c_int]
    for fn in ("nc_moe_forward", "nc_quant_matmul", "nc_dequantized_acts", "nc_omp_threads", "nc_last_threads",
               "nc_has_simd", "nc_has_vnni"):
        getattr(lib, fn).restype = c_int
    lib.nc_set_simd.restype = None
    return lib


def extension() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (after one warning) when they cannot be built."""
    return _kernels.get(_load_extension, "nanochat: the CPU expert kernels could not be built ({error}); routed "
                        "experts fall back to dequantize + matmul in torch (slower). Install g++ and ninja to fix it.")


def available() -> bool:
    return extension() is not None


def _check(rc: int, what: str) -> None:
    if rc:
        raise ValueError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


# ---------------------------------------------------------------- single-matrix entry points (tests, tools)


def dequantized_activations(ggml_type: int, x: torch.Tensor) -> torch.Tensor:
    """x [n, K] as the kernels see it for weights of `ggml_type`: int8 values times their block scale."""
    lib = extension()
    if lib is None:
        raise RuntimeError("the CPU expert kernels are not available")
    x = x.detach().to(torch.float32).contiguous().cpu()
    out = torch.empty_like(x)
    _check(lib.nc_dequantized_acts(ggml_type, _ptr(x), x.shape[0], x.shape[1], _ptr(out)), "activations")
    return out


def quant_matmul(qw: QuantWeight, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """y [n, out] = x [n, in] @ W^T with W's raw blocks (a kernel type), activations quantized to int8."""
    lib = extension()
    if lib is None:
        raise RuntimeError("the CPU expert kernels are not available")
    if qw.ggml_type not in KERNEL_TYPES:
        raise ValueError(f"no CPU kernel for {qw.type_name} (have {sorted(gq.type_name(t) for t in KERNEL_TYPES)})")
    x = x.detach().to(torch.float32).contiguous().cpu()
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"quant_matmul: input has {x.shape[-1]} features, weight expects {qw.in_features}")
    data = qw.data
    if data.stride(-1) != 1:
        data = data.contiguous()
    y = torch.empty(x.shape[0], qw.out_features)
    _check(lib.nc_quant_matmul(qw.ggml_type, _ptr(data), qw.out_features, qw.in_features, data.stride(0),
                               _ptr(x), x.shape[0], _ptr(y), threads or cpu_threads()), f"{qw.type_name} matmul")
    return y


# ---------------------------------------------------------------- the expert executor


class HostExperts:
    """The routed experts of one MoE layer, computed on the host (see the module docstring).

    backend: "auto" (compiled kernels when every projection is a kernel type and the extension
    builds, else torch), "kernel" (require the kernels), "torch"."""

    def __init__(self, gate: StackedWeight, up: StackedWeight, down: StackedWeight,
                 threads: int | None = None, backend: str = "auto", name: str = "experts"):
        if backend not in ("auto", "kernel", "torch"):
            raise ValueError(f"unknown host expert backend {backend!r} (auto, kernel, torch)")
        for w, what in ((gate, "gate"), (up, "up"), (down, "down")):
            w.check(f"{name}.{what}")
        e, inter, hidden = gate.shape
        if up.shape != gate.shape or down.shape != (e, hidden, inter):
            raise ValueError(f"{name}: expert shapes do not fit together: gate {list(gate.shape)}, "
                             f"up {list(up.shape)}, down {list(down.shape)}")
        self.gate, self.up, self.down = gate, up, down
        self.num_experts, self.hidden_size, self.intermediate_size = e, hidden, inter
        self.threads = threads or cpu_threads()
        self.name = name
        self.batch_invariant = False   # the torch backend's matmuls on the q8 kernels (Config.batch_invariant)
        types = {gate.ggml_type, up.ggml_type, down.ggml_type}
        lib = None
        if backend != "torch" and types <= KERNEL_TYPES:
            lib = extension()
        if backend == "kernel" and lib is None:
            raise RuntimeError(f"{name}: the CPU expert kernels are unavailable for "
                               f"{sorted(gq.type_name(t) for t in types)}")
        self.backend = "kernel" if lib is not None else "torch"
        self._lib = lib
        if lib is not None:
            self._mats = [self._mat(w) for w in (gate, up, down)]
            self._mat_refs = tuple(ctypes.byref(m) for m in self._mats)

    @staticmethod
    def _mat(w: StackedWeight) -> _Mat:
        d = w.data
        return _Mat(w.ggml_type, 0, d.data_ptr(), d.stride(0), d.stride(1), w.out_features, w.in_features)

    def nbytes_per_expert(self) -> int:
        return sum(w.nbytes() for w in (self.gate, self.up, self.down)) // self.num_experts

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], ids / weights [T, k] (host tensors) -> float32 [T, H] (written into `out` if given)."""
        x = x.to(torch.float32).contiguous()
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        t, k = ids.shape
        if x.shape != (t, self.hidden_size) or weights.shape != ids.shape:
            raise ValueError(f"{self.name}: x {list(x.shape)}, ids {list(ids.shape)}, weights "
                             f"{list(weights.shape)} do not fit hidden size {self.hidden_size}")
        if out is None:
            out = torch.empty(t, self.hidden_size, dtype=torch.float32)
        if self.backend == "kernel":
            g, u, d = self._mat_refs
            rc = self._lib.nc_moe_forward(_ptr(x), t, self.hidden_size, _ptr(ids), _ptr(weights), k,
                                          self.num_experts, g, u, d, _ptr(out), self.threads)
            _check(rc, self.name)
            return out
        out.copy_(self._torch_forward(x, ids, weights))
        return out

    def _matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w^T; batch_invariant: on the q8 kernels' dense tiles, each row of x summed in one order
        whatever the other rows (torch's GEMM blocks by the rows: a token's result would depend on how many
        share its expert)."""
        return cpu_qgemv.matmul(x, cpu_qgemv.pack_dense(w)) if self.batch_invariant else x @ w.T

    def _torch_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_experts):
            raise ValueError(f"{self.name}: expert id out of range")
        k = ids.shape[1]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):   # a loop over the active experts; rows are batched
            if not n:
                continue
            sel = order[start:start + n]
            start += n
            rows = sel // k
            xs = x.index_select(0, rows)
            gate, up = self._matmul(xs, self.gate.dense_expert(e)), self._matmul(xs, self.up.dense_expert(e))
            h = activation("silu", gate, up)
            y = self._matmul(h, self.down.dense_expert(e)) * weights.reshape(-1)[sel].unsqueeze(1)
            out.index_add_(0, rows, y)
        return out
