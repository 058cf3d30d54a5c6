"""The kernels credit methods share: one module below every family file (the family files
import from here, never from each other).

* ``traj_advantages``: a per-trajectory advantage [N] as ``Advantages`` (turns and tokens).
* Group statistics of step-level methods: ``episode_advantage`` (GRPO's episode term),
  ``step_returns`` (discounted per-turn returns), ``normalize_in_groups`` (normalisation within
  the key groups of turns), ``combine`` (episode + step terms onto the tokens); the modes they
  take (``MODES``, ``EPISODE_WEIGHTINGS``, ``SINGLETONS``) and their checks
  (``check_episode_args``).
* Re-weighting: ``normalize_weights`` (non-negative weights to mean 1 per segment, with floor
  and exact-mass clipping), ``token_weights`` (raw per-turn or per-token weights to per-token
  weights of mean 1 per trajectory / turn / group), ``apply_token_weights`` (A'_t = A_t w_t),
  ``shuffle_weights`` (the matched-concentration control) and their ``LEVELS``.
* Per-turn signals: ``potential_differences`` / ``potential_terms`` (PBRS terms from a
  potential), ``normalize_turns`` over a peer set (``NORMS``; ``cohort_ids``).
* Token masks: ``valid_tokens`` (action tokens of real trajectories), ``token_trajectories``
  (each token's trajectory index).

Segment sums, discounting and masks live one layer down, in ``jaxrl_agent.segments``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import check_choice, check_positive, check_unit, traj_field, turn_field

MODES = ("mean_std_norm", "mean_norm")
EPISODE_WEIGHTINGS = ("trajectory", "steps")
SINGLETONS = ("zero", "raw")


def check_episode_args(normalization, episode_weighting, eps, singleton, gamma=1.0):
    """Trace-time checks of the arguments the step-level estimators share (``step_group``,
    ``gigpo``, the tree estimators, BiPACE): GRPO's episode term (``episode_advantage``) and
    the discount.

    normalization: one of ``MODES``, ``"mean_std_norm"`` (z-score) or ``"mean_norm"`` (centre
      only); episode_weighting: one of ``EPISODE_WEIGHTINGS``, ``"trajectory"`` (each
      trajectory counts once in the group statistics) or ``"steps"`` (once per valid turn);
      eps: > 0, added to the stds; singleton: one of ``SINGLETONS``, the episode term of a
      task group with one trajectory, ``"zero"`` or ``"raw"`` (R); gamma: in [0, 1].
    """
    check_choice("normalization", normalization, MODES)
    check_choice("episode_weighting", episode_weighting, EPISODE_WEIGHTINGS)
    check_choice("singleton", singleton, SINGLETONS)
    check_positive("eps", eps)
    check_unit("gamma", gamma)


# ----------------------------------------------------------------------------- trajectory credit


def traj_advantages(a, batch: TrajectoryBatch) -> Advantages:
    """Wraps a per-trajectory advantage [N] as ``Advantages`` (turn [N, K] and token [R, T])."""
    a = jnp.where(batch.traj_mask, a, 0.0).astype(jnp.float32)
    turn = jnp.where(batch.turn_mask, a[:, None], 0.0)
    return Advantages(token=segments.traj_to_token(a, batch), turn=turn)


# ----------------------------------------------------------------------------- step-level groups


def episode_advantage(b: TrajectoryBatch, *, normalization: str = "mean_std_norm",
                      weighting: str = "trajectory", reward: str = "outcome", eps: float = 1e-6,
                      singleton: str = "zero"):
    """GRPO's episode term, [N] (0 on padding trajectories).

    A_ep(i) = (R_i - mean_g) / (std_g + eps), or R_i - mean_g with ``normalization="mean_norm"``.
    ``weighting="trajectory"`` counts each trajectory once in mean_g and std_g (GRPO);
    ``"steps"`` counts it once per valid turn K_i (verl-agent's default
    ``compute_mean_std_cross_steps=True``, which normalises over per-step rows: long failed
    episodes then pull the baseline toward failure). std is unbiased over the counted entries
    (frequency weights). ``reward``: ``"outcome"`` (R = outcome) or ``"reward_sum"``
    (R = sum of turn rewards, MatchTIR). A singleton group (one trajectory) gives 0, or
    ``singleton="raw"`` verl's mean 0, std 1 (A = R).
    """
    if reward == "outcome":
        r = b.outcome.astype(jnp.float32)
    else:
        r = jnp.sum(jnp.where(b.turn_mask, b.turn_rewards, 0.0), axis=1).astype(jnp.float32)
    w = None
    if weighting == "steps":
        w = jnp.sum(b.turn_mask, axis=1).astype(jnp.float32)
    mean, std, _ = segments.group_stats(r, b.group_ids, b.traj_mask, 1, w)
    count = segments.group_stats(r, b.group_ids, b.traj_mask)[2]
    a = r - mean
    if normalization == "mean_std_norm":
        a = a / (std + eps)
    lone = r / (1.0 + eps) if (singleton == "raw" and normalization == "mean_std_norm") else r
    a = jnp.where(count > 1, a, lone if singleton == "raw" else 0.0)
    return jnp.where(b.traj_mask, a, 0.0)


def step_returns(b: TrajectoryBatch, gamma):
    """G[i, k] = sum_{j >= k} gamma^(j - k) r[i, j] over valid turns, [N, K]."""
    r = jnp.where(b.turn_mask, b.turn_rewards, 0.0).astype(jnp.float32)
    return jnp.where(b.turn_mask, segments.reverse_scan(r, gamma, axis=1), 0.0)


def normalize_in_groups(x, ids, valid, *, normalization: str = "mean_std_norm",
                        eps: float = 1e-6, singleton: str = "zero"):
    """(x - mean_S) / (std_S + eps) (``normalization="mean_norm"``: x - mean_S) over the key
    group S of every turn, [N, K].

    std unbiased (ddof 1). A singleton group gives 0 (``singleton="raw"``: mean 0, std 1, so
    x / (1 + eps) or x, the verl convention); equal values give exactly 0; invalid turns 0.
    """
    mean, std, count = segments.key_stats(x, ids, valid, ddof=1)
    a = x - mean
    if normalization == "mean_std_norm":
        a = a / (std + eps)
    if singleton == "raw":
        lone = x / (1.0 + eps) if normalization == "mean_std_norm" else x
    else:
        lone = jnp.zeros_like(x)
    return jnp.where(valid, jnp.where(count > 1, a, lone), 0.0)


def combine(b: TrajectoryBatch, a_ep, a_step, episode_weight=1.0, step_weight=1.0,
            how: str = "sum") -> Advantages:
    """A[i, k] = episode_weight A_ep(i) + step_weight A_step(i, k) (``how="sum"``), or their
    weighted mean ``(we A_ep + ws A_step) / (we + ws)`` (``how="mean"``), on valid turns, and
    broadcast onto each turn's action tokens."""
    a = episode_weight * a_ep[:, None] + step_weight * a_step
    if how == "mean":
        a = a / (episode_weight + step_weight)
    a = jnp.where(segments.valid_turns(b), a, 0.0).astype(jnp.float32)
    return Advantages(token=segments.turn_to_token(a, b), turn=a)


# ----------------------------------------------------------------------------- re-weighting


LEVELS = ("trajectory", "turn", "group")


# ----------------------------------------------------------------------------- the normaliser


class _Segments:
    """Segment reductions over entries with ``ok``. Flat mode: ``seg`` [M] per entry. Row
    mode (``x`` [R, T], ``seg`` [R]): every entry of a row is in the row's segment, so a
    reduction is a dense row reduction followed by a segment op over R rows (the scatter
    over R T entries that dominates the flat mode is avoided)."""

    def __init__(self, seg, ok, num_segments, rows: bool):
        self.ok, self.n, self.rows = ok, num_segments, rows
        row_ok = ok.any(axis=1) if rows else ok
        self.seg = jnp.where(row_ok, seg, num_segments)
        self.safe = jnp.clip(self.seg, 0, num_segments - 1)

    def sum(self, x):
        x = jnp.where(self.ok, x, 0.0)
        return jax.ops.segment_sum(x.sum(axis=1) if self.rows else x, self.seg, self.n)

    def max(self, x):
        x = jnp.where(self.ok, x, -jnp.inf)
        return jax.ops.segment_max(x.max(axis=1) if self.rows else x, self.seg, self.n)

    def min(self, x):
        x = jnp.where(self.ok, x, jnp.inf)
        return jax.ops.segment_min(x.min(axis=1) if self.rows else x, self.seg, self.n)

    def gather(self, v):
        """A per-segment value [S] at every entry."""
        return v[self.safe][:, None] if self.rows else v[self.safe]


def normalize_weights(w, seg, valid, num_segments: int, *, measure=None, floor: float = 0.0,
                      clip_min=None, clip_max=None, max_iters: int = 64):
    """Rescales non-negative raw weights to measure-weighted mean 1 in every segment.

    With measure mu (default 1 per entry) and segment s:

        w_hat_i = w_i * sum_s mu / sum_s mu w            (mean 1; uniform if sum_s mu w = 0)
        w'_i    = floor + (1 - floor) w_hat_i            (residual support path, mean still 1)

    then, if ``clip_min``/``clip_max`` are given and a segment has entries outside them, its
    weights become clip(c w', clip_min, clip_max) with the per-segment scale c that makes the
    mean exactly 1 (c by bisection, ``max_iters`` steps, then an analytic rescale of the
    entries strictly inside the bounds): entries past a bound are pinned to it and the others
    keep their ratios. Feasible when clip_min <= 1 <= clip_max and some weight is positive;
    zero weights, which no scale can lift, share any mass still missing evenly. With
    infeasible bounds (clip_min > 1 or clip_max < 1) every entry ends at the violated bound,
    as close to mean 1 as allowed. Segments inside the bounds are left as they are.

    Args:
      w: [M] raw weights (negative values are treated as 0), or [R, T] with ``seg`` [R]
        (every entry of a row in the row's segment: a faster, scatter-free path).
      seg: [M] (or [R]) int segment ids in [0, num_segments); others are dropped.
      valid: bool like ``w``, entries that count.
      measure: like ``w``, non-negative mass per entry (e.g. token counts of turns), default 1.

    Returns:
      [M] float32 weights; 0 where not ``valid``.
    """
    check_unit("floor", floor)
    ok = valid.astype(bool)
    mu = (ok.astype(jnp.float32) if measure is None
          else jnp.where(ok, measure, 0.0).astype(jnp.float32))
    ok = ok & (mu > 0)
    segs = _Segments(seg, ok, num_segments, rows=jnp.ndim(w) == 2)
    w = jnp.where(ok, jnp.maximum(jnp.asarray(w, jnp.float32), 0.0), 0.0)

    total = segs.sum(mu)
    mass = segs.sum(mu * w)
    # equal weights give exactly 1 (a division would round): reduction to the base estimator
    # holds bit for bit
    uniform = segs.gather((mass <= 0.0) | (segs.max(w) == segs.min(w)))
    w_hat = w * segs.gather(total / jnp.where(mass > 0, mass, 1.0))
    out = floor + (1.0 - floor) * w_hat if floor else w_hat
    out = jnp.where(uniform, 1.0, out)  # exactly 1, whatever the floor
    if clip_min is not None or clip_max is not None:
        lo = -jnp.inf if clip_min is None else jnp.float32(clip_min)
        hi = jnp.inf if clip_max is None else jnp.float32(clip_max)
        out = _project_mean_one(out, segs, mu, total, lo, hi, max_iters)
    return jnp.where(ok, out, 0.0)


def _project_mean_one(w, segs, mu, total, lo, hi, max_iters):
    """Mean-1 weights inside [lo, hi] of the form clip(c_s w, lo, hi) per segment s.

    F_s(c) = sum_s mu clip(c w, lo, hi) is non-decreasing in c, so c_s is found by bisection
    on log c (``max_iters`` halvings of [e^-60, e^60]); then the entries strictly inside the
    bounds are rescaled analytically so the mass is exact. Zero weights cannot be scaled: if
    the mass is still short (every positive entry at ``hi``), they share the rest evenly.
    Segments already inside the bounds are returned unchanged (bit for bit)."""
    ok, seg_sum, at = segs.ok, segs.sum, segs.gather
    outside = seg_sum(((w < lo) | (w > hi)).astype(jnp.float32)) > 0

    def body(_, ab):
        a, b = ab
        mid = 0.5 * (a + b)
        low = seg_sum(mu * jnp.clip(at(jnp.exp(mid)) * w, lo, hi)) < total
        return jnp.where(low, mid, a), jnp.where(low, b, mid)

    # built from the inputs: varies over a mesh axis like them (shard_map's type check)
    zero = jnp.zeros((segs.n,), jnp.float32) + jnp.sum(jnp.where(ok, 0.0, 0.0))
    a, b = lax.fori_loop(0, max_iters, body, (zero - 60.0, zero + 60.0))
    x = at(jnp.exp(0.5 * (a + b))) * w
    free = (x > lo) & (x < hi)
    fixed = seg_sum(jnp.where(free, 0.0, mu * jnp.clip(x, lo, hi)))
    free_w = seg_sum(jnp.where(free, mu * w, 0.0))
    scale = jnp.where(free_w > 0, (total - fixed) / jnp.where(free_w > 0, free_w, 1.0), 0.0)
    y = jnp.clip(jnp.where(free, w * at(scale), x), lo, hi)
    zw = ok & (w <= 0)
    short = total - seg_sum(mu * y)
    zmu = seg_sum(jnp.where(zw, mu, 0.0))
    share = jnp.where((short > 0) & (zmu > 0), short / jnp.where(zmu > 0, zmu, 1.0), 0.0)
    y = jnp.where(zw, jnp.clip(y + at(share), lo, hi), y)
    return jnp.where(at(outside), y, w)


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
    """uint32 keys [N, K]: a hash of (seed, global trajectory index, turn index), so the
    permutation does not depend on padding (K, extra trajectories) or sharding."""
    n_off, _ = _global_offsets(batch, axis_name)
    n, k = batch.num_traj, batch.num_turns
    traj = jnp.broadcast_to((jnp.arange(n) + n_off)[:, None], (n, k)).astype(jnp.uint32)
    turn = jnp.broadcast_to(jnp.arange(k)[None, :], (n, k)).astype(jnp.uint32)
    return segments.hash_combine(segments.hash_combine(jnp.uint32(seed), traj), turn)


def _token_rand(batch, seed, axis_name):
    """uint32 keys [R, T]: a hash of (seed, global trajectory, turn, position of the token
    inside its turn's action tokens): the same in both layouts, under any padding and
    sharded or not."""
    n_off, _ = _global_offsets(batch, axis_name)
    m = batch.action_mask
    rank = jnp.cumsum(m.astype(jnp.int32), axis=1) - 1  # rank among the row's action tokens
    first, _ = segments.turn_boundary_masks(batch)
    start = segments.token_to_turn(jnp.where(first, rank, 0), batch)  # rank of each turn's 1st
    pos = rank - segments.turn_to_token(start, batch)
    traj = jnp.broadcast_to((batch.row_traj + n_off)[:, None], m.shape).astype(jnp.uint32)
    turn = jnp.clip(batch.turn_ids, 0, batch.num_turns - 1).astype(jnp.uint32)
    h = segments.hash_combine(jnp.uint32(seed) ^ jnp.uint32(0x5BD1E995), traj)
    h = segments.hash_combine(segments.hash_combine(h, turn), pos.astype(jnp.uint32))
    return jnp.where(m, h, jnp.uint32(0))


def shuffle_weights(w, batch: TrajectoryBatch, *, level: str = "trajectory", seed: int = 0,
                    axis_name=None, per: str | None = None):
    """The matched-concentration shuffled control of a weight array: the weights of every
    trajectory (``level="trajectory"``/``"group"``) or turn (``"turn"``) are randomly permuted
    over its valid turns ([N, K] weights) or action tokens ([R, T] weights). Same multiset
    (same entropy and Gini), random placement; deterministic for a ``seed`` and the same
    sharded or not, in both layouts and under any padding. ``per``: ``"turn"`` ([N, K]) or
    ``"token"`` ([R, T]); ``None`` infers it from the shape."""
    check_choice("level", level, LEVELS)
    b = segments.localize(batch, axis_name)
    if _is_per_turn(w, b, per):
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


def _is_per_turn(w, batch, per):
    """Whether ``w`` holds per-turn [N, K] (True) or per-token [R, T] (False) values."""
    if per is not None:
        check_choice("per", per, ("turn", "token"))
        want = batch.turn_mask.shape if per == "turn" else batch.tokens.shape
        if w.shape != want:
            raise ValueError(f"per={per!r} weights must have shape {want}, got {w.shape}")
        return per == "turn"
    if w.shape == batch.turn_mask.shape:
        return True
    if w.shape != batch.tokens.shape:
        raise ValueError(f"weights must have shape [N, K] = {batch.turn_mask.shape} or [R, T] = "
                         f"{batch.tokens.shape}, got {w.shape}")
    return False


def token_weights(raw, batch: TrajectoryBatch, *, level: str = "trajectory", floor: float = 0.0,
                  clip_min=None, clip_max=None, measure=None, per: str | None = None):
    """Normalised token weights [R, T] (mean 1 per ``level`` segment over action tokens) from
    raw non-negative weights given per turn [N, K] (each token of turn k gets w_k) or per
    token [R, T]. ``measure`` [R, T] (default 1 per action token) is the mass each token
    carries in the mean. ``batch`` must be block-local (``segments.local_view``). ``per``
    (``"turn"``/``"token"``) says which one ``raw`` is where N, K = R, T; default: by shape."""
    check_choice("level", level, LEVELS)
    raw = jnp.asarray(raw, jnp.float32)
    if _is_per_turn(raw, batch, per):
        raw = segments.turn_to_token(raw, batch)
    valid = batch.action_mask & batch.traj_mask[jnp.clip(batch.row_traj, 0, batch.num_traj - 1)][:, None]
    nseg = batch.num_traj * (batch.num_turns if level == "turn" else 1)
    seg = _token_segments(batch, level)
    if level != "turn":  # constant along each row: row sums, then a segment op over rows
        return normalize_weights(raw, seg[:, 0], valid, nseg, measure=measure, floor=floor,
                                 clip_min=clip_min, clip_max=clip_max)
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


def valid_tokens(b: TrajectoryBatch):
    """[R, T] bool: the action tokens of the batch's real trajectories (``action_mask`` and
    the row's trajectory in ``traj_mask``)."""
    return b.action_mask & b.traj_mask[jnp.clip(b.row_traj, 0, b.num_traj - 1)][:, None]


def token_trajectories(b: TrajectoryBatch):
    """[R, T] int32: each token's trajectory index (its row's ``row_traj``, clipped into
    ``[0, N)`` for padding rows)."""
    return jnp.broadcast_to(jnp.clip(b.row_traj, 0, b.num_traj - 1)[:, None], b.tokens.shape)


# ----------------------------------------------------------------------------- per-turn signals


#: peer sets of ``normalize_turns``
NORMS = ("cohort", "group", "state", "batch", "none")


def potential_differences(phi, final, valid, gamma=1.0):
    """F_k = gamma Phi_{k+1} - Phi_k over valid turns, with Phi_{K_i} = ``final`` [N].

    ``phi`` [N, K]: Phi before action k. Valid turns must be a prefix of each row (the batch
    layout). 0 on invalid turns. sum_k gamma^k F_k = gamma^{K_i} final - Phi_0 (telescoping).
    """
    nxt_valid = segments.next_turn(valid, False)
    nxt = jnp.where(nxt_valid, segments.next_turn(phi), final[:, None])
    return jnp.where(valid, gamma * nxt - phi, 0.0)


def potential_terms(b: TrajectoryBatch, potential: str, final_potential: str, gamma: float,
                    require_final: bool, who: str):
    """The PBRS term F [N, K] of ``b`` (a local view) from ``extras[potential]`` [N, K] (Phi
    before action k) and ``extras[final_potential]`` [N] (Phi after the last turn; absent ->
    0 unless ``require_final``), read without gradient; ``who`` names the method in errors.
    ``potential_differences`` of the two."""
    phi = turn_field(b, potential, who, "Phi(s_k) before action k, [N, K]", stop_gradient=True)
    final = traj_field(b, final_potential, who, "Phi after the last turn, [N]",
                       default=None if require_final else 0.0, stop_gradient=True)
    return potential_differences(phi, final, segments.valid_turns(b), gamma)


def cohort_ids(b: TrajectoryBatch):
    """[N, K] int: one id per (task group, turn index): the cohort of ``normalize_turns``."""
    n, k = b.turn_mask.shape
    return jnp.clip(b.group_ids, 0, n - 1)[:, None] * k + jnp.arange(k)[None, :]


def normalize_turns(x, b, *, by: str = "cohort", scale_std: bool = True, eps: float = 1e-6,
                    ddof: int = 1, axis_name=None):
    """(x - mean_S) / (std_S + eps) (or x - mean_S) over the peer set S of each valid turn.

    ``by``: ``"cohort"`` S = turns of the same task group and turn index (g, k);
    ``"group"`` all valid turns of the task group pooled; ``"state"`` turns of the group with
    the same ``state_keys`` (GiGPO's anchor); ``"batch"`` all valid turns of the batch
    (psum over ``axis_name``); ``"none"`` x itself. std with ``ddof`` (1 = unbiased). A
    singleton peer set gives 0; equal values give exactly 0. [N, K], 0 off valid turns.
    """
    valid = segments.valid_turns(b)
    x = jnp.where(valid, x, 0.0)
    if by == "none":
        return x
    n, k = x.shape
    if by == "batch":
        mean, var = segments.masked_mean_var(x, valid, axis_name, ddof)
        std = segments.safe_sqrt(var)
        count = segments.psum(jnp.sum(valid.astype(jnp.float32)), axis_name)
    elif by == "group":
        gid = jnp.broadcast_to(jnp.clip(b.group_ids, 0, n - 1)[:, None], (n, k))
        m_s, s_s, c_s = segments.segment_stats(x.reshape(-1), gid.reshape(-1),
                                               valid.reshape(-1), n, ddof)
        mean, std, count = m_s[gid], s_s[gid], c_s[gid]
    else:
        ids = (cohort_ids(b) if by == "cohort"
               else segments.turn_key_ids(b, b.state_keys, valid=valid))
        mean, std, count = segments.key_stats(x, ids, valid, ddof)
    a = x - mean
    if scale_std:
        a = a / (std + eps)
    return jnp.where(valid & (count > 1), a, 0.0)
