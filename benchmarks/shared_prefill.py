"""The JAX sampler's shared prefill (``JaxSampler(share_prefill=...)``): a prompt that occurs
several times in one ``generate`` call is prefilled once and its cache rows copied.

    python benchmarks/shared_prefill.py            # about 3 min on 2 quiet cores
    python benchmarks/shared_prefill.py --repeats 3

Both settings run side by side in the same process, on the same random-weight built-in model
(the default run's shapes) and the same seeds:

* ``call``: one ``generate`` of 8 groups x 8 copies of a prompt (``--prompt-len`` tokens),
  8 new tokens at T=1 (a grid-world action): milliseconds per call (median of repeats, the
  first call compiles and is left out).
* ``rollouts``: one step of grid-world rollouts at the horizon study's L2 (7x7, 20 turns;
  4 tasks x 8 samples), ``rollout.history`` ``last`` (the default) and ``full``: wall time of
  the collection and the prompt tokens prefilled per generated token. The records of both
  settings are compared: the sampled token ids and outcomes (must be equal) and the largest
  log-prob difference (a prefill of fewer rows may round differently in the last bits).

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

from flax import nnx  # noqa: E402

from jaxrl_agent import envs, run_checks  # noqa: E402
from jaxrl_agent.models import Transformer  # noqa: E402
from jaxrl_agent.rollout import ByteCodec, collect_groups  # noqa: E402
from jaxrl_agent.sampling import SamplingParams  # noqa: E402
from jaxrl_agent.sampling.jax_sampler import JaxSampler  # noqa: E402
from jaxrl_agent.train.build import builtin_model_config  # noqa: E402

L2 = ["env.kwargs.size=7", "env.kwargs.max_turns=20", "rollout.max_turns=20",
      "rollout.tasks_per_step=4", "rollout.group_size=8"]


def samplers(cfg, model):
    kw = dict(max_len=cfg.rollout.max_context_tokens, batch_buckets=(8, 32, 128), seed=0)
    return {"unshared": JaxSampler(model, share_prefill=False, **kw),
            "shared": JaxSampler(model, share_prefill=True, **kw)}


def bench_call(cfg, model, prompt_len: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 200, prompt_len).tolist() for _ in range(8)] * 8
    params = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=i) for i in range(64)]
    out = {}
    for name, s in samplers(cfg, model).items():
        s.generate(prompts, params)  # compiles
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            s.generate(prompts, params)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def bench_rollouts(history: str) -> dict:
    cfg = run_checks.load(None, L2 + [f"rollout.history={history}"])
    model = Transformer(builtin_model_config(cfg), rngs=nnx.Rngs(0))
    env = envs.make_env(cfg.env.name, **cfg.env.kwargs)
    tasks = env.sample_tasks(np.random.default_rng(0), cfg.rollout.tasks_per_step)
    codec = ByteCodec()
    rc = cfg.rollout.collect_config(prompt_prefix=(codec.bos_token_id,) if cfg.rollout.bos
                                    else ())
    out, records = {}, {}
    for name, s in samplers(cfg, model).items():
        collect_groups(env, tasks[:1], s, codec, rc, seed=1)  # compiles most buckets
        s.prefill_stats.clear()
        t0 = time.perf_counter()
        records[name], _ = collect_groups(env, tasks, s, codec, rc, seed=0)
        wall = time.perf_counter() - t0
        generated = sum(len(t["action"]) for r in records[name] for t in r["turns"])
        out[name] = dict(wall_s=wall, prefilled=s.prefill_stats["tokens_prefilled"],
                         asked=s.prefill_stats["tokens_asked"], generated=generated)
    key = lambda r: [t["action"] for t in r["turns"]] + [r["outcome"]]  # noqa: E731
    out["same"] = [key(r) for r in records["unshared"]] == [key(r) for r in records["shared"]]
    lps = [np.concatenate([t["logprobs"] for t in r["turns"]]) for k in ("unshared", "shared")
           for r in records[k]]
    half = len(lps) // 2
    out["lp_diff"] = max((float(np.max(np.abs(a - b))) for a, b in zip(lps[:half], lps[half:])
                          if a.shape == b.shape), default=float("nan"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-len", type=int, nargs="+", default=[64, 256])
    a = p.parse_args(argv)
    cfg = run_checks.load(None, L2)
    model = Transformer(builtin_model_config(cfg), rngs=nnx.Rngs(0))
    print("one generate call: 8 groups x 8 copies, 8 new tokens, T=1 (median of "
          f"{a.repeats}, ms)")
    print(f"{'prompt tokens':>14} {'unshared':>10} {'shared':>10} {'speed-up':>9}")
    for n in a.prompt_len:
        r = bench_call(cfg, model, n, a.repeats)
        print(f"{n:>14} {r['unshared']:>10.1f} {r['shared']:>10.1f} "
              f"{r['unshared'] / r['shared']:>8.2f}x")
    print("\none step of L2 grid-world rollouts (4 tasks x 8 samples, <= 20 turns, random "
          "weights)")
    print(f"{'history':>8} {'setting':>9} {'wall s':>8} {'prefilled / generated':>22} "
          f"{'prefilled / asked':>18} {'same tokens':>12} {'max |d logprob|':>16}")
    for history in ("last", "full"):
        r = bench_rollouts(history)
        for name in ("unshared", "shared"):
            x = r[name]
            print(f"{history:>8} {name:>9} {x['wall_s']:>8.1f} "
                  f"{x['prefilled'] / max(x['generated'], 1):>22.1f} "
                  f"{x['prefilled'] / max(x['asked'], 1):>18.2f} {str(r['same']):>12} "
                  f"{r['lp_diff']:>16.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
