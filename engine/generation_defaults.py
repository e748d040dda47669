"""The sampling settings a model file recommends: GGUF `general.sampling.*` keys, or a Hugging Face
folder's generation_config.json; and for the models nanochat ships, their model card's (card_defaults),
which the engine puts under the file's own.

It lives in the engine, not in models/, because SamplingParams is the judge of what is valid and
models/ may not import the engine (tests/test_layering.py).
"""

from __future__ import annotations

import gguf
import numpy as np

from nanochat.engine.sampling_params import SamplingParams

_GGUF_KEYS = {   # SamplingParams name -> GGUF key (min_p has no SamplingParams counterpart)
    "temperature": gguf.Keys.General.SAMPLING_TEMP,
    "top_p": gguf.Keys.General.SAMPLING_TOP_P,
    "top_k": gguf.Keys.General.SAMPLING_TOP_K,
    "repetition_penalty": gguf.Keys.General.SAMPLING_PENALTY_REPEAT,
}
_FLOAT32 = (int(gguf.GGUFValueType.FLOAT32),)


def sampling_defaults(source) -> dict:
    """SamplingParams keyword -> value for each setting the model file states and SamplingParams accepts;
    a value of the wrong type or out of range is left out. `source`: a GGUFSource or an HFSource."""
    stated = _hf_stated(source.generation_config()) if hasattr(source, "generation_config") \
        else _gguf_stated(source)
    checked = {name: _checked(name, value) for name, value in stated.items()}
    return {name: value for name, value in checked.items() if value is not None}


def card_defaults(source) -> dict:
    """The model card's recommended sampling of a model nanochat ships (models/formats/catalog.py), checked as a
    file's are; {} for other models."""
    from nanochat.models.formats.catalog import card_sampling

    checked = {name: _checked(name, value) for name, value in card_sampling(source.path).items()}
    return {name: value for name, value in checked.items() if value is not None}


def _gguf_stated(source) -> dict:
    stated = {}
    for name, key in _GGUF_KEYS.items():
        value = source.metadata(key)   # the metadata parsed at load, not a second read of the file
        if isinstance(value, float) and source.reader.types.get(key) == _FLOAT32:
            value = float(str(np.float32(value)))   # 0.6 as written, not float32's 0.6000000238418579
        if value is not None:
            stated[name] = value
    return stated


def _hf_stated(config: dict) -> dict:
    stated = {name: config[name] for name in ("temperature", "top_p", "top_k", "repetition_penalty")
              if name in config}
    if config.get("do_sample") is False:
        # Greedy: transformers then ignores the sampling filters; the repetition penalty still applies.
        stated = {"temperature": 0.0, **{k: v for k, v in stated.items() if k == "repetition_penalty"}}
    return stated


def _checked(name: str, value):
    """The value as SamplingParams takes it, or None when it would refuse it."""
    if isinstance(value, bool):
        return None
    if name == "top_k":
        if not isinstance(value, int) or value <= 0:   # 0 and -1 mean disabled: nothing to recommend
            return None
    elif isinstance(value, (int, float)):
        try:
            value = float(value)
        except OverflowError:   # an integer too large for a float
            return None
    else:
        return None
    try:
        SamplingParams(**{name: value})
    except ValueError:
        return None
    return value
