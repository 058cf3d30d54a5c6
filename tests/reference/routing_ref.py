"""Slow references for the credit routing rules of jaxrl_agent/estimators/routing.py.

Plain Python over records in float64, written from the methods' docstring formulas; nothing
here imports ``jaxrl_agent``. Each reference is named by its method's registry name and takes
the same hyper-parameters. Signatures:

* transforms: ``fn(records, base, **hp) -> RefOut`` where ``base`` holds, per record, per
  turn, the list of the base advantage's token values (what the transform receives, e.g. read
  back from ``grpo(batch).token`` with ``place``'s spans). A_i is the token mean of
  ``base`` over the record.
* estimators (``ccpo``, ``sharp``): ``fn(records, **hp) -> RefOut``.
* functions: ``shapley(v)`` (average marginal contribution over all n! orders: a different
  formula from the subset sum the library uses), ``triage_constants``, ``grse_credit``.

Record fields read: ``turns[k].turn_extras`` / ``token_extras`` (labels), ``turns[k].action``
and ``action_key`` (Self-Credit matching), ``traj_extras``, ``edges``, ``group``, ``outcome``.
Every ``RefOut.tol`` entry models float32 error of the library (atol + rtol * magnitude,
plus the standardisation term for per-agent GRPO).
"""

from __future__ import annotations

import itertools
import math

from tests.reference.estimators_ref import (BASE_ATOL, BASE_RTOL, RefOut, U32, WHITEN_C,
                                            _std_tol, f32)

RTOL = 4 * BASE_RTOL


def _lens(rec):
    return [len(t["action"]) for t in rec["turns"]]


def _turn_x(rec, name, default=None):
    return [f32(t.get("turn_extras", {}).get(name, default)) for t in rec["turns"]]


def _traj_x(rec, name):
    v = rec["traj_extras"][name]
    return [f32(x) for x in v] if isinstance(v, list) else f32(v)


def _a_i(base_rec):
    flat = [x for turn in base_rec for x in turn]
    return sum(flat) / len(flat)


def _out(recs, tokens):
    """RefOut from per-record per-turn token lists; turn = token mean."""
    turn = [[sum(t) / len(t) for t in per] for per in tokens]
    tol = [BASE_ATOL + RTOL * max(abs(x) for t in per for x in t) for per in tokens]
    return RefOut(token=tokens, turn=turn, tol={"token": tol, "turn": tol})


def _normalize(w, lens):
    """Per-turn weights at token-weighted mean 1 (uniform if equal or all 0)."""
    w = [max(x, 0.0) for x in w]
    total, mass = sum(lens), sum(n * x for n, x in zip(lens, w))
    if mass <= 0 or max(w) == min(w):
        return [1.0] * len(w)
    return [x * total / mass for x in w]


def _scale_turns(base_rec, w):
    return [[a * x for a in turn] for turn, x in zip(base_rec, w)]


def _route(recs, base, weights):
    return _out(recs, [_scale_turns(b, _normalize(w, _lens(r)))
                       for r, b, w in zip(recs, base, weights)])


# ----------------------------------------------------------------------------- STAMP, IAPO


def stamp(records, base, *, citations="supported_citations", alpha=1.0):
    ws = []
    for rec in records:
        c = [max(x, 0.0) for x in _turn_x(rec, citations)]
        tot = max(1.0, sum(c))
        ws.append([1 + alpha * x / tot for x in c])
    return _route(records, base, ws)


def iapo(records, base, *, edges="edges", alpha=1.0, beta=1.0, dedup=True):
    ws = []
    for rec, b in zip(records, base):
        k = len(rec["turns"])
        es = [tuple((list(e) + [0])[:3]) for e in rec.get(edges, [])]
        es = [e for e in es if e[2] in (0, 1)]
        if dedup:
            es = list(dict.fromkeys(es))
        a = _a_i(b)
        w = []
        for j in range(k):
            if a > 0:
                w.append(1 + alpha * sum(1 for s, d, t in es if s == j and t == 0)
                         + beta * (j == k - 1))
            elif a < 0:
                w.append(1 + alpha * sum(1 for s, d, t in es if s == j and t == 1)
                         + beta * sum(1 for s, d, t in es if d == j and t == 1))
            else:
                w.append(1.0)
        ws.append(w)
    return _route(records, base, ws)


# ----------------------------------------------------------------------------- Self-Credit


def _key(turn):
    return ("k", turn["action_key"]) if "action_key" in turn else ("a", tuple(turn["action"]))


def self_credit(records, base, *, cite="cite", alpha=1.0, alpha_fail=0.5, w_min=0.1,
                variant="reweight"):
    a = [_a_i(b) for b in base]
    cited = [{_key(t) for t, c in zip(r["turns"], _turn_x(r, cite)) if c > 0.5}
             for r in records]
    out = []
    for i, rec in enumerate(records):
        group = [j for j, r in enumerate(records) if r["group"] == rec["group"]]
        succ = [j for j in group if a[j] > 0]
        fail = [j for j in group if a[j] < 0]
        w = []
        for t, c in zip(rec["turns"], _turn_x(rec, cite)):
            if c <= 0.5 or a[i] == 0:
                w.append(1.0)
                continue
            key = _key(t)
            s = sum(key in cited[j] for j in succ) / max(1, len(succ))
            f = sum(key in cited[j] for j in fail) / max(1, len(fail))
            w.append(1 + alpha * max(s - f, 0.0) if a[i] > 0 else max(w_min, 1 - alpha_fail * s))
        if variant == "conserve":
            w = _normalize(w, _lens(rec))
        out.append(_scale_turns(base[i], w))
    return _out(records, out)


# ----------------------------------------------------------------------------- TRIAGE


def _role(x):
    return int(x) if x == int(x) and 0 <= x <= 3 else None


def triage(records, base, *, role="role", bound=0.5, c_progress=1.0, c_exploration=0.5,
           c_infrastructure=0.0, c_regression=-1.0, sign_consistent=False):
    c = [c_progress, c_exploration, c_infrastructure, c_regression]
    out = []
    for rec, b in zip(records, base):
        a = _a_i(b)
        per = []
        for turn, x in zip(b, _turn_x(rec, role)):
            r = _role(x)
            add = f32(bound * f32(c[r])) if r is not None else 0.0
            vals = [v + add for v in turn]
            if sign_consistent:
                vals = [max(v, 0.0) if a > 0 else (min(v, 0.0) if a < 0 else 0.0) for v in vals]
            per.append(vals)
        out.append(per)
    return _out(records, out)


def triage_constants(records, target, base, *, role="role"):
    """Least squares min_c sum_k (target_k - base_k - c_role(k))^2 solved by the normal
    equations of the one-hot design: per role, the residual sum over the count."""
    num, cnt = [0.0] * 4, [0] * 4
    for rec, tg, bs in zip(records, target, base):
        for x, t, b in zip(_turn_x(rec, role), tg, bs):
            r = _role(x)
            if r is not None:
                num[r] += t - b
                cnt[r] += 1
    return [n / c if c else 0.0 for n, c in zip(num, cnt)]


# ----------------------------------------------------------------------------- SERL, VICT, ECHO


def _relevance(rec, name):
    """Per turn, per token relevance (turn extras broadcast)."""
    out = []
    for t in rec["turns"]:
        if name in t.get("token_extras", {}):
            out.append([f32(x) for x in t["token_extras"][name]])
        else:
            out.append([f32(t["turn_extras"][name])] * len(t["action"]))
    return out


def serl(records, base, *, relevance="relevance", alpha=1.0):
    out = []
    for rec, b in zip(records, base):
        w = [[max(0.0, 1 + alpha * x) for x in turn] for turn in _relevance(rec, relevance)]
        flat = [x for turn in w for x in turn]
        if sum(flat) > 0 and max(flat) != min(flat):
            s = len(flat) / sum(flat)
            w = [[x * s for x in turn] for turn in w]
        else:
            w = [[1.0] * len(turn) for turn in w]
        out.append([[a * x for a, x in zip(bt, wt)] for bt, wt in zip(b, w)])
    return _out(records, out)


def vict(records, base, *, atoms="atoms", complete="trace_complete", alpha=1.0):
    ws = []
    for rec in records:
        ok = complete is None or _traj_x(rec, complete) > 0.5
        ws.append([1 + alpha * max(x, 0.0) if ok else 1.0 for x in _turn_x(rec, atoms)])
    return _route(records, base, ws)


def echo(records, base, *, selected="selected", eta=1.0, normalize=False):
    out = []
    for rec, b in zip(records, base):
        pos = _a_i(b) > 0
        w = [1 + eta if pos and s > 0.5 else 1.0 for s in _turn_x(rec, selected)]
        if normalize:
            w = _normalize(w, _lens(rec))
        out.append(_scale_turns(b, w))
    return _out(records, out)


# ----------------------------------------------------------------------------- SkillGate, ProAS


def skillgate(records, base, *, skill_mask="skill_mask", read_correct="read_correct",
              normalization="group", eps=1e-6):
    x = [_traj_x(r, read_correct) for r in records]
    a_sel, tol = list(x), [0.0] * len(records)
    if normalization == "group":
        for i, rec in enumerate(records):
            g = [x[j] for j, r in enumerate(records) if r["group"] == rec["group"]]
            if len(g) < 2:
                a_sel[i] = 0.0
                continue
            m = sum(g) / len(g)
            sd = math.sqrt(sum((v - m) ** 2 for v in g) / (len(g) - 1))
            a_sel[i] = (x[i] - m) / (sd + eps)
            tol[i] = _std_tol(max(abs(v) for v in g), sd + eps, len(g), a_sel[i])
    out = []
    for i, (rec, b) in enumerate(zip(records, base)):
        out.append([[a_sel[i] if m else v for v, m in zip(bt, t["token_extras"][skill_mask])]
                    for bt, t in zip(b, rec["turns"])])
    res = _out(records, out)
    res.tol = {f: [t + s for t, s in zip(res.tol[f], tol)] for f in res.tol}
    return res


def proas(records, base, *, reasonable="reasonable", deviation="deviation", alpha=1.0,
          beta=0.5):
    out = []
    for rec, b in zip(records, base):
        a = _a_i(b)
        ok = [x > 0.5 for x in _turn_x(rec, reasonable)]
        dev = [max(x, 0.0) for x in _turn_x(rec, deviation)]
        if a > 0:
            w = [1.0 if o else 0.0 for o in ok]
        elif a < 0:
            w = _normalize([1 + alpha * d if d > 0 else (1 - beta if o else 1.0)
                            for o, d in zip(ok, dev)], _lens(rec))
        else:
            w = [1.0] * len(ok)
        out.append(_scale_turns(b, w))
    return _out(records, out)


# ----------------------------------------------------------------------------- Neos, GGPO


def neos(records, base, *, divergence="divergence_step", after="keep"):
    out = []
    for rec, b in zip(records, base):
        d = round(_traj_x(rec, divergence))
        k = len(rec["turns"])
        if _a_i(b) < 0 and 0 <= d < k:
            w = [0.0 if j < d else (1.0 if j == d or after == "keep" else 0.0) for j in range(k)]
        else:
            w = [1.0] * k
        out.append(_scale_turns(b, w))
    return _out(records, out)


def ggpo(records, base, *, redundant="redundant"):
    out = []
    for rec, b in zip(records, base):
        red = _relevance(rec, redundant)
        out.append([[min(v, 0.0) if r > 0.5 else v for v, r in zip(bt, rt)]
                    for bt, rt in zip(b, red)])
    return _out(records, out)


# ----------------------------------------------------------------------------- multi-agent


def shapley(v):
    """phi_a = mean over all orderings of agent a's marginal contribution v(P u a) - v(P),
    P the agents before a; coalitions are bitmasks."""
    n = len(v).bit_length() - 1
    phi = [0.0] * n
    orders = list(itertools.permutations(range(n)))
    for order in orders:
        mask = 0
        for a in order:
            phi[a] += v[mask | (1 << a)] - v[mask]
            mask |= 1 << a
    return [p / len(orders) for p in phi]


def _per_agent_grpo(records, role_rewards, *, agent, eps, ddof, scale_extra=0.0):
    """GRPO of R_{i,a} within (group, agent) over the trajectories where a acts."""
    agents = [[round(x) for x in _turn_x(r, agent)] for r in records]
    na = len(role_rewards[0]) if role_rewards else 0
    acts = [{a for a in ag if 0 <= a < na} for ag in agents]
    adv = [dict() for _ in records]
    tol = [BASE_ATOL] * len(records)
    for i, rec in enumerate(records):
        for a in acts[i]:
            members = [j for j, r in enumerate(records)
                       if r["group"] == rec["group"] and a in acts[j]]
            vals = [role_rewards[j][a] for j in members]
            if len(vals) < 2:
                adv[i][a] = 0.0
                continue
            m = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - m) ** 2 for v in vals) / max(len(vals) - ddof, 1))
            adv[i][a] = (role_rewards[i][a] - m) / (sd + eps)
            scale = max(abs(v) for v in vals) + scale_extra
            tol[i] = max(tol[i], _std_tol(scale, sd + eps, len(vals), adv[i][a]))
    turn = [[adv[i].get(a, 0.0) for a in ag] for i, ag in enumerate(agents)]
    token = [[[x] * n for x, n in zip(tv, _lens(r))] for tv, r in zip(turn, records)]
    return RefOut(token=token, turn=turn, tol={"token": tol, "turn": tol})


def ccpo(records, *, agent="agent", counterfactual="counterfactual_outcome", weight=1.0,
         eps=1e-6, ddof=1):
    rr = []
    for rec in records:
        r = f32(rec["outcome"])
        rr.append([r + weight * (r - w) for w in _traj_x(rec, counterfactual)])
    return _per_agent_grpo(records, rr, agent=agent, eps=eps, ddof=ddof)


def sharp(records, *, agent="agent", coalition_values="coalition_values", beta=1.0,
          tool_rewards=None, delta=0.0, eps=1e-6, ddof=1):
    rr, extra = [], 0.0
    for rec in records:
        v = _traj_x(rec, coalition_values)
        phi = shapley(v)
        tool = _traj_x(rec, tool_rewards) if tool_rewards else [0.0] * len(phi)
        rr.append([f32(rec["outcome"]) + beta * p + delta * t for p, t in zip(phi, tool)])
        # float32 error of the 2^n-term Shapley sum, relative to the coalition scale
        extra = max(extra, abs(beta) * len(v) * max(abs(x) for x in v) * 4)
    return _per_agent_grpo(records, rr, agent=agent, eps=eps, ddof=ddof, scale_extra=extra)


def grse_credit(records, *, active="pair_active"):
    out = []
    for rec in records:
        group = [r for r in records if r["group"] == rec["group"]]
        p = len(_traj_x(rec, active))
        row = []
        for q in range(p):
            on = [f32(r["outcome"]) for r in group if _traj_x(r, active)[q] > 0.5]
            off = [f32(r["outcome"]) for r in group if _traj_x(r, active)[q] <= 0.5]
            row.append(sum(on) / len(on) - sum(off) / len(off) if on and off else 0.0)
        out.append(row)
    return out


REFERENCES = {
    "stamp": stamp, "iapo": iapo, "self_credit": self_credit, "triage": triage, "serl": serl,
    "vict": vict, "echo": echo, "skillgate": skillgate, "proas": proas, "neos": neos,
    "ggpo": ggpo, "ccpo": ccpo, "sharp": sharp,
}
