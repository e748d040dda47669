"""The inference engine: paged KV cache, prefix caching, continuous batching."""

from nanochat.engine.config import Config
from nanochat.engine.llm import LLM
from nanochat.engine.llm_engine import LLMEngine, RequestError
from nanochat.engine.output import EngineStats, RequestResult, RequestStats, TokenEvent
from nanochat.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "Config", "SamplingParams", "RequestError", "RequestResult",
           "RequestStats", "TokenEvent", "EngineStats"]
