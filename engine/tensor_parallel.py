"""Tensor-parallel ranks: rank 0 is the engine, ranks 1..N-1 are workers that mirror its model runner.

    python -m nanochat.engine.tensor_parallel      (a worker; rank and rendezvous from the environment)

Every rank is a torch.distributed process with the usual launch environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK). On one machine rank 0 starts the workers itself with that
environment; across machines `torchrun` (or any launcher that sets it) starts every rank, and ranks
other than 0 become workers (app/cli.py, LLMEngine). The same worker code serves both.

Calls from rank 0 to the workers go through torch.distributed itself: rank 0 broadcasts each call
(method name and arguments) over a gloo group, and every rank then runs it. nano-vllm uses shared
memory and an event instead; a broadcast costs a little more per step but is the same code on one
machine and across several, and a dead rank makes it fail rather than wait. The calls are the model runner's: one step's prepared inputs (token ids, positions,
slots, block tables: what the runner built on rank 0, so no rank needs the scheduler), a KV copy,
exit. The compute (the model's all-reduces) runs on NCCL on CUDA and on the same gloo group on CPU.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from nanochat.engine.config import engine_process_env, launched_rank
from nanochat.models.errors import ModelLoadError, one_line
from nanochat.models.parallel.sharding import TensorParallel


class WorkerLost(RuntimeError):
    """A tensor-parallel rank stopped; the engine cannot go on."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Exit when the process that started this one goes (no orphan worker after rank 0 is killed). A
    polling thread rather than PR_SET_PDEATHSIG, which fires when the starting *thread* ends."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="nanochat-tp-parent", daemon=True).start()


@dataclass
class RankGroup:
    """One rank's view of the group: the model's collectives (tp) and the control channel."""

    tp: TensorParallel
    control: object            # gloo ProcessGroup for calls and agreements
    serving: bool = False      # every rank built its shard: the workers take calls

    @classmethod
    def join(cls, rank: int, size: int) -> "RankGroup":
        """Join the group over gloo (the control channel; the CPU's compute too)."""
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size)
        # None is the default group: nothing here keeps its object alive after destroy_process_group (one
        # that lives on to the interpreter's exit can abort it there)
        return cls(TensorParallel(rank, size, None), None)

    def use_device(self, device: torch.device, same_machine: bool = False, alive=None) -> None:
        """On CUDA the model's collectives run on NCCL. On the CPU, ranks that rank 0 started on its own
        machine (same_machine, rank 0's say) add through shared memory: gloo's loopback all-reduce is
        slow next to a decode step, and it runs twice a layer (models/parallel/shm_reduce.py). Every rank
        calls this, in the same order."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.tp = replace(self.tp, group=dist.new_group(backend="nccl"))
            return
        from nanochat.models.parallel.shm_reduce import ShmAllReduce
        mine = ShmAllReduce.create(self.tp.size, alive) if self.tp.rank == 0 and same_machine else None
        path = self.broadcast(None if mine is None else mine.path)
        if path is None:
            return
        shm = mine or ShmAllReduce(path, self.tp.rank, self.tp.size)
        dist.barrier(group=self.control)
        if mine is not None:
            mine.unlink()   # every rank has it mapped: the name can go, so nothing is left behind
        self.tp = replace(self.tp, shm=shm)

    def broadcast(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def agree(self, error: str | None) -> None:
        """Every rank says whether it got here; any rank's error is raised on all of them."""
        errors = [None] * self.tp.size
        dist.all_gather_object(errors, error, group=self.control)
        first = next(((r, e) for r, e in enumerate(errors) if e), None)
        if first is not None:
            rank, message = first
            raise ModelLoadError(message if rank == self.tp.rank else f"tensor-parallel rank {rank}: {message}")
        self.serving = True

    def leave(self) -> None:
        """Leave the group together: a rank that tears its connections down while another is still in its
        last call can abort either process at exit (seen under load with torchrun)."""
        if dist.is_initialized():
            try:
                dist.barrier(group=self.control)
            except RuntimeError:   # a rank is gone already: nothing to wait for
                pass
            dist.destroy_process_group()


class Workers(RankGroup):
    """Rank 0's side: starts the workers (unless a launcher did), sends them calls, stops them."""

    def __init__(self, size: int, device: torch.device, model: str, config):
        if dist.is_initialized():
            raise RuntimeError("this process already runs a tensor-parallel engine: close() it first")
        self.procs: list[subprocess.Popen] = []
        if launched_rank() is None:
            port = str(_free_port())
            for rank in range(1, size):
                env = dict(engine_process_env(), RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                self.procs.append(subprocess.Popen([sys.executable, "-m", "nanochat.engine.tensor_parallel"],
                                                   env=env, stdin=subprocess.DEVNULL))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        try:
            joined = RankGroup.join(0, size)
        except BaseException:
            self.stop()
            raise
        super().__init__(joined.tp, joined.control)
        atexit.register(self.stop)
        self.broadcast((model, config))
        self.use_device(device, same_machine=bool(self.procs),
                        alive=lambda: all(proc.poll() is None for proc in self.procs))
        if device.type == "cuda" and self.procs:
            threading.Thread(target=self._watch, name="nanochat-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        """CUDA: a collective with a dead rank waits on NCCL's timeout (minutes), not an error as on gloo;
        so when a worker dies while serving, rank 0's process stops at once with one line (the engine
        process: its client shows the line and starts a new engine on the next message)."""
        while self.procs:
            for rank, proc in enumerate(list(self.procs), start=1):
                if proc.poll() is not None and self.serving:
                    code = proc.returncode
                    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                    print(f"tensor-parallel rank {rank} stopped ({how})", file=sys.stderr, flush=True)
                    os._exit(1)
            time.sleep(0.2)

    def call(self, method: str, *args) -> None:
        """Have every worker run its runner's `method(*args)` (rank 0 runs it itself after)."""
        try:
            self.broadcast((method, args))
        except RuntimeError as e:
            raise self.lost(e) from None

    def lost(self, error: BaseException) -> BaseException:
        """The exception to raise for a failed collective: WorkerLost naming a rank that stopped."""
        for rank, proc in enumerate(self.procs, start=1):
            try:
                code = proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                continue
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            return WorkerLost(f"tensor-parallel rank {rank} stopped ({how})")
        if isinstance(error, WorkerLost):
            return error
        return WorkerLost(f"tensor-parallel communication failed: {one_line(error)[:200]}")

    def stop(self) -> None:
        """Tell the workers to exit, then make sure they have (no process is left behind)."""
        if dist.is_initialized() and self.serving:
            try:
                self.broadcast(("exit", ()))
            except RuntimeError:
                pass
        self.serving = False
        self.leave()
        for proc in self.procs:
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        atexit.unregister(self.stop)


def worker_device(config, rank: int) -> torch.device:
    device = config.resolved_device()
    if device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return device


def run_worker() -> int:
    """A worker rank: join, build this rank's shard of the model, then run rank 0's calls until exit."""
    from nanochat.engine.model_runner import ModelRunner
    from nanochat.models.formats.loader import build_model, open_source

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C belongs to rank 0's front end
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    group = RankGroup.join(rank, size)
    model, config = group.broadcast()
    device = worker_device(config, rank)
    group.use_device(device)
    if device.type == "cpu":
        torch.set_num_threads(config.cpu_thread_count())
        config.use_cpu_isa()
    dtype = config.resolved_dtype(device)
    built, error = None, None
    try:
        source = open_source(model)
        built = build_model(source, device, dtype, config.kvcache_block_size, config.max_model_len,
                            config.dequantize, config.moe_offload, config.quantize, None, config.pack_cache,
                            tp=group.tp, kernels=config.kernel_options())
    except Exception as e:
        error = one_line(e)
    try:
        group.agree(error)
        runner = ModelRunner(config, built, device, dtype, ranks=group)
        while True:
            method, args = group.broadcast()
            if method == "exit":
                break
            getattr(runner, method)(*args)
    except Exception:   # a shard that failed to load, or rank 0 went away: rank 0 reports, a worker stops
        return 1
    finally:
        group.leave()
    return 0


def run_worker_and_exit() -> None:
    """run_worker, then end the process: a worker holds nothing to save, and skipping the interpreter's
    teardown skips torch's threads' too."""
    code = run_worker()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_worker_and_exit()
