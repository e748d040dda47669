"""A Hugging Face folder's text side: tokenizer.json with tokenizer_config.json, the chat template, and what
generation_config.json states. Without torch: the lean one-shot (engine/lean.py) reads a folder through it too;
HFSource (models/formats/hf_source.py) adds the weights."""

from __future__ import annotations

import json
from pathlib import Path

from nanochat.models.errors import ModelLoadError


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e.__class__.__name__}: {e})") from None


class FolderText:
    """The tokenizer side of the folder at `self.root`."""

    root: Path

    def tokenizer(self, cache: bool = False):
        """The folder's tokenizer.json with its tokenizer_config.json (`cache`: nothing to cache, it is built)."""
        from nanochat.models.text.tokenizer import Tokenizer

        tok_path = self.tokenizer_path()
        if tok_path is None:
            raise ModelLoadError(f"{self.root}: no tokenizer.json")
        return Tokenizer.from_file(str(tok_path), self.tokenizer_config())

    def stated_sampling(self) -> dict:
        """The sampling settings generation_config.json states (SamplingParams names, values unchecked)."""
        config = self.generation_config()
        stated = {name: config[name] for name in ("temperature", "top_p", "top_k", "repetition_penalty")
                  if name in config}
        if config.get("do_sample") is False:
            # Greedy: transformers then ignores the sampling filters; the repetition penalty still applies.
            stated = {"temperature": 0.0, **{k: v for k, v in stated.items() if k == "repetition_penalty"}}
        return stated

    def stated_pooling(self) -> str | None:
        """A sentence-transformers folder's pooling (modules.json names the Pooling module's folder; its
        config.json sets one pooling_mode_* flag), as llama.cpp's converter reads it."""
        modules = self.root / "modules.json"
        if not modules.is_file():
            return None
        listed = read_json(modules)
        folder = next((m.get("path") for m in listed if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")),
                      None) if isinstance(listed, list) else None
        config = self.root / str(folder) / "config.json" if folder is not None else None
        if config is None or not config.is_file():
            return None
        pooling = read_json(config)
        for flag, mode in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                           ("pooling_mode_lasttoken", "last")):
            if pooling.get(flag):
                return mode
        return {"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(pooling.get("pooling_mode"))

    def tokenizer_path(self) -> Path | None:
        p = self.root / "tokenizer.json"
        return p if p.is_file() else None

    def tokenizer_json(self) -> str | None:
        p = self.tokenizer_path()
        return p.read_text() if p else None

    def tokenizer_config(self) -> dict:
        p = self.root / "tokenizer_config.json"
        return read_json(p) if p.is_file() else {}

    def chat_template_origin(self) -> str:
        jinja = self.root / "chat_template.jinja"
        return str(jinja if jinja.is_file() else self.root / "tokenizer_config.json")

    def chat_template(self) -> str | None:
        jinja = self.root / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        template = self.tokenizer_config().get("chat_template")
        if isinstance(template, list):   # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template

    def generation_config(self) -> dict:
        """generation_config.json, or {} when absent or unreadable: the file is advice (config.json and
        the tokenizer still say how to stop), so a bad one never stops a load."""
        p = self.root / "generation_config.json"
        try:
            config = read_json(p) if p.is_file() else {}
        except (ModelLoadError, RecursionError):
            return {}
        return config if isinstance(config, dict) else {}

    def generation_eos_ids(self) -> tuple[int, ...]:
        """Extra end ids from generation_config.json."""
        eos = self.generation_config().get("eos_token_id")
        if isinstance(eos, list):
            return tuple(e for e in eos if isinstance(e, int) and not isinstance(e, bool))
        return (eos,) if isinstance(eos, int) and not isinstance(eos, bool) else ()
