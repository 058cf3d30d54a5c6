"""Slow reference losses, written straight from the formulas with Python loops over tokens.

Independent of ``jaxrl_agent.losses``: plain numpy / math, one token at a time. Every function
takes numpy arrays (``mask`` [R, T] bool, ``row_traj`` [R], ``turn_ids`` [R, T], ...) and
returns per-token losses [R, T] (0 outside the mask) or a ``(sum, denominator)`` pair.
"""

import math

import numpy as np


def _tokens(mask):
    R, T = mask.shape
    for r in range(R):
        for t in range(T):
            if mask[r, t]:
                yield r, t


def _ratio(lp, old):
    return math.exp(min(max(float(lp) - float(old), -20.0), 20.0))


# ----------------------------------------------------------------------------- aggregation


def aggregate(per_token, mask, row_traj, mode, constant=None):
    R, T = mask.shape
    row_sum = [0.0] * R
    row_n = [0] * R
    for r, t in _tokens(mask):
        row_sum[r] += float(per_token[r, t])
        row_n[r] += 1
    nonempty = [r for r in range(R) if row_n[r] > 0]
    if mode == "token_mean":
        return sum(row_sum), float(sum(row_n))
    if mode == "seq_mean_token_mean":
        return sum(row_sum[r] / row_n[r] for r in nonempty), float(len(nonempty))
    if mode == "seq_mean_token_sum":
        return sum(row_sum), float(len(nonempty))
    if mode == "seq_mean_token_sum_norm":
        c = T if constant is None else constant
        return sum(row_sum), float(c * len(nonempty))
    if mode == "traj_mean_token_mean":
        traj_sum, traj_n = {}, {}
        for r in range(R):
            i = int(row_traj[r])
            traj_sum[i] = traj_sum.get(i, 0.0) + row_sum[r]
            traj_n[i] = traj_n.get(i, 0) + row_n[r]
        live = [i for i in traj_n if traj_n[i] > 0]
        return sum(traj_sum[i] / traj_n[i] for i in live), float(len(live))
    raise ValueError(mode)


# ----------------------------------------------------------------------------- policy


def ppo_tokens(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0, weights=None):
    out = np.zeros(mask.shape)
    for r, t in _tokens(mask):
        a = float(adv[r, t])
        ratio = _ratio(lp[r, t], old[r, t])
        clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
        loss = max(-a * ratio, -a * clipped)
        if dual_clip is not None and a < 0:
            loss = min(loss, -a * dual_clip)
        if weights is not None:
            loss *= float(weights[r, t])
        out[r, t] = loss
    return out


def gspo_tokens(lp, old, adv, mask, row_traj, turn_ids, level, clip_low, clip_high):
    """log s = mean of lp - lp_old over the row (sequence) or over (row_traj, turn)."""
    groups = {}
    for r, t in _tokens(mask):
        key = r if level == "sequence" else (int(row_traj[r]), int(turn_ids[r, t]))
        groups.setdefault(key, []).append(float(lp[r, t]) - float(old[r, t]))
    out = np.zeros(mask.shape)
    for r, t in _tokens(mask):
        key = r if level == "sequence" else (int(row_traj[r]), int(turn_ids[r, t]))
        vals = groups[key]
        s = math.exp(min(max(sum(vals) / len(vals), -20.0), 20.0))
        a = float(adv[r, t])
        out[r, t] = max(-a * s, -a * min(max(s, 1 - clip_low), 1 + clip_high))
    return out


def cispo_tokens(lp, old, adv, mask, clip_low=1.0, clip_high=0.2):
    out = np.zeros(mask.shape)
    for r, t in _tokens(mask):
        w = min(max(_ratio(lp[r, t], old[r, t]), 1 - clip_low), 1 + clip_high)
        out[r, t] = -w * float(adv[r, t]) * float(lp[r, t])
    return out


def soft_gate_tokens(lp, old, adv, mask, tau_pos=1.0, tau_neg=1.05):
    out = np.zeros(mask.shape)
    for r, t in _tokens(mask):
        a = float(adv[r, t])
        tau = tau_pos if a > 0 else tau_neg
        x = tau * (_ratio(lp[r, t], old[r, t]) - 1.0)
        gate = 1.0 / (1.0 + math.exp(-x)) * 4.0 / tau
        out[r, t] = -a * gate
    return out


def reinforce_tokens(lp, adv, mask, weights=None):
    out = np.zeros(mask.shape)
    for r, t in _tokens(mask):
        w = 1.0 if weights is None else float(weights[r, t])
        out[r, t] = -float(adv[r, t]) * float(lp[r, t]) * w
    return out


def is_weights(prox, sampler, mask, level="token", cap=2.0, mode="truncate", lower=None):
    R, T = mask.shape
    out = np.zeros(mask.shape)
    for r in range(R):
        toks = [t for t in range(T) if mask[r, t]]
        if not toks:
            continue
        if level == "sequence":
            mean = sum(float(prox[r, t]) - float(sampler[r, t]) for t in toks) / len(toks)
            logs = {t: mean for t in toks}
        else:
            logs = {t: float(prox[r, t]) - float(sampler[r, t]) for t in toks}
        for t in toks:
            w = math.exp(min(max(logs[t], -20.0), 20.0))
            if mode == "truncate":
                out[r, t] = min(w, cap)
            else:
                lo = 0.0 if lower is None else lower
                out[r, t] = 1.0 if lo <= w <= cap else 0.0
    return out


# ----------------------------------------------------------------------------- kl / entropy


def kl_tokens(lp, ref, mask, kind):
    out = np.zeros(mask.shape)
    for r, t in _tokens(mask):
        x, y = float(lp[r, t]), float(ref[r, t])
        if kind in ("k1", "k1_st"):
            out[r, t] = x - y
        elif kind == "k2":
            out[r, t] = 0.5 * (x - y) ** 2
        else:  # k3, k3_st
            d = min(max(y - x, -20.0), 20.0)
            out[r, t] = min(max(math.exp(d) - d - 1.0, -10.0), 10.0)
    return out


def entropy_from_logits(logits):
    lead = logits.shape[:-1]
    out = np.zeros(lead)
    for idx in np.ndindex(*lead):
        row = [float(v) for v in logits[idx]]
        mx = max(row)
        z = sum(math.exp(v - mx) for v in row)
        h = 0.0
        for v in row:
            p = math.exp(v - mx) / z
            if p > 0:
                h -= p * math.log(p)
        out[idx] = h
    return out


# ----------------------------------------------------------------------------- value


def value(values, returns, mask, old_values=None, clip=None):
    total, count = 0.0, 0.0
    for idx in zip(*np.nonzero(mask)):
        v, ret = float(values[idx]), float(returns[idx])
        err = (v - ret) ** 2
        if clip is not None:
            old = float(old_values[idx])
            vc = old + min(max(v - old, -clip), clip)
            err = max(err, (vc - ret) ** 2)
        total += 0.5 * err
        count += 1.0
    return total, count
