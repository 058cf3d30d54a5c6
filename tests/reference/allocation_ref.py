"""Slow references for jaxrl_agent/estimators/allocation.py: the allocation primitive
(``reallocate``, ``shuffled_control``), the re-allocation and add-on transforms, the ADRS
shaping and the R3L estimator. Plain Python loops over records, turns and tokens in float64,
written from the docstring formulas; nothing here imports the library. Each reference is
named by its method's registry name and takes the same hyper-parameters.

Signatures (all return a ``RefOut`` of tests.reference.estimators_ref):

* transforms: ``fn(records, base, **hp)``; ``base[i][k][j]`` is the base advantage of record
  i, turn k, action token j (the advantages the transform receives, e.g. GRPO's read back
  from the batch). ``turn`` of the result is the token mean per turn.
* ``shuffled_control`` also needs ``traj_index`` (record -> packed trajectory index): the
  shuffle is keyed by global positions.
* ``adrs`` (shaping): ``fn(records, **hp)``; ``token`` holds what is added to
  ``extras['token_rewards']``,
  ``state`` a dict with ``outcome`` (per record) and ``turn_rewards`` (per record, per turn)
  after shaping.
* ``r3l`` (estimator): ``fn(records, **hp)``.

Record fields read here (``pack_records`` ignores unknown turn keys; tests place
``teacher_logprobs`` into ``extras`` themselves, since the packer reserves that name):
  turn["logprobs"]           old log-probs per action token
  turn["teacher_logprobs"]   teacher log-probs per action token
  turn["ref_logprobs"]       reference log-probs per action token
  turn["token_extras"][name] per-token extras (entropy, current log-probs, token weights)
  turn["turn_extras"][name]  per-turn extras (probe, turn weights)
  turn["state_key"]          equality key of the state (GiGPO anchors)
"""

from __future__ import annotations

import math
from collections import defaultdict


from tests.reference.estimators_ref import RefOut, _unflatten, f32

ATOL = 2e-4


# ----------------------------------------------------------------------------- parsing


class T:
    """One turn: per-token float lists by name, per-turn floats by name."""

    def __init__(self, t):
        n = len(t["action"])
        self.n = n
        self.tok = {"old_logprobs": [f32(x) for x in t.get("logprobs", [0.0] * n)]}
        for name in ("teacher_logprobs", "ref_logprobs"):
            if name in t:
                self.tok[name] = [f32(x) for x in t[name]]
        for name, v in t.get("token_extras", {}).items():
            self.tok[name] = [f32(x) for x in v]
        self.turn = {name: f32(v) for name, v in t.get("turn_extras", {}).items()}
        self.reward = f32(t.get("reward", 0.0))
        self.state = t.get("state_key", tuple(t.get("observation", [])))


def parse(records):
    out = []
    for r in records:
        turns = [T(t) for t in r["turns"]]
        if not any("reward" in t for t in r["turns"]):
            turns[-1].reward = f32(r["outcome"])
        out.append({"group": r["group"], "outcome": f32(r["outcome"]), "turns": turns})
    return out


def _gap(tr, teacher, student):
    return [[a - b for a, b in zip(t.tok[teacher], t.tok[student])] for t in tr["turns"]]


def _sign(x):
    return (x > 0) - (x < 0)


def _result(records, per_token, tol_scale=None):
    """RefOut from per record, per turn, per token values; turn = token mean per turn."""
    turn = [[sum(v) / len(v) for v in rec] for rec in per_token]
    tol = [ATOL * (1.0 + max(abs(x) for v in rec for x in v)) for rec in per_token]
    return RefOut(token=per_token, turn=turn, tol={"token": tol, "turn": tol})


def _flat(rec):
    return [x for v in rec for x in v]


# ----------------------------------------------------------------------------- the normaliser


def normalize(w, mu=None, floor=0.0, lo=None, hi=None):
    """Mean-1 weights of one segment: rescale, floor, then pin-and-rescale into [lo, hi]."""
    n = len(w)
    mu = [1.0] * n if mu is None else mu
    w = [max(x, 0.0) for x in w]
    total = sum(mu)
    mass = sum(m * x for m, x in zip(mu, w))
    if mass <= 0 or max(w) == min(w):
        out = [1.0] * n
    else:
        out = [x * total / mass for x in w]
    out = [floor + (1 - floor) * x for x in out]
    if lo is None and hi is None:
        return out
    lo = -math.inf if lo is None else lo
    hi = math.inf if hi is None else hi
    if all(lo <= x <= hi for x in out):
        return out

    def mass(c):
        return sum(m * min(max(c * x, lo), hi) for m, x in zip(mu, out))

    a, b = -60.0, 60.0  # F(c) is non-decreasing: bisection on log c
    for _ in range(200):
        mid = 0.5 * (a + b)
        a, b = (mid, b) if mass(math.exp(mid)) < total else (a, mid)
    c = math.exp(0.5 * (a + b))
    y = [min(max(c * x, lo), hi) for x in out]
    short = total - sum(m * x for m, x in zip(mu, y))
    zmu = sum(m for m, x in zip(mu, out) if x <= 0)
    if short > 1e-12 and zmu > 0:  # zero weights share what no scale can reach
        y = [min(max(v + short / zmu, lo), hi) if x <= 0 else v for v, x in zip(y, out)]
    return y


def _weights_per_token(tr, name):
    """A record's raw weights per turn per token (per-turn weights broadcast)."""
    if name in tr["turns"][0].turn:
        return [[t.turn[name]] * t.n for t in tr["turns"]]
    return [list(t.tok[name]) for t in tr["turns"]]


def _segments(trajs, level):
    """(record, turn, token) -> segment key."""
    def key(i, k):
        return {"trajectory": i, "turn": (i, k), "group": ("g", trajs[i]["group"])}[level]
    return key


def _apply(trajs, base, raw, level="trajectory", floor=0.0, lo=None, hi=None):
    """Normalise raw[i][k][j] per segment and multiply into base."""
    key = _segments(trajs, level)
    members = defaultdict(list)
    for i, tr in enumerate(trajs):
        for k, t in enumerate(tr["turns"]):
            for j in range(t.n):
                members[key(i, k)].append((i, k, j))
    w = {}
    for seg, idx in members.items():
        vals = normalize([raw[i][k][j] for i, k, j in idx], floor=floor, lo=lo, hi=hi)
        w.update(zip(idx, vals))
    return [[[base[i][k][j] * w[i, k, j] for j in range(t.n)] for k, t in enumerate(tr["turns"])]
            for i, tr in enumerate(trajs)], w


# ----------------------------------------------------------------------------- hashing (shuffle)

M32 = 0xFFFFFFFF


def fmix32(h):
    h &= M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def hash_combine(h, v):
    return fmix32((h * 0x9E3779B1 + fmix32(v + 0x7F4A7C15)) & M32)


def _shuffle(trajs, raw, traj_index, level, seed, per_turn):
    """Permutes raw weights within each trajectory (or turn) by hashed global keys."""
    out = [[list(v) for v in rec] for rec in raw]
    for i, tr in enumerate(trajs):
        n = traj_index[i]
        if per_turn:  # one value per turn: raw[i][k][0] stands for the turn
            if level == "turn":
                continue
            vals = [raw[i][k][0] for k in range(len(tr["turns"]))]
            keys = [hash_combine(hash_combine(seed, n), k) for k in range(len(vals))]
            order = sorted(range(len(vals)), key=lambda p: (keys[p], p))
            for slot, src in enumerate(order):
                out[i][slot] = [vals[src]] * tr["turns"][slot].n
            continue
        h0 = hash_combine((seed ^ 0x5BD1E995) & M32, n)
        segs = defaultdict(list)
        for k, t in enumerate(tr["turns"]):
            for j in range(t.n):
                segs[k if level == "turn" else 0].append((k, j))
        for idx in segs.values():
            keys = [hash_combine(hash_combine(h0, k), j) for k, j in idx]
            order = sorted(range(len(idx)), key=lambda p: (keys[p], p))
            for slot, src in zip(idx, order):
                k, j = idx[src]
                out[i][slot[0]][slot[1]] = raw[i][k][j]
    return out


# ----------------------------------------------------------------------------- primitive


def reallocate(records, base, *, weights="weights", level="trajectory", floor=0.0,
               clip_min=None, clip_max=None, shuffle=False, seed=0, traj_index=None):
    trajs = parse(records)
    raw = [_weights_per_token(tr, weights) for tr in trajs]
    if shuffle:
        raw = _shuffle(trajs, raw, traj_index, level, seed,
                       per_turn=weights in trajs[0]["turns"][0].turn)
    out, _ = _apply(trajs, base, raw, level, floor, clip_min, clip_max)
    return _result(records, out)


def shuffled_control(records, base, *, traj_index, **hp):
    return reallocate(records, base, shuffle=True, traj_index=traj_index, **hp)


# ----------------------------------------------------------------------------- transforms


def _turn_std(xs):
    n = len(xs)
    if n < 2:
        return 0.0
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))


def _turn_base(base):
    return [[sum(v) / len(v) for v in rec] for rec in base]


def trial(records, base, *, teacher="teacher_logprobs", student="old_logprobs", weight=0.1,
          shuffle=False, seed=0, traj_index=None):
    trajs = parse(records)
    gaps = [_gap(tr, teacher, student) for tr in trajs]
    mags = [[[sum(abs(x) for x in v) / len(v)] * len(v) for v in g] for g in gaps]
    if shuffle:
        mags = _shuffle(trajs, mags, traj_index, "trajectory", seed, per_turn=True)
    out = []
    for tr, b, g, toks in zip(trajs, base, gaps, mags):
        mu = _unflatten(normalize(_flat(toks)), g)
        out.append([[a + weight * w * x for a, w, x in zip(bv, wv, gv)]
                    for bv, wv, gv in zip(b, mu, g)])
    return _result(records, out)


def _signed_turn(trajs, base, scores, alpha, w_min, w_max, eps, mode, shuffle=None):
    tb = _turn_base(base)
    out = []
    raw = []
    for tr, b, s, a_t in zip(trajs, base, scores, tb):
        sd = _turn_std(s)
        z = [x / (sd + eps) for x in s]
        if mode == "additive":
            out.append([[a + alpha * zk for a in bv] for bv, zk in zip(b, z)])
        else:
            w = [min(max(1 + alpha * _sign(ak) * zk, w_min), w_max) for ak, zk in zip(a_t, z)]
            raw.append([[wk] * t.n for wk, t in zip(w, tr["turns"])])
    if mode == "additive":
        return out
    if shuffle is not None:  # (seed, traj_index)
        raw = _shuffle(trajs, raw, shuffle[1], "trajectory", shuffle[0], per_turn=True)
    return _apply(trajs, base, raw, "trajectory", 0.0, w_min, w_max)[0]


def stepopsd(records, base, *, teacher="teacher_logprobs", student="old_logprobs",
             lambda_mix=0.5, alpha_clip=0.5, eps=1e-6, token_dist=False, shuffle=False, seed=0):
    assert not shuffle
    trajs = parse(records)
    gaps = [_gap(tr, teacher, student) for tr in trajs]
    s = [[sum(v) / len(v) for v in g] for g in gaps]
    out = _signed_turn(trajs, base, s, lambda_mix, 1 - alpha_clip, 1 + alpha_clip, eps,
                       "reweight")
    if token_dist:
        new = []
        for o, b, g in zip(out, base, gaps):
            rec = []
            for ov, bv, gv in zip(o, b, g):
                sp = [math.log1p(math.exp(_sign(a) * x)) for a, x in zip(bv, gv)]
                rec.append([x * w for x, w in zip(ov, normalize(sp))])
            new.append(rec)
        out = new
    return _result(records, out)


def cort(records, base, *, teacher="teacher_logprobs", student="old_logprobs", kappa=0.5,
         tau=1.0, w_min=0.2, w_max=2.0, absolute=False, shuffle=False, seed=0, traj_index=None):
    trajs = parse(records)
    raw = []
    for tr in trajs:
        g = _gap(tr, teacher, student)
        raw.append([[min(max(1 + kappa * math.tanh((abs(x) if absolute else x) / tau), w_min),
                         w_max) for x in v] for v in g])
    if shuffle:
        raw = _shuffle(trajs, raw, traj_index, "trajectory", seed, per_turn=False)
    return _result(records, _apply(trajs, base, raw, "trajectory", 0.0, w_min, w_max)[0])


def _median(xs):
    s = sorted(xs)
    n = len(s)
    return 0.5 * (s[(n - 1) // 2] + s[n // 2])


def rvco(records, base, *, teacher="teacher_logprobs", student="old_logprobs", tau=1.0,
         beta=0.1, absolute=True, eps=1e-6, shuffle=False, seed=0):
    assert not shuffle
    trajs = parse(records)
    out = []
    for tr, b in zip(trajs, base):
        g = _gap(tr, teacher, student)
        e = [abs(x) if absolute else x for x in _flat(g)]
        med = _median(e)
        mad = _median([abs(x - med) for x in e])
        z = [(x - med) / (mad + eps) / tau for x in e]
        top = max(z)
        p = [math.exp(x - top) for x in z]
        n = len(p)
        w = [(1 - beta) * n * x / sum(p) + beta for x in p]
        out.append([[a * x for a, x in zip(bv, wv)] for bv, wv in zip(b, _unflatten(w, g))])
    return _result(records, out)


def _sigmoid(x):
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def belief(e, l0, rho):
    """(beliefs l_1..l_K, revisions Delta_1..Delta_K)."""
    ls, ds, prev = [], [], l0
    for x in e:
        cur = l0 + rho * (prev - l0) + x
        ls.append(cur)
        ds.append(_sigmoid(cur) - _sigmoid(prev))
        prev = cur
    return ls, ds


def agentopsd(records, base, *, teacher="teacher_logprobs", student="old_logprobs", p0=0.5,
              rho=1.0, alpha=0.5, w_min=0.2, w_max=3.0, eps=1e-6, mode="reweight",
              shuffle=False, seed=0):
    assert not shuffle
    trajs = parse(records)
    groups = defaultdict(list)
    for tr in trajs:
        groups[tr["group"]].append(min(max(tr["outcome"], 0.0), 1.0))
    deltas = []
    for tr in trajs:
        p = p0 if p0 is not None else min(max(sum(groups[tr["group"]]) / len(groups[tr["group"]]),
                                              1e-3), 1 - 1e-3)
        e = [sum(v) for v in _gap(tr, teacher, student)]
        deltas.append(belief(e, math.log(p) - math.log1p(-p), rho)[1])
    if mode == "additive":
        out = [[[a + alpha * d for a in bv] for bv, d in zip(b, ds)] for b, ds in zip(base, deltas)]
    else:
        out = _signed_turn(trajs, base, deltas, alpha, w_min, w_max, eps, mode)
    return _result(records, out)


def pbsd(records, base, *, teacher="teacher_logprobs", student="old_logprobs", alpha=0.5,
         w_min=0.2, w_max=3.0, eps=1e-6, mode="reweight", shuffle=False, seed=0,
         traj_index=None):
    trajs = parse(records)
    s = [[sum(v) for v in _gap(tr, teacher, student)] for tr in trajs]
    return _result(records, _signed_turn(trajs, base, s, alpha, w_min, w_max, eps, mode,
                                         (seed, traj_index) if shuffle else None))


def dcsd(records, base, *, teacher="teacher_logprobs", student="old_logprobs", probe="probe",
         q_init=0.5, weight=0.1, temperature=1.0):
    trajs = parse(records)
    out = []
    for tr, b in zip(trajs, base):
        g = _gap(tr, teacher, student)
        q = [t.turn[probe] for t in tr["turns"]]
        d = [_sign(x - y) for x, y in zip(q, [f32(q_init)] + q[:-1])]
        mag = [abs(sum(v)) for v in g]
        mean = sum(mag) / len(mag)
        mag = [m / mean if mean > 0 else 0.0 for m in mag]
        rec = []
        for bv, gv, dk, mk in zip(b, g, d, mag):
            a = [abs(x) / temperature for x in gv]
            ex = [math.exp(x - max(a)) for x in a]
            w = [len(ex) * x / sum(ex) for x in ex]
            rec.append([av + weight * dk * mk * wv for av, wv in zip(bv, w)])
        out.append(rec)
    return _result(records, out)


def verpo(records, base, *, teacher="teacher_logprobs", student="old_logprobs", eta=0.1,
          shrink=1.0):
    trajs = parse(records)
    out = []
    for tr, b in zip(trajs, base):
        g = _gap(tr, teacher, student)
        out.append([[a + eta * _sign(a) * abs(c) / (1 + shrink * c * c) if c * a > 0 else a
                     for a, c in zip(bv, gv)] for bv, gv in zip(b, g)])
    return _result(records, out)


def taco(records, base, *, logprobs="old_logprobs", entropy="entropy", alpha=0.01, damping=0.9):
    trajs = parse(records)
    out = []
    for tr, b in zip(trajs, base):
        rec = []
        for t, bv in zip(tr["turns"], b):
            row = []
            for a, lp, h in zip(bv, t.tok[logprobs], t.tok[entropy]):
                risk = -lp - h + math.log(f32(alpha))
                w = 1 - damping * (1 - math.exp(-risk)) if risk > 0 else 1.0
                row.append(w * a if a > 0 else a)
            rec.append(row)
        out.append(rec)
    return _result(records, out)


def eapo(records, base, *, entropy="entropy", a=1.0, shuffle=False, seed=0, traj_index=None):
    trajs = parse(records)
    raw = []
    for tr, b in zip(trajs, base):
        h = [x for t in tr["turns"] for x in t.tok[entropy]]
        lo, hi = min(h), max(h)
        hn = [(x - lo) / (hi - lo) if hi > lo else 0.0 for x in h]
        bf = _flat(b)
        raw.append(_unflatten([1 + a * x if av > 0 else 1 + a * (1 - x)
                               for x, av in zip(hn, bf)], b))
    if shuffle:
        raw = _shuffle(trajs, raw, traj_index, "trajectory", seed, per_turn=False)
    return _result(records, _apply(trajs, base, raw)[0])


def fipo(records, base, *, current="old_logprobs", gamma=0.99, alpha=0.5, clip=1.0, kl="k1",
         eps=1e-8):
    trajs = parse(records)
    fs = []
    for tr in trajs:
        d = [c - o for t in tr["turns"] for c, o in zip(t.tok[current], t.tok["old_logprobs"])]
        x = d if kl == "k1" else [math.expm1(-r) + r for r in d]
        f = []
        for i in range(len(x)):
            f.append(sum(gamma ** (j - i) * x[j] for j in range(i + 1, len(x))))
        fs.append(f)
    allf = [v for f in fs for v in f]
    m = sum(allf) / len(allf)
    s = math.sqrt(sum((v - m) ** 2 for v in allf) / len(allf))
    out = []
    for f, b in zip(fs, base):
        w = [1 + alpha * min(max(v / (s + eps), -clip), clip) for v in f]
        out.append([[a * x for a, x in zip(bv, wv)] for bv, wv in zip(b, _unflatten(w, b))])
    return _result(records, out)


def craft_cti(records, base, *, teacher="teacher_logprobs", student="old_logprobs",
              temperature=1.0, weight=0.1, anchor="state", scale="sign"):
    trajs = parse(records)
    tb = _turn_base(base)
    gaps = [_gap(tr, teacher, student) for tr in trajs]
    groups = defaultdict(list)
    for i, tr in enumerate(trajs):
        for k, t in enumerate(tr["turns"]):
            key = (tr["group"], t.state if anchor == "state" else k)
            groups[key].append((sum(gaps[i][k]) / temperature, tb[i][k]))
    out = []
    for i, tr in enumerate(trajs):
        rec = []
        for k, t in enumerate(tr["turns"]):
            mem = groups[(tr["group"], t.state if anchor == "state" else k)]
            top = max(d for d, _ in mem)
            w = [math.exp(d - top) for d, _ in mem]
            cti = (sum(x * a for x, (_, a) in zip(w, mem)) / sum(w)
                   - sum(a for _, a in mem) / len(mem))
            g = gaps[i][k]
            gmax = max(abs(x) for x in g)
            unit = ([_sign(x) for x in g] if scale == "sign"
                    else [x / gmax if gmax > 0 else 0.0 for x in g])
            rec.append([a + weight * cti * u for a, u in zip(base[i][k], unit)])
        out.append(rec)
    return _result(records, out)


# ----------------------------------------------------------------------------- ADRS (shaping)


def _std1(xs):
    n = len(xs)
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))


def _tva(members):
    """members: list of (alpha, reward) -> TVA (0 below 2 members)."""
    if len(members) < 2:
        return 0.0
    sa = sum(a for a, _ in members)
    sb = sum(1 - a for a, _ in members)
    return (sum(a * r for a, r in members) / (sa + 1e-8)
            - sum((1 - a) * r for a, r in members) / (sb + 1e-8))


def adrs(records, *, teacher="teacher_logprobs", tva="step", eta=0.1, temperature=1.0, tau=2.0,
         baseline="step", normalization="global", gate_normalize=False, gamma=1.0, ref="ref_logprobs",
         target="token", update_outcome=True, gate_field=None):
    trajs = parse(records)
    lp = [[list(t.tok[teacher]) for t in tr["turns"]] for tr in trajs]
    all_lp = [x for rec in lp for v in rec for x in v]
    if baseline == "step":
        u = [[[x - sum(v) / len(v) for x in v] for v in rec] for rec in lp]
    else:
        gm = sum(all_lp) / len(all_lp)
        u = [[[x - gm for x in v] for v in rec] for rec in lp]
    if normalization == "global":
        flat = [x for rec in u for v in rec for x in v]
        s = _std1(flat) + 1e-8 if len(flat) > 1 else 1.0
        u = [[[x / s for x in v] for v in rec] for rec in u]
    elif normalization == "per_seq":
        new = []
        for rec in u:
            f = _flat(rec)
            m = sum(f) / len(f)
            s = math.sqrt(sum((x - m) ** 2 for x in f) / len(f)) + 1e-8
            new.append([[x / s for x in v] for v in rec])
        u = new

    def gnorm(vals):
        if not gate_normalize or len(vals) < 2:
            return vals
        s = _std1(vals)
        return [v / (s + 1e-8) for v in vals] if s > 1e-8 else vals

    if tva == "none":
        gate = [[[0.5] * len(v) for v in rec] for rec in u]
    elif tva == "pas":
        d = [[[a - b for a, b in zip(t.tok[teacher], t.tok[ref])] for t in tr["turns"]]
             for tr in trajs]
        flat = [x for rec in d for v in rec for x in v]
        s = _std1(flat) + 1e-8 if len(flat) > 1 else 1.0
        gate = [[[_sigmoid(tau * x / s) for x in v] for v in rec] for rec in d]
    elif tva == "completion":
        comp = [sum(_flat(rec)) / (len(_flat(rec)) + 1e-8) for rec in lp]
        gm = sum(comp) / len(comp)
        rew = [sum(t.reward for t in tr["turns"]) for tr in trajs]
        al = [_sigmoid((c - gm) / (temperature + 1e-8)) for c in comp]
        groups = defaultdict(list)
        for i, tr in enumerate(trajs):
            groups[tr["group"]].append((al[i], rew[i]))
        t_vals = gnorm([_tva(groups[tr["group"]]) for tr in trajs])
        gate = [[[_sigmoid(tau * tv)] * len(v) for v in rec] for tv, rec in zip(t_vals, u)]
    else:
        gm = sum(all_lp) / (len(all_lp) + 1e-8)
        groups = defaultdict(list)
        info = []
        for i, tr in enumerate(trajs):
            rtg, acc = [], 0.0
            for t in reversed(tr["turns"]):
                acc = t.reward + gamma * acc
                rtg.append(acc)
            rtg.reverse()
            for k, t in enumerate(tr["turns"]):
                a = _sigmoid((sum(lp[i][k]) / (len(lp[i][k]) + 1e-8) - gm) / (temperature + 1e-8))
                key = (tr["group"], t.state)
                groups[key].append((a, rtg[k]))
                info.append((i, k, key))
        t_vals = gnorm([_tva(groups[key]) for _, _, key in info])
        gate = [[None] * len(tr["turns"]) for tr in trajs]
        for (i, k, _), tv in zip(info, t_vals):
            gate[i][k] = [_sigmoid(tau * tv)] * len(u[i][k])
    if tva == "none":
        shaped = [[[eta * x for x in v] for v in rec] for rec in u]
    else:
        shaped = [[[eta * g * x for g, x in zip(gv, v)] for gv, v in zip(grec, rec)]
                  for grec, rec in zip(gate, u)]
    outcome = [tr["outcome"] + (sum(_flat(s)) if update_outcome else 0.0)
               for tr, s in zip(trajs, shaped)]
    turn_rewards = [[t.reward + (sum(v) if target == "turn" else 0.0)
                     for t, v in zip(tr["turns"], s)] for tr, s in zip(trajs, shaped)]
    tol = [ATOL * (1.0 + max(abs(x) for x in _flat(s))) for s in shaped]
    if target == "turn":  # nothing is added to extras['token_rewards']
        shaped = [[[0.0] * len(v) for v in s] for s in shaped]
    return RefOut(token=shaped, turn=None, tol={"token": tol},
                  state={"outcome": outcome, "turn_rewards": turn_rewards, "gate": gate})


# ----------------------------------------------------------------------------- R3L (estimator)


def r3l(records, *, alpha=3.0, baseline="mean", tau=1.0, r_max=1.0, normalize=False,
        score="outcome"):
    assert score == "outcome"
    trajs = parse(records)
    groups = defaultdict(list)
    for tr in trajs:
        groups[tr["group"]].append(tr["outcome"])
    vals = []
    for tr in trajs:
        rs = groups[tr["group"]]
        if len(rs) == 1:
            b = 0.0
        elif baseline == "mean":
            b = sum(rs) / len(rs)
        else:
            top = max(r / tau for r in rs)
            b = tau * (top + math.log(sum(math.exp(r / tau - top) for r in rs)) - math.log(len(rs)))
        r = tr["outcome"]
        s = r - b
        if r_max is not None and r >= r_max:
            s = 1.0
        elif s >= 0:
            s = alpha * s
        if normalize:
            s /= len(tr["turns"])
        vals.append(s)
    per_token = [[[v] * t.n for t in tr["turns"]] for v, tr in zip(vals, trajs)]
    return _result(records, per_token)


REFERENCES = {
    "reallocate": reallocate, "shuffled_control": shuffled_control, "trial": trial,
    "stepopsd": stepopsd, "cort": cort, "rvco": rvco, "agentopsd": agentopsd, "pbsd": pbsd,
    "dcsd": dcsd, "verpo": verpo, "taco": taco, "eapo": eapo, "fipo": fipo,
    "craft_cti": craft_cti, "adrs": adrs, "r3l": r3l,
}
