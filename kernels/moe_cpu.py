"""Routed MoE experts on the host CPU, computed from GGML blocks where they lie (e.g. a GGUF memory map).

`HostExperts(gate, up, down)` holds one projection of every expert each (a `StackedWeight`:
[experts, out, in], quantized rows as raw uint8 blocks) and computes, for hidden states x [T, H] and
the router's top-k ids / weights [T, k]:

    out[t] = sum_j weights[t, j] * (down_e act(gate_e x_t + bg_e, up_e x_t + bu_e) + bd_e),   e = ids[t, j]

act "silu": silu(g) * u (most MoE models); "swiglu_oai": gpt-oss's clamped variant, `clamped_swiglu`. The
per-expert biases bg, bu [E, I] and bd [E, H] (gpt-oss) are optional: absent, they are zero.

Two backends:
- "kernel": kernels/csrc/moe.cpp in the matmul library of kernels/cpu_qgemv.py, for the block types
  it takes (Q4_0 .. Q8_0, Q2_K .. Q6_K, MXFP4): the same int8 activations (KernelOptions.act_levels) and
  integer products as the dense layers' matmuls, on their thread pool, read from the raw
  rows (no repacked copy). Results are those of cpu_qgemv.matmul on the weights packed, bit for bit,
  on every code path, and a token's output does not depend on the other tokens of the call.
- "torch": dequantizes the selected experts per call and uses fp32 matmuls (a loop over active
  experts). Used for other weight types, dense experts, and when the library cannot be built.

Threads and activation levels: the engine's KernelOptions (expert_threads: its cpu_threads, default one per
physical core).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from nanochat.kernels import cpu_qgemv
from nanochat.kernels import gguf_quants as gq
from nanochat.kernels.cpu_decoder import activation
from nanochat.kernels.options import DEFAULT, KernelOptions
from nanochat.kernels.qweight import QuantWeight, Shaped

DENSE_TYPES = frozenset({gq.F32, gq.F16, gq.BF16})
KERNEL_TYPES = cpu_qgemv.KERNEL_TYPES - DENSE_TYPES
_ERRORS = {1: "unsupported weight type", 2: "shapes do not match the block size", 3: "expert id out of range",
           4: "unknown activation"}
ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}   # csrc/moe.cpp ACT_*


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation (transformers' GptOssExperts._apply_gate) for float32 gate / up:
    g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * (g * sigmoid(g * alpha)). The sigmoid is
    cpu_decoder.activation's (per element, whatever the batch, on the CPU); the rest is exact per element."""
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    return (u + 1) * (g * activation("sigmoid", g * alpha))


class _Mat(ctypes.Structure):
    """Mirror of NcMat in csrc/moe.h: one projection of every expert."""

    _fields_ = [("type", ctypes.c_int32), ("reserved", ctypes.c_int32), ("data", ctypes.c_void_p),
                ("expert_stride", ctypes.c_int64), ("row_stride", ctypes.c_int64),
                ("rows", ctypes.c_int64), ("cols", ctypes.c_int64)]


@dataclass
class StackedWeight(Shaped):
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


# ---------------------------------------------------------------- the compiled library


def available() -> bool:
    return cpu_qgemv.available()


def _check(rc: int, what: str) -> None:
    if rc:
        raise ValueError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


def quant_matmul(qw: QuantWeight, x: torch.Tensor, threads: int | None = None,
                 levels: int | None = None) -> torch.Tensor:
    """y [n, out] = x [n, in] @ W^T on W's raw blocks (a kernel type), as the experts compute it:
    activations quantized with `levels` levels (default cpu_qgemv.DEFAULT_LEVELS)."""
    lib = cpu_qgemv.extension()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available")
    if qw.ggml_type not in KERNEL_TYPES:
        raise ValueError(f"no CPU kernel for {qw.type_name} (have {sorted(gq.type_name(t) for t in KERNEL_TYPES)})")
    x = x.detach().to(torch.float32).contiguous().cpu()
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"quant_matmul: input has {x.shape[-1]} features, weight expects {qw.in_features}")
    data = qw.data
    if data.stride(-1) != 1:
        data = data.contiguous()
    y = torch.empty(x.shape[0], qw.out_features)
    _check(lib.nc_qg_matmul_rows(qw.ggml_type, data.data_ptr(), qw.out_features, qw.in_features, data.stride(0),
                                 x.data_ptr(), x.shape[0], x.shape[1], y.data_ptr(), qw.out_features,
                                 (levels or cpu_qgemv.DEFAULT_LEVELS) == 2, threads or DEFAULT.expert_thread_count()),
           f"{qw.type_name} matmul")
    return y


# ---------------------------------------------------------------- the expert executor


class HostExperts:
    """The routed experts of one MoE layer, computed on the host (see the module docstring).

    backend: "auto" (compiled kernels when every projection is a kernel type and the extension
    builds, else torch), "kernel" (require the kernels), "torch". activation: "silu" or "swiglu_oai"
    (with alpha and limit); gate_bias / up_bias [E, I], down_bias [E, H]: float tensors, or None."""

    def __init__(self, gate: StackedWeight, up: StackedWeight, down: StackedWeight,
                 options: KernelOptions = DEFAULT, backend: str = "auto", name: str = "experts", *,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                 gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None):
        if backend not in ("auto", "kernel", "torch"):
            raise ValueError(f"unknown host expert backend {backend!r} (auto, kernel, torch)")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{name}: unknown expert activation {activation!r} ({', '.join(ACTIVATIONS)})")
        for w, what in ((gate, "gate"), (up, "up"), (down, "down")):
            w.check(f"{name}.{what}")
        e, inter, hidden = gate.shape
        if up.shape != gate.shape or down.shape != (e, hidden, inter):
            raise ValueError(f"{name}: expert shapes do not fit together: gate {list(gate.shape)}, "
                             f"up {list(up.shape)}, down {list(down.shape)}")
        self.gate, self.up, self.down = gate, up, down
        self.num_experts, self.hidden_size, self.intermediate_size = e, hidden, inter
        self.activation, self.alpha, self.limit = activation, float(alpha), float(limit)
        self.act_id = ACTIVATIONS[activation]   # the kernel's code for it (csrc/moe.cpp ACT_*)
        self.gate_bias, self.up_bias, self.down_bias = (
            self._bias(b, (e, n), f"{name}.{what}_bias")
            for b, n, what in ((gate_bias, inter, "gate"), (up_bias, inter, "up"), (down_bias, hidden, "down")))
        self.threads, self.levels = options.expert_thread_count(), options.act_levels
        self.name = name
        self.batch_invariant = False   # the torch backend's matmuls on the q8 kernels (Config.batch_invariant)
        types = {gate.ggml_type, up.ggml_type, down.ggml_type}
        lib = None
        if backend != "torch" and types <= KERNEL_TYPES:
            lib = cpu_qgemv.extension()
        if backend == "kernel" and lib is None:
            raise RuntimeError(f"{name}: the CPU expert kernels are unavailable for "
                               f"{sorted(gq.type_name(t) for t in types)}")
        self.backend = "kernel" if lib is not None else "torch"
        self._lib = lib
        # the kernel's view of gate, up and down (NcMat, csrc/moe.h); the fused decoder step's plan points at them too
        self.mats = [self._mat(w) for w in (gate, up, down)] if lib is not None else []
        self._mat_refs = tuple(ctypes.byref(m) for m in self.mats)

    @staticmethod
    def _bias(b: torch.Tensor | None, shape: tuple[int, int], name: str) -> torch.Tensor | None:
        """A bias as the kernel reads it: float32, contiguous, on the host; None stays None."""
        if b is None:
            return None
        if not isinstance(b, torch.Tensor) or not b.is_floating_point() or tuple(b.shape) != shape:
            got = f"{b.dtype} {list(b.shape)}" if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"{name}: expert biases need a float tensor {list(shape)}, got {got}")
        return b.detach().to(device="cpu", dtype=torch.float32).contiguous()

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
            bg, bu, bd = (None if b is None else b.data_ptr() for b in (self.gate_bias, self.up_bias, self.down_bias))
            rc = self._lib.nc_moe_forward(x.data_ptr(), t, self.hidden_size, ids.data_ptr(), weights.data_ptr(), k,
                                          self.num_experts, g, u, d, out.data_ptr(), ACTIVATIONS[self.activation],
                                          self.alpha, self.limit, bg, bu, bd, self.levels == 2, self.threads)
            _check(rc, self.name)
            return out
        out.copy_(self._torch_forward(x, ids, weights))
        return out

    def _matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w^T; batch_invariant: on the q8 kernels' dense tiles, each row of x summed in one order
        whatever the other rows (torch's GEMM blocks by the rows: a token's result would depend on how many
        share its expert)."""
        return cpu_qgemv.matmul(x, cpu_qgemv.pack_dense(w), threads=self.threads) if self.batch_invariant else x @ w.T

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
            if self.gate_bias is not None:
                gate = gate + self.gate_bias[e]
            if self.up_bias is not None:
                up = up + self.up_bias[e]
            if self.activation == "silu":
                h = activation("silu", gate, up)
            else:
                h = clamped_swiglu(gate, up, self.alpha, self.limit)
            y = self._matmul(h, self.down.dense_expert(e))
            if self.down_bias is not None:
                y = y + self.down_bias[e]
            y = y * weights.reshape(-1)[sel].unsqueeze(1)
            out.index_add_(0, rows, y)
        return out
