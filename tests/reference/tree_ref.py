"""Slow references for the rollout-tree estimators (RTMC, tree-node values, ProGPO).

Straight from the formulas: Python dictionaries keyed by (task group, history tuple), float64
loops over trajectories and turns. Histories are tuples of the equality keys of
``step_ref.parse_steps`` (observation tokens / action tokens, or the record's keys), never the
library's hashes, so a hashing or scoping bug shows up as a mismatch. Nothing here imports
``jaxrl_agent.estimators`` or ``jaxrl_agent.segments``.

Tolerances model float32 forward error: means and convex combinations of values of magnitude
``scale`` are good to a few float32 ulps of ``scale`` (times the tree depth for RTMC's chained
priors); the GRPO and prefix terms reuse step_ref's standardisation error model.
"""

from __future__ import annotations

from collections import defaultdict

from tests.reference.step_ref import (
    BASE_ATOL, BASE_RTOL, EPS, U32, RefOut, _bcast_turns, discounted, episode_term, groups_of,
    mean_std, normalize_groups, parse_steps)

PAD = ("<pad>",)  # a missing early turn in a depth-limited history key


def _returns(trajs, target, gamma):
    if target == "outcome":
        return [[tr.outcome] * len(tr.turns) for tr in trajs]
    return [discounted([t.reward for t in tr.turns], gamma) for tr in trajs]


def _out(trajs, turn, step_tol, a_ep=None, tol_ep=None, we=0.0, ws=1.0) -> RefOut:
    """A = we A_ep + ws step, with per-record tolerance |we| tol_ep + |ws| step_tol."""
    a = [[we * (a_ep[i] if a_ep else 0.0) + ws * x for x in row] for i, row in enumerate(turn)]
    tol = [BASE_ATOL + BASE_RTOL * max([abs(x) for x in a[i]] + [0.0])
           + abs(ws) * step_tol[i] + (abs(we) * tol_ep[i] if tol_ep else 0.0)
           for i in range(len(trajs))]
    return RefOut(token=_bcast_turns(trajs, a), turn=a, tol={"token": tol, "turn": tol})


def _group_scale(trajs, values):
    """Per record: the largest |value| in its task group (the scale of its statistics)."""
    scale = [0.0] * len(trajs)
    for members in groups_of(trajs).values():
        s = max(abs(x) for i in members for x in values[i])
        for i in members:
            scale[i] = s
    return scale


# ----------------------------------------------------------------------------- RTMC


def rtmc(records, *, kappa=1.0, signature="history", target="return", gamma=1.0,
         episode_weight=0.0, normalization="mean_std_norm", episode_weighting="trajectory", eps=EPS,
         singleton="zero") -> RefOut:
    """First-visit MC: N(s), sum G over first visits of s and of (s, a) per trajectory;
    V~(s) = (sum G + kappa V_prior) / (N + kappa), V_prior = V~(parent history) or the group
    mean of G at turn 0 (roots; every state for the state signature); Q~(s, a) the same with
    prior V~(s); A = Q~ - V~ (+ episode_weight A_ep)."""
    trajs = parse_steps(records)
    G = _returns(trajs, target, gamma)

    def sig(i, k):
        tr = trajs[i]
        return (tr.group, tr.history(k) if signature == "history" else tr.turns[k].state)

    v_sum, v_n = defaultdict(float), defaultdict(int)
    q_sum, q_n = defaultdict(float), defaultdict(int)
    for i, tr in enumerate(trajs):
        seen_s, seen_sa = set(), set()
        for k, t in enumerate(tr.turns):
            s = sig(i, k)
            sa = (s, t.act_key)
            if s not in seen_s:
                seen_s.add(s)
                v_sum[s] += G[i][k]
                v_n[s] += 1
            if sa not in seen_sa:
                seen_sa.add(sa)
                q_sum[sa] += G[i][k]
                q_n[sa] += 1
    root = {g: sum(G[i][0] for i in m) / len(m) for g, m in groups_of(trajs).items()}

    v_t: dict = {}

    def v_tilde(i, k):
        s = sig(i, k)
        if signature == "history" and k > 0:
            prior = v_tilde(i, k - 1)
        else:
            prior = root[trajs[i].group]
        val = (v_sum[s] + kappa * prior) / (v_n[s] + kappa)
        assert v_t.setdefault(s, val) == val  # one prior per node (exact histories)
        return val

    turn = []
    for i, tr in enumerate(trajs):
        row = []
        for k, t in enumerate(tr.turns):
            v = v_tilde(i, k)
            sa = (sig(i, k), t.act_key)
            q = (q_sum[sa] + kappa * v) / (q_n[sa] + kappa)
            row.append(q - v)
        turn.append(row)
    scale = _group_scale(trajs, G)
    depth = max(len(tr.turns) for tr in trajs)
    step_tol = [32 * U32 * s * (depth + 2) for s in scale]
    a_ep, tol_ep = episode_term(trajs, normalization=normalization, weighting=episode_weighting, eps=eps,
                                singleton=singleton)
    return _out(trajs, turn, step_tol, a_ep, tol_ep, episode_weight, 1.0)


# ----------------------------------------------------------------------------- tree values


def tree_nodes(trajs, child="history"):
    """Per turn (node key, child key), both scoped by task group: the node is the history
    (s_0, a_0, ..., s_k); the child is the history of turn k + 1, or ("leaf", history, a_k)
    at the last turn (``child="action"``: ("act", history, a_k) at every turn)."""
    out = []
    for tr in trajs:
        row = []
        for k, t in enumerate(tr.turns):
            node = (tr.group, tr.history(k))
            if child == "action":
                kid = (tr.group, "act", tr.history(k), t.act_key)
            elif k + 1 < len(tr.turns):
                kid = (tr.group, tr.history(k + 1))
            else:
                kid = (tr.group, "leaf", tr.history(k), t.act_key)
            row.append((node, kid))
        out.append(row)
    return out


def tree_value(records, *, episode_weight=1.0, step_weight=1.0, baseline="parent",
               child="history", normalization="mean_std_norm", episode_weighting="trajectory", eps=EPS,
               singleton="zero") -> RefOut:
    """V(u) = mean R over the trajectories through u; A_proc = V(child) - V(node) (or minus
    the plain mean of V over the node's distinct children); 0 where the node has one child."""
    trajs = parse_steps(records)
    nodes = tree_nodes(trajs, child)
    through = defaultdict(set)
    children = defaultdict(set)
    for i, row in enumerate(nodes):
        for node, kid in row:
            through[node].add(i)
            through[kid].add(i)
            children[node].add(kid)

    def V(u):
        return sum(trajs[i].outcome for i in through[u]) / len(through[u])

    turn = []
    for row in nodes:
        out = []
        for node, kid in row:
            if len(children[node]) == 1:
                out.append(0.0)
                continue
            base = V(node) if baseline == "parent" else \
                sum(V(c) for c in children[node]) / len(children[node])
            out.append(V(kid) - base)
        turn.append(out)
    scale = _group_scale(trajs, [[tr.outcome] for tr in trajs])
    step_tol = [16 * U32 * s for s in scale]
    a_ep, tol_ep = episode_term(trajs, normalization=normalization, weighting=episode_weighting, eps=eps,
                                singleton=singleton)
    return _out(trajs, turn, step_tol, a_ep, tol_ep, episode_weight, step_weight)


# ----------------------------------------------------------------------------- ProGPO


def depth_key(tr, k, d):
    """The state s_k and the d turns before it, (a_{k-j}, s_{k-j}) for j = 1..d, with PAD for
    turns before the start."""
    key = [tr.turns[k].state]
    for j in range(1, d + 1):
        key.append((tr.turns[k - j].act_key, tr.turns[k - j].state) if k - j >= 0 else PAD)
    return tuple(key)


def progpo_terms(trajs, *, gamma=1.0, max_depth=2, prior_std=0.5, terminal="outcome"):
    """(G, Phi_d[i][k][d], w_d[i][k][d], Phi[i][k], C[i][k]) from the formulas."""
    G = _returns(trajs, "return", gamma)
    s0sq = float(prior_std) ** 2
    phi_d = [[[0.0] * (max_depth + 1) for _ in tr.turns] for tr in trajs]
    w_d = [[[0.0] * (max_depth + 1) for _ in tr.turns] for tr in trajs]
    for d in range(max_depth + 1):
        buckets = defaultdict(list)
        for i, tr in enumerate(trajs):
            for k in range(len(tr.turns)):
                buckets[(tr.group, depth_key(tr, k, d))].append((i, k))
        for members in buckets.values():
            xs = [G[i][k] for i, k in members]
            m, s = mean_std(xs)
            var = s * s if len(xs) > 1 else s0sq
            for i, k in members:
                phi_d[i][k][d] = m
                w_d[i][k][d] = len(xs) / (var + s0sq)
    phi = [[sum(w * p for w, p in zip(w_d[i][k], phi_d[i][k])) / sum(w_d[i][k])
            for k in range(len(tr.turns))] for i, tr in enumerate(trajs)]
    credit = []
    for i, tr in enumerate(trajs):
        row = []
        for k, t in enumerate(tr.turns):
            last = k + 1 == len(tr.turns)
            if terminal == "outcome":
                nxt = tr.outcome if last else phi[i][k + 1]
                row.append(gamma * nxt - phi[i][k])
            else:
                nxt = 0.0 if last else phi[i][k + 1]
                row.append(t.reward + gamma * nxt - phi[i][k])
        credit.append(row)
    return G, phi_d, w_d, phi, credit


def progpo(records, *, gamma=1.0, prefix_weight=1.0, transition_weight=1.0, max_depth=2,
           prior_std=0.5, terminal="outcome", normalization="mean_std_norm",
           prefix_normalization="mean_norm", episode_weighting="trajectory", eps=EPS,
           singleton="zero") -> RefOut:
    """A = A_ep + w1 (G - mean over the same history) + w2 (gamma Phi' - Phi), Phi the
    inverse-variance fusion of the depth-d means of G."""
    trajs = parse_steps(records)
    G, _, _, _, credit = progpo_terms(trajs, gamma=gamma, max_depth=max_depth,
                                      prior_std=prior_std, terminal=terminal)
    a_pre, tol_pre = normalize_groups(trajs, G, lambda i, k: trajs[i].history(k),
                                      normalization=prefix_normalization, eps=eps)
    step = [[prefix_weight * p + transition_weight * c for p, c in zip(a_pre[i], credit[i])]
            for i in range(len(trajs))]
    scale = [max(s, abs(tr.outcome)) for s, tr in zip(_group_scale(trajs, G), trajs)]
    # Fusion weights carry a relative error ~ u scale^2 / s0^2 (variances of values of size
    # scale); Phi moves by that times the spread of the depth means (<= 2 scale).
    fuse = [64 * U32 * s * (1 + s * s / prior_std ** 2) for s in scale]
    step_tol = [abs(prefix_weight) * max(tol_pre[i] + [0.0]) + abs(transition_weight) * fuse[i]
                for i in range(len(trajs))]
    a_ep, tol_ep = episode_term(trajs, normalization=normalization, weighting=episode_weighting, eps=eps,
                                singleton=singleton)
    return _out(trajs, step, step_tol, a_ep, tol_ep, 1.0, 1.0)


REFERENCES = {"rtmc": rtmc, "tree_value": tree_value, "progpo": progpo}
