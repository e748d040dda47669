"""Batched sampling: repetition / presence / frequency penalties and logit bias, then greedy, temperature, top-k, top-p,
with reproducible per-request seeds; and the verification of speculative proposals (`verify`)."""

from __future__ import annotations

from array import array

import torch

from nanochat.engine.sampling_params import SamplingParams
from nanochat.engine.speculative import accept_greedy

FIRST_GUESS = 64   # candidates fetched first for top-p; a peaked distribution's nucleus is usually smaller


def candidates(row: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tokens top-k and then top-p keep from one row of (temperature-scaled) logits: (ids, their
    probabilities renormalized), most likely first; None when neither filter is on.

    top-p keeps a token while the mass of the tokens before it is below top_p (the first always
    stays), over the top-k distribution when top-k is on. Instead of sorting the whole vocabulary (on a
    CPU that can cost as much as a decode step), it takes the FIRST_GUESS most likely tokens and widens
    8x until their mass reaches top_p: the same set, since the nucleus is a prefix of the sorted order."""
    vocab = row.shape[-1]
    top_k = top_k if 0 < top_k < vocab else vocab
    if top_k == vocab and top_p >= 1.0:
        return None
    if top_k < vocab:
        logits, ids = torch.topk(row, top_k)
        probs = logits.softmax(-1)
    else:
        lse, n = torch.logsumexp(row, -1), FIRST_GUESS
        while True:
            logits, ids = torch.topk(row, min(n, vocab))
            probs = (logits - lse).exp()
            if n >= vocab or float(probs.sum()) >= top_p:
                break
            n *= 8
    if top_p < 1.0:
        keep = max(1, int(((probs.cumsum(-1) - probs) < top_p).sum()))
        ids, probs = ids[:keep], probs[:keep]
    return ids, probs / probs.sum()


def uniform(generator: torch.Generator | None) -> float:
    """One float64 draw in [0, 1) from a request's generator (None: torch's global one): each token drawn, on
    either sampling path or in verification, spends exactly one."""
    return float(torch.rand((), dtype=torch.float64, generator=generator))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index of the 1-D distribution `probs` (any positive total), from one uniform draw of `generator`
    through the inverse of its CDF (accumulated in float64): on a large vocabulary torch.multinomial
    costs a sizeable share of a CPU decode step, and this a fraction of it."""
    cdf = probs.double().cumsum(0)
    u = uniform(generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)


History = tuple[list[int] | torch.Tensor, int]   # (prompt + generated token ids, number of prompt ids)


class TokenHistory:
    """A request's token ids as an int64 tensor for the penalties, kept in step with the sequence's list
    (the source of truth, append-only) by copying only the ids added since the last sync: converting the
    whole list every step would cost time that grows with the chat, the tail almost none."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.buf = torch.empty(0, dtype=torch.int64, device=device)
        self.n = 0

    def sync(self, token_ids: list[int]) -> torch.Tensor:
        m = len(token_ids)
        if m < self.n:                 # never for an append-only list; resync rather than trust a stale copy
            self.n = 0
        if m > self.buf.numel():
            grown = torch.empty(max(m, 2 * self.buf.numel(), 64), dtype=torch.int64, device=self.buf.device)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if m > self.n:
            tail = torch.frombuffer(array("q", token_ids[self.n:m]), dtype=torch.int64)
            self.buf[self.n:m] = tail.to(self.buf.device)
            self.n = m
        return self.buf[:m]


@torch.inference_mode()   # the engine's logits are inference tensors: in-place updates only in this mode
def apply_penalties(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                    histories: list[History | None]) -> None:
    """Penalize `logits` [B, V] (contiguous) in place, for the listed rows only (each with a history):

    - repetition_penalty p (HF/CTRL, transformers' RepetitionPenaltyLogitsProcessor): every token id that
      appears in the prompt or the generated tokens, once however often, gets logit / p if the logit is
      > 0, else logit * p.
    - then frequency_penalty f and presence_penalty r (vLLM's order and definition, over the generated
      tokens only): logit = logit - f * count - r * (count > 0).

    The work is gathers / scatters over the histories' ids (no sort, no pass over the vocabulary). Ids the
    logits do not cover (an embedding wider than the head) are skipped, as transformers does."""
    vocab, dev = logits.shape[-1], logits.device
    flat = logits.view(-1)            # one flat index per (row, token): 1-D index ops are cheaper than 2-D

    def keys_of(picked: list[int], prompt_too: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The picked rows' history ids as (flat index, row), on the logits' device."""
        ids = [torch.as_tensor(histories[i][0] if prompt_too else histories[i][0][histories[i][1]:],
                               dtype=torch.int64) for i in picked]
        row = torch.tensor(picked).repeat_interleave(torch.tensor([len(t) for t in ids])).to(dev)
        tok = torch.cat(ids).to(dev)
        if tok.numel() and int(tok.max()) >= vocab:     # rare: only then pay for the masking
            keep = tok < vocab
            row, tok = row[keep], tok[keep]
        return row * vocab + tok, row

    def per_row(name: str, row: torch.Tensor) -> torch.Tensor:
        return torch.tensor([getattr(sp, name) for sp in params], dtype=logits.dtype, device=dev)[row]

    rep = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep:
        key, row = keys_of(rep, prompt_too=True)
        val, factor = flat.index_select(0, key), per_row("repetition_penalty", row)
        # A repeated id gathers the same logit each time, so all its writes agree: it is penalized once.
        flat.index_copy_(0, key, torch.where(val > 0, val / factor, val * factor))
    gen = [i for i in rows if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0]
    if gen:
        key, row = keys_of(gen, prompt_too=False)
        if key.numel():
            # Count each (row, token) in its own logit's slot, with no sort and no vocabulary-sized buffer:
            # keep the logits, zero them, add 1 per occurrence (exact in any order), read the counts back.
            val = flat.index_select(0, key)
            flat.index_fill_(0, key, 0.0)
            flat.index_add_(0, key, torch.ones_like(val))
            count = flat.index_select(0, key)
            val = val - per_row("frequency_penalty", row) * count - per_row("presence_penalty", row)
            flat.index_copy_(0, key, val)


@torch.inference_mode()   # as apply_penalties: the engine's logits are inference tensors
def apply_bias(rows: torch.Tensor, sp: SamplingParams) -> None:
    """Add the request's logit_bias to `rows` ([V] or [n, V]) in place."""
    ids = torch.tensor([t for t, _ in sp.logit_bias], device=rows.device)
    rows[..., ids] += torch.tensor([b for _, b in sp.logit_bias], dtype=rows.dtype, device=rows.device)


@torch.inference_mode()
def token_logprobs(logits: torch.Tensor, tokens: list[int],
                   ks: list[int]) -> list[tuple[float, list[int], list[float]]]:
    """Per row of `logits` [B, V]: log_softmax's value at `tokens[i]`, and the ids and values of its
    ks[i] largest entries (most likely first)."""
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    k = max(ks)
    values, ids = torch.topk(logp, k) if k else (logp[:, :0], logp[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    return [(chosen[i], ids[i][:ks[i]], values[i][:ks[i]]) for i in range(len(tokens))]


def argmax_rows(logits: torch.Tensor) -> list[int] | int:
    """Each row's argmax as `logits.argmax(-1).tolist()` gives it: a list for [B, V], an int for one row [V]
    (the first on ties, NaN counting as the largest). CPU rows go through numpy: torch's CPU argmax is an
    order of magnitude slower, and over several rows wakes OpenMP threads that wait for the cores the kernels'
    own pool holds (benchmarks/README.md, "Two costs outside the kernels")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 histories: list[History | None] | None = None) -> list[int]:
        """logits [B, V] (fp32); one params/generator per row. Greedy rows take the argmax.

        Rows whose params set a penalty need their history (prompt + generated ids, number of prompt
        ids) and are penalized in place first, before greedy / temperature / top-k / top-p (the
        engine's logits are a per-step temporary). Without penalties nothing else is done."""
        rows = [i for i, sp in enumerate(params) if sp.penalized]
        if rows:
            if histories is None or any(histories[i] is None for i in rows):
                raise ValueError("a row with a penalty needs its token history")
            logits = logits.contiguous()       # a no-op for the engine's logits
            apply_penalties(logits, rows, params, histories)
        for i, sp in enumerate(params):
            if sp.logit_bias:
                apply_bias(logits[i], sp)
        greedy = argmax_rows(logits)
        if logits.device.type != "cpu":
            sampled = [i for i, sp in enumerate(params) if not sp.greedy]
            drawn = dict(zip(sampled, sample_rows(logits[sampled], [params[i] for i in sampled],
                                                  [generators[i] for i in sampled]))) if sampled else {}
            return [drawn.get(i, g) for i, g in enumerate(greedy)]
        out = []
        for i, sp in enumerate(params):
            if sp.greedy:
                out.append(greedy[i])
                continue
            row = (logits[i] / sp.temperature).cpu()
            kept = candidates(row, sp.top_k, sp.top_p)
            if kept is None:
                out.append(draw(row.softmax(-1), generators[i]))
            else:
                ids, probs = kept
                out.append(int(ids[draw(probs, generators[i])]))
        return out


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every row's distribution at once, as `target_probs` gives it one row at a time: (probs [B, V], None) in
    vocabulary order when no row sets top-k or top-p, else (probs, ids) in each row's descending order,
    zero past its top-k and its top-p nucleus and renormalized. For a GPU: one batched sort costs less there
    than a launch per row; on a CPU `candidates` avoids the sort."""
    temps = torch.tensor([sp.temperature for sp in params], dtype=logits.dtype, device=logits.device)
    scaled = logits / temps[:, None]
    vocab = logits.shape[-1]
    top_k = [sp.top_k if 0 < sp.top_k < vocab else vocab for sp in params]
    top_p = [sp.top_p for sp in params]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return scaled.softmax(-1), None
    scaled, ids = scaled.sort(-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.tensor(top_k, device=logits.device)
    probs = scaled.masked_fill(rank >= k[:, None], float("-inf")).softmax(-1)
    p = torch.tensor(top_p, dtype=probs.dtype, device=logits.device)
    # a token stays while the mass before it is below top_p; the first always does
    keep = ((probs.cumsum(-1) - probs) < p[:, None]) | (p[:, None] >= 1.0) | (rank == 0)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True), ids


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [B, V] for sampled (not greedy) requests, batched on the logits' device:
    `filtered_probs`, then `draw`'s inverse CDF in float64 with one uniform from each row's generator."""
    probs, ids = filtered_probs(logits, params)
    u = torch.tensor([uniform(g) for g in generators], dtype=torch.float64, device=logits.device)
    cdf = probs.double().cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=logits.shape[-1] - 1)
    return (picked if ids is None else ids.gather(1, picked))[:, 0].tolist()


def target_probs(row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The distribution a sampled (not greedy) request draws from, over the whole vocabulary: one row of
    (penalized) logits through temperature, top-k and top-p, as Sampler.__call__ draws."""
    row = (row / sp.temperature).cpu()
    kept = candidates(row, sp.top_k, sp.top_p)
    if kept is None:
        return row.softmax(-1)
    ids, probs = kept
    return torch.zeros_like(row).index_copy_(0, ids, probs)


@torch.inference_mode()
def verify(logits: torch.Tensor, draft: list[int], sp: SamplingParams, generator: torch.Generator | None,
           history: History | None = None, draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens a speculative step emits: the accepted prefix of `draft` and one token of the target's.

    logits [k + 1, V]: the target's rows for the last real token and each of the k proposals. Greedy: a
    proposal is kept while it is the target's argmax, then the argmax follows, so the tokens are plain
    greedy decoding's. Sampled: proposal j is kept with probability min(1, p_j(d) / q_j(d)), q_j being the
    proposer's distribution (`draft_probs` [k, V]; None: a deterministic proposer, q_j one-hot); at the
    first rejection a token is drawn from the normalized residual max(0, p_j - q_j), and after k acceptances
    from p_k; so the emitted tokens follow the target's distribution exactly (Leviathan et al. 2023,
    Chen et al. 2023). Penalties see each row's own history: the sequence's ids and the proposals before it;
    the logit bias applies to every row."""
    k = len(draft)
    if sp.penalized or sp.logit_bias:
        logits = logits.contiguous()   # changed in place below
    if sp.penalized:
        if history is None:
            raise ValueError("a row with a penalty needs its token history")
        ids, prompt = history
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        apply_penalties(logits, list(range(k + 1)), [sp] * (k + 1),
                        [(ids + draft[:j], prompt) for j in range(k + 1)])
    if sp.logit_bias:
        apply_bias(logits, sp)
    if sp.greedy:
        return accept_greedy(argmax_rows(logits), draft)
    out = []
    for j in range(k + 1):
        p = target_probs(logits[j], sp)
        if j == k:
            return out + [draw(p, generator)]
        d = draft[j]
        q = None if draft_probs is None else draft_probs[j].to(p.device, torch.float32)
        q_d = 1.0 if q is None else float(q[d])
        u = uniform(generator)
        if u * q_d < float(p[d]):
            out.append(d)
            continue
        if q is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - q).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:   # p == q up to rounding: the residual is empty, p itself stands in
            residual = p
        return out + [draw(residual, generator)]
    return out
