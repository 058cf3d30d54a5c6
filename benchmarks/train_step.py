"""Time per RL train step and the share of it spent in the advantage estimator.

    python benchmarks/train_step.py             # 5 estimators x 2 layouts, 10 repeats
    python benchmarks/train_step.py --quick     # 3 repeats, concatenated layout only
    python benchmarks/train_step.py --lora 8    # + the same step with rank-8 LoRA adapters

Batch: --traj synthetic rollout records (default 16, in groups of 8), 4-8 turns each, an
observation of 32-48 and an action of 4-8 tokens per turn (random ids below --vocab, random
behaviour log-probs, binary outcome; numpy, seeded), packed with ``pack_records`` in each
layout. Model: the CPU default run's size (``--hidden 64 --layers 2 --vocab 260``, 4 heads /
2 kv heads, MLP 2 x hidden, float32); gae and turn_gae use ``value_head=True``.

Per case (estimator, layout):

* step ms: ``make_train_step(model, make_optimizer(...), StepConfig(estimator=...))``, PPO
  loss, token mean, one micro-batch; the first call compiles, then the median of --repeats
  calls, blocking on the returned state. For gae / turn_gae the step also runs the value
  forward pass and trains the value head (value_coef 0.5).
* estimator ms: ``jax.jit(functools.partial(spec(name).fn, **params))`` alone on the same
  batch, with random values in ``batch.extras`` for the critic estimators
  (``token_values`` [R, T] for gae, ``turn_values`` [N, K] for turn_gae). It does not include
  the value forward pass that the step runs to produce those values.
* share = estimator ms / step ms.
* lora ms (with ``--lora R``): the same step of the same model with rank-R LoRA adapters on
  all seven projections (the base frozen: gradients and Adam state for the adapters and the
  value head only), in the same run.
* baseline ms (measured once per layout in the same run, on the same batch, with the
  policy-only model): plain supervised training, i.e. grad of the token-mean NLL of the action
  tokens + the same optax update, jitted; what the RL step adds is step ms - baseline ms.

The default --traj is 16 (two groups of 8) so the default run stays within about 3 minutes on a
2-core CPU: the concatenated layout pads every trajectory to T = 512 and its attention costs
grow with T^2. 16 is also the rollout batch of the default config (4 tasks x 4 rollouts);
``--traj 64`` gives 8 groups of 8.

No number here is asserted anywhere: tests never time anything.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_agent import estimators  # noqa: E402
from jaxrl_agent.batch import LAYOUTS  # noqa: E402
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.models.config import ModelConfig  # noqa: E402
from jaxrl_agent.models.transformer import Transformer, token_logprobs  # noqa: E402
from jaxrl_agent.train.step import (StepConfig, init_state, make_optimizer,  # noqa: E402
                                    make_train_step)

CASES = ("grpo", "rloo", "reinforce_pp", "gae", "turn_gae")
OBS_LEN, ACT_LEN, TURNS = (32, 48), (4, 8), (4, 8)  # inclusive ranges


def synthetic_records(n: int, group: int, vocab: int, seed: int = 0) -> list[dict]:
    """n rollout records in groups of ``group``; random tokens, log-probs and outcomes."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        turns = []
        for _ in range(int(rng.integers(TURNS[0], TURNS[1] + 1))):
            n_act = int(rng.integers(ACT_LEN[0], ACT_LEN[1] + 1))
            turns.append({
                "observation": rng.integers(0, vocab, int(rng.integers(OBS_LEN[0],
                                                                       OBS_LEN[1] + 1))).tolist(),
                "action": rng.integers(0, vocab, n_act).tolist(),
                "reward": 0.0,
                "logprobs": (-rng.exponential(1.0, n_act)).tolist()})
        records.append({"group": i // group, "outcome": float(rng.integers(0, 2)),
                        "turns": turns})
    return records


def with_values(batch, name: str, seed: int = 1):
    """The batch with random critic values in extras, as the estimator alone needs them."""
    rng = np.random.default_rng(seed)
    extras = dict(batch.extras)
    if name in ("gae", "lambda_returns"):
        m = np.asarray(batch.action_mask)
        extras["token_values"] = np.where(m, rng.normal(size=m.shape), 0).astype(np.float32)
    elif name in ("turn_gae", "sapo"):
        m = np.asarray(batch.turn_mask)
        extras["turn_values"] = np.where(m, rng.normal(size=m.shape), 0).astype(np.float32)
    return batch.replace(extras=extras)


def median_ms(call, repeats: int) -> float:
    """Median wall time in ms of ``repeats`` calls after one warm-up (compiling) call."""
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def make_baseline(model, optimizer):
    """Jitted supervised step: grad of the token-mean NLL of the action tokens + optax update."""
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch):
        out = nnx.merge(graphdef, params, rest)(
            batch.tokens, positions=batch.extras.get("positions"),
            segment_ids=batch.extras.get("segment_ids"))
        lp = token_logprobs(out.logits, batch.tokens)
        m = batch.action_mask.astype(jnp.float32)
        return -jnp.sum(lp * m) / jnp.maximum(jnp.sum(m), 1.0)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def run(args):
    base_cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                           intermediate_size=2 * args.hidden, num_layers=args.layers,
                           num_heads=4, num_kv_heads=2,
                           max_position_embeddings=max(2048, TURNS[1] * (OBS_LEN[1] + ACT_LEN[1])))
    models = {vh: Transformer(base_cfg.replace(value_head=vh), rngs=nnx.Rngs(0))
              for vh in (False, True)}
    lora_models = ({vh: Transformer(base_cfg.replace(value_head=vh, lora_rank=args.lora),
                                    rngs=nnx.Rngs(0)) for vh in (False, True)}
                   if args.lora else {})
    optimizer = make_optimizer(1e-4, total_steps=1000, warmup_steps=10)
    records = synthetic_records(args.traj, args.group, args.vocab, seed=args.seed)
    batches = {layout: jax.device_put(pack_records(records, layout=layout)[0])
               for layout in args.layouts}

    n_tok = sum(len(t["observation"]) + len(t["action"]) for r in records for t in r["turns"])
    n_act = sum(len(t["action"]) for r in records for t in r["turns"])
    n_turns = sum(len(r["turns"]) for r in records)
    shapes = ", ".join(f"{lay}: R x T = {b.tokens.shape[0]} x {b.tokens.shape[1]}, "
                       f"N x K = {b.turn_mask.shape[0]} x {b.turn_mask.shape[1]}"
                       for lay, b in batches.items())
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.platform} ({dev.device_kind}), {jax.device_count()} "
          f"device(s), {os.cpu_count()} cores; model hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}; batch {args.traj} trajectories in groups of {args.group}, "
          f"{n_turns} turns, {n_tok} tokens ({n_act} action); {shapes}; median of "
          f"{args.repeats}\n", flush=True)

    header = (f"{'case':<14}{'layout':<14}{'R x T':>11}{'step ms':>10}{'estimator ms':>14}"
              f"{'share %':>9}{'baseline ms':>13}" + (f"{'lora ms':>10}" if args.lora else ""))
    print(header)
    print("-" * len(header), flush=True)

    baselines = {}
    for layout in args.layouts:
        batch = batches[layout]
        for name in args.estimators:
            spec = estimators.spec(name)
            if spec.stateful:
                raise SystemExit(f"{name}: stateful estimators are not benchmarked here")
            cfg = StepConfig(estimator=name)
            model = models[cfg.needs_values]
            state = init_state(model, optimizer, seed=0)
            step = make_train_step(model, optimizer, cfg)
            t_step = median_ms(lambda: step(state, batch)[0], args.repeats)

            est = jax.jit(functools.partial(spec.fn, **dict(cfg.estimator_params)))
            est_batch = jax.device_put(with_values(batch, name))
            t_est = median_ms(lambda: est(est_batch), args.repeats)

            if layout not in baselines:  # once per layout, policy-only model
                sup = make_baseline(models[False], optimizer)
                s0 = init_state(models[False], optimizer, seed=0)
                baselines[layout] = median_ms(lambda: sup(s0.params, s0.opt_state, batch),
                                              args.repeats)
            lora = ""
            if args.lora:
                lm = lora_models[cfg.needs_values]
                ls = init_state(lm, optimizer, seed=0)
                lstep = make_train_step(lm, optimizer, cfg)
                lora = f"{median_ms(lambda: lstep(ls, batch)[0], args.repeats):>10.2f}"
            rt = f"{batch.tokens.shape[0]}x{batch.tokens.shape[1]}"
            print(f"{name:<14}{layout:<14}{rt:>11}{t_step:>10.2f}{t_est:>14.3f}"
                  f"{100 * t_est / t_step:>9.2f}{baselines[layout]:>13.2f}{lora}", flush=True)
    print("\nbaseline = forward + backward of the token-mean NLL of the action tokens + the same "
          "optax update, policy-only model, measured once per layout\nestimator ms for gae / "
          "turn_gae excludes the value forward pass that their step adds")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--traj", type=int, default=16, help="trajectories in the batch")
    p.add_argument("--group", type=int, default=8, help="trajectories per group")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=260)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--estimators", nargs="*", default=list(CASES))
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="also time the step with LoRA adapters of this rank")
    p.add_argument("--quick", action="store_true",
                   help="smoke check: 3 repeats, concatenated layout only")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.layouts = min(args.repeats, 3), ["concatenated"]
    if args.hidden % 4:
        p.error("--hidden must be a multiple of 4 (4 heads)")
    run(args)


if __name__ == "__main__":
    main()
