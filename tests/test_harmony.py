"""gpt-oss's harmony format: the real template rendered through nanochat's sandbox equals transformers'
rendering of it; replies split into reasoning, answer and tool calls however the stream is chunked and
when they come through a tokenizer with the harmony special tokens; a chat session keeps the history
the template renders (earlier analysis dropped), so its next prompt diverges from the cached KV exactly
after the generation prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanochat.engine.serve.session import ChatSession
from nanochat.models.text.chat_template import (ChatTemplate, end_of_turn_token, history_end_token, is_harmony)
from nanochat.models.text.harmony import TOKENS, HarmonySplitter, call_arguments, split_harmony
from nanochat.models.text.tokenizer import IncrementalDetokenizer, Tokenizer

# gpt-oss's own chat template (as the 20b and 120b ship it; llama.cpp's models/templates keeps the same file).
TEMPLATE_PATH = Path(__file__).parent / "data" / "gpt_oss_chat_template.jinja"


@pytest.fixture(scope="module")
def source():
    return TEMPLATE_PATH.read_text(encoding="utf-8")


def fixed_date(fmt):
    return "2025-08-05"   # both renders read the same date (the template writes today's)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "reasoning_history": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Is 21 prime?"},
        {"role": "assistant", "thinking": "21 = 3 * 7.", "content": "No."},
        {"role": "user", "content": "And 23?"},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": "I should call get_weather.", "tool_calls": [CALL]},
        {"role": "tool", "content": "18C, sunny"},
    ],
    "tool_then_answer": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": "I should call get_weather.", "tool_calls": [CALL]},
        {"role": "tool", "content": "18C, sunny"},
        {"role": "assistant", "thinking": "Report it.", "content": "18C and sunny."},
        {"role": "user", "content": "Thanks! And tomorrow?"},
    ],
}


def _reference(source, messages, **kwargs):
    """transformers' rendering (its plain sandboxed jinja environment), reading the same date."""
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

    _compile_jinja_template(source).globals["strftime_now"] = fixed_date   # kwargs cannot carry a function
    rendered, _ = render_jinja_template([messages], chat_template=source, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("effort", [None, "low", "high"])
def test_harmony_template_renders_as_transformers_does(source, name, effort):
    extra = {"reasoning_effort": effort} if effort else {}
    tools = [WEATHER_TOOL] if name.startswith("tool") else None
    messages = CONVERSATIONS[name]
    ours = ChatTemplate(source).render(messages, add_generation_prompt=True, tools=tools, strftime_now=fixed_date,
                                       **extra)
    assert ours == _reference(source, messages, tools=tools, add_generation_prompt=True, **extra)
    assert ours.endswith("<|start|>assistant")
    assert f"Reasoning: {effort or 'medium'}\n" in ours


def test_earlier_analysis_is_dropped_and_a_pending_calls_analysis_kept(source):
    template = ChatTemplate(source)
    history = template.render(CONVERSATIONS["reasoning_history"], add_generation_prompt=True, strftime_now=fixed_date)
    assert "21 = 3 * 7." not in history
    assert "<|start|>assistant<|channel|>final<|message|>No.<|end|><|start|>user<|message|>And 23?<|end|>" in history
    # a tool call not answered yet keeps its analysis; once an answer follows, both analyses go
    pending = template.render(CONVERSATIONS["tool_round_trip"], add_generation_prompt=True, tools=[WEATHER_TOOL])
    assert "<|channel|>analysis<|message|>I should call get_weather.<|end|>" in pending
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18C, sunny"<|end|>'
            ) in pending
    answered = template.render(CONVERSATIONS["tool_then_answer"], add_generation_prompt=True, tools=[WEATHER_TOOL])
    assert "I should call get_weather." not in answered and "Report it." not in answered


def test_the_template_is_known_as_harmony_with_its_reasoning_efforts(source):
    template = ChatTemplate(source)
    assert template.harmony and is_harmony(source)
    assert template.reasoning_efforts() == ("low", "medium", "high")
    assert template.thinking_modes() == (False, frozenset())   # no enable_thinking switch
    assert template.takes_tools()
    # replies end at <|return|> (their <|end|> closes the analysis inside them); the history closes with <|end|>
    assert end_of_turn_token(template) == "<|return|>"
    assert history_end_token(template) == "<|end|>"
    chatml = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    assert not chatml.harmony and chatml.reasoning_efforts() == ()
    # a template that reads only some values: those it fails on are not offered
    picky = ChatTemplate("{% if reasoning_effort == 'low' %}{{ raise_exception('no') }}{% endif %}"
                         "R: {{ reasoning_effort }}")
    assert picky.reasoning_efforts() == ("medium", "high")


# ---------------------------------------------------------------------------------- parsing
ANSWER_REPLY = ("<|channel|>analysis<|message|>User asks 2+2. Simple: 4.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**.")
CALL_REPLY = ("<|channel|>analysis<|message|>Need the weather: call the tool.<|end|>"
              "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
              '<|message|>{"city":"Paris"}')
PREAMBLE_REPLY = ("<|channel|>analysis<|message|>Think.<|end|>"
                  "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")


def _fed(chunks) -> HarmonySplitter:
    splitter, seen = HarmonySplitter(), []
    for chunk in chunks:
        splitter.feed(chunk)
        seen.append((splitter.reasoning or "", splitter.answer))
    splitter.finish()
    seen.append((splitter.reasoning or "", splitter.answer))
    for (r0, a0), (r1, a1) in zip(seen, seen[1:]):   # both only grow
        assert r1.startswith(r0) and a1.startswith(a0)
    return splitter


def _at_every_split(text):
    for at in range(len(text) + 1):
        yield [text[:at], text[at:]]
    yield list(text)   # a character at a time


@pytest.mark.parametrize("text, reasoning, answer, calls", [
    (ANSWER_REPLY, "User asks 2+2. Simple: 4.", "2 + 2 = **4**.", []),
    (CALL_REPLY, "Need the weather: call the tool.", "", [("get_weather", '{"city":"Paris"}')]),
    (CALL_REPLY + "<|call|>", "Need the weather: call the tool.", "", [("get_weather", '{"city":"Paris"}')]),
    (PREAMBLE_REPLY, "Think.", "Let me check.\n\nDone.", []),
    # the recipient before the channel, as the template writes calls in the history
    (' to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>', None, "", [("f", '{"a": 1}')]),
    ("plain text, no channels", None, "plain text, no channels", []),
    ("<|channel|>final<|message|>a <| b <|en", None, "a <| b <|en", []),   # a token's beginning that never ends
])
def test_a_reply_splits_the_same_however_it_is_chunked(text, reasoning, answer, calls):
    for chunks in _at_every_split(text):
        s = _fed(chunks)
        assert (s.reasoning, s.answer) == (reasoning, answer), chunks
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in s.calls] == calls
        assert s.closed == (reasoning is not None)
        assert not s.thinking and not s.prompted


def test_the_splitter_says_when_it_is_inside_the_analysis():
    s = HarmonySplitter()
    s.feed("<|channel|>analysis<|mess")
    assert s.reasoning is None and not s.thinking
    s.feed("age|>Hmm")
    assert s.thinking and s.reasoning == "Hmm" and not s.closed
    s.feed("<|end|><|start|>assistant<|channel|>final<|message|>Yes")
    assert not s.thinking and s.closed and s.answer == "Yes"
    assert call_arguments(split_harmony(CALL_REPLY).calls[0]) == {"city": "Paris"}


def _harmony_tokenizer(template_source: str | None = None) -> Tokenizer:
    """A tiny byte-level BPE with the harmony special tokens, trained here."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", *TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["User asks 2+2. Simple: 4.", "2 + 2 = **4**.", "analysis final commentary assistant user system",
              'Weather in Paris? {"city": "Paris"} get_weather functions', "Reasoning: low medium high"] * 20
    backend.train_from_iterator(corpus, trainer)
    return Tokenizer(backend, eos_token_id=backend.token_to_id("<|return|>"), chat_template=template_source,
                     name="tiny-harmony")


def test_the_tokenizer_path_keeps_the_special_tokens_for_the_parser():
    tok = _harmony_tokenizer()
    ids = tok.encode(ANSWER_REPLY, add_special_tokens=False)
    for special in TOKENS:   # each a single id
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("<|start|>assistant", add_special_tokens=False))
    chunks = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(chunks) == ANSWER_REPLY   # special tokens decoded as text, not skipped
    s = _fed(chunks)
    assert (s.reasoning, s.answer) == ("User asks 2+2. Simple: 4.", "2 + 2 = **4**.")


# ---------------------------------------------------------------------------------- the session's history
def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_session_keeps_the_history_the_template_renders_and_reuses_kv_up_to_the_divergence(source):
    tok = _harmony_tokenizer(source)
    template = ChatTemplate(source)
    variables = {"reasoning_effort": "low", "strftime_now": fixed_date}
    session = ChatSession(tok, template, "Be brief.")
    first = session.prepare_turn("Is 21 prime?", variables)
    generated = tok.encode("<|channel|>analysis<|message|>21 = 3 * 7.<|end|>"
                           "<|start|>assistant<|channel|>final<|message|>No.<|return|>", add_special_tokens=False)
    cached = first + generated     # what the engine's KV holds after the turn (the prompt and the reply)
    session.complete_turn(tok.decode(generated[:-1]), generated)
    second = session.prepare_turn("And 23?", variables)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is 21 prime?"},
                {"role": "assistant", "content": "No."}, {"role": "user", "content": "And 23?"}]
    expected = template.render(messages, add_generation_prompt=True, **variables)
    assert tok.decode(second) == expected and "21 = 3 * 7." not in expected
    # The prompt shares the KV up to the generation prompt and the reply's first token (<|channel|>):
    # the prefix cache serves that much; the rest (final message, new turn) is prefilled again.
    shared = _common_prefix(cached, second)
    assert shared == len(first) + 1
    assert len(second) - shared == len(tok.encode("final<|message|>No.<|end|><|start|>user<|message|>And 23?"
                                                  "<|end|><|start|>assistant", add_special_tokens=False))


def test_a_session_renders_tool_results_after_a_harmony_call(source):
    tok = _harmony_tokenizer(source)
    template = ChatTemplate(source)
    variables = {"tools": [WEATHER_TOOL], "strftime_now": fixed_date}
    session = ChatSession(tok, template)
    first = session.prepare_turn("Weather in Paris?", variables)
    generated = tok.encode(CALL_REPLY + "<|call|>", add_special_tokens=False)
    session.complete_turn(tok.decode(generated[:-1]), generated)
    assert session.token_ids == first + generated   # a call is kept as written, ending with <|call|>
    second = session.prepare_turn([{"role": "tool", "content": "18C, sunny"}], variables)
    assert tok.decode(second[len(first) + len(generated):]) == (
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18C, sunny"<|end|>'
        "<|start|>assistant")
    # a replayed transcript (a new engine) rebuilds the same history from the reply's text
    replayed = ChatSession.from_history(tok, template, None, [
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": CALL_REPLY}],
        template_kwargs=variables)
    assert replayed.token_ids == first + generated
    assert json.loads(split_harmony(CALL_REPLY).calls[0]["function"]["arguments"]) == {"city": "Paris"}
