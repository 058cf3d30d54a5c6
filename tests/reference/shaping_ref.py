"""Slow references for dense reward / potential shaping (jaxrl_agent/estimators/shaping.py).

Plain Python over the rollout *records* (dict-of-groups, loops, float64), written from the
formulas in the docstrings; nothing here imports the library. Each reference is keyed by
the registered name and takes the same hyper-parameters as the package function.

Signatures (by kind of the registered name):
  shaping    ``ref(records, **hp) -> ShapeOut``: per record the shaped turn rewards (one
             float per turn), the outcome, and the token rewards (per turn, one float per
             action token; None when the shaping does not write them);
  estimator  ``ref(records, **hp) -> RefOut`` (per record per-turn advantages, broadcast to
             tokens);
  transform  ``ref(records, base, **hp) -> RefOut`` where ``base`` is the base estimator's
             per-record list of per-turn advantages (e.g. ``estimators_ref.grpo(records).turn``).
Record fields read: ``turn_extras`` / ``token_extras`` / ``traj_extras`` / ``edges`` as
packed by ``rollout.records.pack_records``; ``ref_logprobs`` / ``logprobs`` of each turn.
"""

from __future__ import annotations

import dataclasses
import math

from tests.reference.estimators_ref import RefOut, f32
from tests.reference.step_ref import parse_steps

TOL_A, TOL_R = 2e-4, 2e-4


@dataclasses.dataclass
class ShapeOut:
    turn_rewards: list
    outcome: list
    token_rewards: list | None = None


def _tol(vals):
    return [TOL_A + TOL_R * max([abs(x) for x in v] + [0.0]) for v in vals]


def _out(recs, turn):
    token = [[[x] * len(t["action"]) for x, t in zip(v, r["turns"])] for r, v in zip(recs, turn)]
    tol = _tol(turn)
    return RefOut(token=token, turn=turn, tol={"turn": tol, "token": tol})


def _te(rec, name):
    return [f32(t["turn_extras"][name]) for t in rec["turns"]]


def _tr(rec, name, default=None):
    if name == "outcome":
        return _outcome(rec)
    ex = rec.get("traj_extras", {})
    if name not in ex:
        if default is None:
            raise KeyError(name)
        return default
    v = ex[name]
    return [f32(x) for x in v] if isinstance(v, list) else f32(v)


def _outcome(rec):
    return parse_steps([rec])[0].outcome


def _rewards(rec):
    return [t.reward for t in parse_steps([rec])[0].turns]


def _diffs(phi, final, gamma=1.0):
    k = len(phi)
    return [gamma * (phi[j + 1] if j + 1 < k else final) - phi[j] for j in range(k)]


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs, ddof=1):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / max(len(xs) - ddof, 1))


def _normalize(records, vals, by, scale_std=True, eps=1e-6):
    """The peer-set z-score of ``normalize_turns`` (singleton 0, unbiased std)."""
    if by == "none":
        return [list(v) for v in vals]
    trajs = parse_steps(records)
    peers = {}
    for i, (tr, v) in enumerate(zip(trajs, vals)):
        for k, x in enumerate(v):
            key = {"cohort": (tr.group, k), "group": tr.group, "batch": 0,
                   "state": (tr.group, tr.turns[k].state)}[by]
            peers.setdefault(key, []).append(x)
    out = []
    for tr, v in zip(trajs, vals):
        row = []
        for k, x in enumerate(v):
            key = {"cohort": (tr.group, k), "group": tr.group, "batch": 0,
                   "state": (tr.group, tr.turns[k].state)}[by]
            xs = peers[key]
            if len(xs) <= 1:
                row.append(0.0)
                continue
            d = x - _mean(xs)
            row.append(d / (_std(xs) + eps) if scale_std else d)
        out.append(row)
    return out


def _add(base, term):
    return [[a + t for a, t in zip(b, d)] for b, d in zip(base, term)]


# ----------------------------------------------------------------------------- shapings


def pbrs(records, *, potential="potential", final_potential="final_potential", gamma=1.0,
         scale=1.0, to_outcome=False):
    tr, oc = [], []
    for rec in records:
        f = [scale * x for x in _diffs(_te(rec, potential), _tr(rec, final_potential, 0.0), gamma)]
        tr.append([r + x for r, x in zip(_rewards(rec), f)])
        oc.append(_outcome(rec) + (sum(gamma ** k * x for k, x in enumerate(f))
                                   if to_outcome else 0.0))
    return ShapeOut(tr, oc)


def uniform(records, *, score="outcome", replace=True):
    tr = []
    for rec in records:
        k = len(rec["turns"])
        s = _tr(rec, score) / k
        tr.append([s + (0.0 if replace else r) for r in _rewards(rec)])
    return ShapeOut(tr, [_outcome(r) for r in records])


def spa(records, *, contribution="contribution", grounded="grounded", bonus=0.5, replace=True):
    tr = []
    for rec in records:
        c, g, rw = _te(rec, contribution), _te(rec, grounded), _rewards(rec)
        k = len(c)
        tr.append([c[j] + bonus * (g[j] > 0.5) + bonus * (j == k - 1) + (0.0 if replace else rw[j])
                   for j in range(k)])
    return ShapeOut(tr, [_outcome(r) for r in records])


def rebel(records, *, state="belief_state", task="belief_task", pred="belief_pred",
          format="belief_format", w_state=0.3, w_task=0.4, w_pred=0.3, w_format=0.1,
          cw_state=1.0, cw_task=1.0, cw_pred=1.0, cw_format=1.0, replace=False):
    tr = []
    for rec in records:
        parts = [_te(rec, n) for n in (state, task, pred, format)]
        coef = [w_state * cw_state, w_task * cw_task, w_pred * cw_pred, w_format * cw_format]
        rw = _rewards(rec)
        tr.append([sum(c * p[j] for c, p in zip(coef, parts)) + (0.0 if replace else rw[j])
                   for j in range(len(rw))])
    return ShapeOut(tr, [_outcome(r) for r in records])


def red(records, *, scores="prefix_scores", initial_score="initial_score", scale=1.0):
    tok = []
    for rec in records:
        prev = _tr(rec, initial_score, 0.0)
        per_turn = []
        for t in rec["turns"]:
            row = []
            for s in t["token_extras"][scores]:
                s = f32(s)
                row.append(scale * (s - prev))
                prev = s
            per_turn.append(row)
        tok.append(per_turn)
    return ShapeOut([_rewards(r) for r in records], [_outcome(r) for r in records], tok)


def vpr(records, *, label="verified", scale=1.0, to="outcome", replace=False):
    tr, oc = [], []
    for rec in records:
        x = [scale * v for v in _te(rec, label)]
        rw = _rewards(rec)
        if to in ("turns", "both"):
            rw = [v + (0.0 if replace else r) for v, r in zip(x, rw)]
        tr.append(rw)
        oc.append(_outcome(rec) + (sum(x) if to in ("outcome", "both") else 0.0))
    return ShapeOut(tr, oc)


def nasa(records, *, evidence="evidence", necessity="necessity", threshold=0.5, scale=1.0,
         replace=False):
    tr = []
    for rec in records:
        u = [max(e, 0.0) * max(n, 0.0) for e, n in zip(_te(rec, evidence), _te(rec, necessity))]
        tot = sum(u)
        share = [x / tot for x in u] if tot > 0 else [1.0 / len(u)] * len(u)
        r = _outcome(rec)
        sign = 1.0 if r > threshold else (-1.0 if r < threshold else 0.0)
        tr.append([scale * sign * s + (0.0 if replace else w)
                   for s, w in zip(share, _rewards(rec))])
    return ShapeOut(tr, [_outcome(r) for r in records])


def v_rubrics(records, *, scores="rubric_scores", starts="rubric_start", ends="rubric_end",
              mode="span", scale=1.0):
    tok = []
    for rec in records:
        lens = [len(t["action"]) for t in rec["turns"]]
        n = sum(lens)
        flat = [0.0] * n
        for s, lo, hi in zip(_tr(rec, scores), _tr(rec, starts), _tr(rec, ends)):
            lo, hi = int(round(lo)), int(round(hi))
            lo = 0 if mode == "prefix" else max(lo, 0)
            span = [p for p in range(n) if hi >= 0 and lo <= p <= hi]
            if not span:
                span = list(range(n))
            for p in span:
                flat[p] += scale * s / len(span)
        per_turn, pos = [], 0
        for m in lens:
            per_turn.append(flat[pos:pos + m])
            pos += m
        tok.append(per_turn)
    return ShapeOut([_rewards(r) for r in records], [_outcome(r) for r in records], tok)


# ----------------------------------------------------------------------------- estimators


def reward_to_go(records, *, score="outcome", baseline="cohort", normalize=False, eps=1e-6):
    trajs = parse_steps(records)
    s = [_tr(rec, score) for rec in records]
    g = [[si * (len(r["turns"]) - k) / len(r["turns"]) for k in range(len(r["turns"]))]
         for si, r in zip(s, records)]
    if baseline == "cohort":
        return _out(records, _normalize(records, g, "cohort", normalize, eps))
    groups = {}
    for i, tr in enumerate(trajs):
        groups.setdefault(tr.group, []).append(s[i])
    out = []
    for i, (tr, rec) in enumerate(zip(trajs, records)):
        xs = groups[tr.group]
        k = len(rec["turns"])
        if len(xs) <= 1:
            out.append([0.0] * k)
            continue
        d = s[i] - _mean(xs)
        if normalize:
            d = d / (_std(xs) + eps)
        out.append([d * (k - j) / k for j in range(k)])
    return _out(records, out)


def pica(records, *, potential="potential", gamma=1.0, normalization="separate",
         std_normalize=True, f1_weight=1.0, ig_weight=1.0, eps=1e-6):
    trajs = parse_steps(records)
    f1 = [tr.outcome for tr in trajs]
    ig = []
    for rec in records:
        k = len(rec["turns"])
        if potential is None:
            src = _rewards(rec)
            ig.append([src[j] for j in range(k - 1)])
        else:
            phi = _te(rec, potential)
            ig.append([phi[j + 1] - phi[j] for j in range(k - 1)])

    def stats(xs):
        if not xs:
            return 0.0, 1.0
        m = _mean(xs)
        if len(xs) <= 1:
            return m, 1.0
        return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs) + 1e-8)

    pools_f, pools_i = {}, {}
    for i, tr in enumerate(trajs):
        pools_f.setdefault(tr.group, []).append(f1[i])
        pools_i.setdefault(tr.group, []).extend(ig[i])

    def z(x, ms):
        d = x - ms[0]
        return d / (ms[1] + eps) if std_normalize else d

    out = []
    for i, tr in enumerate(trajs):
        if normalization == "separate":
            sf, si = stats(pools_f[tr.group]), stats(pools_i[tr.group])
        else:
            sf = si = stats(pools_f[tr.group] + pools_i[tr.group])
        fz = f1_weight * z(f1[i], sf)
        igz = [ig_weight * z(x, si) for x in ig[i]]
        acc, adv = 0.0, []
        for x in reversed(igz):
            acc = x + gamma * acc
            adv.append(acc + fz)
        out.append(list(reversed(adv)) + [fz])
    return _out(records, out)


# ----------------------------------------------------------------------------- transforms


def trace(records, base, *, potential="potential", final_potential="final_potential", beta=0.5,
          normalization="cohort", accumulate=False, length=None, eps=1e-6):
    r = []
    for rec in records:
        d = _diffs(_te(rec, potential), _tr(rec, final_potential))
        if length is not None:
            d = [x / max(_tr(rec, length), 1.0) for x in d]
        r.append(d)
    z = _normalize(records, r, normalization, True, eps)
    if accumulate:
        z = [[sum(v[k:]) for k in range(len(v))] for v in z]
    return _out(records, _add(base, [[beta * x for x in v] for v in z]))


def spae(records, base, *, potential="step_potential", acc="acc", conf="conf", alpha=0.1,
         c_sat=1.0, saturation=0.9):
    out = []
    for rec, b in zip(records, base):
        if potential is None:
            phi = [1.5 * a * c + 0.5 * a - c for a, c in zip(_te(rec, acc), _te(rec, conf))]
        else:
            phi = _te(rec, potential)
        row, seen = [], False
        for k, p in enumerate(phi):
            d = 0.0 if k == 0 else p - phi[k - 1]
            s = c_sat if seen else 1.0
            row.append(b[k] * s + alpha * d)
            seen = seen or p > saturation
        out.append(row)
    return _out(records, out)


def _efca_w(rec, tr, feedback, fb_coef, loop_coef, window, w_min, w_max):
    fb = _te(rec, feedback)
    k = len(fb)
    w = []
    for j in range(k):
        key = (tr.turns[j].state, tr.turns[j].act_key)
        rep = any((tr.turns[i].state, tr.turns[i].act_key) == key
                  for i in range(max(0, j - window), j))
        stall = j + 1 < k and tr.turns[j + 1].state == tr.turns[j].state
        w.append(min(max(1 + fb_coef * fb[j] - loop_coef * (rep + stall), w_min), w_max))
    return w


def efca(records, base, *, feedback="feedback", fb_coef=0.5, loop_coef=0.5, window=3,
         w_min=0.0, w_max=2.0, normalize=False):
    trajs = parse_steps(records)
    out = []
    for rec, tr, b in zip(records, trajs, base):
        w = _efca_w(rec, tr, feedback, fb_coef, loop_coef, window, w_min, w_max)
        if normalize:
            n = [len(t["action"]) for t in rec["turns"]]
            mass = sum(x * m for x, m in zip(w, n))
            if mass <= 0 or max(w) == min(w):
                w = [1.0] * len(w)
            else:
                w = [x * sum(n) / mass for x in w]
        out.append([a * x for a, x in zip(b, w)])
    return _out(records, out)


def vtca_credit(rec, progress="progress", final_progress="final_progress", edges="edges",
                rho=0.3):
    delta = _diffs(_te(rec, progress), _tr(rec, final_progress))
    k = len(delta)
    pairs = {(int(e[0]), int(e[1])) for e in rec.get(edges, []) if e[0] != e[1]}
    pre = {j: [s for s, d in pairs if d == j] for j in range(k)}
    c = []
    for j in range(k):
        x = delta[j] * (1 - rho * (delta[j] > 0 and len(pre[j]) > 0))
        x += sum(rho * delta[d] / len(pre[d]) for s, d in pairs if s == j and delta[d] > 0)
        c.append(x)
    return c


def vtca(records, base, *, progress="progress", final_progress="final_progress", edges="edges",
         rho=0.3, eta=1.0, normalization="none", eps=1e-6):
    c = [vtca_credit(rec, progress, final_progress, edges, rho) for rec in records]
    c = _normalize(records, c, normalization, True, eps)
    return _out(records, _add(base, [[eta * x for x in v] for v in c]))


def procredit(records, base, *, progress="progress", final_progress="final_progress",
              weight=1.0, cohort="cohort", normalize=True, eps=1e-6):
    g = [[_tr(rec, final_progress) - p for p in _te(rec, progress)] for rec in records]
    z = _normalize(records, g, cohort, normalize, eps)
    return _out(records, _add(base, [[weight * x for x in v] for v in z]))


def _a2tgpo_ig(records, potential, final_potential, eps):
    ig = [_diffs(_te(rec, potential), _tr(rec, final_potential)) for rec in records]
    return _normalize(records, ig, "cohort", True, eps)


def a2tgpo(records, base, *, potential="potential", final_potential="final_potential",
           gamma=1.0, weight=1.0, eps=1e-6):
    z = _a2tgpo_ig(records, potential, final_potential, eps)
    term = []
    for v in z:
        k = len(v)
        term.append([weight * sum(gamma ** (j - i) * v[j] for j in range(i, k))
                     / math.sqrt(sum(gamma ** (2 * (j - i)) for j in range(i, k)))
                     for i in range(k)])
    return _out(records, _add(base, term))


def a2tgpo_clip_range(records, *, potential="potential", final_potential="final_potential",
                      eps0=0.2, kappa=0.5, eps_min=0.1, eps_max=0.3, eps=1e-6):
    """Per record, per turn, one clip epsilon per action token."""
    z = _a2tgpo_ig(records, potential, final_potential, eps)
    return [[[min(max(eps0 * (1 + kappa * math.tanh(x)), eps_min), eps_max)] * len(t["action"])
             for x, t in zip(v, rec["turns"])] for v, rec in zip(z, records)]


def cast(records, base, *, oracle="oracle_advantage", alpha=0.3, transform="asinh",
         normalization="rms", eps=1e-8):
    fn = {"asinh": math.asinh, "identity": lambda a: a,
          "signed_log": lambda a: math.copysign(math.log1p(abs(a)), a) if a else 0.0}[transform]
    g = [[fn(a) for a in _te(rec, oracle)] for rec in records]
    allg = [x for v in g for x in v]
    rms = math.sqrt(sum(x * x for x in allg) / len(allg)) if allg else 1.0
    scale = 1.0 / (rms + eps) if normalization == "rms" else 1.0
    return _out(records, _add(base, [[alpha * x * scale for x in v] for v in g]))


def implicit_step_rewards(rec, prm="prm_logprobs", ref="ref_logprobs", beta=0.1):
    out = []
    for t in rec["turns"]:
        lp = [f32(x) for x in t["token_extras"][prm]]
        key = "logprobs" if ref == "old_logprobs" else ref
        lr = [f32(x) for x in (t[key] if key in t else t["token_extras"][key])]
        out.append(beta * sum(a - b for a, b in zip(lp, lr)))
    return out


def oprl(records, base, *, prm="prm_logprobs", ref="ref_logprobs", beta=0.1, weight=1.0,
         cohort="cohort", normalize=True, eps=1e-6):
    r = [implicit_step_rewards(rec, prm, ref, beta) for rec in records]
    z = _normalize(records, r, cohort, normalize, eps)
    return _out(records, _add(base, [[weight * x for x in v] for v in z]))


def step_gain(records, base, *, potential="potential", final_potential="final_potential",
              weight=1.0, normalize=True, eps=1e-6):
    g = [_diffs(_te(rec, potential), _tr(rec, final_potential)) for rec in records]
    z = _normalize(records, g, "cohort", normalize, eps)
    return _out(records, _add(base, [[weight * x for x in v] for v in z]))


def ups(records, base, *, align="alignment", weight=0.5, center="trajectory"):
    x = [_te(rec, align) for rec in records]
    if center == "trajectory":
        d = [[a - _mean(v) for a in v] for v in x]
    else:
        d = _normalize(records, x, "group", False)
    return _out(records, _add(base, [[weight * a for a in v] for v in d]))


def capo(records, base, *, verdict="step_verdict", kappa=0.5, reward_correct=False,
         fail_below=0.5):
    out = []
    for rec, b in zip(records, base):
        failed = _outcome(rec) < fail_below
        out.append([a + kappa * (-(v < 0) + (reward_correct and failed and v > 0))
                    for a, v in zip(b, _te(rec, verdict))])
    return _out(records, out)


REFERENCES = {
    "pbrs": pbrs, "uniform": uniform, "spa": spa, "rebel": rebel, "red": red, "vpr": vpr,
    "nasa": nasa, "v_rubrics": v_rubrics,
    "reward_to_go": reward_to_go, "pica": pica,
    "trace": trace, "spae": spae, "efca": efca, "vtca": vtca, "procredit": procredit,
    "a2tgpo": a2tgpo, "cast": cast, "oprl": oprl, "step_gain": step_gain, "ups": ups,
    "capo": capo,
}
KINDS = {name: ("shaping" if name in ("pbrs", "uniform", "spa", "rebel", "red", "vpr", "nasa",
                                      "v_rubrics")
                else "estimator" if name in ("reward_to_go", "pica") else "transform")
         for name in REFERENCES}
