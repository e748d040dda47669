"""Where a batched decode step's time goes on a GPU: the host's share and the device's kernels.

    python benchmarks/gpu_profile.py MODEL [--device cuda] [--num-seqs 256] [--steps 20] [--max-input-len N] [--json]

Starts nano-vllm's bench workload (engine/serve/bench.py make_workload: prompts of 100-1024 random ids,
temperature 0.6), steps the engine until every sequence has been prefilled, then times `--steps` pure decode
steps: per step the wall time (with the device synchronized), the engine's phases (schedule, the runner's
step inputs and forward, sampling and events: everything else), and under torch.profiler the device's
busy time and its top kernels. benchmarks/gpu_check.py runs it after the bench; `--device cpu` runs it here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict


def _timed(obj, name: str, totals: dict, sync) -> None:
    """Wrap obj.name so that each call adds its wall time (device synchronized after it) to totals[name]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        out = inner(*args, **kwargs)
        sync()
        totals[name] += time.perf_counter() - started
        return out

    setattr(obj, name, wrapper)


def profile(model: str, device: str, num_seqs: int, steps: int, max_input_len: int | None = None) -> dict:
    import torch

    from nanochat.engine import LLM
    from nanochat.engine.serve.bench import make_workload, spec_from

    spec = spec_from(workload="nano-vllm", num_seqs=num_seqs, max_input_len=max_input_len)
    llm = LLM(model, device=device, max_model_len=spec.max_model_len, max_num_seqs=num_seqs,
              max_num_batched_tokens=16384)
    engine = llm.engine
    work = make_workload(spec, engine.loaded.config.vocab_size)
    for prompt, sp in zip(work.prompts, work.params):
        # every sequence decodes through the timed steps
        engine.add_request(prompt, dataclasses.replace(sp, max_tokens=max(sp.max_tokens, steps + 8)))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    sync()
    phases: dict[str, float] = defaultdict(float)
    _timed(engine.scheduler, "schedule", phases, sync)
    _timed(engine.runner, "step_inputs", phases, sync)
    _timed(engine.runner, "forward", phases, sync)
    walls, batch = [], len(engine.scheduler.running)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            sync()
            walls.append(time.perf_counter() - started)
    total = sum(walls)
    kernels = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if device.startswith("cuda") and e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name]
            k[0] += e.device_time_total / 1000
            k[1] += 1
    device_ms = sum(v[0] for v in kernels.values())
    ms = lambda s: round(1000 * s / steps, 3)  # noqa: E731
    phase_ms = {name: ms(t) for name, t in phases.items()}
    phase_ms["sampling, events and the rest"] = round(ms(total) - sum(phase_ms.values()), 3)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(seq.request_id)
    return {
        "model": model, "device": device, "batch": batch, "steps": steps,
        "step_ms": {"median": round(1000 * statistics.median(walls), 3), "mean": ms(total)},
        "phases_ms_per_step": phase_ms,
        "device_busy_ms_per_step": round(device_ms / steps, 3) if kernels else None,
        "top_kernels": [{"name": name[:120], "ms_per_step": round(t / steps, 3), "calls_per_step": round(n / steps, 1)}
                        for name, (t, n) in top],
        "graphs": engine.runner.graphs is not None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-input-len", type=int, help="prompts up to this long (default: the workload's 1024)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    out = profile(args.model, args.device, args.num_seqs, args.steps, args.max_input_len)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['batch']} sequences, {out['steps']} decode steps on {out['device']}: "
          f"median {out['step_ms']['median']} ms a step (graphs: {out['graphs']})")
    for name, t in out["phases_ms_per_step"].items():
        print(f"  {name:32} {t:8.3f} ms")
    if out["device_busy_ms_per_step"] is not None:
        print(f"  device busy {out['device_busy_ms_per_step']} ms a step; top kernels:")
        for k in out["top_kernels"]:
            print(f"    {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<6} {k['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
