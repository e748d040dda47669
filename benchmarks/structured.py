"""Structured output, single stream, greedy: what holding a reply to a JSON schema or a GBNF grammar costs, and what
prompt lookup gives back on replies that copy their prompt, beside llama.cpp's own JSON-schema grammar (GBNF, what its
server builds for response_format) and its own GBNF sampler on the same file.

    python benchmarks/structured.py [--model FILE] [--peer-python /path/to/python] [--repeats 3] [--threads 2]

Each task is a chat turn (the model's template) with a schema or a GBNF grammar. nanochat runs it unconstrained
("free"), constrained with speculation off, and constrained with prompt lookup; llama-cpp-python runs it
unconstrained and with the schema's grammar, or the same GBNF. "free" replies are other tokens (the model writes
prose around its JSON): their tok/s is the engine's plain speed, for scale.
tok/s: reply tokens after the first over the time after the first (as benchmarks/speculative.py). Medians over
--repeats, the engines alternating. Each row also says whether the constrained reply is valid: it parses and has
the schema's required keys, or it matches the regex beside the grammar.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from speculative import render  # noqa: E402

RECORD = ("Customer record: name Margaret Ellison, email margaret.ellison@example.com, phone +44 20 7946 0958, "
          "city Cambridge, country United Kingdom, member since 2019, plan Premium Annual.")
TASKS = {
    "extract": (f"Extract the customer's fields from this record as JSON.\n\n{RECORD}",
                {"type": "object", "properties": {k: {"type": "string"} for k in
                                                   ("name", "email", "phone", "city", "country", "plan")},
                 "required": ["name", "email", "phone", "city", "country", "plan"], "additionalProperties": False}),
    "list": ("List these fruits as a JSON array of strings: apples, bananas, cherries, dates, elderberries, figs, "
             "grapes, kiwis, lemons, mangoes.",
             {"type": "array", "items": {"type": "string"}, "maxItems": 20}),
    "person": ("Invent a person and describe them as JSON with name, age, city and hobbies.",
               {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "city": {"type": "string"},
                                                 "hobbies": {"type": "array", "items": {"type": "string"},
                                                             "maxItems": 5}},
                "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}),
    # GBNF grammars (the same text for both engines) and the regex their replies must match
    "gbnf: bullets": ("List five fruits, one per line, each line starting with a dash.",
                      ('root ::= item ("\\n" item){4}\nitem ::= "- " [A-Za-z][a-z ]{0,30}\n',
                       r"- [A-Za-z][a-z ]{0,30}(\n- [A-Za-z][a-z ]{0,30}){4}")),
    "gbnf: answer": ("Is Paris the capital of France? Answer yes or no, then give one short reason.",
                     ('root ::= ("Yes" | "No") ", because " [a-zA-Z ,]{1,80} "."\n',
                      r"(Yes|No), because [a-zA-Z ,]{1,80}\.")),
}


def held(spec) -> dict:
    """SamplingParams' keywords for a task's schema (a dict) or GBNF grammar (its text and the reply's regex)."""
    return {"grammar": spec[0]} if isinstance(spec, tuple) else {"json_schema": spec}


def run(engine, ids, spec, mode, max_tokens):
    from nanochat.engine import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, speculative=mode, **(held(spec) if spec else {}))
    rid = engine.add_request(ids, sp)
    tokens, text, final = [], "", None
    while final is None:
        for ev in engine.step():
            if ev.request_id == rid:
                tokens += [ev.token_id] if ev.token_id is not None else []
                text += ev.text
                final = ev if ev.finished else None
    return tokens, text, final.stats.decode_tok_s or 0.0


def valid(text: str, spec) -> bool:
    if isinstance(spec, tuple):
        return re.fullmatch(spec[1], text) is not None
    schema = spec
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if schema.get("type") == "object":
        return isinstance(value, dict) and set(schema.get("required", [])) <= set(value)
    return isinstance(value, list)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF file (default: the built-in SmolLM2-135M Q4_1)")
    p.add_argument("--peer-python", help="an interpreter with llama-cpp-python (default: nanochat only)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    from nanochat.engine import LLMEngine
    from nanochat.kernels import cpu_qgemv
    from nanochat.models.formats.catalog import embedded_model_path

    model = args.model or str(embedded_model_path())
    engine = LLMEngine(model, max_model_len=4096, cpu_threads=args.threads)
    stop = sorted(engine.eos_token_ids)
    peer = None
    if args.peer_python:
        from peers import WorkerRunner, peer_env

        env = peer_env(argparse.Namespace(peer_env=[], threads=args.threads, isa=None))
        peer = WorkerRunner("llama.cpp", HERE / "llamacpp_worker.py", args.peer_python,
                            {"model": model, "threads": args.threads, "n_ctx": 4096}, env)
    names = ["free", "schema", "schema+lookup"] + (["llama.cpp free", "llama.cpp schema"] if peer else [])
    print(f"### {Path(model).name}: JSON schema and GBNF replies, greedy, 1 stream, {args.threads} threads, "
          f"{args.repeats} repeats (median), nanochat ISA {cpu_qgemv.simd_level()}\n")
    print("| task | reply tokens (schema) | " + " | ".join(f"{n} tok/s" for n in names)
          + " | lookup / schema | nanochat / llama.cpp | valid (nanochat, llama.cpp) |")
    print("|" + "---|" * (len(names) + 5))
    for task, (text, schema) in TASKS.items():
        ids = render(engine, text)
        speeds: dict[str, list[float]] = {n: [] for n in names}
        outs: dict[str, tuple] = {}
        for rep in range(args.repeats):
            for name in (names if rep % 2 == 0 else names[::-1]):
                if name.startswith("llama.cpp"):
                    constrained = held(schema) if name.endswith("schema") else {}
                    r = peer._call({"cmd": "lookup_generate", "ids": ids, "n": args.max_tokens, "stop_ids": stop,
                                    "lookup": 0, "grammar": constrained.get("grammar"),
                                    "json_schema": json.dumps(constrained["json_schema"])
                                    if "json_schema" in constrained else None})
                    tokens, tok_s = r["ids"], r["tokens"] / r["seconds"] if r["seconds"] else 0.0
                    body = tokens[:-1] if tokens and tokens[-1] in stop else tokens
                    outs[name] = (tokens, engine.tokenizer.decode(body))
                else:
                    mode = "ngram" if name == "schema+lookup" else "off"
                    tokens, out_text, tok_s = run(engine, ids, None if name == "free" else schema, mode,
                                                  args.max_tokens)
                    outs[name] = (tokens, out_text)
                speeds[name].append(tok_s)
        med = {n: statistics.median(v) for n, v in speeds.items()}
        same = outs["schema"][0] == outs["schema+lookup"][0]
        cells = [task + ("" if same else " (lookup changed the reply!)"), str(len(outs["schema"][0]))]
        cells += [f"{med[n]:.1f}" for n in names]
        cells.append(f"{med['schema+lookup'] / med['schema']:.2f}x")
        cells.append(f"{med['schema+lookup'] / med['llama.cpp schema']:.2f}x" if peer else "-")
        cells.append(f"{valid(outs['schema'][1], schema)}, "
                     f"{valid(outs['llama.cpp schema'][1], schema) if peer else '-'}")
        print("| " + " | ".join(cells) + " |", flush=True)
    if peer is not None:
        peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
