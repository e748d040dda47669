"""Speculation's policy replayed without noise: how many tokens it proposes, and what that would cost, on
replies whose tokens are known.

    python benchmarks/spec_policy.py [--model FILE|NAME] [--more-turns] [--held-out] [--max-tokens 256] [--threads 2]
                                     [--costs '1:3.4,2:4.3,...'] [--json]

End-to-end speculation figures (benchmarks/speculative.py) swing by +-0.2x on a shared VM, more than most
changes to the policy (engine/speculative.py: which kinds propose, k, the back-off) move them. This tool
separates the two: it decodes each chat turn of speculative.py greedily once, measures what a decode step
costs by its rows in the engine (a forced number of proposals every step; the median of each), then runs
the policy over the known replies (greedy speculation emits the same tokens) and charges every step the
measured cost of its rows. The ratio of the plain steps' cost to that is what speculation would gain if
step costs never moved; the same costs (`--costs`, ms by rows) replay another version of the policy (run
this script with that version's package on PYTHONPATH) on equal terms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from speculative import chat_turns, model_path, nanochat_turn, render  # noqa: E402


def measure_costs(engine, ids: list[int], rows: int, steps: int = 32, repeats: int = 3) -> dict[int, float]:
    """ms per decode step by its rows (1 .. rows), as speculative.py's tok/s sees it (the whole step: scheduling,
    the forward, sampling, the events): the engine decodes `steps` tokens of `ids`' reply with that many
    proposals forced into every step (the last token repeated), and the time after the first token is divided
    by the steps taken (tokens after the first, less the proposals accepted). The median of `repeats`."""
    from nanochat.engine import speculative as spec_mod

    propose = spec_mod.Speculation.propose_ngram
    forced = [0]
    spec_mod.Speculation.propose_ngram = lambda self, tokens, room, ratio, batch=1: [tokens[-1]] * min(room, forced[0])
    seen: dict[int, list[float]] = {}
    try:
        nanochat_turn(engine, ids, 4, "ngram")                 # warm
        for _ in range(repeats):
            for k in range(rows):
                forced[0] = k
                tokens, tok_s, _, accepted = nanochat_turn(engine, ids, steps, "ngram")
                if tok_s:
                    seen.setdefault(1 + k, []).append((len(tokens) - 1) / tok_s / (len(tokens) - 1 - accepted) * 1e3)
    finally:
        spec_mod.Speculation.propose_ngram = propose
    return {n: statistics.median(v) for n, v in sorted(seen.items())}


def replay(ids: list[int], reply: list[int], costs: dict[int, float], max_tokens: int) -> dict:
    """The policy over a known greedy reply (of at most `max_tokens`): steps, proposals, and the cost ratio plain /
    speculative."""
    from nanochat.engine.speculative import Speculation, SpeculationConfig, StepTimes

    config = SpeculationConfig()
    times = StepTimes(config.row_cost)
    for n, ms in costs.items():
        for _ in range(StepTimes.SETTLE):   # a row count's cost stands for it once it has SETTLE steps
            times.record(n, ms)
    spec = Speculation(config, "ngram")
    pos, spent, steps = 1, 0.0, 0          # the first token comes from the prefill, as speculative.py counts
    while pos < len(reply):
        room = max_tokens - pos - 1        # the engine's room: it does not know where the reply will end
        proposal = spec.propose_ngram(ids + reply[:pos], room, lambda k: times.ratio(1, k))
        ok = 0
        while ok < len(proposal) and pos + ok < len(reply) and proposal[ok] == reply[pos + ok]:
            ok += 1
        spec.record(len(proposal), ok)
        spent += costs[1 + len(proposal)]
        pos += ok + 1
        steps += 1
    plain = (len(reply) - 1) * costs[1]
    return {"tokens": len(reply), "steps": steps, "proposed": spec.proposed, "accepted": spec.accepted,
            "gain": plain / spent if spent else 1.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF file, a Hugging Face folder or a matrix model name (default: the built-in "
                                   "SmolLM2-135M Q4_1)")
    p.add_argument("--more-turns", action="store_true", help="speculative.py's MORE_TURNS too")
    p.add_argument("--held-out", action="store_true", help="speculative.py's HELD_OUT too")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--costs", help="ms per step by rows, '1:3.4,2:4.3,...' (default: measured here)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from nanochat.engine import LLMEngine
    from nanochat.engine.speculative import SpeculationConfig
    from nanochat.kernels import cpu_qgemv

    model = model_path(args.model, threads=args.threads)
    engine = LLMEngine(model, speculative="ngram", max_model_len=4096, cpu_threads=args.threads)
    turns = [(kind, i, render(engine, text)) for kind, i, text in chat_turns(args.more_turns, args.held_out)]
    rows = SpeculationConfig().k_max + 1
    if args.costs:
        costs = {int(n): float(ms) for n, ms in (item.split(":") for item in args.costs.split(","))}
    else:
        costs = measure_costs(engine, turns[1][2], rows)
    results = []
    for kind, i, ids in turns:
        reply = nanochat_turn(engine, ids, args.max_tokens, "off")[0]
        results.append({"kind": kind, "turn": i, **replay(ids, reply, costs, args.max_tokens)})
    if args.json:
        print(json.dumps({"costs_ms": costs, "turns": results}, indent=1))
        return 0
    print(f"### {Path(model).name}: speculation's policy replayed, nanochat ISA {cpu_qgemv.simd_level()}, "
          f"{args.threads} threads\n")
    print("step ms by rows: " + ", ".join(f"{n}: {ms:.2f}" for n, ms in costs.items()))
    print("(`--costs '" + ",".join(f"{n}:{ms:.2f}" for n, ms in costs.items()) + "'` replays on the same)\n")
    print("| turn | tokens | steps | accepted/proposed | gain |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['kind']} {r['turn']} | {r['tokens']} | {r['steps']} | {r['accepted']}/{r['proposed']} "
              f"| {r['gain']:.2f}x |")
    for kind in ("copy", "open"):
        gains = [r["gain"] for r in results if r["kind"] == kind]
        print(f"\n{kind}: geometric mean {statistics.geometric_mean(gains):.3f}x, lowest {min(gains):.2f}x", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
