"""nanochat's SentencePiece ('llama') GGUF tokenizer against llama.cpp's, on the same files.

    .venv/bin/python benchmarks/tokenizer_parity.py [--peer-python /path/to/venv/bin/python] [--json]

Trains a small SentencePiece BPE model (byte fallback, user-defined symbols; tests/gguf_writer.py),
writes it as vocabulary-only GGUF files the way llama.cpp's converter does, in variants:

  llama     add_space_prefix and add_bos left to their defaults (true)
  gemma     trained without SentencePiece's dummy prefix, add_space_prefix false, and Gemma's kind of
            user-defined whitespace tokens (runs of spaces, "\n\n"), written with literal spaces
  phi3      general.name "Phi-3 mini" (llama.cpp strips the whitespace after its special tokens)
  extra-ws  tokenizer.ggml.remove_extra_whitespaces true (llama.cpp ignores it for these vocabularies)
  ties-10   the llama vocabulary with scores rounded to tens (ties-50: to fifties), so that entries share
            scores: there a BPE ranking can only approximate llama.cpp's leftmost-first choice (trained
            SentencePiece vocabularies give their pieces distinct scores)

and tokenizes a corpus of tricky strings with both. llama.cpp: llama-cpp-python in --peer-python
(Llama(vocab_only=True)), tokenize(add_bos=True, special=True), and llama_detokenize(remove_special=False,
unparse_special=True) of the ids tokenized without BOS. nanochat: Tokenizer.from_gguf(file), encode(text)
and decode(ids). Prints, per variant, how many strings got identical ids and identical text back, and
the first differences.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PEER = r"""
import ctypes, json, sys
import llama_cpp

job = json.load(sys.stdin)
out = {}
for name, path in job["files"].items():
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    ids, texts = [], []
    for text in job["texts"]:
        ids.append(llm.tokenize(text.encode(), add_bos=True, special=True))
        plain = llm.tokenize(text.encode(), add_bos=False, special=True)
        arr = (llama_cpp.llama_token * max(1, len(plain)))(*plain)
        buf = ctypes.create_string_buffer(64 * len(plain) + 64)
        n = llama_cpp.llama_detokenize(vocab, arr, len(plain), buf, len(buf), False, True)
        texts.append([plain, buf.raw[:n].decode("utf-8", "replace")])
    out[name] = {"ids": ids, "decoded": texts}
json.dump(out, sys.stdout)
"""

TRAIN = ("The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.\n"
         "def add(a, b):\n    return a + b\n\n\nclass Point:\n        x: int = 0\n\nprint(add(1, 2))  # three\n"
         "Hello there! How are you today? I am fine, thank you. 12345 67890 3.14159 2024-01-31\n"
         "caf\u00e9 na\u00efve \u00fcber \u4f60\u597d \u4e16\u754c \u65e5\u672c\u8a9e \U0001f600 tab\tseparated\n"
         "    indented   with   runs   of   spaces\n").splitlines() * 30
USER_DEFINED = ("<sep>", "<|end|>", "<|endoftext|>")  # llama.cpp's Phi-3 rule needs <|endoftext|>
HANDMADE = [
    "", " ", "  ", "\n", "\t", "Hello world", " leading", "   three leading", "trailing   ", "a  b   c    d",
    "tabs\tand\t\ttabs", "new\nlines\n\n\nand\r\nCRLF", "    return a + b\n", "digits 0123456789 3.14159 1,000",
    "emoji \U0001f600\U0001f44d\U0001f3fd \U0001f1eb\U0001f1f7 \U0001f680",
    "CJK \u4f60\u597d\u4e16\u754c \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4",
    "unseen \u2603 \u00df \u03a9 \u2211 \u0416", "\x00\x01\x7f control bytes", "caf\u00e9 na\u00efve \u00fcber",
    "\u2581 literal lower block \u2581\u2581", "<s>starts with BOS", "x</s>y", "<unk> unknown", "<s><s>",
    "a<sep>b", "a <sep> b", "<sep>\n  indented", "hi<|end|>\nnext<|end|> x", "a<|endoftext|>  b", "<|end|><|end|>",
    "</s> </s>  </s>",
    "The quick brown fox jumps over the lazy dog.", "It was the best of times, it was the worst of times.",
    "class Point:\n        x: int = 0\n", "\u00a0nbsp\u3000ideographic\u200bzero-width",
]
PIECES = ["a", "the", " ", "  ", "    ", "\t", "\n", "\n\n", "1", "23", "\u00e9", "\u4f60", "\u2603", "\U0001f600",
          "\U0001f680", "<s>", "</s>", "<sep>", "<|end|>", "<unk>", ".", ",", "quick", " fox", "return", "x"]


def corpus(n_random: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return HANDMADE + ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 20))) for _ in range(n_random)]


def write_files(folder: Path) -> dict[str, Path]:
    import numpy as np
    from gguf_writer import MetaValue, sentencepiece_tokenizer_metadata, train_sentencepiece, write_vocab_gguf

    sp = train_sentencepiece(TRAIN, 500, USER_DEFINED)
    gemma_user = USER_DEFINED + ("\u2581\u2581", "\u2581\u2581\u2581\u2581", "\n\n")
    sp_plain = train_sentencepiece(TRAIN, 500, gemma_user, add_dummy_prefix=False)
    llama = sentencepiece_tokenizer_metadata(sp, USER_DEFINED)
    scores = llama["tokenizer.ggml.scores"]

    def ties(step: int) -> dict:
        rounded = (np.round(np.asarray(scores.value) / step) * step).tolist()
        return dict(llama, **{"tokenizer.ggml.scores": MetaValue(rounded, scores.vtype, scores.sub_type)})

    variants = {
        "llama": (llama, "tiny-vocab"),
        "gemma": (sentencepiece_tokenizer_metadata(sp_plain, gemma_user, add_space_prefix=False), "tiny-vocab"),
        "phi3": (llama, "Phi-3 mini"),
        "extra-ws": (sentencepiece_tokenizer_metadata(sp, USER_DEFINED, remove_extra_whitespaces=True), "tiny-vocab"),
        "ties-10": (ties(10), "tiny-vocab"),
        "ties-50": (ties(50), "tiny-vocab"),
    }
    return {name: write_vocab_gguf(folder / f"{name}.gguf", meta, name=model_name)
            for name, (meta, model_name) in variants.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer-python", help="an interpreter with llama-cpp-python (default: $NANOCHAT_PEER_PYTHON, "
                                           "else this one)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = ap.parse_args()

    from nanochat.models.text.tokenizer import Tokenizer

    texts = corpus()
    with tempfile.TemporaryDirectory() as tmp:
        files = write_files(Path(tmp))
        job = json.dumps({"files": {k: str(v) for k, v in files.items()}, "texts": texts})
        peer_python = args.peer_python or os.environ.get("NANOCHAT_PEER_PYTHON") or sys.executable
        proc = subprocess.run([peer_python, "-c", PEER], input=job, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"llama.cpp side failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        peer = json.loads(proc.stdout)
        report = {}
        for name, path in files.items():
            tok = Tokenizer.from_gguf(path)
            ids_same = text_same = 0
            diffs = []
            for text, ref_ids, (plain, ref_text) in zip(texts, peer[name]["ids"], peer[name]["decoded"]):
                ours = tok.encode(text)
                decoded = tok.decode(plain)
                ids_same += ours == ref_ids
                text_same += decoded == ref_text
                if (ours != ref_ids or decoded != ref_text) and len(diffs) < 3:
                    diffs.append({"text": text, "llama.cpp": ref_ids, "nanochat": ours,
                                  "llama.cpp text": ref_text, "nanochat text": decoded})
            report[name] = {"strings": len(texts), "same ids": ids_same, "same text": text_same, "diffs": diffs}
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
        return 0
    print(f"{'variant':10} {'strings':>8} {'same ids':>9} {'same text':>10}")
    for name, r in report.items():
        print(f"{name:10} {r['strings']:8} {r['same ids']:9} {r['same text']:10}")
    for name, r in report.items():
        for d in r["diffs"]:
            print(f"\n{name}: {d['text']!r}\n  llama.cpp {d['llama.cpp']}\n  nanochat  {d['nanochat']}"
                  f"\n  llama.cpp text {d['llama.cpp text']!r}\n  nanochat text  {d['nanochat text']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
