"""What a teacher costs in the train step: the step time of on-policy distillation with each
kind of teacher, against GRPO (no teacher) on the same batch, in the same run.

    python benchmarks/teacher_pass.py                 # per_step layout, 10 repeats
    python benchmarks/teacher_pass.py --layout concatenated --repeats 5

Batch and model: ``benchmarks/train_step.py``'s synthetic records (--traj 16 in groups of 8, 4-8
turns of 32-48 observation and 4-8 action tokens) and the CPU default run's model size (hidden
64, 2 layers, vocabulary 260). Per case, ``make_train_step`` with PPO and one micro-batch; the
first call compiles, then the median of --repeats calls.

Cases:

* ``grpo``: no teacher (the baseline; ratio 1.00).
* ``opd live``: the teacher is the policy at the start of the step: one extra forward pass.
* ``opd base``: the start weights (a frozen copy): one extra forward pass of the copy.
* ``opd ema``: the moving average (one copy, updated after the step).
* ``opd model``: another checkpoint of the same size, its parameters beside the policy's.
* ``opd live + context``: the teacher reads rows of its own, 16 context tokens longer per
  prompt, and its log-probs are moved to the policy's tokens.
* ``grpo + sdl (base)``: SDL as an auxiliary loss, the teacher being the start weights.
* ``topk_kl k=16 (model)``: the forward KL over another checkpoint's 16 most likely next
  tokens (``teacher.top_k: 16``, OPD at beta 0 + ``loss.aux: [topk_kl]``): the teacher pass
  also takes a top-16 per position, the policy's pass gathers 16 log-probs per position.
* ``topk_kl k=V (model)``: the same over the whole vocabulary (K = V: the exact forward KL).

No number here is asserted anywhere: tests never time anything.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_agent.models.config import ModelConfig  # noqa: E402
from jaxrl_agent.models.transformer import Transformer  # noqa: E402
from jaxrl_agent.rollout.records import pack_records  # noqa: E402
from jaxrl_agent.train.step import (TEACHER_VIEW, StepConfig, init_state,  # noqa: E402
                                    make_optimizer, make_train_step)
from train_step import OBS_LEN, ACT_LEN, TURNS, median_ms, synthetic_records  # noqa: E402

TEACHER = ("teacher_logprobs",)
#: pure top-K distillation from another checkpoint (teacher_top_k -1: the whole vocabulary)
TOPK = dict(estimator="opd", estimator_params=(("beta", 0.0),), teacher="model",
            extra_reads=TEACHER + ("teacher_topk_logprobs",),
            aux_losses=(("topk_kl", 1.0, ()),))
CASES = [
    ("grpo", dict(estimator="grpo"), {}),
    ("opd live", dict(estimator="opd", teacher="live", extra_reads=TEACHER), {}),
    ("opd base", dict(estimator="opd", teacher="base", extra_reads=TEACHER),
     {"with_reference": True}),
    ("opd ema", dict(estimator="opd", teacher="ema", extra_reads=TEACHER),
     {"ema_teacher": True}),
    ("opd model", dict(estimator="opd", teacher="model", extra_reads=TEACHER), {"model": True}),
    ("opd live + context", dict(estimator="opd", teacher="live", teacher_view=True,
                                extra_reads=TEACHER), {"view": True}),
    ("grpo + sdl (base)", dict(estimator="grpo", teacher="base", extra_reads=TEACHER,
                               aux_losses=(("sdl", 0.1, ()),)), {"with_reference": True}),
    ("topk_kl k=16 (model)", dict(TOPK, teacher_top_k=16), {"model": True}),
    ("topk_kl k=V (model)", dict(TOPK, teacher_top_k=-1), {"model": True}),
]


def run(args):
    mc = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                     intermediate_size=2 * args.hidden, num_layers=args.layers, num_heads=4,
                     num_kv_heads=2,
                     max_position_embeddings=max(2048, TURNS[1] * (OBS_LEN[1] + ACT_LEN[1] + 16)))
    model = Transformer(mc, rngs=nnx.Rngs(0))
    other = Transformer(mc, rngs=nnx.Rngs(1))
    optimizer = make_optimizer(1e-4, total_steps=1000, warmup_steps=10)
    records = synthetic_records(args.traj, args.group, args.vocab, seed=0)
    batch, _ = pack_records(records, layout=args.layout)
    ctx = list(range(3, 19))  # 16 context tokens before each prompt (the first, concatenated)
    view = [dict(r, turns=[dict(t, observation=ctx + t["observation"])
                           if k == 0 or args.layout == "per_step" else t
                           for k, t in enumerate(r["turns"])]) for r in records]
    tb, _ = pack_records(view, layout=args.layout)
    with_view = batch.replace(extras={**batch.extras, TEACHER_VIEW[0]: tb.tokens,
                                      TEACHER_VIEW[1]: tb.action_mask})
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.platform}, {os.cpu_count()} cores; model hidden "
          f"{args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.traj} trajectories, "
          f"{args.layout}: R x T = {batch.tokens.shape[0]} x {batch.tokens.shape[1]} (teacher "
          f"rows with context: {tb.tokens.shape[1]}); median of {args.repeats}\n", flush=True)
    header = f"{'case':<22}{'step ms':>10}{'x grpo':>9}"
    print(header)
    print("-" * len(header), flush=True)
    base = None
    for name, kw, how in CASES:
        if kw.get("teacher_top_k") == -1:
            kw = dict(kw, teacher_top_k=args.vocab)
        cfg = StepConfig(**kw)
        tparams = nnx.state(other, nnx.Param) if how.get("model") else ()
        state = init_state(model, optimizer, seed=0, teacher_params=tparams,
                           with_reference=how.get("with_reference", False),
                           ema_teacher=how.get("ema_teacher", False))
        step = make_train_step(model, optimizer, cfg,
                               teacher_model=other if how.get("model") else None)
        b = with_view if how.get("view") else batch
        ms = median_ms(lambda: step(state, b)[0], args.repeats)
        base = ms if base is None else base
        print(f"{name:<22}{ms:>10.2f}{ms / base:>9.2f}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="per_step", choices=("per_step", "concatenated"))
    p.add_argument("--traj", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=260)
    p.add_argument("--repeats", type=int, default=10)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
