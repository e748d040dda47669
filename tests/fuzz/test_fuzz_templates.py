"""Hostile chat templates: each is refused with a one-line ChatTemplateError naming the model file,
quickly and without taking the machine's memory, when rendered from a worker thread (where a signal-
based time limit could not work). A seeded generator adds random combinations of the same tricks;
those may also render (a small loop is fine), but only within the limits.
"""

from __future__ import annotations

import random
import resource
import time

import pytest

from timed import call_with_timeout
from nanochat.models.text.chat_template import ChatTemplate, ChatTemplateError, RenderLimits

ORIGIN = "/models/hostile.gguf"
# The default time limit is a few seconds; the fuzz run uses a shorter one to stay quick (the default
# limits are what tests/test_chat_template.py checks, and the slow run uses them here too).
FAST = RenderLimits(max_seconds=1.0)
SLACK = 2.0   # seconds a refusal may take beyond the time limit
BIG = "'x' * 7000000"

HOSTILE = {
    # huge outputs
    "repeat 300 MB": "{{ 'ab' * 150000000 }}",
    "repeat 10 GB": "{{ 'x' * 10**10 }}",
    "repeat list": "{{ [1] * 10**9 }}",
    "repeat then join": "{{ (['x' * 1000] * 100000)|join }}",
    "join a huge range": "{{ range(100000)|join(',' * 1000) }}",
    "join the same big string": "{% set s = " + BIG + " %}{{ [s, s, s, s]|join }}",
    "str.join": "{% set s = " + BIG + " %}{{ s.join([s, s, s]) }}",
    "replace with itself": "{% set s = " + BIG + " %}{{ s.replace('x', s) }}",
    "center": "{{ 'x'|center(10000000000) }}",
    "ljust": "{{ 'x'.ljust(10000000000) }}",
    "zfill": "{{ '1'.zfill(10**12) }}",
    "format width": "{{ '{:>10000000000}'.format(1) }}",
    "format repeated field": "{% set s = " + BIG + " %}{{ '{0}{0}{0}{0}{0}'.format(s) }}",
    "percent width": "{{ '%10000000000d' % 1 }}",
    "percent precision": "{{ '%.100000000d' % 1 }}",
    "percent star": "{{ '%*s' % (10**10, 'x') }}",
    "format filter": "{{ '%*s'|format(10000000000, 'x') }}",
    "indent": "{% set s = '\\n' * 7000000 %}{{ s|indent(1000) }}",
    "wordwrap": "{% set s = 'a ' * 3000000 %}{{ s|wordwrap(1, wrapstring='x' * 1000) }}",
    "expandtabs": "{% set s = '\\t' * 7000000 %}{{ s.expandtabs(100) }}",
    "translate": "{% set s = 'x' * 1000000 %}{{ s.translate({120: 'y' * 1000}) }}",
    "tojson indent": "{{ range(100)|list|tojson(indent=100000000) }}",
    "tojson of shared refs": "{% set s = " + BIG + " %}{{ [s, s, s, s, s, s, s, s]|tojson }}",
    "print shared refs": "{% set s = " + BIG + " %}{{ [s, s, s, s, s, s, s, s] }}",
    "string of shared refs": "{% set s = " + BIG + " %}{{ [s, s, s, s, s, s, s, s]|string }}",
    "dict of shared refs": "{% set s = " + BIG + " %}{{ {}.fromkeys(range(100), s) }}",
    "batch fill": "{% for b in [1]|batch(7000000, " + BIG + ") %}{{ b }}{% endfor %}",
    "concat doubling": "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}",
    "plus doubling": "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "list doubling": "{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "set block": "{% set b %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}",
    "macro output": "{% macro m() %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endmacro %}"
                    "{% for i in range(10) %}{% set x = m() %}{% endfor %}",
    "filter block": "{% filter upper %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endfilter %}",
    "lipsum": "{{ lipsum(100000000) }}",
    "big integer": "{{ 10**100000 }}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(100) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "prompt too long": "{% for i in range(90) %}{{ 'z' * 100000 }}{% endfor %}",
    # loop work
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
    "nested ranges, silent": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "triple ranges": "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}"
                     "{% endfor %}{% endfor %}{% endfor %}",
    "loop over a long string": "{% for c in 'x' * 5000000 %}{% for d in 'y' * 5000000 %}{% endfor %}{% endfor %}",
    "loop filter": "{% for i in range(100000) if i is odd %}{% for j in range(100000) if j is odd %}"
                   "{% endfor %}{% endfor %}",
    "map over a huge list": "{% set s = 'x' * 7000000 %}{{ s|list|map('upper')|join }}",
    "sort in a loop": "{% set s = range(100000)|list %}{% for i in range(100000) %}{{ s|sort|first }}{% endfor %}",
    "sum of lists": "{{ ([[1]] * 100000)|sum(start=[])|length }}",
    "cycler": "{% set c = cycler(*range(100000)) %}{% for i in range(100000) %}{% for j in range(100000) %}"
              "{{ c.next() }}{% endfor %}{% endfor %}",
    "namespace counter": "{% set ns = namespace(n=0) %}{% for i in range(100000) %}{% for j in range(100000) %}"
                         "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}",
    "loop.cycle": "{% for i in range(100000) %}{% for j in range(100000) %}{{ loop.cycle('a', 'b') }}"
                  "{% endfor %}{% endfor %}",
    # recursion
    "macro recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "macro fan-out": "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "caller recursion": "{% macro f() %}{{ caller() }}{% endmacro %}{% macro g() %}{% call f() %}{{ g() }}"
                        "{% endcall %}{% endmacro %}{{ g() }}",
    "recursive loop": "{% for x in [[1]] recursive %}{{ loop([x, x]) }}{% endfor %}",
    "deep list": "{% set ns = namespace(x=1) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}"
                 "{{ ns.x }}",
    "nested parentheses": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
    "huge source": "{{ 'a' }}" * 200000,
    # sandbox escapes
    "class attribute": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals via a macro": "{% macro m() %}{% endmacro %}{{ m.__globals__ }}",
    "attr filter": "{{ (''|attr('__class__')).__mro__ }}",
    "getattr by item": "{{ ''['__class__'] }}",
    "format field escape": "{{ '{0.__class__.__mro__}'.format('') }}",
    "namespace underscore": "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "namespace init underscore": "{% set ns = namespace(_secret=1) %}",
    "list append": "{% set l = [] %}{{ l.append(1) }}",
    "dict update": "{% set d = {} %}{{ d.update(a=1) }}",
    "self": "{{ self.__dict__ }}",
    "include": "{% include '/etc/passwd' %}",
    "import": "{% import 'os' as os %}",
    "cycler internals": "{{ cycler(1).__init__.__globals__ }}",
    "joiner internals": "{{ joiner().__class__.__init__.__globals__ }}",
    "loop internals": "{% for i in [1] %}{{ loop._iterator }}{% endfor %}",
    "raise": "{{ raise_exception('no\\nthank you') }}",
    # plain errors
    "zero division": "{{ 1 // 0 }}",
    "float overflow": "{{ 2.0 ** 100000 }}",
    "undefined call": "{{ foo() }}",
    "syntax": "{% for %}",
}

# Odd but harmless: these may render (within the limits) or be refused.
ODD = {
    "int of a huge string": "{{ ('9' * 100000)|int + 1 }}",
    "undefined attribute": "{{ messages[0].nothing.deeper }}",
    "small loops": "{% for i in range(100) %}{% for j in range(100) %}{{ i * j }}{% endfor %}{% endfor %}",
    "a big but allowed string": "{{ 'x' * 1000000 }}",
}

# Fragments the generator combines (a loop header, an emitted body, a value to build).
LOOPS = ["range({n})", "'x' * {n}", "range({n})|list", "(range({n})|list) * 3", "messages * {n}"]
BODIES = ["{{{{ {v} }}}}", "{{% set ns.s = ns.s ~ {v} %}}", "{{% set ns.l = ns.l + [{v}] %}}",
          "{{{{ ({v})|length }}}}", "{{{{ m({v}) }}}}", "{{{{ ({v})|tojson }}}}", "{{{{ [{v}, {v}]|join }}}}"]
VALUES = ["'y' * {n}", "i", "ns.s", "ns.l", "range({n})|join", "('z' * {n}).upper()", "10 ** {n}", "'%s' % ns.l",
          "ns.s.replace('x', ns.s)", "ns.s ~ ns.s"]


def generated(seed: int) -> str:
    rng = random.Random(seed)

    def n():
        return rng.choice([10, 1000, 100000, 10**7, 10**10])

    depth = rng.randint(1, 3)
    body = rng.choice(BODIES).format(v=rng.choice(VALUES).format(n=n()))
    for level in range(depth):
        body = f"{{% for i in {rng.choice(LOOPS).format(n=n())} %}}{body}{{% endfor %}}"
    return ("{% set ns = namespace(s='x', l=[]) %}{% macro m(v) %}{{ v }}{{ v }}{% endmacro %}" + body)


def render_in_thread(template: str, limits: RenderLimits, seconds: float) -> tuple[str, str]:
    """("refused" | "rendered" | "traceback" | "hang", detail), rendered from a non-main thread."""
    def render():
        return len(ChatTemplate(template, origin=ORIGIN, limits=limits).render([{"role": "user", "content": "hi"}]))

    kind, value = call_with_timeout(render, seconds)
    if kind == "hang":
        return "hang", f"still rendering after {seconds:g} s"
    if kind == "done":
        return ("rendered", str(value)) if value <= limits.max_prompt_chars else ("traceback", f"{value} chars")
    msg = str(value)
    if isinstance(value, ChatTemplateError) and "\n" not in msg and msg.startswith(ORIGIN):
        return "refused", msg
    return "traceback", f"{type(value).__name__}: {msg[:300]}"


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run(cases: dict[str, str], limits: RenderLimits, must_refuse: bool) -> None:
    counts = {"refused": 0, "rendered": 0, "traceback": 0, "hang": 0}
    problems, slowest = [], (0.0, "")
    rss_before = _max_rss_mb()
    for name, template in cases.items():
        start = time.perf_counter()
        outcome, detail = render_in_thread(template, limits, limits.max_seconds + SLACK + 5)
        took = time.perf_counter() - start
        slowest = max(slowest, (took, name))
        counts[outcome] += 1
        if outcome in ("traceback", "hang") or (must_refuse and outcome == "rendered"):
            problems.append(f"{name}: {outcome}: {detail}")
        elif took > limits.max_seconds + SLACK:
            problems.append(f"{name}: took {took:.1f} s")
    grown = _max_rss_mb() - rss_before
    print(f"\ntemplates: {len(cases)} cases, {counts['refused']} refused cleanly, {counts['rendered']} rendered within "
          f"limits, {counts['traceback']} tracebacks, {counts['hang']} hangs; slowest {slowest[1]!r} "
          f"{slowest[0]:.2f} s; peak memory grew {grown:.0f} MB")
    assert not problems, "\n".join(problems)
    assert grown < 1024, f"peak memory grew {grown:.0f} MB"


def test_hostile_templates_are_refused():
    _run(HOSTILE, FAST, must_refuse=True)


def test_generated_templates_stay_within_limits():
    cases = {f"generated {seed}": generated(seed) for seed in range(40)}
    _run({**ODD, **cases}, FAST, must_refuse=False)


@pytest.mark.slow
def test_hostile_templates_under_the_default_limits():
    _run(HOSTILE, RenderLimits(), must_refuse=True)


@pytest.mark.slow
def test_many_generated_templates():
    _run({f"generated {seed}": generated(seed) for seed in range(1000, 1400)}, RenderLimits(), must_refuse=False)
