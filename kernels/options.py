"""The CPU kernels' options, passed as an argument from the engine's Config down to each kernel call:
two engines in one process each run with their own (no process-wide switches)."""

from __future__ import annotations

import os
from dataclasses import dataclass

ACT_LEVELS = (1, 2)


@dataclass(frozen=True)
class KernelOptions:
    # GGUF linears' backend: "auto" picks per device and type (kernels/quant_matmul.py), or one for all.
    quant_backend: str = "auto"
    # q8 kernels' activation quantization: 2 (int8 codes + int8 residual codes) or 1 (llama.cpp's).
    act_levels: int = 2
    # Threads of the kernels' own pool per call; None: torch.get_num_threads() at call time.
    threads: int | None = None
    # Host MoE experts' threads; None: half the logical CPUs (memory-bound: more threads than cores only
    # contend for bandwidth).
    expert_threads: int | None = None
    # Dense models on the CPU run each step's layer stack in one compiled call (models/layers/fused_forward.py).
    fused_forward: bool = True

    def __post_init__(self):
        if self.act_levels not in ACT_LEVELS:
            raise ValueError(f"activation levels must be 1 or 2, got {self.act_levels!r}")

    def expert_thread_count(self) -> int:
        return self.expert_threads or max(1, (os.cpu_count() or 2) // 2)


DEFAULT = KernelOptions()
