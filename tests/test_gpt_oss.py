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
