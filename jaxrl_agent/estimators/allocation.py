"""Family (e): re-allocation of a fixed advantage over turns and tokens.

Every rule here is a *credit transform*: ``f(adv, batch, *, ..., axis_name=None) ->
Advantages``. It takes the advantages of a base estimator (``grpo(batch)``, ``gigpo(batch)``,
...) and redistributes them with non-negative weights w:

    A'_t = A_t w'_t,   w'_t >= 0,   sum_{t in s} m_t w'_t = sum_{t in s} m_t   for each segment s

(the token-weighted mean of w' is 1 on every trajectory, turn or group: ``level``). For a
trajectory-constant base advantage this conserves advantage mass exactly (P8) and never flips
a sign (P9). The primitive is ``reallocate``; the named methods only compute raw weights.

Composition: ``reallocate(grpo(batch), batch, weights="w")`` in code, ``estimator.then`` in a
config, ``jaxrl-agent credit --estimator grpo --then trial`` on the command line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.estimators._checks import check_choice, check_unit, require

LEVELS = ("trajectory", "turn", "group")


# ----------------------------------------------------------------------------- the normaliser


def normalize_weights(w, seg, valid, num_segments: int, *, measure=None, floor: float = 0.0,
                      clip_min=None, clip_max=None, max_iters: int = 64):
    """Rescales non-negative raw weights to measure-weighted mean 1 in every segment.

    With measure mu (default 1 per entry) and segment s:

        w_hat_i = w_i * sum_s mu / sum_s mu w            (mean 1; uniform if sum_s mu w = 0)
        w'_i    = floor + (1 - floor) w_hat_i            (residual support path, mean still 1)

    then, if ``clip_min``/``clip_max`` are given, w' is projected onto [clip_min, clip_max]
    with the mean kept at exactly 1: entries outside the bounds are pinned to them and the free
    entries are rescaled to carry the remaining mass, until no free entry leaves the bounds
    (the pinned set only grows, so this ends in at most #entries rounds; ``max_iters`` caps
    it). Feasible when clip_min <= 1 <= clip_max; a segment whose entries are all pinned keeps
    the pinned values (the mean is then as close to 1 as the bounds allow).

    Args:
      w: [M] raw weights (negative values are treated as 0).
      seg: [M] int segment ids in [0, num_segments); others are dropped.
      valid: [M] bool, entries that count.
      measure: [M] non-negative mass per entry (e.g. token counts of turns), default 1.

    Returns:
      [M] float32 weights; 0 where not ``valid``.
    """
    check_unit("floor", floor)
    ok = valid.astype(bool)
    mu = ok.astype(jnp.float32) if measure is None else jnp.where(ok, measure, 0.0).astype(jnp.float32)
    ok = ok & (mu > 0)
    seg = jnp.where(ok, seg, num_segments)
    safe = jnp.clip(seg, 0, num_segments - 1)
    w = jnp.where(ok, jnp.maximum(jnp.asarray(w, jnp.float32), 0.0), 0.0)

    def seg_sum(x):
        return jax.ops.segment_sum(jnp.where(ok, x, 0.0), seg, num_segments)

    total = seg_sum(mu)
    mass = seg_sum(mu * w)
    # equal weights give exactly 1 (a division would round): P10 holds bit for bit
    top = jax.ops.segment_max(jnp.where(ok, w, -jnp.inf), seg, num_segments)
    bottom = jax.ops.segment_min(jnp.where(ok, w, jnp.inf), seg, num_segments)
    uniform = ((mass <= 0.0) | (top == bottom))[safe]
    w_hat = jnp.where(uniform, 1.0, w * (total / jnp.where(mass > 0, mass, 1.0))[safe])
    out = floor + (1.0 - floor) * w_hat if floor else w_hat
    if clip_min is not None or clip_max is not None:
        lo = -jnp.inf if clip_min is None else jnp.float32(clip_min)
        hi = jnp.inf if clip_max is None else jnp.float32(clip_max)
        out = _project_mean_one(out, seg, ok, mu, total, lo, hi, num_segments, max_iters)
    return jnp.where(ok, out, 0.0)


def _project_mean_one(w, seg, ok, mu, total, lo, hi, num_segments, max_iters):
    safe = jnp.clip(seg, 0, num_segments - 1)

    def seg_sum(x):
        return jax.ops.segment_sum(jnp.where(ok, x, 0.0), seg, num_segments)

    def body(carry):
        w, pinned, _, it = carry
        new_pin = pinned | (w < lo) | (w > hi)
        w = jnp.clip(w, lo, hi)
        fixed = seg_sum(jnp.where(new_pin, mu * w, 0.0))
        free = seg_sum(jnp.where(new_pin, 0.0, mu * w))
        scale = jnp.where(free > 0, (total - fixed) / jnp.where(free > 0, free, 1.0), 1.0)
        w = jnp.where(new_pin, w, w * jnp.maximum(scale, 0.0)[safe])
        moved = jnp.any(ok & ~new_pin & ((w < lo) | (w > hi)))
        return w, new_pin, moved, it + 1

    zero = jnp.zeros_like(w, dtype=bool)
    init = (w, zero, jnp.any(ok), jnp.int32(0) + jnp.sum(zero).astype(jnp.int32))
    w, _, _, _ = lax.while_loop(lambda c: c[2] & (c[3] < max_iters), body, init)
    return jnp.clip(w, lo, hi)


# ----------------------------------------------------------------------------- shuffled control


def _global_offsets(batch: TrajectoryBatch, axis_name):
    if axis_name is None:
        return jnp.int32(0), jnp.int32(0)
    d = lax.axis_index(axis_name)
    return d * batch.num_traj, d * batch.num_rows


def permute_within(x, seg, valid, rand):
    """Permutes ``x`` [M] inside each segment by the order of the random keys ``rand`` [M]:
    the multiset of values of every segment is kept, their placement is random. Invalid
    entries keep their value."""
    m = x.shape[0]
    big = jnp.iinfo(jnp.int32).max
    s = jnp.where(valid, seg, big)
    natural = jnp.lexsort((jnp.arange(m), s))  # slots of each segment, in position order
    shuffled = jnp.lexsort((rand, s))  # the same segments, members in random order
    out = x.at[natural].set(x[shuffled])
    return jnp.where(valid, out, x)


def _turn_rand(batch, seed, axis_name):
    n_off, _ = _global_offsets(batch, axis_name)
    n, k = batch.num_traj, batch.num_turns
    idx = (jnp.arange(n)[:, None] + n_off) * k + jnp.arange(k)[None, :]
    return segments.hash_combine(jnp.uint32(seed), idx.astype(jnp.uint32))


def _token_rand(batch, seed, axis_name):
    _, r_off = _global_offsets(batch, axis_name)
    r, t = batch.num_rows, batch.row_len
    idx = (jnp.arange(r)[:, None] + r_off) * t + jnp.arange(t)[None, :]
    return segments.hash_combine(jnp.uint32(seed) ^ jnp.uint32(0x5BD1E995), idx.astype(jnp.uint32))


def shuffle_weights(w, batch: TrajectoryBatch, *, level: str = "trajectory", seed: int = 0,
                    axis_name=None):
    """The matched-concentration shuffled control of a weight array (d1): the weights of every
    trajectory (``level="trajectory"``/``"group"``) or turn (``"turn"``) are randomly permuted
    over its valid turns ([N, K] weights) or action tokens ([R, T] weights). Same multiset
    (same entropy and Gini), random placement; deterministic for a ``seed`` and the same
    sharded or not."""
    check_choice("level", level, LEVELS)
    b = segments.localize(batch, axis_name)
    if w.shape == b.turn_mask.shape:
        n, k = w.shape
        valid = segments.valid_turns(b)
        seg = jnp.broadcast_to(jnp.arange(n)[:, None] * (k if level == "turn" else 1)
                               + (jnp.arange(k)[None, :] if level == "turn" else 0), (n, k))
        out = permute_within(w.reshape(-1), seg.reshape(-1), valid.reshape(-1),
                             _turn_rand(b, seed, axis_name).reshape(-1))
        return out.reshape(n, k)
    seg = _token_segments(b, "trajectory" if level == "group" else level)
    out = permute_within(w.reshape(-1), seg.reshape(-1), b.action_mask.reshape(-1),
                         _token_rand(b, seed, axis_name).reshape(-1))
    return out.reshape(w.shape)


# ----------------------------------------------------------------------------- the primitive


def _token_segments(batch: TrajectoryBatch, level: str):
    traj = jnp.broadcast_to(batch.row_traj[:, None], batch.tokens.shape)
    if level == "trajectory":
        return traj
    if level == "turn":
        return traj * batch.num_turns + jnp.clip(batch.turn_ids, 0, batch.num_turns - 1)
    return batch.group_ids[jnp.clip(traj, 0, batch.num_traj - 1)]


def token_weights(raw, batch: TrajectoryBatch, *, level: str = "trajectory", floor: float = 0.0,
                  clip_min=None, clip_max=None, measure=None):
    """Normalised token weights [R, T] (mean 1 per ``level`` segment over action tokens) from
    raw non-negative weights given per turn [N, K] (each token of turn k gets w_k) or per
    token [R, T]. ``measure`` [R, T] (default 1 per action token) is the mass each token
    carries in the mean. ``batch`` must be block-local (``segments.local_view``)."""
    check_choice("level", level, LEVELS)
    raw = jnp.asarray(raw, jnp.float32)
    if raw.shape == batch.turn_mask.shape:
        raw = segments.turn_to_token(raw, batch)
    elif raw.shape != batch.tokens.shape:
        raise ValueError(f"weights must have shape [N, K] = {batch.turn_mask.shape} or [R, T] = "
                         f"{batch.tokens.shape}, got {raw.shape}")
    valid = batch.action_mask & batch.traj_mask[jnp.clip(batch.row_traj, 0, batch.num_traj - 1)][:, None]
    nseg = batch.num_traj * (batch.num_turns if level == "turn" else 1)
    seg = _token_segments(batch, level)
    w = normalize_weights(raw.reshape(-1), seg.reshape(-1), valid.reshape(-1), nseg,
                          measure=None if measure is None else measure.reshape(-1),
                          floor=floor, clip_min=clip_min, clip_max=clip_max)
    return w.reshape(raw.shape)


def apply_token_weights(adv: Advantages, w, batch: TrajectoryBatch) -> Advantages:
    """A'_t = A_t w_t; the turn-level credit becomes the token mean of A' over each turn.
    Value targets (``token_returns``/``turn_returns``) pass through unchanged."""
    tok = jnp.where(batch.action_mask, adv.token * w, 0.0).astype(jnp.float32)
    turn = jnp.where(segments.valid_turns(batch), segments.token_to_turn(tok, batch, "mean"), 0.0)
    return adv.replace(token=tok, turn=turn)


def reallocate(adv: Advantages, batch: TrajectoryBatch, *, weights: str = "weights",
               level: str = "trajectory", floor: float = 0.0, clip_min: float | None = None,
               clip_max: float | None = None, shuffle: bool = False, seed: int = 0,
               axis_name=None) -> Advantages:
    """The allocation primitive: A'_t = A_t w'_t with w' from ``extras[weights]``.

    w' = ``token_weights`` of the raw weights (per turn [N, K] or per token [R, T], >= 0),
    mean 1 over the action tokens of every trajectory / turn / group (``level``), optional
    residual ``floor`` and exact-mass clipping to [``clip_min``, ``clip_max``]. With
    ``shuffle=True`` the raw weights are first permuted within each trajectory (or turn):
    the matched-concentration shuffled control of the verifier-density paper (d1), which any
    targeting claim must beat.

    Properties: sum_t m A'_t = A_i sum_t m per trajectory for trajectory-constant A (P8);
    sign(A'_t) in {sign(A_t), 0} (P9); constant weights give A' = A exactly (P10).
    """
    b = segments.local_view(batch, axis_name)
    raw = require(b, weights, "reallocate", "non-negative weights [N, K] or [R, T]")
    if shuffle:
        raw = shuffle_weights(raw, batch, level=level, seed=seed, axis_name=axis_name)
    w = token_weights(raw, b, level=level, floor=floor, clip_min=clip_min, clip_max=clip_max)
    return apply_token_weights(adv, w, b)


def shuffled_control(adv: Advantages, batch: TrajectoryBatch, *, weights: str = "weights",
                     level: str = "trajectory", floor: float = 0.0,
                     clip_min: float | None = None, clip_max: float | None = None,
                     seed: int = 0, axis_name=None) -> Advantages:
    """``reallocate`` with the raw weights randomly permuted within each trajectory (or turn):
    the matched-concentration shuffled control (d1). [X] formula of METHODS.md d1
    (verifier-information-density paper): same multiset of weights, random placement."""
    return reallocate(adv, batch, weights=weights, level=level, floor=floor, clip_min=clip_min,
                      clip_max=clip_max, shuffle=True, seed=seed, axis_name=axis_name)


# Registered by jaxrl_agent.estimators (kind: name -> function).
TRANSFORMS = {"reallocate": reallocate, "shuffled_control": shuffled_control}
