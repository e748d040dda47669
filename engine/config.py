"""Engine configuration: defaults, environment overrides, validation (once, then frozen).

Importing this module loads no torch (the command line imports the dtype names and the device check
from here); the methods that need torch import it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from nanochat.engine.rules import (FRACTION, KV_CACHE_GIB, POOLINGS, POSITIVE_INT, SPECULATIVE_K, THREADS, TP_SIZE,
                                   check, shown)
from nanochat.kernels.options import ACT_LEVELS

if TYPE_CHECKING:
    import torch


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


# Environment variable -> (Config field, parser); explicit arguments win over the environment. Every
# knob of the engine and its kernels is read here, once per Config.create, and nowhere else.
# NANO_VLLM_*: nano-vllm's names, kept for its users; NANOCHAT_*: the rest (README: "Environment variables").
ENV_OVERRIDES = {
    "NANO_VLLM_MAX_NUM_SEQS": ("max_num_seqs", int),
    "NANO_VLLM_MAX_MODEL_LEN": ("max_model_len", int),
    "NANO_VLLM_MAX_BATCHED_TOKENS": ("max_num_batched_tokens", int),
    "NANO_VLLM_GPU_MEMORY_UTILIZATION": ("gpu_memory_utilization", float),
    "NANO_VLLM_KVCACHE_BLOCK_SIZE": ("kvcache_block_size", int),
    "NANO_VLLM_CPU_THREADS": ("cpu_threads", int),
    "NANO_VLLM_KV_CACHE_DTYPE": ("kv_cache_dtype", str),
    "NANO_VLLM_TENSOR_PARALLEL_SIZE": ("tensor_parallel_size", int),
    "NANOCHAT_PACK_CACHE": ("pack_cache", _flag),
    "NANOCHAT_CPU_ISA": ("cpu_isa", str),
    "NANOCHAT_QUANT_BACKEND": ("quant_backend", str),
    "NANOCHAT_FUSED_FORWARD": ("fused_forward", _flag),
    "NANOCHAT_ACT_LEVELS": ("act_levels", int),
    "NANOCHAT_BATCH_INVARIANT": ("batch_invariant", _flag),
    "NANOCHAT_SPECULATIVE": ("speculative", str),
    "NANOCHAT_SPECULATIVE_K": ("speculative_k", int),
}

# What the engine process's environment defaults to, before torch loads libgomp: OpenMP workers that spin
# after every torch op (libgomp's default) take the cores the CPU kernels' own thread pool needs between
# ops. Set where an engine process starts (the client, tensor-parallel ranks, benchmark workers), never at
# import; a value the user set wins.
ENGINE_PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def engine_process_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a new engine process: `base` (os.environ) over ENGINE_PROCESS_ENV."""
    return {**ENGINE_PROCESS_ENV, **(os.environ if base is None else base)}


# dtype names the engine (and the command line's --dtype, besides "auto") accepts -> torch's name
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
DEVICES = "cpu, cuda, cuda:N or auto"   # what valid_device accepts, for messages
# kernels/quant_matmul.BACKENDS (tests/test_options.py pins them equal): named here so that checking a
# config needs no torch, and the command line can check one before it starts the engine.
QUANT_BACKENDS = ("auto", "q8", "int4", "dense", "triton")


def _launch_world_size() -> int | None:
    """WORLD_SIZE when a torch.distributed launcher (torchrun) started this process among several."""
    raw = os.environ.get("WORLD_SIZE", "")
    if "RANK" not in os.environ or not raw.isdigit() or int(raw) < 2:
        return None
    return int(raw)


def launched_rank() -> int | None:
    """This process's RANK when a torch.distributed launcher (torchrun) started several, else None."""
    if _launch_world_size() is None or not os.environ["RANK"].isdigit():
        return None
    return int(os.environ["RANK"])


def valid_device(name) -> bool:
    """cpu, cuda, cuda:N (N digits) or auto."""
    return isinstance(name, str) and (name in ("cpu", "cuda", "auto")
                                      or (name.startswith("cuda:") and name[5:].isascii() and name[5:].isdigit()))


def names_a_model(value: str) -> bool:
    """Whether `value` can name a model to load: a .gguf file, a folder with a config.json, or (when no such
    path exists) a hub id "owner/name". A typo of a word (`ngarm`) or a stray path is refused up front."""
    path = os.path.expanduser(value)
    if os.path.exists(path):
        return (os.path.isfile(path) and path.lower().endswith(".gguf")) or \
            os.path.isfile(os.path.join(path, "config.json"))
    return re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.-]+)?", value) is not None


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, DTYPES[name])


@dataclass(frozen=True)
class Config:
    model: str = ""
    device: str = "cpu"                 # cpu | cuda | cuda:N | auto
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
    cpu_threads: int | None = None      # torch's and the host MoE kernels' threads (None: all CPUs / half)
    dequantize: bool = False            # materialise GGUF weights as dense tensors
    quantize: str | None = None         # "q8_0": quantize a dense checkpoint's linears at load
    moe_offload: str = "auto"           # routed MoE experts on the host: auto | cpu | none
    pack_cache: bool = True             # keep what a load builds slowly (packed CPU weights, merges) on disk
    cpu_isa: str = "auto"               # CPU kernels' build: auto (native) | avx2 | scalar (benchmarks, tests)
    quant_backend: str = "auto"         # linears: auto | q8 | int4 | dense | triton (kernels/quant_matmul.py)
    fused_forward: bool = True          # CPU: a dense model's whole step in one compiled call (models/layers/fused_forward.py)
    act_levels: int = 2                 # q8 kernels' activation quantization: 2 (int8 + residual) or 1 (llama.cpp)
    batch_invariant: bool = False       # CPU: a sequence's tokens independent of its batch also with torch's GEMMs
                                        # (quant_backend dense, dequantize, an HF MoE's dense experts); see
                                        # models/layers/common.py
    speculative: str = "auto"           # speculative decoding's proposer: auto | off | ngram | a draft model (its path
                                        # or hub id: same tokenizer); auto: ngram where exact (LLMEngine._proposer)
    speculative_k: int = 8              # most tokens proposed for one step
    pooling: str = "auto"               # embedding requests' default pooling: auto (the model's files' own, else
                                        # mean) | mean | cls | last (engine/pooling.py)
    tensor_parallel_size: int = 1       # ranks the model is split over (engine/tensor_parallel.py); under a
                                        # torch.distributed launcher (torchrun) its WORLD_SIZE
    chat_template: str | None = None    # a Jinja chat template file used instead of the model's

    @classmethod
    def create(cls, model: str = "", **kwargs) -> "Config":
        """Defaults <- environment <- explicit kwargs, then validate. A bad environment value is a
        one-line ValueError naming the variable."""
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown config option(s): {', '.join(sorted(unknown))}")
        values, from_env = {}, {}
        for env, (name, cast) in ENV_OVERRIDES.items():
            raw = os.environ.get(env)
            if raw not in (None, "") and name not in kwargs:
                try:
                    values[name] = cast(raw)
                except ValueError:
                    kind = {_flag: "a flag (0 or 1)", int: "an integer", float: "a number"}[cast]
                    raise ValueError(f"{env}={shown(raw)} is not {kind}; fix or unset it") from None
                from_env[name] = f"{env}={shown(raw)}"
        values.update({k: v for k, v in kwargs.items() if v is not None})
        world = _launch_world_size()
        if world is not None:   # started by torchrun & co: every rank of the launch is a tensor-parallel rank
            asked = values.setdefault("tensor_parallel_size", world)
            if asked != world:
                raise ValueError(f"tensor_parallel_size {asked} differs from the launcher's WORLD_SIZE {world}")
        cfg = cls(model=model, **values)
        try:
            cfg.validate()
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            if name in from_env:
                raise ValueError(f"{from_env[name]}: {e}; fix or unset it") from None
            raise
        return cfg

    def validate(self) -> None:
        """Raises ValueError("<field> must be ..."), the field's name first."""
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "kvcache_block_size"):
            check(name, POSITIVE_INT, getattr(self, name))
        if self.kvcache_block_size & (self.kvcache_block_size - 1):
            raise ValueError(f"kvcache_block_size must be a power of two, got {self.kvcache_block_size}")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"chat_template must be a chat template file, got {shown(self.chat_template)} "
                             f"({'a folder' if os.path.isdir(self.chat_template) else 'no such file'})")
        if not valid_device(self.device):
            raise ValueError(f"device must be {DEVICES}, got {shown(self.device)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {shown(self.dtype)}")
        check("gpu_memory_utilization", FRACTION, self.gpu_memory_utilization)
        check("kv_cache_gib", KV_CACHE_GIB, self.kv_cache_gib)
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks < 1:
            raise ValueError(f"num_kvcache_blocks must be >= 1, got {self.num_kvcache_blocks}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto, float32, float16 or bfloat16, "
                             f"got {shown(self.kv_cache_dtype)}")
        if self.quantize not in (None, "q8_0"):
            raise ValueError(f"quantize must be q8_0 (or unset), got {shown(self.quantize)}")
        if self.quantize and self.dequantize:
            raise ValueError("quantize and dequantize exclude each other: give --quantize or --dequantize, not both")
        if self.moe_offload not in ("auto", "cpu", "none"):
            raise ValueError(f"moe_offload must be auto, cpu or none, got {shown(self.moe_offload)}")
        if self.cpu_isa not in ("auto", "avx2", "scalar"):
            raise ValueError(f"cpu_isa must be auto, avx2 or scalar, got {shown(self.cpu_isa)}")
        if self.cpu_threads is not None:
            check("cpu_threads", THREADS, self.cpu_threads)
        if self.quant_backend not in QUANT_BACKENDS:
            raise ValueError(f"quant_backend must be one of {', '.join(QUANT_BACKENDS)}, "
                             f"got {shown(self.quant_backend)}")
        check("tensor_parallel_size", TP_SIZE, self.tensor_parallel_size)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) if launched_rank() is not None else 0
        cpus = os.cpu_count() or 1
        if self.device == "cpu" and (local or self.tensor_parallel_size) > cpus:
            raise ValueError(f"tensor_parallel_size must be at most {cpus} on the CPU (this machine's CPUs: each "
                             f"rank needs one), got {self.tensor_parallel_size}")
        if not isinstance(self.speculative, str) or not (self.speculative in ("auto", "off", "ngram")
                                                         or names_a_model(self.speculative)):
            raise ValueError(f"speculative must be auto, off, ngram or a draft model's path or hub id, "
                             f"got {shown(self.speculative)}")
        check("speculative_k", SPECULATIVE_K, self.speculative_k)
        if self.pooling not in ("auto", *POOLINGS):
            raise ValueError(f"pooling must be auto, {', '.join(POOLINGS[:-1])} or {POOLINGS[-1]}, "
                             f"got {shown(self.pooling)}")
        if self.act_levels not in ACT_LEVELS:
            raise ValueError(f"act_levels must be 1 or 2, got {self.act_levels!r}")

    def cpu_thread_count(self) -> int:
        """The engine's CPU threads (torch's and the kernels'): cpu_threads, else this rank's share of the CPUs."""
        return self.cpu_threads or max(1, (os.cpu_count() or 2) // self.tensor_parallel_size)

    def use_cpu_isa(self) -> None:
        """Load the lower-ISA build of the CPU kernels that cpu_isa forces, for this process ("auto": the native
        build stays)."""
        if self.cpu_isa != "auto":
            from nanochat.kernels import cpu_qgemv

            cpu_qgemv.use_isa(self.cpu_isa)

    def kernel_options(self):
        """The options this engine hands its model and kernels (kernels/options.py): each engine its own."""
        from nanochat.kernels.options import KernelOptions

        return KernelOptions(quant_backend=self.quant_backend, act_levels=self.act_levels,
                             threads=self.cpu_thread_count() if self.device == "cpu" else None,
                             expert_threads=self.cpu_threads, fused_forward=self.fused_forward)

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device cuda was requested but torch sees no CUDA device")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _torch_dtype(self.dtype)

    def resolved_kv_dtype(self, device: torch.device, compute_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype. On the CPU 16-bit halves the cache's memory and bandwidth; fp16 (not
        bf16) keeps 10 mantissa bits, and attention widens it to fp32 (tests/test_fused_models.py pins the cost)."""
        import torch

        if self.kv_cache_dtype == "auto":
            return torch.float16 if device.type == "cpu" else compute_dtype
        return _torch_dtype(self.kv_cache_dtype)

    def with_model_limits(self, max_position_embeddings: int) -> "Config":
        """Clamp max_model_len to what the model supports (a new Config; the original is untouched)."""
        if self.max_model_len <= max_position_embeddings:
            return self
        return replace(self, max_model_len=max_position_embeddings)
