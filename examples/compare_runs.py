"""Compare training variants over several seeds from one warm start: held-out learning curves
with 95% intervals and paired differences.

    python examples/compare_runs.py OUT_DIR --seeds 0 1 2 \
        --variant grpo: \
        --variant gigpo:estimator.name=gigpo \
        --variant turn_gae:estimator.name=turn_gae,model.value_head=true \
        [--set key=value ...] [--jobs 2]

1. One supervised warm-up (the config after ``--set``, seed 0) is run once and saved as an HF
   folder (``OUT_DIR/_warmup/warmup_model``), or ``--warm-start HF_DIR`` gives one (e.g. the
   default run's ``runs/cpu_default/warmup_model``).
2. Every (variant, seed) runs ``jaxrl-agent train`` from that folder
   (``model.builtin_dir=...``, ``trainer.warmup_sft_steps=0``, ``trainer.seed=SEED``) as its
   own run ``OUT_DIR/<variant>/seed<SEED>``; a finished run (its ``metrics.jsonl`` reaches
   ``trainer.steps``) is not run again, an unfinished one is resumed.
3. ``OUT_DIR/summary.json``, ``OUT_DIR/curves.png`` and ``OUT_DIR/summary.md``: per variant
   and evaluation step, the mean held-out success over seeds with a 95% t-interval; the lift
   over the step-0 evaluation; and the paired difference to the first variant (same seed =
   same held-out tasks and same RL task stream), with its 95% t-interval.

The held-out set of a run depends on its seed (``trainer.seed``), so seeds differ in tasks as
well as in sampling; each evaluation's own binomial standard error is reported beside the
spread over seeds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np


# two-sided 95% quantiles of Student's t for 1..10 degrees of freedom; 1.96 beyond 30
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def _t95(n: int) -> float:
    """The 97.5% quantile of Student's t with n - 1 degrees of freedom (nan for n < 2)."""
    df = n - 1
    if df < 1:
        return float("nan")
    if df <= len(_T95):
        return _T95[df - 1]
    return 2.042 if df <= 30 else 1.96  # conservative between 11 and 30


def _ci(values) -> tuple[float, float]:
    v = np.asarray(values, float)
    if len(v) < 2:
        return float(v.mean()) if len(v) else float("nan"), float("nan")
    return float(v.mean()), _t95(len(v)) * float(v.std(ddof=1)) / math.sqrt(len(v))


def _parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition(":")
    if not name or "/" in name:
        raise SystemExit(f"--variant {text!r}: give NAME:key=value,key=value (NAME without /)")
    return name, [s for s in sets.split(",") if s.strip()]


def _rows(metrics_path: pathlib.Path) -> list[dict]:
    if not metrics_path.exists():
        return []
    rows = []
    for line in metrics_path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _eval_curve(metrics_path: pathlib.Path) -> dict[int, dict]:
    return {int(r["step"]): {"success": float(r["eval/success"])}
            for r in _rows(metrics_path) if r.get("eval/success") is not None}


def _train_means(metrics_path: pathlib.Path) -> dict[str, float]:
    """Means over a run's RL steps of the share of zero-advantage groups and the step time."""
    rows = [r for r in _rows(metrics_path) if r.get("train/group_zero_frac") is not None]
    out = {}
    for name, keys in (("group_zero_frac", ("train/group_zero_frac",)),
                       ("step_s", ("time/rollout_s", "time/train_s"))):
        vals = [sum(r[k] for k in keys) for r in rows if all(k in r for k in keys)]
        out[name] = float(np.mean(vals)) if vals else float("nan")
    return out


def _auc(curve: dict[int, dict], steps: list[int]) -> float:
    """Mean held-out success over the evaluations after step 0 (the area under the curve per
    evaluation; with evenly spaced evaluations the trapezoid's ranking)."""
    later = [curve[s]["success"] for s in steps if s > 0 and s in curve]
    return float(np.mean(later)) if later else float("nan")


def _cli(args: list[str], log: pathlib.Path) -> int:
    cmd = [sys.executable, "-m", "jaxrl_agent.cli", *map(str, args)]
    with open(log, "w") as f:
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)


def _run_args(out: pathlib.Path, sets: list[str], warmup_export: bool = False) -> list[str]:
    args = ["train", "--quiet"]
    for s in sets + [f"run.dir={out}", "checkpoint.export=false",
                     f"checkpoint.export_warmup={str(warmup_export).lower()}",
                     "metrics.tensorboard=false", "checkpoint.every=0"]:
        args += ["--set", s]
    return args


def warm_start(root: pathlib.Path, sets: list[str]) -> pathlib.Path:
    """The warmed-up model (HF folder), made once by a one-step run of the base config."""
    folder = root / "_warmup" / "warmup_model"
    if (folder / "config.json").exists():
        return folder
    out = root / "_warmup"
    if out.exists():
        import shutil
        shutil.rmtree(out)
    rc = _cli(_run_args(out, sets + ["trainer.steps=1", "trainer.seed=0"], warmup_export=True),
              root / "warmup.log")
    if rc != 0 or not (folder / "config.json").exists():
        raise SystemExit(f"the warm-up run failed (exit {rc}); see {root / 'warmup.log'}")
    return folder


def run_one(root, warm, variant, vsets, seed, base_sets, steps) -> pathlib.Path:
    out = root / variant / f"seed{seed}"
    metrics = out / "metrics" / "metrics.jsonl"
    curve = _eval_curve(metrics)
    if curve and max(curve) >= steps:
        return out
    out.mkdir(parents=True, exist_ok=True)
    sets = base_sets + vsets + [f"model.builtin_dir={warm}", "trainer.warmup_sft_steps=0",
                                f"trainer.seed={seed}"]
    args = _run_args(out, sets)
    if (out / "config.yaml").exists():  # an unfinished run of an earlier invocation: go on
        args.append("--resume")
    rc = _cli(args, out / "log.txt")
    if rc != 0:
        print(f"  {variant} seed {seed}: exit {rc}, see {out / 'log.txt'}", file=sys.stderr)
    return out


def summarize(root, variants, seeds, eval_tasks) -> dict:
    curves = {v: {s: _eval_curve(root / v / f"seed{s}" / "metrics" / "metrics.jsonl")
                  for s in seeds} for v, _ in variants}
    steps = sorted(set.intersection(*[set(c) for v in curves for c in curves[v].values()
                                      if c] or [set()]))
    base = variants[0][0]
    out = {"steps": steps, "seeds": seeds, "eval_tasks": eval_tasks, "variants": {}}
    for v, sets in variants:
        per = {}
        for st in steps:
            vals = [curves[v][s][st]["success"] for s in seeds if st in curves[v][s]]
            m, h = _ci(vals)
            lift = [curves[v][s][st]["success"] - curves[v][s][0]["success"]
                    for s in seeds if st in curves[v][s] and 0 in curves[v][s]]
            lm, lh = _ci(lift)
            diff = [curves[v][s][st]["success"] - curves[base][s][st]["success"]
                    for s in seeds if st in curves[v][s] and st in curves[base][s]]
            dm, dh = _ci(diff)
            se = float(np.mean([math.sqrt(max(x * (1 - x), 0) / eval_tasks) for x in vals]))
            per[st] = {"values": vals, "mean": m, "ci95": h, "lift": lm, "lift_ci95": lh,
                       "diff_vs_" + base: dm, "diff_ci95": dh, "eval_se": se}
        aucs = {s: _auc(curves[v][s], steps) for s in seeds if curves[v][s]}
        am, ah = _ci(list(aucs.values()))
        adiff = [aucs[s] - _auc(curves[base][s], steps) for s in aucs if curves[base][s]]
        adm, adh = _ci(adiff)
        means = [_train_means(root / v / f"seed{s}" / "metrics" / "metrics.jsonl") for s in seeds]
        out["variants"][v] = {
            "sets": sets, "per_step": per, "auc": am, "auc_ci95": ah,
            "auc_diff_vs_" + base: adm, "auc_diff_ci95": adh,
            "group_zero_frac": float(np.nanmean([m["group_zero_frac"] for m in means])),
            "step_s": float(np.nanmean([m["step_s"] for m in means]))}
    return out


def write_report(root: pathlib.Path, summary: dict) -> None:
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    steps, variants = summary["steps"], summary["variants"]
    if not steps:
        return
    base = next(iter(variants))
    last = steps[-1]
    lines = [f"held-out success over seeds {summary['seeds']} ({summary['eval_tasks']} tasks "
             f"each; mean +- 95% t-interval over seeds; AUC = mean success over the evaluations "
             f"after step 0; eval SE = binomial standard error of one evaluation; zero-adv = "
             f"mean share of groups whose advantages are all 0)", "",
             f"| variant | step 0 | step {last} | lift (step {last} - step 0) | "
             f"paired diff vs {base} at step {last} | AUC | paired AUC diff vs {base} | "
             f"eval SE | zero-adv groups |", "|---|---|---|---|---|---|---|---|---|"]
    for v, d in variants.items():
        p0, pl = d["per_step"][steps[0]], d["per_step"][last]
        diff = "-" if v == base else f"{pl['diff_vs_' + base]:+.3f} +- {pl['diff_ci95']:.3f}"
        adiff = ("-" if v == base else
                 f"{d['auc_diff_vs_' + base]:+.3f} +- {d['auc_diff_ci95']:.3f}")
        lines.append(f"| {v} | {p0['mean']:.3f} +- {p0['ci95']:.3f} | "
                     f"{pl['mean']:.3f} +- {pl['ci95']:.3f} | {pl['lift']:+.3f} +- "
                     f"{pl['lift_ci95']:.3f} | {diff} | {d['auc']:.3f} +- {d['auc_ci95']:.3f} | "
                     f"{adiff} | {pl['eval_se']:.3f} | {d['group_zero_frac']:.2f} |")
    (root / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for v, d in variants.items():
        m = np.array([d["per_step"][s]["mean"] for s in steps])
        h = np.nan_to_num(np.array([d["per_step"][s]["ci95"] for s in steps]))
        ax.plot(steps, m, marker="o", ms=3, label=f"{v} (n={len(summary['seeds'])})")
        ax.fill_between(steps, m - h, m + h, alpha=0.2)
    ax.set_xlabel("RL step (0 = after the warm-up)")
    ax.set_ylabel("held-out success")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("held-out success, mean and 95% interval over seeds")
    fig.tight_layout()
    fig.savefig(root / "curves.png")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output directory (re-running resumes: finished runs are kept)")
    p.add_argument("--variant", action="append", required=True,
                   help="NAME:key=value,key=value (the first variant is the baseline)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--set", action="append", default=[], dest="sets",
                   help="override for every run (and the warm-up)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each uses every core)")
    p.add_argument("--warm-start", default=None, metavar="HF_DIR",
                   help="start every run from this model (e.g. runs/cpu_default/warmup_model) "
                        "instead of running a warm-up here")
    p.add_argument("--warmup-only", action="store_true",
                   help="make the shared warm-up (OUT_DIR/_warmup/warmup_model) and stop")
    a = p.parse_args(argv)
    root = pathlib.Path(a.out).absolute()
    root.mkdir(parents=True, exist_ok=True)
    variants = [_parse_variant(v) for v in a.variant]
    from jaxrl_agent import run_checks
    cfg = run_checks.load(None, a.sets)
    warm = pathlib.Path(a.warm_start).absolute() if a.warm_start else warm_start(root, a.sets)
    if not (warm / "config.json").exists():
        raise SystemExit(f"--warm-start {warm}: no config.json (not an HF model folder)")
    print(f"warm start: {warm}", flush=True)
    if a.warmup_only:
        return 0
    jobs = [(v, vs, s) for s in a.seeds for v, vs in variants]
    with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
        futs = {pool.submit(run_one, root, warm, v, vs, s, a.sets, cfg.trainer.steps): (v, s)
                for v, vs, s in jobs}
        for f in concurrent.futures.as_completed(futs):
            v, s = futs[f]
            c = _eval_curve(f.result() / "metrics" / "metrics.jsonl")
            print(f"  {v} seed {s}: " + " ".join(f"{k}:{x['success']:.3f}"
                                                 for k, x in sorted(c.items())), flush=True)
    write_report(root, summarize(root, variants, a.seeds, cfg.trainer.eval_tasks))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
