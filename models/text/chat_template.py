"""Chat templates rendered the way transformers' `apply_chat_template` renders them.

A model's template (from tokenizer_config.json or GGUF `tokenizer.chat_template`) is Jinja run in a
sandbox with the globals and filters transformers provides, so the same template gives the same
prompt text here as in transformers, without importing transformers at runtime.

A template is input from whoever made the model file, so it runs under limits no file can exceed
(RenderLimits): its source length, the size of every value it builds (checked *before* a string or
list is multiplied, joined, padded, formatted or concatenated, so `'ab' * 150000000` allocates
nothing), the total text it emits, the prompt it renders (checked before anyone tokenizes it), the
work it does (loop iterations, calls, filters and operators all count) and the time it takes (a
deadline checked at each of those steps, so it works in any thread). Any failure is a one-line
ChatTemplateError naming the model file; a limit is a ChatTemplateLimitError naming the limit.
"""

from __future__ import annotations

import contextvars
import json
import re
import time
import types
import warnings
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes as nodes
import jinja2.visitor
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2 import pass_context, pass_environment

from nanochat.models.errors import one_line

# Used when a model ships no template: the most common format among small chat models.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The thinking block of reasoning models (Qwen3, SmolLM3, DeepSeek-R1, Phi-4 reasoning).
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PROBE = "\u2063nanochat-probe\u2063"   # a user message no template changes

# End-of-turn markers by template family, most specific first.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")

# gpt-oss's harmony format (models/text/harmony.py): a reply ends with <|return|> (its final answer) or
# <|call|> (a tool call); <|end|> ends each message inside it (its analysis) and every turn in the history.
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|return|>")
HARMONY_REPLY_ENDS = ("<|return|>", "<|call|>")
HARMONY_TURN_END = "<|end|>"
# The values of `reasoning_effort` probed (the harmony template writes "Reasoning: <value>").
REASONING_EFFORTS = ("low", "medium", "high")


class ChatTemplateError(ValueError):
    """A template failed to compile or render (including its own raise_exception calls)."""


class ChatTemplateLimitError(ChatTemplateError):
    """A template exceeded one of its RenderLimits (`limit` names which)."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class RenderLimits:
    """What one render of a chat template may use. The defaults leave real templates far inside them:
    a 1M-token context of ~8 characters a token is an 8 MiB prompt, rendered in milliseconds."""

    max_prompt_chars: int = 8 * 2**20     # the rendered prompt, checked before it is tokenized
    max_value_chars: int = 16 * 2**20     # any one string / list the template builds (text size)
    max_emitted_chars: int = 32 * 2**20   # all text emitted, macros and {% set %} blocks included
    max_steps: int = 2_000_000            # loop iterations + calls + filters + operators
    max_seconds: float = 3.0              # wall time of one render (checked at every step)
    max_source_chars: int = 2**18         # the template's own source (real ones are under 50 KB)
    max_int_bits: int = 4096              # integers built with * and **
    max_json_indent: int = 64             # tojson(indent=...)


DEFAULT_LIMITS = RenderLimits()

_FIX = "the model's chat template is broken or hostile: use --no-chat-template, or another model file"


def _one_line(text, limit: int = 300) -> str:
    """one_line of the text alone (the callers name the exception's class where it helps), cut at `limit`:
    a template's error can quote a long stretch of the template."""
    text = one_line(str(text))
    return text if len(text) <= limit else text[:limit] + "..."


class _Exceeded(Exception):
    """Raised inside a render when a limit is hit (not a ValueError, so no filter swallows it)."""

    def __init__(self, limit: str, detail: str):
        super().__init__(f"{limit}: {detail}")
        self.limit, self.detail = limit, detail


# ---------------------------------------------------------------------------------- the render budget

_BUDGET: contextvars.ContextVar["_Budget | None"] = contextvars.ContextVar("chat_template_budget", default=None)
_SEQUENCES = (str, bytes, list, tuple)


class _Budget:
    """The limits of one render: steps, deadline, emitted text, and value sizes (memoized per render)."""

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self.steps = 0
        self.emitted = 0
        self.deadline = time.monotonic() + limits.max_seconds
        self._sizes: dict[int, tuple[object, int]] = {}   # id -> (the object, kept alive; its size)

    def tick(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise _Exceeded("work limit", f"more than {self.limits.max_steps:,} steps "
                                          "(loop iterations, calls, filters and operators)")
        if time.monotonic() > self.deadline:
            raise _Exceeded("time limit", f"rendering took more than {self.limits.max_seconds:g} s")

    def ensure(self, size: int, what: str) -> None:
        """Refuse an operation whose result would be larger than any one value may be."""
        if size > self.limits.max_value_chars:
            raise _Exceeded("size limit", f"{what} would make {size:,} characters "
                                          f"(at most {self.limits.max_value_chars:,})")

    def checked(self, value, what: str):
        self.ensure(self.size(value), what)
        return value

    def emit(self, value):
        size = self.size(value)
        self.ensure(size, "output")
        self.emitted += size
        if self.emitted > self.limits.max_emitted_chars:
            raise _Exceeded("output limit", f"the template emitted more than {self.limits.max_emitted_chars:,} "
                                            "characters")
        return value

    def length(self, value) -> int:
        """A string's exact length, any other value's text size."""
        return len(value) if isinstance(value, (str, bytes)) else self.size(value)

    def size(self, value) -> int:
        """About how many characters `value` becomes as text (an upper bound for strings and containers);
        the walk stops as soon as it passes the value limit, so it costs at most that many steps."""
        if isinstance(value, (str, bytes)):
            return len(value) + 2
        if not isinstance(value, (list, tuple, dict, jinja2.utils.Namespace)):
            return _scalar_size(value)
        memo = self._sizes.get(id(value))
        if memo is not None and memo[0] is value:
            return memo[1]
        cap = self.limits.max_value_chars
        total, stack, volatile, walked = 0, [value], False, 0
        while stack and total <= cap:
            item = stack.pop()
            walked += 1
            if walked % 65536 == 0:
                self.tick()
            if isinstance(item, (str, bytes)):
                total += len(item) + 4
            elif isinstance(item, (list, tuple)):
                known = self._sizes.get(id(item))
                if known is not None and known[0] is item and item is not value:
                    total += known[1]
                else:
                    total += 2
                    stack.extend(item)
            elif isinstance(item, dict):
                total += 2
                for k, v in item.items():
                    stack.append(k)
                    stack.append(v)
            elif isinstance(item, jinja2.utils.Namespace):   # mutable: never memoized
                volatile = True
                total += 12
                stack.extend(_Namespace.values(item))
            else:
                total += _scalar_size(item) + 2
        if not volatile and total <= cap:
            self._sizes[id(value)] = (value, total)
        return total


def _scalar_size(value) -> int:
    if isinstance(value, int):
        return value.bit_length() // 3 + 2
    return 24


def _budget() -> _Budget:
    budget = _BUDGET.get()
    return budget if budget is not None else _Budget(DEFAULT_LIMITS)   # outside render(): sizes still hold


class _Counted:
    """An iterable whose iteration costs one step an item (keeps len() for loop.length)."""

    __slots__ = ("items", "budget")

    def __init__(self, items, budget: _Budget):
        self.items, self.budget = items, budget

    def __iter__(self):
        tick = self.budget.tick
        for item in self.items:
            tick()
            yield item

    def __len__(self) -> int:
        return len(self.items)


# ---------------------------------------------------------------------------------- size estimates

def _int(value, default: int = 0) -> int:
    return value if isinstance(value, int) else default


def _widths(spec_numbers: list[str]) -> int:
    """The largest width / precision written in a format string (digit runs of over 12 are 'infinite')."""
    return max((int(d) if len(d) <= 12 else 10**13 for d in spec_numbers), default=0)


def _format_args_size(budget: _Budget, args) -> tuple[int, int]:
    """(largest argument as text, largest int argument: a width given with * or {})."""
    sizes = [budget.size(a) for a in args] or [0]
    ints = [abs(a) for a in args if isinstance(a, int)] or [0]
    return max(sizes), max(ints)


def _percent_size(budget: _Budget, fmt, args) -> int:
    """An upper bound on len(fmt % args)."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    arg_max, int_max = _format_args_size(budget, values)
    specs = re.findall(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?", text)
    numbers = [n for spec in specs for n in spec if n and n != "*"]
    width = max(_widths(numbers), int_max if "*" in text else 0)
    return len(text) + len(specs) * (arg_max + width)


def _brace_size(budget: _Budget, fmt: str, args, kwargs) -> int:
    """An upper bound on len(fmt.format(*args, **kwargs))."""
    arg_max, int_max = _format_args_size(budget, [*args, *kwargs.values()])
    fields = fmt.count("{")
    numbers = [n for spec in re.findall(r"\{([^{}]*)\}", fmt) for n in re.findall(r"\d+", spec)]
    width = max(_widths(numbers), int_max)
    return len(fmt) + fields * (arg_max + width)


def _replace_size(s, old, new, count=-1) -> int:
    n = s.count(old) if len(old) else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * len(new)


def _tab(s):
    return b"\t" if isinstance(s, bytes) else "\t"


# str / bytes methods whose result can be much larger than their inputs: (budget, self, args, kwargs) -> size
_METHOD_SIZES = {
    "replace": lambda b, s, a, k: _replace_size(s, *a, **k),
    "center": lambda b, s, a, k: max(len(s), _int(a[0] if a else k.get("width"))),
    "ljust": lambda b, s, a, k: max(len(s), _int(a[0] if a else k.get("width"))),
    "rjust": lambda b, s, a, k: max(len(s), _int(a[0] if a else k.get("width"))),
    "zfill": lambda b, s, a, k: max(len(s), _int(a[0] if a else k.get("width"))),
    "expandtabs": lambda b, s, a, k: len(s) + s.count(_tab(s)) * max(_int(a[0] if a else k.get("tabsize", 8), 8), 0),
    "translate": lambda b, s, a, k: len(s) * max([1] + [b.size(v) for v in a[0].values()]
                                                 if a and isinstance(a[0], dict) else [1]),
    "join": lambda b, s, a, k: sum(b.size(x) for x in a[0]) + len(s) * max(len(a[0]) - 1, 0),
    "format": lambda b, s, a, k: _brace_size(b, s, a, k),
    "format_map": lambda b, s, a, k: _brace_size(b, s, (), a[0] if a and isinstance(a[0], dict) else {}),
}


def _estimate(estimate) -> int:
    """estimate() or 0 when the arguments are malformed (the real call then raises its own error)."""
    try:
        return estimate()
    except (TypeError, ValueError, AttributeError, IndexError, KeyError):
        return 0


# ---------------------------------------------------------------------------------- filters

def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters (<, >, &) and sorts keys; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _tojson_size(budget: _Budget, value, *args, **kwargs) -> int:
    indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
    if isinstance(indent, str):
        indent = len(indent)
    if _int(indent) > budget.limits.max_json_indent:
        raise _Exceeded("size limit", f"tojson indent {indent} (at most {budget.limits.max_json_indent})")
    separators = kwargs.get("separators", args[2] if len(args) > 2 else None) or ()
    per_item = 6 + _int(indent) * 8 + sum(budget.size(x) for x in separators)
    return budget.size(value) * per_item


def _indent_size(budget: _Budget, s, width=4, *args, **kwargs) -> int:
    width = kwargs.get("width", width)
    per_line = len(width) if isinstance(width, str) else _int(width)
    text_size = budget.size(s)
    return text_size + (str(s).count("\n") + 1 if isinstance(s, str) else text_size) * per_line


def _wordwrap_size(budget: _Budget, s, width=79, break_long_words=True, wrapstring=None, *args, **kwargs) -> int:
    """The text plus one wrapstring per line break (at most one per `width` characters or per space)."""
    width, wrapstring = _int(kwargs.get("width", width), 79), kwargs.get("wrapstring", wrapstring)
    text = str(s) if isinstance(s, str) else ""
    size = budget.size(s)
    breaks = min(size, size // max(width, 1) + text.count(" ") + text.count("\n") + 1)
    return size + breaks * (budget.size(wrapstring) if wrapstring is not None else 1)


def _join_size(budget: _Budget, items, d="", attribute=None) -> int:
    return sum(budget.size(x) for x in items) + budget.size(d) * max(len(items) - 1, 0)


# filter name -> (budget, value, *args, **kwargs) -> size of the result, for filters that can multiply
_FILTER_SIZES = {
    "center": lambda b, v, width=80: max(b.size(v), _int(width)),
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "replace": lambda b, v, old, new, count=None: _replace_size(str(v), str(old), str(new), _int(count, -1)),
    "join": _join_size,
    "format": lambda b, v, *a, **k: _percent_size(b, str(v), k if k else tuple(a)),
    "tojson": _tojson_size,
}


def _sum(environment, iterable, attribute=None, start=0):
    """The sum filter, one checked `+` per item (a sum of lists or strings is otherwise quadratic in C)."""
    if attribute is not None:
        iterable = map(jinja2.filters.make_attrgetter(environment, attribute), iterable)
    total = start
    for item in iterable:
        total = environment.call_binop(None, "+", total, item)
    return total


def _guarded_filter(name: str, raw: jinja2.Environment):
    """Filter `name` of `raw` (the unguarded filters) with the budget around it: a step, its inputs and
    output within the value limit, and (for filters that can multiply their input) the result's size
    estimated before it is built. It takes the context, so jinja never runs it at compile time, outside
    any budget; `raw.call_filter` gives the filter the context, eval context or environment it asks for."""
    estimate = _FILTER_SIZES.get(name)

    @pass_context
    def guarded(context, value=None, *args, **kwargs):
        budget = _budget()
        budget.tick()
        if name == "join":   # iterate once, counted, so the estimate and the join see the same items
            value = list(_Counted(value, budget))
        for x in (value, *args, *kwargs.values()):
            budget.checked(x, f"the {name} filter's input")
        if estimate is not None:
            budget.ensure(_estimate(lambda: estimate(budget, value, *args, **kwargs)), f"|{name}")
        return budget.checked(raw.call_filter(name, value, args, kwargs, context=context), f"|{name}")

    guarded.__name__ = getattr(raw.filters[name], "__name__", name)
    return guarded


# ---------------------------------------------------------------------------------- the sandbox

class _Hooks(jinja2.ext.Extension):
    """Methods the compiled template calls: every loop's iterable, every `~` and every output chunk go
    through the budget (wired in by _instrument)."""

    identifier = "nanochat.render_budget"

    def loop(self, items):
        return _Counted(items, _budget())

    def concat(self, *parts):
        budget = _budget()
        budget.tick()
        budget.ensure(sum(budget.length(p) for p in parts), "'~'")
        return "".join(map(str, parts))

    def emit(self, value):
        budget = _budget()
        budget.tick()
        return budget.emit(value)

    loop._nanochat_hook = concat._nanochat_hook = emit._nanochat_hook = True


class _Instrument(jinja2.visitor.NodeTransformer):
    def _hook(self, name: str, args: list, lineno: int) -> nodes.Call:
        func = nodes.ExtensionAttribute(_Hooks.identifier, name, lineno=lineno)
        return nodes.Call(func, args, [], None, None, lineno=lineno)

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = self._hook("loop", [node.iter], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return self._hook("concat", list(node.nodes), node.lineno)

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        self.generic_visit(node)
        node.nodes = [self._hook("emit", [child], child.lineno or node.lineno) for child in node.nodes]
        return node


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox with the render budget on operators, calls and str methods."""

    intercepted_binops = frozenset(["+", "*", "%", "**"])

    def call_binop(self, context, operator, left, right):
        budget = _budget()
        budget.tick()
        if operator == "**":
            self._check_power(budget, left, right)
        elif operator == "*":
            self._check_product(budget, left, right)
        elif operator == "+" and isinstance(left, _SEQUENCES):
            budget.ensure(budget.length(left) + budget.length(right), "'+'")
        elif operator == "%" and isinstance(left, (str, bytes)):
            budget.ensure(_percent_size(budget, left, right), "'%'")
        return budget.checked(self.binop_table[operator](left, right), f"'{operator}'")

    @staticmethod
    def _check_power(budget: _Budget, base, exp) -> None:
        if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
            bits = base.bit_length() * exp
            if bits > budget.limits.max_int_bits:
                raise _Exceeded("size limit", f"'**' would make a {bits:,}-bit integer "
                                              f"(at most {budget.limits.max_int_bits:,})")

    @staticmethod
    def _check_product(budget: _Budget, left, right) -> None:
        if isinstance(left, int) and isinstance(right, int):
            bits = left.bit_length() + right.bit_length()
            if bits > budget.limits.max_int_bits:
                raise _Exceeded("size limit", f"'*' would make a {bits:,}-bit integer "
                                              f"(at most {budget.limits.max_int_bits:,})")
            return
        seq, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, _SEQUENCES) and isinstance(count, int):
            budget.ensure(budget.length(seq) * max(count, 0), "'*'")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        if getattr(__obj, "_nanochat_hook", False):
            return __obj(*args)   # kwargs: only jinja's _loop_vars / _block_vars
        budget = _budget()
        budget.tick()
        if isinstance(__obj, LoopContext) and args:   # a recursive loop's next level
            args = (_Counted(args[0], budget), *args[1:])
        return budget.checked(super().call(__context, __obj, *args, **kwargs), "a call")

    def getattr(self, obj, attribute):
        if isinstance(attribute, str) and attribute.startswith("__"):   # never data: always a reach for internals
            raise jinja2.exceptions.SecurityError(f"access to attribute {attribute!r} is not allowed")
        return super().getattr(obj, attribute)

    def unsafe_undefined(self, obj, attribute):
        """An internal attribute (`__class__`, `_iterator`, ...) is an error, not an empty value: a template
        that reaches for one is refused outright."""
        raise jinja2.exceptions.SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} "
                                              "object is not allowed")

    def wrap_str_format(self, value):
        """Every str / bytes method a template reads passes here: the ones that can multiply their input
        get their result's size checked before they run (format also gets the sandbox's formatter)."""
        owner = getattr(value, "__self__", None)
        if not isinstance(owner, (str, bytes)) or not isinstance(value, (types.MethodType, types.BuiltinMethodType)):
            return None
        name = value.__name__
        estimate = _METHOD_SIZES.get(name)
        if estimate is None:
            return None
        method = super().wrap_str_format(value) or value

        def bounded(*args, **kwargs):
            budget = _budget()
            if name == "join" and args:
                args = (list(_Counted(args[0], budget)), *args[1:])
            budget.ensure(_estimate(lambda: estimate(budget, owner, args, kwargs)), f"{type(owner).__name__}.{name}()")
            return method(*args, **kwargs)

        return bounded


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, so templates cannot reach Python internals. It keeps its
    own copy of the values for the budget to size (jinja's Namespace hides its dict under a private name)."""

    def __init__(*args, **kwargs):  # same signature trick as jinja's Namespace: `self` may be a kwarg
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)
        object.__setattr__(self, "_nanochat_values", dict(attrs))

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)
        object.__getattribute__(self, "_nanochat_values")[name] = value

    @staticmethod
    def values(namespace) -> list:
        """A namespace's values (none for a plain jinja Namespace, which templates cannot make here)."""
        try:
            return list(object.__getattribute__(namespace, "_nanochat_values").values())
        except AttributeError:
            return []

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


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTag, jinja2.ext.loopcontrols, _Hooks])
    env.optimized = False   # nothing of the template runs at compile time, outside the budget
    env.filters["tojson"] = _tojson
    env.filters["sum"] = pass_environment(_sum)
    # The unguarded filters live on an overlay: the same sandbox and settings, so a filter that takes the
    # environment (attr, sort, ...) still reads attributes through the sandbox.
    raw = env.overlay()
    raw.filters = dict(env.filters)
    env.filters = {name: _guarded_filter(name, raw) for name in raw.filters}
    env.globals.pop("lipsum", None)   # lipsum(n) writes n paragraphs; no chat template uses it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _environment()
    try:
        tree = env.parse(source)
        return env.from_string(_Instrument().visit(tree))
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile (line {exc.lineno}): "
                                f"{_one_line(exc.message)}") from exc
    except RecursionError:
        raise ChatTemplateError("chat template does not compile: nested too deeply") from None


class ChatTemplate:
    """A model's chat template. `source=None` means the model has none: ChatML is used, with a warning.
    `origin` (the model file) is named in errors; `limits` bound every render."""

    def __init__(self, source: str | None, bos_token: str | None = "", eos_token: str | None = "",
                 origin: str | None = None, limits: RenderLimits = DEFAULT_LIMITS):
        self.is_fallback = not source
        if self.is_fallback:
            warnings.warn("model has no chat template; using ChatML (<|im_start|>role ... <|im_end|>)",
                          stacklevel=2)
            source = CHATML_TEMPLATE
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.origin = str(origin) if origin else None
        self.limits = limits
        if len(source) > limits.max_source_chars:
            raise self._limit_error("source limit", f"the template is {len(source):,} characters "
                                                    f"(at most {limits.max_source_chars:,})")
        try:
            self._template = _compile(source)
        except ChatTemplateError as exc:
            raise ChatTemplateError(f"{self._where}{exc}") from exc.__cause__

    @classmethod
    def for_tokenizer(cls, tokenizer, source: str | None = None) -> "ChatTemplate":
        """The template given (or the one the tokenizer carries) with the tokenizer's BOS/EOS text."""
        source = source if source is not None else getattr(tokenizer, "chat_template", None)
        return cls(source, bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "",
                   origin=getattr(tokenizer, "name", None) or None)

    @property
    def _where(self) -> str:
        return f"{self.origin}: " if self.origin else ""

    def _limit_error(self, limit: str, detail: str) -> ChatTemplateLimitError:
        return ChatTemplateLimitError(f"{self._where}chat template exceeds its {limit}: {detail}; {_FIX}", limit)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **extra) -> str:
        """The prompt text. `extra` reaches the template as variables (e.g. enable_thinking=False).
        Raises ChatTemplateError (one line) when the template fails, ChatTemplateLimitError when it
        exceeds its limits, including a prompt longer than limits.max_prompt_chars."""
        variables = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            # transformers passes these as None when absent; `tools is defined` must read the same.
            "tools": None,
            "documents": None,
            **extra,
        }
        token = _BUDGET.set(_Budget(self.limits))
        try:
            return self._render(messages, add_generation_prompt, variables)
        except _Exceeded as exc:
            raise self._limit_error(exc.limit, exc.detail) from None
        except ChatTemplateError:
            raise
        except RecursionError:
            raise ChatTemplateError(f"{self._where}chat template failed: it recurses too deeply; {_FIX}") from None
        except MemoryError:
            raise ChatTemplateError(f"{self._where}chat template failed: out of memory; {_FIX}") from None
        except jinja2.exceptions.TemplateError as exc:   # incl. SecurityError and the template's raise_exception
            raise ChatTemplateError(f"{self._where}chat template failed: {_one_line(exc)}") from exc
        except Exception as exc:   # an error of the template's own: 1 // 0, 'a' + 1, ...
            raise ChatTemplateError(f"{self._where}chat template failed: {type(exc).__name__}: "
                                    f"{_one_line(exc)}") from exc
        finally:
            _BUDGET.reset(token)

    def _render(self, messages, add_generation_prompt, variables) -> str:
        chunks, length, cap = [], 0, self.limits.max_prompt_chars
        for chunk in self._template.generate(messages=[dict(m) for m in messages],
                                             add_generation_prompt=add_generation_prompt, **variables):
            length += len(chunk)
            if length > cap:
                raise _Exceeded("prompt size limit", f"the rendered prompt passes {cap:,} characters")
            chunks.append(chunk)
        return "".join(chunks)

    def end_of_turn_token(self, tokenizer=None) -> str | None:
        return end_of_turn_token(self, tokenizer)

    def thinking_modes(self) -> tuple[bool, frozenset]:
        """(whether the template reads `enable_thinking`: its prompt differs with it on and off; the
        values of enable_thinking, None for not given, whose generation prompt opens a <think> block
        itself, so that the model writes only the thinking's body and </think>). A value the template
        fails on counts as neither."""
        prompts = {}
        for value in (None, True, False):
            extra = {} if value is None else {"enable_thinking": value}
            try:
                prompt = self.render([{"role": "user", "content": _PROBE}], add_generation_prompt=True, **extra)
            except ChatTemplateError:
                continue
            at = prompt.rfind(_PROBE)
            prompts[value] = prompt[at + len(_PROBE):] if at >= 0 else prompt   # the generation prompt
        switch = True in prompts and False in prompts and prompts[True] != prompts[False]
        return switch, frozenset(v for v, p in prompts.items() if p.rfind(THINK_OPEN) > p.rfind(THINK_CLOSE))


    @property
    def harmony(self) -> bool:
        """Whether replies under this template are in the harmony format (gpt-oss)."""
        return is_harmony(self.source)

    def reasoning_efforts(self) -> tuple[str, ...]:
        """The values of `reasoning_effort` the template reads (each gives its own prompt, and none fails;
        gpt-oss's: low, medium, high); () for a template that ignores it."""
        prompts = {}
        for value in (None, *REASONING_EFFORTS):
            extra = {} if value is None else {"reasoning_effort": value}
            try:
                prompts[value] = self.render([{"role": "user", "content": _PROBE}], add_generation_prompt=True,
                                             strftime_now=_fixed_date, **extra)
            except ChatTemplateError:
                continue
        values = [v for v in REASONING_EFFORTS if v in prompts]
        if len({prompts[v] for v in values}) < 2:
            return ()
        return tuple(v for v in values if sum(p == prompts[v] for k, p in prompts.items() if k is not None) == 1)

    def takes_tools(self) -> bool:
        """Whether the template renders a `tools` list into the prompt (Qwen2.5's and Qwen3's do)."""
        probe = [{"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {}}}]
        try:
            prompt = self.render([{"role": "user", "content": "hi"}], add_generation_prompt=True, tools=probe)
        except ChatTemplateError:
            return False
        return _PROBE in prompt


def _fixed_date(fmt: str) -> str:
    """strftime_now for probes: two renders across midnight must not differ by their date."""
    return datetime(2024, 1, 1).strftime(fmt)


def is_harmony(template) -> bool:
    """Whether a template (a ChatTemplate or its source) writes the harmony format."""
    source = template.source if isinstance(template, ChatTemplate) else (template or "")
    return all(marker in source for marker in HARMONY_MARKERS)


def end_of_turn_token(template, tokenizer=None) -> str | None:
    """The token that closes an assistant reply under this template, for the engine's stop set.

    `template` is a ChatTemplate or template source. The token must appear in the template and,
    when a tokenizer is given, be a single token of its vocabulary. Under harmony it is <|return|>:
    its <|end|> closes the reasoning inside a reply, so stopping there would cut every reply after
    its analysis (<|call|>, the other end of a reply, is in the model's own end-of-reply ids).
    """
    source = template.source if isinstance(template, ChatTemplate) else (template or "")
    tokens = HARMONY_REPLY_ENDS[:1] if is_harmony(source) else END_OF_TURN_TOKENS
    for tok in tokens:
        if tok in source and (tokenizer is None or tokenizer.token_to_id(tok) is not None):
            return tok
    return None


def history_end_token(template, tokenizer=None) -> str | None:
    """The token that closes an assistant turn in the history the template renders: the reply's own end
    (end_of_turn_token), except under harmony, whose history closes a final answer with <|end|> where
    the model wrote <|return|>."""
    if is_harmony(template) and (tokenizer is None or tokenizer.token_to_id(HARMONY_TURN_END) is not None):
        return HARMONY_TURN_END
    return end_of_turn_token(template, tokenizer)
