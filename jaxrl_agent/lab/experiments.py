"""The three reproductions of ``docs/lab.md``, as functions and a script.

    python -m jaxrl_agent.lab.experiments [--seeds 16] [--out docs] [--only gigpo,vd,crossover]

prints the numbers of the tables in ``docs/lab.md``, writes them (without the per-step
curves, which are in the plots) to ``lab_experiments.json`` and the plots ``lab_*.png`` into
``--out``. Training settings are shared by every arm of an experiment
(same seeds, so differences are paired per seed); credit is RMS-normalised per batch
(``learning.train_curves(scale="rms")``), so arms differ only in where the credit goes.

1. ``gigpo``: step-level grouping (GiGPO) vs trajectory-level GRPO on the grid world (states
   recur, also within a rollout) and on a random tree (states recur only across rollouts).
2. ``vd``: on a prerequisite chain at low V_d = 1/6: sparse binary outcome vs uniform
   redistribution of the dense verifier score vs the same advantage targeted at verified
   turns vs the matched-concentration shuffled control.
3. ``crossover``: the same arms as V_d = k / C grows from 1/6 to 1.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from jaxrl_agent.lab import arms as lab_arms
from jaxrl_agent.lab import learning, report, scoring, tasks
from jaxrl_agent.lab.mdp import optimal_return, warm_start_logits

TRAIN = dict(steps=60, num_groups=2, group_size=8, lr=5.0)


def _compare(task, specs, seeds, init=None, reference=None, **train):
    """Curves of every arm on ``task`` and paired differences (AUC, final) against
    ``reference`` (the first spec by default)."""
    train = {**TRAIN, **train}
    curves = {s: learning.train_curves(task.mdp, lab_arms.parse_arm(s), seeds=seeds,
                                       init_logits=init, **train) for s in specs}
    ref = reference or specs[0]
    out = dict(task=task.describe(), train=train, arms={})
    for s, c in curves.items():
        res = dict(learning.summarize(c))
        if s != ref:
            res["vs_" + ref] = dict(auc=learning.paired_difference(c.mean(1), curves[ref].mean(1)),
                                    final=learning.paired_difference(c[:, -1], curves[ref][:, -1]))
        out["arms"][s] = res
    return out


def _scores(task, specs, seeds, logits=None, group_size=8, num_groups=4):
    out = {}
    for s in specs:
        sc = scoring.score_arm(task, lab_arms.parse_arm(s), seeds=seeds, logits=logits,
                               group_size=group_size, num_groups=num_groups)
        sc.pop("per_seed")
        out[s] = sc
    return out


def gigpo_vs_grpo(seeds: int = 16, out_dir=None) -> dict:
    """Reproduction 1: GiGPO vs GRPO where states recur."""
    res = {}
    grid = tasks.make_task("gridworld")
    init = warm_start_logits(grid.mdp, 1.5)
    res["gridworld"] = _compare(grid, ["grpo", "gigpo"], seeds, init=init)
    res["gridworld"]["scores"] = _scores(grid, ["grpo", "gigpo", "mc_minus_v"], seeds, init)
    tree = tasks.make_task("tree", depth=10, width=8, num_actions=4)
    res["tree"] = _compare(tree, ["grpo", "gigpo"], seeds)
    res["tree"]["scores"] = _scores(tree, ["grpo", "gigpo", "mc_minus_v"], seeds)
    if out_dir is not None:
        for name, task in (("gridworld", grid), ("tree", tree)):
            report.plot_learning_curves(
                res[name]["arms"], pathlib.Path(out_dir) / f"lab_gigpo_{name}.png",
                title=f"{name}: GiGPO vs GRPO, exact success, mean and 95% CI, {seeds} seeds",
                optimum=float(optimal_return(task.mdp)))
    return res


VD_ARMS = ["sparse", "uniform", "targeted", "shuffled"]


def low_vd(seeds: int = 16, out_dir=None, length: int = 6, exposed: int = 1) -> dict:
    """Reproduction 2: the arms of the credit-targeting paper at low V_d."""
    task = tasks.make_task("chain", length=length, exposed=exposed)
    res = _compare(task, VD_ARMS, seeds, reference="uniform")
    if out_dir is not None:
        report.plot_learning_curves(
            res["arms"], pathlib.Path(out_dir) / "lab_vd_low.png",
            title=f"chain C={length}, V_d={exposed}/{length}: exact success, 95% CI, "
                  f"{seeds} seeds", optimum=1.0)
    return res


def crossover(seeds: int = 16, out_dir=None, length: int = 6) -> dict:
    """Reproduction 3: final and mean success of each arm as V_d = k / C grows."""
    res = {}
    for k in range(1, length + 1):
        res[k] = _compare(tasks.make_task("chain", length=length, exposed=k), VD_ARMS, seeds,
                          reference="uniform")
    if out_dir is not None:
        from jaxrl_agent.lab.report import new_figure, save_figure
        fig = new_figure()
        ax = fig.add_subplot(1, 1, 1)
        vd = np.arange(1, length + 1) / length
        for arm in VD_ARMS:
            m = np.array([res[k]["arms"][arm]["auc"]["mean"] for k in res])
            ci = np.array([res[k]["arms"][arm]["auc"]["ci"] for k in res])
            ax.errorbar(vd, m, yerr=ci, marker="o", capsize=3, label=arm)
        ax.set_xlabel("verifier information density V_d = k / C")
        ax.set_ylabel("mean exact success over training (AUC)")
        ax.set_title(f"chain C={length}: arms vs V_d, mean and 95% CI, {seeds} seeds",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save_figure(fig, pathlib.Path(out_dir) / "lab_vd_crossover.png")
    return res


EXPERIMENTS = {"gigpo": gigpo_vs_grpo, "vd": low_vd, "crossover": crossover}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--seeds", type=int, default=16)
    p.add_argument("--out", default="docs")
    p.add_argument("--only", default=",".join(EXPERIMENTS))
    args = p.parse_args(argv)
    results = {}
    for name in args.only.split(","):
        t0 = time.perf_counter()
        results[name] = EXPERIMENTS[name](seeds=args.seeds, out_dir=args.out)
        print(f"# {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        print(json.dumps(brief(results[name]), indent=1, default=_short))
    path = pathlib.Path(args.out) / "lab_experiments.json"
    path.write_text(json.dumps(brief(results), indent=1, default=_short))
    return 0


def _short(x):
    return str(x)


def brief(res):
    """The result without the per-step curves (final, AUC and paired differences only)."""
    if isinstance(res, dict):
        return {k: brief(v) for k, v in res.items() if k not in ("mean", "std", "ci")
                or not isinstance(v, list)}
    return res


if __name__ == "__main__":
    sys.exit(main())
