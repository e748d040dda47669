"""gpt-oss: a tiny random GptOssForCausalLM (transformers) is the oracle. Its checkpoint as transformers saves it
(experts transposed, gate|up interleaved, fp32) and as published (MXFP4 expert blocks and scales), and the same
model as GGUF files (F32; MXFP4 experts with Q8_0 linears) written as llama.cpp's converter writes them: logits,
greedy tokens through the engine (batched, preempted, chunked, prefix-cached, a multi-turn chat) past the
sliding window, with sinks, biases, YaRN and the clamped SwiGLU all away from their neutral values."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from nanochat.engine import LLM, SamplingParams
from nanochat.kernels import gguf_quants as gq
from nanochat.models.formats.hf_source import HFSource
from nanochat.models.families.gpt_oss import mxfp4_rows
from tests.conftest import TINY, build_tokenizer, save_tiny
from tests.gguf_writer import T, write_gguf_from_hf
from tests.test_families import (assert_chat_turns_replay, engine_for, oracle_greedy, oracle_logits, step_logits,
                                 tokenizer_metadata)

WINDOW = 12
PROMPT = list(range(5, 25))
FORCED = [(7 * i + 3) % 300 for i in range(24)]   # decode steps well past the window
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# MXFP4 experts run on the host kernels with int8 activations (one level): their error, of max |logit|.
HOST_TOL = 0.15


def make_gpt_oss(out_dir: Path, seed: int = 0) -> Path:
    """A tiny random 4-layer gpt-oss: windowed and full layers alternating, 4 experts (top 2), YaRN past a
    32-token original context; every weight random, sinks and biases included."""
    import transformers

    tok = build_tokenizer(320)
    cfg = transformers.GptOssConfig(
        **{**TINY, "num_hidden_layers": 4, "intermediate_size": 64}, vocab_size=320, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, tie_word_embeddings=False, bos_token_id=None,
        pad_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"),
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            elif "router" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif "experts" in name:   # large enough that the SwiGLU's clamp at 7 bites
                p.copy_((0.5 if "gate_up" in name else 0.1) * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return save_tiny(model, tok, out_dir)


def mxfp4_checkpoint(folder: Path, out_dir: Path) -> Path:
    """`folder` as published: experts quantized to MXFP4 (blocks [E, out, in / 32, 16], scales [E, out, in / 32],
    rows gate|up interleaved), everything else as is; quantization_config says mxfp4."""
    out_dir.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    tensors = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = t.transpose(1, 2).contiguous()            # [E, out, in]
            e, out, inp = rows.shape
            blocks = gguf.quants.quantize(rows.reshape(-1, inp).numpy(), T.MXFP4).reshape(e, out, inp // 32, 17)
            tensors[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))
            qs = torch.from_numpy(np.ascontiguousarray(blocks[..., 1:]))
            values = torch.cat((qs & 0x0F, qs >> 4), dim=-1)   # the 32 values of each block, in order
            tensors[name + "_blocks"] = (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous()
        else:
            tensors[name] = t
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.layers.*.mlp.router"]}
    (out_dir / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / f).write_bytes((folder / f).read_bytes())
    return out_dir


def dequantized_oracle(hf, folder: Path):
    """The transformers model with its experts replaced by the MXFP4 checkpoint's values (what it holds)."""
    src = HFSource(folder)
    cfg = src.config
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            x = f"model.layers.{i}.mlp.experts"
            for e in range(cfg.num_experts):
                gate, up, down = (gq.dequantize(src.get(f"{x}.{e}.{p}_proj.weight"), torch.float32)
                                  for p in ("gate", "up", "down"))
                gate_up = torch.stack((gate, up), dim=1).reshape(-1, gate.shape[1])   # interleaved rows
                layer.mlp.experts.gate_up_proj[e].copy_(gate_up.t())
                layer.mlp.experts.down_proj[e].copy_(down.t())
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt_oss")
    hf = make_gpt_oss(root / "hf")
    return {"hf": hf, "mxfp4": mxfp4_checkpoint(hf, root / "mxfp4")}


@pytest.fixture(scope="module")
def oracle(models):
    import transformers

    cache = {}

    def get(kind: str = "hf"):
        if kind not in cache:
            hf = transformers.AutoModelForCausalLM.from_pretrained(models["hf"], dtype=torch.float32).eval()
            cache[kind] = dequantized_oracle(hf, models["mxfp4"]) if kind == "mxfp4" else hf
        return cache[kind]
    return get


# ---------------------------------------------------------------- config and tensors


def test_config_from_the_hf_folder(models):
    cfg = HFSource(models["hf"]).config
    assert cfg.arch == "gpt_oss" and cfg.layer_windows == (WINDOW, 0, WINDOW, 0)
    assert cfg.attention_sinks and cfg.attention_bias and cfg.moe_router == "topk_softmax"
    assert cfg.expert_act == "swiglu_oai" and (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert cfg.num_experts == 4 and cfg.moe_intermediate_size == 64 and cfg.num_experts_per_tok == 2
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False


def test_yarn_tables_equal_transformers(models, oracle):
    from nanochat.models.layers.common import rope_tables

    cfg = HFSource(models["hf"]).config
    cos, sin = oracle().model.rotary_emb(torch.zeros(1, 256, 16), torch.arange(256)[None])
    ours = rope_tables(cfg, cfg.rotary_dim, 256)
    assert torch.equal(ours[0], cos[0]) and torch.equal(ours[1], sin[0])


def test_the_checkpoints_experts_are_served_in_the_gguf_layout(models):
    """Per-expert [out, in] weights from both checkpoint layouts: the transposed, interleaved fp32 ones exactly;
    MXFP4 as GGUF block_mxfp4 rows (17 bytes per 32 values) whose values are the checkpoint's."""
    plain, mx = HFSource(models["hf"]), HFSource(models["mxfp4"])
    gate_up = plain._stored("model.layers.1.mlp.experts.gate_up_proj")
    assert torch.equal(plain.get("model.layers.1.mlp.experts.2.up_proj.weight"), gate_up[2, :, 1::2].t())
    assert "model.layers.1.mlp.experts.gate_up_proj" not in plain.tensor_names()
    w = mx.get("model.layers.1.mlp.experts.2.up_proj.weight")
    assert w.ggml_type == gq.MXFP4 and w.shape == (64, 64) and w.data.shape == (64, 2 * 17)
    ref = gguf.quants.dequantize(gguf.quants.quantize(gate_up[2, :, 1::2].t().contiguous().numpy(), T.MXFP4), T.MXFP4)
    assert np.array_equal(gq.dequantize(w, torch.float32).numpy(), ref)
    assert plain.get("model.layers.3.mlp.gate.bias").shape == (4,)
    assert plain.get("model.layers.3.mlp.experts.gate_proj.bias").shape == (4, 64)
    assert plain.get("model.layers.0.self_attn.sinks.weight").shape == (4,)


def test_mxfp4_repack_puts_value_j_and_j_plus_16_in_one_byte():
    blocks = torch.tensor([[[(2 * j + 1) % 16 << 4 | (2 * j) % 16 for j in range(16)]]], dtype=torch.uint8)
    scales = torch.tensor([[127]], dtype=torch.uint8)
    row = mxfp4_rows(blocks, scales)[0]
    values = list(range(16)) * 2    # value i of the block is i % 16
    assert row[0] == 127 and all(row[1 + j] == values[j] | values[j + 16] << 4 for j in range(16))


# ---------------------------------------------------------------- numbers


def test_logits_match_transformers(models, oracle):
    """fp32 logits within 1e-4, prompt and decode steps past the window (the module path: MoE layers)."""
    engine = engine_for(models["hf"], False)
    err = (step_logits(engine, PROMPT, FORCED) - oracle_logits(oracle(), PROMPT, FORCED)).abs().max().item()
    assert err <= 1e-4, f"max abs err {err}"


@pytest.mark.parametrize("change", ["sinks", "window", "clamp"])
def test_the_checks_can_fail(change, models, oracle):
    """Each of gpt-oss's own pieces moves the logits: the comparisons above would see it missing."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(models["hf"], dtype=torch.float32).eval()
    if change == "window":
        hf.config.layer_types = ["full_attention"] * len(hf.model.layers)
    for layer in hf.model.layers:
        if change == "sinks":
            layer.self_attn.sinks.data.fill_(-1e4)
        elif change == "window":
            layer.self_attn.sliding_window = None
        else:
            layer.mlp.experts.limit = 1e9
    moved = (oracle_logits(hf, PROMPT, FORCED[:4]) - oracle_logits(oracle(), PROMPT, FORCED[:4])).abs().max().item()
    assert moved > 1e-2, f"{change}: logits moved only {moved}"


def test_greedy_through_the_engine(models, oracle):
    """Batched, one by one (prefix-cached), preempted and in 7-token chunks: transformers' greedy tokens."""
    prompts = [PROMPT, list(range(40, 70)), PROMPT[:5], PROMPT + [9, 9, 9]]
    expected = [oracle_greedy(oracle(), p, GREEDY.max_tokens) for p in prompts]
    path = str(models["hf"])
    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype="float32")
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected
    small = LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype="float32", num_kvcache_blocks=6,
                max_num_batched_tokens=7)
    assert [r.token_ids for r in small.generate(prompts, GREEDY)] == expected


def test_chat_session_turns_equal_a_fresh_replay(models):
    assert_chat_turns_replay(models["hf"])


def test_mxfp4_checkpoint_matches_its_values(models, oracle):
    """The published layout, experts on the host kernels (MXFP4 rows as they lie, int8 activations)."""
    engine = engine_for(models["mxfp4"], False)
    moe = engine.runner.model.layers[0].mlp
    assert moe.offloaded and moe.experts.host.gate.ggml_type == gq.MXFP4
    ours = step_logits(engine, PROMPT, FORCED[:8])
    ref = oracle_logits(oracle("mxfp4"), PROMPT, FORCED[:8])
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err <= HOST_TOL, f"relative err {err}"
    plain = oracle_logits(oracle(), PROMPT, FORCED[:8])
    assert (plain - ref).abs().max().item() > 1e-3    # MXFP4 rounding is visible: the oracle is the right one


@pytest.mark.parametrize("linears, experts, tol", [(T.F32, T.F32, 1e-4), (T.Q8_0, T.MXFP4, HOST_TOL)],
                         ids=["F32", "Q8_0-MXFP4"])
def test_gguf_matches_the_hf_folder(linears, experts, tol, models, oracle, tmp_path):
    # llama.cpp always rounds YaRN's correction range out (truncate); the reference folder says so too.
    folder = tmp_path / "truncated"
    folder.mkdir()
    for f in models["hf"].iterdir():
        (folder / f.name).symlink_to(f)
    cfg = json.loads((models["hf"] / "config.json").read_text())
    cfg["rope_parameters"]["truncate"] = True
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(cfg))
    path = write_gguf_from_hf(folder, tmp_path / "gpt-oss.gguf", "gpt-oss", linears, expert_qtype=experts,
                              tokenizer=tokenizer_metadata(folder))
    engine = engine_for(path, False)
    cfg = engine.runner.model.config
    assert cfg.layer_windows == (WINDOW, 0, WINDOW, 0) and cfg.attention_sinks and cfg.expert_act == "swiglu_oai"
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is True   # llama.cpp's rule
    if experts == T.MXFP4:   # the reference holds the same MXFP4 experts: the published checkpoint's layout
        folder = mxfp4_checkpoint(folder, tmp_path / "truncated-mxfp4")
    ref = step_logits(engine_for(folder, False), PROMPT, FORCED[:8])
    err = (step_logits(engine, PROMPT, FORCED[:8]) - ref).abs().max().item()
    if experts == T.MXFP4:
        err /= ref.abs().max().item()
    assert err <= tol, f"{linears.name}/{experts.name}: err {err}"


# ---------------------------------------------------------------- harmony, end to end

# What the hand-set model below answers to any short message: its analysis, then its final answer.
ANALYSIS, ANSWER = "Let me think~", "Hello!"
REPLY_TOKENS = ["<|channel|>", "analysis", "<|message|>", "Let", " me", " think", "~", "<|end|>", "<|start|>",
                "assistant", "<|channel|>", "final", "<|message|>", "Hello", "!", "<|return|>"]


def make_harmony_gpt_oss(out_dir: Path) -> Path:
    """A tiny gpt-oss with a harmony tokenizer and gpt-oss's own chat template whose weights are set by hand so
    that it answers every short message `<|channel|>analysis<|message|>Let me think~<|end|><|start|>assistant
    <|channel|>final<|message|>Hello!<|return|>`: each token predicts the next through the embeddings and the
    head (a bigram table), and the two places where the next token depends on more than the current one (which
    channel follows <|channel|>, which text follows <|message|>) are decided by the windowed layer's attention:
    the query of <|channel|> finds a "~" in its window, that of <|message|> a "final" (q/k on the slowest RoPE
    dimensions, the sink soaking up the attention of every other query)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from nanochat.models.text.harmony import TOKENS

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    words = [*(t for t in REPLY_TOKENS if not t.startswith("<|")), "Let me think~", "Hello!", "user", "system",
             "developer", "commentary", "Reasoning: low medium high"]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<|endoftext|>", *TOKENS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(words * 50, trainer)
    def one_id(text: str) -> int:
        found = backend.encode(text, add_special_tokens=False).ids
        assert len(found) == 1, f"{text!r} is not one token of the trained vocabulary"
        return found[0]

    token_id = {t: one_id(t) for t in REPLY_TOKENS}
    V, H = backend.get_vocab_size(), 64
    cfg = transformers.GptOssConfig(
        **{**TINY, "num_hidden_layers": 2, "intermediate_size": 64}, vocab_size=V, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False, bos_token_id=None, pad_token_id=None,
        eos_token_id=[backend.token_to_id("<|return|>"), backend.token_to_id("<|call|>")])
    model = transformers.GptOssForCausalLM(cfg).float()
    dim = {t: i for i, t in enumerate(dict.fromkeys(REPLY_TOKENS))}   # a hidden dimension per distinct token
    TILDE_SEEN, FINAL_SEEN = 60, 61
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in [model.model.norm] + [m for layer in model.model.layers
                                          for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for t, d in dim.items():
            emb[token_id[t], d] = 1.0
        first_next = {}
        for cur, nxt in zip(REPLY_TOKENS, REPLY_TOKENS[1:]):
            first_next.setdefault(cur, nxt)   # the second <|channel|> / <|message|> go by the attention
        for cur, nxt in first_next.items():
            head[token_id[nxt], dim[cur]] = 10.0
        head[token_id["<|channel|>"], dim["assistant"]] = 10.0   # the generation prompt's last token
        head[token_id["final"], TILDE_SEEN] = 40.0
        head[token_id["Hello"], FINAL_SEEN] = 40.0
        attn = model.model.layers[0].self_attn   # windowed; q heads 0-1 read KV head 0, 2-3 KV head 1
        hd = 16
        for q_head, kv, query, key, out in ((0, 0, "<|channel|>", "~", TILDE_SEEN),
                                            (2, 1, "<|message|>", "final", FINAL_SEEN)):
            slow = hd // 2 - 1   # the slowest-turning RoPE pair: (7, 15)
            attn.q_proj.weight[q_head * hd + slow, dim[query]] = 30.0
            attn.k_proj.weight[kv * hd + slow, dim[key]] = 1.0
            attn.v_proj.weight[kv * hd, dim[key]] = 1.0
            attn.o_proj.weight[out, q_head * hd] = 3.0
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(8.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    backend.save(str(out_dir / "tokenizer.json"))
    template = (Path(__file__).parent / "data" / "gpt_oss_chat_template.jinja").read_text(encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "eos_token": "<|return|>", "bos_token": None, "pad_token": "<|endoftext|>",
        "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out_dir


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory) -> Path:
    return make_harmony_gpt_oss(tmp_path_factory.mktemp("harmony") / "model")


def test_the_hand_set_model_answers_in_harmony_as_transformers_does(harmony_model):
    """Its greedy reply is the designed one through transformers and through the engine (which stops at
    <|return|>, not at the analysis' <|end|>)."""
    import transformers
    from nanochat.engine import LLMEngine

    engine = LLMEngine(str(harmony_model), dtype="float32", max_model_len=1024, kv_cache_dtype="float32")
    tok = engine.tokenizer
    end, ret = tok.token_to_id("<|end|>"), tok.token_to_id("<|return|>")
    assert ret in engine.loaded.eos_token_ids and end not in engine.loaded.eos_token_ids
    prompt = engine.loaded.chat_template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(harmony_model, dtype=torch.float32).eval()
    expected = oracle_greedy(hf, ids, len(REPLY_TOKENS))
    assert tok.decode(expected, skip_special_tokens=False) == "".join(REPLY_TOKENS)
    llm = LLM(str(harmony_model), dtype="float32", max_model_len=1024, kv_cache_dtype="float32")
    (out,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=40))
    assert out.token_ids == expected   # stopped at <|return|>, its last token


def test_harmony_turns_reuse_kv_up_to_where_the_template_rewrites_history(harmony_model):
    """Turn 2 reuses the KV of turn 1 up to the reply's <|channel|> (the template drops an answered turn's
    analysis), and prefills the rest; another reasoning effort rewrites the system message, so turn 3 reuses
    only what comes before the effort's word. Every reply is still the designed one, split into its thinking and
    its answer."""
    from nanochat.engine import LLMEngine
    from nanochat.engine.serve.session import ChatSession
    from nanochat.models.text.harmony import split_harmony
    from test_chat_session import run_turn

    engine = LLMEngine(str(harmony_model), dtype="float32", max_model_len=1024, kv_cache_dtype="float32")
    session = ChatSession(engine.tokenizer, engine.loaded.chat_template)
    sp = SamplingParams(temperature=0, max_tokens=40)

    def turn(user: str, **variables):
        before = list(session.token_ids)
        ids, gen, final = run_turn(engine, session, user, sp, variables)
        split = split_harmony(engine.tokenizer.decode(gen, skip_special_tokens=False))
        assert (split.reasoning, split.answer) == (ANALYSIS, ANSWER)
        return before, ids, gen, final.stats

    _, first, reply, stats = turn("Hi")
    assert stats.cached_tokens == 0
    _, ids, _, stats = turn("Hi again")
    shared = next(i for i, (a, b) in enumerate(zip(first + reply, ids)) if a != b)
    assert shared == len(first) + 1                  # the reply's <|channel|>; its analysis is gone
    assert stats.cached_tokens == shared
    text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert "Reasoning: medium" in text and ANALYSIS not in text and ANSWER in text
    before, ids, _, stats = turn("And again", reasoning_effort="high")
    text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert "Reasoning: high" in text and "Reasoning: medium" not in text
    effort_at = len(engine.tokenizer.encode(text[:text.index("Reasoning: high") + len("Reasoning:")],
                                            add_special_tokens=False))   # " high" is the next token
    assert ids[:effort_at] == before[:effort_at] and ids[effort_at] != before[effort_at]
    assert stats.cached_tokens <= effort_at
    engine.release_session(session.session_id)


def test_serve_returns_the_final_channel_as_content_and_the_analysis_as_reasoning(harmony_model):
    """nanochat serve through the openai SDK, whole and streamed; reasoning_effort reaches the template and a value
    the template does not take is a 400."""
    openai = pytest.importorskip("openai")
    from nanochat.engine.serve.client import EngineClient
    from test_serve import KEY, MODEL, Server

    client = EngineClient()
    client.load_model(str(harmony_model), dtype="float32", max_model_len=1024)
    server = Server(client)
    try:
        sdk = server.sdk()
        messages = [{"role": "user", "content": "Hi"}]
        whole = sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
        message = whole.choices[0].message
        assert message.content == ANSWER and message.model_extra["reasoning_content"] == ANALYSIS
        assert whole.choices[0].finish_reason == "stop"
        chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                                  stream=True, stream_options={"include_usage": True},
                                                  reasoning_effort="high"))
        # the same message again, but its system message says "Reasoning: high": the prefix cache serves the
        # prompt only up to there
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens < whole.usage.prompt_tokens - 40
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == ANSWER
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == ANALYSIS
        with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
            sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, reasoning_effort="extreme")
        # a forced call: the analysis as reasoning, then the call as a commentary message, streamed too
        tools = [{"type": "function", "function": {"name": "get_time", "description": "The time.", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
            "additionalProperties": False}}}]
        for stream in (False, True):
            kw = dict(model=MODEL, messages=messages, temperature=0, max_tokens=80, tools=tools,
                      tool_choice={"type": "function", "function": {"name": "get_time"}})
            if stream:
                deltas = [c.choices[0].delta for c in sdk.chat.completions.create(**kw, stream=True) if c.choices]
                content = "".join(d.content or "" for d in deltas)
                reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
                calls = [t.function for d in deltas for t in d.tool_calls or []]
            else:
                message = sdk.chat.completions.create(**kw).choices[0].message
                content, reasoning = message.content, message.model_extra["reasoning_content"]
                calls = [t.function for t in message.tool_calls or []]
            assert not content and reasoning == ANALYSIS and [c.name for c in calls] == ["get_time"], (content, calls)
            assert json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")
        # the Responses API: the analysis is a reasoning item, the final channel the message; reasoning.effort
        # reaches the template; a forced call follows the analysis as a function_call item
        whole = sdk.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=40)
        assert [o.type for o in whole.output] == ["reasoning", "message"] and whole.status == "completed"
        assert whole.output[0].content[0].text == ANALYSIS and whole.output_text == ANSWER
        low = sdk.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=40,
                                   reasoning={"effort": "low"})
        assert low.reasoning.effort == "low" and low.output_text == ANSWER
        assert low.usage.input_tokens_details.cached_tokens < whole.usage.input_tokens - 40
        called = sdk.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=80,
                                      tools=[{"type": "function", **tools[0]["function"]}],
                                      tool_choice={"type": "function", "name": "get_time"})
        assert [o.type for o in called.output] == ["reasoning", "function_call"]
        assert called.output[1].name == "get_time" and called.output[0].content[0].text == ANALYSIS
        # Anthropic's Messages API: the analysis is a thinking block, the final channel the text, a forced call a
        # tool_use block after the thinking
        anthropic = pytest.importorskip("anthropic")
        claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
        message = claude.messages.create(model=MODEL, messages=messages, max_tokens=40, extra_body={"temperature": 0})
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == \
            [("thinking", ANALYSIS), ("text", ANSWER)] and message.stop_reason == "end_turn"
        used = claude.messages.create(model=MODEL, messages=messages, max_tokens=80, extra_body={"temperature": 0},
                                      tools=[{"name": "get_time", "description": "The time.",
                                              "input_schema": tools[0]["function"]["parameters"]}],
                                      tool_choice={"type": "tool", "name": "get_time"})
        assert [b.type for b in used.content] == ["thinking", "tool_use"] and used.stop_reason == "tool_use"
        assert used.content[1].name == "get_time" and used.content[1].input["zone"] in ("UTC", "CET")
    finally:
        server.stop()
        client.shutdown()
