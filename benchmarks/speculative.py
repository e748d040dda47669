"""Speculative decoding, single stream, greedy: nanochat with and without speculation, side by side with
llama-cpp-python plain and with its prompt-lookup decoding (LlamaPromptLookupDecoding), on chat turns whose
replies copy from the prompt and on open ones.

    python benchmarks/speculative.py [--model FILE|NAME] [--peer-python /path/to/python] [--repeats 3]
                                     [--max-tokens 256] [--draft FILE [--draft-k K]] [--threads 2] [--more-turns]
                                     [--held-out] [--json]

Every turn is rendered with the model's chat template (nanochat's renderer; llama.cpp gets the same ids) and
runs until the end of the reply or --max-tokens. tok/s: completion tokens after the first over the time after
the first (the prompt's prefill is the same work either way). Each turn runs `--repeats` times per engine,
the engines alternating; the table gives medians. nanochat's tokens with speculation are checked equal to its
tokens without. With --draft, nanochat also runs with that model drafting (its acceptance and speed-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CODE = '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
'''
FRUITS = "apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew melons, kiwis, lemons, mangoes, " \
         "nectarines, oranges, papayas, quinces, raspberries, strawberries, tangerines"
PASSAGE = ("The lighthouse stood at the end of the rocky point for more than a century. Its keeper climbed the "
           "one hundred and twelve steps every evening to light the lamp, and every morning to put it out. Ships "
           "passing in the night saw its beam sweep across the water every ten seconds, and knew where the rocks "
           "were.")
TURNS = {
    "copy": [
        f"Add a docstring and comments to this function. Reply with the whole function.\n\n```python\n{CODE}```",
        f"Reformat this list as a numbered list, one item per line, keeping every item exactly as written: {FRUITS}.",
        f"Quote the following passage exactly, then summarize it in one sentence.\n\n{PASSAGE}",
    ],
    "open": [
        "Write a short story about a lighthouse keeper.",
        "Explain how a refrigerator works.",
        "Give me three tips for learning a new language.",
    ],
}
# --more-turns: four more of each kind (not in the tables of earlier runs)
MORE_TURNS = {
    "copy": [
        'Rewrite this JSON with two-space indentation:\n{"name": "Ada", "age": 36, "languages": ["English", "French"], '
        '"city": "London"}',
        "Fix the spelling mistakes in this paragraph and return the corrected paragraph: The quick brown fox jumpd "
        "over the lazy dog. It was a sunny day and the fox was verry happy to be out in the feild.",
        "Convert this Python function to use a list comprehension. Reply with the whole function.\n\n```python\n"
        "def squares(numbers):\n    result = []\n    for n in numbers:\n        if n % 2 == 0:\n"
        "            result.append(n * n)\n    return result\n```",
        "Here is a shopping list: milk, eggs, bread, butter, cheese, apples, rice, pasta, tomatoes, onions. Write it "
        "as a bulleted list.",
    ],
    "open": [
        "What is the capital of France?",
        "Write a poem about the sea.",
        "Explain recursion to a child.",
        "What are the benefits of exercise?",
    ],
}

# --held-out: turns written to check that a change to the policy tuned on the turns above holds on others (many
# short replies: where a probe that fails costs most)
HELD_OUT = {
    "copy": [
        "Translate this list to uppercase, one per line: red, green, blue, yellow, purple, orange, black, white.",
        "Add type hints to this function and return the whole function.\n\n```python\ndef area(width, height):\n"
        "    return width * height\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n```",
        "Sort these names alphabetically and list them one per line: Zoe, Adam, Mia, Liam, Emma, Noah, Olivia, Ethan.",
        "Repeat this sentence three times: The early bird catches the worm.",
        "Turn this into a markdown table with columns Name and Age: Alice 30, Bob 25, Carol 41, Dave 35.",
        "Correct the grammar: Me and him goes to the store yesterday and buyed three apple.",
        "Rename the variable x to count in this code and return it.\n\n```python\nx = 0\nfor item in items:\n"
        "    if item.ok:\n        x += 1\nprint(x)\n```",
        "Write this address on separate lines: 221B Baker Street, London, NW1 6XE, United Kingdom.",
    ],
    "open": [
        "What is 2 + 2?",
        "Name a color.",
        "Write a haiku about autumn.",
        "Why is the sky blue?",
        "Tell me a joke.",
        "How do I make a cup of tea?",
        "What is photosynthesis?",
        "Suggest a name for a cat.",
        "Describe your ideal weekend.",
        "What is the largest planet in the solar system?",
    ],
}


def chat_turns(more: bool = False, held_out: bool = False) -> list[tuple[str, int, str]]:
    """(kind, index within its kind, text) of the turns to run: TURNS, MORE_TURNS with `more`, HELD_OUT with
    `held_out`."""
    out = []
    for kind in ("copy", "open"):
        texts = TURNS[kind] + (MORE_TURNS[kind] if more else []) + (HELD_OUT[kind] if held_out else [])
        out += [(kind, i, text) for i, text in enumerate(texts)]
    return out


def model_path(model: str | None, peer_python: str | None = None, threads: int = 2) -> str:
    """--model: a file or folder, a matrix model name (matrix_models.py: made on first use, e.g. smollm2-f16), or
    None for the built-in SmolLM2-135M Q4_1."""
    import matrix_models
    from nanochat.models.formats.catalog import embedded_model_path

    if model is None:
        return str(embedded_model_path())
    if model in matrix_models.MODELS:
        return str(matrix_models.ensure_model(model, matrix_models.default_models_dir(),
                                              matrix_models.peer_python(peer_python), threads, _log))
    return model


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def render(engine, text: str) -> list[int]:
    """A user turn's prompt ids, rendered with the model's chat template."""
    template = engine.loaded.chat_template
    return engine.tokenizer.encode(template.render([{"role": "user", "content": text}], add_generation_prompt=True),
                                   add_special_tokens=False)


def nanochat_turn(engine, ids: list[int], max_tokens: int, mode: str | None):
    from nanochat.engine import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, speculative=mode)
    rid = engine.add_request(ids, sp)
    tokens, final = [], None
    while final is None:
        for ev in engine.step():
            if ev.request_id != rid:
                continue
            if ev.token_id is not None:
                tokens.append(ev.token_id)
            final = ev if ev.finished else None
    st = final.stats
    return tokens, st.decode_tok_s or 0.0, st.spec_proposed, st.spec_accepted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF file, a Hugging Face folder or a matrix model name (matrix_models.py, "
                                   "e.g. smollm2-f16; default: the built-in SmolLM2-135M Q4_1)")
    p.add_argument("--peer-python", help="an interpreter with llama-cpp-python (default: none, nanochat only; it "
                                         "also makes a matrix model)")
    p.add_argument("--draft", help="also run nanochat with this model drafting")
    p.add_argument("--draft-k", type=int, default=0,
                   help="the draft proposes this many tokens every step, whether it pays or not (default: the "
                        "engine's choice, which stops a draft that does not pay)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--more-turns", action="store_true", help="four more turns of each kind (MORE_TURNS)")
    p.add_argument("--held-out", action="store_true", help="18 more turns, many with short replies (HELD_OUT)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from nanochat.engine import LLMEngine
    from nanochat.kernels import cpu_qgemv

    model = model_path(args.model, args.peer_python, args.threads)
    if args.draft_k:
        from nanochat.engine.speculative import Speculation
        chosen = Speculation.choose_k
        Speculation.choose_k = lambda self, room, ratio, batch=1: (
            min(room, args.draft_k) if self.mode == "draft" else chosen(self, room, ratio, batch))
    common = dict(max_model_len=4096, cpu_threads=args.threads)
    engines = {"off": LLMEngine(model, speculative="off", **common),
               "ngram": LLMEngine(model, speculative="ngram", **common)}
    if args.draft:
        engines["draft"] = LLMEngine(model, speculative=args.draft, **common)
    main_engine = engines["off"]
    stop = sorted(main_engine.eos_token_ids)
    peer = None
    if args.peer_python:
        from peers import WorkerRunner, peer_env

        env_args = argparse.Namespace(peer_env=[], threads=args.threads, isa=None)
        peer = WorkerRunner("llama.cpp", HERE / "llamacpp_worker.py", args.peer_python,
                            {"model": model, "threads": args.threads, "n_ctx": 4096}, peer_env(env_args))
    results = []
    for kind, i, text in chat_turns(args.more_turns, args.held_out):
        ids = render(main_engine, text)
        row = {"kind": kind, "turn": i, "prompt_tokens": len(ids)}
        speeds: dict[str, list[float]] = {}
        outputs: dict[str, list[int]] = {}
        for rep in range(args.repeats):
            order = list(engines) + (["llama.cpp", "llama.cpp lookup"] if peer else [])
            if rep % 2:
                order.reverse()
            for name in order:
                if name in engines:
                    mode = {"off": "off", "ngram": "ngram", "draft": "draft"}[name]
                    out, tok_s, proposed, accepted = nanochat_turn(engines[name], ids, args.max_tokens, mode)
                    row[f"{name} accepted"] = (accepted, proposed)
                else:
                    r = peer._call({"cmd": "lookup_generate", "ids": ids, "n": args.max_tokens, "stop_ids": stop,
                                    "lookup": 10 if name.endswith("lookup") else 0})
                    out, tok_s = r["ids"], r["tokens"] / r["seconds"] if r["seconds"] else 0.0
                speeds.setdefault(name, []).append(tok_s)
                outputs[name] = out
        row["tokens"] = len(outputs["off"])
        row["tok_s"] = {k: statistics.median(v) for k, v in speeds.items()}
        row["same_output"] = all(outputs[k] == outputs["off"] for k in engines)
        results.append(row)
        print(f"{kind} {i}: " + ", ".join(f"{k} {v:.1f}" for k, v in row["tok_s"].items())
              + f" tok/s, {row['tokens']} tokens, same output: {row['same_output']}", file=sys.stderr)
    if peer is not None:
        peer.close()
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    isa = cpu_qgemv.simd_level()
    print(f"### {Path(model).name}: speculative decoding, greedy, 1 stream, {args.threads} threads, "
          f"{args.repeats} repeats (median), nanochat ISA {isa}\n")
    cols = list(results[0]["tok_s"])
    head = ["turn", "tokens"] + [f"{c} tok/s" for c in cols] + ["ngram/off", "accepted/proposed"]
    if peer:
        head.append("ngram / llama.cpp lookup")
    if args.draft:
        head.append("draft/off")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        t = r["tok_s"]
        acc, prop = r["ngram accepted"]
        cells = [f"{r['kind']} {r['turn']}", str(r["tokens"])] + [f"{t[c]:.1f}" for c in cols]
        cells += [f"{t['ngram'] / t['off']:.2f}x", f"{acc}/{prop}"]
        if peer:
            cells.append(f"{t['ngram'] / t['llama.cpp lookup']:.2f}x")
        if args.draft:
            cells.append(f"{t['draft'] / t['off']:.2f}x ({r['draft accepted'][0]}/{r['draft accepted'][1]})")
        if not r["same_output"]:
            cells[0] += " (outputs differ!)"
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"\n({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    sys.exit(code)
