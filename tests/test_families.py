"""The dense families beyond Llama/Qwen: SmolLM3 (NoPE layers), Mistral-style sliding windows, Phi-3 /
Phi-4-mini (fused qkv / gate_up, LongRoPE, partial rotary, sliding window). Tiny random transformers models
are the oracle: logits on the fused CPU step and on the module path, greedy tokens through the engine
(batched, preempted, chunked, prefix-cached, a multi-turn chat), and the same checkpoints as GGUF files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from nanochat.engine import LLM, LLMEngine, SamplingParams
from nanochat.kernels import cpu_qgemv
from nanochat.models.errors import ModelLoadError
from tests.conftest import TINY, build_tokenizer, save_tiny
from tests.gguf_writer import T, MetaValue, VT, write_gguf_from_hf

WINDOW = 12          # the tiny models' sliding window: the prompts below are longer
ORIGINAL_CONTEXT = 32  # Phi-3's LongRoPE switches to its long factors from this position on
PROMPT = list(range(5, 25))
FORCED = [(7 * i + 3) % 300 for i in range(40)]   # decode steps past the window and past ORIGINAL_CONTEXT
FAMILIES = ["smollm3", "mistral", "phi3", "phi4mini"]
GGUF_ARCH = {"smollm3": "smollm3", "mistral": "llama", "phi3": "phi3", "phi4mini": "phi3"}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def make_family_model(family: str, out_dir: Path, seed: int = 0) -> Path:
    """A tiny random 4-layer model of `family`, norms randomised too, with the suite's tokenizer."""
    import transformers

    tok = build_tokenizer(320)
    kw = dict(TINY, num_hidden_layers=4, vocab_size=320, tie_word_embeddings=False, bos_token_id=None,
              pad_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"))
    rnd = random.Random(seed)
    if family == "smollm3":   # the real model's rule: every fourth layer without RoPE
        cfg = transformers.SmolLM3Config(**kw, rope_theta=50000.0, no_rope_layers=[1, 1, 1, 0])
        cls = transformers.SmolLM3ForCausalLM
    elif family == "mistral":
        cfg = transformers.MistralConfig(**kw, rope_theta=50000.0, sliding_window=WINDOW)
        cls = transformers.MistralForCausalLM
    else:   # Phi-3 with a window; Phi-4-mini: 3/4 of the head rotated, no window
        partial = 0.5 if family == "phi3" else 0.75
        half = int(TINY["head_dim"] * partial) // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                "short_factor": [1.0 + 0.5 * rnd.random() for _ in range(half)],
                "long_factor": [2.0 + 4.0 * rnd.random() for _ in range(half)]}
        kw.pop("head_dim")
        cfg = transformers.Phi3Config(**{**kw, "max_position_embeddings": 256}, partial_rotary_factor=partial,
                                      original_max_position_embeddings=ORIGINAL_CONTEXT, rope_parameters=rope,
                                      sliding_window=WINDOW if family == "phi3" else None)
        cls = transformers.Phi3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return save_tiny(model, tok, out_dir)


def tokenizer_metadata(folder: Path, eos: str = "<|im_end|>") -> dict:
    """The folder's byte-level BPE tokenizer as llama.cpp's gpt2 tokenizer keys (as its converter writes them)."""
    import gguf

    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    vocab.update(specials)
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    types = [int(gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL) for t in tokens]
    return {"tokenizer.ggml.model": MetaValue("gpt2", VT.STRING), "tokenizer.ggml.pre": MetaValue("default", VT.STRING),
            "tokenizer.ggml.tokens": MetaValue(tokens, VT.ARRAY, VT.STRING),
            "tokenizer.ggml.token_type": MetaValue(types, VT.ARRAY, VT.INT32),
            "tokenizer.ggml.merges": MetaValue(merges, VT.ARRAY, VT.STRING),
            "tokenizer.ggml.eos_token_id": MetaValue(vocab[eos], VT.UINT32)}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: make_family_model(f, root / f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def oracle(family_models):
    import transformers

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = transformers.AutoModelForCausalLM.from_pretrained(family_models[family],
                                                                              dtype=torch.float32).eval()
        return cache[family]
    return get


def engine_for(path, fused: bool, **kw) -> LLMEngine:
    """fp32 weights and KV cache; fused: the compiled CPU step, else the module forward (dense weights on the
    kernels' exact F32 tiles either way)."""
    kw = {"max_model_len": 256, "num_kvcache_blocks": 64, "kv_cache_dtype": "float32", **kw}
    return LLMEngine(str(path), dtype="float32", fused_forward=fused, **kw)


def step_logits(engine: LLMEngine, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """The engine's last-row logits after the prompt and after each forced token."""
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=len(forced) + 1, ignore_eos=True))
    out = []
    for token in [*forced, None]:
        chunks = engine.scheduler.schedule()
        logits = engine.runner.run(chunks).logits
        out.append(logits[0].clone())
        if token is not None:
            chunks[0].seq.num_computed_tokens = chunks[0].end
            chunks[0].seq.append_token(token)
    return torch.stack(out)


def oracle_logits(hf, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """transformers' logits, the prompt in one forward then one token per forward on its cache (LongRoPE
    picks its factors per forward by the last position: per token here, as nanochat does)."""
    out = []
    with torch.no_grad():
        res = hf(torch.tensor([prompt]), use_cache=True)
        out.append(res.logits[0, -1])
        for token in forced:
            res = hf(torch.tensor([[token]]), past_key_values=res.past_key_values, use_cache=True)
            out.append(res.logits[0, -1])
    return torch.stack(out)


def oracle_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, one forward per token on its cache. (generate() would do the same but for
    Phi-3, whose generate recomputes the whole cache with the long factors when a sequence first passes
    original_max_position_embeddings; nanochat keeps per-position factors, see models/layers.rope_tables.)"""
    out = []
    with torch.no_grad():
        res = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            out.append(int(res.logits[0, -1].argmax()))
            res = hf(torch.tensor([[out[-1]]]), past_key_values=res.past_key_values, use_cache=True)
    return out


# ---------------------------------------------------------------- config


def test_per_layer_config(family_models):
    from nanochat.models.formats.hf_source import HFSource

    smol, mistral, phi3, phi4 = (HFSource(family_models[f]).config for f in FAMILIES)
    assert smol.layer_rope == (True, True, True, False) and smol.layer_windows == (0, 0, 0, 0)
    assert mistral.layer_windows == (WINDOW,) * 4 and all(mistral.layer_rope)
    assert phi3.layer_windows == (WINDOW,) * 4 and phi3.rotary_dim == 8
    assert phi4.layer_windows == (0,) * 4 and phi4.rotary_dim == 12
    scaling = phi3.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == ORIGINAL_CONTEXT
    # transformers' default attention factor: sqrt(1 + ln(256 / 32) / ln(32))
    assert scaling["attention_factor"] == pytest.approx((1 + torch.log(torch.tensor(8.0)).item()
                                                         / torch.log(torch.tensor(32.0)).item()) ** 0.5)


def test_windows_from_config_json_as_transformers_reads_them():
    from nanochat.models.families import registry

    base = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)

    def windows(model_type, **cfg):
        return registry.hf_config({**base, "model_type": model_type, **cfg}).layer_windows

    assert windows("smollm3", use_sliding_window=True, sliding_window=8) == (0, 0, 0, 8)   # on its NoPE layers
    assert windows("smollm3", sliding_window=8) == (0,) * 4
    assert windows("qwen2", use_sliding_window=False, sliding_window=8) == (0,) * 4
    assert windows("qwen2", sliding_window=8, layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2) \
        == (0, 0, 8, 8)
    assert windows("llama", sliding_window=8) == (0,) * 4        # transformers' Llama has no window
    assert windows("mistral", sliding_window=8) == (8,) * 4


@pytest.mark.parametrize("change, message", [
    ({"no_rope_layers": [1, 0]}, "no_rope_layers must list one 0/1 flag per layer"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0]}},
     "short_factor needs"),
])
def test_bad_config_is_one_line(family_models, tmp_path, change, message):
    family = "smollm3" if "no_rope_layers" in change else "phi3"
    assert_refused(family_models[family], tmp_path, change, message)


def assert_refused(model: Path, tmp_path: Path, change: dict, message: str) -> None:
    """A copy of `model` with `change` in its config.json is refused in one line matching `message`."""
    import shutil

    from nanochat.models.formats.hf_source import HFSource

    folder = tmp_path / model.name
    shutil.copytree(model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message) as e:
        HFSource(folder)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- logits


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "module"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, fused, family_models, oracle):
    assert_logits_match(family_models[family], oracle(family), fused)


def assert_logits_match(model: Path, hf, fused: bool) -> None:
    """fp32 logits over PROMPT and FORCED within 1e-4 of the transformers model `hf`, on the path asked for."""
    if fused and not cpu_qgemv.available():
        pytest.skip("the CPU kernels cannot be built here")
    engine = engine_for(model, fused)
    assert (engine.runner.model.fused.why_not is None) == fused
    err = (step_logits(engine, PROMPT, FORCED) - oracle_logits(hf, PROMPT, FORCED)).abs().max().item()
    assert err <= 1e-4, f"{model.name}: max abs err {err}"


def test_the_window_changes_the_result(family_models, oracle):
    """The checks above can fail: the same weights without the window give other logits."""
    ref = oracle_logits(oracle("mistral"), PROMPT, FORCED[:4])
    hf = oracle("mistral")
    hf.config.sliding_window = None
    try:
        full = oracle_logits(hf, PROMPT, FORCED[:4])
    finally:
        hf.config.sliding_window = WINDOW
    assert (ref - full).abs().max().item() > 1e-2


# ---------------------------------------------------------------- engine


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_through_the_engine(family, family_models, oracle):
    """Batched, one by one, preempted (a KV budget too small for the batch), chunked prefill and prefix-cached
    runs all give transformers' greedy tokens."""
    prompts = [PROMPT, list(range(40, 70)), PROMPT[:5], PROMPT + [9, 9, 9]]
    expected = [oracle_greedy(oracle(family), p, GREEDY.max_tokens) for p in prompts]
    path = str(family_models[family])
    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype="float32")
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == expected
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected   # prefix-cached
    small = LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype="float32", num_kvcache_blocks=6,
                max_num_batched_tokens=7)   # preemption and 7-token chunks
    assert [r.token_ids for r in small.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("family", ["smollm3", "phi3"])
def test_chat_session_turns_equal_a_fresh_replay(family, family_models):
    assert_chat_turns_replay(family_models[family])


def assert_chat_turns_replay(model: Path) -> None:
    """Three chat-session turns (each prefilling only its new message) give the tokens a fresh engine gives
    for the same ids."""
    from nanochat.engine.serve.session import ChatSession

    engine = LLMEngine(str(model), dtype="float32", max_model_len=256, kv_cache_dtype="float32")
    fresh = LLMEngine(str(model), dtype="float32", max_model_len=256, kv_cache_dtype="float32",
                      enable_prefix_caching=False)
    session = ChatSession(engine.tokenizer, engine.loaded.chat_template, system_prompt="Be brief.")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for user in ["hello there, how are you?", "what is the capital of France?", "tell me more"]:
        ids = session.prepare_turn(user)
        rid = engine.add_request(ids, sp, session_id=session.session_id)
        text, gen = [], []
        while engine.has_unfinished():
            for ev in engine.step():
                if ev.request_id == rid:
                    text.append(ev.text)
                    gen.append(ev.token_id)
        session.complete_turn("".join(text), gen)
        rid = fresh.add_request(ids, sp)
        replay = []
        while fresh.has_unfinished():
            replay += [ev.token_id for ev in fresh.step() if ev.request_id == rid]
        assert replay == gen
    engine.release_session(session.session_id)


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize("qtype, tol", [(T.F32, 1e-4), (T.Q8_0, 0.15)], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_matches_the_hf_folder(family, qtype, tol, family_models, tmp_path):
    folder = family_models[family]
    path = write_gguf_from_hf(folder, tmp_path / f"{family}.gguf", GGUF_ARCH[family], qtype,
                              tokenizer=tokenizer_metadata(folder))
    gguf_engine = engine_for(path, True)
    assert gguf_engine.runner.model.fused.why_not is None
    hf_cfg, gguf_cfg = engine_for(folder, False).runner.model.config, gguf_engine.runner.model.config
    assert (gguf_cfg.layer_windows, gguf_cfg.layer_rope, gguf_cfg.rotary_dim) == \
        (hf_cfg.layer_windows, hf_cfg.layer_rope, hf_cfg.rotary_dim)
    ref = step_logits(engine_for(folder, False), PROMPT, FORCED[:16])
    err = (step_logits(gguf_engine, PROMPT, FORCED[:16]) - ref).abs().max().item()
    assert err <= tol, f"{family} {qtype.name}: max abs err {err}"


def test_phi3_gguf_weight_map_builds_what_the_loader_builds(family_models, tmp_path):
    """Phi-3's fused attn_qkv and ffn_up (gate|up) are listed as the Llama tensors they hold, with their own
    shapes, and the map's targets equal the loaded model's parameters."""
    from nanochat.models.formats.loader import build_model, open_source
    from nanochat.models.formats.weight_map import apply_plan, build_plan, engine_param_name

    folder = family_models["phi3"]
    source = open_source(str(write_gguf_from_hf(folder, tmp_path / "phi3.gguf", "phi3", T.Q8_0,
                                                tokenizer=tokenizer_metadata(folder))))
    plan = build_plan(source)
    up = plan["tensors"]["model.layers.0.mlp.up_proj.weight"]
    assert up == {"shape": [TINY["intermediate_size"], TINY["hidden_size"]], "dtype": "Q8_0"}
    built = apply_plan(plan, source, dequantize=True, dtype=torch.float32)
    model = build_model(source, torch.device("cpu"), torch.float32, 16, 64, dequantize=True)
    params = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    assert {engine_param_name(t) for t in built} == set(params)
    for target, tensor in built.items():
        assert torch.equal(tensor, params[engine_param_name(target)]), target


# ---------------------------------------------------------------- attention kernels


def _paged_batch(seqs: list[tuple[int, int]], block_size: int = 16, heads: int = 4, kv_heads: int = 2, d: int = 64,
                 seed: int = 0):
    """Random q rows and fp32 caches; per sequence (context length, rows in this step), scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n, _ in seqs]
    blocks = torch.randperm(sum(need) + 3, generator=g)[:sum(need)].tolist()
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    at = 0
    for b, k in enumerate(need):
        tables[b, :k] = torch.tensor(blocks[at:at + k])
        at += k
    cache = (sum(need) + 3, block_size, kv_heads, d)
    k_cache, v_cache = torch.randn(cache, generator=g), torch.randn(cache, generator=g)
    rows = sum(r for _, r in seqs)
    q = torch.randn(rows, heads, d, generator=g)
    cu = torch.tensor([0] + [sum(r for _, r in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    lens = torch.tensor([n for n, _ in seqs], dtype=torch.int32)
    return q, k_cache, v_cache, cu, lens, tables


def _reference(q, k_cache, v_cache, cu, lens, tables, scale, window):
    """float64 softmax over each row's keys p - window + 1 .. p (transformers' sliding-window mask)."""
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, ctx in enumerate(lens.tolist()):
        lo, hi = cu[b].item(), cu[b + 1].item()
        slots = [tables[b, p // bs].item() * bs + p % bs for p in range(ctx)]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), k) * scale
        pos = torch.arange(hi - lo).unsqueeze(1) + ctx - (hi - lo)
        keys = torch.arange(ctx).unsqueeze(0)
        s = s.masked_fill((keys > pos) | (keys <= pos - window), float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


SEQS = [(300, 1), (700, 37), (40, 40), (5, 1), (260, 130)]


@pytest.mark.parametrize("window", [1, 12, 128, 200, 1000])
def test_cpu_attention_window_matches_reference(window):
    from nanochat.kernels import attention as torch_attn
    from nanochat.kernels import cpu_decoder

    if not cpu_qgemv.available():
        pytest.skip("the CPU kernels cannot be built here")
    q, kc, vc, cu, lens, tables = _paged_batch(SEQS)
    ref = _reference(q, kc, vc, cu, lens, tables, 0.125, window)
    fused = cpu_decoder.paged_attention(q, kc, vc, cu, lens, tables, 0.125, window)
    fallback = torch_attn.paged_attention(q, kc, vc, cu, lens, tables, 0.125, window=window)
    assert (fused.double() - ref).abs().max().item() < 1e-5
    assert (fallback.double() - ref).abs().max().item() < 1e-5


def test_cpu_attention_window_rows_are_batch_invariant():
    """A windowed row's output is the same bits alone (decode), inside a prefill chunk, and beside others."""
    from nanochat.kernels import cpu_decoder

    if not cpu_qgemv.available():
        pytest.skip("the CPU kernels cannot be built here")
    q, kc, vc, cu, lens, tables = _paged_batch([(700, 300)])
    window = 150
    whole = cpu_decoder.paged_attention(q, kc, vc, cu, lens, tables, 0.125, window)
    for last in (0, 1, 137, 299):   # row `last` alone, as the last row of its sequence
        ctx = 400 + last + 1
        one = cpu_decoder.paged_attention(q[last:last + 1], kc, vc, torch.tensor([0, 1], dtype=torch.int32),
                                          torch.tensor([ctx], dtype=torch.int32), tables, 0.125, window)
        assert torch.equal(one[0], whole[last])
    chunk = cpu_decoder.paged_attention(q[100:200], kc, vc, torch.tensor([0, 100], dtype=torch.int32),
                                        torch.tensor([600], dtype=torch.int32), tables, 0.125, window)
    assert torch.equal(chunk, whole[100:200])
