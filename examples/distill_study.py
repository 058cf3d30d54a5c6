"""On-policy distillation where outcome RL failed: the horizon study's L2 (7x7 grid world, 13
optimal turns), where GRPO fell below its warm start (docs/training.md, "A teacher in the
loop").

    python examples/distill_study.py [--out runs/distill] [--seeds 0 1 2 3 4] [--jobs 1]
    python examples/distill_study.py --report [--out runs/distill] [--arms grpo topk ...]
    python examples/distill_study.py --level L3 --out runs/distill_L3 --all --arms grpo ...

1. The student: the L2 warm start of the horizon study (the default run's noisy demonstrator,
   25% random actions, seed 0), made by ``examples/compare_runs.py``.
2. The teacher: a stronger checkpoint of the same tokenizer, a warm-up on a demonstrator that
   never errs (``TEACHER_SETS``), made the same way; its held-out success (the warm-up run's
   step-0 evaluation: 128 held-out layouts of seed 0) is the ceiling.
3. From the student's warm start, the variants x seeds, each ``jaxrl-agent train`` with the
   horizon study's L2 budget (4 tasks x 8 samples, 60 steps, 128 held-out layouts; evaluated
   every 30 steps to fit a session): GRPO; OPD alone (``estimator.name: opd``, the
   advantage beta (lp_T - lp_old) per token); and the top-K distillation (``loss.aux:
   [topk_kl]`` with ``teacher.top_k: 16``: the forward KL from the teacher's 16 most likely
   next tokens to the student's at every action position the student visited, with no policy
   gradient: OPD's advantage at beta 0), and the same with 4 optimizer updates per step at lr
   1e-3 (``topk_mb4_lr1e-3``: distillation's target is fixed, so it can use its batch more than
   outcome RL can); with ``--all`` also GRPO + OPD
   (``estimator.then: [seed]``: the GRPO advantage plus lp_T - lp_old, as slime's
   ``--use-opd``) and PBRS with the grid world's potential (``estimator.shaping: [pbrs]``, no
   teacher), and the warm start's own distribution sharpened to T = 0.5 as the target
   (``teacher.source: base``, ``teacher.temperature: 0.5``, through the top K): alone
   (``sharpen_topk``), beside GRPO (``grpo+sharpen_topk``) and its control at T = 1
   (``grpo+anchor_topk``). The same seed gives every variant the same task stream and
   held-out layouts, so differences are paired. ``--level L3`` runs the same at the horizon
   study's L3 (its warm-up and budget) in another ``--out``.
4. ``--report``: ``OUT/distill.md`` (table: step 0, final, paired difference to GRPO, the
   teacher's ceiling and the final / teacher ratio, s / step) and ``OUT/distill.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


horizon = _load("horizon_study")
compare = _load("compare_runs")

#: the level and budget of the horizon study's L2 runs (an evaluation every 30 steps, not 15)
BASE = horizon.LEVELS["L2"][1] + horizon.BUDGET + ["trainer.eval_every=30"]


def base(level: str = "L2") -> list[str]:
    """The overrides of ``level``'s runs (``horizon_study.LEVELS``): its env, the horizon
    study's budget for it, two evaluations after step 0."""
    if level == "L2":
        return BASE
    extra = horizon.LEVEL_BUDGET.get(level, [])
    steps = int([s.split("=")[1] for s in horizon.BUDGET + extra
                 if s.startswith("trainer.steps=")][-1])  # the last one given wins
    return horizon.LEVELS[level][1] + horizon.BUDGET + extra + [
        f"trainer.eval_every={steps // 2}"]
#: the teacher's warm-up: the same recipe with a demonstrator that never errs
TEACHER_SETS = ["trainer.sft_noise=0.0"]
#: the teacher's most likely tokens the top-K distillation reads per position
TOPK = 16
#: the distillation recipe that uses its batch more: 4 optimizer updates per step (one task's
#: 8 episodes each; the same forward / backward work as one update on all 32) at lr 1e-3
FAST = "trainer.mini_batches=4,optimizer.lr=1e-3"
#: the sharpened teacher: the student's own start weights scored at this temperature (the
#: warm start sampled at T = 0.5 succeeds far more often than at T = 1: docs/training.md)
SHARPEN = 0.5


def variants(teacher: pathlib.Path, every: bool = False) -> list[tuple[str, str]]:
    t = f"teacher.source={teacher}"
    topk = (f"estimator.name=opd,estimator.params.beta=0.0,{t},teacher.top_k={TOPK},"
            f"loss.aux=[topk_kl]")
    # no other checkpoint: the start weights at temperature SHARPEN, through the top K
    sharp_aux = (f"teacher.source=base,teacher.temperature={SHARPEN},teacher.top_k={TOPK},"
                 f"loss.aux=[topk_kl]")
    sharp = f"estimator.name=opd,estimator.params.beta=0.0,{sharp_aux}"
    # its control: the same loss towards the start weights at the rollouts' temperature
    anchor_aux = f"teacher.source=base,teacher.top_k={TOPK},loss.aux=[topk_kl]"
    return [("grpo", "estimator.name=grpo"), ("opd", f"estimator.name=opd,{t}"),
            ("topk", topk), ("topk_mb4_lr1e-3", f"{topk},{FAST}")] + (
        [("grpo+opd", f"estimator.name=grpo,estimator.then=[seed],{t}"),
         ("pbrs", "estimator.name=grpo,estimator.shaping=[pbrs]"),
         ("sharpen_topk", sharp), ("grpo+sharpen_topk", f"estimator.name=grpo,{sharp_aux}"),
         ("grpo+anchor_topk", f"estimator.name=grpo,{anchor_aux}")]
        if every else [])


def teacher_ceiling(out: pathlib.Path) -> dict:
    """The teacher's held-out success and its standard error: the step-0 evaluation of its
    warm-up run (128 held-out layouts of seed 0)."""
    p = compare._eval_curve(out / "teacher" / "_warmup" / "metrics" / "metrics.jsonl")[0][
        "success"]
    return {"success": p, "se": (p * (1 - p) / 128) ** 0.5}


def arms(teacher: pathlib.Path, every: bool, only) -> list[tuple[str, str]]:
    """The variants to run / report: those named in ``only`` when given, else all."""
    v = variants(teacher, every)
    if only:
        unknown = sorted(set(only) - {n for n, _ in v})
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; known: {[n for n, _ in v]}")
        return [x for x in v if x[0] in only]
    return v


def run(out: pathlib.Path, seeds, jobs: int, pbrs: bool, only=None, level="L2") -> None:
    for d in ("student", "teacher"):
        (out / d).mkdir(parents=True, exist_ok=True)
    level_sets = base(level)
    student = compare.warm_start(out / "student", level_sets)
    probe = pathlib.Path("/TEACHER")  # the stronger teacher is made only for arms that read it
    if any(str(probe) in sets for _, sets in arms(probe, pbrs, only)):
        teacher = compare.warm_start(out / "teacher", level_sets + TEACHER_SETS)
        ceiling = teacher_ceiling(out)
        print(f"teacher {teacher}: held-out success {ceiling}", flush=True)
        (out / "ceiling.json").write_text(json.dumps(ceiling))
    else:
        teacher = probe
    argv = [str(out / "runs"), "--seeds", *map(str, seeds), "--jobs", str(jobs),
            "--warm-start", str(student)]
    for name, sets in arms(teacher, pbrs, only):
        argv += ["--variant", f"{name}:{sets}"]
    for s in level_sets:
        argv += ["--set", s]
    compare.main(argv)


def _step_times(root: pathlib.Path, name: str, seeds) -> float:
    """Mean rollout + train seconds per RL step over steps 2.. of every seed's run."""
    t = []
    for s in seeds:
        rows = compare._rows(root / name / f"seed{s}" / "metrics" / "metrics.jsonl")
        t += [r["time/rollout_s"] + r["time/train_s"] for r in rows
              if r.get("step", 0) >= 2 and "time/train_s" in r]
    return float(np.mean(t)) if t else float("nan")


def report(out: pathlib.Path, pbrs: bool = False, seeds=None, only=None, level="L2") -> str:
    if not (out / "runs" / "summary.json").exists():
        raise SystemExit(f"--report: no study in {out} (runs/summary.json is missing); run it "
                         f"first: python examples/distill_study.py --out {out}")
    summary = json.loads((out / "runs" / "summary.json").read_text())
    # the stronger teacher's ceiling, when an arm of the study read it
    ceiling = (json.loads((out / "ceiling.json").read_text())
               if (out / "ceiling.json").exists() else None)
    seeds, steps = seeds or summary["seeds"], summary["steps"]
    last = steps[-1]
    names = [v[0] for v in arms(pathlib.Path("T"), pbrs, only)]
    if "grpo" not in names:
        names = ["grpo"] + names  # the paired differences are against GRPO
    t_mean = ceiling["success"] if ceiling else float("nan")
    lines = [f"Teacher (warm-up without demonstrator noise): held-out success {t_mean:.2f} "
             f"(standard error {ceiling['se']:.2f}, 128 layouts)." if ceiling else
             "No stronger teacher in this study (no final / teacher ratio).", "",
             "| method | step 0 | final | lift | paired diff vs GRPO, final | paired diff vs OPD, "
             "final | final / teacher | AUC | s / step |", "|---|---|---|---|---|---|---|---|---|"]
    curves = {}
    for name in names:
        c = {s: compare._eval_curve(out / "runs" / name / f"seed{s}" / "metrics" /
                                    "metrics.jsonl") for s in seeds}
        curves[name] = c
        first = compare._ci([c[s][0]["success"] for s in seeds])
        final = compare._ci([c[s][last]["success"] for s in seeds])
        ratio = compare._ci([c[s][last]["success"] / max(t_mean, 1e-9) for s in seeds])
        lift = compare._ci([c[s][last]["success"] - c[s][0]["success"] for s in seeds])
        auc = compare._ci([compare._auc(c[s], steps) for s in seeds])
        def paired(base):
            if name == base or base not in curves:
                return ""
            return "{:+.2f} +- {:.2f}".format(*compare._ci(
                [c[s][last]["success"] - curves[base][s][last]["success"] for s in seeds]))

        lines.append(f"| {name} | {first[0]:.2f} +- {first[1]:.2f} | {final[0]:.2f} +- "
                     f"{final[1]:.2f} | {lift[0]:+.2f} +- {lift[1]:.2f} | {paired('grpo')} | "
                     f"{paired('opd')} | "
                     f"{ratio[0]:.2f} +- {ratio[1]:.2f} | "
                     f"{auc[0]:.2f} +- {auc[1]:.2f} | "
                     f"{_step_times(out / 'runs', name, seeds):.2f} |")
    text = "\n".join(lines)
    (out / "distill.md").write_text(text + "\n")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.5, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name in names:
        m, h = zip(*[compare._ci([curves[name][s][k]["success"] for s in seeds])
                     for k in steps])
        m, h = np.asarray(m), np.asarray(h)
        ax.plot(steps, m, marker="o", label=name)
        ax.fill_between(steps, m - h, m + h, alpha=0.15)
    if ceiling:
        ax.axhline(t_mean, color="k", ls="--", lw=1, label="teacher")
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out success (128 layouts)")
    ax.set_title(f"{level} ({horizon.LEVELS[level][0]}): distillation vs outcome RL, "
                 f"{len(seeds)} seeds, 95% intervals", fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(out / "distill.png", dpi=110, bbox_inches="tight")
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/distill")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--report", action="store_true")
    p.add_argument("--all", action="store_true",
                   help="also GRPO + OPD and GRPO with PBRS shaping")
    p.add_argument("--arms", nargs="+", help="only these variants (run and report)")
    p.add_argument("--level", default="L2", choices=sorted(horizon.LEVELS),
                   help="the horizon study's level (its env, warm-up and budget; L2: the "
                        "measurements of docs/training.md)")
    a = p.parse_args(argv)
    out = pathlib.Path(a.out).absolute()
    if not a.report:
        run(out, a.seeds, a.jobs, a.all, a.arms, a.level)
    print(report(out, a.all, a.seeds, a.arms, a.level))
    return 0


if __name__ == "__main__":
    sys.exit(main())
