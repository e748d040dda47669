"""Structured output (engine/structured.py): replies held to a JSON schema, or to a grammar, token by token.

The tiny models are random: whatever JSON they write, they write only because every token that would break the
document or the schema is masked before sampling. Batched, preempted, sampled and greedy replies are checked
against the schema; an unconstrained reply in the same batch is unchanged.
"""

from __future__ import annotations

import json
import re

import pytest

from nanochat.engine import LLM, SamplingParams
from nanochat.engine.lean import sampling_supported
from nanochat.engine.output import RequestError
from nanochat.engine.sampling_params import ANY_OBJECT
from nanochat.engine.structured import Constraint, Lead, schema_grammar

ARCH = "qwen3"
PICK = {"type": "object", "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", "blue"]},
                                         "tag": {"type": "string", "maxLength": 6},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "pick", "tag", "n"], "additionalProperties": False}
PROMPTS = [[5, 17, 42, 99, 3], [11, 12, 13], list(range(20, 61))]


def _valid_pick(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"ok", "pick", "tag", "n"} and isinstance(value["ok"], bool)
            and value["pick"] in ("red", "green", "blue") and isinstance(value["tag"], str) and len(value["tag"]) <= 6
            and isinstance(value["n"], int) and 0 <= value["n"] <= 99)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=512)


def test_sampled_and_greedy_replies_follow_the_schema_batched(llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300, json_schema=PICK) for s in range(4)]
    params.append(SamplingParams(temperature=0, max_tokens=300, json_schema=PICK))
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    for out in outs:
        assert out.finish_reason == "stop" and _valid_pick(out.text), out.text


def test_an_unconstrained_reply_in_the_same_batch_is_unchanged(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], plain)[0].token_ids
    mixed = llm.generate([PROMPTS[0], PROMPTS[1]], [plain, SamplingParams(temperature=0, max_tokens=300,
                                                                          json_schema=PICK)])
    assert mixed[0].token_ids == alone and _valid_pick(mixed[1].text)


def test_a_reply_ends_when_the_document_is_complete(llm):
    for schema, texts in (({"const": "hello"}, {'"hello"'}), ({"type": "boolean"}, {"true", "false"})):
        out = llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=3, max_tokens=50,
                                                         json_schema=schema))[0]
        assert out.text in texts and out.finish_reason == "stop", out
    cut = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3, json_schema=ANY_OBJECT))[0]
    assert cut.finish_reason == "length" and cut.text.lstrip().startswith("{")


def test_constrained_replies_under_preemption_follow_the_schema(tiny_models):
    llm = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=256, num_kvcache_blocks=8, kvcache_block_size=16)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, json_schema=PICK) for s in range(4)]
    outs = llm.generate([list(range(3, 40))] * 4, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(o.finish_reason == "stop" and _valid_pick(o.text) for o in outs), [o.text for o in outs]
    assert llm.engine.block_manager.num_free_blocks == len(llm.engine.block_manager.blocks)


LIST = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 12, "maxItems": 40}


@pytest.mark.parametrize("schema", [PICK, LIST], ids=["pick", "list"])
def test_speculation_leaves_constrained_greedy_replies_as_they_are(tiny_models, schema):
    """Proposals are verified against rows masked as the grammar stands after the proposals before them: the same
    greedy tokens as plain decoding, and the proposals the grammar refuses are never accepted."""
    prompts = [PROMPTS[2], list(range(7, 90))]
    greedy = SamplingParams(temperature=0, max_tokens=300, json_schema=schema)
    plain = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=512, speculative="off")
    spec = LLM(str(tiny_models[ARCH]), dtype="float32", max_model_len=512, speculative="ngram")
    want = [o.token_ids for o in plain.generate(prompts, greedy)]
    got = spec.generate(prompts, greedy)
    assert [o.token_ids for o in got] == want
    assert all(json.loads(o.text) is not None and o.finish_reason == "stop" for o in got)
    if schema is LIST:   # a repetitive list: prompt lookup proposes, and some proposals hold
        assert spec.engine.total_spec_proposed > 0 and spec.engine.total_spec_accepted > 0
    sampled = spec.generate(prompts, SamplingParams(temperature=1.0, max_tokens=300, json_schema=schema))
    assert all(o.finish_reason == "stop" and json.loads(o.text) is not None for o in sampled)


def test_bad_schemas_are_clear_errors(llm):
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingParams(json_schema="{oops")
    with pytest.raises(ValueError, match="must be a JSON object"):
        SamplingParams(json_schema=[1, 2])
    for bad, words in (({"type": "nope"}, "json_schema cannot be followed: "),
                       ({"propertyNames": {"pattern": "^x"}}, "json_schema cannot be followed: Unimplemented"),
                       (False, "admits no document")):
        with pytest.raises(RequestError, match=words):
            llm.engine.add_request([5, 6], SamplingParams(json_schema=bad))
    # true: any JSON value (a document, or a prefix of one where max_tokens cut it)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=2, max_tokens=300, json_schema=True))[0]
    if out.finish_reason == "stop":
        json.loads(out.text)
    assert not llm.engine.has_unfinished()


def test_the_mask_allows_exactly_the_valid_continuations(llm):
    """After `{"ok": ` only `true` / `false` can start: every allowed token's text is a prefix of one of them
    (with optional whitespace), and the tokens that spell them are allowed."""
    engine = llm.engine
    c = Constraint(engine.grammars.tokenizer, schema_grammar(SamplingParams(json_schema=PICK).json_schema))
    for token in engine.tokenizer.encode('{"ok":', add_special_tokens=False):
        assert c.allowed()[token]
        assert not c.advance(token)
    allowed = [int(i) for i in c.allowed().nonzero()[0]]
    texts = [engine.tokenizer.decode([i]) for i in allowed]
    assert allowed and all(t.strip() and ("true".startswith(t.strip()) or "false".startswith(t.strip()))
                           or not t.strip() for t in texts), texts
    for word in ("true", "false"):
        first = engine.tokenizer.encode(word, add_special_tokens=False)[0]
        assert first in allowed


def test_the_lean_one_shot_holds_schemas_and_grammars_too():
    assert sampling_supported({"temperature": 0, "json_schema": ANY_OBJECT})
    assert sampling_supported({"temperature": 0, "grammar": 'start: "x"'})


# ---------------------------------------------------------------------------------- grammars: forced tool calls
def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
SUM = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
       "additionalProperties": False}
TOOLS = [_tool("get_weather", CITY), _tool("add", SUM)]


def _valid_call(call: dict) -> bool:
    arguments = json.loads(call["function"]["arguments"])
    return (call["function"]["name"] == "get_weather" and arguments.get("city") in CITY["properties"]["city"]["enum"]
            or call["function"]["name"] == "add" and set(arguments) == {"x"} and 0 <= arguments["x"] <= 9)


def test_a_forced_call_grammar_holds_replies_to_the_tags_and_the_tools_parameters(llm):
    """Hermes-style calls (Qwen2.5, Qwen3): any tool, one call or more; a named one, exactly one call of it. The
    reply parses into calls and nothing else, sampled or greedy, batched beside an unconstrained reply. (The random
    model would write calls until max_tokens: a bias on its end-of-turn token ends the reply where the grammar
    first allows it, after the first call.)"""
    from nanochat.app.tool_calls import call_grammar, split

    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], plain)[0].token_ids
    end = {min(llm.engine.eos_token_ids): 100}
    params = [plain, SamplingParams(temperature=0, max_tokens=300, grammar=call_grammar(TOOLS, True), logit_bias=end)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=300, grammar=call_grammar(TOOLS, True),
                              logit_bias=end) for s in range(3)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=300, grammar=call_grammar(TOOLS, "add"))
               for s in range(3)]
    # required without parallel calls: the reply ends after its call, without the bias
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=300, grammar=call_grammar(TOOLS, True,
                                                                                           parallel=False))
               for s in range(2)]
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    assert outs[0].token_ids == alone
    for out, sp in zip(outs[1:], params[1:]):
        content, calls = split(out.text)
        assert out.finish_reason == "stop" and content.strip() == "" and calls, out.text
        assert all(_valid_call(c) for c in calls), calls
        assert len(calls) == 1 and (sp.logit_bias or "get_weather" in sp.grammar
                                    or calls[0]["function"]["name"] == "add"), out.text
    assert not llm.engine.has_unfinished()


def test_a_forced_calls_json_has_the_bounded_whitespace_of_a_schemas(llm):
    from nanochat.app.tool_calls import call_grammar
    from nanochat.engine.structured import lark_grammar

    engine = llm.engine
    for spaces, valid in ((20, True), (21, False)):
        c = Constraint(engine.grammars.tokenizer, lark_grammar(call_grammar(TOOLS, "add")), what="grammar")
        text = '<tool_call>\n{\n' + " " * spaces + '"name": "add", "arguments": {"x": 3}}\n</tool_call>'
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        assert (c.matcher.validate_tokens(ids) == len(ids)) == valid


def test_auto_without_parallel_calls_leaves_text_free_and_ends_after_one_call(llm):
    """tool_choice "auto" with parallel_tool_calls false: any text without the opening tag, or text and one call of
    valid arguments, after which only the end may come."""
    from nanochat.app.tool_calls import call_grammar
    from nanochat.engine.structured import lark_grammar

    assert call_grammar(TOOLS, False) is None   # parallel calls allowed: nothing to hold
    engine = llm.engine
    grammar = lark_grammar(call_grammar(TOOLS, False, parallel=False))
    call = '<tool_call>\n{"name": "add", "arguments": {"x": 3}}\n</tool_call>'
    for text, taken, stopped in (("No tools needed, <tool> is not a tag.", True, False),
                                 (f"Let me add.\n{call}", True, True),
                                 (f"Let me add.\n{call}\n{call}", False, None),
                                 ('<tool_call>\n{"name": "add", "arguments": {"x": 30}}', False, None)):
        c = Constraint(engine.grammars.tokenizer, grammar, what="grammar")
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        assert (c.matcher.validate_tokens(ids) == len(ids)) == taken, text
        if taken:
            assert [c.advance(t) for t in ids][-1] == stopped, text
    from nanochat.app.tool_calls import split

    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                                                grammar=call_grammar(TOOLS, False, parallel=False)))
    for out in outs:   # (the random model writes text; had it opened a tag, one valid call would end the reply)
        calls = split(out.text)[1]
        assert calls == [] and "<tool_call>" not in out.text or len(calls) == 1 and _valid_call(calls[0]), out.text


def test_grammar_errors_are_clear(llm):
    with pytest.raises(ValueError, match="json_schema and grammar cannot both"):
        SamplingParams(json_schema=PICK, grammar='start: "x"')
    with pytest.raises(ValueError, match="grammar must be a Lark grammar's text"):
        SamplingParams(grammar="  ")
    for bad in ("start: nowhere", 'start: %json {"type": "nope"}'):
        with pytest.raises(RequestError, match="grammar cannot be followed: "):
            llm.engine.add_request([5, 6], SamplingParams(grammar=bad))
    assert not llm.engine.has_unfinished()


def test_a_harmony_models_analysis_is_left_free_and_its_final_answer_held(tmp_path):
    """The tiny gpt-oss answers every message with an analysis and then "Hello!" in the final channel; under a
    schema the analysis stays its own and the final channel's text is the document."""
    from test_gpt_oss import make_harmony_gpt_oss

    from nanochat.models.text.harmony import split_harmony as split

    llm = LLM(str(make_harmony_gpt_oss(tmp_path / "harmony")), dtype="float32", max_model_len=256)
    engine = llm.engine
    prompt = engine.loaded.chat_template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60))[0]
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=120, json_schema=PICK))[0]
    raw = [engine.tokenizer.decode(o.token_ids) for o in (free, held)]
    assert split(raw[0]).answer == "Hello!"
    assert split(raw[1]).reasoning == split(raw[0]).reasoning == "Let me think~"
    assert _valid_pick(split(raw[1]).answer) and held.finish_reason == "stop"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A tiny random Qwen3 whose tokenizer has <think> and </think> as tokens of their own (as Qwen3's)."""
    import transformers
    import torch

    from conftest import SPECIALS, TINY, build_tokenizer, save_tiny

    tok = build_tokenizer(320, [*SPECIALS, "<think>", "</think>"])
    cfg = transformers.Qwen3Config(**TINY, vocab_size=320, tie_word_embeddings=False, bos_token_id=None,
                                   eos_token_id=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(9)
    return save_tiny(transformers.Qwen3ForCausalLM(cfg).float(), tok, tmp_path_factory.mktemp("thinker") / "m")


def test_a_reasoning_models_thinking_is_left_free_and_the_document_held_after_it(thinker):
    llm = LLM(str(thinker), dtype="float32", max_model_len=512)
    engine, tok = llm.engine, llm.engine.tokenizer
    think = (tok.token_to_id("<think>"), tok.token_to_id("</think>"))
    lead = Lead((think[1],), opener=think[0])
    assert engine.grammars.lead() == lead
    held = schema_grammar(SamplingParams(json_schema=PICK).json_schema)
    c = Constraint(engine.grammars.tokenizer, held, lead, [5, 6])
    assert c.allowed()[think[0]] and not c.allowed()[think[1]]       # may open a block, or start the document
    assert not c.advance(think[0]) and c.allowed() is None           # thinking: anything goes
    for token in tok.encode("plan {{{ ]] no json here", add_special_tokens=False):
        assert not c.advance(token)
    assert not c.advance(think[1])                                   # </think>: the document is held from here
    allowed = c.allowed()
    assert not allowed[think[0]] and allowed[tok.encode("{", add_special_tokens=False)[0]]
    # a prompt that opened the block starts inside it; mask_along crosses </think> and leaves the state as it was
    c = Constraint(engine.grammars.tokenizer, held, lead, [5, think[0]])
    assert c.allowed() is None
    import torch
    rows = torch.zeros(3, engine.loaded.config.vocab_size)
    c.mask_along(rows, [7, think[1]])
    assert torch.isfinite(rows[0]).all() and torch.isfinite(rows[1]).all()   # still thinking
    assert torch.isinf(rows[2]).sum() > 0 and torch.isinf(rows[2, think[0]])   # the document's first token
    assert c.phase == "lead" and c.allowed() is None
    # through the engine: the prompt opens the block, a +100 bias closes it at once; the answer is the document
    prompt = [*tok.encode("hello", add_special_tokens=False), think[0]]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=300, json_schema=PICK,
                                                logit_bias={think[1]: 100}))[0]
    assert out.token_ids[0] == think[1] and _valid_pick(tok.decode(out.token_ids[1:]))


def test_a_gbnf_grammar_holds_replies_as_llama_cpps_does(llm):
    """llama.cpp's GBNF (converted by llguidance) and the same grammar in Lark hold sampled replies alike."""
    gbnf = 'root ::= word (", " word){1,2} "."\nword ::= [a-z]{2,5}'
    lark = 'start: WORD (", " WORD){1,2} "."\nWORD: /[a-z]{2,5}/'
    for grammar in (gbnf, lark):
        outs = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=s, max_tokens=60, grammar=grammar)
                                      for s in range(len(PROMPTS))])
        for out in outs:
            assert re.fullmatch(r"[a-z]{2,5}(, [a-z]{2,5}){1,2}\.", out.text) and out.finish_reason == "stop", out


def test_in_harmony_a_forced_call_follows_the_analysis_and_a_grammar_holds_the_answer(tmp_path):
    """The tiny gpt-oss, which writes an analysis and then "Hello!" in the final channel, under a forced call: its
    analysis is its own, then a commentary message to the function with arguments under the tool's parameters, and
    the reply ends at <|call|>."""
    from test_gpt_oss import make_harmony_gpt_oss

    from nanochat.app.tool_calls import call_grammar
    from nanochat.models.text.harmony import split_harmony as split

    llm = LLM(str(make_harmony_gpt_oss(tmp_path / "harmony")), dtype="float32", max_model_len=256)
    engine = llm.engine
    prompt = engine.loaded.chat_template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60))[0]
    assert call_grammar(TOOLS, False, harmony=True, parallel=False) is None   # a harmony reply holds one call at most
    for name in (True, "add"):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=120,
                                                    grammar=call_grammar(TOOLS, name, harmony=True)))[0]
        raw = engine.tokenizer.decode(out.token_ids)
        reply = split(raw)
        assert reply.reasoning == split(engine.tokenizer.decode(free.token_ids)).reasoning == "Let me think~"
        assert out.finish_reason == "stop" and reply.answer == "" and len(reply.calls) == 1, raw
        assert _valid_call(reply.calls[0]) and name in (True, reply.calls[0]["function"]["name"]), raw
        assert "<|channel|>commentary to=functions." in raw and raw.endswith("<|call|>"), raw
    # a grammar that does not name the channels holds the answer, as a schema does: the final channel's text
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=120, grammar='root ::= "Bye" [!?]'))[0]
    reply = split(engine.tokenizer.decode(held.token_ids))
    assert reply.reasoning == "Let me think~" and reply.answer in ("Bye!", "Bye?") and held.finish_reason == "stop"


def test_a_reasoning_model_thinks_before_a_forced_call(thinker):
    """Qwen3's <think> block stays free before the calls, as before a JSON document."""
    from nanochat.app.tool_calls import call_grammar, split

    llm = LLM(str(thinker), dtype="float32", max_model_len=512)
    tok = llm.engine.tokenizer
    think = (tok.token_to_id("<think>"), tok.token_to_id("</think>"))
    prompt = [*tok.encode("hello", add_special_tokens=False), think[0]]   # the prompt opens the block
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=300, grammar=call_grammar(TOOLS, "add"),
                                                logit_bias={think[1]: 100}))[0]
    assert out.token_ids[0] == think[1]
    content, calls = split(tok.decode(out.token_ids[1:]))
    assert out.finish_reason == "stop" and not content.strip() and len(calls) == 1 and _valid_call(calls[0])
