"""Slow references for the step-level group estimators (GiGPO, step_group, MatchTIR), and the
record parsing that every step-level reference (graphs, trees, BiPACE) shares.

Written the way the original code works: Python dictionaries of groups keyed by
(task group, key), float64 loops over trajectories and turns. Keys are compared as Python
values (the observation token tuple, the action token tuple, the history tuple), never via
the library's hashes, so a hashing bug shows up as a mismatch.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

from tests.reference.estimators_ref import (  # noqa: F401  (re-exported for the others)
    BASE_ATOL, BASE_RTOL, U32, WHITEN_C, RefOut, _bcast_turns, _plain_tol, _std_tol, f32,
    record_rewards)

EPS = 1e-6


@dataclasses.dataclass
class STurn:
    obs: tuple
    action: tuple
    reward: float
    state: Any  # equality key of the observation (the record's state_key, or the tokens)
    act_key: Any  # the record's action_key, or the action tokens
    turn_key: Any
    value: float | None
    turn_extras: dict
    token_extras: dict


@dataclasses.dataclass
class STraj:
    group: Any
    task: Any
    outcome: float
    turns: list

    def history(self, k):
        """(s_0, a_0, ..., a_{k-1}, s_k) as a tuple of keys."""
        h = []
        for j in range(k):
            h += [self.turns[j].state, self.turns[j].act_key]
        return tuple(h + [self.turns[k].state])


def parse_steps(records) -> list[STraj]:
    """Records -> trajectories with equality keys, applying the record defaults (no turn
    reward: the outcome is the last turn's reward; no outcome: the sum of turn rewards)."""
    out = []
    for rec in records:
        rewards, outcome = record_rewards(rec)
        turns = []
        for t, r in zip(rec["turns"], rewards):
            obs = tuple(t.get("observation", []))
            act = tuple(t["action"])
            state = ("k", t["state_key"]) if "state_key" in t else ("o", obs)
            ak = ("k", t["action_key"]) if "action_key" in t else ("a", act)
            turns.append(STurn(obs, act, f32(r), state, ak, t.get("turn_key"),
                               None if "value" not in t else f32(t["value"]),
                               {k: v for k, v in t.get("turn_extras", {}).items()},
                               {k: v for k, v in t.get("token_extras", {}).items()}))
        out.append(STraj(rec["group"], rec.get("task", rec["group"]), f32(outcome), turns))
    return out


def groups_of(trajs):
    g: dict = defaultdict(list)
    for i, t in enumerate(trajs):
        g[t.group].append(i)
    return g


def mean_std(xs, weights=None):
    """Mean and unbiased std (frequency weights: n = sum of weights)."""
    w = [1.0] * len(xs) if weights is None else list(weights)
    n = sum(w)
    m = sum(wi * x for wi, x in zip(w, xs)) / n
    var = sum(wi * (x - m) ** 2 for wi, x in zip(w, xs)) / max(n - 1, 1)
    return m, math.sqrt(var)


def discounted(rewards, gamma):
    g, out = 0.0, []
    for r in reversed(rewards):
        g = r + gamma * g
        out.append(g)
    return out[::-1]


def episode_term(trajs, *, normalization="mean_std_norm", weighting="trajectory", reward="outcome",
                 eps=EPS, singleton="zero"):
    """Per trajectory (A_ep, tol): GRPO over each task group; ``weighting="steps"`` repeats
    each trajectory once per turn in the statistics (verl-agent's per-step rows)."""
    rs = [t.outcome if reward == "outcome" else sum(x.reward for x in t.turns) for t in trajs]
    a, tol = [0.0] * len(trajs), [BASE_ATOL] * len(trajs)
    for members in groups_of(trajs).values():
        if len(members) == 1:
            i = members[0]
            if singleton == "raw":
                a[i] = rs[i] / (1 + eps) if normalization == "mean_std_norm" else rs[i]
            tol[i] = BASE_ATOL + BASE_RTOL * abs(a[i])
            continue
        vals = []
        for i in members:
            vals += [rs[i]] * (len(trajs[i].turns) if weighting == "steps" else 1)
        m, s = mean_std(vals)
        scale = max(abs(v) for v in vals)
        for i in members:
            a[i] = (rs[i] - m) / (s + eps) if normalization == "mean_std_norm" else rs[i] - m
            denom = s + eps if normalization == "mean_std_norm" else 1.0
            tol[i] = _std_tol(scale, denom, len(vals), a[i])
    return a, tol


def normalize_groups(trajs, values, keyfn, *, normalization="mean_std_norm", eps=EPS, singleton="zero"):
    """values[i][k] normalised over {(j, l): group(j) = group(i), keyfn(j, l) = keyfn(i, k)}.
    Returns (A[i][k], tol[i][k])."""
    buckets: dict = defaultdict(list)
    for i, tr in enumerate(trajs):
        for k in range(len(tr.turns)):
            buckets[(tr.group, keyfn(i, k))].append((i, k))
    a = [[0.0] * len(tr.turns) for tr in trajs]
    tol = [[BASE_ATOL] * len(tr.turns) for tr in trajs]
    for members in buckets.values():
        xs = [values[i][k] for i, k in members]
        if len(members) == 1:
            i, k = members[0]
            if singleton == "raw":
                a[i][k] = xs[0] / (1 + eps) if normalization == "mean_std_norm" else xs[0]
            tol[i][k] = BASE_ATOL + BASE_RTOL * abs(a[i][k])
            continue
        m, s = mean_std(xs)
        scale = max(abs(x) for x in xs)
        denom = s + eps if normalization == "mean_std_norm" else 1.0
        for (i, k), x in zip(members, xs):
            a[i][k] = (x - m) / denom
            tol[i][k] = _std_tol(scale, denom, len(xs), a[i][k])
    return a, tol


def combined(trajs, a_ep, tol_ep, a_st, tol_st, we=1.0, ws=1.0, how="sum") -> RefOut:
    div = (we + ws) if how == "mean" else 1.0
    turn = [[(we * a_ep[i] + ws * a_st[i][k]) / div for k in range(len(tr.turns))]
            for i, tr in enumerate(trajs)]
    tol = [(abs(we) * tol_ep[i] + abs(ws) * max(tol_st[i] + [0.0])) / div + BASE_ATOL
           for i in range(len(trajs))]
    return RefOut(token=_bcast_turns(trajs, turn), turn=turn, tol={"token": tol, "turn": tol})


def _target(tr, target, gamma):
    if target == "return":
        return discounted([t.reward for t in tr.turns], gamma)
    if target == "reward":
        return [t.reward for t in tr.turns]
    return [tr.outcome] * len(tr.turns)


def _keyfn(trajs, key):
    return {
        "state": lambda i, k: trajs[i].turns[k].state,
        "action": lambda i, k: trajs[i].turns[k].act_key,
        "state_action": lambda i, k: (trajs[i].turns[k].state, trajs[i].turns[k].act_key),
        "history": lambda i, k: trajs[i].history(k),
        "turn": lambda i, k: k,
        "turn_key": lambda i, k: trajs[i].turns[k].turn_key,
    }[key]


def step_group(records, *, key="state", target="return", gamma=1.0, episode_weight=1.0,
               step_weight=1.0, normalization="mean_std_norm", episode_weighting="trajectory",
               episode_reward="outcome", combine_as="sum", eps=EPS, singleton="zero",
               step_singleton="zero") -> RefOut:
    """A = we A_ep + ws A_step (or their weighted mean), A_step normalised over
    (task group, key) buckets of the target."""
    trajs = parse_steps(records)
    a_ep, tol_ep = episode_term(trajs, normalization=normalization, weighting=episode_weighting,
                                reward=episode_reward, eps=eps, singleton=singleton)
    ys = [_target(tr, target, gamma) for tr in trajs]
    a_st, tol_st = normalize_groups(trajs, ys, _keyfn(trajs, key), normalization=normalization, eps=eps,
                                    singleton=step_singleton)
    return combined(trajs, a_ep, tol_ep, a_st, tol_st, episode_weight, step_weight, combine_as)


def gigpo(records, *, gamma=0.95, step_weight=1.0, normalization="mean_std_norm",
          episode_weighting="trajectory", anchor="exact", eps=EPS, singleton="zero",
          **_unused) -> RefOut:
    """GiGPO: GRPO episode term + w * anchor-state group normalisation of the discounted step
    returns (exact anchors: equal observations; 'bucket': equal rounded features)."""
    trajs = parse_steps(records)
    a_ep, tol_ep = episode_term(trajs, normalization=normalization, weighting=episode_weighting, eps=eps,
                                singleton=singleton)
    ys = [_target(tr, "return", gamma) for tr in trajs]
    if anchor == "exact":
        keyfn = _keyfn(trajs, "state")
    elif anchor == "bucket":
        w = _unused.get("bucket_width", 0.1)

        def keyfn(i, k):
            f = trajs[i].turns[k].turn_extras["state_features"]
            return tuple(round(f32(x) / f32(w)) for x in f)
    else:
        keyfn = similar_anchor(trajs, _unused.get("sim_threshold", 0.95))
    a_st, tol_st = normalize_groups(trajs, ys, keyfn, normalization=normalization, eps=eps)
    return combined(trajs, a_ep, tol_ep, a_st, tol_st, 1.0, step_weight)


def similar_anchor(trajs, threshold):
    """Connected components (union-find) of cos(f_a, f_b) >= threshold inside task groups."""
    nodes = [(i, k) for i, tr in enumerate(trajs) for k in range(len(tr.turns))]
    parent = {v: v for v in nodes}

    def find(v):
        while parent[v] != v:
            v = parent[v]
        return v

    def cos(a, b):
        na = math.sqrt(sum(x * x for x in a))
        nb = math.sqrt(sum(x * x for x in b))
        if na == 0 or nb == 0:
            return -2.0
        return sum(x * y for x, y in zip(a, b)) / (na * nb)

    feats = {v: [f32(x) for x in trajs[v[0]].turns[v[1]].turn_extras["state_features"]]
             for v in nodes}
    for a in nodes:
        for b in nodes:
            if a < b and trajs[a[0]].group == trajs[b[0]].group and \
                    cos(feats[a], feats[b]) >= threshold:
                parent[find(a)] = find(b)
    return lambda i, k: find((i, k))


def matchtir(records, *, gamma=0.9, eps=EPS) -> RefOut:
    """(GRPO z-score of the reward sum + (group, k)-cohort z-score of the gamma-discounted turn
    return) / 2, singletons with mean 0 and std 1 (verl)."""
    return step_group(records, key="turn", target="return", gamma=gamma, combine_as="mean",
                      episode_reward="reward_sum", singleton="raw", step_singleton="raw",
                      eps=eps)


REFERENCES = {"gigpo": gigpo, "step_group": step_group, "matchtir": matchtir}
