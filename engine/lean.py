"""The lean engine: a CPU one-shot on a dense model (a GGUF file or a Hugging Face folder) without torch.

`nanochat --prompt Hi` spent most of its time importing torch (~2 s, ~220 MB) for a model whose every step
runs in the fused CPU decoder's C library anyway. When the full engine has loaded a model once, it keeps the
fused decoder's plan beside the packed weights (models/layers/fused_forward.py, keep_lean_plan). The lean engine
rebuilds that same FusedDecoder over numpy buffers, maps the same packed tiles, embeds and scores with the same
C calls, and builds the tokenizer and chat template from the file (or the folder's files) as the full engine
does; so it produces the full engine's tokens (greedy: the same ids; sampled: the same distribution from another
generator).

It serves one request at a time (a prompt: one prefill chunk per max_num_batched_tokens, then decode) and implements
greedy, temperature, top-k and top-p sampling, stop strings and stop ids, and replies held to a JSON schema or a
grammar (engine/structured.py, on its numpy logits). `plan_for` says whether it applies: a .gguf file or a Hugging
Face folder, a CPU float32 config without tensor parallelism or kernel options it does not run, and a plan that
covers the context. Anything else (and any failure while it loads) goes to the full engine, which also writes the
plan for next time. EngineClient(lean=True) chooses it (engine/serve/client.py); it runs in the client's process, on
the in-process core (LeanCore), behind the same messages as the engine process.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from nanochat.engine.config import Config, launched_rank
from nanochat.engine.output import EngineStats, RequestError, RequestStats, TokenEvent
from nanochat.engine.reply_text import add_token, check_prompt, request_stats, take_delta
from nanochat.engine.sampling_params import SamplingParams
from nanochat.engine.sequence import Sequence
from nanochat.engine.serve.core import EngineCore
from nanochat.engine.speculative import Speculation, SpeculationConfig, StepTimes, accept_greedy
from nanochat.engine.structured import Grammars
from nanochat.models.formats.hf_text import FolderText

FIRST_GUESS = 64   # as engine/sampler.py: candidates fetched first for top-p

# Config values the lean engine runs as the full engine would; any other value is the full engine's.
_FLOAT32 = ("auto", "float32", "fp32")
_KV_DTYPES = {"auto": "float16", "float16": "float16", "fp16": "float16", "half": "float16",
              "float32": "float32", "fp32": "float32"}


@dataclass
class LeanPlan:
    """What plan_for found: the checked config, the plan and its mapped weights."""

    path: str
    config: Config
    meta: dict
    arrays: dict
    weights: dict


def plan_for(model: str, engine_config: dict, sampling: dict | None = None) -> LeanPlan | None:
    """The lean plan for loading `model` with these Config keyword arguments, or None when the lean engine does
    not apply (the full engine loads it). `sampling`: SamplingParams keywords the caller will use; penalties and
    log-probabilities are the full engine's."""
    if sampling and not sampling_supported(sampling):
        return None
    path = Path(os.path.expanduser(model))
    gguf_file = path.suffix.lower() == ".gguf" and path.is_file()
    if not (gguf_file or (path / "config.json").is_file()) or launched_rank() is not None:
        return None
    try:
        config = Config.create(str(path), **engine_config)
    except ValueError:
        return None   # the full engine says what is wrong
    if not _config_supported(config):
        return None
    from nanochat.models.formats import pack_cache
    from nanochat.models.layers.fused_forward import LEAN_PLAN_VERSION, lean_plan_name, lean_plan_weights

    try:
        cache = pack_cache.PackCache(str(path))
    except OSError:
        return None
    kept = pack_cache.read_arrays(lean_plan_name(cache.key))
    if kept is None or cache.missing:
        return None
    meta, arrays = kept
    if meta.get("version") != LEAN_PLAN_VERSION:
        return None
    if not sampling_supported({**meta["stated_sampling"], **(sampling or {})}):   # the file's defaults too
        return None
    config = config.with_model_limits(meta["max_position_embeddings"])
    if meta["max_positions"] < config.max_model_len:   # the RoPE table must cover the context
        return None
    weights = lean_plan_weights(cache, meta)
    return None if weights is None else LeanPlan(str(path), config, meta, arrays, weights)


def sampling_supported(sampling: dict) -> bool:
    """Whether the lean engine serves these SamplingParams keywords' values: no penalties, logit bias or
    log-probabilities, and no seeded sampling (a seed promises the full engine's tokens, drawn from torch's
    generator)."""
    sp = SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    return not sp.penalized and not sp.logit_bias and sp.logprobs is None and (sp.greedy or sp.seed is None)


def _config_supported(c: Config) -> bool:
    default = Config()
    return (c.device == "cpu" and c.dtype in _FLOAT32 and c.kv_cache_dtype in _KV_DTYPES
            and c.speculative in ("auto", "off", "ngram")
            and c.tensor_parallel_size == 1 and not c.dequantize and c.quantize is None
            and c.quant_backend in ("auto", "q8") and c.fused_forward and c.pack_cache
            and c.kv_cache_gib == default.kv_cache_gib and c.num_kvcache_blocks is None)


# ---------------------------------------------------------------------------------- sampling
def candidates(row, top_k: int, top_p: float):
    """engine/sampler.py's `candidates` on a numpy row (float32): (ids, probabilities), most likely first, or
    None when neither filter is on."""
    import numpy as np

    vocab = row.shape[-1]
    top_k = top_k if 0 < top_k < vocab else vocab
    if top_k == vocab and top_p >= 1.0:
        return None

    def top(n: int):
        ids = np.argpartition(-row, n - 1)[:n] if n < vocab else np.arange(vocab)
        ids = ids[np.argsort(-row[ids], kind="stable")]
        return row[ids], ids

    if top_k < vocab:
        logits, ids = top(top_k)
        e = np.exp(logits - logits[0])
        probs = e / e.sum(dtype=np.float32)
    else:
        m = row.max()
        lse = m + np.log(np.exp(row - m).sum(dtype=np.float32))
        n = FIRST_GUESS
        while True:
            logits, ids = top(min(n, vocab))
            probs = np.exp(logits - lse)
            if n >= vocab or float(probs.sum(dtype=np.float32)) >= top_p:
                break
            n *= 8
    if top_p < 1.0:
        keep = max(1, int(((np.cumsum(probs, dtype=np.float32) - probs) < top_p).sum()))
        ids, probs = ids[:keep], probs[:keep]
    return ids, probs / probs.sum(dtype=np.float32)


def draw(probs, u: float) -> int:
    """engine/sampler.py's `draw` with the uniform draw `u` in [0, 1) given: the inverse CDF, in float64."""
    import numpy as np

    cdf = np.cumsum(probs, dtype=np.float64)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), probs.shape[0] - 1)


def sample(row, sp: SamplingParams, rng) -> int:
    """One token from fp32 logits `row` (numpy) as the engine's Sampler picks it (rng: numpy Generator)."""
    import numpy as np

    if sp.greedy:
        return int(np.argmax(row))
    row = (row / np.float32(sp.temperature)).astype(np.float32)
    kept = candidates(row, sp.top_k, sp.top_p)
    if kept is None:
        e = np.exp(row - row.max())
        return draw(e / e.sum(dtype=np.float32), rng.random())
    ids, probs = kept
    return int(ids[draw(probs, rng.random())])


# ---------------------------------------------------------------------------------- engine
@dataclass
class _Loaded:
    tokenizer: object
    chat_template: object
    eos_token_ids: frozenset
    config: object


@dataclass
class _Request:
    request_id: str
    seq: Sequence
    detok: object
    rng: object
    constraint: object = None   # a json_schema or grammar request's state (engine/structured.py)
    text: str = ""
    emitted: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.seq.sampling_params


class _PlanSource:
    """What models/formats/loader.load_tokenizer_and_template reads of a weight source, from the GGUF file and
    the plan (the values the engine's GGUFSource had when it wrote the plan)."""

    kind = "gguf"

    def __init__(self, path: str, meta: dict):
        from nanochat.models.formats.gguf_file import GGUFFile

        self.path, self.meta, self.config = path, meta, _plan_config(meta)
        self.reader = GGUFFile(path)

    def tokenizer(self, cache: bool = False):
        from nanochat.models.text.tokenizer import load_tokenizer
        return load_tokenizer(self.path, self.reader, cache=cache)

    def chat_template(self) -> str | None:
        value = self.reader.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    def chat_template_origin(self) -> str:
        return self.path

    def eos_ids(self) -> tuple[int, ...]:
        return tuple(self.meta["eos_ids"])

    def stated_sampling(self) -> dict:
        return dict(self.meta["stated_sampling"])


def _plan_config(meta: dict):
    """The part of the model's config the tokenizer and template checks read, as the plan keeps it (a lean plan is
    a fused decoder's: never an encoder)."""
    from types import SimpleNamespace

    return SimpleNamespace(vocab_size=meta["vocab_size"], arch=meta["arch"],
                           max_position_embeddings=meta["max_position_embeddings"], encoder=False)


class _FolderPlanSource(FolderText):
    """_PlanSource for a Hugging Face folder: its tokenizer side from the folder's files (as HFSource reads them),
    its end ids from the plan."""

    kind = "hf"

    def __init__(self, path: str, meta: dict):
        self.path, self.root, self.meta, self.config = path, Path(path), meta, _plan_config(meta)

    def eos_ids(self) -> tuple[int, ...]:
        return tuple(self.meta["eos_ids"])


class LeanEngine:
    """The part of LLMEngine's interface the engine core uses (engine/serve/core.py), on the lean plan."""

    device = "cpu"
    dtype = "float32"
    workers = None
    speculative_modes = ("off", "ngram")   # prompt lookup, for greedy requests (accept_greedy)
    # one-shots ask for no embeddings: it has no add_embedding
    pooling, embedding_model, embedding_length = "mean", False, 0
    encoder = False

    def __init__(self, plan: LeanPlan, load_progress=None):
        from nanochat.engine.generation_defaults import card_defaults, sampling_defaults
        from nanochat.kernels import cpu_qgemv
        from nanochat.models.formats.loader import load_tokenizer_and_template

        started = time.perf_counter()
        plan.config.use_cpu_isa()
        if cpu_qgemv.extension() is None:
            raise RuntimeError("the CPU kernels are not available")
        self.plan, self.config = plan, plan.config
        self.threads = self.config.cpu_thread_count()
        self.levels = self.config.act_levels
        source = (_FolderPlanSource if Path(plan.path).is_dir() else _PlanSource)(plan.path, plan.meta)
        with warnings.catch_warnings():   # the engine process's warnings go to its stderr, which no user sees
            warnings.simplefilter("ignore")
            tokenizer, template, eos = load_tokenizer_and_template(source, self.config.pack_cache,
                                                                   self.config.chat_template)
        self.loaded = _Loaded(tokenizer, template, eos, source.config)
        self.tokenizer, self.eos_token_ids = tokenizer, eos
        self.grammars = Grammars(tokenizer, source.config.vocab_size, eos, template.harmony)
        stated = sampling_defaults(source)
        self.card_sampling = {k: v for k, v in card_defaults(source).items() if k not in stated}
        self.sampling_defaults = {**self.card_sampling, **stated}
        self.requests: dict[str, _Request] = {}
        self._queue: list[str] = []
        self.speculation = SpeculationConfig(k_max=self.config.speculative_k)
        self.speculative = "off" if self.config.speculative == "off" else "ngram"
        self.step_times = StepTimes(self.speculation.row_cost)
        self._model = None          # the LeanModel over the current KV caches
        self._blocks = 0            # their size in blocks
        self.total_prefill_tokens = self.total_decode_tokens = 0
        if load_progress is not None:
            load_progress(1, 1)
        self.load_seconds = time.perf_counter() - started

    @property
    def model_config(self):
        return self.loaded.config

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, session_id: str | None = None) -> str:
        import numpy as np

        from nanochat.models.text.tokenizer import IncrementalDetokenizer

        sp = sampling_params or SamplingParams()
        if not sampling_supported({"repetition_penalty": sp.repetition_penalty, "temperature": sp.temperature,
                                   "presence_penalty": sp.presence_penalty, "seed": sp.seed,
                                   "frequency_penalty": sp.frequency_penalty, "logprobs": sp.logprobs}):
            raise RequestError("penalties, log-probabilities and seeded sampling need the full engine")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(ids, self.config.max_model_len, self.loaded.config.vocab_size)
        request_id = request_id or f"req-{len(self.requests)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        try:
            constraint = self.grammars.constraint(sp, ids)
        except ValueError as e:
            raise RequestError(str(e)) from None
        seq = Sequence(ids, sp, session_id=session_id)
        seq.request_id = request_id
        if sp.greedy and self.config.speculative != "off" and sp.speculative in (None, "ngram"):
            seq.spec = Speculation(self.speculation, "ngram")   # greedy verification only (accept_greedy)
        rng = None if sp.greedy else np.random.default_rng()
        self.requests[request_id] = _Request(request_id, seq, IncrementalDetokenizer(self.tokenizer), rng,
                                             constraint)
        self._queue.append(request_id)
        return request_id

    def abort(self, request_id: str) -> TokenEvent | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._queue.remove(request_id)
        return TokenEvent(request_id, None, "", True, "abort", self._request_stats(req, "abort"))

    def has_unfinished(self) -> bool:
        return bool(self._queue)

    def touch_session(self, session_id: str) -> None:
        pass   # one request at a time, nothing kept between them: no resident KV to order

    def release_session(self, session_id: str) -> None:
        pass

    def close(self) -> None:
        self._model = None

    # ------------------------------------------------------------------ step
    def _caches_for(self, tokens: int) -> None:
        """KV caches for `tokens` positions (rounded up to blocks; pages are touched as they are written)."""
        import numpy as np

        from nanochat.models.layers.fused_forward import lean_model

        bs = self.config.kvcache_block_size
        blocks = -(-tokens // bs)
        if self._model is not None and blocks <= self._blocks:
            return
        d = self.plan.meta["dims"]
        dtype = np.dtype(_KV_DTYPES[self.config.kv_cache_dtype])
        shape = (blocks, bs, d["kv_heads"], d["head_dim"])
        k = [np.empty(shape, dtype) for _ in range(d["layers"])]
        v = [np.empty(shape, dtype) for _ in range(d["layers"])]
        self._model = lean_model(self.plan.meta, self.plan.arrays, self.plan.weights, bs, k, v)
        self._blocks = blocks

    def step(self) -> list[TokenEvent]:
        import numpy as np

        from nanochat.kernels import cpu_qgemv

        req = self.requests[self._queue[0]]
        seq, sp = req.seq, req.params
        if seq.num_computed_tokens == 0:
            self._caches_for(min(len(seq) + sp.max_tokens, self.config.max_model_len))
        m = self._model
        start = seq.num_computed_tokens
        end = min(len(seq), start + self.config.max_num_batched_tokens)
        draft = self._draft(seq) if end - start == 1 and start >= seq.num_prompt_tokens else []
        t0 = time.perf_counter()
        ids = np.asarray(seq.token_ids[start:end] + draft, dtype=np.int64)
        end += len(draft)   # the proposals' rows follow the last real token (engine/speculative.py)
        n, hidden = end - start, m.embedding.in_features
        x = np.empty((n, hidden), dtype=np.float32)
        cpu_qgemv.dequantize_rows_raw(m.embedding, ids.ctypes.data, n, x.ctypes.data)
        if m.embed_scale != 1.0:   # as the model's forward: the factor rounded to float32
            x *= np.float32(m.embed_scale)
        positions = np.arange(start, end, dtype=np.int64)
        tables = np.arange(self._blocks, dtype=np.int32)[None, :]   # one sequence: blocks 0.. in order
        m.decoder.forward(x, positions, positions.copy(), np.array([0, n], dtype=np.int32), tables,
                          np.array([end], dtype=np.int32), self.levels, self.threads)
        if end - len(draft) < len(seq):
            seq.num_computed_tokens = end
            self.total_prefill_tokens += n
            return []   # more of the prompt to prefill
        logits = self._logits(m, x[-1 - len(draft):])
        if draft:
            if req.constraint is not None:
                req.constraint.mask_along(logits, draft)
            tokens = accept_greedy(logits.argmax(-1).tolist(), draft)
            seq.spec.record(len(draft), len(tokens) - 1)
        else:
            if req.constraint is not None:
                req.constraint.mask(logits[0])
            tokens = [sample(logits[0], sp, req.rng)]
        now = time.perf_counter()
        if start >= seq.num_prompt_tokens:
            self.total_decode_tokens += len(tokens)
            if seq.spec is not None:
                self.step_times.record(n, now - t0)
        else:
            self.total_prefill_tokens += n
        events = []
        for token in tokens:   # as the engine's _emit: the KV covers every token the sequence holds
            seq.num_computed_tokens = len(seq)
            events.append(self._postprocess(req, token, now))
            if events[-1].finished:
                break
        return events

    def _draft(self, seq: Sequence) -> list[int]:
        """Prompt-lookup proposals for a greedy decode step (the KV caches were sized for the whole reply)."""
        spec = seq.spec
        if spec is None:
            return []
        room = min(self.config.max_model_len - len(seq) - 1,
                   seq.sampling_params.max_tokens - seq.num_completion_tokens - 1,
                   self._blocks * self.config.kvcache_block_size - len(seq))
        return spec.propose_ngram(seq.token_ids, room, lambda k: self.step_times.ratio(1, k))

    def _logits(self, m, hidden):
        """fp32 logits [rows, vocab] of final-normed hidden rows, as the model's compute_logits."""
        import numpy as np

        from nanochat.kernels import cpu_qgemv

        head = m.head
        rows = hidden.shape[0]
        out = np.empty((rows, head.out_features), dtype=np.float32)
        cpu_qgemv.linear_raw(head.ggml_type, cpu_qgemv.data_address(head.data), head.out_features,
                             head.in_features, hidden.ctypes.data, False, rows, hidden.shape[1], out.ctypes.data,
                             False, head.out_features, 0 if m.head_bias is None else m.head_bias.ctypes.data,
                             self.levels, self.threads)
        if m.softcap:
            from nanochat.kernels.cpu_decoder import activation_raw
            scaled = out / np.float32(m.softcap)
            activation_raw("tanh", scaled, out, self.threads)
            out *= np.float32(m.softcap)
        return out

    # ------------------------------------------------------------------ as LLMEngine._postprocess
    def _postprocess(self, req: _Request, token: int, now: float) -> TokenEvent:
        reason = add_token(req, token, now, self.eos_token_ids, self.config.max_model_len)
        if reason is not None:
            self.requests.pop(req.request_id)
            self._queue.remove(req.request_id)
        delta = take_delta(req, final=reason is not None)
        stats = self._request_stats(req, reason) if reason is not None else None
        return TokenEvent(req.request_id, token, delta, reason is not None, reason, stats)

    def _request_stats(self, req: _Request, reason: str) -> RequestStats:
        return request_stats(req.seq, reason, self.config.max_model_len, time.perf_counter())

    def stats(self) -> EngineStats:
        return EngineStats(running=min(1, len(self._queue)), waiting=max(0, len(self._queue) - 1),
                           total_prefill_tokens=self.total_prefill_tokens,
                           total_decode_tokens=self.total_decode_tokens, extra={"engine": "lean"})

    def describe(self):
        raise RequestError("the lean one-shot engine does not describe models; `nanochat info` uses the full engine")


class LeanCore(EngineCore):
    """The engine core (sessions, events, stats) over a LeanEngine made from `plan`."""

    def __init__(self, conn, plan: LeanPlan):
        super().__init__(conn)
        self.plan = plan

    def create_engine(self, model: str, config: dict, progress):
        return LeanEngine(self.plan, load_progress=progress)
