"""Running a lab comparison and reporting it: a text table, a JSON of the numbers, PNG plots.

``run_lab`` scores every arm (``scoring.score_arm``) at every (group size, groups per batch)
setting and trains it (``learning.train_curves``); ``format_table`` prints the result;
``plot_correlation_by_turn`` and ``plot_learning_curves`` draw it (matplotlib's Agg canvas,
no pyplot, like ``train/plots.py``).
"""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np

from jaxrl_agent.lab import learning, scoring
from jaxrl_agent.lab.arms import Arm
from jaxrl_agent.lab.tasks import Task

_DPI = 120


def run_lab(task: Task, arms: list[Arm], *, seeds: int = 4, group_sizes=(8,), num_groups=(4,),
            steps: int = 60, lr: float = 5.0, epochs: int = 2, seed: int = 0,
            log=None) -> dict:
    """Scores and trains every arm on ``task``; returns the JSON-ready result.

    Scoring: ``seeds`` batches per (arm, group size G, groups per batch B) setting, drawn from
    the fixed scoring policy. Training (skipped with ``steps=0``): ``seeds`` runs per arm at
    the first G and B, ``steps`` PPO steps each.
    """
    log = log or (lambda msg: None)
    out = dict(task=dict(task.info, name=task.name, num_states=task.mdp.num_states,
                         num_actions=task.mdp.num_actions, horizon=task.mdp.horizon),
               settings=dict(seeds=seeds, group_sizes=list(group_sizes),
                             num_groups=list(num_groups), steps=steps, lr=lr, epochs=epochs,
                             seed=seed),
               arms={})
    for arm in arms:  # every arm must run on lab batches before any work starts
        scoring.check_arm(task, arm)
    for arm in arms:
        t0 = time.perf_counter()
        res = dict(description=arm.description, scores=[])
        for g in group_sizes:
            for b in num_groups:
                sc = scoring.score_arm(task, arm, seeds=seeds, num_groups=b, group_size=g,
                                       seed=seed)
                sc.pop("per_seed")
                res["scores"].append(dict(group_size=g, num_groups=b, **sc))
        if steps > 0:
            curves = learning.train_curves(task.mdp, arm, seeds=seeds, steps=steps,
                                           num_groups=num_groups[0],
                                           group_size=group_sizes[0], lr=lr, epochs=epochs,
                                           seed=seed)
            res["learning"] = learning.summarize(curves)
            res["learning"]["per_seed_final"] = curves[:, -1].tolist()
            res["learning"]["per_seed_auc"] = curves.mean(axis=1).tolist()
        res["seconds"] = round(time.perf_counter() - t0, 2)
        out["arms"][arm.name] = res
        log(f"{arm.name}: {res['seconds']:.1f} s")
    return out


def format_table(result: dict) -> str:
    """One row per arm and setting: metric means (across-seed std, ddof = 1, in brackets), the
    number of degenerate seeds (constant credit or exact advantage: correlation 0, averaged
    in) and the final and average success of training, mean +- the 95% t-CI half-width."""
    seeds = result["settings"]["seeds"]
    head = (f"{'arm':<16} {'G':>3} {'B':>3}  {'pearson':>13} {'spearman':>13} {'sign':>13} "
            f"{'nmse':>13} {'cell_pearson':>13} {'degen':>6}  {'final +-95% CI':>16} "
            f"{'mean +-95% CI':>16}")
    lines = [f"# {result['task']['name']}: " + ", ".join(
        f"{k}={v}" for k, v in result["task"].items() if k != "name"),
        "# metrics: mean (across-seed std) over seeds; degen: degenerate seeds; success: exact "
        "J, mean +- 95% t-CI", head, "-" * len(head)]
    for name, res in result["arms"].items():
        learn = res.get("learning")
        for i, sc in enumerate(res["scores"]):
            cells = " ".join(f"{sc[m][0]:>7.3f}({sc[m][1]:.2f})"[:13].rjust(13)
                             for m in scoring.METRICS)
            cells += f" {sc['degenerate']:>3}/{seeds:<2}"
            tail = ""
            if learn and i == 0:
                tail = "  " + " ".join(
                    f"{learn[k]['mean']:>7.3f}+-{learn[k]['ci']:.3f}".rjust(16)
                    for k in ("final", "auc"))
            lines.append(f"{name:<16} {sc['group_size']:>3} {sc['num_groups']:>3}  {cells}{tail}")
    return "\n".join(lines)


def write_json(result: dict, path) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def new_figure(width=7.0, height=4.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, path) -> str:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    return str(path)


def plot_correlation_by_turn(result: dict, path) -> str:
    """Pearson corr(C, A) at each turn index, one line per arm (first setting)."""
    fig = new_figure()
    ax = fig.add_subplot(1, 1, 1)
    for name, res in result["arms"].items():
        sc = res["scores"][0]
        ax.plot(np.arange(len(sc["per_turn"])), sc["per_turn"], marker="o", label=name)
    sc0 = next(iter(result["arms"].values()))["scores"][0]
    ax.set_xlabel("turn k")
    ax.set_ylabel("Pearson corr(credit, exact A) at turn k")
    ax.set_title(f"{result['task']['name']}: credit vs exact advantage "
                 f"(G={sc0['group_size']}, B={sc0['num_groups']}, "
                 f"{result['settings']['seeds']} seeds)", fontsize=10)
    ax.axhline(0.0, color="gray", lw=0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_learning_curves(curves: dict, path, title: str = "", optimum=None) -> str:
    """Mean exact success vs step with a shaded 95% CI, one line per arm. ``curves``: name ->
    ``learning.summarize`` output (or an arm result with a ``learning`` entry)."""
    fig = new_figure()
    ax = fig.add_subplot(1, 1, 1)
    for name, s in curves.items():
        s = s.get("learning", s)
        mean, ci = np.asarray(s["mean"]), np.asarray(s["ci"])
        x = np.arange(len(mean))
        (line,) = ax.plot(x, mean, label=name)
        ax.fill_between(x, mean - ci, mean + ci, color=line.get_color(), alpha=0.2)
    if optimum is not None:
        ax.axhline(optimum, color="gray", ls="--", lw=0.8, label="optimal policy")
    ax.set_xlabel("training step")
    ax.set_ylabel("exact success probability J(pi)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
