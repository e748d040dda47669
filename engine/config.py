"""Engine configuration: defaults, environment overrides, validation (once, then frozen)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


# Environment variable -> Config field. Explicit arguments win over the environment.
ENV_OVERRIDES = {
    "NANO_VLLM_MAX_NUM_SEQS": ("max_num_seqs", int),
    "NANO_VLLM_MAX_MODEL_LEN": ("max_model_len", int),
    "NANO_VLLM_MAX_BATCHED_TOKENS": ("max_num_batched_tokens", int),
    "NANO_VLLM_GPU_MEMORY_UTILIZATION": ("gpu_memory_utilization", float),
    "NANO_VLLM_KVCACHE_BLOCK_SIZE": ("kvcache_block_size", int),
    "NANO_VLLM_CPU_THREADS": ("cpu_threads", int),
    "NANO_VLLM_KV_CACHE_DTYPE": ("kv_cache_dtype", str),
    "NANOCHAT_PACK_CACHE": ("pack_cache", _flag),
    "NANOCHAT_CPU_ISA": ("cpu_isa", str),
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Config:
    model: str = ""
    device: str = "cpu"                 # "cpu" | "cuda" | "auto"
    dtype: str = "auto"                 # auto: fp32 on CPU, bf16 on CUDA
    max_num_seqs: int = 16
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    kvcache_block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_gib: float = 1.0           # CPU: KV-cache budget (an upper bound: pages are touched as used)
    kv_cache_dtype: str = "auto"        # auto: float16 on CPU (as llama.cpp), the compute dtype on CUDA
    num_kvcache_blocks: int | None = None   # explicit block count (tests, tiny budgets)
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    cpu_threads: int | None = None
    dequantize: bool = False            # materialise GGUF weights as dense tensors
    quantize: str | None = None         # "q8_0": quantize a dense checkpoint's linears at load
    moe_offload: str = "auto"           # routed MoE experts on the host: auto | cpu | none
    pack_cache: bool = True             # CPU: keep a GGUF's repacked kernel weights on disk for the next load
    cpu_isa: str = "auto"               # CPU kernels' build: auto (native) | avx2 | scalar (benchmarks, tests)

    @classmethod
    def create(cls, model: str = "", **kwargs) -> "Config":
        """Defaults <- environment <- explicit kwargs, then validate."""
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown config option(s): {', '.join(sorted(unknown))}")
        values = {}
        for env, (name, cast) in ENV_OVERRIDES.items():
            raw = os.environ.get(env)
            if raw not in (None, "") and name not in kwargs:
                try:
                    values[name] = cast(raw)
                except ValueError:
                    kind = "flag (0 or 1)" if cast is _flag else cast.__name__
                    raise ValueError(f"{env}={raw!r} is not a valid {kind}") from None
        values.update({k: v for k, v in kwargs.items() if v is not None})
        cfg = cls(model=model, **values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def positive(name):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "kvcache_block_size"):
            positive(name)
        if self.kvcache_block_size & (self.kvcache_block_size - 1):
            raise ValueError(f"kvcache_block_size must be a power of two, got {self.kvcache_block_size}")
        if self.device not in ("cpu", "cuda", "auto") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks < 1:
            raise ValueError(f"num_kvcache_blocks must be >= 1, got {self.num_kvcache_blocks}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto, float32, float16 or bfloat16, got {self.kv_cache_dtype!r}")
        if self.quantize not in (None, "q8_0"):
            raise ValueError(f"quantize must be q8_0 (or unset), got {self.quantize!r}")
        if self.quantize and self.dequantize:
            raise ValueError("quantize and dequantize exclude each other")
        if self.moe_offload not in ("auto", "cpu", "none"):
            raise ValueError(f"moe_offload must be auto, cpu or none, got {self.moe_offload!r}")
        if self.cpu_isa not in ("auto", "avx2", "scalar"):
            raise ValueError(f"cpu_isa must be auto, avx2 or scalar, got {self.cpu_isa!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device cuda was requested but torch sees no CUDA device")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def resolved_kv_dtype(self, device: torch.device, compute_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype. On the CPU 16-bit halves the cache's memory and bandwidth; fp16 (not
        bf16) keeps 10 mantissa bits, and attention widens it to fp32 (tests/test_fused_models.py pins the cost)."""
        if self.kv_cache_dtype == "auto":
            return torch.float16 if device.type == "cpu" else compute_dtype
        return DTYPES[self.kv_cache_dtype]

    def with_model_limits(self, max_position_embeddings: int) -> "Config":
        """Clamp max_model_len to what the model supports (a new Config; the original is untouched)."""
        if self.max_model_len <= max_position_embeddings:
            return self
        return replace(self, max_model_len=max_position_embeddings)
