"""Throughput of the JAX sampler and of a policy+value train step on a tiny model.

    python benchmarks/sampler.py              # 5 repeats
    python benchmarks/sampler.py --repeats 3
    python benchmarks/sampler.py --lora 8     # + the sampler on the same model with LoRA adapters

Model: hidden 128, 2 layers, 4 heads / 2 kv heads of head_dim 32, MLP 256, vocab 512, float32.

* ``JaxSampler.generate``: 64 prompts (lengths 8..64, so one length bucket of 64) x 32 new
  tokens (no stop tokens: every row generates all 32), greedy and T=1. Tokens/s counts the
  generated tokens. The first call compiles (reported separately); then the median of
  repeats.
* Baseline in the same run: greedy decoding without a KV cache: a jitted full forward pass
  over the whole padded [64, 96] sequence per new token (what the sampler would cost without
  its cache).
* Train step: ``jax.value_and_grad`` of ``token-mean(-logprob) + 0.5 * mean((value -
  target)^2)`` over the split NNX state, jitted, on a 64 x 64 batch with the value head on.
  Tokens/s counts the 64 x 64 tokens of one forward + backward.

* ``--lora R``: the sampler rows again on the same model with rank-R LoRA adapters on all
  seven projections (``lora_b`` random, as after training): the JAX sampler runs the adapted
  module as the trainer does (``lora_matmul``: each layer's kernel merged with its adapter in
  every call), in the same run as the plain model's rows.

No number here is asserted anywhere: tests never time anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_agent.models import ModelConfig, Transformer, token_logprobs  # noqa: E402
from jaxrl_agent.sampling import JaxSampler, SamplingParams  # noqa: E402

CONFIG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512)
N_PROMPTS, NEW_TOKENS, TRAIN_B, TRAIN_T = 64, 32, 64, 64


def timed(fn, repeats):
    """(first-call seconds, median seconds of ``repeats`` further calls); fn blocks."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def bench_sampler(model, prompts, repeats):
    sampler = JaxSampler(model, batch_buckets=(64,), len_buckets=(64,), new_token_buckets=(32,))
    rows = []
    for name, params in (("JaxSampler greedy", SamplingParams(temperature=0.0,
                                                              max_new_tokens=NEW_TOKENS)),
                         ("JaxSampler T=1", SamplingParams(temperature=1.0,
                                                           max_new_tokens=NEW_TOKENS))):
        def run():
            outs = sampler.generate(prompts, params)
            assert sum(len(o.token_ids) for o in outs) == N_PROMPTS * NEW_TOKENS
        first, med = timed(run, repeats)
        rows.append((name, first, med, N_PROMPTS * NEW_TOKENS / med))
    return rows, sampler.compile_counts


def bench_no_cache_baseline(model, prompts, repeats):
    graphdef, state = nnx.split(model)
    total = 64 + NEW_TOKENS

    @jax.jit
    def next_tokens(state, tokens, lengths):
        logits = nnx.merge(graphdef, state)(tokens).logits
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return jnp.argmax(last, axis=-1).astype(jnp.int32)

    def run():
        tokens = np.zeros((N_PROMPTS, total), np.int32)
        lengths = np.array([len(p) for p in prompts], np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
        rows = jnp.arange(N_PROMPTS)
        for _ in range(NEW_TOKENS):
            nxt = next_tokens(state, tokens, lengths)
            tokens = tokens.at[rows, lengths].set(nxt)
            lengths = lengths + 1
        jax.block_until_ready(tokens)

    first, med = timed(run, repeats)
    return [("no-cache greedy (baseline)", first, med, N_PROMPTS * NEW_TOKENS / med)]


def bench_train_step(repeats):
    model = Transformer(CONFIG.replace(value_head=True), rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (TRAIN_B, TRAIN_T)), jnp.int32)
    mask = jnp.asarray(np.arange(TRAIN_T)[None, :] >= 16).astype(jnp.float32) * jnp.ones(
        (TRAIN_B, 1))
    targets = jnp.asarray(rng.normal(size=(TRAIN_B, TRAIN_T)), jnp.float32)

    def loss_fn(state):
        out = nnx.merge(graphdef, state)(tokens)
        lp = token_logprobs(out.logits, tokens)
        pg = -jnp.sum(lp * mask) / jnp.sum(mask)
        vf = jnp.sum(jnp.square(out.values - targets) * mask) / jnp.sum(mask)
        return pg + 0.5 * vf

    step = jax.jit(jax.value_and_grad(loss_fn))

    def run():
        jax.block_until_ready(step(state))

    first, med = timed(run, repeats)
    return [("train fwd+bwd, policy+value", first, med, TRAIN_B * TRAIN_T / med)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lora", type=int, default=0, metavar="RANK")
    args = ap.parse_args()
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CONFIG.vocab_size, int(n)).tolist()
               for n in rng.integers(8, 65, N_PROMPTS)]

    rows, counts = bench_sampler(model, prompts, args.repeats)
    if args.lora:
        from jaxrl_agent.models import lora_paths
        lm = Transformer(CONFIG.replace(lora_rank=args.lora), rngs=nnx.Rngs(0))
        for path in lora_paths(lm.config):
            lin = lm
            for key in path:
                lin = getattr(lin, key)
            lin.lora_b[...] = jnp.asarray(rng.normal(0, 0.02, lin.lora_b.shape), jnp.float32)
        lrows, _ = bench_sampler(lm, prompts, args.repeats)
        rows += [(f"{name} (LoRA r={args.lora})", *rest) for name, *rest in lrows]
    rows += bench_no_cache_baseline(model, prompts, args.repeats)
    rows += bench_train_step(args.repeats)

    print(f"backend {jax.default_backend()}, {jax.device_count()} device(s); model hidden "
          f"{CONFIG.hidden_size}, {CONFIG.num_layers} layers, head_dim {CONFIG.head_dim}, vocab "
          f"{CONFIG.vocab_size}; sampler: {N_PROMPTS} prompts x {NEW_TOKENS} new tokens; train: "
          f"{TRAIN_B} x {TRAIN_T}; median of {args.repeats}")
    print(f"sampler traces: {dict(counts)}")
    w = max(len(r[0]) for r in rows)
    print(f"{'what':<{w}}  {'first call s':>12}  {'median s':>9}  {'tokens/s':>10}")
    for name, first, med, tps in rows:
        print(f"{name:<{w}}  {first:>12.3f}  {med:>9.4f}  {tps:>10.0f}")


if __name__ == "__main__":
    main()
