"""What crosses the engine-process boundary, and the typed errors a client raises.

Client -> core: `Call(op, call_id, args)`; the core answers each call once, with
    ("done", call_id, value)  or  ("failed", call_id, error_kind, one_line_message)
and may send ("progress", call_id, payload) before that (model loading, a bench), and
("status", call_id, text): slow one-time work a load does now (compiling the kernels, a first repack).
Core -> client, unprompted:
    ("events", [TokenEvent, ...])      the deltas of all requests, every EVENTS_INTERVAL seconds while
                                       they stream, and at once when one ends
    ("session", session_id, ids)       a chat session's canonical token ids after a finished turn
    ("stats", EngineStats)             at most every STATS_INTERVAL seconds, and after loads

Everything is picklable plain data without torch: front ends never import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanochat.models.errors import one_line  # noqa: F401 (front ends import it from here, with the errors)
# The reply format of harmony models crosses the boundary as text; front ends split it with the engine's parser.
from nanochat.models.text.harmony import HarmonySplitter, split_harmony  # noqa: F401
from nanochat.models.text.harmony import call_grammar as harmony_call_grammar  # noqa: F401

STATS_INTERVAL = 0.25     # seconds between engine-stats reports while busy
# Seconds token events wait to share one message with later steps' (a step can take a few ms): fewer
# messages to pickle on the engine's loop and to wake the client's reader for; a front end draws at
# most every 0.1 s anyway.
EVENTS_INTERVAL = 0.02


@dataclass
class Call:
    op: str
    call_id: int
    args: dict = field(default_factory=dict)


@dataclass
class ModelInfo:
    """What a front end shows about the loaded model."""

    model: str                 # as given: a path or a hub id
    arch: str
    device: str
    dtype: str
    max_model_len: int
    load_seconds: float
    sampling_defaults: dict = field(default_factory=dict)   # SamplingParams keywords the model recommends (its file, its card)
    tensor_parallel_size: int = 1
    thinking_switch: bool = False   # the chat template reads enable_thinking (its prompt differs with it on and off)
    # The enable_thinking values (None: not given) whose generation prompt opens a <think> block itself:
    # the model then writes only the thinking's body and </think>.
    thinking_opened: frozenset = frozenset()
    tools: bool = False             # the chat template renders a `tools` list (function calling)
    harmony: bool = False           # replies are in the harmony format (gpt-oss): channels, not <think>
    reasoning_efforts: tuple = ()   # the reasoning_effort values the chat template reads (gpt-oss: low, medium, high)
    speculative: str = "off"        # the engine's speculative proposer: off, ngram or draft (a request may pick another)
    speculative_modes: tuple = ("off",)   # the proposers a request may pick here (draft: with a draft model loaded)
    pooling: str = "mean"           # an embedding request's pooling (engine/pooling.py): the model's own, else mean
    embedding_model: bool = False   # the model's files state a pooling: an embedding model (Ollama's "embedding")
    embedding_length: int = 0       # the width of its embeddings (the hidden size)
    writes_text: bool = True        # False: an encoder (BERT-style): embeddings only, no replies


class EngineError(RuntimeError):
    """The engine could not do what was asked; the message is one line for the user."""


class EngineDied(EngineError):
    """The engine process ended unexpectedly (killed, crashed, out of memory)."""


class EngineRestarting(EngineError):
    """A new engine process is loading the model after the last one died: ask again shortly."""


def error_kind(exc: BaseException) -> str:
    """The name a client maps back to an exception class (see `remote_error`)."""
    return type(exc).__name__


def remote_error(kind: str, message: str) -> BaseException:
    """The client-side exception for an error the core reported: the same class where front ends
    handle it specially (a bad model, a bad request, a bench stop, bad options), else EngineError."""
    from nanochat.engine.output import RequestError
    from nanochat.engine.serve.bench import BenchCancelled, BenchError
    from nanochat.models.errors import ModelLoadError

    known = {cls.__name__: cls for cls in (ModelLoadError, RequestError, BenchError, BenchCancelled,
                                          ValueError, MemoryError, FileNotFoundError, PermissionError)}
    return known.get(kind, EngineError)(message)

