"""Accuracy of the host MoE expert kernels (kernels/moe_cpu.py) against a float64 reference.

    .venv/bin/python benchmarks/expert_accuracy.py [--hidden 2048] [--inter 768] [--tokens 16]

Per weight type: the relative Frobenius error ||y - y_ref|| / ||y_ref|| of
- one matmul, `moe_cpu.quant_matmul(W, x)` vs x @ dequantize(W)^T in float64 (x Gaussian rows);
- a whole routed expert FFN (`HostExperts`, top-4 of 8 experts) vs the same FFN in float64 on the
  dequantized weights (silu(gate x) * up x, then down, weighted sum over the token's experts).
Random GGML blocks with sane scales: the error comes from the activation rounding, not the weights.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from nanochat.kernels import gguf_quants as gq
from nanochat.kernels import moe_cpu
from nanochat.kernels.moe_cpu import HostExperts
from nanochat.kernels.qweight import QuantWeight

from bench_experts import random_stack   # beside this script

TYPES = {"Q4_K": gq.Q4_K, "Q5_K": gq.Q5_K, "Q6_K": gq.Q6_K, "Q8_0": gq.Q8_0}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    h, i, n, e, k = args.hidden, args.inter, args.tokens, 8, 4
    gen = torch.Generator().manual_seed(0)
    for name, t in TYPES.items():
        rng = np.random.default_rng(t)
        g, u, d = random_stack(t, e, i, h, rng), random_stack(t, e, i, h, rng), random_stack(t, e, h, i, rng)
        wg, wu, wd = ([s.dense_expert(j).double() for j in range(e)] for s in (g, u, d))
        x = torch.randn(n, h, generator=gen)
        y = moe_cpu.quant_matmul(QuantWeight(t, (i, h), g.data[0]), x)
        one = rel(y, x.double() @ wg[0].T)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
        weights = torch.rand(n, k, generator=gen)
        out = HostExperts(g, u, d, backend="kernel")(x, ids, weights)
        ref = torch.zeros(n, h, dtype=torch.float64)
        for tok in range(n):
            for j in range(k):
                ex = int(ids[tok, j])
                act = F.silu(wg[ex] @ x[tok].double()) * (wu[ex] @ x[tok].double())
                ref[tok] += float(weights[tok, j]) * (wd[ex] @ act)
        print(f"{name}: one matmul {i}x{h} rel. error {one:.2e}; expert FFN (top-{k} of {e}) {rel(out, ref):.2e}")


if __name__ == "__main__":
    main()
