"""The engine loop: add requests, step (schedule -> run -> sample -> postprocess), report events."""

from __future__ import annotations

import gc
import itertools
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from nanochat.engine.block_manager import BlockManager
from nanochat.engine.config import Config
from nanochat.engine.generation_defaults import card_defaults, sampling_defaults
from nanochat.engine.model_runner import ModelRunner, kv_window
from nanochat.engine.output import (EngineStats, RequestError, RequestStats, TokenEvent, TokenLogprobs,
                                    embeddings_only)
from nanochat.engine.pooling import POOLINGS, PoolingParams, default_pooling, finish
from nanochat.engine.reply_text import add_token, check_ids, check_prompt, request_stats, take_delta
from nanochat.engine.sampler import Sampler, TokenHistory, token_logprobs, verify
from nanochat.engine.sampling_params import SamplingParams
from nanochat.engine.scheduler import Scheduler
from nanochat.engine.sequence import Sequence
from nanochat.engine.speculative import Speculation, SpeculationConfig, StepTimes
from nanochat.engine.structured import Constraint, Grammars
from nanochat.models.errors import one_line


@contextmanager
def _collector_paused():
    """No cyclic garbage collection during a load: torch's import leaves a great many tracked objects, every
    full collection walks them all, and the hundreds of thousands of small objects a load makes (a
    vocabulary's merges, the model's modules) would trigger several. The collector's
    state is restored whether the load succeeds or not. (Not gc.freeze: whatever it froze that later became
    cyclic garbage would never be collected.)"""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class _Request:
    request_id: str
    seq: Sequence
    detok: object
    generator: torch.Generator | None
    text: str = ""
    emitted: int = 0          # chars of `text` already sent as deltas
    history: TokenHistory | None = None   # penalized requests: seq.token_ids as a tensor, for the sampler
    constraint: Constraint | None = None  # a json_schema or grammar request's state (engine/structured.py)

    @property
    def params(self) -> SamplingParams:
        return self.seq.sampling_params


class LLMEngine:
    def __init__(self, model: str, config: Config | None = None, loaded=None, load_progress=None, **kwargs):
        """`load_progress(done, total)`: called as the weights load (a progress bar). Under a torch.distributed
        launcher (torchrun), on a rank other than 0 this serves rank 0's engine and exits the process."""
        from nanochat.engine.config import launched_rank

        if launched_rank():
            from nanochat.engine.tensor_parallel import run_worker_and_exit
            run_worker_and_exit()

        started = time.perf_counter()
        with _collector_paused():
            self._load(model, config, loaded, load_progress, kwargs)
        self.load_seconds = time.perf_counter() - started

    def _load(self, model: str, config: Config | None, loaded, load_progress, kwargs: dict) -> None:
        from nanochat.models.formats.loader import load

        config = config or Config.create(model, **kwargs)
        self.device = config.resolved_device()
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_thread_count())
            config.use_cpu_isa()
        self.loaded = loaded or load(model, cache=config.pack_cache, template_file=config.chat_template)
        # An encoder (BERT) reads an input in one chunk, attending both ways: no chunk may start after a cached
        # prefix (its positions' states depend on what follows them), and one step holds a whole input.
        self.encoder = self.loaded.config.encoder
        if self.encoder:
            if config.tensor_parallel_size > 1:
                raise ValueError(f"{self.loaded.config.name}: an encoder (embedding) model runs without tensor "
                                 "parallelism (tensor_parallel_size 1)")
            config = replace(config, enable_prefix_caching=False, speculative="off")
        self.config = config.with_model_limits(self.loaded.config.max_position_embeddings)
        self.kernels = config.kernel_options()
        self.dtype = self.config.resolved_dtype(self.device)
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_ids = self.loaded.eos_token_ids
        # What the model file recommends, over its model card's for a model nanochat ships (key by key).
        stated = sampling_defaults(self.loaded.source)
        self.card_sampling = {k: v for k, v in card_defaults(self.loaded.source).items() if k not in stated}
        self.sampling_defaults = {**self.card_sampling, **stated}
        stated_pooling = self.loaded.source.stated_pooling()
        # an embedding request's default: --pooling, else the files' own, else mean
        self.pooling = default_pooling(stated_pooling) if self.config.pooling == "auto" else self.config.pooling
        self.stated_pooling = stated_pooling if stated_pooling in POOLINGS else None
        self.embedding_model = self.stated_pooling is not None or self.encoder
        self.embedding_length = self.loaded.config.hidden_size
        self.workers = None
        if self.config.tensor_parallel_size > 1:
            from nanochat.engine.tensor_parallel import Workers, worker_device
            self.device = worker_device(self.config, 0)
            self.workers = Workers(self.config.tensor_parallel_size, self.device, model, self.config)
        try:
            self.runner = self._build_runner(load_progress)
        except BaseException:
            self.close()
            raise
        r = self.runner
        self.block_manager = BlockManager(r.num_blocks, self.config.kvcache_block_size,
                                          self.config.enable_prefix_caching, r.num_state_slots,
                                          window=kv_window(self.loaded.config),
                                          window_group=(r.group_window, r.num_window_blocks) if r.group_window
                                          else None)
        self.block_manager.copy_kv = self.runner.copy_kv
        # Speculative decoding: what proposes (config.speculative) unless the model cannot roll back its state
        # (hybrid models' recurrent state would need a copy per proposal).
        self.speculation = SpeculationConfig(k_max=self.config.speculative_k)
        self.step_times = StepTimes(self.speculation.row_cost)
        self.draft = None
        self.speculative = self._proposer(self.config.speculative)
        if self.speculative == "draft":
            from nanochat.engine.draft import DraftModel
            try:
                self.draft = DraftModel(self.config.speculative, self.config, self.tokenizer,
                                        self.loaded.config.vocab_size, self.device, self.dtype)
            except BaseException:
                self.close()
                raise
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, whole=self.encoder)
        self.sampler = Sampler()
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.grammars = Grammars(self.tokenizer, self.loaded.config.vocab_size, self.eos_token_ids,
                                 self.loaded.chat_template.harmony)
        # (time, prefill tokens, decode tokens, prefill s, decode s, decode chunks, proposed, accepted) per step
        self._window: deque[tuple[float, int, int, float, float, int, int, int]] = deque()
        self.total_prefill_tokens = self.total_decode_tokens = 0
        self.total_spec_proposed = self.total_spec_accepted = 0

    @property
    def speculative_modes(self) -> tuple[str, ...]:
        """The proposers a request may pick (SamplingParams.speculative)."""
        if self.runner.is_hybrid:
            return ("off",)
        return ("off", "ngram", "draft") if self.draft is not None else ("off", "ngram")

    def _proposer(self, asked: str) -> str:
        """The engine's speculative mode: off, ngram or draft (config.speculative names a draft model). "auto" is
        ngram where a row's logits are the same bits however many rows its step computes, so proposals cannot
        change a token: the CPU with every matmul on the q8 kernels (GGUF blocks, dense weights in their own
        type, dense MoE experts under Config.batch_invariant; benchmarks/README.md measured what it gains);
        elsewhere (torch's GEMMs, GPUs) plain decoding, unless asked.
        Hybrid models never speculate: their recurrent state cannot be cut back to the accepted tokens."""
        if self.runner.is_hybrid or asked == "off":
            return "off"
        if asked == "auto":
            from nanochat.models.layers.common import batch_invariant
            exact = self.device.type == "cpu" and batch_invariant(self.runner.model)
            return "ngram" if exact else "off"
        return "ngram" if asked == "ngram" else "draft"

    def _build_runner(self, load_progress) -> ModelRunner:
        from nanochat.models.formats.loader import build_model

        c, workers = self.config, self.workers
        try:   # with tensor parallelism every rank builds its shard, and all agree before the first collective
            model = build_model(self.loaded.source, self.device, self.dtype, c.kvcache_block_size, c.max_model_len,
                                c.dequantize, c.moe_offload, c.quantize, load_progress, c.pack_cache,
                                tp=None if workers is None else workers.tp, kernels=self.kernels)
        except Exception as e:
            if workers is not None:
                try:
                    workers.agree(one_line(e))
                except Exception:
                    pass
            raise
        if workers is not None:
            workers.agree(None)
        return ModelRunner(c, model, self.device, self.dtype, ranks=workers)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them); the engine is unusable after."""
        workers, self.workers = getattr(self, "workers", None), None
        if workers is not None:
            workers.stop()

    @property
    def model_config(self):
        return self.loaded.config

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, session_id: str | None = None) -> str:
        from nanochat.models.text.tokenizer import IncrementalDetokenizer

        sp = sampling_params or SamplingParams()
        if self.encoder:
            raise RequestError(embeddings_only(self.loaded.config.name))
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(ids)
        vocab = self.loaded.config.vocab_size
        if any(t >= vocab for t, _ in sp.logit_bias):
            raise RequestError(f"logit_bias names token {max(t for t, _ in sp.logit_bias)}, past the vocabulary's "
                               f"{vocab} ids")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        constraint = self._constraint(sp, ids)
        seq = Sequence(ids, sp, session_id=session_id)
        mode = self._speculation_mode(sp)
        if mode != "off":
            seq.spec = Speculation(self.speculation, mode)
        if session_id is not None:
            self.block_manager.touch_session(session_id)
        generator = None
        if not sp.greedy:
            generator = torch.Generator()
            generator.manual_seed(sp.seed if sp.seed is not None else torch.seed())
        history = TokenHistory(self.device) if sp.penalized else None
        self.requests[request_id] = _Request(request_id, seq, IncrementalDetokenizer(self.tokenizer), generator,
                                             history=history, constraint=constraint)
        seq.request_id = request_id
        self.scheduler.add(seq)
        return request_id

    def add_embedding(self, prompt: str | list[int], pooling: PoolingParams | None = None,
                      request_id: str | None = None, truncate: bool = False) -> str:
        """An embedding request: the prompt's final hidden states pooled (engine/pooling.py; `pooling` None: the
        model's own pooling, normalized). Its one event is the final one, with `embedding` set. `truncate`: an
        input longer than the context keeps its first max_model_len tokens (else it is refused)."""
        pooling = pooling or PoolingParams(self.pooling)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        limit = self.embedding_limit
        if truncate:
            ids = ids[:limit]
        if not ids:
            raise RequestError("the input is empty")
        if len(ids) > limit:   # the whole context is the input's: nothing is generated after it
            knob = "max_num_batched_tokens" if limit < self.config.max_model_len else "max_model_len"
            raise RequestError(f"the input has {len(ids)} tokens, but the context holds {limit} ({knob})")
        check_ids(ids, self.loaded.config.vocab_size)
        if self.block_manager.num_blocks_for(len(ids)) > len(self.block_manager.blocks):
            raise RequestError(f"the input needs {len(ids)} tokens of KV cache but the cache holds only "
                               f"{len(self.block_manager.blocks) * self.config.kvcache_block_size}")
        width = self.embedding_length
        if pooling.dimensions is not None and pooling.dimensions > width:
            raise RequestError(f"dimensions is {pooling.dimensions}, but this model's embeddings have {width}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = Sequence(ids, SamplingParams(temperature=0.0, max_tokens=1))
        seq.pooling, seq.request_id = pooling, request_id
        self.requests[request_id] = _Request(request_id, seq, None, None)
        self.scheduler.add(seq)
        return request_id

    @property
    def embedding_limit(self) -> int:
        """The longest input an embedding request takes: the context, and for an encoder one step's tokens."""
        c = self.config
        return min(c.max_model_len, c.max_num_batched_tokens) if self.encoder else c.max_model_len

    def _constraint(self, sp: SamplingParams, ids: list[int]) -> Constraint | None:
        try:
            return self.grammars.constraint(sp, ids)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def _speculation_mode(self, sp: SamplingParams) -> str:
        """The request's proposer: its own choice, else the engine's; "off" where the model cannot speculate."""
        if self.runner.is_hybrid or (not sp.greedy and sp.seed is not None):
            # A seed promises the same tokens on every run; how many proposals a step verifies (and so how the
            # seed's draws are spent) follows measured step times, so a seeded sampled request runs plainly.
            return "off"
        mode = sp.speculative or self.speculative
        if mode == "draft" and self.draft is None:
            raise RequestError("speculative 'draft' needs a draft model: start the engine with speculative=PATH")
        return mode

    def _propose(self, seq: Sequence, room: int) -> list[int]:
        """The scheduler's proposer: a decoding sequence's proposals, never past its max_tokens or the context."""
        spec = seq.spec
        if spec is None:
            return []
        room = min(room, self.config.max_model_len - len(seq) - 1,
                   seq.sampling_params.max_tokens - seq.num_completion_tokens - 1)
        base = max(1, len(self.scheduler.running))

        def ratio(k: int) -> float:
            return self.step_times.ratio(base, k)

        if spec.mode == "ngram":
            return spec.propose_ngram(seq.token_ids, room, ratio, base)
        plain = self.step_times.estimate(base)

        def with_draft(k: int) -> float:   # the draft's k steps come on top of the target's step
            return ratio(k) + (k * self.draft.token_seconds / plain if plain else 0.0)

        return self.draft.propose(seq, spec.choose_k(room, with_draft, base))

    def _check_prompt(self, ids: list[int]) -> None:
        check_prompt(ids, self.config.max_model_len, self.loaded.config.vocab_size)
        if self.block_manager.num_blocks_for(len(ids) + 1) > len(self.block_manager.blocks):
            raise RequestError(f"the prompt needs {len(ids)} tokens of KV cache but the cache holds only "
                               f"{len(self.block_manager.blocks) * self.config.kvcache_block_size}; "
                               "raise the KV-cache budget")

    def abort(self, request_id: str) -> TokenEvent | None:
        """Cancel a request now: its blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.seq.session_id is not None and req.seq.block_table:
            self.block_manager.pin_session(req.seq.session_id, req.seq)
        self._finish(req.seq, "abort")
        return TokenEvent(request_id, None, "", True, "abort", self._request_stats(req, "abort"))

    def touch_session(self, session_id: str) -> None:
        """Mark a conversation's resident KV as most recently used (evicted last)."""
        self.block_manager.touch_session(session_id)
        if self.draft is not None:
            self.draft.touch_session(session_id)

    def release_session(self, session_id: str) -> None:
        """Drop a conversation's resident KV (on /clear or delete); its blocks stay cached until reused."""
        self.block_manager.release_session(session_id)
        if self.draft is not None:
            self.draft.release_session(session_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenEvent]:
        chunks = self.scheduler.schedule(None if self.runner.is_hybrid else self._propose)
        if not chunks:
            return self._fail_unschedulable()
        t0 = time.perf_counter()
        threads = self.kernels.threads
        if threads and torch.get_num_threads() != threads:   # torch's count is per process: another engine's
            torch.set_num_threads(threads)
        out = self.runner.run(chunks)
        logits = out.logits
        sampled = [c for c in chunks if c.samples]
        first = list(itertools.accumulate((1 + len(c.draft) for c in sampled), initial=0))   # each chunk's rows
        plain = [i for i, c in enumerate(sampled) if not c.draft]
        emitted: list[list[int]] = [[] for _ in sampled]
        logprobs: dict[int, list] = {}
        if plain:
            rows = logits if len(plain) == len(sampled) else logits[[first[i] for i in plain]]
            reqs = [self.requests[sampled[i].seq.request_id] for i in plain]
            # Log-probabilities are the model's own (vLLM's default, "raw_logprobs"): from the logits before
            # penalties (which change them in place), temperature, top-k and top-p.
            asking = [j for j, r in enumerate(reqs) if r.params.logprobs is not None]
            raw = rows[asking] if asking else None
            for j, r in enumerate(reqs):
                if r.constraint is not None:
                    r.constraint.mask(rows[j])
            tokens = self.sampler(rows, [r.params for r in reqs], [r.generator for r in reqs],
                                  [self._history(r) for r in reqs])
            for i, token in zip(plain, tokens):
                emitted[i] = [token]
            if asking:
                found = token_logprobs(raw, [tokens[j] for j in asking], [reqs[j].params.logprobs for j in asking])
                logprobs.update({plain[j]: [f] for j, f in zip(asking, found)})
        for i, c in enumerate(sampled):
            if c.draft:
                emitted[i] = self._verify(c, logits[first[i]:first[i + 1]], logprobs, i)
        now = time.perf_counter()
        self._record_throughput(chunks, sum(map(len, emitted)), now - t0, now)
        if not self.runner.is_hybrid and all(c.num_tokens == 1 for c in chunks):   # a decode step's cost, for k
            self.step_times.record(sum(c.stop - c.start for c in chunks), now - t0)
        for c in chunks:
            if not c.draft:
                c.seq.num_computed_tokens = c.end
                self.block_manager.commit_computed(c.seq)
                self.block_manager.drop_outside_window(c.seq)
        events = self._pool([c for c in chunks if c.seq.pooling is not None], out.pooled)
        for i, (c, tokens) in enumerate(zip(sampled, emitted)):
            events += self._emit(c, tokens, now, logprobs.get(i))
        return events

    def _pool(self, chunks: list, pooled: list[torch.Tensor]) -> list[TokenEvent]:
        """Embedding requests: add each chunk's pooled rows (`pooled`: one sum per chunk with a pool_span, in order);
        a request whose prompt is all computed ends with its embedding. A chunk from position 0 starts the sum
        again (a preempted request recomputes its prompt)."""
        events, sums = [], iter(pooled)
        for c in chunks:
            seq, at = c.seq, c.pool_span
            if c.start == 0:
                seq.pool_sum, seq.pool_count = None, 0
            if at is not None:
                rows = next(sums)
                seq.pool_sum = rows if seq.pool_sum is None else seq.pool_sum + rows
                seq.pool_count += at[1] - at[0]
            if c.end < len(seq):
                continue
            req = self.requests.pop(seq.request_id)
            vector = finish(seq.pool_sum, seq.pool_count, seq.pooling)
            self._finish(seq, "stop")
            events.append(TokenEvent(req.request_id, None, "", True, "stop", self._request_stats(req, "stop"),
                                     embedding=vector))
        return events

    @staticmethod
    def _history(req: _Request):
        """A penalized request's ids for the sampler (prompt + generated so far, read from the sequence, so a
        preempted or resumed request is penalized the same), else None."""
        return None if req.history is None else (req.history.sync(req.seq.token_ids), req.seq.num_prompt_tokens)

    def _verify(self, c, rows: torch.Tensor, logprobs: dict, i: int) -> list[int]:
        """A speculating chunk's tokens: its accepted proposals and one of the target's (sampler.verify)."""
        req = self.requests[c.seq.request_id]
        raw = rows.clone() if req.params.logprobs is not None else None   # verify penalizes rows in place
        if req.constraint is not None:
            req.constraint.mask_along(rows, c.draft)
        tokens = verify(rows, c.draft, req.params, req.generator, self._history(req),
                        self.draft.probs(c.seq) if c.seq.spec.mode == "draft" else None)
        c.seq.spec.record(len(c.draft), len(tokens) - 1)
        if raw is not None:
            logprobs[i] = token_logprobs(raw[:len(tokens)], tokens, [req.params.logprobs] * len(tokens))
        return tokens

    def _emit(self, c, tokens: list[int], now: float, logprobs: list | None) -> list[TokenEvent]:
        """The events of a sampled chunk's tokens, one by one as plain decoding would emit them: before each,
        the sequence's KV covers every token it holds (the last real one and the proposals accepted before
        it), so only accepted tokens are ever hashed; a stop ends the chunk early."""
        seq, req, events = c.seq, self.requests[c.seq.request_id], []
        if c.draft:
            self.block_manager.trim(seq, len(seq) + len(tokens))
        for j, token in enumerate(tokens):
            if c.draft:
                seq.num_computed_tokens = len(seq)
                self.block_manager.commit_computed(seq)
                self.block_manager.drop_outside_window(seq)
            events.append(self._postprocess(req, token, now, None if logprobs is None else logprobs[j]))
            if events[-1].finished:
                break
        return events

    def _token_logprobs(self, token: int, found: tuple[float, list[int], list[float]]) -> TokenLogprobs:
        logprob, ids, values = found
        text = self.tokenizer.decode
        return TokenLogprobs(text([token]), logprob, [(text([i]), v, i) for i, v in zip(ids, values)])

    def _fail_unschedulable(self) -> list[TokenEvent]:
        """Nothing could run: the head request cannot fit even in an empty cache."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        req = self.requests.pop(seq.request_id)
        self._finish(seq, "error")
        need = len(seq)
        return [TokenEvent(req.request_id, None, "", True, "error", self._request_stats(req, "error"),
                           error=f"out of KV-cache memory: the sequence needs {need} tokens of cache, "
                                 f"more than the whole cache holds; raise the KV-cache budget")]

    def _postprocess(self, req: _Request, token: int, now: float, logprobs=None) -> TokenEvent:
        """`logprobs`: token_logprobs' answer for this row, when the request asks."""
        seq = req.seq
        try:
            reason = add_token(req, token, now, self.eos_token_ids, self.config.max_model_len)
        except RuntimeError as e:   # the grammar engine failed (the mask allows only what it can take)
            self.requests.pop(req.request_id)
            self._finish(seq, "error")
            return TokenEvent(req.request_id, None, "", True, "error", self._request_stats(req, "error"), error=str(e))
        if reason is not None:
            self.requests.pop(req.request_id)
            if seq.session_id is not None:   # keep the conversation's KV for its next turn
                self.block_manager.pin_session(seq.session_id, seq)
            self._finish(seq, reason)
        delta = take_delta(req, final=reason is not None)
        stats = self._request_stats(req, reason) if reason is not None else None
        return TokenEvent(req.request_id, token, delta, reason is not None, reason, stats,
                          logprobs=None if logprobs is None else self._token_logprobs(token, logprobs))

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.draft is not None:
            self.draft.release(seq)

    def _request_stats(self, req: _Request, reason: str) -> RequestStats:
        return request_stats(req.seq, reason, self.config.max_model_len, time.perf_counter())

    # ------------------------------------------------------------------ stats
    def _record_throughput(self, chunks, emitted: int, elapsed: float, now: float) -> None:
        """emitted: the tokens the step's decode chunks produced (more than one per chunk when speculating)."""
        decoding = [c for c in chunks if c.num_tokens == 1 and c.start >= c.seq.num_prompt_tokens]
        prefill = sum(c.num_tokens for c in chunks) - len(decoding)
        accepted = emitted - sum(1 for c in chunks if c.samples)   # a proposal kept: one token more
        decode = len(decoding) + accepted
        proposed = sum(len(c.draft) for c in decoding)
        self.total_prefill_tokens += prefill
        self.total_decode_tokens += decode
        self.total_spec_proposed += proposed
        self.total_spec_accepted += accepted
        total = prefill + decode
        # Split a mixed step's time between prefill and decode by token share.
        self._window.append((now, prefill, decode, elapsed * prefill / total, elapsed * decode / total,
                             len(decoding), proposed, accepted))
        while self._window and now - self._window[0][0] > 3.0:
            self._window.popleft()

    def describe(self):
        """A models.report.ModelReport of the loaded model, with the engine's KV cache and load time."""
        from nanochat.models.report import describe, dtype_name

        report = describe(self.runner.model)
        r = self.runner
        per_token = r.kv_bytes_per_block() // self.config.kvcache_block_size
        report.extra["KV cache"] = (f"{dtype_name(r.kv_dtype)}, {per_token / 1024:.1f} KiB per token, up to "
                                    f"{r.num_blocks * self.config.kvcache_block_size:,} tokens "
                                    f"(pages are used as tokens are)") if per_token else \
            f"none (an encoder reads each input in one step, up to {self.embedding_limit:,} tokens)"
        report.extra["context"] = f"{self.config.max_model_len:,} tokens (model: " \
                                  f"{self.loaded.config.max_position_embeddings:,})"
        report.extra["load time"] = f"{self.load_seconds:.2f} s"
        report.extra["embeddings"] = (f"{self.pooling} pooling (--pooling; the model's files state "
                                      f"{self.stated_pooling or 'none'})"
                                      if self.config.pooling != "auto" else
                                      f"{self.pooling} pooling, as the model's files state" if self.stated_pooling
                                      else "mean pooling (the model's files state none"
                                      + (": an encoder, embeddings only)" if self.encoder else ": a chat model)"))
        if self.config.chat_template is not None:
            report.extra["chat template"] = f"{self.config.chat_template} (--chat-template)"
        if self.workers is not None:
            report.extra["tensor parallel"] = (f"{self.config.tensor_parallel_size} ranks; the weights and KV cache "
                                               "above are rank 0's shard")
        report.sampling_defaults, report.card_sampling = self.sampling_defaults, self.card_sampling
        return report

    def stats(self) -> EngineStats:
        p_tok = sum(w[1] for w in self._window)
        d_tok = sum(w[2] for w in self._window)
        p_time = sum(w[3] for w in self._window)
        d_time = sum(w[4] for w in self._window)
        chunks, proposed, accepted = (sum(w[i] for w in self._window) for i in (5, 6, 7))
        b = self.block_manager.stats()
        return EngineStats(
            spec_acceptance=accepted / proposed if proposed else 0.0,
            spec_tokens_per_step=d_tok / chunks if chunks else 0.0,
            total_spec_proposed=self.total_spec_proposed, total_spec_accepted=self.total_spec_accepted,
            prefill_tok_s=p_tok / p_time if p_time else 0.0, decode_tok_s=d_tok / d_time if d_time else 0.0,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_total=b.total, kv_blocks_used=b.used, kv_blocks_cached=b.cached, kv_blocks_free=b.free,
            prefix_hit_rate=b.hit_rate, prefix_hit_tokens=b.hit_tokens, prefix_queried_tokens=b.queried_tokens,
            pinned_sessions=b.pinned_sessions, preemptions=self.scheduler.num_preemptions,
            total_prefill_tokens=self.total_prefill_tokens, total_decode_tokens=self.total_decode_tokens)
