"""The sampling settings a model file recommends (GGUF `general.sampling.*` keys, or a Hugging Face
folder's generation_config.json, as the weight source reads them), checked; and for the models nanochat
ships, their model card's (card_defaults), which the engine puts under the file's own.

The checking lives in the engine, not in models/, because SamplingParams is the judge of what is valid and
models/ may not import the engine (tests/test_layering.py).
"""

from __future__ import annotations

from nanochat.engine.sampling_params import SamplingParams


def sampling_defaults(source) -> dict:
    """SamplingParams keyword -> value for each setting the model file states (a WeightSource's
    stated_sampling) and SamplingParams accepts; a value of the wrong type or out of range is left out."""
    stated = source.stated_sampling()
    checked = {name: _checked(name, value) for name, value in stated.items()}
    return {name: value for name, value in checked.items() if value is not None}


def card_defaults(source) -> dict:
    """The model card's recommended sampling of a model nanochat ships (models/formats/catalog.py), checked as a
    file's are; {} for other models."""
    from nanochat.models.formats.catalog import card_sampling

    checked = {name: _checked(name, value) for name, value in card_sampling(source.path).items()}
    return {name: value for name, value in checked.items() if value is not None}


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
