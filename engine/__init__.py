"""The inference engine: paged KV cache, prefix caching, continuous batching.

The nano-vllm core (llm, llm_engine, scheduler, block_manager, model_runner, sequence, sampler)
sits here; engine/serve/ runs it in its own process behind one client. Names are imported on first
use, so `from nanochat.engine import SamplingParams` does not pay for torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "llm", "LLMEngine": "llm_engine", "Config": "config", "SamplingParams": "sampling_params",
    "RequestError": "output", "RequestResult": "output", "RequestStats": "output", "TokenEvent": "output",
    "EngineStats": "output", "Reply": "output", "PoolingParams": "pooling", "EmbeddingResult": "output",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nanochat.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"nanochat.engine.{module}"), name)
