"""Per-device train-state bytes and compile time of the train step for each mesh layout.

    python benchmarks/sharding_layouts.py               # 256-wide, 4-layer model (~4 min, 2 cores)
    python benchmarks/sharding_layouts.py --quick       # 64-wide, 1-layer model (~1.5 min)
    python benchmarks/sharding_layouts.py --layouts 1x1x1,1x8x1 --json /tmp/sh.json

Runs on 8 host CPU "devices" (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` is set
before jax is imported unless XLA_FLAGS is already set; ``JAX_PLATFORMS`` defaults to cpu, set
``JAX_PLATFORMS=`` to use the accelerators of a multi-device machine instead). The CPU devices
share the machine's cores, so step times are NOT speed-ups (8 "devices" on 2 cores run the
same work plus the collectives): only the bytes and the compile times mean something here.

Model: ``models.Transformer`` (``--hidden 256 --intermediate 1024 --layers 4 --heads 8
--kv-heads 4 --head-dim 32 --vocab 2048``, value head, float32). Optimizer:
``train.step.make_optimizer`` (global-norm clipping + AdamW, so two moments per parameter).
Batch: ``--traj`` synthetic rollout records (groups of ``--group``, 2-3 turns of 24-40
observation + 4-8 action tokens; numpy, seeded), packed with ``pack_records(layout=
"concatenated", num_shards=data*fsdp*micro, pad_to=fixed)`` so every layout gets the same
shapes, placed with ``sharding.batch_sharding(mesh)``. Step: ``StepConfig(estimator=grpo,
data_shards=data*fsdp, micro_batches=--micro, remat=--remat)`` from ``make_train_step(...,
mesh=, state_shardings=sharding.train_state_shardings(...))`` with ``DEFAULT_RULES``.

Layouts are ``DATAxFSDPxTENSOR``; ``1x1x1`` (one device) is the baseline, measured first in the
same run. Per layout:

* params / opt MiB: ``sharding.bytes_per_device`` of the placed ``state.params`` and
  ``state.opt_state`` (the most loaded device, from the arrays' actual shards); "x base" is the
  ratio to the baseline and "ideal" is ``1 / (fsdp * tensor)``. Parameters that the rules
  leave replicated (norm weights, the value head's bias, Adam's step counters) or whose
  dimension the mesh axis does not divide keep the ratio above the ideal; "repl %" is the
  share of the parameter bytes that is whole on every device.
* lower s / compile s: ``jit(step).lower(state, batch)`` (trace + StableHLO) and
  ``.compile()`` (XLA, SPMD partitioning included), wall time.
* SPMD full remat: how many "Involuntary full rematerialization" warnings XLA's SPMD
  partitioner logged while compiling (a tensor it could not reshard directly, so it was
  replicated and re-split; the ops are listed under the table). XLA's log lines are captured
  during the compile; any other line is passed through to stderr.
* step ms: median of ``--steps`` calls of the compiled step after one warm call, chained
  (each call takes the previous state), blocking on the result. CPU, shared cores.
* |dloss| / |dparam|: max abs difference against the baseline of the loss at every step of the
  same chain and of the parameters after it (a sanity check: same numbers, other layout).

No number here is asserted anywhere: tests never time anything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_agent import sharding  # noqa: E402
from jaxrl_agent.rollout.records import pack_records  # noqa: E402
from jaxrl_agent.models import ModelConfig, Transformer  # noqa: E402
from jaxrl_agent.sharding import multihost  # noqa: E402
from jaxrl_agent.train.step import (StepConfig, init_state, make_optimizer,  # noqa: E402
                                    make_train_step)

DEFAULT_LAYOUTS = "1x1x1,8x1x1,1x8x1,4x1x2,1x4x2,2x2x2,1x2x4"
NAMES = {(1, 1, 1): "single device", (8, 1, 1): "DP8", (1, 8, 1): "FSDP8",
         (4, 1, 2): "DP4 x TP2", (1, 4, 2): "FSDP4 x TP2", (2, 2, 2): "DP2 x FSDP2 x TP2",
         (1, 2, 4): "FSDP2 x TP4"}
OBS_LEN, ACT_LEN, TURNS = (24, 40), (4, 8), (2, 3)  # inclusive ranges
MiB = 2 ** 20


def synthetic_records(n: int, group: int, vocab: int, seed: int = 0) -> list[dict]:
    """n rollout records in groups of ``group``; random tokens, log-probs and outcomes."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        turns = []
        for _ in range(int(rng.integers(TURNS[0], TURNS[1] + 1))):
            n_act = int(rng.integers(ACT_LEN[0], ACT_LEN[1] + 1))
            n_obs = int(rng.integers(OBS_LEN[0], OBS_LEN[1] + 1))
            turns.append({"observation": rng.integers(3, vocab, n_obs).tolist(),
                          "action": rng.integers(3, vocab, n_act).tolist(), "reward": 0.0,
                          "logprobs": (-rng.exponential(1.0, n_act)).tolist()})
        records.append({"group": f"g{i // group}", "outcome": float(rng.integers(0, 2)),
                        "turns": turns})
    return records


def parse_layouts(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        try:
            d, f, t = (int(x) for x in item.strip().lower().split("x"))
        except ValueError:
            raise SystemExit(f"--layouts: expected DATAxFSDPxTENSOR items such as 1x4x2, "
                             f"got {item!r}")
        out.append((d, f, t))
    if (1, 1, 1) in out:  # the baseline goes first
        out.remove((1, 1, 1))
    return [(1, 1, 1)] + out


def skip_reason(layout, cfg: ModelConfig, args) -> str | None:
    d, f, t = layout
    if d * f * t > jax.device_count():
        return f"needs {d * f * t} devices, have {jax.device_count()}"
    if cfg.num_kv_heads % t or cfg.num_heads % t:
        return f"heads {cfg.num_heads}/{cfg.num_kv_heads} not divisible by tensor={t}"
    if args.traj % (d * f * args.micro) or (args.traj // args.group) % (d * f * args.micro):
        return f"{args.traj // args.group} groups do not fill data*fsdp*micro={d * f * args.micro}"
    return None


@contextlib.contextmanager
def captured_stderr():
    """Captures file descriptor 2 (XLA's C++ log lines, e.g. the SPMD partitioner's
    "Involuntary full rematerialization" warnings) into ``out["text"]``."""
    sys.stderr.flush()
    saved = os.dup(2)
    out = {"text": ""}
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out["text"] = tmp.read().decode(errors="replace")


REMAT = re.compile(r"Involuntary full rematerialization.*?HLO operation %(\S+) = (\S+)")


def replicated_share(params, mesh) -> tuple[float, list[str]]:
    """(share of parameter bytes left whole on every device, notes of dims left replicated
    although their rule names a mesh axis)."""
    rows = sharding.layout_table(params, mesh)
    total = repl = 0
    notes = []
    for r in rows:
        nbytes = int(np.prod(r["shape"])) * 4
        total += nbytes
        if tuple(r["local_shape"]) == tuple(r["shape"]):
            repl += nbytes
        notes += [f"{r['path']}: {n}" for n in r["notes"]]
    return repl / max(total, 1), notes


def run_layout(layout, model, optimizer, records, pad_to, args, base):
    d, f, t = layout
    mesh = sharding.make_mesh(data=d, fsdp=f, tensor=t)
    shards = sharding.batch_shards(mesh)
    cfg = StepConfig(estimator=args.estimator, micro_batches=args.micro, remat=args.remat,
                     data_shards=shards)
    host_state = jax.device_get(init_state(model, optimizer, seed=0))
    shardings = sharding.train_state_shardings(host_state, optimizer, mesh)
    state = multihost.global_tree(host_state, shardings)
    batch, _ = pack_records(records, layout="concatenated", num_shards=shards * args.micro,
                            pad_to=pad_to)
    batch = multihost.global_tree(batch, sharding.batch_sharding(mesh))
    step = make_train_step(model, optimizer, cfg, mesh=mesh, state_shardings=shardings)

    with captured_stderr() as log:
        t0 = time.perf_counter()
        lowered = step.lower(state, batch)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    remats = [f"{op} {shape}" for op, shape in REMAT.findall(log["text"])]
    other = [ln for ln in log["text"].splitlines()
             if ln.strip() and "Involuntary full rematerialization" not in ln]
    if other:  # anything else XLA said goes through unchanged
        print("\n".join(other), file=sys.stderr, flush=True)

    p_bytes = sharding.bytes_per_device(state.params)
    o_bytes = sharding.bytes_per_device(state.opt_state)
    repl, notes = replicated_share(state.params, mesh)
    losses, times = [], []
    for i in range(args.steps + 1):   # call 0 is the warm-up, not timed
        s0 = time.perf_counter()
        state, out = compiled(state, batch)
        jax.block_until_ready(state)
        if i:
            times.append(time.perf_counter() - s0)
        losses.append(float(out["metrics"]["loss"]))
    # the placed state must still hold its layout after the steps
    p_after = sharding.bytes_per_device(state.params)
    final = [np.asarray(x) for x in jax.tree.leaves(multihost.host_gather(state.params))]
    row = {"layout": f"{d}x{f}x{t}", "name": NAMES.get(layout, f"{d}x{f}x{t}"),
           "data": d, "fsdp": f, "tensor": t, "params_bytes": p_bytes, "opt_bytes": o_bytes,
           "params_bytes_after": p_after, "replicated_share": repl,
           "ideal": 1.0 / (f * t), "lower_s": t1 - t0, "compile_s": t2 - t1,
           "step_ms": 1e3 * statistics.median(times), "losses": losses, "notes": notes,
           "spmd_full_remat": remats,
           "_params": final}
    if base is not None:
        row["params_ratio"] = p_bytes / base["params_bytes"]
        row["opt_ratio"] = o_bytes / base["opt_bytes"]
        row["max_dloss"] = max(abs(a - b) for a, b in zip(losses, base["losses"]))
        row["max_dparam"] = max(float(np.max(np.abs(a - b)))
                                for a, b in zip(final, base["_params"]))
    else:
        row.update(params_ratio=1.0, opt_ratio=1.0, max_dloss=0.0, max_dparam=0.0)
    return row


def run(args):
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_layers=args.layers,
                      num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                      max_position_embeddings=1024, value_head=True, dtype="float32")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    optimizer = make_optimizer(1e-4, total_steps=1000, warmup_steps=0)
    records = synthetic_records(args.traj, args.group, args.vocab, seed=args.seed)
    longest = max(sum(len(u["observation"]) + len(u["action"]) for u in r["turns"])
                  for r in records)
    pad_to = {"num_traj": args.traj, "num_turns": TURNS[1], "row_len": 16 * -(-longest // 16)}
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {jax.device_count()} x {dev.platform} ({dev.device_kind}) on "
          f"{os.cpu_count()} cores, load average {'%.2f %.2f %.2f' % os.getloadavg()}\n"
          f"model: hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, {cfg.num_layers} "
          f"layers, {cfg.num_heads} heads / {cfg.num_kv_heads} kv heads x {cfg.head_dim}, vocab "
          f"{cfg.vocab_size}, value head, float32: {n_params / 1e6:.2f} M parameters "
          f"({n_params * 4 / MiB:.1f} MiB); AdamW\nbatch: {args.traj} trajectories in groups of "
          f"{args.group}, concatenated, R x T = {args.traj} x {pad_to['row_len']}; estimator "
          f"{args.estimator}, micro-batches {args.micro}, remat {args.remat}; step ms = median "
          f"of {args.steps}\n", flush=True)

    rows, base, skipped = [], None, []
    for layout in parse_layouts(args.layouts):
        why = skip_reason(layout, cfg, args)
        if why:
            skipped.append(f"{'x'.join(map(str, layout))}: {why}")
            continue
        row = run_layout(layout, model, optimizer, records, pad_to, args, base)
        base = base or row
        rows.append(row)
        print(f"  {row['layout']} done: compile {row['compile_s']:.1f} s, step "
              f"{row['step_ms']:.0f} ms", flush=True)

    head = ("| layout | DxFxT | params MiB/dev | x base | opt MiB/dev | x base | ideal | repl % "
            "| lower s | compile s | SPMD full remat | step ms (CPU, shared cores) | "
            "max abs dloss | max abs dparam |")
    print("\n" + head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    for r in rows:
        print(f"| {r['name']} | {r['layout']} | {r['params_bytes'] / MiB:.2f} | "
              f"{r['params_ratio']:.3f} | {r['opt_bytes'] / MiB:.2f} | {r['opt_ratio']:.3f} | "
              f"{r['ideal']:.3f} | {100 * r['replicated_share']:.2f} | {r['lower_s']:.1f} | "
              f"{r['compile_s']:.1f} | {len(r['spmd_full_remat'])} | {r['step_ms']:.0f} | "
              f"{r['max_dloss']:.1e} | "
              f"{r['max_dparam']:.1e} |")
    for r in rows:
        if r["params_bytes_after"] != r["params_bytes"]:
            print(f"WARNING {r['layout']}: params bytes/device changed after the steps "
                  f"({r['params_bytes']} -> {r['params_bytes_after']})")
        for n in r["notes"]:
            print(f"note {r['layout']}: {n}")
        for op in r["spmd_full_remat"]:
            print(f"note {r['layout']}: XLA SPMD 'involuntary full rematerialization' of {op}")
    for s in skipped:
        print(f"skipped {s}")
    print(f"\nlosses are over {args.steps + 1} chained steps from the same initial state; "
          f"load average after: {'%.2f %.2f %.2f' % os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": [{k: v for k, v in r.items()
                                                     if not k.startswith("_")} for r in rows],
                       "skipped": skipped}, fh, indent=1)
        print(f"wrote {args.json}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                   help="comma-separated DATAxFSDPxTENSOR; 1x1x1 (baseline) is always run first")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--traj", type=int, default=16, help="trajectories in the batch")
    p.add_argument("--group", type=int, default=2, help="trajectories per group")
    p.add_argument("--micro", type=int, default=1, help="micro-batches per step")
    p.add_argument("--remat", action="store_true", help="recompute decoder layers in backward")
    p.add_argument("--estimator", default="grpo")
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 64 wide, MLP 256, 1 layer, head_dim 16, vocab 256, 1 timed "
                        "step")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.vocab = 64, 256, 1, 256
        args.head_dim, args.steps = 16, 1
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.traj % args.group:
        p.error("--traj must be a multiple of --group")
    run(args)


if __name__ == "__main__":
    main()
