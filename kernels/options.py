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
    # Host MoE experts' threads; None: one per physical core this process may run on (memory-bound: a core's
    # second hardware thread only contends for bandwidth).
    expert_threads: int | None = None
    # Dense models on the CPU run each step's layer stack in one compiled call (models/layers/fused_forward.py).
    fused_forward: bool = True

    def __post_init__(self):
        if self.act_levels not in ACT_LEVELS:
            raise ValueError(f"activation levels must be 1 or 2, got {self.act_levels!r}")

    def expert_thread_count(self) -> int:
        return self.expert_threads or physical_cores()


def physical_cores(topology: str = "/sys/devices/system/cpu") -> int:
    """Physical cores among the CPUs this process may run on (Linux sysfs topology: distinct package and core
    ids); elsewhere, or when sysfs cannot be read, half the logical CPUs (SMT's usual two threads a core)."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:
        cpus = range(os.cpu_count() or 2)
    cores = set()
    try:
        for cpu in cpus:
            base = f"{topology}/cpu{cpu}/topology"
            with open(f"{base}/physical_package_id") as pkg, open(f"{base}/core_id") as core:
                cores.add((pkg.read().strip(), core.read().strip()))
    except OSError:
        return max(1, len(cpus) // 2)
    return max(1, len(cores))


DEFAULT = KernelOptions()
