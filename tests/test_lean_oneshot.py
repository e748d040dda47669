"""The lean one-shot engine (engine/lean.py): the full engine's tokens without torch, chosen only where it applies.

A full-engine load with the pack cache writes the lean plan; the lean engine then answers through the same client
(EngineClient(lean=True)). Greedy ids must equal the full engine's on the built-in model and on tiny GGUFs of
every family the fused path runs; the sampler's filters must keep what the engine's keep; and a lean one-shot
in a fresh process must never import torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nanochat.kernels import cpu_qgemv

T = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_qgemv.available(), reason="the CPU kernels cannot be built here")
ROOT = Path(__file__).resolve().parents[2]   # the folder holding the `nanochat` package
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """A NANOCHAT_HOME of the test's own: its pack cache (and lean plans) start empty."""
    monkeypatch.setenv("NANOCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _replies(client, model: str, prompts: list[str], **config) -> list[list[int]]:
    from nanochat.engine import SamplingParams

    client.load_model(model, pack_cache=True, **config)
    try:
        sp = SamplingParams(**GREEDY)
        out = [client.submit_turn(client.open_session(), p, sp).result(120).token_ids for p in prompts]
        out.append(client.submit(prompts[0], sp).result(120).token_ids)   # a raw prompt too
        return out
    finally:
        client.shutdown()


def _engine_then_lean(path: str, prompts: list[str], **config) -> tuple[list, list]:
    from nanochat.engine.serve.client import EngineClient

    full = _replies(EngineClient(in_process=True), path, prompts, **config)   # writes the lean plan
    lean = EngineClient(lean=True, lean_sampling=GREEDY)
    ids = _replies(lean, path, prompts, **config)
    assert lean.lean_used, _why_not_lean(path, lean)
    return full, ids


def _why_not_lean(path: str, client) -> str:
    """What a failed lean load left behind (the CI saw one, once, that did not recur)."""
    from nanochat.models.formats import pack_cache
    from nanochat.models.layers.fused_forward import lean_plan_name

    cache = pack_cache.PackCache(path)
    plan = pack_cache.read_arrays(lean_plan_name(cache.key))
    return (f"{client.lean_refused}; pack cache {'missing' if cache.missing else 'present'}, lean plan "
            f"{'absent' if plan is None else plan[0].get('max_positions')}; files: "
            f"{sorted(p.name for p in pack_cache.cache_dir().glob('*'))}")


def _tied(folder: Path, out: Path) -> Path:
    """A copy of an HF folder whose head is tied to the embedding (the lean plan serves packed tied tables)."""
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _family_gguf(family: str, root: Path) -> Path:
    from tests.conftest import make_hf_model
    from tests.gguf_writer import write_gguf_from_hf

    if family in ("llama", "qwen2", "qwen3"):
        src = make_hf_model(family, root / "hf", seed=7, tie=True, vocab_size=320, hidden_size=64,
                            intermediate_size=128)
        arch, meta, template = family, None, None
    elif family == "gemma3":
        from tests.test_gemma3 import GEMMA_TEMPLATE, make_gemma3
        from tests.test_families import tokenizer_metadata
        src = _tied(make_gemma3(root / "g"), root / "hf")
        arch, meta, template = "gemma3", tokenizer_metadata(src, eos="<end_of_turn>"), GEMMA_TEMPLATE
    else:
        from tests.test_families import GGUF_ARCH, make_family_model, tokenizer_metadata
        src = _tied(make_family_model(family, root / "f"), root / "hf")
        arch, meta, template = GGUF_ARCH[family], tokenizer_metadata(src), None
    path = root / "m" / "model.gguf"
    path.parent.mkdir()
    if meta is None:   # the suite's tokenizer.json beside the file
        shutil.copy(src / "tokenizer.json", path.parent / "tokenizer.json")
    kwargs = {"chat_template": template} if template else {}
    if meta is not None:
        kwargs["tokenizer"] = meta
    return write_gguf_from_hf(src, path, arch, T.Q8_0, embed_qtype=T.Q4_1, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma3"])
def test_lean_greedy_equals_the_engine_on_every_fused_family(family, home, tmp_path):
    path = _family_gguf(family, tmp_path)
    full, lean = _engine_then_lean(str(path), ["Hello there", "What is 2 + 2?"])
    assert lean == full
    assert all(len(ids) == GREEDY["max_tokens"] for ids in lean)


def test_lean_greedy_equals_the_engine_on_the_builtin_model(home):
    from nanochat.models.formats.catalog import embedded_model_path

    path = embedded_model_path()
    if path is None:
        pytest.skip("the built-in model is not installed")
    full, lean = _engine_then_lean(str(path), ["Hi", "Name three colours."], max_model_len=1024)
    assert lean == full


def test_lean_applies_only_where_it_can(home, tmp_path):
    from nanochat.engine.lean import plan_for
    from nanochat.engine.serve.client import EngineClient

    path = str(_family_gguf("qwen2", tmp_path))
    base = {"pack_cache": True}                            # the suite's environment turns the cache off
    assert plan_for(path, base) is None                    # no plan yet: the full engine loads it (and writes one)
    _replies(EngineClient(in_process=True), path, ["hi"])
    assert plan_for(path, base) is not None
    assert plan_for(path, {**base, "max_model_len": 64}) is not None
    for config in ({"dtype": "bfloat16"}, {"tensor_parallel_size": 2}, {"fused_forward": False},
                   {"quant_backend": "int4"}, {"dequantize": True}, {"kv_cache_dtype": "bfloat16"},
                   {"pack_cache": False}, {"num_kvcache_blocks": 4}, {"device": "auto"}):
        assert plan_for(path, {**base, **config}) is None, config
    # A seed promises the full engine's tokens (torch's generator): seeded sampling is the full engine's.
    for sampling in ({"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"logprobs": 2},
                     {"temperature": 0.7, "seed": 1}):
        assert plan_for(path, base, sampling) is None, sampling
    assert plan_for(path, base, {"temperature": 0.7, "top_p": 0.9, "top_k": 40}) is not None
    assert plan_for(path, base, {"temperature": 0, "seed": 1}) is not None
    other = tmp_path / "o" / "model.gguf"                  # another file: its own cache key, no plan
    shutil.copytree(Path(path).parent, other.parent)
    assert plan_for(str(other), base) is None
    assert plan_for(str(tmp_path / "missing.gguf"), base) is None
    # A client that may go lean but finds no plan serves the model in the engine process, as before.
    client = EngineClient(lean=True, lean_sampling=GREEDY)
    _replies(client, str(other), ["hi"], max_model_len=128)
    assert not client.lean_used and client.lean_refused.startswith("no lean plan applies")


@pytest.mark.parametrize("kind", ["gguf", "folder"])
def test_a_lean_one_shot_never_imports_torch(home, tmp_path, kind):
    """Two whole one-shots in fresh processes: the first loads the full engine (and keeps the plan), the second
    answers without torch; both print the same JSON (less timings) and the same stats line shape."""
    if kind == "gguf":
        path = str(_family_gguf("llama", tmp_path))
    else:
        from tests.conftest import make_hf_model
        path = str(make_hf_model("llama", tmp_path / "hf", seed=7, tie=True, dtype=torch.bfloat16))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NANOCHAT_HOME": str(home), "NANOCHAT_PACK_CACHE": "1"}
    script = ("import sys\nfrom nanochat.app.cli import main\ncode = main(sys.argv[1:])\n"
              "print('TORCH', 'torch' in sys.modules, 'DECODER', 'nanochat.kernels.cpu_decoder' in sys.modules,"
              " file=sys.stderr)\nsys.exit(code)\n")
    cmd = [sys.executable, "-c", script, "--model", path, "--prompt", "Hello", "--max-tokens", "6", "--temperature",
           "0", "--ignore-eos", "--json"]
    runs = [subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    # the first in the engine process (this process builds no decoder), the second here, without torch
    assert runs[0].stderr.endswith("TORCH False DECODER False\n")
    assert runs[1].stderr.endswith("TORCH False DECODER True\n")
    assert runs[0].stderr.count("\n") == runs[1].stderr.count("\n") == 2   # the stats line, no warnings
    first, second = (json.loads(r.stdout) for r in runs)
    for key in ("ttft_s", "decode_tok_s"):
        first.pop(key), second.pop(key)
    assert first == second and len(second["token_ids"]) == 6
    stats = [next(line for line in r.stderr.splitlines() if line.startswith("[")) for r in runs]
    assert all("6 tok" in s and "max tokens" in s for s in stats)


# ---------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (5, 1.0), (-1, 0.9), (-1, 0.3), (20, 0.8), (-1, 0.999)])
def test_lean_filters_keep_what_the_engine_keeps(top_k, top_p):
    from nanochat.engine import lean, sampler

    rng = np.random.default_rng(3)
    for trial in range(20):
        row = (rng.standard_normal(500) * (1 + trial)).astype(np.float32)
        ref = sampler.candidates(torch.from_numpy(row.copy()), top_k, top_p)
        ids, probs = lean.candidates(row, top_k, top_p)
        assert ids.tolist() == ref[0].tolist()
        np.testing.assert_allclose(probs, ref[1].numpy(), rtol=1e-5, atol=1e-7)
        for u in (0.0, 0.25, 0.5, 0.999):   # the same inverse CDF for the same uniform draw
            cdf = ref[1].double().cumsum(0)
            want = min(int(torch.searchsorted(cdf, torch.tensor(u, dtype=torch.float64) * cdf[-1], right=True)),
                       len(ids) - 1)
            assert lean.draw(probs, u) == want
    assert sampler.candidates(torch.zeros(10), -1, 1.0) is None and lean.candidates(np.zeros(10, np.float32), -1, 1.0) is None


def test_lean_sampling_follows_the_distribution():
    """Many seeded draws at temperature 1 from a small vocabulary: the frequencies match the softmax (chi-square
    at p ~ 1e-6), seeds reproduce, greedy is the argmax."""
    from nanochat.engine import SamplingParams, lean

    row = np.log(np.array([0.5, 0.25, 0.15, 0.1], dtype=np.float32))
    sp = SamplingParams(temperature=1.0, top_p=1.0)
    gen = np.random.default_rng(11)
    n = 20000
    counts = np.bincount([lean.sample(row, sp, gen) for _ in range(n)], minlength=4)
    expected = np.array([0.5, 0.25, 0.15, 0.1]) * n
    assert ((counts - expected) ** 2 / expected).sum() < 30.0      # chi-square, 3 dof
    a = [lean.sample(row, sp, np.random.default_rng(5)) for _ in range(5)]
    assert len(set(a)) == 1
    assert lean.sample(row, SamplingParams(temperature=0.0), None) == 0
    assert {lean.sample(row, SamplingParams(temperature=1.0, top_k=1), gen) for _ in range(50)} == {0}
    top2 = np.bincount([lean.sample(row, SamplingParams(temperature=1.0, top_p=0.6), gen) for _ in range(2000)],
                       minlength=4)
    assert top2[2] == top2[3] == 0 and top2[0] > top2[1] > 0


def test_lean_speculates_on_greedy_replies_and_keeps_the_engines_tokens(home, monkeypatch):
    """Prompt lookup in the lean engine: a reply that copies its prompt gets proposals accepted, and the tokens are
    the full engine's without speculation. (4 proposals whenever a match allows: whether they pay is timing.)"""
    from nanochat.engine import SamplingParams
    from nanochat.engine.speculative import Speculation

    monkeypatch.setattr(Speculation, "choose_k", lambda self, room, ratio, batch=1: min(room, 4))
    from nanochat.engine.serve.client import EngineClient
    from nanochat.models.formats.catalog import embedded_model_path

    path = embedded_model_path()
    if path is None:
        pytest.skip("the built-in model is not installed")
    prompt = ("Reformat this list as a numbered list, one item per line, keeping every item exactly: apples, "
              "bananas, cherries, dates, elderberries, figs, grapes, kiwis, lemons, mangoes.")
    sp = SamplingParams(temperature=0, max_tokens=60)
    results = {}
    for name, client, config in (("full", EngineClient(in_process=True), {"speculative": "off"}),
                                 ("lean", EngineClient(lean=True, lean_sampling=GREEDY), {})):
        client.load_model(str(path), pack_cache=True, max_model_len=1024, **config)
        try:
            results[name] = client.submit_turn(client.open_session(), prompt, sp).result(120)
            if name == "lean":
                assert client.lean_used
        finally:
            client.shutdown()
    assert results["lean"].token_ids == results["full"].token_ids
    stats = results["lean"].stats
    assert stats.spec_accepted > 0 and stats.spec_proposed >= stats.spec_accepted


def test_lean_holds_replies_to_a_schema_and_a_grammar_as_the_engine_does(home):
    """Structured one-shots stay lean: greedy replies held to a JSON schema (prompt lookup verifying against it) and
    to a GBNF grammar are the full engine's tokens; a sampled one follows the grammar; one that cannot be followed is
    the engine's error."""
    import re

    from nanochat.engine import SamplingParams
    from nanochat.engine.lean import sampling_supported
    from nanochat.engine.serve.client import EngineClient
    from nanochat.models.formats.catalog import embedded_model_path

    path = embedded_model_path()
    if path is None:
        pytest.skip("the built-in model is not installed")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "fruits": {"type": "array", "items": {"type": "string"},
                                                          "maxItems": 5}},
              "required": ["name", "fruits"], "additionalProperties": False}
    colours = 'root ::= colour (", " colour){2} "."\ncolour ::= "red" | "green" | "blue" | "yellow"'
    asks = [("Describe Ann, who likes apples, bananas and figs, as JSON.", dict(json_schema=schema)),
            ("Name three colours.", dict(grammar=colours))]
    assert all(sampling_supported({"temperature": 0, **held}) for _, held in asks)
    results = {}
    for name, client, config in (("full", EngineClient(in_process=True), {"speculative": "off"}),
                                 ("lean", EngineClient(lean=True, lean_sampling=GREEDY), {})):
        client.load_model(str(path), pack_cache=True, max_model_len=1024, **config)
        try:
            results[name] = [client.submit_turn(client.open_session(), text,
                                                SamplingParams(temperature=0, max_tokens=120, **held)).result(120)
                             for text, held in asks]
            if name == "lean":
                assert client.lean_used
                sampled = client.submit_turn(client.open_session(), "Colours?", SamplingParams(
                    temperature=1.0, max_tokens=40, grammar=colours)).result(120)
                assert re.fullmatch("(red|green|blue|yellow)(, (red|green|blue|yellow)){2}\\.", sampled.text)
                bad = client.submit_turn(client.open_session(), "x", SamplingParams(grammar="root ::= (")).result(120)
                assert bad.final.finish_reason == "error" and bad.final.error.startswith("grammar cannot be followed")
        finally:
            client.shutdown()
    for lean, full in zip(results["lean"], results["full"]):
        assert lean.token_ids == full.token_ids and lean.final.finish_reason == full.final.finish_reason == "stop"
    assert set(json.loads(results["lean"][0].text)) == {"name", "fruits"}


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_lean_greedy_equals_the_engine_on_a_folder(family, home, tmp_path):
    """A Hugging Face folder (bf16; Phi-3's fused qkv / gate_up) once loaded by the engine: the lean one-shot maps
    its packed tiles and reads its tokenizer and template from the folder."""
    from tests.conftest import make_hf_model

    if family == "qwen3":
        folder = make_hf_model("qwen3", tmp_path / "hf", seed=7, tie=True, dtype=torch.bfloat16)
    else:
        from tests.test_families import make_family_model
        folder = _tied(make_family_model("phi3", tmp_path / "f"), tmp_path / "hf")
    full, lean = _engine_then_lean(str(folder), ["Hello there", "What is 2 + 2?"])
    assert lean == full
    assert all(len(ids) == GREEDY["max_tokens"] for ids in lean)
