"""Synchronous vs asynchronous rollouts on the default recipe, with and without env latency.

    python benchmarks/async_rollouts.py                      # about 15 min on 2 quiet cores
    python benchmarks/async_rollouts.py --steps 10 --quick   # smoke run
    python benchmarks/async_rollouts.py --warm-start runs/cpu_default/warmup_model

Every run starts from the same warmed-up model (``--warm-start``, or one made here by the
default warm-up, seed 0) and trains ``--steps`` RL steps of the default recipe with the same
seed, so the task stream and the evaluation layouts are the same in every run; the settings
differ only in

* ``sync``: the built-in synchronous loop (collect, train, sync, repeat);
* ``async lag L``: ``trainer.async_rollouts=true`` with ``trainer.max_policy_lag=L`` and
  ``trainer.rollout_workers=L`` (rollouts of the next L steps run while the trainer trains),
  with the default correction (PPO's clipped ratio against the sampler's log-probs) or with
  ``--set``'s extra keys (e.g. ``loss.is_weights=truncate loss.decoupled=true``);

each at env latency 0 and at ``--latency`` seconds per env step (``env.kwargs.step_latency_s``;
``rollout.env_threads`` = ``--env-threads`` envs stepped at once, a stand-in for a tool or HTTP
environment that serves a few calls concurrently), where rollouts take longer than the update.

Reported per run: wall time of the RL steps (metrics timestamps from the step-0 evaluation to
step N - 1: the final evaluation, the same in every run, is left out), trained trajectories
per second over those steps and the speed-up over ``sync`` at the same latency, held-out success
at the end (256 layouts, one rollout each, with its standard error), the largest sampler-trainer
KL (k3 estimate of KL(behaviour || proximal) over a step's tokens; ``train/behaviour_kl_k3``,
logged when the correction computes the proximal policy, else the first update's
``approx_kl_k3``, the same quantity), the mean lag of the trained turns and the fraction of
corrected (truncated / masked) tokens. Single seed per setting: held-out differences smaller
than about two standard errors are noise. No number here is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time


def _cli(args: list[str], log: pathlib.Path) -> int:
    cmd = [sys.executable, "-m", "jaxrl_agent.cli", *map(str, args)]
    with open(log, "w") as f:
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)


def _train_args(out: pathlib.Path, sets: list[str]) -> list[str]:
    args = ["train", "--quiet", "--overwrite"]
    for s in sets + [f"run.dir={out}", "checkpoint.export=false",
                     "checkpoint.export_warmup=false", "metrics.tensorboard=false",
                     "metrics.plots=false", "checkpoint.every=0"]:
        args += ["--set", s]
    return args


def warm_start(root: pathlib.Path) -> pathlib.Path:
    folder = root / "_warmup" / "warmup_model"
    if (folder / "config.json").exists():
        return folder
    args = _train_args(root / "_warmup", ["trainer.steps=1", "trainer.eval_every=0"])
    args = [a if a != "checkpoint.export_warmup=false" else "checkpoint.export_warmup=true"
            for a in args]
    rc = _cli(args, root / "warmup.log")
    if rc != 0 or not (folder / "config.json").exists():
        raise SystemExit(f"the warm-up run failed (exit {rc}); see {root / 'warmup.log'}")
    return folder


def _rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run(root, name, warm, sets, steps, seed) -> dict:
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    base = [f"model.builtin_dir={warm}", "trainer.warmup_sft_steps=0", f"trainer.seed={seed}",
            f"trainer.steps={steps}", f"trainer.eval_every={steps}"]
    t0 = time.perf_counter()
    rc = _cli(_train_args(out, base + sets), out / "log.txt")
    wall_process = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{name}: exit {rc}; see {out / 'log.txt'}")
    rows = _rows(out / "metrics" / "metrics.jsonl")
    first, last = rows[0], rows[-1]
    trained = [r for r in rows if r["step"] > 0]
    # steps 1 .. N-1: from the step-0 evaluation's row to step N-1's (step N's row also
    # waits for the final evaluation)
    n = sum(64 - r.get("train/stale_refused", 0) for r in trained[:-1])
    wall = rows[-2]["time"] - first["time"]
    kl = [r.get("train/behaviour_kl_k3", r.get("train/approx_kl_k3", 0.0)) for r in trained]
    p = last["eval/success"]
    return {"name": name, "wall_s": wall, "process_s": wall_process,
            "traj_per_s": n / max(wall, 1e-9), "success": p,
            "se": math.sqrt(p * (1 - p) / 256), "start": first["eval/success"],
            "kl_max": max(kl), "lag_mean": sum(r.get("async/lag_mean", 0.0) for r in trained)
            / len(trained),
            "corrected": sum(r.get("train/is_corrected_frac", 0.0) for r in trained)
            / len(trained),
            "stale_refused": sum(r.get("train/stale_refused", 0) for r in trained)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench_async")
    p.add_argument("--warm-start", default=None, metavar="HF_DIR")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency", type=float, default=0.05, help="seconds per env step")
    p.add_argument("--env-threads", type=int, default=8)
    p.add_argument("--lags", default="1,2")
    p.add_argument("--set", action="append", default=[], dest="sets",
                   help="extra key=value for the async runs (e.g. loss.decoupled=true)")
    p.add_argument("--quick", action="store_true", help="latency setting only, lag 1")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    root = pathlib.Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    warm = pathlib.Path(a.warm_start) if a.warm_start else warm_start(root)
    lags = [1] if a.quick else [int(x) for x in a.lags.split(",")]
    latencies = [a.latency] if a.quick else [0.0, a.latency]
    print(f"load average before: {os.getloadavg()}", flush=True)
    results = []
    for lat in latencies:
        env = [f"env.kwargs.step_latency_s={lat}", f"rollout.env_threads={a.env_threads}"]
        settings = [("sync", [])] + [(f"async lag {lag}", [
            "trainer.async_rollouts=true", f"trainer.max_policy_lag={lag}",
            f"trainer.rollout_workers={lag}", *a.sets]) for lag in lags]
        base = None
        for label, sets in settings:
            name = f"lat{lat:g}_" + label.replace(" ", "_")
            r = run(root, name, warm, env + sets, a.steps, a.seed)
            r.update(label=label, latency=lat)
            base = base or r
            r["speedup"] = r["traj_per_s"] / base["traj_per_s"]
            results.append(r)
            print(f"  {label:12s} latency {lat:g} s: {r['wall_s']:.0f} s, held-out "
                  f"{r['success']:.2f} +- {r['se']:.2f}", flush=True)
    print(f"load average after: {os.getloadavg()}")
    print(f"\n{a.steps} RL steps of the default recipe from one warm start "
          f"(held-out {results[0]['start']:.2f} at step 0), seed {a.seed}; env latency per "
          f"step, {a.env_threads} env threads\n")
    print("| env latency | loop | wall (s) | trajectories/s | speed-up | held-out at end "
          "| max sampler-trainer KL | mean lag | corrected tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['latency'] * 1000:.0f} ms | {r['label']} | {r['wall_s']:.0f} | "
              f"{r['traj_per_s']:.1f} | {r['speedup']:.2f}x | {r['success']:.2f} +- "
              f"{r['se']:.2f} | {r['kl_max']:.4f} | {r['lag_mean']:.2f} | "
              f"{r['corrected']:.3f} |")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
