"""What both engines (engine/llm_engine.py, engine/lean.py) do with a request's tokens: check its prompt ids;
for each sampled token append it, grow the request's text, decide whether the request ends (stop token, stop
string, max_tokens, the context) and hand out the text that is final; and sum up the request. Imports no torch.

A request here is any object with `seq` (engine/sequence.py), `params` (SamplingParams), `detok`
(an IncrementalDetokenizer), `text` and `emitted` (chars of `text` already sent)."""

from __future__ import annotations

from nanochat.engine.output import ContextExceeded, RequestError, RequestStats


def check_prompt(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """RequestError unless the prompt is non-empty, leaves room for a token and names only the vocabulary's ids."""
    if not ids:
        raise RequestError("the prompt is empty")
    if len(ids) >= max_model_len:
        raise ContextExceeded(len(ids), max_model_len)
    check_ids(ids, vocab_size)


def check_ids(ids: list[int], vocab_size: int) -> None:
    """RequestError unless every id is the vocabulary's."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")


def add_token(req, token: int, now: float, eos_token_ids, max_model_len: int) -> str | None:
    """Append `token` to the request and its text; the finish reason ("stop" | "length") when it ends here. A held
    reply's grammar (req.constraint, engine/structured.py) takes the token first: when it admits nothing after it,
    the reply stops, its text kept; RuntimeError (nothing appended): the grammar engine could not take it."""
    complete = req.constraint is not None and token not in eos_token_ids and req.constraint.advance(token)
    seq, sp = req.seq, req.params
    seq.append_token(token)
    if seq.stats.first_token_time is None:
        seq.stats.first_token_time = now
    reason = None
    if (not sp.ignore_eos and token in eos_token_ids) or token in sp.stop_token_ids:
        reason = "stop"
    stop_text = reason is not None   # a stop token's own text is not part of the reply
    if not stop_text:
        req.text += req.detok.add(token)
        hit = _stop_string(req)
        if hit is not None:
            req.text, reason = req.text[:hit[0]], "stop"
            seq.stats.stop_string = hit[1]
    if reason is None and complete:
        reason = "stop"
    if reason is None and (seq.num_completion_tokens >= sp.max_tokens or len(seq) >= max_model_len):
        reason = "length"
    if reason is not None:
        if not stop_text:
            req.text += req.detok.flush() if hasattr(req.detok, "flush") else ""
            if sp.stop:
                hit = _stop_string(req)
                if hit is not None:
                    req.text = req.text[:hit[0]]
                    if reason == "stop":
                        seq.stats.stop_string = hit[1]
        seq.stats.finish_time = now
    return reason


def _stop_string(req) -> tuple[int, str] | None:
    """Where the first stop string in the text begins, and which it is."""
    hits = [(i, s) for s in req.params.stop if (i := req.text.find(s)) >= 0]
    return min(hits) if hits else None


def take_delta(req, final: bool) -> str:
    """The text not sent yet, holding back a tail that could still grow into a stop string."""
    hold = 0 if final or not req.params.stop else max(len(s) for s in req.params.stop) - 1
    end = max(req.emitted, len(req.text) - hold)
    delta = req.text[req.emitted:end]
    req.emitted = end
    return delta


def request_stats(seq, reason: str, max_model_len: int, now: float) -> RequestStats:
    """The one stats type for a finished (or failed, or cancelled) request."""
    st = seq.stats
    end = st.finish_time or now
    decode = None
    n = seq.num_completion_tokens
    if st.first_token_time is not None and n > 1 and end > st.first_token_time:
        decode = (n - 1) / (end - st.first_token_time)
    spec = seq.spec
    return RequestStats(prompt_tokens=seq.num_prompt_tokens, cached_tokens=st.num_cached_tokens,
                        completion_tokens=n, ttft=st.ttft, decode_tok_s=decode,
                        elapsed=end - st.arrival_time, preemptions=st.num_preemptions, finish_reason=reason,
                        context_full=len(seq) >= max_model_len, stop_string=st.stop_string,
                        spec_proposed=spec.proposed if spec else 0, spec_accepted=spec.accepted if spec else 0)
