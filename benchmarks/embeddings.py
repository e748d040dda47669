"""Embeddings against llama.cpp: the same vectors (on a file made by llama.cpp's own converter), and the time to embed
a batch of passages, both engines in fresh worker processes side by side.

    .venv/bin/python benchmarks/embeddings.py --peer-python PY [--llama-cpp DIR] [--isa avx2] [--repeats 3]

Parity: a tiny random Qwen3 saved as Qwen3-Embedding is (a sentence-transformers folder: last-token pooling, a
tokenizer whose post-processor ends every input with <|endoftext|>) is converted by convert_hf_to_gguf.py at F32
(it writes qwen3.pooling_type and add_eos as it does for the real model); both engines embed the same texts from
it, and each vector is compared with transformers' (the folder's last hidden state at the last token, normalized).
Then a tiny random BertModel and a tiny NomicBertModel (nomic-ai's layout) likewise, mean pooling, with their
WordPiece ids compared with llama.cpp's.

Speed: N passages of 100-300 words embedded in one call by each engine, 2 threads: the whole batch's wall time
(tokens per second) and the worker's peak RSS, the two engines alternating. llama-cpp-python's `embed` cuts each
input to its batch, so its batch (and context) is the longest passage's tokens, at least llama.cpp's default 512: a
batch of 2048 in a context of 4096 was slower (SmolLM2: 205 against 298 tok/s), 512 cuts the longer passages; an
encoder's stops at its positions. The files: a Qwen3-Embedding-0.6B-shaped GGUF (the random Qwen3-0.6B folder
benchmarks/hf_folder.py makes, with last-token pooling, converted at Q8_0 by llama.cpp's converter), the built-in
SmolLM2 (a chat model: mean pooling on both sides, as Ollama pools one), and the encoders in BERTS (random weights,
converted at F16 and Q8_0 by llama.cpp's converter). `--files TEXT` runs only the rows whose name holds TEXT.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests"), str(HERE)]

import matrix_models  # noqa: E402

PEER = """
import json, sys, time
# The peak resident set of this process's own memory (VmHWM; ru_maxrss also keeps a parent's across exec: a benchmark
# that has just built a model in-process would be reported for the worker)
def hwm_mb():
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:")) / 1024
from llama_cpp import Llama
path, texts, pooling = sys.argv[1], json.loads(open(sys.argv[2]).read()), int(sys.argv[3])
vocab = Llama(model_path=path, vocab_only=True, verbose=False)
ids = [vocab.tokenize(x.encode(), add_bos=True, special=True) for x in texts]
lengths = [len(x) for x in ids]
# embed() cuts an input to the batch: the smallest batch that holds each whole (an encoder's: within its positions)
batch = max(512, max(lengths))
if vocab.metadata.get("general.architecture") == "bert":
    batch = min(batch, int(vocab.metadata["bert.context_length"]))
t = time.perf_counter()
llm = Llama(model_path=path, embedding=True, n_ctx=batch, n_batch=batch, n_ubatch=batch, n_threads=2,
            pooling_type=pooling, verbose=False)
load = time.perf_counter() - t
t = time.perf_counter()
vectors = llm.embed(texts, normalize=True)
seconds = time.perf_counter() - t
tokens = sum(lengths)
json.dump({"vectors": vectors, "seconds": seconds, "tokens": tokens, "ids": ids, "load": load,
           "rss_mb": hwm_mb()}, open(sys.argv[4], "w"))
"""

OURS = """
import json, sys, time
# The peak resident set of this process's own memory (VmHWM; ru_maxrss also keeps a parent's across exec: a benchmark
# that has just built a model in-process would be reported for the worker)
def hwm_mb():
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:")) / 1024
from nanochat.engine import LLM
from nanochat.engine.pooling import PoolingParams
path, texts, pooling = sys.argv[1], json.loads(open(sys.argv[2]).read()), sys.argv[3]
t = time.perf_counter()
llm = LLM(path, max_model_len=4096, max_num_batched_tokens=4096, cpu_threads=2)
load = time.perf_counter() - t
t = time.perf_counter()
results = llm.embed(texts, PoolingParams(pooling) if pooling != "file" else None)
seconds = time.perf_counter() - t
json.dump({"vectors": [r.embedding for r in results], "seconds": seconds,
           "ids": [llm.tokenizer.encode(x) for x in texts], "load": load,
           "tokens": sum(r.stats.prompt_tokens for r in results),
           "rss_mb": hwm_mb()}, open(sys.argv[4], "w"))
"""

LLAMA_POOLING = {"mean": 1, "cls": 2, "last": 3, "file": -1}   # llama.cpp's enum; -1: the file's own


def run(python: str, script: str, path: Path, texts: list[str], pooling: str, tmp: Path, env: dict) -> dict:
    inputs, out = tmp / "texts.json", tmp / "out.json"
    inputs.write_text(json.dumps(texts))
    arg = str(LLAMA_POOLING[pooling]) if script is PEER else pooling
    subprocess.run([python, "-c", script, str(path), str(inputs), arg, str(out)], check=True, env=env)
    return json.loads(out.read_text())


def embedder_folder(source: Path, out: Path) -> Path:
    """`source` (a Qwen3 folder) as Qwen3-Embedding's folder is laid out: last-token pooling, and a tokenizer that
    ends every input with <|endoftext|>. The weights are linked, not copied."""
    from tokenizers import Tokenizer, processors

    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve()) if f.suffix == ".safetensors" else shutil.copy(f, out / f.name)
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    end = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1",
                                                       special_tokens=[("<|endoftext|>", end)])
    (out / "tokenizer.json").unlink()
    tok.save(str(out / "tokenizer.json"))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    return out


def passages(n: int, seed: int = 0) -> list[str]:
    words = ("the model reads every token of a passage once and keeps one vector for it so that a search can "
             "find the passages nearest a question by their cosine similarity in the index built from a "
             "library of documents code notes and messages").split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(100, 300))) + "." for _ in range(n)]


def parity(args, tmp: Path, env: dict) -> None:
    import torch
    import transformers

    from conftest import make_hf_model

    folder = embedder_folder(make_hf_model("qwen3", tmp / "tiny", seed=4), tmp / "tiny-embedder")
    path = matrix_models.convert_hf(folder, tmp / "tiny-embedder.gguf", "f32", Path(args.llama_cpp), "qwen2")
    texts = ["The quick brown fox jumps over the lazy dog.", "Hello there! How are you today?",
             "def add(a, b):\n    return a + b\n"]
    theirs = run(args.peer_python, PEER, path, texts, "file", tmp, env)
    ours = run(sys.executable, OURS, path, texts, "file", tmp, env)
    hf = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    print("parity (tiny Qwen3 embedder converted by llama.cpp at F32, last-token pooling):")
    _compare(texts, ours, theirs, hf, tok, lambda h: h[-1])
    # Encoders: both ways attention, WordPiece; accents, CJK, a [CLS] inside the text and a long word test the
    # tokenizers
    from conftest import make_bert_folder

    texts += ["Naïve CAFÉ résumé, 数字 and the text; " + "x" * 120, "a [CLS] inside the text"]
    for name, nomic in (("BertModel", False), ("NomicBertModel", True)):
        folder = make_bert_folder(tmp / name, context=512, seed=4, nomic=nomic)
        path = matrix_models.convert_hf(folder, tmp / f"{name}.gguf", "f32", Path(args.llama_cpp), "default")
        theirs = run(args.peer_python, PEER, path, texts, "mean", tmp, env)
        ours = run(sys.executable, OURS, path, texts, "mean", tmp, env)
        print(f"parity (tiny {name} converted by llama.cpp at F32, mean pooling):")
        _compare(texts, ours, theirs, transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval(),
                 transformers.AutoTokenizer.from_pretrained(folder), lambda h: h.mean(0), ours_ids=True)


def _compare(texts, ours, theirs, hf, tok, pool, ours_ids: bool = False) -> None:
    """Each engine's vector against transformers' (pooled by `pool`, normalized); ours_ids: transformers reads the
    ids nanochat's tokenizer gave (transformers cuts a word over 100 characters to one [UNK], llama.cpp does not),
    and they are checked against llama.cpp's."""
    import numpy as np
    import torch

    for i, text in enumerate(texts):
        ids = ours["ids"][i] if ours_ids else tok(text)["input_ids"]
        with torch.no_grad():
            ref = pool(hf(torch.tensor([ids])).last_hidden_state[0].double())
        ref = (ref / ref.norm()).numpy()
        a, b = np.array(ours["vectors"][i]), np.array(theirs["vectors"][i])
        same = f"ids {'equal' if ours['ids'][i] == theirs['ids'][i] else 'DIFFER'} to llama.cpp's; " if ours_ids else ""
        print(f"  text {i}: {len(ids)} tokens; {same}max |nanochat - transformers| {np.abs(a - ref).max():.2e}, "
              f"max |llama.cpp - transformers| {np.abs(b - ref).max():.2e}, cosine(nanochat, llama.cpp) "
              f"{float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)):.6f}")


def speed(args, tmp: Path, env: dict) -> None:
    import numpy as np

    from hf_folder import make_folder

    cache = matrix_models.default_models_dir()
    files = []
    shaped = cache / "Qwen3-Embedding-0.6B-shaped.Q8_0.gguf"
    if not shaped.exists():
        folder = embedder_folder(make_folder(cache / "Qwen3-0.6B-random-hf"), tmp / "embedder-0.6b")
        matrix_models.convert_hf(folder, shaped, "q8_0", Path(args.llama_cpp), "qwen2")
    files.append(("Qwen3-Embedding-0.6B-shaped Q8_0 (last)", shaped, "file"))
    from conftest import smollm_gguf_path
    files.append(("SmolLM2-135M-Instruct Q4_1 (mean)", smollm_gguf_path(), "mean"))
    files += bert_files(args, tmp, cache)
    texts = passages(args.passages)
    for name, path, pooling in files:
        if args.files and args.files not in name:
            continue
        rows = {"nanochat": [], "llama.cpp": []}
        for _ in range(args.repeats):
            for engine, python, script in (("nanochat", sys.executable, OURS), ("llama.cpp", args.peer_python, PEER)):
                rows[engine].append(run(python, script, path, texts, pooling, tmp, env))
        cos = [float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))
               for a, b in zip(rows["nanochat"][0]["vectors"], rows["llama.cpp"][0]["vectors"])]
        tok_s = {e: statistics.median(r["tokens"] / r["seconds"] for r in rs) for e, rs in rows.items()}
        rss = {e: statistics.median(r["rss_mb"] for r in rs) for e, rs in rows.items()}
        tokens = {e: rs[0]["tokens"] for e, rs in rows.items()}
        print(f"{name}, {len(texts)} passages ({tokens['nanochat']} tokens; llama.cpp counts {tokens['llama.cpp']}), "
              f"{args.repeats} runs each, medians:")
        print(f"  tok/s nanochat {tok_s['nanochat']:.1f}, llama.cpp {tok_s['llama.cpp']:.1f}: "
              f"{tok_s['nanochat'] / tok_s['llama.cpp']:.2f}x  (runs: "
              + ", ".join(f"{r['tokens'] / r['seconds']:.0f}" for r in rows["nanochat"]) + " / "
              + ", ".join(f"{r['tokens'] / r['seconds']:.0f}" for r in rows["llama.cpp"]) + ")")
        load = {e: statistics.median(r["load"] for r in rs) for e, rs in rows.items()}
        print(f"  peak RSS MB nanochat {rss['nanochat']:.0f}, llama.cpp {rss['llama.cpp']:.0f}; load s nanochat "
              f"{load['nanochat']:.2f}, llama.cpp {load['llama.cpp']:.2f}; cosine between the engines' vectors min "
              f"{min(cos):.5f}, median {statistics.median(cos):.5f}")


# The encoders people embed with: bge-small-en-v1.5 (all-MiniLM-L12's widths too), bge-large-en-v1.5 /
# mxbai-embed-large-v1 (the same shapes; CLS pooling) and nomic-embed-text-v1.5 (mean pooling); random weights, a
# WordPiece vocabulary trained on the passages' words.
BERTS = {"bge-small-en-v1.5-shaped": (dict(hidden=384, layers=12, heads=12, intermediate=1536), "cls"),
         "bge-large-en-v1.5-shaped": (dict(hidden=1024, layers=24, heads=16, intermediate=4096), "cls"),
         "nomic-embed-text-v1.5-shaped": (dict(hidden=768, layers=12, heads=12, intermediate=3072, nomic=True),
                                          "mean")}


def bert_files(args, tmp: Path, cache: Path) -> list[tuple[str, Path, str]]:
    from conftest import make_bert_folder

    files = []
    for name, (shape, pooling) in BERTS.items():
        for outtype in ("f16", "q8_0"):
            path = cache / f"{name}.{outtype.upper()}.gguf"
            if not path.exists():
                folder = tmp / name
                if not folder.exists():
                    make_bert_folder(folder, passages(200, seed=9), vocab_size=2000, context=512, **shape)
                matrix_models.convert_hf(folder, path, outtype, Path(args.llama_cpp), "default")
            files.append((f"{name} {outtype.upper()} ({pooling})", path, pooling))
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer-python", required=True, help="a Python with llama-cpp-python")
    ap.add_argument("--llama-cpp", default=str(matrix_models.LLAMA_CPP_SRC),
                    help="llama.cpp's source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--isa", choices=["avx512", "avx2"], help="nanochat's kernels for this ISA")
    ap.add_argument("--passages", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["parity", "speed"], help="run one of the two parts")
    ap.add_argument("--files", help="only the speed rows whose name contains this")
    args = ap.parse_args()
    env = dict(os.environ)
    if args.isa:
        env["NANOCHAT_CPU_ISA"] = args.isa
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.only != "speed":
            parity(args, tmp, env)
        if args.only != "parity":
            speed(args, tmp, env)


if __name__ == "__main__":
    main()
