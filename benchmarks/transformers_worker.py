"""transformers side of benchmarks/peers.py: `generate` on the GGUF file (dequantized to fp32), or on a Hugging Face
folder in the dtype asked (benchmarks/hf_folder.py).

Same line protocol as llamacpp_worker.py (one JSON request per line on stdin, one reply per line on
stdout). A process of its own so that it runs with torch's default environment (nanochat's worker runs with its
engine process's OMP_WAIT_POLICY=PASSIVE, which would change transformers' speed too).

    {"cmd": "load", "model": PATH, "threads": N[, "dtype": "auto"|"float32"|...]}
                                                  -> {"version", "n_vocab", "load_s"} (from_pretrained alone)
    {"cmd": "prefill", "ids": [...]}              -> {"seconds"} (prompt to its first token)
    {"cmd": "decode", "ids": [...], "n": N}       -> {"seconds", "tokens", "ids"} (timed after the first token)
    {"cmd": "quit"}
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")   # the GGUF conversion bar ignores transformers' own switches
STATE: dict = {}


def cmd_load(req: dict) -> dict:
    import torch
    import transformers

    torch.set_num_threads(int(req["threads"]))
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    path = Path(req["model"])
    t0 = time.perf_counter()
    if path.is_dir():   # a Hugging Face folder: in the dtype asked ("auto": the checkpoint's own)
        dtype = req.get("dtype", "auto")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype if dtype == "auto" else getattr(torch, dtype)).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    STATE["model"] = model
    return {"version": transformers.__version__, "n_vocab": model.config.vocab_size,
            "load_s": time.perf_counter() - t0}


def _generate(ids: list[int], n: int) -> tuple[list[float], list[int]]:
    """Timestamps of the prompt hand-off and of each generated token, and the generated ids."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    stamps: list[float] = []

    class Stamps(BaseStreamer):
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    x = torch.tensor([ids])
    with torch.inference_mode():
        y = STATE["model"].generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                    do_sample=False, streamer=Stamps(), pad_token_id=0)
    return stamps, y[0, len(ids):].tolist()


def cmd_prefill(req: dict) -> dict:
    t0 = time.perf_counter()
    stamps, _ = _generate(req["ids"], 1)
    return {"seconds": stamps[-1] - t0}


def cmd_decode(req: dict) -> dict:
    stamps, out = _generate(req["ids"], int(req["n"]))
    stamps = stamps[1:]   # the first put is the prompt
    return {"seconds": stamps[-1] - stamps[0], "tokens": len(stamps) - 1, "ids": out}


COMMANDS = {"load": cmd_load, "prefill": cmd_prefill, "decode": cmd_decode}


if __name__ == "__main__":
    from worker_protocol import serve   # beside this file (the script's directory is on sys.path)

    sys.exit(serve(COMMANDS))
