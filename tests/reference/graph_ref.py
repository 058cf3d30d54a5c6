"""Slow references for the state-graph estimators G2PO, GraphGPO and GAGPO.

Written straight from the formulas in the docstrings of
``jaxrl_agent/estimators/graph.py``: Python dictionaries keyed by (task group, state) where
the state is the record's ``state_key`` or observation tuple (never the library's hash), float64
loops over trajectories and turns, the distances to SUCCESS by breadth-first search from
SUCCESS over reversed edges (the library uses Bellman-Ford), sentinels as tagged tuples.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque

from tests.reference.step_ref import (
    BASE_ATOL, BASE_RTOL, EPS, U32, RefOut, _bcast_turns, _std_tol, discounted, episode_term,
    groups_of, parse_steps)

TERMINAL = ("__terminal__",)
SUCCESS = ("__success__",)


def _dead_end(group):
    return ("__dead_end__", group)


# ----------------------------------------------------------------------------- pieces


def grouped_values(trajs, gamma):
    """G[i][k], V(s_{i,k}) and V(s_{i,k+1}) (0 past the last turn): V = mean G over the visits
    of the state in the task group."""
    gs = [discounted([t.reward for t in tr.turns], gamma) for tr in trajs]
    visits = defaultdict(list)
    for i, tr in enumerate(trajs):
        for k, t in enumerate(tr.turns):
            visits[(tr.group, t.state)].append(gs[i][k])
    mean = {key: sum(xs) / len(xs) for key, xs in visits.items()}
    v = [[mean[(tr.group, t.state)] for t in tr.turns] for tr in trajs]
    v_next = [vi[1:] + [0.0] for vi in v]
    return gs, v, v_next


def standardize(trajs, x, scale, how, eps):
    """x[i][k] -> (x - mean) / (std + eps) over the turns of each task group ("group") or of all
    turns ("batch"), std with ddof 1, one member or all equal -> 0; "none": x. ``scale[i][k]``:
    the float32 error scale of x. Returns (A, tol) per turn."""
    a = [[0.0] * len(tr.turns) for tr in trajs]
    tol = [[0.0] * len(tr.turns) for tr in trajs]
    if how == "none":
        for i, tr in enumerate(trajs):
            for k in range(len(tr.turns)):
                a[i][k] = x[i][k]
                tol[i][k] = BASE_ATOL + BASE_RTOL * abs(x[i][k]) + 16 * U32 * scale[i][k]
        return a, tol
    buckets = defaultdict(list)
    for i, tr in enumerate(trajs):
        for k in range(len(tr.turns)):
            buckets[tr.group if how == "group" else 0].append((i, k))
    for members in buckets.values():
        xs = [x[i][k] for i, k in members]
        n = len(xs)
        sc = max(scale[i][k] for i, k in members)
        if n == 1 or all(v == xs[0] for v in xs):
            for i, k in members:
                tol[i][k] = _std_tol(sc, eps, n, 0.0)
            continue
        _standardize_members(members, xs, sc, eps, a, tol)
    return a, tol


def _standardize_members(members, xs, scale, eps, a, tol):
    """Writes (x - mean) / (std + eps) of the values ``xs`` (std with ddof 1) at their
    positions ``members`` (i, k) into ``a``, and their tolerances (error scale ``scale``) into
    ``tol``."""
    n = len(xs)
    m = sum(xs) / n
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    for (i, k), x in zip(members, xs):
        a[i][k] = (x - m) / (s + eps)
        tol[i][k] = _std_tol(scale, s + eps, n, a[i][k])


def _out(trajs, turn, tol_turn, a_ep=None, tol_ep=None, we=0.0, wg=1.0, turn_returns=None,
         tol_returns=None):
    a = [[we * (a_ep[i] if a_ep else 0.0) + wg * x for x in row] for i, row in enumerate(turn)]
    tol = [abs(we) * (tol_ep[i] if tol_ep else 0.0) + abs(wg) * max(row + [0.0]) + BASE_ATOL
           for i, row in enumerate(tol_turn)]
    out = RefOut(token=_bcast_turns(trajs, a), turn=a, tol={"token": tol, "turn": tol})
    if turn_returns is not None:
        out.turn_returns = turn_returns
        out.tol["turn_returns"] = tol_returns
    return out


def _td_scale(trajs, gs, v, v_next):
    """Float32 error scale of the TD errors: the magnitudes that enter them (a mean of G
    carries the error of its largest member)."""
    out = []
    for i, tr in enumerate(trajs):
        big = max(abs(g) for g in gs[i])
        out.append([abs(t.reward) + abs(v[i][k]) + abs(v_next[i][k]) + 4 * big
                    for k, t in enumerate(tr.turns)])
    return out


# ----------------------------------------------------------------------------- estimators


def g2po(records, *, gamma=1.0, normalization="group", episode_weight=0.0,
         episode_weighting="trajectory", eps=EPS) -> RefOut:
    """delta = r + gamma V(s') - V(s) (V(TERMINAL) = 0) standardised over the task group's (or
    the batch's) edges, plus episode_weight * GRPO."""
    trajs = parse_steps(records)
    gs, v, v_next = grouped_values(trajs, gamma)
    delta = [[t.reward + gamma * v_next[i][k] - v[i][k] for k, t in enumerate(tr.turns)]
             for i, tr in enumerate(trajs)]
    a, tol = standardize(trajs, delta, _td_scale(trajs, gs, v, v_next), normalization, eps)
    a_ep, tol_ep = episode_term(trajs, weighting=episode_weighting, eps=eps)
    return _out(trajs, a, tol, a_ep, tol_ep, episode_weight, 1.0)


def distances_to_success(edges, max_iters=None):
    """BFS from SUCCESS over reversed edges (unit costs). ``edges``: list of (src, dst).
    With ``max_iters``, nodes more than that many hops away count as unreachable. Unreachable
    nodes get max_finite + 1. Returns {node: d} over every node."""
    nodes = {u for e in edges for u in e}
    preds = defaultdict(set)
    for u, w in edges:
        preds[w].add(u)
    dist = {}
    if SUCCESS in nodes:
        dist[SUCCESS] = 0
        queue = deque([SUCCESS])
        while queue:
            w = queue.popleft()
            if max_iters is not None and dist[w] >= max_iters:
                continue
            for u in preds[w]:
                if u not in dist:
                    dist[u] = dist[w] + 1
                    queue.append(u)
    far = max(dist.values(), default=0) + 1
    return {u: float(dist.get(u, far)) for u in nodes}


def graphgpo(records, *, omega=0.1, success_reward=10.0, success_threshold=0.5,
             convention="reference", episode_weight=1.0, graph_weight=1.0,
             episode_weighting="trajectory", max_iters=None, eps=EPS) -> RefOut:
    """q = R_succ omega^d(next) (paper: omega^(d(next)+1)) standardised per (group, source
    state); 0 in groups without a success; plus the GRPO episode term."""
    trajs = parse_steps(records)
    q = [[0.0] * len(tr.turns) for tr in trajs]
    for g, members in groups_of(trajs).items():
        if not any(trajs[i].outcome >= success_threshold for i in members):
            continue
        edges, occ = [], []
        for i in members:
            tr = trajs[i]
            end = SUCCESS if tr.outcome >= success_threshold else _dead_end(g)
            for k, t in enumerate(tr.turns):
                nxt = tr.turns[k + 1].state if k + 1 < len(tr.turns) else end
                edges.append((("s", t.state), nxt if nxt in (SUCCESS, end) else ("s", nxt)))
                occ.append((i, k))
        dist = distances_to_success(edges, max_iters)
        for (i, k), (_, nxt) in zip(occ, edges):
            e = dist[nxt] + (1.0 if convention == "paper" else 0.0)
            q[i][k] = success_reward * omega ** e
    # standardise per (group, source state)
    a = [[0.0] * len(tr.turns) for tr in trajs]
    tol = [[BASE_ATOL] * len(tr.turns) for tr in trajs]
    buckets = defaultdict(list)
    for i, tr in enumerate(trajs):
        for k, t in enumerate(tr.turns):
            buckets[(tr.group, t.state)].append((i, k))
    for members in buckets.values():
        xs = [q[i][k] for i, k in members]
        n = len(xs)
        sc = max(abs(x) for x in xs) * 8  # omega^d in float32: a few roundings
        if n == 1 or all(x == xs[0] for x in xs):
            continue
        _standardize_members(members, xs, sc, eps, a, tol)
    a_ep, tol_ep = episode_term(trajs, weighting=episode_weighting, eps=eps)
    return _out(trajs, a, tol, a_ep, tol_ep, episode_weight, graph_weight)


def gagpo(records, *, gamma=1.0, lam=0.95, normalization="group", eps=EPS) -> RefOut:
    """Turn GAE over the grouped value proxy, normalised per task group (or batch / none);
    turn_returns = GAE + V_hat(s)."""
    trajs = parse_steps(records)
    gs, v, v_next = grouped_values(trajs, gamma)
    raw, scale = [], []
    td_scale = _td_scale(trajs, gs, v, v_next)
    for i, tr in enumerate(trajs):
        delta = [t.reward + gamma * v_next[i][k] - v[i][k] for k, t in enumerate(tr.turns)]
        acc, out = 0.0, []
        for d in reversed(delta):
            acc = d + gamma * lam * acc
            out.append(acc)
        raw.append(out[::-1])
        scale.append([sum(td_scale[i][k:]) for k in range(len(tr.turns))])
    a, tol = standardize(trajs, raw, scale, normalization, eps)
    ret = [[raw[i][k] + v[i][k] for k in range(len(tr.turns))] for i, tr in enumerate(trajs)]
    tol_ret = [BASE_ATOL + BASE_RTOL * max(abs(x) for x in row) + 16 * U32 * max(sc)
               for row, sc in zip(ret, scale)]
    return _out(trajs, a, tol, turn_returns=ret, tol_returns=tol_ret)


REFERENCES = {"g2po": g2po, "graphgpo": graphgpo, "gagpo": gagpo}
