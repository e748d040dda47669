"""Gemma 3's text decoder (HF Gemma3ForCausalLM / gemma3_text, the text part of gemma3 wrappers, GGUF gemma3):
tiny random transformers models are the oracle, with the real layout's rules (four norms a layer stored as
w for a scale of 1 + w, q/k norms, GeGLU, embeddings times sqrt(hidden), query_pre_attn_scalar, windowed local
layers with their own RoPE base and global layers with linear RoPE scaling, optional logit soft-capping) and a
sliding window the prompts exceed. Logits on the fused CPU step and on the module path, greedy tokens through the
engine (batched, preempted, chunked, prefix-cached, a multi-turn chat with Gemma's template), and the same
checkpoint as GGUF files written as llama.cpp's converter writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanochat.engine import LLM, LLMEngine, SamplingParams
from nanochat.models.families import registry
from tests.conftest import build_tokenizer
from tests.gguf_writer import T, write_gguf_from_hf
from tests.test_families import (assert_chat_turns_replay, assert_logits_match, assert_refused, engine_for,
                                 oracle_greedy, oracle_logits, step_logits, tokenizer_metadata)

WINDOW = 12
PROMPT = list(range(5, 25))
FORCED = [(7 * i + 3) % 300 for i in range(40)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
# google/gemma-3-*-it's chat template.
GEMMA_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n")
# The variants: the real layout (every 6th layer global, linear RoPE scaling there, tied head, query_pre_attn_scalar
# = head_dim as in the 1B-12B), and one with its own layer pattern, an untied head, soft-capped logits and another
# query_pre_attn_scalar (as the 27B's).
VARIANTS = ["gemma3", "gemma3_capped"]


def gemma_tokenizer(vocab_size: int = 320):
    """The suite's byte-level BPE with Gemma's special tokens."""
    return build_tokenizer(vocab_size, SPECIALS)


def make_gemma3(out_dir: Path, variant: str = "gemma3", seed: int = 0) -> Path:
    """A tiny random Gemma3ForCausalLM, norms randomised around 0 (a scale of about 1, as 1 + w)."""
    import transformers

    tok = gemma_tokenizer()
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    kw = dict(vocab_size=320, hidden_size=96, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
              query_pre_attn_scalar=16, sliding_window=WINDOW, rope_parameters=rope, pad_token_id=0,
              bos_token_id=tok.token_to_id("<bos>"),
              eos_token_id=[tok.token_to_id("<eos>"), tok.token_to_id("<end_of_turn>")])
    if variant == "gemma3_capped":
        kw.update(layer_types=["sliding_attention", "full_attention", "full_attention"] * 2,
                  final_logit_softcapping=2.0, tie_word_embeddings=False, query_pre_attn_scalar=24)
    cfg = transformers.Gemma3TextConfig(**kw)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": GEMMA_TEMPLATE, "eos_token": "<eos>", "bos_token": "<bos>", "pad_token": "<pad>",
        "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3")
    return {v: make_gemma3(root / v, v, seed=i) for i, v in enumerate(VARIANTS)}


@pytest.fixture(scope="module")
def oracle(models):
    import transformers

    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = transformers.AutoModelForCausalLM.from_pretrained(models[variant],
                                                                              dtype=torch.float32).eval()
        return cache[variant]
    return get


# ---------------------------------------------------------------- config


def test_config_from_the_hf_folder(models):
    from nanochat.models.formats.hf_source import HFSource

    cfg = HFSource(models["gemma3"]).config
    assert cfg.arch == "gemma3_text" and cfg.qk_norm and cfg.norm_zero_centred and cfg.sandwich_norms
    assert cfg.layer_windows == (WINDOW,) * 5 + (0,)   # transformers' default: every 6th layer global
    assert cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings
    assert cfg.embed_scale == pytest.approx(96 ** 0.5) and cfg.attention_scale == 16 ** -0.5
    assert (cfg.rope_theta, cfg.local_rope_theta) == (50000.0, 10000.0)
    assert cfg.rope_scaling["rope_type"] == "linear" and cfg.rope_scaling["factor"] == 4.0
    assert cfg.final_logit_softcapping == 0.0
    capped = HFSource(models["gemma3_capped"]).config
    assert capped.layer_windows == (WINDOW, 0, 0) * 2 and capped.final_logit_softcapping == 2.0
    assert capped.attention_scale == 24 ** -0.5 and not capped.tie_word_embeddings


# A gemma-3-4b-it config.json as published (transformers 4.50): the text config lists only what differs from
# Gemma3TextConfig's defaults, the RoPE settings are top-level keys, the wrapper holds the end ids.
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
             "boi_token_index": 255999, "image_token_index": 262144, "mm_tokens_per_image": 256,
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                             "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024},
             "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}


def test_config_of_a_multimodal_wrapper_with_transformers_defaults():
    cfg = registry.hf_config(GEMMA3_4B)
    assert cfg.arch == "gemma3_text" and cfg.vocab_size == 262_208 and cfg.eos_token_ids == (1, 106)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 256)
    assert cfg.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(34))
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["factor"]) == (1e6, 10000.0, 8.0)
    assert cfg.attention_scale == 256 ** -0.5 and cfg.embed_scale == 2560 ** 0.5 and cfg.tie_word_embeddings


def test_old_and_new_rope_keys_agree():
    """transformers 4.x's rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern and 5.x's
    rope_parameters per layer type and layer_types describe the same model."""
    base = dict(model_type="gemma3_text", vocab_size=320, hidden_size=64, intermediate_size=128,
                num_hidden_layers=8, num_attention_heads=4, head_dim=16, sliding_window=32)
    old = registry.hf_config({**base, "rope_theta": 5e5, "rope_local_base_freq": 2e4, "sliding_window_pattern": 4,
                                    "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    new = registry.hf_config({**base, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]
                                    + ["sliding_attention"] * 3 + ["full_attention"],
                                    "rope_parameters": {
                                        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}})
    for cfg in (old, new):
        assert cfg.layer_windows == (32, 32, 32, 0) * 2 and (cfg.rope_theta, cfg.local_rope_theta) == (5e5, 2e4)
        assert (cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == ("linear", 2.0)


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."], ids=["4.50", "4.52+"])
def test_multimodal_checkpoint_serves_its_text_model(prefix, models, tmp_path):
    """A Gemma3ForConditionalGeneration folder (the text model's tensors under either transformers layout, beside
    a vision tower and projector; the text config inside the wrapper's) gives the text model's logits."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, out = models["gemma3"], tmp_path / "mm"
    shutil.copytree(folder, out)
    state = {prefix + k.removeprefix("model."): v for k, v in load_file(folder / "model.safetensors").items()}
    state["vision_tower.vision_model.post_layernorm.weight" if prefix.startswith("language")
          else "model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    state["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, 96)
    save_file(state, out / "model.safetensors")
    text = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                 "vision_config": {"model_type": "siglip_vision_model"},
                                                 "eos_token_id": text["eos_token_id"]}))
    ref = step_logits(engine_for(folder, False), PROMPT, FORCED[:4])
    assert torch.equal(step_logits(engine_for(out, False), PROMPT, FORCED[:4]), ref)


@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping .* is not supported"),
    ({"hidden_activation": "relu"}, "hidden activation 'relu' is not supported for gemma3_text"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar is 0"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "RoPE scaling on the sliding-window layers"),
])
def test_unsupported_config_is_one_line(models, tmp_path, change, message):
    assert_refused(models["gemma3"], tmp_path, change, message)


# ---------------------------------------------------------------- logits


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "module"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(variant, fused, models, oracle):
    assert_logits_match(models[variant], oracle(variant), fused)


def test_the_checks_can_fail(models, oracle):
    """Each Gemma rule changes the logits: the oracle without the window, without the local RoPE base, without
    the linear scaling, and with head_dim's attention scale all differ from it."""
    hf = oracle("gemma3")
    ref = oracle_logits(hf, PROMPT, FORCED[:4])
    cfg = hf.config
    changes = [("sliding_window", 10_000), ("query_pre_attn_scalar", 24)]
    for key, value in changes:
        old = getattr(cfg, key)
        setattr(cfg, key, value)
        for layer in hf.model.layers:   # read at construction
            layer.self_attn.scaling = cfg.query_pre_attn_scalar ** -0.5
            layer.self_attn.sliding_window = cfg.sliding_window if layer.self_attn.is_sliding else None
        try:
            assert (oracle_logits(hf, PROMPT, FORCED[:4]) - ref).abs().max().item() > 1e-2, key
        finally:
            setattr(cfg, key, old)
            for layer in hf.model.layers:
                layer.self_attn.scaling = cfg.query_pre_attn_scalar ** -0.5
                layer.self_attn.sliding_window = cfg.sliding_window if layer.self_attn.is_sliding else None
    rotary = hf.model.rotary_emb
    for name in ("sliding_attention_inv_freq", "full_attention_inv_freq"):
        saved = getattr(rotary, name).clone()
        getattr(rotary, name).mul_(1.5)
        try:
            assert (oracle_logits(hf, PROMPT, FORCED[:4]) - ref).abs().max().item() > 1e-2, name
        finally:
            getattr(rotary, name).copy_(saved)
    assert (oracle_logits(hf, PROMPT, FORCED[:4]) - ref).abs().max().item() == 0


def test_nanochat_info_reports_the_fused_path(models):
    from nanochat.models.report import describe

    engine = engine_for(models["gemma3"], True)
    report = dict(describe(engine.runner.model).lines())
    assert report["forward"] == "fused whole-stack CPU kernel"
    assert "sliding window 12 on 5 of 6 layers" in report["attention"]


# ---------------------------------------------------------------- engine


@pytest.mark.parametrize("variant, fused", [("gemma3", True), ("gemma3", False), ("gemma3_capped", True)])
def test_greedy_through_the_engine(variant, fused, models, oracle):
    """Batched, one by one (prefix-cached), preempted with 7-token chunks: transformers' greedy tokens, on the
    fused step (dense weights on its exact F32 tiles) and on the module path."""
    prompts = [PROMPT, list(range(40, 70)), PROMPT[:5], PROMPT + [9, 9, 9]]
    expected = [oracle_greedy(oracle(variant), p, GREEDY.max_tokens) for p in prompts]
    path = str(models[variant])
    kw = dict(dtype="float32", max_model_len=256, kv_cache_dtype="float32", fused_forward=fused)
    llm = LLM(path, **kw)
    assert (llm.engine.runner.model.fused.why_not is None) == fused
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected   # prefix-cached
    small = LLM(path, **kw, num_kvcache_blocks=6, max_num_batched_tokens=7)   # preemption and 7-token chunks
    assert [r.token_ids for r in small.generate(prompts, GREEDY)] == expected


def test_chat_template_renders_and_ends_turns(models):
    from nanochat.models.text.chat_template import ChatTemplate, ChatTemplateError

    engine = LLMEngine(str(models["gemma3"]), dtype="float32", max_model_len=256, kv_cache_dtype="float32")
    template = engine.loaded.chat_template
    prompt = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "},
                              {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}],
                             add_generation_prompt=True)
    assert prompt == ("<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nhello"
                      "<end_of_turn>\n<start_of_turn>user\nmore<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="must alternate"):
        ChatTemplate(GEMMA_TEMPLATE, bos_token="<bos>").render([{"role": "assistant", "content": "x"}])
    assert template.end_of_turn_token(engine.tokenizer) == "<end_of_turn>"
    eot = engine.tokenizer.token_to_id("<end_of_turn>")
    assert eot in engine.eos_token_ids
    ids = engine.tokenizer.encode(prompt)
    assert ids[0] == engine.tokenizer.token_to_id("<bos>") and ids.count(eot) == 3


def test_chat_session_turns_equal_a_fresh_replay(models):
    assert_chat_turns_replay(models["gemma3"])


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize("qtype, tol", [(T.F32, 1e-4), (T.Q8_0, 0.15)], ids=["F32", "Q8_0"])
def test_gguf_matches_the_hf_folder(qtype, tol, models, tmp_path):
    folder = models["gemma3"]
    path = write_gguf_from_hf(folder, tmp_path / "gemma3.gguf", "gemma3", qtype,
                              tokenizer=tokenizer_metadata(folder, eos="<end_of_turn>"), chat_template=GEMMA_TEMPLATE)
    gguf_engine = engine_for(path, True)
    assert gguf_engine.runner.model.fused.why_not is None
    hf_cfg, gguf_cfg = engine_for(folder, False).runner.model.config, gguf_engine.runner.model.config
    for key in ("layer_windows", "hidden_act", "sandwich_norms", "embed_scale", "local_rope_theta", "rope_theta",
                "tie_word_embeddings", "attention_scale"):
        assert getattr(gguf_cfg, key) == getattr(hf_cfg, key), key
    assert gguf_cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert not gguf_cfg.norm_zero_centred   # the file holds 1 + w
    ref = step_logits(engine_for(folder, False), PROMPT, FORCED[:16])
    err = (step_logits(gguf_engine, PROMPT, FORCED[:16]) - ref).abs().max().item()
    assert err <= tol, f"{qtype.name}: max abs err {err}"


def test_gguf_layer_pattern_and_27b_scale_as_llama_cpp(models, tmp_path):
    """attention.sliding_window_pattern as an n or a per-layer array; no window: every layer global; the 27B's
    attention scale (hidden / heads) ** -0.5 from its 62 layers."""
    from nanochat.models.families.gemma3 import gemma3_attention_scale
    from nanochat.models.formats.gguf_source import GGUFSource
    from tests.gguf_writer import MetaValue, VT

    folder = models["gemma3"]
    meta = tokenizer_metadata(folder, eos="<end_of_turn>")

    def windows(**extra):
        path = write_gguf_from_hf(folder, tmp_path / "p.gguf", "gemma3", tokenizer=meta, extra_metadata=extra)
        return GGUFSource(path).config.layer_windows

    key = "gemma3.attention.sliding_window_pattern"
    assert windows() == (WINDOW,) * 5 + (0,)
    assert windows(**{key: MetaValue(3, VT.UINT32)}) == (WINDOW, WINDOW, 0) * 2
    flags = [True, False, True, True, False, False]
    assert windows(**{key: MetaValue(flags, VT.ARRAY, VT.BOOL)}) == tuple(WINDOW if f else 0 for f in flags)
    assert gemma3_attention_scale(62, 5376, 32, 128) == 168 ** -0.5   # Gemma 3 27B: query_pre_attn_scalar 168
    assert gemma3_attention_scale(34, 2560, 8, 256) == 256 ** -0.5


def test_embeddings_of_a_windowed_model_match_transformers(models, oracle):
    """An input several windows long, prefilled in chunks while the windowed group gives back what falls behind:
    every position's final hidden state still reaches the mean, and the last one is transformers' last."""
    from nanochat.engine.pooling import PoolingParams

    ids = [(7 * i) % 300 + 3 for i in range(5 * WINDOW)]
    with torch.no_grad():
        h = oracle("gemma3").model(torch.tensor([ids])).last_hidden_state[0].double()
    llm = LLM(str(models["gemma3"]), dtype="float32", max_model_len=512, max_num_batched_tokens=WINDOW + 3)
    for pooling, ref in (("mean", h.mean(0)), ("last", h[-1])):
        got = torch.tensor(llm.embed(ids, PoolingParams(pooling))[0].embedding, dtype=torch.float64)
        assert float((got - ref / ref.norm()).abs().max()) < 2e-4, pooling
    assert llm.engine.block_manager.stats().used == 0
