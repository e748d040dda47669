"""A draft model for speculative decoding: a smaller model with the target's tokenizer, loaded beside it in the
engine process with its own paged KV cache, prefix cache and chat sessions.

For each target sequence that speculates, the draft keeps a sequence of its own that follows the target's
tokens. A proposal catches the draft's KV up to the target's last token and runs k draft steps, each
sampling (greedy, or with the request's temperature, top-k and top-p) the next proposal; sampled requests keep
each step's distribution q for the target's rejection sampling (sampler.verify). After verification the
draft's sequence is cut back to the tokens the target kept: its KV slots past them are simply overwritten
later, and since the draft hashes a block only once every token in it is verified, no block it hashed ever
holds a rejected proposal. A conversation's draft KV is pinned with the target's (same session id), so the
draft too prefills only the new message of the next turn.

Only non-hybrid models draft (a recurrent state cannot be cut back); the draft runs without tensor
parallelism, on rank 0's device."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from nanochat.engine.block_manager import BlockManager
from nanochat.engine.config import Config
from nanochat.engine.model_runner import ModelRunner, kv_window
from nanochat.engine.sampler import argmax_rows, draw, target_probs
from nanochat.engine.scheduler import ScheduledChunk
from nanochat.engine.sequence import Sequence


class DraftModel:
    def __init__(self, path: str, config: Config, tokenizer, vocab_size: int, device: torch.device,
                 dtype: torch.dtype):
        """config: the target engine's; tokenizer, vocab_size: the target's (the draft must share the tokenizer,
        and never propose an id past the target's logits)."""
        from nanochat.models.formats.loader import build_model, load

        self.path = path
        self.loaded = load(path, cache=config.pack_cache)
        if not same_tokenizer(self.loaded.tokenizer, tokenizer):
            raise ValueError(f"the draft model {path!r} does not share the model's tokenizer")
        self.config = replace(config.with_model_limits(self.loaded.config.max_position_embeddings),
                              model=path, speculative="off", tensor_parallel_size=1)
        c = self.config
        model = build_model(self.loaded.source, device, dtype, c.kvcache_block_size, c.max_model_len, c.dequantize,
                            c.moe_offload, c.quantize, None, c.pack_cache, kernels=c.kernel_options())
        if getattr(model, "is_hybrid", False):
            raise ValueError(f"the draft model {path!r} is a hybrid (recurrent) model, which cannot draft")
        self.runner = ModelRunner(c, model, device, dtype)
        r = self.runner
        self.blocks = BlockManager(r.num_blocks, c.kvcache_block_size, c.enable_prefix_caching,
                                   window=kv_window(self.loaded.config),
                                   window_group=(r.group_window, r.num_window_blocks) if r.group_window else None)
        self.blocks.copy_kv = r.copy_kv
        self.vocab_size = vocab_size
        self.seqs: dict[int, Sequence] = {}          # target seq_id -> the draft's sequence
        self.q: dict[int, torch.Tensor | None] = {}  # target seq_id -> the last proposals' distributions
        self.generators: dict[int, torch.Generator] = {}
        self.token_seconds = 0.0                     # EMA of one draft step's time (a proposal's cost)

    # ------------------------------------------------------------------ proposing
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k proposals for the target's `seq` (fewer when the draft's cache is full)."""
        if k <= 0:
            return []
        d = self._sync(seq)
        if d is None:
            return []
        sp = seq.sampling_params
        started = time.perf_counter()
        proposals, probs = [], []
        for _ in range(k):
            logits = self._catch_up(d)
            if logits is None:
                break
            row = logits[0, :self.vocab_size]
            if sp.greedy:
                token = argmax_rows(row)
            else:
                q = torch.zeros(self.vocab_size)
                q[:row.shape[0]] = target_probs(row, sp)
                token = draw(q, self._generator(seq))
                probs.append(q)
            d.append_token(token)
            proposals.append(token)
        if proposals:
            per_token = (time.perf_counter() - started) / len(proposals)
            self.token_seconds = per_token if not self.token_seconds else \
                self.token_seconds + 0.25 * (per_token - self.token_seconds)
        self.q[seq.seq_id] = torch.stack(probs) if probs else None
        return proposals

    def probs(self, seq: Sequence) -> torch.Tensor | None:
        """The distributions the last proposals for `seq` were drawn from ([k, vocab]); None for greedy."""
        return self.q.get(seq.seq_id)

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = self.generators[seq.seq_id] = torch.Generator()
            gen.manual_seed(torch.seed())
        return gen

    def _catch_up(self, d: Sequence) -> torch.Tensor | None:
        """Compute the draft's KV up to its last token (in chunks of the step budget); the logits after it, or
        None when the draft's cache has no room."""
        logits = None
        while d.num_computed_tokens < len(d):
            n = min(len(d) - d.num_computed_tokens, self.config.max_num_batched_tokens)
            if not self.blocks.ensure_slots(d, d.num_computed_tokens + n):
                return None
            logits = self.runner.run([ScheduledChunk(d, d.num_computed_tokens, n)]).logits
            d.num_computed_tokens += n
        return logits

    def _sync(self, seq: Sequence) -> Sequence | None:
        """The draft's sequence for `seq`, cut back to the tokens both hold and extended with the target's."""
        d = self.seqs.get(seq.seq_id)
        if d is None:
            d = Sequence(list(seq.token_ids), seq.sampling_params, session_id=seq.session_id)
            if not self.blocks.allocate(d):
                return None
            self.seqs[seq.seq_id] = d
            return d
        target = seq.token_ids
        common = 0
        for a, b in zip(d.token_ids, target):
            if a != b:
                break
            common += 1
        d.token_ids[common:] = target[common:]
        d.num_computed_tokens = min(d.num_computed_tokens, common)
        self.blocks.trim(d, len(d))
        self.blocks.commit_computed(d)   # only now: every computed token is one the target kept
        self.blocks.drop_outside_window(d)
        return d

    # ------------------------------------------------------------------ lifetime
    def release(self, seq: Sequence) -> None:
        """The target's `seq` ended: pin the draft's KV with its session, else free it (cached for later hits)."""
        if seq.seq_id not in self.seqs:
            return
        d = self._sync(seq)   # cut back to the target's tokens, the verified blocks hashed
        del self.seqs[seq.seq_id]
        self.q.pop(seq.seq_id, None)
        self.generators.pop(seq.seq_id, None)
        if d.session_id is not None:
            self.blocks.pin_session(d.session_id, d)
        self.blocks.deallocate(d)

    def release_session(self, session_id: str) -> None:
        self.blocks.release_session(session_id)

    def touch_session(self, session_id: str) -> None:
        self.blocks.touch_session(session_id)


def same_tokenizer(a, b) -> bool:
    """Whether two nanochat Tokenizers map every token to the same id (and agree on BOS/EOS)."""
    return (a.vocab_size == b.vocab_size and a.bos_token_id == b.bos_token_id and a.eos_token_id == b.eos_token_id
            and a.backend.get_vocab(with_added_tokens=True) == b.backend.get_vocab(with_added_tokens=True))
