"""Trajectory-level (outcome) estimators: one scalar per trajectory, broadcast to its tokens.

GRPO, Dr.GRPO, RLOO, REINFORCE++ (token-level returns) and REINFORCE++-baseline, SPO and SPO++
(persistent per-task Beta tracker), the rollout-level advantage of per-step rows, and R3L's
positive-amplified outcome advantage.

Degenerate groups: a singleton group (one valid member) gives 0 by default
(``singleton="zero"``); ``singleton="raw"`` reproduces verl, where a lone member's mean is 0
and std 1, so A = R. A zero-variance group gives exactly 0 (statistics are computed on rewards
shifted by the group maximum, so equal rewards cancel exactly).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import (check_choice, check_nonneg, check_positive, check_unit, require,
                                traj_field)
from jaxrl_agent.estimators.primitives import traj_advantages
from jaxrl_agent.registry import register

_SINGLETON = ("zero", "raw")


def _group_centered(batch, *, ddof, singleton, normalize, eps, rloo=False, weights=None):
    r = batch.outcome.astype(jnp.float32)
    mean, std, count = segments.group_stats(r, batch.group_ids, batch.traj_mask, ddof, weights)
    if weights is not None:  # a singleton is one member, whatever its weight
        count = segments.group_stats(r, batch.group_ids, batch.traj_mask)[2]
    a = r - mean
    if normalize:
        a = a / (std + eps)
    if rloo:
        a = a * count / jnp.maximum(count - 1.0, 1.0)
    lone = r if singleton == "raw" else jnp.zeros_like(r)
    return jnp.where(count > 1, a, lone)


@register("grpo")
def group_normalized_outcome(batch: TrajectoryBatch, *, eps: float = 1e-6, ddof: int = 1,
                             singleton: str = "zero", axis_name=None) -> Advantages:
    """GRPO: a_i = (R_i - mean_g R) / (std_g R + eps), std with ``ddof`` (1 = unbiased, as verl).

    Groups are ``group_ids``; only valid trajectories count. Singleton groups: see module doc.
    Shao et al. 2024 (DeepSeekMath); verl ``compute_grpo_outcome_advantage``.

    Args:
      batch: reads ``outcome`` [N], ``group_ids`` [N] and ``traj_mask`` [N] (N trajectories);
        the result reaches the tokens through ``row_traj`` [R] and ``action_mask`` [R, T].
      eps: added to the group std, > 0.
      ddof: delta degrees of freedom of the std (1 unbiased, 0 population).
      singleton: ``"zero"`` (a lone member gets 0) or ``"raw"`` (it gets R, as verl).
      axis_name: the mesh axis under ``shard_map`` (groups are whole on one shard, so the
        statistics stay shard-local), or None.

    Returns:
      ``Advantages`` with ``turn`` [N, K] (a_i on every valid turn of trajectory i, 0 elsewhere)
      and ``token`` [R, T] (a_i on every action token of i's rows, 0 elsewhere).
    """
    check_positive("eps", eps)
    check_choice("singleton", singleton, _SINGLETON)
    b = segments.local_view(batch, axis_name)
    return traj_advantages(_group_centered(b, ddof=ddof, singleton=singleton, normalize=True,
                                           eps=eps), b)


@register("dr_grpo")
def group_centered_outcome(batch: TrajectoryBatch, *, singleton: str = "zero",
                           axis_name=None) -> Advantages:
    """Dr.GRPO: a_i = R_i - mean_g R (no std scaling; pair it with the constant-normalised
    ``seq_mean_token_sum_norm`` loss aggregation). Liu et al. 2025, "Understanding R1-Zero".

    Args:
      singleton: ``"zero"`` (a lone member gets 0) or ``"raw"`` (it gets R).

    ``batch``, ``axis_name`` and the result (a_i broadcast): as in ``grpo``.
    """
    check_choice("singleton", singleton, _SINGLETON)
    b = segments.local_view(batch, axis_name)
    return traj_advantages(_group_centered(b, ddof=1, singleton=singleton, normalize=False,
                                           eps=0.0), b)


@register("rloo")
def leave_one_out_outcome(batch: TrajectoryBatch, *, singleton: str = "zero",
                          axis_name=None) -> Advantages:
    """RLOO: a_i = R_i - mean_{j in g, j != i} R_j = n_g / (n_g - 1) (R_i - mean_g R).

    Ahmadian et al. 2024; verl ``compute_rloo_outcome_advantage`` (singleton: ``"raw"`` = R).

    Args:
      singleton: ``"zero"`` (a lone member gets 0) or ``"raw"`` (it gets R, as verl).

    ``batch``, ``axis_name`` and the result (a_i broadcast): as in ``grpo``.
    """
    check_choice("singleton", singleton, _SINGLETON)
    b = segments.local_view(batch, axis_name)
    return traj_advantages(_group_centered(b, ddof=1, singleton=singleton, normalize=False,
                                           eps=0.0, rloo=True), b)


@register("reinforce_pp", aliases=("whitened_token_returns",))
def reinforce_pp(batch: TrajectoryBatch, *, gamma: float = 1.0, kl_coef: float = 0.0,
                 eps: float = 1e-8, axis_name=None) -> Advantages:
    """REINFORCE++: token reward-to-go, then token-weighted whitening over the whole batch.

    r_t = turn reward on the last action token of its turn (+ extras['token_rewards'])
          - kl_coef (old_logprob_t - ref_logprob_t)   [KL in the reward, if kl_coef > 0]
    G_t = r_t + gamma G_next(t), over the trajectory's action tokens in order;
    A = (G - mean_m G) / sqrt(var_m G + eps), mean and var token-weighted over all action
    tokens of the batch (and across ``axis_name``).

    Multi-turn: observation tokens carry the running return through unchanged, so the outcome
    reaches every earlier turn (verl resets the sum at masked tokens, which cuts it off).
    Hu 2025, "REINFORCE++".

    Args:
      batch: reads ``turn_rewards`` [N, K], ``action_mask``, ``turn_ids`` [R, T] and
        ``row_traj`` [R]; optional extras['token_rewards'] [R, T]; with ``kl_coef`` > 0 also
        ``old_logprobs`` and extras['ref_logprobs'] [R, T].
      gamma: per-token discount, in [0, 1].
      kl_coef: weight of the KL penalty in the reward (0 = none).
      eps: added to the variance in the whitening.
      axis_name: the mesh axis under ``shard_map``: mean and variance are reduced across it,
        or None.

    Returns:
      ``Advantages`` with ``token`` [R, T] (A on action tokens, 0 elsewhere) only.
    """
    check_unit("gamma", gamma)
    b = segments.local_view(batch, axis_name)
    r = segments.token_rewards(b)
    if kl_coef:
        ref = require(b, "ref_logprobs", "reinforce_pp with kl_coef > 0",
                      "[R, T] reference-model log-probs")
        r = r - kl_coef * jnp.where(b.action_mask, b.old_logprobs - ref, 0.0)
    g, _ = segments.trajectory_reverse_scan(r, gamma, b)
    return Advantages(token=segments.masked_whiten(g, b.action_mask, axis_name, eps))


def _token_whitened_traj(a, b, axis_name, eps):
    """(a_i - mu) / sqrt(var + eps) with mu, var weighted by each trajectory's action tokens."""
    n_tok = segments.traj_token_counts(b) * b.traj_mask
    mu, var = segments.weighted_mean_var(a, n_tok, axis_name)
    return (a - mu) * jax.lax.rsqrt(var + eps)


@register("reinforce_pp_baseline", aliases=("group_baseline_whitened",))
def reinforce_pp_baseline(batch: TrajectoryBatch, *, eps: float = 1e-8,
                          axis_name=None) -> Advantages:
    """REINFORCE++-baseline: a_i = R_i - mean_g R, broadcast to action tokens, then whitened
    token-weighted over the batch: A = (a - mu_m) / sqrt(var_m + eps). verl.

    mu_m and var_m weight each trajectory by its number of action tokens (across
    ``axis_name``). A singleton group gives a_i = 0 before the whitening.

    Args:
      batch: reads ``outcome`` [N], ``group_ids`` [N], ``traj_mask`` [N], and ``row_traj`` [R]
        with ``action_mask`` [R, T] for the token weights.
      eps: added to the variance.
      axis_name: the mesh axis under ``shard_map``: the whitening reduces across it, or None.

    Returns:
      ``Advantages``: ``turn`` [N, K] and ``token`` [R, T], A_i broadcast as in ``grpo``.
    """
    b = segments.local_view(batch, axis_name)
    r = b.outcome.astype(jnp.float32)
    mean, _, _ = segments.group_stats(r, b.group_ids, b.traj_mask)
    return traj_advantages(_token_whitened_traj(r - mean, b, axis_name, eps), b)


# ----------------------------------------------------------------------------- SPO / SPO++


@struct.dataclass
class SPOState:
    """Persistent per-task Beta tracker of SPO: p_hat(task) = alpha / (alpha + beta)."""

    alpha: jax.Array  # [P]
    beta: jax.Array  # [P]


def spo_init(num_tasks: int, alpha0: float = 0.5, beta0: float = 0.5) -> SPOState:
    """A tracker for ``num_tasks`` task ids (0.5/0.5 = uninformed prior, p_hat = 0.5).

    From offline estimates (s successes of n): alpha0 = N0 (s + 0.5)/(n + 1),
    beta0 = N0 (n - s + 0.5)/(n + 1) with N0 = 1 / (1 - rho).
    """
    return SPOState(alpha=jnp.full((num_tasks,), alpha0, jnp.float32),
                    beta=jnp.full((num_tasks,), beta0, jnp.float32))


def check_spo_state(batch: TrajectoryBatch, state: SPOState) -> None:
    """Host-side check that every real task id has a tracker entry (inside jit an id past the
    end would silently share the last entry)."""
    if not isinstance(state, SPOState):
        raise ValueError("spo/spo_pp need state=SPOState (make one with spo_init(num_tasks))")
    tasks = np.asarray(batch.task_ids)[np.asarray(batch.traj_mask)]
    p = state.alpha.shape[0]
    if tasks.size and (tasks.min() < 0 or tasks.max() >= p):
        raise ValueError(f"task_ids range over [{tasks.min()}, {tasks.max()}] but the SPO "
                         f"tracker has {p} entries: make it with spo_init(num_tasks > "
                         f"{tasks.max()})")


def _spo_residual_and_update(b, state, rho, axis_name):
    if not isinstance(state, SPOState):
        raise ValueError("spo/spo_pp need state=SPOState (make one with spo_init(num_tasks))")
    p = state.alpha.shape[0]
    task = jnp.clip(b.task_ids, 0, p - 1)
    p_hat = state.alpha[task] / (state.alpha[task] + state.beta[task])
    r = b.outcome.astype(jnp.float32)
    valid = b.traj_mask.astype(jnp.float32)
    succ = jnp.clip(r, 0.0, 1.0) * valid
    hits = segments.psum(jax.ops.segment_sum(valid, task, p), axis_name)
    wins = segments.psum(jax.ops.segment_sum(succ, task, p), axis_name)
    seen = hits > 0
    new = SPOState(alpha=jnp.where(seen, rho * state.alpha + wins, state.alpha),
                   beta=jnp.where(seen, rho * state.beta + hits - wins, state.beta))
    return r - p_hat, new


@register("spo", stateful=True, init_state=spo_init, check_state=check_spo_state)
def single_stream(batch: TrajectoryBatch, *, state: SPOState, rho: float = 0.96,
                  eps: float = 1e-8, axis_name=None):
    """SPO (Single-stream Policy Optimization): a persistent per-task baseline, no groups.

    p_hat = alpha / (alpha + beta) of the trajectory's task (state before this batch);
    a_i = R_i - p_hat;  A_i = (a_i - mean_B a) / (std_B a + eps), one scalar per trajectory
    (trajectory-level whitening, std unbiased; a single trajectory gives 0).
    Update: alpha <- rho alpha + sum R, beta <- rho beta + sum (1 - R) over the batch's
    trajectories of that task, R clipped to [0, 1] (outcomes are success probabilities);
    tasks absent from the batch are untouched.

    Deviation, stated: all evidence of one batch is one event (one decay per batch, not per
    sample), which makes the update order-free, permutation- and shard-invariant. With one
    sample per task per batch it is SPO's update. The KL-adaptive rho is left out: pass rho.
    Task ids must lie in [0, P) of the state. SPO, Xu et al. 2025.

    Args:
      batch: reads ``outcome`` [N], ``task_ids`` [N] and ``traj_mask`` [N].
      state: ``SPOState`` with ``alpha``, ``beta`` [P] (make it with ``spo_init(P)``).
      rho: decay of the tracker per batch, in [0, 1].
      eps: added to the batch std.
      axis_name: the mesh axis under ``shard_map``: the tracker counts and the batch mean and
        std reduce across it, or None.

    Returns:
      ``(Advantages, new SPOState)``: ``turn`` [N, K] and ``token`` [R, T] carry A_i as in
      ``grpo``; the new state has the same shapes [P].
    """
    check_unit("rho", rho)
    b = segments.local_view(batch, axis_name)
    a, new = _spo_residual_and_update(b, state, rho, axis_name)
    mean, var = segments.masked_mean_var(a, b.traj_mask, axis_name, ddof=1)
    return traj_advantages((a - mean) / (segments.safe_sqrt(var) + eps), b), new


@register("spo_pp", stateful=True, init_state=spo_init, check_state=check_spo_state)
def single_stream_pp(batch: TrajectoryBatch, *, state: SPOState, rho: float = 0.96,
                     eps: float = 1e-8, axis_name=None):
    """SPO++: SPO's tracker residuals standardised under the action-token measure.

    a_i = R_i - p_hat(task_i); w_i = n_i / sum_j n_j with n_i the trajectory's action tokens;
    mu = sum_i w_i a_i; var = sum_i w_i (a_i - mu)^2; A_i = (a_i - mu) / sqrt(var + eps).
    Then sum_{i,t} m A = 0 exactly and the token-weighted variance is ~1, so a token-mean
    actor loss receives a centred signal (SPO's per-trajectory z-score does not). Tracker
    update as ``single_stream``, with the same batch granularity (one event per batch, our
    choice). With p_hat = group mean this is REINFORCE++-baseline.

    Args:
      batch: reads ``outcome`` [N], ``task_ids`` [N], ``traj_mask`` [N], and ``row_traj`` [R]
        with ``action_mask`` [R, T] for the token counts n_i.
      state: ``SPOState`` with ``alpha``, ``beta`` [P].
      rho: decay of the tracker per batch, in [0, 1].
      eps: added to the variance.
      axis_name: the mesh axis under ``shard_map``: tracker counts, mu and var reduce across
        it, or None.

    Returns:
      ``(Advantages, new SPOState)``: ``turn`` [N, K] and ``token`` [R, T] carry A_i as in
      ``grpo``.
    """
    check_unit("rho", rho)
    b = segments.local_view(batch, axis_name)
    a, new = _spo_residual_and_update(b, state, rho, axis_name)
    return traj_advantages(_token_whitened_traj(a, b, axis_name, eps), b), new


# ----------------------------------------------------------------------------- rollout level


@register("rollout_level", renamed={"normalize_std": "normalize"})
def rollout_level(batch: TrajectoryBatch, *, eps: float = 1e-6, ddof: int = 1,
                  normalize: bool = True, row_weighted: bool = False,
                  singleton: str = "zero", axis_name=None) -> Advantages:
    """The rollout-level advantage of per-step rows (Agent Lightning): one group-normalised
    advantage per trajectory, computed once per rollout, and every row of it gets that value.

    a_i = (R_i - mean_g) / (std_g + eps) (``normalize=False``: R_i - mean_g), with each rollout
    counted once however many rows it spans, so the result does not depend on how a rollout is
    split into rows. ``row_weighted=True`` gives the contrast that counts a rollout once per
    row (the cross-step statistics of verl-agent): frequency weights w_i = rows of trajectory
    i. With row_weighted=False this equals GRPO (Dr.GRPO without the std).

    Args:
      batch: reads ``outcome`` [N], ``group_ids`` [N] and ``traj_mask`` [N]; with
        ``row_weighted``, ``row_traj`` [R] and ``action_mask`` [R, T] to count the rows.
      eps: added to the group std, > 0.
      ddof: delta degrees of freedom of the std (1 unbiased, 0 population).
      normalize: divide by the group std (True) or only centre (False). Former name
        ``normalize_std``.
      row_weighted: count each rollout once per row with action tokens.
      singleton: ``"zero"`` (a lone rollout gets 0) or ``"raw"`` (it gets R).
      axis_name: the mesh axis under ``shard_map`` (statistics stay shard-local), or None.

    Returns:
      ``Advantages``: ``turn`` [N, K] and ``token`` [R, T], a_i broadcast as in ``grpo``
      (every row of a rollout gets its value).
    """
    check_positive("eps", eps)
    check_choice("singleton", singleton, _SINGLETON)
    b = segments.local_view(batch, axis_name)
    rows = None
    if row_weighted:
        has_tokens = b.action_mask.any(axis=1).astype(jnp.float32)
        rows = jax.ops.segment_sum(has_tokens, b.row_traj, b.num_traj)
    return traj_advantages(_group_centered(b, ddof=ddof, singleton=singleton,
                                           normalize=normalize, eps=eps, weights=rows), b)


# ----------------------------------------------------------------------------- R3L (estimator)


@register("r3l", renamed={"step_norm": "normalize"})
def positive_amplified_outcome(batch: TrajectoryBatch, *, alpha: float = 3.0,
                               baseline: str = "mean", tau: float = 1.0,
                               r_max: float | None = 1.0, normalize: bool = False,
                               score: str = "outcome", axis_name=None) -> Advantages:
    """R3L positive amplification: a group-baselined outcome whose positive part is amplified.
    Pinned: shiweijiezero/R3L
    ``trinity/algorithm/advantage_fn/multi_step_grpo_advantage.py``
    (``StepWiseOPMDReweightAdvAdvantageFn``).

    An *estimator* (it replaces the trajectory score, reading ``score`` [N], default the
    outcome, and the task groups):

        b_g = mean_g R   (``baseline="logavgexp"``: tau (logsumexp_g(R / tau) - log n_g));
              a singleton group has b = 0 (as the repository)
        s_i = R_i - b_g;  s_i = 1 if R_i >= r_max;  else alpha s_i if s_i >= 0;  else s_i
        A_i = s_i on every action token (``normalize``: divided by the number of turns)

    ``r_max=None`` disables the success cap. ``r_max`` must be the largest possible reward
    (an R_i >= r_max below its group mean would be set to +1). Sign preservation holds; zero sum
    fails by design: positive mass is amplified by alpha (sum_{A>0} A / sum_{A<0} |A| grows by
    alpha when no R_i reaches r_max).
    The reflect-then-retry pivot mask of the paper is a loss mask of the rollout, not here.

    Args:
      batch: the batch; reads the score [N], ``group_ids`` [N] and ``turn_mask`` [N, K].
      alpha: >= 0, the amplification of non-negative centred scores.
      baseline: ``"mean"`` or ``"logavgexp"``, the group baseline b_g.
      tau: > 0, the temperature of ``"logavgexp"``.
      r_max: the success cap (the largest possible reward), or None.
      normalize: divide each trajectory's advantage by its number of turns.
      score: the per-trajectory score: ``"outcome"`` or the name of an [N] extra.
      axis_name: the mesh axis a sharded batch is split over, or None.

    Returns:
      Advantages: ``token`` [R, T] (A_i on every action token of trajectory i) and ``turn``
      [N, K] (A_i on every valid turn).
    """
    check_choice("baseline", baseline, ("mean", "logavgexp"))
    check_nonneg("alpha", alpha)
    check_positive("tau", tau)
    b = segments.local_view(batch, axis_name)
    r = traj_field(b, score, "r3l", "trajectory score [N]", stop_gradient=True)
    ok = b.traj_mask
    n = b.num_traj
    mean, _, count = segments.group_stats(r, b.group_ids, ok)
    gid = jnp.where(ok, b.group_ids, n)
    safe = jnp.clip(gid, 0, n - 1)
    if baseline == "mean":
        base = mean
    else:
        x = r / tau
        top = jax.ops.segment_max(jnp.where(ok, x, -jnp.inf), gid, n)[safe]
        lse = top + jnp.log(jax.ops.segment_sum(jnp.where(ok, jnp.exp(x - top), 0.0), gid, n)[safe])
        base = tau * (lse - jnp.log(jnp.maximum(count, 1.0)))
    s = r - jnp.where(count > 1, base, 0.0)
    s = jnp.where(s >= 0, alpha * s, s)
    if r_max is not None:
        s = jnp.where(r >= r_max, 1.0, s)
    if normalize:
        s = s / jnp.maximum(jnp.sum(b.turn_mask, axis=1), 1).astype(jnp.float32)
    return traj_advantages(jnp.where(ok, s, 0.0), b)


# Registered by jaxrl_agent.estimators (kind: name -> function).
