"""Slow reference for HiPER's hierarchical advantage estimation (HAE).

Written the way HiPER's ``core_hgae.py`` works: per trajectory, a list of boundary positions,
a list of (start, end, next start) segments, backward Python loops over each segment for the
low level and over the segment list for the high level, in float64. Never imports
``jaxrl_agent.estimators`` or ``segments``.

Record fields read (besides rewards): each turn's ``value`` (V_low), and
``turn_extras``: ``high_values`` (V_high; absent -> V_low), ``switch`` (0/1; turn 0 is always
a boundary), ``term_values`` (optional V_term); ``token_extras``: ``subgoal_mask`` and
``switch_mask`` (one bool per action token; absent -> all False).
"""

from __future__ import annotations

import math

from tests.reference.estimators_ref import BASE_ATOL, BASE_RTOL, U32, RefOut, _std_tol, f32
from tests.reference.step_ref import parse_steps

LOW, HIGH, TERM, NONE = "low", "high", "term", "none"


def _segments(switch):
    """[(start, end, next_start or None)] from per-turn switch flags."""
    starts = [0] + [k for k in range(1, len(switch)) if switch[k]]
    return [(s, (starts[j + 1] - 1) if j + 1 < len(starts) else len(switch) - 1,
             starts[j + 1] if j + 1 < len(starts) else None) for j, s in enumerate(starts)]


def traj_streams(tr, *, gamma, lam_turn, lam_seg, switch_stream):
    """One trajectory: dict of per-turn lists and per-token stream labels ``route``."""
    n = len(tr.turns)
    r = [t.reward for t in tr.turns]
    v_low = [t.value for t in tr.turns]
    ex = [t.turn_extras for t in tr.turns]
    v_high = [f32(e["high_values"]) if "high_values" in e else v for e, v in zip(ex, v_low)]
    has_term = all("term_values" in e for e in ex)
    v_term = [f32(e["term_values"]) for e in ex] if has_term else None
    switch = [bool(e.get("switch", 0) > 0.5) for e in ex]
    segs = _segments(switch)
    boundary = [False] * n
    for s, _, _ in segs:
        boundary[s] = True

    low, ret_term = [0.0] * n, [0.0] * n
    high, high_ret = [0.0] * n, [0.0] * n
    for s, e, nxt in segs:
        boot = v_high[nxt] if nxt is not None else 0.0  # episode end: done, no bootstrap
        nxt_adv = 0.0
        for k in range(e, s - 1, -1):  # low level: GAE inside the segment
            v_next = v_low[k + 1] if k < e else boot
            delta = r[k] + gamma * v_next - v_low[k]
            nxt_adv = delta + (gamma * lam_turn * nxt_adv if k < e else 0.0)
            low[k] = nxt_adv
        g = boot
        for k in range(e, s - 1, -1):  # return to the segment end, bootstrapped
            g = r[k] + gamma * g
            ret_term[k] = g
    nxt_seg = 0.0
    for s, e, nxt in reversed(segs):  # high level: SMDP GAE over segments
        d = e - s + 1
        r_seg = sum(gamma ** p * r[s + p] for p in range(d))
        boot = v_high[nxt] if nxt is not None else 0.0
        delta = r_seg + gamma ** d * boot - v_high[s]
        nxt_seg = delta + (gamma ** d * lam_seg * nxt_seg if nxt is not None else 0.0)
        high[s] = nxt_seg
        high_ret[s] = nxt_seg + v_high[s]

    if switch_stream == "auto":
        switch_stream = "term" if has_term else "none"
    route = []
    for k, t in enumerate(tr.turns):
        m = len(t.action)
        sub = t.token_extras.get("subgoal_mask", [False] * m)
        swm = t.token_extras.get("switch_mask", [False] * m)
        labels = []
        for j in range(m):
            if swm[j]:
                lab = {"term": TERM, "high": HIGH if boundary[k] else NONE, "none": NONE}
                labels.append(lab[switch_stream])
            elif sub[j]:
                labels.append(HIGH if boundary[k] else NONE)
            else:
                labels.append(LOW)
        route.append(labels)
    out = {"boundary": boundary, "low": low, "low_returns": [a + v for a, v in zip(low, v_low)],
           "high": high, "high_returns": high_ret, "term_returns": ret_term, "route": route,
           "scale": sum(abs(x) for x in r + v_low + v_high + (v_term or [])) + 1.0}
    if has_term:
        out["term"] = [g - v for g, v in zip(ret_term, v_term)]
    return out


def streams(records, *, gamma=1.0, lam_turn=1.0, lam_seg=0.95, switch_stream="auto"):
    """Per record: the dict of ``traj_streams``."""
    return [traj_streams(tr, gamma=gamma, lam_turn=lam_turn, lam_seg=lam_seg,
                         switch_stream=switch_stream) for tr in parse_steps(records)]


def _standardise(per, name, label, normalize, eps):
    """Stats of stream ``name`` over the turns carrying >= 1 token labelled ``label`` (each
    counted once, or by its number of such tokens): returns (fn x -> x', denom, n, S)."""
    xs, ws = [], []
    for p in per:
        for k, labels in enumerate(p["route"]):
            c = sum(lab == label for lab in labels)
            if c:
                xs.append(p[name][k] if name in p else 0.0)
                ws.append(float(c) if normalize == "token" else 1.0)
    if not ws:
        return (lambda x: x), 1.0, 0, 0.0
    tot = sum(ws)
    mu = sum(w * x for w, x in zip(ws, xs)) / tot
    var = sum(w * (x - mu) ** 2 for w, x in zip(ws, xs)) / tot
    denom = math.sqrt(var) + eps
    return (lambda x: (x - mu) / denom), denom, tot, max(abs(x) for x in xs)


def hae(records, *, gamma=1.0, lam_turn=1.0, lam_seg=0.95, switch_stream="auto",
        normalization="none", eps=1e-8) -> RefOut:
    per = streams(records, gamma=gamma, lam_turn=lam_turn, lam_seg=lam_seg,
                  switch_stream=switch_stream)
    scale = max(p["scale"] for p in per)
    fns, tol_of = {}, {}
    for name, label in ((LOW, LOW), (HIGH, HIGH), (TERM, TERM)):
        if normalization == "none":
            fns[label] = lambda x: x
            tol_of[label] = lambda x, p: BASE_ATOL + BASE_RTOL * p["scale"]
            continue
        fn, denom, n, _ = _standardise(per, name, label, normalization, eps)
        fns[label] = fn
        if n == 0:
            tol_of[label] = lambda x, p: BASE_ATOL + BASE_RTOL * p["scale"]
        else:
            tol_of[label] = (lambda d, m: lambda x, p: _std_tol(scale, d, m, x)
                             + 16 * U32 * scale / d)(denom, n)
    token, turn, turn_ret, tol = [], [], [], {"token": [], "turn": [], "turn_returns": []}
    for p in per:
        t_low = [fns[LOW](x) for x in p["low"]]
        turn.append(t_low)
        turn_ret.append(p["low_returns"])
        rec_tok, tok_tol = [], [BASE_ATOL]
        for k, labels in enumerate(p["route"]):
            vals = []
            for lab in labels:
                if lab == NONE:
                    vals.append(0.0)
                    continue
                x = fns[lab](p[lab][k] if lab in p else 0.0)
                vals.append(x)
                tok_tol.append(tol_of[lab](x, p))
            rec_tok.append(vals)
        token.append(rec_tok)
        tol["token"].append(max(tok_tol))
        tol["turn"].append(max([tol_of[LOW](x, p) for x in t_low] + [BASE_ATOL]))
        tol["turn_returns"].append(BASE_ATOL + BASE_RTOL * p["scale"])
    return RefOut(token=token, turn=turn, turn_returns=turn_ret, tol=tol)


REFERENCES = {"hae": hae}
