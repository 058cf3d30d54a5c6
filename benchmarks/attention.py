"""Blocked (flash-style) attention vs the dense training path: forward + backward time after
compile and the compiled temporaries, on this machine's default backend.

    python benchmarks/attention.py [--lengths 1024,2048] [--blocks 128,512]

Both paths compute the gradient of a random weighted sum of the attention output with respect
to q, k and v (grouped-query, causal, B = 1, H = 4, KV = 2, hd = 32). Prints a table: length,
path, compile seconds, median step milliseconds over 5 runs, temporaries in MiB, and the ratio
to the dense path of the same length.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agent.models.attention import blocked_attention
from jaxrl_agent.models.transformer import dense_attention


def _dense(q, k, v):
    L = q.shape[1]
    t = jnp.arange(L)
    mask = jnp.broadcast_to(t[:, None] >= t[None, :], (q.shape[0], L, L))
    return dense_attention(q, k, v, mask)


def measure(fn, q, k, v, w):
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2)))
    t0 = time.perf_counter()
    compiled = grad.lower(q, k, v).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - t0)
    temp = mem.temp_size_in_bytes / 2 ** 20 if mem is not None else float("nan")
    return compile_s, 1e3 * float(np.median(times)), temp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--blocks", default="128,512")
    args = ap.parse_args()
    print(f"backend {jax.default_backend()}, B=1 H=4 KV=2 hd=32, float32, fwd+bwd")
    print(f"{'L':>6} {'path':<14} {'compile s':>10} {'step ms':>9} {'temp MiB':>9} "
          f"{'ms / dense':>10} {'MiB / dense':>11}")
    for L in (int(x) for x in args.lengths.split(",")):
        ks = jax.random.split(jax.random.key(L), 4)
        q = jax.random.normal(ks[0], (1, L, 4, 32))
        k = jax.random.normal(ks[1], (1, L, 2, 32))
        v = jax.random.normal(ks[2], (1, L, 2, 32))
        w = jax.random.normal(ks[3], (1, L, 128))
        base = measure(_dense, q, k, v, w)
        print(f"{L:>6} {'dense':<14} {base[0]:>10.2f} {base[1]:>9.1f} {base[2]:>9.1f} "
              f"{1.0:>10.2f} {1.0:>11.3f}")
        for b in (int(x) for x in args.blocks.split(",")):
            r = measure(lambda q, k, v, b=b: blocked_attention(q, k, v, block_q=b, block_k=b),
                        q, k, v, w)
            print(f"{L:>6} {'blocked ' + str(b):<14} {r[0]:>10.2f} {r[1]:>9.1f} {r[2]:>9.1f} "
                  f"{r[1] / base[1]:>10.2f} {r[2] / base[2]:>11.3f}")


if __name__ == "__main__":
    main()
