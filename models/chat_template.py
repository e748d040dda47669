"""Chat templates rendered the way transformers' `apply_chat_template` renders them.

A model's template (from tokenizer_config.json or GGUF `tokenizer.chat_template`) is Jinja run in a
sandbox with the globals and filters transformers provides, so the same template gives the same
prompt text here as in transformers, without importing transformers at runtime.
"""

from __future__ import annotations

import json
import warnings
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template: the most common format among small chat models.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# End-of-turn markers by template family, most specific first.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


class ChatTemplateError(ValueError):
    """A template failed to compile or render (including its own raise_exception calls)."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters (<, >, &) and sorts keys; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args, **kwargs):  # same signature trick as jinja's Namespace: `self` may be a kwarg
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template may not set underscore attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used by training templates) and renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile (line {exc.lineno}): {exc.message}") from exc


class ChatTemplate:
    """A model's chat template. `source=None` means the model has none: ChatML is used, with a warning."""

    def __init__(self, source: str | None, bos_token: str | None = "", eos_token: str | None = ""):
        self.is_fallback = not source
        if self.is_fallback:
            warnings.warn("model has no chat template; using ChatML (<|im_start|>role ... <|im_end|>)",
                          stacklevel=2)
            source = CHATML_TEMPLATE
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._template = _compile(source)

    @classmethod
    def for_tokenizer(cls, tokenizer, source: str | None = None) -> "ChatTemplate":
        """The template given (or the one the tokenizer carries) with the tokenizer's BOS/EOS text."""
        source = source if source is not None else getattr(tokenizer, "chat_template", None)
        return cls(source, bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **extra) -> str:
        """The prompt text. `extra` reaches the template as variables (e.g. enable_thinking=False)."""
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            # transformers passes these as None when absent; `tools is defined` must read the same.
            "tools": None,
            "documents": None,
            **extra,
        }
        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def end_of_turn_token(self, tokenizer=None) -> str | None:
        return end_of_turn_token(self, tokenizer)


def end_of_turn_token(template, tokenizer=None) -> str | None:
    """The token that closes an assistant turn under this template, for the engine's stop set.

    `template` is a ChatTemplate or template source. The token must appear in the template and,
    when a tokenizer is given, be a single token of its vocabulary.
    """
    source = template.source if isinstance(template, ChatTemplate) else (template or "")
    for tok in END_OF_TURN_TOKENS:
        if tok in source and (tokenizer is None or tokenizer.token_to_id(tok) is not None):
            return tok
    return None
