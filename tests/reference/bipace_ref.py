"""Slow reference for BiPACE (estimators/bipace.py), straight from the formulas.

Clusters by union-find in plain Python over the turns of each task group: two turns are joined
when the cosine of their hidden vectors (float32 values, float64 arithmetic) is >= tau (a zero
vector joins nothing), or, with ``merge_state_keys``, when their states are equal (compared as
Python values: the record's state_key or the observation tokens, never the library's hashes).
Action identity is the record's action_key or the action tokens. Then, per cluster, plain
means over dictionaries, in float64. Nothing here imports jaxrl_agent.estimators or segments.
"""

from __future__ import annotations

import math
from collections import defaultdict

from tests.reference.estimators_ref import BASE_ATOL, _std_tol, f32
from tests.reference.step_ref import EPS, combined, discounted, episode_term, mean_std, parse_steps


def union_find_clusters(trajs, tau, merge_state_keys=False, field="hidden"):
    """(i, k) -> the root of its connected component (joins only inside a task group)."""
    nodes = [(i, k) for i, tr in enumerate(trajs) for k in range(len(tr.turns))]
    parent = {v: v for v in nodes}

    def find(v):
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    feats = {(i, k): [f32(x) for x in trajs[i].turns[k].turn_extras[field]] for i, k in nodes}

    def cos(a, b):
        na = math.sqrt(sum(x * x for x in a))
        nb = math.sqrt(sum(x * x for x in b))
        if na == 0 or nb == 0:
            return -math.inf
        return sum(x * y for x, y in zip(a, b)) / (na * nb)

    for a in nodes:
        for b in nodes:
            if a < b and trajs[a[0]].group == trajs[b[0]].group:
                same_state = trajs[a[0]].turns[a[1]].state == trajs[b[0]].turns[b[1]].state
                if cos(feats[a], feats[b]) >= tau or (merge_state_keys and same_state):
                    union(a, b)
    return {v: find(v) for v in nodes}


def pace_term(trajs, returns, clusters, *, leave_one_out=False, step_normalization="mean_norm",
              eps=EPS):
    """A_PACE[i][k] and its tolerance: Q_hat(c, a) - V_hat(c) over the cluster c of (i, k)."""
    members = defaultdict(list)
    for v, root in clusters.items():
        members[root].append(v)
    a = [[0.0] * len(tr.turns) for tr in trajs]
    tol = [[BASE_ATOL] * len(tr.turns) for tr in trajs]
    for c in members.values():
        if len(c) == 1:
            continue  # singleton cluster: 0
        gs = {v: returns[v[0]][v[1]] for v in c}
        act = {v: trajs[v[0]].turns[v[1]].act_key for v in c}
        v_mean, v_std = mean_std(list(gs.values()))
        scale = max(abs(x) for x in gs.values())
        denom = v_std + eps if step_normalization == "mean_std_norm" else 1.0
        for v in c:
            peers = [u for u in c if act[u] == act[v]]
            if not leave_one_out:
                x = sum(gs[u] for u in peers) / len(peers) - v_mean
            else:
                others = [gs[u] for u in c if u != v]
                v_loo = sum(others) / len(others)
                q_peers = [gs[u] for u in peers if u != v]
                x = (sum(q_peers) / len(q_peers) if q_peers else gs[v]) - v_loo
            i, k = v
            a[i][k] = x / denom
            tol[i][k] = 2 * _std_tol(scale, denom, len(c), a[i][k])
    return a, tol


def bipace(records, *, tau=0.9, sim_iters=8, merge_state_keys=False, leave_one_out=False,
           step_normalization="mean_norm", step_weight=1.0, gamma=0.95, normalization="mean_std_norm",
           episode_weighting="trajectory", eps=EPS, singleton="zero"):
    """A = A_ep + w (Q_hat(c, a) - V_hat(c)) [/ (std_c + eps)], clusters by union-find
    (``sim_iters`` is the library's iteration budget: the reference is always exact)."""
    del sim_iters
    trajs = parse_steps(records)
    a_ep, tol_ep = episode_term(trajs, normalization=normalization, weighting=episode_weighting, eps=eps,
                                singleton=singleton)
    returns = [discounted([t.reward for t in tr.turns], gamma) for tr in trajs]
    clusters = union_find_clusters(trajs, tau, merge_state_keys)
    a_st, tol_st = pace_term(trajs, returns, clusters, leave_one_out=leave_one_out,
                             step_normalization=step_normalization, eps=eps)
    return combined(trajs, a_ep, tol_ep, a_st, tol_st, 1.0, step_weight)


REFERENCES = {"bipace": bipace}
