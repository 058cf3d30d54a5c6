"""Why GRPO falls below its warm start on the grid world's L2 (docs/training.md, "Why RL fell
below its warm start"): the horizon study's L2 runs with the per-step diagnostics on
(``metrics.policy_drift``, ``train.diagnostics``) and one ablation per lead.

    python examples/collapse_study.py run [--out runs/collapse] [--seeds 0 1 2] [--jobs 2]
        [--warm-start HF_DIR] [--arms grpo no_penalty ...]
    python examples/collapse_study.py report [--out runs/collapse]
    python examples/collapse_study.py temperatures --warm-start HF_DIR [--out runs/collapse]
    python examples/collapse_study.py probe --warm-start HF_DIR [--out runs/collapse]
        [--arms grpo shuffled ...] [--seeds 0 1 2] [--tasks 64]

``run`` calls ``examples/compare_runs.py`` with the horizon study's L2 level and budget
(``horizon_study.LEVELS``, ``BUDGET``) and the arms of ``ARMS`` (the first is the baseline of
the paired differences); every run logs the diagnostics. ``report`` writes ``OUT/collapse.md``
(per arm: held-out success at the start and end, and the diagnostics averaged over the first
and the last 15 steps, means over seeds) and ``OUT/collapse.png`` (per diagnostic, one curve
per arm: the mean over seeds of a 5-step moving average). ``probe`` reads the policies
themselves (each run's last checkpoint and the warm start) on the states of the solver's
shortest paths through each seed's held-out layouts: the probability of an optimal action,
by the stage of the task (``probe`` below); ``OUT/probe.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent

#: arm -> (what it tests, overrides). Lead (a): nothing bounds how far an update moves the
#: policy; lead (b): the invalid-move penalty under the std normalisation turns groups where
#: every rollout failed into full-size updates that push clean failures up.
ARMS = {
    "grpo": ("the horizon study's L2 recipe", []),
    "no_penalty": ("(b) no invalid-move penalty: groups without a success carry no credit",
                   ["env.kwargs.invalid_penalty=0.0"]),
    "dr_grpo": ("(b) no std normalisation: a penalty-only group's credit stays penalty-sized",
                ["estimator.name=dr_grpo"]),
    "kl_anchor": ("(a) a KL term to the warm start (k3, coefficient 0.05)",
                  ["loss.kl_coef=0.05"]),
    "lr1e-4": ("(a) a 5x smaller learning rate", ["optimizer.lr=1e-4"]),
    "shuffled": ("null control: the step's returns permuted across its episodes (the update "
                 "keeps its size and loses its signal)", ["trainer.shuffle_outcomes=true"]),
    "shuffled_lr1e-4": ("null control at the 5x smaller learning rate: how far noise of the "
                        "update's size moves the policy there",
                        ["trainer.shuffle_outcomes=true", "optimizer.lr=1e-4"]),
    "tasks16x2": ("(a) the same 32 episodes a step from 16 tasks x 2 instead of 4 x 8: more "
                  "independent groups with a signal per update",
                  ["rollout.tasks_per_step=16", "rollout.group_size=2"]),
    "tasks16x8_lr1e-4": ("recipe: 4x the episodes per update (16 tasks x 8) at the 5x smaller "
                         "learning rate: more signal per step against the same update noise",
                         ["rollout.tasks_per_step=16", "optimizer.lr=1e-4"]),
    "entmin_lr1e-4": ("sharpening: an entropy penalty (loss.entropy_coef -0.3) at the 5x smaller "
                      "learning rate (the warm start succeeds far more often at temperature 0.5 "
                      "than at 1; -0.02 did not move the entropy)",
                      ["loss.entropy_coef=-0.3", "optimizer.lr=1e-4"]),
    "entmin_shuffled_lr1e-4": ("its null control: the same penalty with the step's returns "
                               "permuted (what sharpening alone does)",
                               ["loss.entropy_coef=-0.3", "optimizer.lr=1e-4",
                                "trainer.shuffle_outcomes=true"]),
}
DEFAULT_ARMS = ["grpo", "no_penalty", "dr_grpo", "kl_anchor"]

#: the diagnostics plotted and tabulated: metric key -> label
DIAGNOSTICS = {
    "train/success": "train success",
    "train/kl_to_start": "KL(rollout policy || warm start)",
    "train/kl_after_update": "KL moved per step",
    "train/entropy": "entropy (nats / action token)",
    "train/grad_norm": "gradient norm",
    "train/group_zero_frac": "groups with all-zero advantages",
    "train/credit_no_success_groups": "credit mass on groups without a success",
    "train/credit_failed_signed": "signed credit on failures / mass",
    "train/invalid": "invalid actions per episode",
    "train/truncated": "episodes timed out",
    "train/noop_turns": "no-op turns",
    "train/repeat_turns": "turns in a state already visited",
}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(out: pathlib.Path, seeds, jobs: int, arms, warm_start: str | None) -> int:
    hs = _load("horizon_study")
    argv = [str(out), "--seeds", *map(str, seeds), "--jobs", str(jobs)]
    if warm_start:
        argv += ["--warm-start", warm_start]
    for arm in arms:
        argv += ["--variant", f"{arm}:" + ",".join(ARMS[arm][1])]
    for s in hs.LEVELS["L2"][1] + hs.BUDGET + ["estimator.name=grpo",
                                               "metrics.policy_drift=true"]:
        argv += ["--set", s]
    (out).mkdir(parents=True, exist_ok=True)
    (out / "arms.json").write_text(json.dumps({a: ARMS[a] for a in arms}, indent=1))
    return _load("compare_runs").main(argv)


def _series(path: pathlib.Path, key: str, steps: int) -> np.ndarray:
    rows = {int(r["step"]): r for r in _load_rows(path)}
    return np.array([float(rows[s][key]) if s in rows and rows[s].get(key) is not None
                     else np.nan for s in range(1, steps + 1)])


def _load_rows(path: pathlib.Path) -> list:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _finished(out: pathlib.Path, arm: str, steps: int) -> list[int]:
    """The seeds of ``arm`` whose run reached ``steps``."""
    done = []
    for p in sorted((out / arm).glob("seed*")):
        rows = _load_rows(p / "metrics" / "metrics.jsonl") if (
            p / "metrics" / "metrics.jsonl").exists() else []
        if any(int(r["step"]) >= steps and "eval/success" in r for r in rows):
            done.append(int(p.name[4:]))
    return done


def report(out: pathlib.Path, arms, steps: int = 60) -> str:
    """The table and figure of the finished runs of ``arms`` (an arm's unfinished or missing
    seeds are left out of it; paired differences use the seeds both arms finished)."""
    cr = _load("compare_runs")
    seeds = {a: _finished(out, a, steps) for a in arms}
    cfg_tasks = 128  # the horizon study's evaluation (horizon_study.BUDGET)
    summary = {"variants": {}}
    for a in arms:  # compare_runs' summary of this arm against the baseline on common seeds
        common = [s for s in seeds[a] if s in seeds[arms[0]]]
        part = cr.summarize(out, [(arms[0], []), (a, [])] if a != arms[0] else [(a, [])],
                            common, cfg_tasks)
        summary["variants"][a] = part["variants"][a]
        summary["steps"] = part["steps"]
    (out / "collapse_summary.json").write_text(json.dumps(summary, indent=1))
    data = {a: {k: np.stack([_series(out / a / f"seed{s}" / "metrics" / "metrics.jsonl", k,
                                     steps) for s in seeds[a]]) for k in DIAGNOSTICS}
            for a in arms}
    lines = [f"Seeds per arm: {seeds} (paired differences over the seeds both arms ran); "
             f"diagnostics: means over seeds of the mean over steps 1-15 -> steps "
             f"{steps - 14}-{steps}.", "",
             "| arm | seeds | held-out step 0 | final | lift | paired diff vs " + arms[0] +
             ", final | " + " | ".join(DIAGNOSTICS.values()) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(DIAGNOSTICS)]
    variants, evals = summary["variants"], summary["steps"]
    for a in arms:
        first, last = (variants[a]["per_step"][st] for st in (evals[0], evals[-1]))
        cells = []
        for k in DIAGNOSTICS:
            x = data[a][k]
            cells.append(f"{np.nanmean(x[:, :15]):.3g} -> {np.nanmean(x[:, -15:]):.3g}")
        diff = "" if a == arms[0] else (f"{last['diff_vs_' + arms[0]]:+.2f} +- "
                                        f"{last['diff_ci95']:.2f}")
        lines.append(f"| {a} | {len(seeds[a])} | {first['mean']:.2f} +- {first['ci95']:.2f} | "
                     f"{last['mean']:.2f} +- {last['ci95']:.2f} | "
                     f"{last['lift']:+.2f} +- {last['lift_ci95']:.2f} | {diff} | "
                     + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out / "collapse.md").write_text(text)

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    keys = ["eval"] + list(DIAGNOSTICS)
    cols = 4
    fig = Figure(figsize=(4 * cols, 3 * ((len(keys) + cols - 1) // cols)))
    FigureCanvasAgg(fig)
    for i, k in enumerate(keys):
        ax = fig.add_subplot((len(keys) + cols - 1) // cols, cols, i + 1)
        for a in arms:
            if k == "eval":
                per = variants[a]["per_step"]
                xs = list(evals)
                m = np.array([per[st]["mean"] for st in xs])
                ci = np.nan_to_num(np.array([per[st]["ci95"] for st in xs]))
                ax.plot(xs, m, marker="o", label=a)
                ax.fill_between(xs, m - ci, m + ci, alpha=0.15)
            else:
                x = data[a][k]
                smooth = np.stack([np.convolve(np.nan_to_num(r), np.ones(5) / 5, "valid")
                                   for r in x])
                ax.plot(np.arange(5, steps + 1), smooth.mean(0), label=a)
        ax.set_title("held-out success (95% interval)" if k == "eval" else DIAGNOSTICS[k],
                     fontsize=9)
        ax.set_xlabel("RL step", fontsize=8)
        if i == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "collapse.png", dpi=90)
    return text


def temperatures(warm_start: str, seeds, temps, out: pathlib.Path) -> str:
    """The warm start's held-out success when sampled at each of ``temps``, on each seed's
    evaluation set (the tasks and episode seeds a run of that seed evaluates at step 0): how
    much success a sharper policy would have without learning anything new. Written to
    ``OUT/temperatures.md``."""
    from jaxrl_agent import envs, run_checks
    from jaxrl_agent.rollout import collect_groups
    from jaxrl_agent.train.build import build_model, build_sampler
    from jaxrl_agent.train.loop import step_seed
    hs = _load("horizon_study")
    cfg = run_checks.load(None, hs.LEVELS["L2"][1] + hs.BUDGET + [
        f"model.builtin_dir={warm_start}", "trainer.warmup_sft_steps=0"])
    model, codec, _ = build_model(cfg, 0)
    sampler = build_sampler(cfg, model)
    env = envs.make_env(cfg.env.name, **cfg.env.kwargs)
    base = cfg.rollout.collect_config(prompt_prefix=(codec.bos_token_id,))
    table = {t: [] for t in temps}
    for seed in seeds:
        tasks = env.sample_tasks(step_seed(seed, -1, "eval"), cfg.trainer.eval_tasks, "test")
        for t in temps:
            rc = dataclasses.replace(base, group_size=1, temperature=t)
            _, st = collect_groups(env, tasks, sampler, codec, rc,
                                   seed=step_seed(seed, 0, "eval"))
            table[t].append(st["success_rate"])
    n = cfg.trainer.eval_tasks
    lines = [f"warm start {warm_start}: held-out success by sampling temperature ({n} tasks "
             f"per seed; seeds {' '.join(map(str, seeds))})", "",
             "| temperature | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for t in temps:
        v = table[t]
        lines.append(f"| {t:g} | " + " | ".join(f"{x:.3f}" for x in v)
                     + f" | {np.mean(v):.3f} |")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "temperatures.md").write_text(text)
    return text


#: the stages of a grid-world task (``GridWorld.subgoal``), in order
STAGES = ("key", "door", "goal")


def _path_states(env, task) -> list[tuple[str, set, str]]:
    """``(observation, optimal actions, stage)`` at every state of the solver's shortest path
    through ``task`` (the goal excluded): the optimal actions are those after which the solver's
    remaining distance drops by one (found on forks of the env, its public API only)."""
    obs, _ = env.reset(task)
    out = []
    while True:
        d = env.distance()
        good = set()
        for act in ("u", "d", "l", "r", "p", "o"):
            f = env.fork()
            res = f.step(act)
            if (res.done and res.info.get("success")) or (not res.done and f.distance() == d - 1):
                good.add(act)
        out.append((obs, good, env.subgoal()))
        res = env.step(env.solver())
        if res.done:
            return out
        obs = res.observation


def _action_probs(model, prompts: list[list[int]], letter_ids: dict) -> np.ndarray:
    """[states, letters]: the policy's probability of each action letter as the first token of
    its answer (temperature 1, the rollouts'), prompts of one length at a time."""
    import jax
    import jax.numpy as jnp
    ids = np.array(list(letter_ids.values()))
    out = np.zeros((len(prompts), len(ids)))
    by_len: dict = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        logits = model(jnp.asarray([prompts[i] for i in idx], jnp.int32)).logits[:, -1]
        probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32), axis=-1))
        out[idx] = probs[:, ids]
    return out


def probe(out: pathlib.Path, arms, seeds, warm_start: str, num_tasks: int) -> str:
    """Lead (c): how the policies act on the states of the optimal paths. For each seed, the
    first ``num_tasks`` of its held-out layouts (those its runs evaluate), every state of the
    solver's shortest path; for the warm start and each arm's run at its last checkpoint:

    * P(optimal): the probability that the first token of the answer is the letter of an
      optimal action (the grid world's action letters u d l r p o are single tokens of the
      byte codec, distinct at the first token; the rest of an answer, its end, is not read),
      at temperature 1 as the rollouts sample;
    * the same by the task's stage (fetch the key, open the door, reach the goal);
    * greedy optimal: the share of states whose most likely letter is an optimal action;
    * P(letter): the mass on the six letters at all (the rest starts an answer the env
      parses as invalid).

    Means over the states of a seed, then mean +- 95% t-interval over seeds; the paired
    difference to the warm start per seed. Written to ``OUT/probe.md``."""
    from jaxrl_agent import run_checks
    from jaxrl_agent.train.build import build_model
    from jaxrl_agent.train.loop import load_run_policy
    hs = _load("horizon_study")
    cfg = run_checks.load(None, hs.LEVELS["L2"][1] + hs.BUDGET + [
        f"model.builtin_dir={warm_start}", "trainer.warmup_sft_steps=0"])
    warm, codec, _ = build_model(cfg, 0)
    letters = {a: int(codec.encode(a)[0]) for a in ("u", "d", "l", "r", "p", "o")}
    rows: dict = {}  # name -> metric -> [per seed]
    for seed in seeds:
        runs = {arm: load_run_policy(out / arm / f"seed{seed}") for arm in arms}
        first = next(iter(runs.values()))
        rc = first.rollout
        states = [st for task in first.eval_tasks[:num_tasks]
                  for st in _path_states(first.env, task)]
        prompts = [list(rc.prompt_prefix) + [int(i) for i in codec.encode(
            rc.observation_template.format(observation=o))] for o, _, _ in states]
        good = np.array([[a in g for a in letters] for _, g, _ in states])
        stage = np.array([s for _, _, s in states])
        for name, model in [("warm start", warm)] + [(a, r.model) for a, r in runs.items()]:
            p = _action_probs(model, prompts, letters)
            m = {"P(optimal)": (p * good).sum(1),
                 **{f"P(optimal), {s}": (p * good).sum(1)[stage == s] for s in STAGES},
                 "greedy optimal": good[np.arange(len(p)), p.argmax(1)].astype(float),
                 "P(letter)": p.sum(1)}
            for k, v in m.items():
                rows.setdefault(name, {}).setdefault(k, []).append(float(np.mean(v)))
    compare = _load("compare_runs")
    keys = list(next(iter(rows.values())))
    lines = [f"Policies on the solver's shortest paths through the first {num_tasks} held-out "
             f"layouts of each seed (seeds {' '.join(map(str, seeds))}; mean +- 95% interval "
             f"over seeds; in brackets the paired difference to the warm start)", "",
             "| policy | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, m in rows.items():
        cells = []
        for k in keys:
            mean, h = compare._ci(m[k])
            cell = f"{mean:.3f} +- {h:.3f}"
            if name != "warm start":
                dm, dh = compare._ci([a - b for a, b in zip(m[k], rows["warm start"][k])])
                cell += f" ({dm:+.3f} +- {dh:.3f})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out / "probe.md").write_text(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("run", "report", "temperatures", "probe"))
    p.add_argument("--out", default="runs/collapse")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=sorted(ARMS))
    p.add_argument("--warm-start", default=None,
                   help="the L2 warm start (HF folder); default: made here")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 1.0])
    p.add_argument("--tasks", type=int, default=64, help="probe: held-out layouts per seed")
    a = p.parse_args(argv)
    out = pathlib.Path(a.out).absolute()
    if a.what == "run":
        return run(out, a.seeds, a.jobs, a.arms, a.warm_start)
    if a.what == "temperatures":
        if not a.warm_start:
            p.error("temperatures needs --warm-start (the L2 warm start's HF folder)")
        print(temperatures(a.warm_start, a.seeds, a.temperatures, out))
        return 0
    if a.what == "probe":
        if not a.warm_start:
            p.error("probe needs --warm-start (the L2 warm start's HF folder)")
        print(probe(out, a.arms, a.seeds, a.warm_start, a.tasks))
        return 0
    print(report(out, a.arms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
