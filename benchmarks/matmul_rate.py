"""Matmul rate at decode shapes: XLA:CPU (jaxgrpo's flags) against PyTorch, float32.

A decode step multiplies B = 32 rows by every weight of the model, so the rate of these skinny
matmuls, not that of a large square one, bounds how fast a step can be (a CPU's quoted rate
is a large square one's). This prints GFLOP/s for `[B, D] x [D, N]` at SmolLM2-135M's
projection shapes (and its LM head), each timed as the best of `--repeats` calls:

    python benchmarks/matmul_rate.py [--batch 32] [--repeats 20]

The weights are stored as the decode path stores them (`[N, D]`, multiplied as `x @ W.T`).
"""

from __future__ import annotations

import argparse
import time

from jaxgrpo.core.host import keep_freed_memory, use_cpu_xla_flags

# (name, D in, N out) for SmolLM2-135M: hidden 576, 9 query heads and 3 kv heads of 64, mlp 1536.
SHAPES = [
    ("q", 576, 576),
    ("k / v", 576, 192),
    ("o", 576, 576),
    ("gate_up", 576, 3072),
    ("down", 1536, 576),
    ("head", 576, 49152),
    ("square 2048", 2048, 2048),
]


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="rows B (the decode batch)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    use_cpu_xla_flags()
    keep_freed_memory()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    dot = jax.jit(lambda x, w: x @ w.T)
    rng = np.random.default_rng(0)
    print(f"{'shape':12} {'B x D x N':>20} {'XLA GFLOP/s':>12} {'torch GFLOP/s':>14}")
    for name, d, n in SHAPES:
        b = d if name.startswith("square") else args.batch
        x = rng.standard_normal((b, d), np.float32)
        w = rng.standard_normal((n, d), np.float32) * 0.02
        xj, wj = jnp.asarray(x), jnp.asarray(w)
        xt, wt = torch.from_numpy(x), torch.from_numpy(w)
        flops = 2.0 * b * d * n
        t_xla = _best(lambda xj=xj, wj=wj: dot(xj, wj).block_until_ready(), args.repeats)
        with torch.no_grad():
            t_torch = _best(lambda xt=xt, wt=wt: xt @ wt.T, args.repeats)
        shape = f"{b} x {d} x {n}"
        print(f"{name:12} {shape:>20} {flops / t_xla / 1e9:12.1f} {flops / t_torch / 1e9:14.1f}")


if __name__ == "__main__":
    main()
