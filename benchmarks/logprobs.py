"""Sampled log-probs + entropies from final hidden states: the dense path (full [R, T, V]
float32 logits, as the train step computes them) against ``train.logprobs.
chunked_sampled_logprobs`` (a rematerialised scan over chunks of the tokens).

    python benchmarks/logprobs.py              # 3 repeats
    python benchmarks/logprobs.py --repeats 5

For each size and variant: ``jax.grad`` w.r.t. the hidden states and the LM head of
``sum(lp) + 0.01 sum(ent)``, float32 inputs, tied head ([V, D]), temperature 0.7 (and top-k 50
in the truncated size: its sort is most of that size's time). Reports the compile time, the
median wall time of one forward + backward after compiling, and the compiled program's
temporary bytes (``memory_analysis().temp_size_in_bytes``: what the logits cost; inputs and
outputs not counted). The dense path is the baseline of the same run.

No number here is asserted anywhere: tests never time anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl_agent.losses.kl import entropy_from_logits  # noqa: E402
from jaxrl_agent.train.logprobs import chunked_sampled_logprobs  # noqa: E402
from jaxrl_agent.train.step import sampled_logprobs  # noqa: E402

SIZES = [  # R, T, V, D, sampling, chunks
    (2, 1024, 32768, 256, dict(temperature=0.7), (128, 512)),
    (1, 256, 32768, 256, dict(temperature=0.7, top_k=50), (32, 128)),
]


def dense(hidden, weight, tokens, **sampling):
    logits = jnp.einsum("rtd,vd->rtv", hidden.astype(weight.dtype), weight,
                        preferred_element_type=jnp.float32)
    lp, _, zp = sampled_logprobs(logits, tokens, **sampling)
    h = entropy_from_logits(zp)
    return lp, jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)


def chunked(chunk):
    def fn(hidden, weight, tokens, **sampling):
        lp, _, ent = chunked_sampled_logprobs(hidden, weight, tokens, tied=True, chunk=chunk,
                                              **sampling)
        return lp, ent
    return fn


def bench(fn, args, sampling, repeats):
    def loss(h, w, x):
        lp, ent = fn(h, w, x, **sampling)
        return jnp.sum(lp) + 0.01 * jnp.sum(ent)

    t0 = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    stats = compiled.memory_analysis()
    temp = None if stats is None else stats.temp_size_in_bytes
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return compile_s, statistics.median(times), temp


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"backend {jax.default_backend()}, {jax.device_count()} device(s), "
          f"{os.cpu_count()} CPU(s); grad of sum(lp) + 0.01 sum(ent) w.r.t. hidden and head")
    head = (f"{'R':>2} {'T':>5} {'V':>6} {'D':>4} {'sampling':<16} {'variant':<13} "
            f"{'compile s':>9} {'fwd+bwd s':>9} {'temp MiB':>9} {'vs dense':>8}")
    print(head)
    print("-" * len(head))
    for R, T, V, D, sampling, chunks in SIZES:
        k = jax.random.split(jax.random.key(0), 3)
        inputs = (jax.random.normal(k[0], (R, T, D), jnp.float32),
                  jax.random.normal(k[1], (V, D), jnp.float32) / D ** 0.5,
                  jax.random.randint(k[2], (R, T), 0, V, jnp.int32))
        label = ",".join(f"{'t' if n == 'temperature' else n}={v}" for n, v in sampling.items())
        base = None
        for name, fn in [("dense", dense)] + [(f"chunked {c}", chunked(c)) for c in chunks]:
            comp, med, temp = bench(fn, inputs, sampling, args.repeats)
            base = base or temp
            mib = "n/a" if temp is None else f"{temp / 2 ** 20:.1f}"
            rel = "n/a" if not (temp and base) else f"{temp / base:.3f}"
            print(f"{R:>2} {T:>5} {V:>6} {D:>4} {label:<16} {name:<13} {comp:>9.2f} "
                  f"{med:>9.3f} {mib:>9} {rel:>8}", flush=True)


if __name__ == "__main__":
    main()
