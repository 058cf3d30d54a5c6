"""Slow references for SAPO's pieces, from the formulas (plain loops over turns)."""

import math

import numpy as np


def turn_gae_rows(rewards, values, gamma, lam):
    """One trajectory: delta_k = r_k + gamma V_{k+1} - V_k (V past the end 0),
    A_k = sum_l (gamma lam)^l delta_{k+l}. Returns (A, A + V)."""
    k_n = len(rewards)
    adv = []
    for k in range(k_n):
        total = 0.0
        for l in range(k, k_n):
            v_next = values[l + 1] if l + 1 < k_n else 0.0
            delta = rewards[l] + gamma * v_next - values[l]
            total += (gamma * lam) ** (l - k) * delta
        adv.append(total)
    return adv, [a + v for a, v in zip(adv, values)]


def sapo(trajs, gamma, lam, eps, normalize):
    """trajs: list of (rewards, values, action-token counts per turn).
    Returns per-trajectory lists of normalised advantages and lambda-return targets."""
    raw, targets = [], []
    for rewards, values, _ in trajs:
        a, g = turn_gae_rows(rewards, values, gamma, lam)
        raw.append(a)
        targets.append(g)
    weights = [[float(c) if normalize == "token" else 1.0 for c in counts]
               for _, _, counts in trajs]
    total = sum(sum(w) for w in weights)
    mean = sum(w * a for ws, As in zip(weights, raw) for w, a in zip(ws, As)) / total
    var = sum(w * (a - mean) ** 2 for ws, As in zip(weights, raw) for w, a in zip(ws, As)) / total
    norm = [[(a - mean) / math.sqrt(var + eps) for a in As] for As in raw]
    return norm, targets


def sarsa(q, rewards, gamma):
    """q, rewards: per-trajectory lists. Returns (sum of 0.5 (Q_k - r_k - gamma Q_{k+1})^2, count)."""
    total, count = 0.0, 0
    for qs, rs in zip(q, rewards):
        for k in range(len(qs)):
            q_next = qs[k + 1] if k + 1 < len(qs) else 0.0
            total += 0.5 * (qs[k] - (rs[k] + gamma * q_next)) ** 2
            count += 1
    return total, count


def turn_reads(values_row_list, spans, at):
    """values_row_list: [R][T] numpy; spans: per turn (row, start, stop)."""
    out = []
    for row, start, stop in spans:
        if at == "before_action":
            out.append(float(values_row_list[row][max(start - 1, 0)]))
        else:
            out.append(float(values_row_list[row][stop - 1]))
    return out


def as_np(x):
    return np.asarray(x, np.float64)
