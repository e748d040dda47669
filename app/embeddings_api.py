"""Embeddings over HTTP: OpenAI's `POST /v1/embeddings`, Ollama's `POST /api/embed` and its older `/api/embeddings`,
for the tools that index documents with a local model (Open WebUI's RAG, Continue's codebase index, LangChain's
OpenAIEmbeddings and OllamaEmbeddings, LlamaIndex).

Each input is one engine request (engine/pooling.py): the inputs of a request run batched, each prompt's final
hidden states pooled as the model's files say (an embedding model's own pooling: Qwen3-Embedding's last token,
a mean-pooled model's mean) or, for a model that states none, averaged, as Ollama does.
- OpenAI: `input` a string, a list of strings, a list of token ids or a list of such lists (at most 2048);
  `dimensions` keeps the first N values (Matryoshka models) before normalizing; `encoding_format` "float" or
  "base64" (little-endian float32, what the openai SDK asks for by default). The vectors have unit length.
- Ollama /api/embed: `input` a string or a list of strings; `truncate` (default true) cuts an input longer than
  the context to its first tokens instead of failing; `dimensions`; unit-length vectors; counts and nanosecond
  durations. /api/embeddings (deprecated by Ollama, still used): one `prompt`, the vector as it is (not normalized).
  Either without an input loads the model and answers an empty list, as Ollama's server does.
"""

from __future__ import annotations

import base64
import json
import struct

from nanochat.app.api_errors import ApiError, flag, type_error
from nanochat.engine import PoolingParams
from nanochat.engine.rules import POSITIVE_INT, accepts

MAX_INPUTS = 2048   # OpenAI's limit on one request's inputs

Inputs = list[str | list[int]]


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def parse_input(value, name: str, ids: bool) -> Inputs:
    """A request's inputs: text, or a list of texts (`ids`: also token ids, or lists of them)."""
    wanted = "a string, a list of strings, token ids or lists of token ids" if ids else "a string or a list of strings"
    if isinstance(value, str):
        inputs = [value]
    elif ids and _is_ids(value):
        inputs = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or (ids and _is_ids(v)) for v in value):
        inputs = list(value)
    else:
        raise type_error(name, wanted, value)
    if len(inputs) > MAX_INPUTS:
        raise ApiError(400, f"{name} has {len(inputs)} inputs; at most {MAX_INPUTS} go in one request", param=name)
    for at, item in enumerate(inputs):
        if item == "":
            where = name if len(inputs) == 1 else f"{name}[{at}]"
            raise ApiError(400, f"{where} is empty: there is nothing to embed", param=name)
    return inputs


def _dimensions(body: dict) -> int | None:
    value = body.get("dimensions")
    if value is None:
        return None
    if not accepts(POSITIVE_INT, value):
        raise type_error("dimensions", POSITIVE_INT.text, value)
    return value


def _check_width(pooling: PoolingParams, width: int) -> None:
    if pooling.dimensions is not None and width and pooling.dimensions > width:
        raise ApiError(400, f"dimensions is {pooling.dimensions}, but this model's embeddings have {width} values",
                       param="dimensions")


# ---------------------------------------------------------------------------------- OpenAI
def openai_request(body: dict, pooling: str, width: int) -> tuple[Inputs, PoolingParams, str]:
    """(inputs, pooling, encoding format) of a /v1/embeddings body; `pooling`: the model's, `width`: its size."""
    if "input" not in body:
        raise ApiError(400, "input is required: the text (or texts) to embed", param="input")
    inputs = parse_input(body["input"], "input", ids=True)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, f"encoding_format must be \"float\" or \"base64\", got {json.dumps(fmt)[:60]}",
                       param="encoding_format")
    params = PoolingParams(pooling, dimensions=_dimensions(body))
    _check_width(params, width)
    return inputs, params, fmt


def _encoded(vector: list[float], fmt: str):
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def openai_response(model: str, vectors: list[list[float]], prompt_tokens: int, fmt: str) -> dict:
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, fmt)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


# ---------------------------------------------------------------------------------- Ollama
def ollama_embed_request(body: dict, pooling: str, width: int) -> tuple[Inputs, PoolingParams, bool]:
    """(inputs, pooling, truncate) of an /api/embed body; no inputs (none, "" or []): a load request, as Ollama's."""
    value = body.get("input")
    inputs = [] if value in (None, "", []) else parse_input(value, "input", ids=False)
    params = PoolingParams(pooling, dimensions=_dimensions(body))
    _check_width(params, width)
    return inputs, params, flag(body, "truncate", True)


def ollama_embeddings_request(body: dict, pooling: str) -> tuple[Inputs, PoolingParams]:
    """(inputs, pooling) of an /api/embeddings body: one prompt, its vector not normalized; none: a load request."""
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise type_error("prompt", "a string", prompt)
    return [prompt] if prompt else [], PoolingParams(pooling, normalize=False)


def ollama_embed_response(model: str, vectors: list[list[float]], prompt_tokens: int, seconds: float) -> dict:
    return {"model": model, "embeddings": vectors, "total_duration": int(max(seconds, 0.0) * 1e9), "load_duration": 0,
            "prompt_eval_count": prompt_tokens}
