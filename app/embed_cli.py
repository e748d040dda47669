"""`nanochat embed`: embeddings on the command line, as llama.cpp's llama-embedding gives them. Each text's vector
(the model's own pooling, or --pooling; unit length unless --no-normalize) is one JSON line on stdout:
{"index": i, "tokens": n, "embedding": [...]}.

    nanochat embed --model nomic-embed-text-v1.5.Q8_0.gguf "first passage" "second passage"
    nanochat embed --model bge-small-en-v1.5-f16.gguf < passages.txt      (one input per non-blank line)
"""

from __future__ import annotations

import argparse
import json
import sys

from nanochat.app.errors import EXIT_OK, UsageError, run_guarded
from nanochat.app.options import add_engine_options, add_option, argv_text, engine_config, positive_int, resolve_model

PROG = "nanochat embed"


def add_embed_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("embed", help="print the embeddings of texts (one JSON line each)",
                              description="Print each text's embedding as one JSON line on stdout: the model's final "
                                          "hidden states pooled as its files say (or --pooling), unit length. "
                                          "Texts come from the arguments, else one per non-blank line of stdin; "
                                          "they run batched in one engine step where they fit.")
    p.add_argument("texts", nargs="*", type=argv_text, metavar="TEXT", help="texts to embed (default: stdin's lines)")
    add_engine_options(p, suppress=True)
    add_option(p, True, "--quiet", "-q", action="store_true", help="no loading progress on stderr")
    p.add_argument("--dimensions", type=positive_int, metavar="N",
                   help="keep the first N values (Matryoshka models such as nomic-embed-text), before normalizing")
    p.add_argument("--no-normalize", action="store_true", help="the pooled vectors as they are (default: unit length)")
    p.add_argument("--truncate", action="store_true",
                   help="cut an input longer than the model takes to its first tokens (default: an error)")
    p.set_defaults(func=run_embed_cli)
    return p


def run_embed_cli(args) -> int:
    return run_guarded(lambda: _embed(args), PROG)


def read_texts(args) -> list[str]:
    """The arguments, else stdin's non-blank lines (never a wait on a terminal); UsageError when there is none."""
    texts = list(args.texts)
    if not texts:
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("give the texts to embed as arguments, or one per line on stdin")
        texts = [line.rstrip("\r\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise UsageError("nothing to embed: stdin held no text")
    return texts


def _embed(args) -> int:
    from nanochat.app.oneshot import load_client
    from nanochat.engine import PoolingParams

    settings = args.settings
    texts = read_texts(args)
    config = engine_config(args, settings)
    client, _ = load_client(resolve_model(args, settings), config, bool(getattr(args, "quiet", False)))
    try:
        params = PoolingParams(client.model.pooling, normalize=not args.no_normalize, dimensions=args.dimensions)
        streams = [client.submit(text, pooling=params, truncate=args.truncate) for text in texts]
        replies = [stream.result() for stream in streams]
    finally:
        client.shutdown()
    for i, reply in enumerate(replies):   # all or nothing: a refused input prints no vector at all
        if reply.embedding is None:
            raise RuntimeError(f"input {i + 1}: {reply.final.error or 'the engine refused it'}")
    for i, reply in enumerate(replies):
        print(json.dumps({"index": i, "tokens": reply.final.stats.prompt_tokens, "embedding": reply.embedding}))
    return EXIT_OK
