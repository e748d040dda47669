"""From a model reference (GGUF file, HF folder, hub id) to a ready model, tokenizer and template."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nanochat.models.config import ModelConfig
from nanochat.models.errors import ModelLoadError, missing_path

if TYPE_CHECKING:
    import torch

    from nanochat.models.formats.weights import WeightSource


@dataclass
class LoadedModel:
    source: WeightSource
    config: ModelConfig
    tokenizer: object          # models.tokenizer.Tokenizer
    chat_template: object      # models.chat_template.ChatTemplate
    eos_token_ids: frozenset[int]


def open_source(model: str):
    """A WeightSource for a .gguf path, a local HF folder, or a hub id."""
    path = Path(os.path.expanduser(model))
    if path.suffix.lower() == ".gguf" or path.is_file():
        from nanochat.models.formats.gguf_source import GGUFSource
        if not path.exists():
            raise missing_path(path)
        return GGUFSource(str(path))
    from nanochat.models.formats.hf_source import HFSource, resolve_hub_id
    if path.exists():
        return HFSource(path)
    if path.is_symlink():   # a loop or a dangling link, not a hub id
        raise missing_path(path)
    from nanochat.models.formats.hub_gguf import fetch, parse_ref
    ref = parse_ref(model)
    if ref is not None:   # REPO:QUANT, or a repo named ...-GGUF: one GGUF file of it
        from nanochat.models.formats.gguf_source import GGUFSource
        return GGUFSource(str(fetch(ref)))
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return HFSource(resolve_hub_id(model))
    raise missing_path(model, "no such file or folder")


def load_tokenizer_and_template(source, cache: bool = False, template_file: str | None = None):
    """The source's tokenizer, chat template and end-of-reply ids. cache: keep what is slow to build (a GGUF's
    SentencePiece merges) on disk for the next load. template_file: a Jinja chat template to use instead of
    the model's (`--chat-template`)."""
    from nanochat.models.text.chat_template import HARMONY_REPLY_ENDS, HARMONY_TURN_END, ChatTemplate, \
        end_of_turn_token

    tokenizer = source.tokenizer(cache)
    _check_vocabulary(source, tokenizer)
    text, origin = source.chat_template(), source.chat_template_origin()
    if template_file is not None:
        text, origin = read_template(template_file), template_file
    with warnings.catch_warnings():
        if source.config.encoder:   # it never chats: no warning that it has no chat template
            warnings.simplefilter("ignore")
        template = ChatTemplate(text, bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "",
                                origin=origin)
    eos = set(source.eos_ids())
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    eot = end_of_turn_token(template, tokenizer)
    if eot is not None and tokenizer.token_to_id(eot) is not None:
        eos.add(tokenizer.token_to_id(eot))
    if template.harmony:
        # A harmony reply ends at <|return|> (an answer) or <|call|> (a tool call) whatever the file lists; its
        # <|end|> closes the analysis inside a reply, so a file naming it end-of-turn must not stop there
        # (llama.cpp drops it from its end-of-generation set likewise).
        eos |= {i for i in map(tokenizer.token_to_id, HARMONY_REPLY_ENDS) if i is not None}
        eos.discard(tokenizer.token_to_id(HARMONY_TURN_END))
    return tokenizer, template, frozenset(eos)


def read_template(path: str) -> str:
    """A chat template file's text (ModelLoadError, in one line, when it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read the chat template ({e.strerror if isinstance(e, OSError) else e})"
                             ) from None


def _check_vocabulary(source, tokenizer) -> None:
    """Every id the tokenizer can produce must have a row in the embedding (else the lookup reads past it)."""
    size, rows = getattr(tokenizer, "vocab_size", None), source.config.vocab_size
    if isinstance(size, int) and size > rows:
        raise ModelLoadError(f"{source.path}: the tokenizer has {size:,} tokens but the model's embedding has "
                             f"{rows:,} rows; the tokenizer does not belong to these weights")


def load(model: str, cache: bool = False, template_file: str | None = None) -> LoadedModel:
    """The model's source, tokenizer and template (`cache`, `template_file`: see load_tokenizer_and_template)."""
    source = open_source(model)
    tokenizer, template, eos = load_tokenizer_and_template(source, cache, template_file)
    return LoadedModel(source, source.config, tokenizer, template, eos)


def build_model(source, device: torch.device, dtype: torch.dtype, block_size: int, max_positions: int,
                dequantize: bool = False, moe_offload: str = "auto", quantize: str | None = None,
                progress=None, pack_cache: bool = False, tp=None, kernels=None):
    """The model on `device`; `progress(done, total)` is called as its tensors are loaded. pack_cache: keep
    the CPU kernels' packed weights on disk (models/formats/pack_cache.py), so the next load maps them.
    tp: this rank's models.parallel.TensorParallel (its shard of the model), None for the whole model.
    kernels: the engine's kernels.options.KernelOptions (None: the defaults)."""
    from nanochat.kernels.options import DEFAULT
    from nanochat.models.layers.common import WeightLoader
    from nanochat.models.parallel.sharding import SINGLE

    cfg = source.config
    cache = None
    if pack_cache and device.type == "cpu" and not dequantize and (source.kind == "gguf" or not quantize):
        from nanochat.kernels.notices import announce
        from nanochat.models.formats.pack_cache import REPACKING, PackCache, usable
        if usable(kernels or DEFAULT):
            cache = PackCache(source.path, part=f"-tp{tp.rank}of{tp.size}" if tp is not None and tp.on else "")
            if cache.missing:
                announce(REPACKING)
    loader = WeightLoader(source, device, dtype, dequantize, moe_offload, quantize, progress, cache, tp or SINGLE,
                          kernels or DEFAULT)
    model = source.family.model(cfg, loader, block_size, max_positions).eval()
    if cache is not None:
        cache.save()
        fused = getattr(model, "fused", None)
        if fused is not None and tp is None:   # what the lean one-shot replays (models/layers/fused_forward.py)
            fused.keep_lean_plan(cache, source, max_positions)
    return model

