"""Slow reference for the distillation methods (jaxrl_agent/losses/distill.py and
jaxrl_agent/estimators/distill.py), from the formulas.

Independent of ``jaxrl_agent``: plain Python loops over tokens, turns, trajectories and groups
(dicts), in float64, on a host copy of a batch (``host(batch)``: a dict of numpy arrays).

Signatures (``nb`` = ``host(batch)``):

* ``REFERENCES`` (estimator-registry names):
  estimators ``ref(nb, **hp) -> {"token": [R, T], "turn": [N, K]}``;
  transforms ``ref(nb, base_token, **hp) -> {"token", "turn"}`` where ``base_token`` [R, T] is
  the base estimator's token advantage it receives (e.g. GRPO's, from estimators_ref.grpo).
* ``LOSS_TOKENS`` (losses): ``ref(nb, lp, *, lp_stop=None, **hp) -> (per_token [R, T], mask)``:
  the per-token loss and the mask it is aggregated over. ``lp`` are the student log-probs that
  carry gradient, ``lp_stop`` (default ``lp``) their stop-gradient occurrences (gates, weights,
  credit), so a finite difference in ``lp`` alone is the library's gradient.
* ``LOSS_REFERENCES``: ``ref(nb, lp, *, agg="token_mean", agg_constant=None, **hp) -> (sum,
  denominator)``, aggregated by ``losses_ref.aggregate``.

The special field names ``"old_logprobs"`` / ``"outcome"`` read the batch fields; per-signal
fields may be [R, T], [N, K] or [N] (read at the token's turn / trajectory).
"""

from __future__ import annotations

import math

import numpy as np

from tests.reference.losses_ref import aggregate


def host(batch) -> dict:
    nb = {f: np.asarray(getattr(batch, f)) for f in
          ("action_mask", "turn_ids", "row_traj", "turn_mask", "traj_mask", "group_ids",
           "state_keys")}
    nb["old_logprobs"] = np.asarray(batch.old_logprobs, np.float64)
    nb["outcome"] = np.asarray(batch.outcome, np.float64)
    nb["extras"] = {k: np.asarray(v) for k, v in batch.extras.items()}
    return nb


def _tokens(nb):
    m = nb["action_mask"]
    for r in range(m.shape[0]):
        for t in range(m.shape[1]):
            if m[r, t]:
                yield r, t


def _field(nb, name):
    if name in ("old_logprobs", "outcome"):
        return nb[name]
    return np.asarray(nb["extras"][name], np.float64)


def _at(nb, x, r, t):
    """x read at token (r, t): per token, per turn or per trajectory."""
    x = np.asarray(x)
    i, k = int(nb["row_traj"][r]), int(nb["turn_ids"][r, t])
    if x.shape == nb["action_mask"].shape:
        return float(x[r, t])
    if x.shape == nb["turn_mask"].shape:
        return float(x[i, k])
    return float(x[i])


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _k3(lp, lt):
    d = min(max(lt - lp, -20.0), 20.0)
    return min(max(math.exp(d) - d - 1.0, -10.0), 10.0)


def _turn_of_tokens(nb, tok):
    """Token mean per (trajectory, turn), [N, K]."""
    sums, counts = {}, {}
    for r, t in _tokens(nb):
        key = (int(nb["row_traj"][r]), int(nb["turn_ids"][r, t]))
        sums[key] = sums.get(key, 0.0) + tok[r, t]
        counts[key] = counts.get(key, 0) + 1
    out = np.zeros(nb["turn_mask"].shape)
    for key, s in sums.items():
        out[key] = s / counts[key]
    return out


def _mask_field(nb, name):
    m = nb["action_mask"].copy()
    if name is None:
        return m
    x = nb["extras"][name]
    return m & (x if x.dtype == bool else x > 0.5)


def _out(nb, tok):
    return {"token": tok, "turn": _turn_of_tokens(nb, tok)}


# ============================================================================= estimators


def _clip(x, c):
    return x if c is None else min(max(x, -c), c)


def opd(nb, *, beta=1.0, teacher="teacher_logprobs", behavior="old_logprobs", mask=None,
        clip=None):
    lt, lb, on = _field(nb, teacher), _field(nb, behavior), _mask_field(nb, mask)
    tok = np.zeros(on.shape)
    for r, t in _tokens(nb):
        if on[r, t]:
            tok[r, t] = beta * _clip(lt[r, t] - lb[r, t], clip)
    return _out(nb, tok)


def seed(nb, base_token, *, weight=1.0, teacher="teacher_logprobs", student="old_logprobs",
         mask=None, clip=None):
    lt, ls, on = _field(nb, teacher), _field(nb, student), _mask_field(nb, mask)
    tok = np.zeros(on.shape)
    for r, t in _tokens(nb):
        tok[r, t] = base_token[r, t] + (weight * _clip(lt[r, t] - ls[r, t], clip) if on[r, t]
                                        else 0.0)
    return _out(nb, tok)


def cny(nb, base_token, *, mask="selection_mask", **kw):
    return seed(nb, base_token, mask=mask, **kw)


def _lme(xs):
    top = max(xs)
    return top + math.log(sum(math.exp(x - top) for x in xs) / len(xs))


def credit(nb, *, beta=1.0, teacher="teacher_logprobs", negatives="negative_logprobs",
           level="token", variant="logmeanexp"):
    lt, neg = _field(nb, teacher), np.asarray(nb["extras"][negatives], np.float64)
    tok = np.zeros(lt.shape)
    if level == "token":
        for r, t in _tokens(nb):
            negs = list(neg[r, t])
            base = (sum(negs) / len(negs) if variant == "mean"
                    else _lme([lt[r, t]] + negs))
            tok[r, t] = beta * (lt[r, t] - base)
        return _out(nb, tok)
    s_self, s_neg = {}, {}
    for r, t in _tokens(nb):
        i = int(nb["row_traj"][r])
        s_self[i] = s_self.get(i, 0.0) + lt[r, t]
        s_neg[i] = s_neg.get(i, np.zeros(neg.shape[2])) + neg[r, t]
    val = {i: (s_self[i] - (np.mean(s_neg[i]) if variant == "mean"
                            else _lme([s_self[i]] + list(s_neg[i])))) for i in s_self}
    for r, t in _tokens(nb):
        tok[r, t] = beta * val[int(nb["row_traj"][r])]
    return _out(nb, tok)


REFERENCES = {"opd": opd, "credit": credit, "seed": seed, "cny": cny}


# ============================================================================= losses


def _zeros(nb):
    return np.zeros(nb["action_mask"].shape)


def sdl(nb, lp, *, lp_stop=None, teacher="teacher_logprobs", behavior="old_logprobs"):
    lt, lo = _field(nb, teacher), _field(nb, behavior)
    out = _zeros(nb)
    for r, t in _tokens(nb):
        ell = lp[r, t] - lt[r, t]
        k3 = math.exp(min(-ell, 20.0)) - 1.0 + ell
        out[r, t] = math.exp(min(lp[r, t] - lo[r, t], 10.0)) * k3
    return out, nb["action_mask"]


def sdar(nb, lp, *, lp_stop=None, teacher="teacher_logprobs", gate="sigmoid", gate_beta=5.0,
         gate_field="gate", gate_delta_sign=None, weight=None):
    lp_stop = lp if lp_stop is None else lp_stop
    lt = _field(nb, teacher)
    out = _zeros(nb)
    for r, t in _tokens(nb):
        if gate == "sigmoid":
            s = 1.0
            if isinstance(gate_delta_sign, str):
                s = _at(nb, _field(nb, gate_delta_sign), r, t)
            elif gate_delta_sign is not None:
                s = float(gate_delta_sign)
            g = _sigmoid(gate_beta * s * (lt[r, t] - lp_stop[r, t]))
        elif gate == "none":
            g = 1.0
        else:
            g = _at(nb, _field(nb, gate_field), r, t)
        w = 1.0 if weight is None else _at(nb, _field(nb, weight), r, t)
        out[r, t] = w * g * (lt[r, t] - lp[r, t])
    return out, nb["action_mask"]


def edge(nb, lp, *, lp_stop=None, view="view", score="outcome", teacher="old_logprobs",
         above_f_mean=False):
    v, R, lt = _field(nb, view), _field(nb, score), _field(nb, teacher)
    groups = {}
    for i in range(len(v)):
        if nb["traj_mask"][i]:
            groups.setdefault(int(nb["group_ids"][i]), {"E": [], "F": []})[
                "E" if v[i] > 0.5 else "F"].append(i)
    admit = set()
    for g in groups.values():
        if not g["E"] or not g["F"]:
            continue
        mean_e = sum(R[i] for i in g["E"]) / len(g["E"])
        mean_f = sum(R[i] for i in g["F"]) / len(g["F"])
        if mean_e - mean_f > 0:
            admit |= {i for i in g["E"] if not above_f_mean or R[i] > mean_f}
    out, mask = _zeros(nb), np.zeros(nb["action_mask"].shape, bool)
    for r, t in _tokens(nb):
        if int(nb["row_traj"][r]) in admit:
            mask[r, t] = True
            out[r, t] = _k3(lp[r, t], lt[r, t])
    return out, mask


def ucob(nb, lp, *, lp_stop=None, other="other_logprobs", gap="return_gap", gate="sigmoid",
         gate_beta=5.0):
    lp_stop = lp if lp_stop is None else lp_stop
    lb, d_all = _field(nb, other), _field(nb, gap)
    out = _zeros(nb)
    for r, t in _tokens(nb):
        d = _at(nb, d_all, r, t)
        if d > 0:
            hi, lo, lo_stop = lb[r, t], lp[r, t], lp_stop[r, t]
        else:
            hi, lo, lo_stop = lp_stop[r, t], lb[r, t], lb[r, t]
        g = _sigmoid(gate_beta * (hi - lo_stop)) if gate == "sigmoid" else 1.0
        out[r, t] = abs(d) * g * (hi - lo)
    return out, nb["action_mask"]


def icsd_weights(nb, lp_stop, *, advantage_field="advantages", teacher="teacher_logprobs",
                 behavior="old_logprobs", trust="sdar", gate_beta=5.0, w_min=0.5, eps=1e-8,
                 normalize_mass=True):
    lt, lo, adv = _field(nb, teacher), _field(nb, behavior), _field(nb, advantage_field)
    toks = list(_tokens(nb))
    turn = {}
    for r, t in toks:
        turn.setdefault((int(nb["row_traj"][r]), int(nb["turn_ids"][r, t])), []).append((r, t))
    g = {p: lt[p] - lp_stop[p] for p in toks}
    g_bar = {key: sum(g[p] for p in ps) / len(ps) for key, ps in turn.items()}
    u = {}
    for key, ps in turn.items():
        for p in ps:
            rho = math.exp(min(max(lp_stop[p] - lo[p], -20.0), 20.0))
            u[p] = rho * _at(nb, adv, *p) * (g[p] - g_bar[key])
    mean = sum(u.values()) / max(len(u), 1)
    std = math.sqrt(sum((x - mean) ** 2 for x in u.values()) / max(len(u), 1))
    w = {p: min(max(1.0 + math.tanh(u[p] / (std + eps)), w_min), 2.0) for p in toks}
    c = {p: _sigmoid(gate_beta * g[p]) if trust == "sdar" else 1.0 for p in toks}
    if normalize_mass:
        for ps in turn.values():
            sc = sum(c[p] for p in ps)
            swc = sum(w[p] * c[p] for p in ps)
            if swc > 0:
                for p in ps:
                    w[p] = w[p] * sc / swc
    wa, ca = _zeros(nb), _zeros(nb)
    for p in toks:
        wa[p], ca[p] = w[p], c[p]
    return wa, ca


def icsd(nb, lp, *, lp_stop=None, trust="sdar", teacher="teacher_logprobs",
         behavior="old_logprobs", **kw):
    lp_stop = lp if lp_stop is None else lp_stop
    w, c = icsd_weights(nb, lp_stop, trust=trust, teacher=teacher, behavior=behavior, **kw)
    if trust == "sdar":
        lt = _field(nb, teacher)
        base = _zeros(nb)
        for p in _tokens(nb):
            base[p] = lt[p] - lp[p]
    else:
        base, _ = sdl(nb, lp, teacher=teacher, behavior=behavior)
    return c * w * base, nb["action_mask"]


def craft_credit(nb, lp_stop, *, advantage_field="advantages", teacher="teacher_logprobs",
                 level="group", temperature=1.0, credit="sign"):
    lt, adv = _field(nb, teacher), _field(nb, advantage_field)
    members = {}  # member -> tokens
    for r, t in _tokens(nb):
        i = int(nb["row_traj"][r])
        key = i if level == "group" else (i, int(nb["turn_ids"][r, t]))
        members.setdefault(key, []).append((r, t))
    groups = {}
    for key, ps in members.items():
        i = key if level == "group" else key[0]
        gid = int(nb["group_ids"][i])
        anchor = gid if level == "group" else (gid, int(nb["state_keys"][i, key[1]]))
        groups.setdefault(anchor, []).append(key)
    cti = {}
    for keys in groups.values():
        delta = [sum(lt[p] - lp_stop[p] for p in members[k]) / temperature for k in keys]
        a = [sum(_at(nb, adv, *p) for p in members[k]) / len(members[k]) for k in keys]
        if len(keys) < 2:
            val = 0.0
        else:
            top = max(delta)
            w = [math.exp(x - top) for x in delta]
            val = sum(wi * ai for wi, ai in zip(w, a)) / sum(w) - sum(a) / len(a)
        for k in keys:
            cti[k] = val
    c = _zeros(nb)
    gmax = {}
    for r, t in _tokens(nb):
        i = int(nb["row_traj"][r])
        gmax[i] = max(gmax.get(i, 0.0), abs(lt[r, t] - lp_stop[r, t]))
    for key, ps in members.items():
        for r, t in ps:
            g = lt[r, t] - lp_stop[r, t]
            if credit == "sign":
                c[r, t] = cti[key] * float(np.sign(g))
            else:
                gm = gmax[int(nb["row_traj"][r])]
                c[r, t] = cti[key] * g / (gm if gm > 0 else 1.0)
    return c


def _forward_kl(lp, lt):
    d = min(max(lt - lp, -20.0), 20.0)
    r = math.exp(d)
    return min(r * d - (r - 1.0), 10.0)


def craft(nb, lp, *, lp_stop=None, teacher="teacher_logprobs", cti=True, controller=False,
          polarize=True, lambda_distill=1.0, advantage_field="advantages", level="group",
          temperature=1.0, credit="sign"):
    lp_stop = lp if lp_stop is None else lp_stop
    lt = _field(nb, teacher)
    if cti:
        c = craft_credit(nb, lp_stop, advantage_field=advantage_field, teacher=teacher,
                         level=level, temperature=temperature, credit=credit)
    else:
        c = _zeros(nb)
        for p in _tokens(nb):
            c[p] = float(np.sign(lt[p] - lp_stop[p]))
    out = _zeros(nb)
    for p in _tokens(nb):
        val = _forward_kl(lp[p], lt[p]) if polarize and c[p] < 0 else _k3(lp[p], lt[p])
        if cti:
            val *= abs(c[p])
        if controller:
            val *= lambda_distill
        out[p] = val
    return out, nb["action_mask"]


def treeopsd(nb, lp, *, lp_stop=None, credit="tree_credit", behavior="old_logprobs", beta=1.0,
             delta=1.0):
    c, lb = _field(nb, credit), _field(nb, behavior)
    out = _zeros(nb)
    for r, t in _tokens(nb):
        target = min(max(_at(nb, c, r, t) / beta, -delta), delta)
        out[r, t] = 0.5 * (lp[r, t] - lb[r, t] - target) ** 2
    return out, nb["action_mask"]


def t_reg(nb, lp, *, lp_stop=None, good="teacher_logprobs", bad="contrast_logprobs",
          reference="ref_logprobs", sign="outcome", temperature=1.0):
    lg, lbad, sgn = _field(nb, good), _field(nb, bad), _field(nb, sign)
    ref = None if reference is None else _field(nb, reference)
    per_traj = {}
    for r, t in _tokens(nb):
        per_traj.setdefault(int(nb["row_traj"][r]), []).append((r, t))
    out = _zeros(nb)
    for i, ps in per_traj.items():
        s = float(np.sign(_at(nb, sgn, *ps[0])))
        x = [s * (lg[p] - lbad[p]) / temperature for p in ps]
        top = max(x)
        e = [math.exp(v - top) for v in x]
        z = sum(e)
        for p, ei in zip(ps, e):
            w = len(ps) * ei / z
            out[p] = -s * w * (lp[p] - (0.0 if ref is None else ref[p]))
    return out, nb["action_mask"]


def weighted_sft(nb, lp, *, lp_stop=None, weights=None, mask=None):
    on = _mask_field(nb, mask)
    out = _zeros(nb)
    for r, t in _tokens(nb):
        w = 1.0 if weights is None else _at(nb, _field(nb, weights), r, t)
        out[r, t] = -w * lp[r, t]
    return out, on


LOSS_TOKENS = {
    "sdl": sdl, "sdar": sdar, "edge": edge, "ucob": ucob, "icsd": icsd, "craft": craft,
    "treeopsd": treeopsd, "t_reg": t_reg, "weighted_sft": weighted_sft,
}


def _pair(tokens_fn):
    def ref(nb, lp, *, agg="token_mean", agg_constant=None, **hp):
        per_token, mask = tokens_fn(nb, lp, **hp)
        return aggregate(per_token, mask, nb["row_traj"], agg, agg_constant)
    ref.__name__ = tokens_fn.__name__
    return ref


LOSS_REFERENCES = {name: _pair(fn) for name, fn in LOSS_TOKENS.items()}


def topk_kl_tokens(nb, student_topk, *, teacher="teacher_topk_logprobs"):
    """topk_kl per token: sum_k exp(lt_k) (lt_k - ls_k) over the teacher's top-K entries
    ``lt`` = extras[teacher] [R, T, K] and the student's ``ls`` [R, T, K] of the same ids, on
    the action tokens; a teacher entry of probability 0 (-inf) adds 0. Returns (per_token,
    action_mask)."""
    lt = np.asarray(nb["extras"][teacher], np.float64)
    ls = np.asarray(student_topk, np.float64)
    m = nb["action_mask"]
    out = np.zeros(m.shape)
    for r in range(m.shape[0]):
        for t in range(m.shape[1]):
            if not m[r, t]:
                continue
            total = 0.0
            for k in range(lt.shape[2]):
                if math.isfinite(lt[r, t, k]):
                    total += math.exp(lt[r, t, k]) * (lt[r, t, k] - ls[r, t, k])
            out[r, t] = total
    return out, m


def topk_kl(nb, lp, *, student_topk, agg="token_mean", agg_constant=None, **hp):
    """The (sum, denominator) of ``topk_kl``; ``lp`` (the sampled tokens') is not read."""
    per_token, mask = topk_kl_tokens(nb, student_topk, **hp)
    return aggregate(per_token, mask, nb["row_traj"], agg, agg_constant)


LOSS_REFERENCES["topk_kl"] = topk_kl


def token_gradient(name, nb, lp, *, h=1e-5, **hp):
    """d per_token / d lp by central differences in ``lp`` with ``lp_stop`` fixed: the
    gradient of the aggregated sum of the ``token_mean`` mode."""
    fn = LOSS_TOKENS[name]
    up, mask = fn(nb, lp + h, lp_stop=lp, **hp)
    down, _ = fn(nb, lp - h, lp_stop=lp, **hp)
    return np.where(mask, (up - down) / (2 * h), 0.0)
