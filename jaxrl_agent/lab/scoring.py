"""Scoring an arm's per-turn credit C against the exact advantage A on sampled batches.

For one batch, over the valid turns (n, k) (padding excluded):

  pearson       corr(C, A);
  spearman      corr(rank C, rank A) (average ranks for ties);
  sign          fraction of turns with |A| > ``eps`` where sign(C) = sign(A) (C = 0 counts
                as wrong);
  nmse          min_{c >= 0} sum((c C - A)^2) / sum(A^2), c = max(<C, A> / <C, C>, 0): the
                squared error left after the best positive rescaling (the estimator's own
                scale is free, its sign is not), in [0, 1]: 0 = exact up to scale, 1 = no
                better than C = 0;
  cell_pearson  corr over the (turn k, state, action) cells of the batch between the mean
                credit of the cell and A of the cell, weighted by visits: the bias part. An
                estimator that is unbiased for A up to a scale tends to 1 as the batch grows,
                while ``pearson`` stays capped by the noise of single rollouts.

A degenerate batch (fewer than two valid turns, constant C over them, e.g. all-zero credit
when no rollout of the batch succeeded, or constant A) gives 0 correlation; ``degenerate``
flags it, and ``score_arm`` counts such seeds (they are averaged in, not dropped). Each metric
is computed for every seed; ``score_arm`` reports the mean and the across-seed sample std
(ddof = 1; 0 for one seed). Everything is deterministic for a seed.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from scipy.stats import rankdata

from jaxrl_agent.lab.arms import Arm
from jaxrl_agent.lab.sampling import sample_batch
from jaxrl_agent.lab.tasks import Task

METRICS = ("pearson", "spearman", "sign", "nmse", "cell_pearson")


def _flat(x) -> bool:
    """Fewer than two values, or (numerically) no spread: a correlation with x is undefined."""
    return len(x) < 2 or float(np.var(x)) <= 1e-20


def _corr(x, y, w=None):
    w = np.ones_like(x) if w is None else w
    if len(x) < 2 or w.sum() <= 0:
        return 0.0
    mx, my = np.average(x, weights=w), np.average(y, weights=w)
    dx, dy = x - mx, y - my
    sxx, syy = np.average(dx * dx, weights=w), np.average(dy * dy, weights=w)
    if sxx <= 1e-20 or syy <= 1e-20:
        return 0.0
    return float(np.average(dx * dy, weights=w) / np.sqrt(sxx * syy))


def turn_metrics(credit, exact, mask, state=None, action=None, eps: float = 1e-6) -> dict:
    """The metrics of the module docstring for one batch (numpy, [N, K] inputs)."""
    credit, exact, mask = (np.asarray(x) for x in (credit, exact, mask))
    c, a = credit[mask].astype(np.float64), exact[mask].astype(np.float64)
    out = dict(pearson=_corr(c, a), spearman=_corr(rankdata(c), rankdata(a)) if len(c) else 0.0)
    big = np.abs(a) > eps
    out["sign"] = float(np.mean(np.sign(c[big]) == np.sign(a[big]))) if big.any() else 0.0
    cc = float(np.dot(c, c))
    scale = max(float(np.dot(c, a)) / cc, 0.0) if cc > 0 else 0.0
    aa = float(np.dot(a, a))
    out["nmse"] = float(np.sum((scale * c - a) ** 2) / aa) if aa > 1e-20 else 0.0
    out["degenerate"] = bool(_flat(c) or _flat(a))
    if state is not None and action is not None:
        k = np.broadcast_to(np.arange(mask.shape[1])[None], mask.shape)[mask]
        cells = np.stack([k, np.asarray(state)[mask], np.asarray(action)[mask]], 1)
        _, inv, counts = np.unique(cells, axis=0, return_inverse=True, return_counts=True)
        inv = inv.reshape(-1)
        mean_c = np.bincount(inv, weights=c) / counts
        mean_a = np.bincount(inv, weights=a) / counts
        out["cell_pearson"] = _corr(mean_c, mean_a, counts.astype(np.float64))
    return out


def _mean_std(x) -> tuple[float, float]:
    """(mean, sample std with ddof = 1; 0 for a single value) over seeds."""
    x = np.asarray(x, np.float64)
    return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else 0.0


def per_turn_pearson(credit, exact, mask) -> np.ndarray:
    """corr(C, A) at each turn index k over the rollouts that have turn k, [K]."""
    credit, exact, mask = (np.asarray(x) for x in (credit, exact, mask))
    return np.array([_corr(credit[mask[:, k], k].astype(np.float64),
                           exact[mask[:, k], k].astype(np.float64))
                     for k in range(mask.shape[1])])


def scoring_policy(task: Task, seed: int = 0, scale: float = 1.0):
    """Fixed policy logits [O, A] ~ scale * N(0, 1) (seeded): a policy with some preferences,
    so that advantages are neither all tiny nor all alike."""
    shape = (task.mdp.num_obs, task.mdp.num_actions)
    return scale * jax.random.normal(jax.random.PRNGKey(10_000 + seed), shape)


@functools.lru_cache(maxsize=None)
def _credit_runner(arm: Arm, num_groups: int, group_size: int):
    def one(key, mdp, logits):
        batch, roll = sample_batch(key, mdp, logits, num_groups, group_size)
        return (arm.credit(batch), batch.extras["exact_adv"], batch.turn_mask, roll["state"],
                roll["action"])
    return jax.jit(jax.vmap(one, in_axes=(0, None, None)))


def sampled_credit(task: Task, arm: Arm, logits, keys, num_groups: int, group_size: int):
    """(credit, exact, mask, state, action), each [seeds, N, K], for the batches drawn with
    ``keys`` [seeds, 2] from softmax(logits)."""
    out = _credit_runner(arm, num_groups, group_size)(keys, task.mdp, logits)
    return tuple(np.asarray(x) for x in out)


def check_arm(task: Task, arm: Arm, num_groups: int = 2, group_size: int = 2) -> None:
    """Runs the arm once on a small validated batch: raises ValueError with the estimator's
    own message when it cannot run on lab batches (e.g. it needs extras the lab has not)."""
    logits = task.mdp.zero_logits()
    batch, _ = sample_batch(jax.random.PRNGKey(0), task.mdp, logits, num_groups, group_size)
    batch.validate()
    try:
        jax.eval_shape(arm.credit, batch)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{arm.name} cannot run on {task.name} batches: {e}") from None


def score_arm(task: Task, arm: Arm, *, seeds: int = 8, num_groups: int = 8,
              group_size: int = 8, logits=None, seed: int = 0) -> dict:
    """Scores ``arm`` on ``seeds`` independent batches of ``num_groups`` x ``group_size``
    rollouts of the scoring policy. Returns {metric: (mean, std over seeds, ddof = 1)}, plus
    ``degenerate`` (how many seeds' batches were degenerate: constant credit or constant
    exact advantage, correlation 0), ``per_turn`` [K] (the mean over seeds of
    ``per_turn_pearson``) and ``per_seed``."""
    logits = scoring_policy(task, seed) if logits is None else logits
    keys = jax.random.split(jax.random.PRNGKey(seed), seeds)
    credit, exact, mask, state, action = sampled_credit(task, arm, logits, keys, num_groups,
                                                        group_size)
    rows = [turn_metrics(credit[i], exact[i], mask[i], state[i], action[i])
            for i in range(seeds)]
    out = {m: _mean_std([r[m] for r in rows]) for m in METRICS}
    out["degenerate"] = int(sum(r["degenerate"] for r in rows))
    out["per_turn"] = np.mean([per_turn_pearson(credit[i], exact[i], mask[i])
                               for i in range(seeds)], axis=0).tolist()
    out["per_seed"] = rows
    return out
