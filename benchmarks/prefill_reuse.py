"""What the JAX sampler saves on prefill: a prompt repeated within a call prefilled once
(``JaxSampler(share_prefill=...)``) and the keys/values of earlier calls reused by the
prompts that continue them (``reuse_calls``).

    python benchmarks/prefill_reuse.py            # about 4 min on 2 quiet cores
    python benchmarks/prefill_reuse.py --repeats 3

The settings run side by side in the same process, on the same random-weight built-in model
(the default run's shapes) and the same seeds: ``fresh`` (every row prefilled from scratch),
``shared`` (repeats within a call prefilled once) and ``kept`` (shared, and the caches of the
last 2 calls reused):

* ``call``: one ``generate`` of 8 groups x 8 copies of a prompt (``--prompt-len`` tokens),
  8 new tokens at T=1 (a grid-world action): milliseconds per call (median of repeats, the
  first call compiles and is left out), ``fresh`` against ``shared`` (no kept caches: the
  repeats of one call would otherwise reuse the previous call's).
* ``rollouts``: one step of grid-world rollouts at the horizon study's L2 (7x7, 20 turns;
  4 tasks x 8 samples), ``rollout.history`` ``last`` (the default) and ``full``: wall time of
  the collection, the prompt tokens prefilled per generated token and per episode token
  (the observations and actions of its turns), and the padded prefill
  slots per generated token; and ``full chat``: the same with ``rollout.chat`` (the Qwen2.5
  instruct chat template through a tiny tokenizer: a multi-turn chat conversation, each
  turn's prompt the whole conversation rendered). Each setting's records are compared with ``fresh``'s: the
  sampled token ids and outcomes (must be equal) and the largest log-prob difference (keys and
  values written by another program round differently in the last bits).

No number here is asserted anywhere: tests never time anything.
"""

from __future__ import annotations

import argparse
import dataclasses
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


SETTINGS = {"fresh": dict(share_prefill=False, reuse_calls=0),
            "shared": dict(share_prefill=True, reuse_calls=0),
            "kept": dict(share_prefill=True, reuse_calls=2)}


def samplers(cfg, model, names=tuple(SETTINGS)):
    kw = dict(max_len=cfg.rollout.max_context_tokens, batch_buckets=(8, 32, 128), seed=0)
    return {n: JaxSampler(model, **SETTINGS[n], **kw) for n in names}


def bench_call(cfg, model, prompt_len: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 200, prompt_len).tolist() for _ in range(8)] * 8
    params = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=i) for i in range(64)]
    out = {}
    for name, s in samplers(cfg, model, ("fresh", "shared")).items():
        s.generate(prompts, params)  # compiles
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            s.generate(prompts, params)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


#: with the whole history in the prompt an L2 episode of 20 turns needs about 1,500 tokens
LONG = ["rollout.max_context_tokens=2048", "model.max_position_embeddings=2048"]


def bench_rollouts(history: str, chat: bool = False) -> dict:
    """One step of L2 rollouts per setting; ``chat``: through the Qwen2.5 instruct chat
    template (a tiny byte-level BPE tokenizer carrying it, ``tests/chat_fixtures.py``; the
    model's vocabulary is that tokenizer's): a conversation of user observations and
    assistant actions."""
    cfg = run_checks.load(None, L2 + [f"rollout.history={history}"]
                          + (LONG if history == "full" else []))
    mc = builtin_model_config(cfg)
    env = envs.make_env(cfg.env.name, **cfg.env.kwargs)
    tasks = env.sample_tasks(np.random.default_rng(0), cfg.rollout.tasks_per_step)
    if chat:
        import tempfile

        from tests.chat_fixtures import make_chat_tokenizer
        codec = make_chat_tokenizer("qwen2.5", tempfile.mkdtemp(prefix="chat_tok_"))
        mc = dataclasses.replace(mc, vocab_size=codec.vocab_size)
        rc = dataclasses.replace(cfg.rollout.collect_config(), chat=True)
    else:
        codec = ByteCodec()
        rc = cfg.rollout.collect_config(prompt_prefix=(codec.bos_token_id,) if cfg.rollout.bos
                                        else ())
    model = Transformer(mc, rngs=nnx.Rngs(0))
    out, records = {}, {}
    for name, s in samplers(cfg, model).items():
        collect_groups(env, tasks, s, codec, rc, seed=1)  # compiles (nearly) every shape
        s.drop_kept_caches()
        s.prefill_stats.clear()
        t0 = time.perf_counter()
        records[name], _ = collect_groups(env, tasks, s, codec, rc, seed=0)
        wall = time.perf_counter() - t0
        generated = sum(len(t["action"]) for r in records[name] for t in r["turns"])
        episode = sum(len(t["observation"]) + len(t["action"]) for r in records[name]
                      for t in r["turns"])
        st = s.prefill_stats
        out[name] = dict(wall_s=wall, prefilled=st["tokens_prefilled"], asked=st["tokens_asked"],
                         padded=st["slots_prefilled"], generated=generated, episode=episode,
                         turns=np.mean([len(r["turns"]) for r in records[name]]))
    key = lambda r: [t["action"] for t in r["turns"]] + [r["outcome"]]  # noqa: E731
    for name in records:
        same = [key(r) for r in records[name]] == [key(r) for r in records["fresh"]]
        lp = [float(np.max(np.abs(np.subtract(t["logprobs"], u["logprobs"]))))
              for r, q in zip(records[name], records["fresh"])
              for t, u in zip(r["turns"], q["turns"]) if len(t["logprobs"]) == len(u["logprobs"])]
        out[name].update(same=same, lp_diff=max(lp, default=float("nan")))
    return out


#: the rollout benchmarks: (rollout.history, chat)
ROLLOUTS = {"last": ("last", False), "full": ("full", False), "chat": ("full", True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-len", type=int, nargs="*", default=[64, 256],
                   help="the one-call benchmark's prompt lengths (none: skip it)")
    p.add_argument("--rollouts", nargs="*", default=list(ROLLOUTS), choices=list(ROLLOUTS),
                   help="which rollout benchmarks to run")
    a = p.parse_args(argv)
    cfg = run_checks.load(None, L2)
    model = Transformer(builtin_model_config(cfg), rngs=nnx.Rngs(0))
    print("one generate call: 8 groups x 8 copies, 8 new tokens, T=1 (median of "
          f"{a.repeats}, ms)")
    print(f"{'prompt tokens':>14} {'fresh':>10} {'shared':>10} {'speed-up':>9}")
    for n in a.prompt_len:
        r = bench_call(cfg, model, n, a.repeats)
        print(f"{n:>14} {r['fresh']:>10.1f} {r['shared']:>10.1f} "
              f"{r['fresh'] / r['shared']:>8.2f}x")
    print("\none step of L2 grid-world rollouts (4 tasks x 8 samples, <= 20 turns, random "
          "weights; history full with a 2048-token context; timed after a first collection "
          "that compiles)")
    print(f"{'history':>8} {'setting':>8} {'wall s':>7} {'speed-up':>8} "
          f"{'prefilled/generated':>19} {'prefilled/episode':>17} {'padded/generated':>16} "
          f"{'same tokens':>11} {'max |d logprob|':>15}")
    for history, chat in (ROLLOUTS[k] for k in a.rollouts):
        r = bench_rollouts(history, chat)
        label = history + (" chat" if chat else "")
        print(f"{label:>8} turns per episode {r['fresh']['turns']:.1f}")
        for name in SETTINGS:
            x, g = r[name], max(r[name]["generated"], 1)
            print(f"{label:>8} {name:>8} {x['wall_s']:>7.1f} "
                  f"{r['fresh']['wall_s'] / x['wall_s']:>7.2f}x {x['prefilled'] / g:>19.1f} "
                  f"{x['prefilled'] / max(x['episode'], 1):>17.2f} {x['padded'] / g:>16.1f} "
                  f"{str(x['same']):>11} {x['lp_diff']:>15.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
