"""Speculative decoding: what proposes tokens, and how many to propose.

A decode step reads every weight once whether it scores one row or several, so the engine lets a
sequence's decode chunk carry k proposed tokens (`ScheduledChunk.draft`): the target scores the last real
token and the k proposals in one forward over k + 1 positions, and the sampler
(`sampler.verify`) keeps the longest prefix the target agrees with plus one token of its own.
Greedy output is unchanged token for token; sampled output keeps the target's distribution (rejection
sampling, Leviathan et al. 2023 / Chen et al. 2023). The KV slots written for rejected proposals lie
past the sequence's end: the next step overwrites them, no block holding them is ever hashed, and the
blocks wholly past the end go back (BlockManager.trim).

Proposers:
- `PromptLookup` (n-gram "prompt lookup"): the tokens that followed the latest earlier occurrence of the
  sequence's last n tokens, over everything the sequence holds (all of a chat's turns, not only the last
  prompt). Free to propose, so it is tried whenever the index finds a match.
- a draft model (engine/draft.py): a smaller model with the same tokenizer, run k decode steps ahead.

`Speculation` keeps one sequence's state: the proposer's index and, for each kind of proposal (prompt
lookup's by the length of the suffix it matched), an estimate of its acceptance. k is what maximizes the
expected tokens per unit of step time at the measured step costs (`StepTimes`); when no k pays, that kind
stops proposing for a while (backing off longer each time it fails again).
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, field

@dataclass(frozen=True)
class SpeculationConfig:
    """How a sequence speculates (the engine builds it from engine.config.Config)."""

    k_max: int = 8              # most tokens proposed for one step
    min_ngram: int = 1          # shortest suffix matched by prompt lookup
    max_ngram: int = 4          # longest (the longest that matches wins)
    prior_acceptance: float = 0.6   # what a sequence is assumed to accept before it has been measured
    prior_weight: float = 0.25      # verification steps' worth of that prior kept in the measured estimate
    row_cost: float = 0.15      # a step's extra row, as a share of a one-row step, until StepTimes has measured it
    window: int = 8             # verification steps the acceptance estimate remembers (EMA span)
    backoff: int = 16           # plain steps after speculation stopped paying, doubled each time it fails again
    guess_row_cost: float = 0.2  # a one-token match proposes on only where an extra row costs at most this of a step


class StepTimes:
    """What a decode step costs by the rows it computes (decode rows plus proposals), measured as the engine
    runs: the median of the last few steps of each row count (a step slowed by another process does not move
    it). Rows never measured are estimated from the nearest measured ones (or the prior `row_cost` per extra
    row). On the CPU an extra row is far from free (the int8 kernels are compute-bound at a few rows, and their
    tiles come in steps), so k is chosen on measured costs."""

    KEEP = 9    # steps remembered per row count
    SETTLE = 3  # steps of a row count before its median stands for it (StepTimes.estimate)
    BATCH = 8   # from this many rows a step's cost is taken as linear in its rows (StepTimes.ratio)

    def __init__(self, row_cost: float):
        self.row_cost = row_cost
        self.samples: dict[int, deque[float]] = {}
        self.seconds: dict[int, float] = {}   # the median of each row count's kept steps
        self.settled: list[int] = []          # the row counts with SETTLE steps, in order
        self._fit: tuple[float, float] | tuple[()] | None = None   # _line()'s, until the next record; () for none

    def record(self, rows: int, seconds: float) -> None:
        kept = self.samples.setdefault(rows, deque(maxlen=self.KEEP))
        kept.append(seconds)
        self.seconds[rows] = statistics.median(kept)
        if len(kept) == self.SETTLE:   # (the deque only grows: this happens once)
            bisect.insort(self.settled, rows)
        self._fit = None

    def estimate(self, rows: int) -> float | None:
        """A step of `rows` rows: the median of its steps once there were SETTLE of them, else from the nearest
        settled row counts. One slow step (a first call's one-off costs, another process) must not stand for a
        row count: a slow first 2-row step stopped the proposals that would have measured 2 rows again, for the
        rest of the engine's life."""
        known = self.settled
        if rows in known:
            return self.seconds[rows]
        if not known:
            return None
        below = [n for n in known if n < rows]
        above = [n for n in known if n > rows]
        if below and above:
            a, b = below[-1], above[0]
            return self.seconds[a] + (self.seconds[b] - self.seconds[a]) * (rows - a) / (b - a)
        near = below[-1] if below else above[0]
        return self.seconds[near] * (1 + self.row_cost * (rows - near))

    def ratio(self, base: int, extra: int) -> float:
        """The cost of a step of base + extra rows over one of base rows. From BATCH rows on, a least-squares line
        through the row counts measured from 2 rows on: a batch's steps are measured at many row counts, each a
        few times, and two neighbours' medians can differ by more than one row costs (a ratio below 1 made
        every sequence of a batch propose)."""
        if base >= self.BATCH:
            if self._fit is None:
                self._fit = self._line() or ()
            if self._fit:
                a, b = self._fit
                return (a + b * (base + extra)) / (a + b * base)
        t0, t1 = self.estimate(base), self.estimate(base + extra)
        if t0 is None or t1 is None or t0 <= 0:
            return 1 + self.row_cost * extra / base
        return t1 / t0

    def _line(self) -> tuple[float, float] | None:
        """(intercept >= 0, slope >= 0) of seconds against rows over the measured row counts from 2 on (None with
        fewer than 4 of them). A line that would start below zero (the larger batches also had longer contexts)
        goes through the origin instead: every row costs alike, which is what a compute-bound step is."""
        points = [(n, t) for n, t in self.seconds.items() if n >= 2]
        if len(points) < 4:
            return None
        mean_n = sum(n for n, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        spread = sum((n - mean_n) ** 2 for n, _ in points)
        slope = max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in points) / spread) if spread else 0.0
        intercept = mean_t - slope * mean_n
        if intercept <= 0:
            return 0.0, sum(n * t for n, t in points) / sum(n * n for n, _ in points)
        return intercept, slope


class PromptLookup:
    """n-gram index over one sequence's tokens: for each n in [min_n, max_n], the latest position each n-gram
    ended at, among those already followed by a token. Updated incrementally as tokens are appended, so a
    step costs a few dictionary look-ups, not a scan of a long chat."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}   # n-gram (any n) -> the index of its last token
        self.indexed = 0                              # n-grams ending before this index are in `ends`

    def _index(self, tokens: list[int]) -> None:
        # An n-gram ending at i goes in once tokens[i + 1] exists (its continuation).
        for i in range(self.indexed, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                self.ends[tuple(tokens[i - n + 1:i + 1])] = i
        self.indexed = max(self.indexed, len(tokens) - 1)

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix, and that
        suffix's length (0: none matched)."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return [], 0
        self._index(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k], n
        return [], 0


def accept_greedy(best: list[int], draft: list[int]) -> list[int]:
    """Greedy verification: the proposals while each is the target's argmax (`best[j]`: row j's, the row of the
    last real token first), then the argmax after them: exactly plain greedy decoding's next tokens."""
    out = []
    for j, d in enumerate(draft):
        if best[j] != d:
            break
        out.append(d)
    return out + [best[len(out)]]


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step with k proposals emits on average when each is accepted with probability `acceptance`
    (given the ones before it): the accepted run plus the target's own token."""
    return sum(acceptance ** i for i in range(k + 1))


@dataclass
class Acceptance:
    """How often one kind of proposal is accepted (EMAs of the tokens accepted and of the rejections per
    verification step: their ratio estimates the per-token acceptance of a geometric run), and its back-off."""

    accepted_ema: float = 0.0
    rejected_ema: float = 0.0
    measured: int = 0               # verification steps since it (re)started
    paused: int = 0                 # chances to propose left before proposing again
    failures: int = 0               # times in a row it stopped paying (the back-off doubles)
    last: int | None = None         # tokens accepted at its last verification (None: never verified)

    def cap(self, room: int) -> int:
        """k at most doubles the last verified run (its accepted tokens + 1): one accepted guess is thin evidence
        for proposing eight, and a short reply cannot earn back a long rejected step."""
        return room if self.last is None else min(room, 2 * (self.last + 1))

    def estimate(self, prior: float, weight: float) -> float:
        """Accepted tokens over accepted tokens and rejections, with `weight` verification steps' worth of the prior
        mixed in (prior x weight accepted of weight): without it one rejected first proposal set a kind's estimate
        to 0, and with it paused proposals that cost nothing (a second row is free with AVX-512 on a small model)."""
        a, r = self.accepted_ema, self.rejected_ema
        return (a + prior * weight) / (a + r + weight) if self.measured else prior

    def record(self, proposed: int, accepted: int, window: int) -> None:
        alpha = 2.0 / (window + 1)
        rejected = 1.0 if accepted < proposed else 0.0
        if self.measured == 0:
            self.accepted_ema, self.rejected_ema = float(accepted), rejected
        else:
            self.accepted_ema += alpha * (accepted - self.accepted_ema)
            self.rejected_ema += alpha * (rejected - self.rejected_ema)
        self.measured += 1
        self.last = accepted
        if accepted:
            self.failures = 0

    def pause(self, backoff: int) -> None:
        """It stopped paying: no proposals for `backoff` chances, doubled each time in a row, then judged afresh
        from the prior."""
        self.failures += 1
        self.paused = backoff << min(self.failures - 1, 6)
        self.accepted_ema = self.rejected_ema = 0.0
        self.measured = 0


@dataclass
class Speculation:
    """One sequence's speculation: its proposer state, acceptance estimates and back-off.

    Prompt lookup keeps one estimate per length of the suffix its proposal follows: a one-token match is a
    guess, a four-token one is usually text being copied (benchmarks/README.md, "One estimate per match
    length"), so guesses that fail and pause do not stop a copy that starts later. A draft model's proposals
    are one kind (0)."""

    config: SpeculationConfig
    mode: str                       # "ngram" or "draft"
    lookup: PromptLookup | None = None
    kinds: dict[int, Acceptance] = field(default_factory=dict)
    kind: int = 0                   # the kind being proposed (prompt lookup: the matched suffix's length)
    proposed: int = 0               # totals, for the stats
    accepted: int = 0

    def __post_init__(self):
        if self.mode == "ngram":
            self.lookup = PromptLookup(self.config.min_ngram, self.config.max_ngram)

    @property
    def state(self) -> Acceptance:
        return self.kinds.setdefault(self.kind, Acceptance())

    @property
    def paused(self) -> int:
        return self.state.paused

    @property
    def acceptance(self) -> float:
        return self.state.estimate(self.config.prior_acceptance, self.config.prior_weight)

    def choose_k(self, room: int, ratio, batch: int = 1) -> int:
        """How many tokens to propose this step (0: a plain step): the k up to `room` that maximizes the
        expected tokens per unit of step time (`ratio(k)`: a step with k proposals over a plain one). The step
        is `batch` sequences': each of them waits for the extra rows, so the tokens this one gains count
        against the whole step's (on a compute-bound CPU, 64 sequences proposing for themselves alone made a
        batch decode 0.71x as fast). When no k beats a plain step the sequence pauses, for longer each time."""
        st = self.state
        if st.paused > 0:
            st.paused -= 1
            return 0
        alpha = self.acceptance
        best, best_value, could_pay = 0, 1.0, False
        for k in range(1, self._limit(st.cap(room), ratio) + 1):
            cost = batch * ratio(k)
            value = (batch - 1 + expected_tokens(alpha, k)) / cost
            if value > best_value * 1.02:   # a near tie goes to fewer rows
                best, best_value = k, value
            could_pay = could_pay or (batch + k) / cost > 1.02    # were every proposal accepted
        if best == 0 and room > 0 and could_pay:   # else the batch, not the proposals, is what does not pay
            if not st.measured:   # never judged: one proposal measures its own acceptance
                return 1
            st.pause(self.config.backoff)
        return best

    def _limit(self, room: int, ratio) -> int:
        """The most proposals worth weighing. A one-token match is a guess, and the token after a guess that held
        is a two-token match's guess (benchmarks/README.md, "One token at a time from a guess"). So a guess proposes
        one token, and once that holds, the next step weighs the two-token kind on its own estimate: one accepted
        guess no longer sets a long step. Where extra rows cost at most `guess_row_cost` of a step each (a large
        weight read, cheap rows), proposing on from a guess pays anyway."""
        k = min(room, self.config.k_max)
        if self.kind != 1:   # (a draft model's proposals are kind 0)
            return k
        guess = 1
        while guess < k and ratio(guess + 1) - 1 <= self.config.guess_row_cost * (guess + 1):
            guess += 1
        return min(k, guess)

    def propose_ngram(self, tokens: list[int], room: int, ratio, batch: int = 1) -> list[int]:
        match, self.kind = self.lookup.match(tokens, min(room, self.config.k_max))
        return match[:self.choose_k(len(match), ratio, batch)] if match else []

    def record(self, proposed: int, accepted: int) -> None:
        """After a verification step: update the estimate of the kind that proposed."""
        if proposed:
            self.proposed += proposed
            self.accepted += accepted
            self.state.record(proposed, accepted, self.config.window)
