"""Slow reference estimators, written straight from the docstring formulas.

Independent oracle: plain Python loops over trajectories, turns and tokens in float64, from
the rollout *records* (the JSONL format of ``rollout.records.pack_records``) or from a host numpy copy
of a batch (``records_from_batch``). Nothing here imports ``jaxrl_agent.estimators`` or
``jaxrl_agent.segments``; the only link to the library is ``place``, which writes per-record
results into the batch's [N, K] / [R, T] positions using a ``RecordIndex`` (``traj``, ``spans``).

Inputs are rounded to float32 on the way in (the batch stores float32), then every formula is
evaluated in float64. Every reference returns a ``RefOut`` with per-record results and a
per-record absolute tolerance ``tol`` that models the float32 forward error of the library:
for standardised outputs it grows like float32 precision times the input scale divided by the
denominator, so ill-conditioned cases (nearly-equal values, tiny eps) are compared fairly and
well-conditioned ones tightly.

Record extensions understood here (``pack_records`` ignores unknown turn keys):
  turn["token_rewards"]: [float] per action token, the dense ``extras['token_rewards']``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

U32 = 2.0 ** -24  # float32 unit round-off
BASE_ATOL = 1e-5
BASE_RTOL = 1e-5
WHITEN_C = 8.0  # safety factor on the sqrt(n) * u * scale error of float32 sums


def f32(x) -> float:
    return float(np.float32(x))


# ----------------------------------------------------------------------------- parsing


@dataclasses.dataclass
class Turn:
    action: list
    reward: float
    value: float | None
    values: list | None
    logprobs: list | None
    ref_logprobs: list | None
    token_rewards: list | None


@dataclasses.dataclass
class Traj:
    group: Any
    task: Any
    outcome: float
    turns: list

    @property
    def num_tokens(self) -> int:
        return sum(len(t.action) for t in self.turns)


def _floats(v):
    return None if v is None else [f32(x) for x in v]


def record_rewards(rec) -> tuple[list, float]:
    """A record's turn rewards and outcome, applying the documented record defaults
    independently: no turn reward at all -> the outcome is the last turn's reward; no outcome
    -> the sum of the turn rewards."""
    turns_in = rec["turns"]
    rewards = [float(t.get("reward", 0.0)) for t in turns_in]
    outcome = float(rec["outcome"]) if "outcome" in rec else sum(rewards)
    if not any("reward" in t for t in turns_in):
        rewards[-1] = outcome
    return rewards, outcome


def parse(records) -> list[Traj]:
    """Records -> trajectories, applying the record defaults (``record_rewards``; task
    defaults to the group)."""
    out = []
    for rec in records:
        turns_in = rec["turns"]
        rewards, outcome = record_rewards(rec)
        turns = [Turn(action=list(t["action"]), reward=f32(r),
                      value=None if "value" not in t else f32(t["value"]),
                      values=_floats(t.get("values")), logprobs=_floats(t.get("logprobs")),
                      ref_logprobs=_floats(t.get("ref_logprobs")),
                      token_rewards=_floats(t.get("token_rewards")))
                 for t, r in zip(turns_in, rewards)]
        out.append(Traj(rec["group"], rec.get("task", rec["group"]), f32(outcome), turns))
    return out


def task_index_of(records) -> dict:
    """Task label -> dense id in first-seen record order (the packing convention)."""
    idx: dict = {}
    for t in parse(records):
        idx.setdefault(t.task, len(idx))
    return idx


# ----------------------------------------------------------------------------- results


@dataclasses.dataclass
class RefOut:
    """Per-record reference results. ``turn``/``turn_returns``: one list of K_i floats per
    record; ``token``/``token_returns``: per record, per turn, one float per action token.
    ``tol``: per record absolute tolerance (float) per field name. ``state``: new SPO state."""

    token: list
    turn: list | None = None
    token_returns: list | None = None
    turn_returns: list | None = None
    tol: dict = dataclasses.field(default_factory=dict)
    state: Any = None


def _bcast_turns(trajs, per_turn):
    return [[[v] * len(t.action) for v, t in zip(vals, tr.turns)]
            for tr, vals in zip(trajs, per_turn)]


def _traj_out(trajs, a, tol):
    """A per-trajectory scalar broadcast to all turns and action tokens."""
    turn = [[x] * len(tr.turns) for x, tr in zip(a, trajs)]
    token = [[[x] * len(t.action) for t in tr.turns] for x, tr in zip(a, trajs)]
    return RefOut(token=token, turn=turn, tol={"token": tol, "turn": tol})


def _plain_tol(values_per_record):
    """atol + rtol * |x| for unnormalised quantities (per record, its largest entry)."""
    return [BASE_ATOL + BASE_RTOL * max([abs(x) for x in vals] + [0.0])
            for vals in values_per_record]


def _std_tol(scale, denom, n, ref_mag):
    """Tolerance of (x - mean) / denom computed in float32 from inputs of magnitude ``scale``."""
    return (BASE_ATOL + BASE_RTOL * abs(ref_mag)
            + WHITEN_C * max(n, 1) ** 0.5 * U32 * scale / max(denom, 1e-300))


def place(out: RefOut, index, shapes) -> dict:
    """Writes per-record results into zero arrays of the batch's shapes.

    Args:
      out: a RefOut.
      index: RecordIndex-like with ``traj`` (record -> trajectory) and ``spans`` (record ->
        per turn (row, start, stop)).
      shapes: dict with N, K, R, T.

    Returns:
      dict field -> (values, tol) numpy arrays; tol is 0 off the real entries (exact zeros).
    """
    N, K, R, T = shapes["N"], shapes["K"], shapes["R"], shapes["T"]
    res = {}
    for fields, shape, cells in ((("turn", "turn_returns"), (N, K), _turn_cells),
                                 (("token", "token_returns"), (R, T), _token_cells)):
        for field in fields:
            vals = getattr(out, field)
            if vals is None:
                res[field] = None
                continue
            x, tol = np.zeros(shape), np.zeros(shape)
            for i, v in enumerate(vals):
                for at, piece in cells(index, i, v):
                    x[at] = piece
                    tol[at] = out.tol[field][i]
            res[field] = (x, tol)
    return res


def _turn_cells(index, i, per_turn):
    """(position, values) of record i's per-turn values: its trajectory's first turns."""
    return [((index.traj[i], slice(0, len(per_turn))), per_turn)]


def _token_cells(index, i, per_turn):
    """(position, values) of record i's per-token values: one (row, start:stop) span a turn."""
    cells = []
    for (row, start, stop), v in zip(index.spans[i], per_turn):
        assert len(v) == stop - start
        cells.append(((row, slice(start, stop)), v))
    return cells


# ----------------------------------------------------------------------------- group helpers


def _groups(trajs):
    g: dict = {}
    for i, t in enumerate(trajs):
        g.setdefault(t.group, []).append(i)
    return g


def _mean(xs):
    return sum(xs) / len(xs)


# ----------------------------------------------------------------------------- outcome baselines


def grpo(records, *, eps=1e-6, ddof=1, singleton="zero") -> RefOut:
    """a_i = (R_i - mean_g R) / (std_g R + eps), std with ddof; singleton 0 or R."""
    trajs = parse(records)
    a, tol = [0.0] * len(trajs), [0.0] * len(trajs)
    for members in _groups(trajs).values():
        rs = [trajs[i].outcome for i in members]
        n = len(rs)
        for i in members:
            if n == 1:
                a[i] = trajs[i].outcome if singleton == "raw" else 0.0
                tol[i] = BASE_ATOL + BASE_RTOL * abs(a[i])
                continue
            assert n - ddof >= 1, "ddof too large for this group"
            mean = _mean(rs)
            std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (n - ddof))
            a[i] = (trajs[i].outcome - mean) / (std + eps)
            tol[i] = _std_tol(max(abs(r) for r in rs), std + eps, n, a[i])
    return _traj_out(trajs, a, tol)


def dr_grpo(records, *, singleton="zero") -> RefOut:
    """a_i = R_i - mean_g R; singleton 0 or R."""
    trajs = parse(records)
    a = [0.0] * len(trajs)
    for members in _groups(trajs).values():
        rs = [trajs[i].outcome for i in members]
        for i in members:
            if len(rs) == 1:
                a[i] = trajs[i].outcome if singleton == "raw" else 0.0
            else:
                a[i] = trajs[i].outcome - _mean(rs)
    return _traj_out(trajs, a, _plain_tol([[x] for x in a]))


def rloo(records, *, singleton="zero") -> RefOut:
    """a_i = R_i - mean_{j in g, j != i} R_j (the leave-one-out form); singleton 0 or R."""
    trajs = parse(records)
    a = [0.0] * len(trajs)
    for members in _groups(trajs).values():
        for i in members:
            others = [trajs[j].outcome for j in members if j != i]
            if not others:
                a[i] = trajs[i].outcome if singleton == "raw" else 0.0
            else:
                a[i] = trajs[i].outcome - _mean(others)
    return _traj_out(trajs, a, _plain_tol([[x] for x in a]))


def _token_reward_stream(tr: Traj, kl_coef=0.0):
    """Per turn, per action token: the turn reward on the turn's last action token, plus the
    dense token reward, minus kl_coef * (old_logprob - ref_logprob)."""
    out = []
    for t in tr.turns:
        n = len(t.action)
        r = [0.0] * n
        r[-1] += t.reward
        if t.token_rewards is not None:
            r = [x + y for x, y in zip(r, t.token_rewards)]
        if kl_coef:
            r = [x - kl_coef * (lp - ref) for x, lp, ref in zip(r, t.logprobs, t.ref_logprobs)]
        out.append(r)
    return out


def _reward_to_go(stream, gamma):
    """G_t = r_t + gamma G_{t+1} along the flattened per-turn token lists (0 past the end)."""
    flat = [x for turn in stream for x in turn]
    g, acc = [0.0] * len(flat), 0.0
    for t in reversed(range(len(flat))):
        acc = flat[t] + gamma * acc
        g[t] = acc
    return _unflatten(g, stream)


def _unflatten(flat, like):
    out, p = [], 0
    for turn in like:
        out.append(flat[p:p + len(turn)])
        p += len(turn)
    return out


def _whiten_tokens(per_record, eps, scale):
    """Token-weighted (x - mean) / sqrt(var + eps) over every token of every record
    (population variance). Returns (whitened, tol per record)."""
    flat = [x for rec in per_record for turn in rec for x in turn]
    n = len(flat)
    mean = sum(flat) / n
    var = sum((x - mean) ** 2 for x in flat) / n
    denom = math.sqrt(var + eps)
    out = [[[(x - mean) / denom for x in turn] for turn in rec] for rec in per_record]
    tol = [_std_tol(scale, denom, n, max([abs(x) for turn in rec for x in turn] + [0.0]))
           for rec in out]
    return out, tol


def reinforce_pp(records, *, gamma=1.0, kl_coef=0.0, eps=1e-8) -> RefOut:
    """Token reward-to-go over each trajectory's action tokens (observations skipped), then
    token-weighted whitening over the whole batch."""
    trajs = parse(records)
    streams = [_token_reward_stream(tr, kl_coef) for tr in trajs]
    g = [_reward_to_go(s, gamma) for s in streams]
    scale = max(sum(abs(x) for turn in s for x in turn) for s in streams) + 1.0
    token, tol = _whiten_tokens(g, eps, scale)
    return RefOut(token=token, tol={"token": tol})


def reinforce_pp_baseline(records, *, eps=1e-8) -> RefOut:
    """a_i = R_i - mean_g R; A_i = (a_i - mu) / sqrt(var + eps), mu and (population) var
    weighted by each trajectory's number of action tokens."""
    trajs = parse(records)
    a = [0.0] * len(trajs)
    for members in _groups(trajs).values():
        mean = _mean([trajs[i].outcome for i in members])
        for i in members:
            a[i] = trajs[i].outcome - mean
    return _token_weighted_traj(trajs, a, eps, max(abs(t.outcome) for t in trajs) + 1.0)


def _token_weighted_traj(trajs, a, eps, scale):
    w = [tr.num_tokens for tr in trajs]
    tot = sum(w)
    mu = sum(wi * ai for wi, ai in zip(w, a)) / tot
    var = sum(wi * (ai - mu) ** 2 for wi, ai in zip(w, a)) / tot
    denom = math.sqrt(var + eps)
    out = [(ai - mu) / denom for ai in a]
    tol = [_std_tol(scale, denom, tot, x) for x in out]
    return _traj_out(trajs, out, tol)


# ----------------------------------------------------------------------------- SPO / SPO++


def _spo_common(records, state, rho, task_index):
    trajs = parse(records)
    task_index = task_index_of(records) if task_index is None else task_index
    alpha = [f32(x) for x in np.asarray(state[0]).tolist()]
    beta = [f32(x) for x in np.asarray(state[1]).tolist()]
    tasks = [task_index[tr.task] for tr in trajs]
    p_hat = [alpha[k] / (alpha[k] + beta[k]) for k in tasks]
    a = [tr.outcome - p for tr, p in zip(trajs, p_hat)]
    new_a, new_b = list(alpha), list(beta)
    for k in sorted(set(tasks)):  # one decay per task present in the batch
        rs = [min(max(tr.outcome, 0.0), 1.0) for tr, kk in zip(trajs, tasks) if kk == k]
        new_a[k] = rho * alpha[k] + sum(rs)
        new_b[k] = rho * beta[k] + sum(1.0 - r for r in rs)
    return trajs, a, (np.array(new_a), np.array(new_b))


def spo(records, *, state, rho=0.96, eps=1e-8, task_index=None) -> RefOut:
    """p_hat = alpha / (alpha + beta) (before the update); a_i = R_i - p_hat;
    A_i = (a_i - mean_B a) / (std_B a + eps), unbiased std; one trajectory gives 0.
    ``state``: (alpha[P], beta[P]). Update: alpha <- rho alpha + sum clip(R, 0, 1),
    beta <- rho beta + sum (1 - clip(R, 0, 1)) over the batch's members of each task."""
    trajs, a, new = _spo_common(records, state, rho, task_index)
    n = len(a)
    mean = _mean(a)
    if n == 1:
        out, tol = [0.0], [BASE_ATOL]
    else:
        std = math.sqrt(sum((x - mean) ** 2 for x in a) / (n - 1))
        out = [(x - mean) / (std + eps) for x in a]
        scale = max(abs(tr.outcome) for tr in trajs) + 1.0
        tol = [_std_tol(scale, std + eps, n, x) for x in out]
    res = _traj_out(trajs, out, tol)
    res.state = new
    return res


def spo_pp(records, *, state, rho=0.96, eps=1e-8, task_index=None) -> RefOut:
    """SPO++: the tracker residuals a_i standardised under the action-token measure:
    w_i = n_i / sum n; mu = sum w a; var = sum w (a - mu)^2; A = (a - mu) / sqrt(var + eps)."""
    trajs, a, new = _spo_common(records, state, rho, task_index)
    res = _token_weighted_traj(trajs, a, eps, max(abs(tr.outcome) for tr in trajs) + 1.0)
    res.state = new
    return res


# ----------------------------------------------------------------------------- rollout level


def rollout_level(records, *, layout, eps=1e-6, ddof=1, normalize=True, row_weighted=False,
                  singleton="zero") -> RefOut:
    """One group-normalised advantage per rollout. row_weighted: frequency weights
    w_i = number of rows of trajectory i (1 in the concatenated layout, its number of turns in
    the per-step layout); mean = sum w R / sum w, var = sum w (R - mean)^2 / (sum w - ddof).
    Singleton (one trajectory in the group): 0 or R."""
    trajs = parse(records)
    w = [1.0 if (not row_weighted or layout == "concatenated") else float(len(tr.turns))
         for tr in trajs]
    a, tol = [0.0] * len(trajs), [0.0] * len(trajs)
    for members in _groups(trajs).values():
        rs = [trajs[i].outcome for i in members]
        ws = [w[i] for i in members]
        for i in members:
            if len(members) == 1:
                a[i] = trajs[i].outcome if singleton == "raw" else 0.0
                tol[i] = BASE_ATOL + BASE_RTOL * abs(a[i])
                continue
            mean = sum(wi * r for wi, r in zip(ws, rs)) / sum(ws)
            a[i] = trajs[i].outcome - mean
            if normalize:
                assert sum(ws) - ddof > 0
                std = math.sqrt(sum(wi * (r - mean) ** 2 for wi, r in zip(ws, rs))
                                / (sum(ws) - ddof))
                a[i] /= std + eps
                tol[i] = _std_tol(max(abs(r) for r in rs), std + eps, sum(ws), a[i])
            else:
                tol[i] = BASE_ATOL + BASE_RTOL * abs(a[i])
    return _traj_out(trajs, a, tol)


# ----------------------------------------------------------------------------- returns and critics


def returns(records, *, gamma=1.0) -> RefOut:
    """G_k = r_k + gamma G_{k+1} over turns (0 past the last turn)."""
    trajs = parse(records)
    g = []
    for tr in trajs:
        acc, out = 0.0, [0.0] * len(tr.turns)
        for k in reversed(range(len(tr.turns))):
            acc = tr.turns[k].reward + gamma * acc
            out[k] = acc
        g.append(out)
    tol = _plain_tol(g)
    return RefOut(token=_bcast_turns(trajs, g), turn=g, turn_returns=g,
                  tol={"token": tol, "turn": tol, "turn_returns": tol})


def _token_value_stream(tr: Traj):
    """Per-token values: the turn's per-token ``values`` if present, else its ``value`` on
    every token of the turn."""
    out = []
    for t in tr.turns:
        if t.values is not None:
            out.append(list(t.values))
        else:
            assert t.value is not None, "gae reference needs values"
            out.append([t.value] * len(t.action))
    return out


def gae(records, *, gamma=1.0, lam=1.0, normalize=True, eps=1e-8) -> RefOut:
    """Token-level GAE along each trajectory's action tokens in turn order (observations
    skipped): delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next (V, A past
    the last action token 0); returns = A + V; optional token-weighted whitening (population
    variance, eps inside the sqrt)."""
    trajs = parse(records)
    adv, ret, scales = [], [], []
    for tr in trajs:
        r = [x for turn in _token_reward_stream(tr) for x in turn]
        v = [x for turn in _token_value_stream(tr) for x in turn]
        n = len(r)
        a, acc = [0.0] * n, 0.0
        for t in reversed(range(n)):
            v_next = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * v_next - v[t]
            acc = delta + gamma * lam * acc
            a[t] = acc
        like = [t.action for t in tr.turns]
        adv.append(_unflatten(a, like))
        ret.append(_unflatten([x + y for x, y in zip(a, v)], like))
        scales.append(sum(abs(x) for x in r) + 2 * sum(abs(x) for x in v))
    rtol = _plain_tol([[x for turn in rec for x in turn] for rec in ret])
    if normalize:
        token, tol = _whiten_tokens(adv, eps, max(scales + [1.0]))
    else:
        token = adv
        tol = _plain_tol([[x for turn in rec for x in turn] for rec in adv])
    return RefOut(token=token, token_returns=ret, tol={"token": tol, "token_returns": rtol})


def _turn_values(tr: Traj):
    assert all(t.value is not None for t in tr.turns), "turn-level reference needs values"
    return [t.value for t in tr.turns]


def turn_gae(records, *, gamma=1.0, lam=1.0, normalization="token", eps=1e-8) -> RefOut:
    """delta_k = r_k + gamma V_{k+1} - V_k (V past the last turn 0); A_k = delta_k +
    gamma lam A_{k+1}; returns = A + V. normalization: "token" (weights = action tokens of the
    turn), "turn" (weights 1 per valid turn), "none"; (A - mu) / sqrt(var + eps)."""
    trajs = parse(records)
    adv, ret, scales = [], [], []
    for tr in trajs:
        v = _turn_values(tr)
        r = [t.reward for t in tr.turns]
        K = len(r)
        a, acc = [0.0] * K, 0.0
        for k in reversed(range(K)):
            v_next = v[k + 1] if k + 1 < K else 0.0
            acc = r[k] + gamma * v_next - v[k] + gamma * lam * acc
            a[k] = acc
        adv.append(a)
        ret.append([x + y for x, y in zip(a, v)])
        scales.append(sum(abs(x) for x in r) + 2 * sum(abs(x) for x in v))
    rtol = _plain_tol(ret)
    if normalization == "none":
        out, tol = adv, _plain_tol(adv)
    else:
        w = [[float(len(t.action)) if normalization == "token" else 1.0 for t in tr.turns]
             for tr in trajs]
        tot = sum(x for ws in w for x in ws)
        mu = sum(wi * ai for ws, aa in zip(w, adv) for wi, ai in zip(ws, aa)) / tot
        var = sum(wi * (ai - mu) ** 2 for ws, aa in zip(w, adv) for wi, ai in zip(ws, aa)) / tot
        denom = math.sqrt(var + eps)
        out = [[(x - mu) / denom for x in aa] for aa in adv]
        tol = [_std_tol(max(scales + [1.0]), denom, tot, max(abs(x) for x in o)) for o in out]
    return RefOut(token=_bcast_turns(trajs, out), turn=out, turn_returns=ret,
                  tol={"token": tol, "turn": tol, "turn_returns": rtol})


def sapo(records, *, gamma=1.0, lam=0.95, normalization="token", eps=1e-8) -> RefOut:
    """SAPO: turn-level GAE with lambda-return targets (A + V), batch-normalised with token or
    turn weights -- the formula of ``turn_gae`` with SAPO's defaults."""
    assert normalization in ("token", "turn")
    return turn_gae(records, gamma=gamma, lam=lam, normalization=normalization, eps=eps)


def lambda_returns(records, *, gamma=1.0, lam=1.0, level="turn") -> RefOut:
    """G_t = r_t + gamma ((1 - lam) V_{t+1} + lam G_{t+1}), V and G past the end 0; over turns
    (turn values) or over action tokens (token values, as in ``gae``)."""
    trajs = parse(records)
    out = []
    for tr in trajs:
        if level == "turn":
            r, v = [t.reward for t in tr.turns], _turn_values(tr)
        else:
            r = [x for turn in _token_reward_stream(tr) for x in turn]
            v = [x for turn in _token_value_stream(tr) for x in turn]
        n = len(r)
        g = [0.0] * n
        for t in reversed(range(n)):
            v_next = v[t + 1] if t + 1 < n else 0.0
            g_next = g[t + 1] if t + 1 < n else 0.0
            g[t] = r[t] + gamma * ((1 - lam) * v_next + lam * g_next)
        out.append(g)
    tol = _plain_tol(out)
    if level == "turn":
        return RefOut(token=_bcast_turns(trajs, out), turn=out, turn_returns=out,
                      tol={"token": tol, "turn": tol, "turn_returns": tol})
    tok = [_unflatten(g, [t.action for t in tr.turns]) for g, tr in zip(out, trajs)]
    return RefOut(token=tok, token_returns=tok, tol={"token": tol, "token_returns": tol})


REFERENCES = {
    "grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline, "spo": spo, "spo_pp": spo_pp,
    "rollout_level": rollout_level, "returns": returns, "gae": gae, "turn_gae": turn_gae,
    "lambda_returns": lambda_returns, "sapo": sapo,
}


# ----------------------------------------------------------------------------- from a batch


@dataclasses.dataclass
class Index:
    """A RecordIndex look-alike: ``traj[i]`` and ``spans[i][k] = (row, start, stop)``."""

    traj: list
    spans: list


def records_from_batch(batch):
    """Rebuilds records (and an Index) from a host numpy copy of a TrajectoryBatch.

    Reads the raw arrays only: masks, turn ids, rewards, outcome, group/task ids and the
    extras ``turn_values``, ``token_values``, ``ref_logprobs``, ``token_rewards``. Group and
    task labels are the integer ids. Observations are left out (they never enter an estimator).
    """
    am = np.asarray(batch.action_mask)
    tid = np.asarray(batch.turn_ids)
    rt = np.asarray(batch.row_traj)
    tm = np.asarray(batch.turn_mask)
    trm = np.asarray(batch.traj_mask)
    rew = np.asarray(batch.turn_rewards, np.float64)
    old = np.asarray(batch.old_logprobs, np.float64)
    ex = {k: np.asarray(v) for k, v in batch.extras.items()}
    records, index = [], Index([], [])
    for n in range(tm.shape[0]):
        if not trm[n]:
            continue
        turns, spans = [], []
        for k in range(tm.shape[1]):
            if not tm[n, k]:
                continue
            rows, cols = np.nonzero(am & (tid == k) & (rt[:, None] == n))
            assert len(rows) > 0 and (rows == rows[0]).all()
            row, start, stop = int(rows[0]), int(cols.min()), int(cols.max()) + 1
            assert stop - start == len(cols), "a turn's action tokens must be contiguous"
            sl = (row, slice(start, stop))
            t = {"action": [int(x) for x in np.asarray(batch.tokens)[sl]],
                 "reward": float(rew[n, k]), "logprobs": old[sl].tolist()}
            if "turn_values" in ex:
                t["value"] = float(ex["turn_values"][n, k])
            for src, dst in (("token_values", "values"), ("ref_logprobs", "ref_logprobs"),
                             ("token_rewards", "token_rewards")):
                if src in ex:
                    t[dst] = np.asarray(ex[src][sl], np.float64).tolist()
            turns.append(t)
            spans.append((row, start, stop))
        records.append({"group": int(np.asarray(batch.group_ids)[n]),
                        "task": int(np.asarray(batch.task_ids)[n]),
                        "outcome": float(np.asarray(batch.outcome)[n]), "turns": turns})
        index.traj.append(n)
        index.spans.append(spans)
    return records, index
