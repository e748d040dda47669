"""Qwen3-MoE / Qwen3-Next / Qwen3.5-MoE as GGUF files (arches qwen3moe, qwen3next, qwen35moe), written by
tests/gguf_writer.py with llama.cpp's converter transforms, loaded by nanochat.

(a) dequantized path vs transformers: F32 files vs the original HF model; quantized experts (Q8_0,
    packed Q4_K / Q5_K / Q6_K) and Q8_0 attention vs the HF model holding the same values (weights
    put through gguf-py's quantize/dequantize, or the packed blocks dequantized by gguf-py).
    Tolerance 2e-4 on logits (fp32, different op order).
(b) offloaded experts (host int8 kernels) vs the dequantized on-device path: each MoE layer's routed
    output, on the hidden states it really sees, within 5e-4 relative (two roundings of the activations
    to the kernels' two-level grid: measured 4.5-4.8e-5); the torch host path within 1e-5; whole-model
    logits within 1e-3 relative rms (measured 1.5-3.8e-5); every token the offloaded model picks greedily
    within NEAR_ARGMAX = 0.1 of the reference's best logit at that step, teacher-forced on the offloaded
    path (measured: 0; 8 random tokens score a gap of 2.3-3.7).
(c) the engine with moe_offload="cpu": batched greedy generation (each output near-greedy for the
    reference model), chat sessions that resume their cached KV + GDN state.

Why not exact greedy equality: rounding to the activation grid is discontinuous, so a float difference
of 1e-7 (a different batch shape in a dense matmul) can move an activation by one step; a change of an
MoE layer's output can swap a near-tied top-k expert, and later layers amplify it, while tiny random
models have top-2 margins of ~0.1. A token that is garbage (or from another sequence) sits ~2 below the
best logit.
The tiny models also use milder, fan-in scaled random weights than tests/test_moe_models.py, whose
sharp routers make this amplification far stronger.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from conftest import CHATML, build_tokenizer
from gguf_writer import _tile_heads, write_gguf_from_hf
from kquant_pack import quantize_k
from nanochat.engine import LLM, LLMEngine, SamplingParams
from nanochat.engine.serve.session import ChatSession
from nanochat.kernels import moe_cpu
from nanochat.kernels.moe_cpu import HostExperts
from nanochat.kernels.qweight import QuantWeight
from nanochat.models.formats.gguf_source import GGUFSource
from nanochat.models.formats.loader import build_model
from nanochat.models.layers.moe import HostOffloadedExperts, SparseMoeBlock, has_host_experts
from test_moe_engine import run_turn
from test_moe_models import BASE, GDN, MOE, VOCAB, Runner, _save_tokenizer

transformers = pytest.importorskip("transformers")

T = gguf.GGMLQuantizationType
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe", "qwen3_5": "qwen35"}
ATOL = 2e-4
LAYER_TOL = 5e-4
LOGIT_RMS = 1e-3
NEAR_ARGMAX = 0.1
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(20, 61)), [11, 12, 13]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# (arch, wide, attention/GDN type, expert types (gate, up, down)); wide = hidden 256 and expert dim 256
# for the K-quants, and head_v_dim 32 so Qwen3.5's ssm_out columns move as whole Q8_0 blocks.
QUANT_CASES = {
    "qwen35moe-q8_0": ("qwen3_5_moe", False, T.F32, (T.Q8_0,) * 3),
    "qwen3moe-q8_0-attn-q8_0": ("qwen3_moe", False, T.Q8_0, (T.Q8_0,) * 3),
    "qwen35moe-q4k-q6k-attn-q8_0": ("qwen3_5_moe", True, T.Q8_0, (T.Q4_K, T.Q4_K, T.Q6_K)),
    "qwen3next-q4k-q5k": ("qwen3_next", True, T.F32, (T.Q4_K, T.Q4_K, T.Q5_K)),
}


# ----------------------------------------------------------------------------- fixtures


def _hf_model(arch: str, wide: bool, seed: int):
    import transformers as tf

    base, moe, gdn = dict(BASE), dict(MOE), dict(GDN)
    if wide:
        base["hidden_size"] = 256
        moe["moe_intermediate_size"] = 256
        gdn.update(linear_key_head_dim=16, linear_value_head_dim=32)
    if arch == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **base, **moe, num_hidden_layers=3, intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
            rope_theta=5000.0))
    elif arch == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            **base, **moe, **gdn, num_hidden_layers=4, intermediate_size=48, shared_expert_intermediate_size=40,
            mlp_only_layers=[2], partial_rotary_factor=0.5, rope_theta=5000.0))
    elif arch == "qwen3_5_moe":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(
            **base, **moe, **gdn, num_hidden_layers=4, shared_expert_intermediate_size=40,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25}))
    else:  # qwen3_5: dense MLPs, attention every 2nd layer
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(
            **base, **gdn, num_hidden_layers=4, intermediate_size=48,
            layer_types=["linear_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}))
    model = model.float().eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * torch.randn_like(p))
            elif "conv1d" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(0.08 * torch.randn_like(p))
            else:   # fan-in scaled, so the wide variants behave like the narrow ones
                scale = 1.6 if name.endswith("mlp.gate.weight") else 0.64 if "lm_head" in name else 0.4
                p.copy_(scale / p.shape[-1] ** 0.5 * torch.randn_like(p))
    return model


def _roundtrip_q8_0(model) -> None:
    """Put the weights the writer stores as Q8_0 through quantize/dequantize (gguf-py), so the HF model
    holds exactly the file's values (Q8_0 is idempotent; the converter's row / whole-block moves keep it)."""
    keep_f32 = ("mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and not name.endswith(keep_f32) and ".experts." not in name and p.shape[1] % 32 == 0:
                q = gguf.quants.quantize(p.numpy(), T.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, T.Q8_0)))


def _pack(x: np.ndarray, qtype) -> np.ndarray:
    return quantize_k(int(qtype), x) if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else gguf.quants.quantize(x, qtype)


def _quantize_experts(model, types) -> dict:
    """Raw expert blocks per GGUF name (packed in HF layout: the converter only stacks experts), and the
    HF model's experts replaced by gguf-py's dequantization of those blocks."""
    raw = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            inter = experts.gate_up_proj.shape[1] // 2
            views = {"gate": experts.gate_up_proj[:, :inter], "up": experts.gate_up_proj[:, inter:],
                     "down": experts.down_proj}
            for (proj, view), qtype in zip(views.items(), types):
                blocks = _pack(view.numpy().copy(), qtype)
                raw[f"blk.{i}.ffn_{proj}_exps.weight"] = (blocks, qtype)
                view.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    return raw


class Models:
    """GGUF files (and the HF models holding their exact values), built on first use."""

    def __init__(self, root: Path):
        self.root, self.tok, self.cache = root, build_tokenizer(VOCAB), {}

    def _folder(self, key: str) -> Path:
        folder = self.root / key
        folder.mkdir(parents=True, exist_ok=True)
        _save_tokenizer(folder, self.tok)     # tokenizer.json beside the .gguf overrides its byte vocab
        return folder

    def f32(self, arch: str):
        if arch not in self.cache:
            hf = _hf_model(arch, wide=False, seed=len(arch))
            path = write_gguf_from_hf(hf, self._folder(arch) / "model.gguf", GGUF_ARCH[arch], T.F32,
                                      chat_template=CHATML)
            self.cache[arch] = (path, hf)
        return self.cache[arch]

    def quant(self, case: str):
        if case not in self.cache:
            arch, wide, attn, expert_types = QUANT_CASES[case]
            hf = _hf_model(arch, wide, seed=len(case))
            if attn == T.Q8_0:
                _roundtrip_q8_0(hf)
            raw = _quantize_experts(hf, expert_types)
            path = write_gguf_from_hf(hf, self._folder(case) / "model.gguf", GGUF_ARCH[arch], attn,
                                      raw_tensors=raw, chat_template=CHATML)
            self.cache[case] = (path, hf)
        return self.cache[case]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return Models(tmp_path_factory.mktemp("moe_gguf"))


def _build(path, **kw):
    return build_model(GGUFSource(path), torch.device("cpu"), torch.float32, 16, 512, **kw)


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _check_prefill_and_decode(model, hf, what: str, atol: float = ATOL) -> None:
    """A batched prefill of two sequences (one crossing a 64-token GDN chunk), then two batched decode
    steps; every logits row vs one transformers forward over each final sequence."""
    runner = Runner(model)
    g = torch.Generator().manual_seed(1)
    seqs = {0: torch.randint(3, VOCAB, (37,), generator=g).tolist(), 2: torch.randint(3, VOCAB, (70,), generator=g).tolist()}
    rows = {s: [] for s in seqs}
    out = runner.step([(s, toks, len(toks)) for s, toks in seqs.items()])
    for step in range(3):
        for (s, toks), logits in zip(seqs.items(), out):
            rows[s].append(logits)
            toks.append(int(logits[-1].argmax()))
        if step < 2:
            out = runner.step([(s, toks, 1) for s, toks in seqs.items()])
    for s, toks in seqs.items():
        ours = torch.cat(rows[s])
        err = (ours - _hf_logits(hf, toks[:-1])).abs().max().item()
        assert err <= atol, f"{what} seq {s}: max abs err {err}"


def _greedy(model, prompt: list[int], n: int = 8) -> list[int]:
    runner, toks = Runner(model), list(prompt)
    (out,) = runner.step([(0, toks, len(toks))])
    for _ in range(n):
        toks.append(int(out[-1].argmax()))
        (out,) = runner.step([(0, toks, 1)])
    return toks[len(prompt):]


def _argmax_gap(reference, prompt: list[int], generated: list[int]) -> float:
    """Largest gap, over the generated tokens, between the reference model's best logit and the
    logit of the token that was picked (teacher-forced: the reference sees the same prefixes)."""
    toks = prompt + generated
    (logits,) = Runner(reference).step([(0, toks[:-1], len(toks) - 1)])
    rows = logits[len(prompt) - 1:]
    chosen = rows.gather(1, torch.tensor(generated).unsqueeze(1)).squeeze(1)
    return (rows.max(-1).values - chosen).max().item()


# ----------------------------------------------------------------------------- (a) loading, vs transformers


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5"])
def test_f32_gguf_matches_transformers(models, arch):
    path, hf = models.f32(arch)
    src = GGUFSource(path)
    cfg, hcfg = src.config, hf.config
    assert cfg.arch == arch and not cfg.norm_zero_centred
    if arch != "qwen3_5":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 3, 32)
        assert cfg.norm_topk_prob == (arch != "qwen3_moe")
        assert cfg.mlp_only_layers == tuple(getattr(hcfg, "mlp_only_layers", None) or ())
    if arch != "qwen3_moe":
        assert cfg.layer_types == tuple(hcfg.layer_types) and cfg.attn_output_gate
        assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (2, 4, 8, 16, 4)
        assert cfg.rotary_dim == int(16 * (0.25 if arch == "qwen3_5_moe" else 0.5))
        assert cfg.shared_expert_intermediate_size == (0 if arch == "qwen3_5" else 40)
    model = _build(path)
    _check_prefill_and_decode(model, hf, arch)


def test_qwen35moe_tensors_undo_the_converter(models):
    """Every HF tensor comes back exactly (A_log via log(-ssm_a)): value-head order, norms, conv1d."""
    path, hf = models.f32("qwen3_5_moe")
    src = GGUFSource(path)
    state = hf.state_dict()
    for name, ref in state.items():
        if ".experts." in name:
            continue
        got = src.get(name)
        if "norm" in name and not name.endswith("linear_attn.norm.weight"):
            got = got - 1.0                     # GGUF holds 1 + w for the zero-centred norms
        tol = 1e-6 if name.endswith("A_log") or "norm" in name else 0.0   # (w + 1) - 1 rounds
        torch.testing.assert_close(got.reshape(ref.shape).float(), ref.float(), atol=tol, rtol=tol, msg=name)
    # experts: per-expert views of the one 3-D tensor, and the stack itself
    gate_up, down = state["model.layers.0.mlp.experts.gate_up_proj"], state["model.layers.0.mlp.experts.down_proj"]
    assert torch.equal(src.get("model.layers.0.mlp.experts.5.up_proj.weight"), gate_up[5, 32:])
    assert torch.equal(src.get("model.layers.0.mlp.experts.7.down_proj.weight"), down[7])
    stack = src.expert_stack("model.layers.0.mlp.experts", "gate")
    assert stack.shape == (8, 32, 64) and torch.equal(stack.data, gate_up[:, :32])
    assert src.expert_stack("model.layers.0.mlp", "gate") is None


def test_qwen3next_ba_split(models):
    path, hf = models.f32("qwen3_next")
    src = GGUFSource(path)
    ba = hf.state_dict()["model.layers.0.linear_attn.in_proj_ba.weight"].view(2, 2, 2, 64)   # [nk, (b|a), r, H]
    assert torch.equal(src.get("model.layers.0.linear_attn.in_proj_b.weight"), ba[:, 0].reshape(4, 64))
    assert torch.equal(src.get("model.layers.0.linear_attn.in_proj_a.weight"), ba[:, 1].reshape(4, 64))
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" not in src.tensor_names()


def test_qwen35_q8_0_out_proj_blocks_straddle_value_heads(tmp_path):
    """head_v_dim 16 < the 32-element Q8_0 block: ssm_out's tiled input columns cannot move as whole
    blocks, so that tensor is served dequantized; the other Q8_0 linears stay quantized."""
    hf = _hf_model("qwen3_5", wide=False, seed=5)
    _roundtrip_q8_0(hf)
    with torch.no_grad():   # out_proj is quantized in the converter's tiled column order: round-trip it there
        for layer in hf.model.layers:
            if hasattr(layer, "linear_attn"):
                w = layer.linear_attn.out_proj.weight
                tiled = _tile_heads(w.numpy(), 1, 2, 2, 16)
                back = gguf.quants.dequantize(gguf.quants.quantize(tiled, T.Q8_0), T.Q8_0)
                w.copy_(torch.from_numpy(_tile_heads(back, 1, 2, 2, 16)))   # (nk = r = 2: its own inverse)
    path = write_gguf_from_hf(hf, tmp_path / "q.gguf", "qwen35", T.Q8_0)
    src = GGUFSource(path)
    assert isinstance(src.get("model.layers.0.linear_attn.in_proj_qkv.weight"), QuantWeight)
    out_proj = src.get("model.layers.0.linear_attn.out_proj.weight")
    assert isinstance(out_proj, torch.Tensor)
    torch.testing.assert_close(out_proj, hf.state_dict()["model.layers.0.linear_attn.out_proj.weight"])
    _check_prefill_and_decode(_build(path, dequantize=True), hf, "qwen35 q8_0")


def test_nextn_blocks_are_not_decoder_layers(models, tmp_path):
    """llama.cpp appends Qwen3.5's multi-token-prediction block as one more blk.N and says so in
    nextn_predict_layers: it is not a decoder layer and its tensors are not served."""
    path, hf = models.f32("qwen3_5_moe")
    reader = gguf.GGUFReader(path)
    out = tmp_path / "mtp.gguf"
    w = gguf.GGUFWriter(out, "qwen35moe")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = f.contents() + 1 if key == "qwen35moe.block_count" else f.contents()
        w.add_key_value(key, value, f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    w.add_uint32("qwen35moe.nextn_predict_layers", 1)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.add_tensor("blk.4.nextn.eh_proj.weight", np.zeros((64, 128), np.float32))
    w.add_tensor("blk.4.attn_q.weight", np.zeros((128, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = GGUFSource(out)
    assert src.config.num_hidden_layers == 4 and len(src.config.layer_types) == 4
    assert not any(n.startswith("model.layers.4.") for n in src.tensor_names())
    tokens = list(range(30, 50))
    (logits,) = Runner(_build(out)).step([(0, tokens, len(tokens))])
    assert (logits - _hf_logits(hf, tokens)).abs().max().item() <= ATOL


@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_quantized_experts_dequantized_path_matches_transformers(models, case):
    path, hf = models.quant(case)
    src = GGUFSource(path)
    arch, _, attn, types = QUANT_CASES[case]
    assert src.quant_summary() == types[0].name
    w = src.get("model.layers.0.mlp.experts.3.gate_proj.weight")
    stack = src.expert_stack("model.layers.0.mlp.experts", "gate")
    assert isinstance(w, QuantWeight) and w.ggml_type == types[0] and stack.ggml_type == types[0]
    # memory-map views, not copies: the expert's rows sit inside the stack's bytes
    assert w.data.data_ptr() == stack.data.data_ptr() + 3 * stack.data.stride(0)
    if attn == T.Q8_0:
        assert isinstance(src.get("model.layers.3.self_attn.q_proj.weight" if arch != "qwen3_moe"
                                  else "model.layers.0.self_attn.q_proj.weight"), QuantWeight)
    model = _build(path, dequantize=True)
    assert all(not isinstance(m.experts, HostOffloadedExperts) for m in model.modules() if isinstance(m, SparseMoeBlock))
    _check_prefill_and_decode(model, hf, case)


# ----------------------------------------------------------------------------- (b) offload vs on-device


@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_offloaded_experts_match_dequantized(models, case):
    path, _ = models.quant(case)
    on_device = _build(path, dequantize=True)
    # attention / GDN weights dequantized in both: only the experts' path differs
    offload = _build(path, dequantize=True, moe_offload="cpu")
    assert _build(path).layers[0].mlp.offloaded          # "auto" on a CPU device: quantized experts offload
    assert has_host_experts(offload) and not has_host_experts(on_device)
    blocks = [m for m in offload.modules() if isinstance(m, SparseMoeBlock)]
    dev_blocks = [m for m in on_device.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(isinstance(b.experts, HostOffloadedExperts) for b in blocks)
    if moe_cpu.available():
        assert all(b.experts.host.backend == "kernel" for b in blocks)

    # each MoE layer's routed output on the hidden states it really sees
    seen = []
    originals = [b.experts.start for b in blocks]      # the block calls start(), not forward()
    for b, orig in zip(blocks, originals):
        b.experts.start = lambda x, ids, w, orig=orig, store=seen: store.append((x, ids, w)) or orig(x, ids, w)
    tokens = PROMPTS[1]
    (logits,) = Runner(offload).step([(0, tokens, len(tokens))])
    for b, orig in zip(blocks, originals):
        b.experts.start = orig
    assert len(seen) == len(blocks)
    for (x, ids, w), b, d in zip(seen, blocks, dev_blocks):
        got, ref = b.experts(x, ids, w), d.experts(x, ids, w)
        assert ((got - ref).norm() / ref.norm()).item() < LAYER_TOL
        torch_host = HostExperts(b.experts.host.gate, b.experts.host.up, b.experts.host.down, backend="torch")
        torch.testing.assert_close(torch_host(x, ids, w), ref, atol=1e-5, rtol=1e-4)

    (ref_logits,) = Runner(on_device).step([(0, tokens, len(tokens))])
    err = ((logits - ref_logits).pow(2).mean() / ref_logits.pow(2).mean()).sqrt().item()
    assert err < LOGIT_RMS, f"{case}: logits relative rms error {err}"
    for prompt in PROMPTS:
        assert _argmax_gap(on_device, prompt, _greedy(offload, prompt)) <= NEAR_ARGMAX


def test_moe_block_offload_modes(models):
    path, _ = models.quant("qwen35moe-q8_0")
    src = GGUFSource(path)
    assert not _build(path, moe_offload="none").layers[0].mlp.offloaded
    assert not _build(path, dequantize=True).layers[0].mlp.offloaded
    assert _build(path, dequantize=True, moe_offload="cpu").layers[0].mlp.offloaded
    with pytest.raises(ValueError, match="moe_offload"):
        build_model(src, torch.device("cpu"), torch.float32, 16, 512, moe_offload="gpu")
    # dense HF-style experts offloaded too (torch path on the host)
    f32_path, hf = models.f32("qwen3_5_moe")
    model = _build(f32_path, moe_offload="cpu")
    assert model.layers[0].mlp.experts.host.backend == "torch"
    _check_prefill_and_decode(model, hf, "f32 experts on the host")


# ----------------------------------------------------------------------------- (c) through the engine


@pytest.mark.parametrize("case", ["qwen3moe-q8_0-attn-q8_0", "qwen35moe-q4k-q6k-attn-q8_0"])
def test_engine_generation_with_offload(models, case):
    path, _ = models.quant(case)
    llm = LLM(str(path), moe_offload="cpu", dequantize=True, dtype="float32", max_model_len=256, kvcache_block_size=16)
    assert llm.engine.config.moe_offload == "cpu" and has_host_experts(llm.engine.runner.model)
    outputs = llm.generate(PROMPTS, GREEDY)                      # one batch: prefill together, decode together
    reference = _build(path, dequantize=True)
    for prompt, out in zip(PROMPTS, outputs):
        assert len(out.token_ids) == GREEDY.max_tokens and out.finish_reason == "length"
        assert _argmax_gap(reference, prompt, out.token_ids) <= NEAR_ARGMAX


@pytest.mark.parametrize("case", ["qwen35moe-q8_0", "qwen3next-q4k-q5k"])
def test_hybrid_chat_resumes_with_offload(models, case):
    path, _ = models.quant(case)
    engine = LLMEngine(str(path), dtype="float32", max_model_len=512, kvcache_block_size=16, moe_offload="cpu",
                       dequantize=True)
    assert engine.runner.is_hybrid and has_host_experts(engine.runner.model)
    session = ChatSession(engine.tokenizer, engine.loaded.chat_template, system_prompt="sys")
    ids1, gen1, stats1 = run_turn(engine, session, "hello there")
    ids2, gen2, stats2 = run_turn(engine, session, "what is two plus two?")
    assert stats1.cached_tokens == 0 and len(gen1) == len(gen2) == GREEDY.max_tokens
    assert stats2.cached_tokens == len(ids1) + len(gen1) - 1 > 0      # resumed, not replayed
    assert ids2[:len(ids1) + len(gen1)] == ids1 + gen1
    reference = _build(path, dequantize=True)
    assert _argmax_gap(reference, ids2, gen2) <= NEAR_ARGMAX
    engine.release_session(session.session_id)
    engine.block_manager.check_invariants()


def test_moe_offload_config_validation():
    from nanochat.engine.config import Config

    assert Config.create("m").moe_offload == "auto"
    with pytest.raises(ValueError, match="moe_offload"):
        Config.create("m", moe_offload="gpu")
