"""Where step-level credit matters: GRPO vs GiGPO vs a turn-level critic as the grid world's
horizon grows (docs/training.md, "Credit assignment as the horizon grows").

    python examples/horizon_study.py L2 [--out runs/horizon] [--seeds 0 1 2 3 4] [--jobs 2]
    python examples/horizon_study.py --report [--out runs/horizon]
    python examples/horizon_study.py L3 --time 8 [--out runs/horizon]   # step times, run alone

A level is a grid-world difficulty (``LEVELS``). For each level, ``examples/compare_runs.py``
makes one shared supervised warm-up (the noisy demonstrator of the default run, seed 0), then
runs every (method, seed) from it: the same seed gives the three methods the same RL task stream
and the same held-out layouts, so differences are paired. ``--report`` reads every level's
``summary.json`` and writes ``OUT/horizon.md`` (one table) and ``OUT/horizon.png`` (one panel
per level, mean and 95% interval over seeds).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent

#: level -> (description, overrides of the default config). max_turns leaves the solver's longest
#: plan 2 turns of slack (layouts with longer plans are not drawn). L3's warm-up imitates a less
#: noisy demonstrator (a random action 10% of the time, not 25%): with 25% its warm start
#: succeeded on 2% of the held-out layouts and RL had nothing to work with.
LEVELS = {
    "L1": ("5x5, one door (the default env)",
           ["env.kwargs.max_turns=12", "rollout.max_turns=12"]),
    "L2": ("7x7, one door",
           ["env.kwargs.size=7", "env.kwargs.max_turns=20", "rollout.max_turns=20"]),
    "L3": ("7x7, two doors (three rooms)",
           ["env.kwargs.size=7", "env.kwargs.doors=2", "env.kwargs.max_turns=24",
            "rollout.max_turns=24", "trainer.sft_noise=0.1"]),
    # the second family (docs/envs.md, "sokoban"): rooms drawn with an optimal solution of at
    # least min_moves moves; not run yet in docs/training.md
    "S1": ("Sokoban 6x6, one box, >= 8 moves",
           ["env.name=sokoban", "env.kwargs={size: 6, boxes: 1, min_moves: 8, max_turns: 20, "
            "action_names: letters}", "rollout.max_turns=20"]),
    "S2": ("Sokoban 8x8, two boxes, >= 12 moves",
           ["env.name=sokoban", "env.kwargs={size: 8, boxes: 2, min_moves: 12, max_turns: 30, "
            "action_names: letters}", "rollout.max_turns=30"]),
}

#: the methods compared; the first is the baseline of the paired differences
METHODS = [("grpo", "estimator.name=grpo"),
           ("gigpo", "estimator.name=gigpo"),
           ("turn_gae", "estimator.name=turn_gae,model.value_head=true")]

#: the RL budget of every run (chosen so that the whole study fits about 2.5 hours of 2 cores):
#: 4 tasks x 8 samples per step, 60 steps, an evaluation of 128 held-out layouts every 15 steps
BUDGET = ["rollout.tasks_per_step=4", "rollout.group_size=8", "trainer.steps=60",
          "trainer.eval_every=15", "trainer.eval_tasks=128", "metrics.plots=false",
          "metrics.rollout_samples=0"]
#: per-level changes of the budget: L3's episodes are the longest (up to 24 turns), so its runs
#: take 40 steps (an evaluation every 10) to keep the study within its time
LEVEL_BUDGET = {"L3": ["trainer.steps=40", "trainer.eval_every=10"]}


def _compare_runs():
    spec = importlib.util.spec_from_file_location("compare_runs", HERE / "compare_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def optimal_turns(level: str, num_tasks: int = 500) -> dict:
    """The solver's plan lengths on the level's layouts (``GridWorld.horizon_stats``)."""
    from jaxrl_agent import run_checks
    from jaxrl_agent import envs

    cfg = run_checks.load(None, LEVELS[level][1])
    return envs.make_env(cfg.env.name, **cfg.env.kwargs).horizon_stats(num_tasks)


def run_level(level: str, out: pathlib.Path, seeds, jobs: int) -> int:
    argv = [str(out / level), "--seeds", *map(str, seeds), "--jobs", str(jobs)]
    for name, sets in METHODS:
        argv += ["--variant", f"{name}:{sets}"]
    for s in LEVELS[level][1] + BUDGET + LEVEL_BUDGET.get(level, []):
        argv += ["--set", s]
    return _compare_runs().main(argv)


def time_level(level: str, out: pathlib.Path, steps: int) -> dict:
    """Seconds per RL step of each method on the level, from its warm start, one run at a time
    (run it with nothing else on the machine): the mean of rollout + train time over steps 2..
    ``steps`` (step 1 compiles). Written to ``OUT/<level>/timing.json``."""
    cr = _compare_runs()
    warm = out / level / "_warmup" / "warmup_model"
    if not (warm / "config.json").exists():
        raise SystemExit(f"{warm}: no warm start yet; run the level first")
    times = {}
    for name, sets in METHODS:
        run = out / level / "_timing" / name
        if run.exists():
            import shutil
            shutil.rmtree(run)
        run.mkdir(parents=True)
        extra = [s for s in BUDGET + LEVEL_BUDGET.get(level, [])
                 if not s.startswith(("trainer.steps", "trainer.eval_every"))]
        args = cr._run_args(run, LEVELS[level][1] + extra + sets.split(",") + [
            f"model.builtin_dir={warm}", "trainer.warmup_sft_steps=0", f"trainer.steps={steps}",
            "trainer.eval_every=0"])
        if cr._cli(args, run / "log.txt") != 0:
            raise SystemExit(f"timing run {name} failed: see {run / 'log.txt'}")
        rows = [r for r in cr._rows(run / "metrics" / "metrics.jsonl")
                if r.get("step", 0) >= 2 and "time/train_s" in r]
        times[name] = float(np.mean([r["time/rollout_s"] + r["time/train_s"] for r in rows]))
    (out / level / "timing.json").write_text(json.dumps(times, indent=1))
    return times


def report(out: pathlib.Path) -> str:
    levels = [lv for lv in LEVELS if (out / lv / "summary.json").exists()]
    if not levels:
        raise SystemExit(f"no {out}/L*/summary.json yet: run a level first")
    base = METHODS[0][0]
    lines = ["| level | optimal turns (mean, max) | method | step 0 | final | paired diff vs "
             f"{base}, final | AUC | paired AUC diff vs {base} | zero-adv groups | s / step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(4.2 * len(levels), 3.8), dpi=120)
    FigureCanvasAgg(fig)
    for i, lv in enumerate(levels):
        summary = json.loads((out / lv / "summary.json").read_text())
        steps = summary["steps"]
        first, last = str(steps[0]), str(steps[-1])
        turns = optimal_turns(lv)
        timing = (json.loads((out / lv / "timing.json").read_text())
                  if (out / lv / "timing.json").exists() else {})
        ax = fig.add_subplot(1, len(levels), i + 1)
        for name, d in summary["variants"].items():
            per = d["per_step"]
            p0, pl = per[first], per[last]
            diff = "-" if name == base else f"{pl['diff_vs_' + base]:+.3f} +- {pl['diff_ci95']:.3f}"
            adiff = ("-" if name == base else
                     f"{d['auc_diff_vs_' + base]:+.3f} +- {d['auc_diff_ci95']:.3f}")
            lines.append(f"| {lv}: {LEVELS[lv][0]} | {turns['mean']:.1f}, {turns['max']} | {name} | "
                         f"{p0['mean']:.2f} +- {p0['ci95']:.2f} | {pl['mean']:.2f} +- "
                         f"{pl['ci95']:.2f} | {diff} | {d['auc']:.3f} +- {d['auc_ci95']:.3f} | "
                         f"{adiff} | {d['group_zero_frac']:.2f} | "
                         + (f"{timing[name]:.2f} |" if name in timing else "- |"))
            m = np.array([per[str(s)]["mean"] for s in steps])
            h = np.nan_to_num(np.array([per[str(s)]["ci95"] for s in steps]))
            ax.plot(steps, m, marker="o", ms=3, label=name)
            ax.fill_between(steps, np.clip(m - h, 0, 1), np.clip(m + h, 0, 1), alpha=0.2)
        ax.set_title(f"{lv}: {LEVELS[lv][0]}\n(optimal {turns['mean']:.1f} turns on average)",
                     fontsize=9)
        ax.set_xlabel("RL step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.set_ylabel(f"held-out success ({len(summary['seeds'])} seeds, 95% interval)")
            ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "horizon.png")
    text = "\n".join(lines) + "\n"
    (out / "horizon.md").write_text(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("level", nargs="?", choices=sorted(LEVELS))
    p.add_argument("--out", default="runs/horizon")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--jobs", type=int, default=2, help="runs at once")
    p.add_argument("--report", action="store_true", help="combine the levels run so far")
    p.add_argument("--time", type=int, default=0, metavar="STEPS",
                   help="time STEPS RL steps of each method on LEVEL, one run at a time")
    a = p.parse_args(argv)
    out = pathlib.Path(a.out).absolute()
    if a.level is None and not a.report:
        p.error("give a LEVEL to run, or --report")
    if a.level is not None and a.time:
        print(json.dumps(time_level(a.level, out, a.time)))
    elif a.level is not None:
        rc = run_level(a.level, out, a.seeds, a.jobs)
        if rc:
            return rc
    if a.report:
        print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
