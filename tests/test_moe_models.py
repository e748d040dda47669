"""Qwen3-MoE and hybrid Qwen3-Next / Qwen3.5(-MoE) models vs transformers on tiny random checkpoints.

Each model is saved as a safetensors folder in its real checkpoint layout (per-expert weights for
Qwen3-MoE / Qwen3-Next; Qwen3.5-MoE as the multimodal wrapper: text_config, `model.language_model.*`,
fused experts, plus vision / MTP tensors to skip), loaded through HFSource + build_model, and run with
hand-built AttnMetadata over a paged KV cache and a state pool allocated here. transformers (fp32, full
recompute of the whole sequence) is the oracle for every logits row.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (the Triton GDN test)

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import CHATML, build_tokenizer
from nanochat.models.layers.attention import AttnMetadata
from nanochat.models.formats.hf_source import HFSource
from nanochat.models.formats.loader import build_model, load
from nanochat.models.layers.moe import Experts, route

VOCAB = 320
BLOCK = 16
ATOL = 1e-4
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None)
MOE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
           linear_conv_kernel_dim=4)


# ----------------------------------------------------------------------------- fixtures


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """All weights random: norms around their base (0 for zero-centred, 1 for plain), routers sharp."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "conv1d" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):   # router: well-separated top-k
                p.copy_(0.6 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))


def _save_tokenizer(out: Path, tok) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
        "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}))


def _build(arch: str, out: Path, tok):
    import transformers as tf

    eos = tok.token_to_id("<|im_end|>")
    if arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**BASE, **MOE, num_hidden_layers=3, intermediate_size=48, norm_topk_prob=False,
                                mlp_only_layers=[1], rope_theta=5000.0, eos_token_id=eos)
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif arch == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**BASE, **MOE, **GDN, num_hidden_layers=4, intermediate_size=48,
                                 shared_expert_intermediate_size=40, mlp_only_layers=[2],
                                 partial_rotary_factor=0.5, rope_theta=5000.0, eos_token_id=eos)
        model = tf.Qwen3NextForCausalLM(cfg)
    elif arch == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeTextConfig(**BASE, **MOE, **GDN, num_hidden_layers=4, shared_expert_intermediate_size=40,
                                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                       "partial_rotary_factor": 0.25,
                                                       "mrope_section": [1, 1, 0], "mrope_interleaved": True},
                                      eos_token_id=eos)
        model = tf.Qwen3_5MoeForCausalLM(cfg)
    elif arch == "qwen3_5":
        cfg = tf.Qwen3_5TextConfig(**BASE, **GDN, num_hidden_layers=4, intermediate_size=48,
                                   layer_types=["linear_attention", "full_attention"] * 2,
                                   rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                    "partial_rotary_factor": 0.5}, eos_token_id=eos)
        model = tf.Qwen3_5ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    model = model.float().eval()
    _randomise(model, seed=len(arch))
    out.mkdir(parents=True, exist_ok=True)
    if arch == "qwen3_5_moe":
        _save_multimodal(model, out)
    else:
        model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(out, tok)
    return model


def _save_multimodal(model, out: Path) -> None:
    """The released Qwen3.5/3.6 layout: wrapper config with text_config, weights under
    model.language_model.*, fused experts, and vision / MTP tensors that we must skip."""
    tensors = {}
    for name, t in model.state_dict().items():
        if name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        tensors[name] = t.contiguous()
    assert any(n.endswith("experts.gate_up_proj") for n in tensors)
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    text = model.config.to_dict()
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False,
        "image_token_id": 1}))


ARCHS = ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    tok = build_tokenizer(VOCAB)
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = (root / arch, _build(arch, root / arch, tok))
        return cache[arch]

    return get


# ----------------------------------------------------------------------------- a tiny hand-made runner


class Runner:
    """Paged KV blocks and state slots per sequence; one forward per step over a ragged batch."""

    def __init__(self, model, num_blocks: int = 64, num_slots: int = 4):
        self.model = model
        cfg = model.config
        shape = (num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
        for layer in model.attention_layers():
            layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
        if model.is_hybrid:
            model.allocate_state(num_slots, torch.device("cpu"))
        self.free_blocks = list(range(num_blocks))[::-1]
        self.tables: dict[int, list[int]] = {}
        self.done: dict[int, int] = {}

    def step(self, work: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """work: (slot, all token ids so far, number of new tokens at the end) -> logits per sequence."""
        ids, pos, slots, cu, ctx, fresh = [], [], [], [0], [], []
        for slot, tokens, n_new in work:
            start = len(tokens) - n_new
            assert self.done.get(slot, 0) == start
            table = self.tables.setdefault(slot, [])
            while len(table) * BLOCK < len(tokens):
                table.append(self.free_blocks.pop())
            ids += tokens[start:]
            pos += range(start, len(tokens))
            slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, len(tokens))]
            cu.append(cu[-1] + n_new)
            ctx.append(len(tokens))
            fresh.append(start == 0)
            self.done[slot] = len(tokens)
        width = max(len(self.tables[s]) for s, _, _ in work)
        meta = AttnMetadata(
            slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            block_tables=torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s, _, _ in work],
                                      dtype=torch.int32),
            max_q_len=max(n for _, _, n in work), max_context_len=max(ctx),
            state_slots=torch.tensor([s for s, _, _ in work]), state_fresh=torch.tensor(fresh))
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(pos), meta))
        return list(logits.split([n for _, _, n in work]))


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def check(ours: torch.Tensor, hf, tokens: list[int], what: str) -> None:
    ref = hf_logits(hf, tokens)[len(tokens) - ours.shape[0]:]
    err = (ours - ref).abs().max().item()
    assert err <= ATOL, f"{what}: max abs err {err}"


def _model(folder: Path):
    return build_model(HFSource(folder), torch.device("cpu"), torch.float32, BLOCK, 512)


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_prefill_and_decode_match_transformers(arch, tiny):
    folder, hf = tiny(arch)
    model = _model(folder)
    assert model.is_hybrid == (arch != "qwen3_moe")
    runner = Runner(model)
    g = torch.Generator().manual_seed(1)
    seqs = {0: torch.randint(3, VOCAB, (37,), generator=g).tolist(),
            2: torch.randint(3, VOCAB, (75,), generator=g).tolist()}   # crosses a 64-token chunk
    out = runner.step([(s, toks, len(toks)) for s, toks in seqs.items()])
    for (s, toks), logits in zip(seqs.items(), out):
        check(logits, hf, toks, f"{arch} prefill seq {s}")
    for i in range(3):
        for (s, toks), logits in zip(seqs.items(), out):
            toks.append(int(logits[-1].argmax()))
        out = runner.step([(s, toks, 1) for s, toks in seqs.items()])
        for (s, toks), logits in zip(seqs.items(), out):
            check(logits, hf, toks, f"{arch} decode {i} seq {s}")


def test_a_bf16_folders_experts_run_on_the_kernels_in_bf16(tiny, tmp_path):
    """A folder's per-expert matrices go to the kernels' dense tiles in the checkpoint's type, as its other
    matrices do (they were widened to an fp32 stack for torch's GEMM): half the memory, rows exact (so speculation
    `auto` proposes), logits those of the same bf16 weights in fp32 maths."""
    import shutil

    import transformers as tf
    from safetensors.torch import load_file

    from nanochat.kernels import cpu_qgemv
    from nanochat.kernels import gguf_quants as gq
    from nanochat.models.layers.common import batch_invariant

    if not cpu_qgemv.available():
        pytest.skip("the CPU kernels cannot be built here")
    folder, _ = tiny("qwen3_moe")
    bf16 = tmp_path / "bf16"
    shutil.copytree(folder, bf16)
    for f in bf16.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(f).items()}, f)
    model = _model(bf16)
    experts = [layer.mlp.experts for layer in model.layers if isinstance(getattr(layer.mlp, "experts", None), Experts)]
    assert len(experts) == 2 and all(e.w13 is None and e.quant is not None for e in experts)
    parts = [p for e in experts for pair in e.quant for lin in pair.values() for p in lin.quant_parts()]
    assert len(parts) == 2 * 2 * MOE["num_experts"]
    assert all(p.ggml_type == gq.BF16 and p.backend == "q8" for p in parts)
    assert batch_invariant(model)
    hf = tf.AutoModelForCausalLM.from_pretrained(bf16, torch_dtype=torch.float32).eval()
    tokens = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    check(Runner(model).step([(0, tokens, len(tokens))])[0], hf, tokens, "bf16 experts")


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_chunked_prefill_carries_state_in_slot(arch, tiny):
    """A prompt split over two steps (the second beside another sequence's decode) == one prefill."""
    folder, hf = tiny(arch)
    runner = Runner(_model(folder))
    g = torch.Generator().manual_seed(2)
    long = torch.randint(3, VOCAB, (90,), generator=g).tolist()
    other = torch.randint(3, VOCAB, (20,), generator=g).tolist()
    first, other_out = runner.step([(1, long[:50], 50), (3, other, 20)])
    check(first, hf, long[:50], f"{arch} chunk 1")
    other.append(int(other_out[-1].argmax()))
    other_next, second = runner.step([(3, other, 1), (1, long, 40)])          # mixed decode + prefill
    check(second, hf, long, f"{arch} chunk 2")
    check(other_next, hf, other, f"{arch} decode beside chunk 2")
    long.append(int(second[-1].argmax()))
    (dec,) = runner.step([(1, long, 1)])
    check(dec, hf, long, f"{arch} decode after chunked prefill")


def test_triton_gdn_path_matches_transformers(tiny):
    """The GPU code path of the GDN layers (Triton kernels, here interpreted) inside the model."""
    pytest.importorskip("triton")
    folder, hf = tiny("qwen3_next")
    model = _model(folder)
    for layer in model.gdn_layers():
        layer.use_triton = True
    runner = Runner(model)
    seqs = {0: list(range(40, 52)), 1: list(range(7, 12))}
    out = runner.step([(s, toks, len(toks)) for s, toks in seqs.items()])
    for (s, toks), logits in zip(seqs.items(), out):
        check(logits, hf, toks, f"triton prefill seq {s}")
        toks.append(int(logits[-1].argmax()))
    out = runner.step([(s, toks, 1) for s, toks in seqs.items()])
    for (s, toks), logits in zip(seqs.items(), out):
        check(logits, hf, toks, f"triton decode seq {s}")


def test_copy_state_snapshot_and_restore(tiny):
    folder, hf = tiny("qwen3_5_moe")
    model = _model(folder)
    runner = Runner(model)
    toks = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    (out,) = runner.step([(0, toks, 30)])
    model.copy_state(0, 3)                                 # snapshot at the end of a "turn"
    toks.append(int(out[-1].argmax()))
    runner.step([(0, toks + [5, 6], 3)])                   # slot 0 moves on (a turn we then discard)
    model.copy_state(3, 0)                                 # restore the snapshot
    runner.done[0] = 30
    (dec,) = runner.step([(0, toks, 1)])
    check(dec, hf, toks, "decode after restore")


def test_state_spec_and_layout(tiny):
    folder, _ = tiny("qwen3_next")
    model = _model(folder)
    cfg = model.config
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert len(model.attention_layers()) == 1 and len(model.gdn_layers()) == 3
    model.allocate_state(5, torch.device("cpu"))
    layer = model.gdn_layers()[0]
    conv_dim = 2 * 2 * 8 + 4 * 16
    assert layer.conv_state.shape == (5, conv_dim, 3) and layer.recurrent_state.shape == (5, 4, 8, 16)
    assert layer.recurrent_state.dtype == torch.float32
    assert model.hybrid_state_spec() == 3 * (conv_dim * 3 * 4 + 4 * 8 * 16 * 4)


def test_missing_state_slots_is_a_clear_error(tiny):
    folder, _ = tiny("qwen3_next")
    model = _model(folder)
    model.allocate_state(1, torch.device("cpu"))
    meta = AttnMetadata(slot_mapping=torch.arange(2), cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
                        context_lens=torch.tensor([2], dtype=torch.int32),
                        block_tables=torch.zeros(1, 1, dtype=torch.int32), max_q_len=2, max_context_len=2)
    with pytest.raises(ValueError, match="state_slots"):
        model(torch.tensor([4, 5]), torch.arange(2), meta)


# ----------------------------------------------------------------------------- loading


def test_multimodal_checkpoint_config_and_names(tiny):
    folder, _ = tiny("qwen3_5_moe")
    src = HFSource(folder)
    cfg = src.config
    assert cfg.arch == "qwen3_5_moe" and cfg.norm_zero_centred and cfg.attn_output_gate
    assert cfg.rotary_dim == 4 and cfg.rope_theta == 5000.0 and cfg.norm_topk_prob
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 3 and cfg.shared_expert_intermediate_size == 40
    names = src.tensor_names()
    assert "model.embed_tokens.weight" in names and "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(n.startswith(("model.language_model.", "model.visual.", "mtp.")) for n in names)
    loaded = load(str(folder))                              # tokenizer, template and eos come along
    assert loaded.config.arch == "qwen3_5_moe"
    assert loaded.tokenizer.token_to_id("<|im_end|>") in loaded.eos_token_ids


def test_qwen3_moe_config(tiny):
    folder, _ = tiny("qwen3_moe")
    cfg = HFSource(folder).config
    assert cfg.arch == "qwen3_moe" and cfg.qk_norm and not cfg.norm_topk_prob and not cfg.norm_zero_centred
    assert cfg.mlp_only_layers == (1,) and not cfg.is_moe_layer(1) and cfg.is_moe_layer(0)
    assert cfg.rope_theta == 5000.0 and cfg.layer_types == ()


# ----------------------------------------------------------------------------- MoE dispatch


def _naive_moe(x, w13, w2, ids, weights):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


class _DenseSource:
    kind = "hf"

    def __init__(self, tensors):
        self.tensors = tensors

    def get(self, name):
        return self.tensors[name]

    def peek(self, name):
        return self.tensors[name].dtype, tuple(self.tensors[name].shape)

    def tensor_names(self):
        return list(self.tensors)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("grouped_mm", [False, True])
def test_moe_dispatch_matches_per_token_loop(fused, grouped_mm):
    from nanochat.models.layers.common import WeightLoader

    if grouped_mm and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not available")
    g = torch.Generator().manual_seed(0)
    E, H, I, T, K = 6, 16, 8, 11, 2
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    if fused:
        tensors = {"e.gate_up_proj": w13, "e.down_proj": w2}
    else:
        tensors = {}
        for e in range(E):
            tensors[f"e.{e}.gate_proj.weight"], tensors[f"e.{e}.up_proj.weight"] = w13[e, :I], w13[e, I:]
            tensors[f"e.{e}.down_proj.weight"] = w2[e]
    # dequantize: torch's dense experts (the dispatch under test; a folder's experts go to the kernels otherwise)
    experts = Experts(WeightLoader(_DenseSource(tensors), torch.device("cpu"), torch.float32, dequantize=True), "e", E)
    experts.use_grouped_mm = grouped_mm
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    logits[3] = 0.0   # a token with tied router scores still gets exactly k distinct experts
    for renorm in (False, True):
        weights, ids = route(logits, K, renorm)
        assert all(len(set(row)) == K for row in ids.tolist())
        got = experts(x, ids, weights)
        ref = _naive_moe(x, w13, w2, ids, weights)
        assert (got - ref).abs().max().item() <= 1e-4
        if renorm:
            torch.testing.assert_close(weights.sum(-1), torch.ones(T))
