"""Seeded GGUF mutations (header, metadata, tensor infos, data offsets) through the model loader.

Each mutated file goes through what `nanochat` does before the first token: models.loader.load (the
GGUF source with its validation, the tokenizer, the chat template) then build_model on the CPU (every
tensor handed to the kernels' packing) and one render of the chat template. The assertion, per case:

- a clean error: a ValueError (ModelLoadError, GGUFError, ChatTemplateError) whose message is one line
  naming the file; never another exception type (a "traceback");
- no hang (a per-case time limit);
- success only where the mutation left a consistent file (tests/fuzz/gguf_mutations.py's oracle):
  an inconsistent shape, type, offset, count or hyper-parameter must be refused.

The default run is a few hundred cases; `-m slow` runs thousands more, with other seeds.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from pathlib import Path

import gguf
import pytest
import torch

from timed import call_with_timeout
from gguf_mutations import Case, Model, Mutator, parse, serialize, tail_case
from gguf_writer import MetaValue, write_gguf_from_hf
from nanochat.models.text.tokenizer import bytes_to_unicode

T = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
CASE_SECONDS = 30.0          # a case slower than this is a hang
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            vocab_size=257, intermediate_size=64, rms_norm_eps=1e-5, max_position_embeddings=128,
            rope_theta=10000.0, bos_token_id=1, eos_token_id=2)


def _state(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """A random state dict in HF naming for llama / qwen3 (qk norms) of config `cfg`."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, base=0.0):
        return base + 0.1 * torch.randn(*shape, generator=g)

    h, hd, i, v = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    state = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": rand(h, base=1.0)}
    if not cfg.get("tie_word_embeddings"):
        state["lm_head.weight"] = rand(v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}"
        state.update({
            f"{p}.input_layernorm.weight": rand(h, base=1.0), f"{p}.post_attention_layernorm.weight": rand(h, base=1.0),
            f"{p}.self_attn.q_proj.weight": rand(q, h), f"{p}.self_attn.k_proj.weight": rand(kv, h),
            f"{p}.self_attn.v_proj.weight": rand(kv, h), f"{p}.self_attn.o_proj.weight": rand(h, q),
            f"{p}.mlp.gate_proj.weight": rand(i, h), f"{p}.mlp.up_proj.weight": rand(i, h),
            f"{p}.mlp.down_proj.weight": rand(h, i)})
        if cfg.get("qk_norm"):
            state[f"{p}.self_attn.q_norm.weight"] = rand(hd, base=1.0)
            state[f"{p}.self_attn.k_norm.weight"] = rand(hd, base=1.0)
        if cfg.get("num_experts"):   # routed experts instead of the dense MLP
            e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            for proj in ("gate", "up", "down"):
                del state[f"{p}.mlp.{proj}_proj.weight"]
            state[f"{p}.mlp.gate.weight"] = rand(e, h)
            for x in range(e):
                state.update({f"{p}.mlp.experts.{x}.gate_proj.weight": rand(mi, h),
                              f"{p}.mlp.experts.{x}.up_proj.weight": rand(mi, h),
                              f"{p}.mlp.experts.{x}.down_proj.weight": rand(h, mi)})
    return state


BASES = {   # name -> (gguf arch, weight type, config)
    "qwen3-f32": ("qwen3", T.F32, dict(TINY, qk_norm=True)),
    "llama-q8_0-tied": ("llama", T.Q8_0, dict(TINY, tie_word_embeddings=True)),
    "qwen3moe-q8_0": ("qwen3moe", T.Q8_0, dict(TINY, qk_norm=True, intermediate_size=0, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
}


def _tokenizer(cfg: dict) -> dict[str, MetaValue]:
    """A byte-level BPE vocabulary: the 256 byte tokens and one merge ("a b" -> "ab")."""
    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["ab"]
    assert len(tokens) == cfg["vocab_size"]
    return {"tokenizer.ggml.model": MetaValue("gpt2", VT.STRING),
            "tokenizer.ggml.pre": MetaValue("default", VT.STRING),
            "tokenizer.ggml.tokens": MetaValue(tokens, VT.ARRAY, VT.STRING),
            "tokenizer.ggml.token_type": MetaValue([1] * len(tokens), VT.ARRAY, VT.INT32),
            "tokenizer.ggml.merges": MetaValue(["a b"], VT.ARRAY, VT.STRING),
            "tokenizer.ggml.bos_token_id": MetaValue(cfg["bos_token_id"], VT.UINT32),
            "tokenizer.ggml.eos_token_id": MetaValue(cfg["eos_token_id"], VT.UINT32)}


def write_base(name: str, folder: Path) -> tuple[Path, Model]:
    arch, qtype, cfg = BASES[name]
    path = write_gguf_from_hf((_state(cfg, seed=len(name)), cfg), folder / f"{name}.gguf", arch, qtype,
                              chat_template=CHATML, tokenizer=_tokenizer(cfg))
    shape_keys = tuple(f"{arch}.{k}" for k in ("block_count", "embedding_length", "feed_forward_length",
                                               "attention.head_count", "attention.head_count_kv",
                                               "attention.key_length", "attention.value_length", "vocab_size",
                                               "expert_count", "expert_feed_forward_length", "rope.dimension_count"))
    ranges = {f"{arch}.expert_used_count": (1, cfg.get("num_experts", 0))}
    return path, Model(arch, cfg["vocab_size"], shape_keys, ranges)


def load_and_build(path: Path) -> None:
    """What the app does with a model file before the first token."""
    from nanochat.models.formats.loader import build_model, load

    loaded = load(str(path))
    build_model(loaded.source, torch.device("cpu"), torch.float32, block_size=16, max_positions=64)
    loaded.chat_template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)


def run_case(path: Path, seconds: float = CASE_SECONDS) -> tuple[str, str]:
    """("accepted" | "clean" | "traceback" | "hang", detail)."""
    def load_quietly():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_and_build(path)

    kind, err = call_with_timeout(load_quietly, seconds)
    if kind == "hang":
        return "hang", f"still running after {seconds:g} s"
    if kind == "done":
        return "accepted", ""
    message = str(err)
    if isinstance(err, ValueError) and "\n" not in message and str(path) in message:
        return "clean", message
    return "traceback", f"{type(err).__name__}: {message[:300]}"


class Tally:
    def __init__(self):
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self.seconds = 0.0
        self.slowest: list[tuple[float, str]] = []

    def add(self, case: Case, outcome: str, detail: str) -> None:
        self.counts["cases"] += 1
        self.counts[outcome] += 1
        if outcome == "accepted":
            self.counts["accepted (consistent)" if case.expect == "either" else "accepted INCONSISTENT"] += 1
            if case.expect == "fail":
                self.problems.append(f"accepted an inconsistent file: {case.what}")
        elif outcome != "clean":
            self.problems.append(f"{outcome}: {case.what}: {detail}")

    def table(self, title: str) -> str:
        c = self.counts
        rows = [("cases", c["cases"]), ("clean errors", c["clean"]), ("tracebacks", c["traceback"]),
                ("hangs", c["hang"]), ("accepted, consistent", c["accepted (consistent)"]),
                ("accepted, inconsistent", c["accepted INCONSISTENT"])]
        width = max(len(r[0]) for r in rows)
        lines = [f"{title} ({self.seconds:.1f} s)"] + [f"  {name:<{width}}  {n:>5}" for name, n in rows]
        slow = sorted(self.slowest, reverse=True)[:3]
        lines.append("  slowest: " + "; ".join(f"{what[:50]} {sec:.2f} s" for sec, what in slow))
        return "\n".join(lines)


def fuzz(base_name: str, folder: Path, seed: int, n_cases: int) -> Tally:
    quiet = logging.getLogger("nanochat.models.text.tokenizer")   # "unknown pre-tokenizer" warnings, by design
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return _fuzz(base_name, folder, seed, n_cases)
    finally:
        quiet.setLevel(level)


def _fuzz(base_name: str, folder: Path, seed: int, n_cases: int) -> Tally:
    base_path, model = write_base(base_name, folder)
    assert run_case(base_path) == ("accepted", ""), "the unmutated base file must load"
    base = parse(base_path)
    mutator = Mutator(base, model, seed)
    cases = [mutator.next() for _ in range(n_cases)]
    cases += [tail_case(base, b"\0" * n) for n in (1, 32, 4096)]
    tally = Tally()
    start = time.perf_counter()
    for n, case in enumerate(cases):
        path = folder / f"case{seed}_{n}.gguf"
        path.write_bytes(case.content())
        t0 = time.perf_counter()
        outcome, detail = run_case(path)
        tally.slowest.append((time.perf_counter() - t0, case.what))
        tally.add(case, outcome, detail)
        path.unlink()   # unlinking a file that is still mapped is fine; rewriting it in place is not
    tally.seconds = time.perf_counter() - start
    return tally


def _check(tally: Tally, title: str) -> None:
    print("\n" + tally.table(title))
    assert not tally.problems, "\n".join(tally.problems[:20])


@pytest.mark.parametrize("base_name,seed,n_cases", [("qwen3-f32", 0, 600), ("llama-q8_0-tied", 1, 300),
                                                     ("qwen3moe-q8_0", 2, 300)])
def test_gguf_mutations(tmp_path, base_name, seed, n_cases):
    _check(fuzz(base_name, tmp_path, seed, n_cases), f"GGUF fuzz: {base_name}, seed {seed}")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12, 13])
@pytest.mark.parametrize("base_name", sorted(BASES))
def test_gguf_mutations_deep(tmp_path, base_name, seed):
    _check(fuzz(base_name, tmp_path, seed, 5000), f"GGUF fuzz (deep): {base_name}, seed {seed}")


def test_serialize_round_trips(tmp_path):
    """The mutator's writer reproduces the base file byte for byte (so mutations change only what they say)."""
    path, _ = write_base("qwen3-f32", tmp_path)
    assert serialize(parse(path)) == path.read_bytes()
