"""Structured output (engine/structured.py): replies held to a JSON schema token by token.

The tiny models are random: whatever JSON they write, they write only because every token that would break the
document or the schema is masked before sampling. Batched, preempted, sampled and greedy replies are checked
against the schema; an unconstrained reply in the same batch is unchanged.
"""

from __future__ import annotations

import json

import pytest

from nanochat.engine import LLM, SamplingParams
from nanochat.engine.lean import sampling_supported
from nanochat.engine.output import RequestError
from nanochat.engine.sampling_params import ANY_OBJECT
from nanochat.engine.structured import Constraint, Lead, canonical_schema

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
    engine._constraint(SamplingParams(json_schema=PICK), [5])   # builds the grammar tokenizer
    c = Constraint(engine._grammar_tokenizer, canonical_schema(PICK))
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


def test_the_lean_one_shot_leaves_schemas_to_the_full_engine():
    assert sampling_supported({"temperature": 0})
    assert not sampling_supported({"temperature": 0, "json_schema": ANY_OBJECT})


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
    engine._constraint(SamplingParams(json_schema=PICK), [5])   # builds the grammar tokenizer
    lead = Lead((think[1],), opener=think[0])
    c = Constraint(engine._grammar_tokenizer, canonical_schema(PICK), lead, [5, 6])
    assert c.allowed()[think[0]] and not c.allowed()[think[1]]       # may open a block, or start the document
    assert not c.advance(think[0]) and c.allowed() is None           # thinking: anything goes
    for token in tok.encode("plan {{{ ]] no json here", add_special_tokens=False):
        assert not c.advance(token)
    assert not c.advance(think[1])                                   # </think>: the document is held from here
    allowed = c.allowed()
    assert not allowed[think[0]] and allowed[tok.encode("{", add_special_tokens=False)[0]]
    # a prompt that opened the block starts inside it; mask_along crosses </think> and leaves the state as it was
    c = Constraint(engine._grammar_tokenizer, canonical_schema(PICK), lead, [5, think[0]])
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
