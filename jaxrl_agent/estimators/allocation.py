"""Re-allocation of a fixed advantage over turns and tokens, and dense credit add-ons.

Most rules here are *credit transforms*: ``f(adv, batch, *, ..., axis_name=None) ->
Advantages``. A transform takes the advantages of a base estimator (``grpo(batch)``,
``gigpo(batch)``, ...) and either redistributes them with non-negative weights w:

    A'_t = A_t w'_t,   w'_t >= 0,   sum_{t in s} m_t w'_t = sum_{t in s} m_t   for each segment s

(m_t = 1 on action tokens: the token-weighted mean of w' is 1 on every trajectory, turn or
group, the ``level``), or adds a dense term to them (an add-on, A'_t = A_t + c d_t). A
re-allocation of a trajectory-constant base advantage conserves each trajectory's advantage
mass exactly and never flips a sign. The primitive is ``reallocate``; the named methods
compute raw weights (or the add-on) from their signal and hand them to it.

Shapes: N trajectories of at most K turns, stored as R token rows of length T (see
``jaxrl_agent.batch``). Every transform takes ``adv``, the base ``Advantages`` (``token`` [R, T],
``turn`` [N, K]), and ``axis_name``, the mesh axis a sharded batch is split over (or None), and
returns ``adv`` with ``token`` [R, T] = A' (zero off the action tokens) and ``turn`` [N, K] the
token mean of ``token`` over each turn; value targets pass through unchanged. A transform with
a ``shuffle`` flag permutes its raw weights first (the matched-concentration shuffled control,
which any targeting claim must beat), with the permutation's seed ``seed``.

Composition: ``reallocate(grpo(batch), batch, weights="w")`` in code, ``estimator.then`` in a
config, ``jaxrl-agent credit --estimator grpo --then trial`` on the command line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import (check_choice, check_nonneg, check_positive, check_unit,
                                require, token_field, turn_field)
from jaxrl_agent.estimators.primitives import (apply_token_weights, shuffle_weights,
                                               token_trajectories, token_weights, valid_tokens)
from jaxrl_agent.registry import register

@register("reallocate", kind="transform")
def reallocate(adv: Advantages, batch: TrajectoryBatch, *, weights: str = "weights",
               level: str = "trajectory", floor: float = 0.0, clip_min: float | None = None,
               clip_max: float | None = None, shuffle: bool = False, seed: int = 0,
               axis_name=None) -> Advantages:
    """The allocation primitive: A'_t = A_t w'_t with w' from ``extras[weights]``.

    w' = ``token_weights`` of the raw weights (per turn [N, K] or per token [R, T], >= 0),
    mean 1 over the action tokens of every trajectory / turn / group (``level``), optional
    residual ``floor`` and exact-mass clipping to [``clip_min``, ``clip_max``]. With
    ``shuffle=True`` the raw weights are first permuted within each trajectory (or turn):
    the matched-concentration shuffled control of the verifier-density paper, which any
    targeting claim must beat.

    Properties: sum_t m A'_t = A_i sum_t m per trajectory for trajectory-constant A (mass
    conservation); sign(A'_t) in {sign(A_t), 0} (sign preservation); constant weights give A' =
    A exactly (reduction to the base estimator).

    Args:
      adv: the base advantages; ``token`` [R, T] is reweighted.
      batch: the batch; reads ``extras[weights]``: raw weights >= 0 per turn [N, K] or per
        token [R, T] (negative values count as 0; gradient stopped).
      weights: the name of that extra.
      level: ``"trajectory"``, ``"turn"`` or ``"group"``: the segment over whose action tokens
        w' has mean 1.
      floor: in [0, 1]; w' = floor + (1 - floor) w_hat keeps that share of the mass uniform.
      clip_min, clip_max: optional bounds on w' (clip_min <= clip_max); the mean stays 1 where
        the bounds allow it (see ``normalize_weights``).
      shuffle: permute the raw weights within each trajectory (within each turn at
        ``level="turn"``) first.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    _check_bounds(clip_min, clip_max)
    b = segments.local_view(batch, axis_name)
    raw = lax.stop_gradient(require(b, weights, "reallocate", "non-negative weights [N, K] or "
                                                              "[R, T]"))
    level_of = b.extra_level(weights, raw.shape)  # declared by pack_records where shapes clash
    per = level_of if level_of in ("turn", "token") else None
    if shuffle:
        raw = shuffle_weights(raw, batch, level=level, seed=seed, axis_name=axis_name, per=per)
    w = token_weights(raw, b, level=level, floor=floor, clip_min=clip_min, clip_max=clip_max,
                      per=per)
    return apply_token_weights(adv, w, b)


@register("shuffled_control", kind="transform")
def shuffled_control(adv: Advantages, batch: TrajectoryBatch, *, weights: str = "weights",
                     level: str = "trajectory", floor: float = 0.0,
                     clip_min: float | None = None, clip_max: float | None = None,
                     seed: int = 0, axis_name=None) -> Advantages:
    """``reallocate`` with the raw weights randomly permuted within each trajectory (or turn):
    the matched-concentration shuffled control. Same multiset of weights (same entropy and
    Gini), random placement. This is our reading of the verifier-information-density paper,
    which describes the control in words: a targeting claim must beat it.

    Args:
      adv, batch, weights, level, floor, clip_min, clip_max, seed, axis_name: as in
        ``reallocate`` (``extras[weights]`` [N, K] or [R, T], raw weights >= 0).

    Returns:
      ``adv`` with ``token`` [R, T] = A w' (w' from the permuted weights) and ``turn`` [N, K]
      its token mean per turn.
    """
    return reallocate(adv, batch, weights=weights, level=level, floor=floor, clip_min=clip_min,
                      clip_max=clip_max, shuffle=True, seed=seed, axis_name=axis_name)



# ============================================================================= named methods
#
# Each method below computes raw weights (or a dense add-on) from its signal and hands them to
# the primitive. Log-prob contrasts take two field-name hyper-parameters, ``teacher`` and
# ``student``: the name of an [R, T] extra, or ``"old_logprobs"`` for ``batch.old_logprobs``.
# Every signal is read through ``lax.stop_gradient``. The teacher scoring (hindsight,
# rubric, evidence, answer-conditioned contexts) runs outside: these functions consume its
# log-probs as arrays.


def _check_bounds(clip_min, clip_max):
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"clip_min must be <= clip_max, got {clip_min} > {clip_max}")


def _check_weight_bounds(w_min, w_max):
    if not 0.0 < w_min <= 1.0 <= w_max:
        raise ValueError(f"need 0 < w_min <= 1 <= w_max (mean-1 weights), got w_min={w_min}, "
                         f"w_max={w_max}")


def _gap(b, teacher, student, who):
    """g_t = lp_teacher - lp_student on valid action tokens (detached), 0 elsewhere."""
    return (token_field(b, teacher, who, "teacher log-probs [R, T]",
                        stop_gradient=True, valid_only=True)
            - token_field(b, student, who, "student log-probs [R, T]",
                          stop_gradient=True, valid_only=True))


def _base_token(adv, b):
    return jnp.where(b.action_mask, adv.token, 0.0).astype(jnp.float32)


def _base_turn(adv, b):
    """The base credit per turn: ``adv.turn``, or the token mean per turn where it is None."""
    turn = adv.turn if adv.turn is not None else segments.token_to_turn(_base_token(adv, b), b,
                                                                         "mean")
    return jnp.where(segments.valid_turns(b), turn, 0.0)


def _set_token(adv, tok, b):
    """Advantages with token credit ``tok``; the turn credit is its token mean per turn."""
    tok = jnp.where(b.action_mask, tok, 0.0).astype(jnp.float32)
    turn = jnp.where(segments.valid_turns(b), segments.token_to_turn(tok, b, "mean"), 0.0)
    return adv.replace(token=tok, turn=turn)


def _reweight(adv, batch, b, raw, *, per, level="trajectory", floor=0.0, clip_min=None,
              clip_max=None, shuffle=False, seed=0, axis_name=None):
    """raw -> (optionally shuffled) -> ``token_weights`` -> A' = A w'."""
    if shuffle:
        raw = shuffle_weights(raw, batch, level=level, seed=seed, axis_name=axis_name, per=per)
    w = token_weights(raw, b, level=level, floor=floor, clip_min=clip_min, clip_max=clip_max,
                      per=per)
    return apply_token_weights(adv, w, b)


def _traj_turn_std(x, b, ddof: int = 1):
    """Per-trajectory std over valid turns of an [N, K] array, broadcast to [N, 1]."""
    n, k = x.shape
    ids = jnp.broadcast_to(jnp.arange(n)[:, None], (n, k)).reshape(-1)
    _, std, _ = segments.segment_stats(x.reshape(-1), ids, segments.valid_turns(b).reshape(-1),
                                       n, ddof)
    return std[:, None]


def _turn_index(b):
    """Flat turn index i * K + k of every action token; N * K elsewhere (dropped)."""
    n, k = b.num_traj, b.num_turns
    idx = token_trajectories(b) * k + jnp.clip(b.turn_ids, 0, k - 1)
    return jnp.where(b.action_mask, idx, n * k)


def _turn_max(x, b):
    """Per-turn maximum of a token array, gathered back to the tokens ([R, T])."""
    n, k = b.num_traj, b.num_turns
    idx = _turn_index(b)
    top = jax.ops.segment_max(jnp.where(b.action_mask, x, -jnp.inf).reshape(-1), idx.reshape(-1),
                              n * k)
    return jnp.where(b.action_mask, top[jnp.clip(idx, 0, n * k - 1)], 0.0)


def _signed_turn_credit(adv, batch, b, x, *, alpha, w_min, w_max, eps, mode, shuffle, seed,
                        axis_name):
    """Turn score x [N, K] -> credit. z_k = x_k / (std_k x + eps) within the trajectory;
    ``reweight``: w_k = clip(1 + alpha sign(A_k) z_k, w_min, w_max), renormalised to token
    mass 1 per trajectory inside the same bounds; ``additive``: A_k + alpha z_k."""
    valid = segments.valid_turns(b)
    z = jnp.where(valid, x / (_traj_turn_std(x, b) + eps), 0.0)
    if mode == "additive":
        return _set_token(adv, _base_token(adv, b) + alpha * segments.turn_to_token(z, b), b)
    raw = jnp.clip(1.0 + alpha * jnp.sign(_base_turn(adv, b)) * z, w_min, w_max)
    return _reweight(adv, batch, b, jnp.where(valid, raw, 0.0), per="turn", clip_min=w_min,
                     clip_max=w_max, shuffle=shuffle, seed=seed, axis_name=axis_name)


# ----------------------------------------------------------------------------- TRIAL


@register("trial", kind="transform", renamed={"lam": "weight"})
def hindsight_gap_bonus(adv: Advantages, batch: TrajectoryBatch, *,
                        teacher: str = "teacher_logprobs", student: str = "old_logprobs",
                        weight: float = 0.1, shuffle: bool = False, seed: int = 0,
                        axis_name=None) -> Advantages:
    """TRIAL (trajectory-relative hindsight distillation) as an advantage add-on: the gap
    between hindsight and ordinary log-probs, scaled per turn.

        g_t = lp_hind_t - lp_ord_t                 (``teacher`` - ``student``, detached)
        M_k = mean_{t in k} |g_t|,  mu_k = M_k / (sum_k n_k M_k / sum_k n_k)
        A'_t = A_t + weight mu_{k(t)} g_t

    This is our reading of the TRIAL paper, which describes the step in words (the formula
    is consistent with its abstract). mu has eligible-token-weighted mean exactly 1 over each
    trajectory (``token_weights``; uniform when every M_k is equal or 0) and is invariant to
    scaling g. ``weight = 0`` gives the base advantage bit for bit.

    Args:
      batch: the batch; reads the two log-prob fields below, [R, T] each.
      teacher: the hindsight (teacher) log-probs: the name of an [R, T] extra, or
        ``"old_logprobs"`` for ``batch.old_logprobs``.
      student: the ordinary log-probs, named the same way (default the rollout's).
      weight: >= 0, the coefficient of the add-on.
      shuffle: permute the turn magnitudes M within each trajectory first.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("weight", weight)
    b = segments.local_view(batch, axis_name)
    g = _gap(b, teacher, student, "trial")
    mag = segments.token_to_turn(jnp.abs(g), b, "mean")
    if shuffle:
        mag = shuffle_weights(mag, batch, seed=seed, axis_name=axis_name, per="turn")
    mu = token_weights(mag, b, per="turn")
    if weight == 0:
        return _set_token(adv, _base_token(adv, b), b)
    return _set_token(adv, _base_token(adv, b) + weight * mu * g, b)


# ----------------------------------------------------------------------------- StepOPSD


@register("stepopsd", kind="transform")
def step_gap_reweight(adv: Advantages, batch: TrajectoryBatch, *,
                      teacher: str = "teacher_logprobs", student: str = "old_logprobs",
                      lambda_mix: float = 0.5, alpha_clip: float = 0.5, eps: float = 1e-6,
                      token_dist: bool = False, shuffle: bool = False, seed: int = 0,
                      axis_name=None) -> Advantages:
    """StepOPSD: step-aware sign-preserving re-allocation with a per-step credit budget, from
    the mean teacher-student log-prob gap of each step.

        s_k = mean_{t in k} (lp_T - lp_S),  s~_k = s_k / (std_k s + eps)   (per trajectory)
        m_k = clip(1 + lambda_mix sign(A_k) s~_k, 1 - alpha_clip, 1 + alpha_clip)
        m <- m renormalised to token mass 1 per trajectory, kept inside the same bounds
        A'_t = A_t m_{k(t)} [ * w_t,  w_t ∝ softplus(sign(A_t) g_t), mean 1 per step ]

    This is our reading of the StepOPSD paper, which describes the step in words. Mass
    conservation per trajectory, sign preservation (m > 0 for alpha_clip < 1), bounds (m in
    [1 - alpha_clip, 1 + alpha_clip] when feasible), reduction to the base estimator
    (lambda_mix = 0 gives A bit for bit, token_dist off). std_k is the unbiased std over the
    trajectory's valid turns; A_k is ``adv.turn`` (the token mean per turn when it is None).

    Args:
      batch: the batch; reads the two log-prob fields below, [R, T] each.
      teacher: the teacher log-probs: the name of an [R, T] extra, or ``"old_logprobs"``.
      student: the student log-probs, named the same way (default the rollout's).
      lambda_mix: >= 0, the strength of the step multiplier.
      alpha_clip: in [0, 1], the half-width of the multiplier's bounds.
      eps: > 0, added to the std.
      token_dist: also distribute each step's credit over its tokens (w_t above).
      shuffle: permute the step multipliers within each trajectory first.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_unit("alpha_clip", alpha_clip)
    check_nonneg("lambda_mix", lambda_mix)
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    g = _gap(b, teacher, student, "stepopsd")
    s = segments.token_to_turn(g, b, "mean")
    out = _signed_turn_credit(adv, batch, b, s, alpha=lambda_mix, w_min=1.0 - alpha_clip,
                              w_max=1.0 + alpha_clip, eps=eps, mode="reweight",
                              shuffle=shuffle, seed=seed, axis_name=axis_name)
    if not token_dist:
        return out
    w_tok = token_weights(jax.nn.softplus(jnp.sign(_base_token(adv, b)) * g), b, level="turn",
                          per="token")
    return _set_token(out, out.token * w_tok, b)


# ----------------------------------------------------------------------------- CoRT


@register("cort", kind="transform")
def rubric_token_reweight(adv: Advantages, batch: TrajectoryBatch, *,
                          teacher: str = "teacher_logprobs", student: str = "old_logprobs",
                          kappa: float = 0.5, tau: float = 1.0, w_min: float = 0.2,
                          w_max: float = 2.0, absolute: bool = False, shuffle: bool = False,
                          seed: int = 0, axis_name=None) -> Advantages:
    """CoRT: counterfactual-replay rubric token weights, from the contrast between log-probs
    with and without the rubric in context.

        c_t = lp_rubric_t - lp_free_t   (``teacher`` - ``student``; when the rubric is in the
              rollout prompt use teacher="old_logprobs", student=<criteria-free field>)
        w_t = clip(1 + kappa tanh(c_t / tau), w_min, w_max)   (|c_t| with ``absolute``)
        w   <- mean 1 per response, kept inside [w_min, w_max];  A'_t = A_t w_t

    This is our reading of the CoRT paper, which describes the step in words. Mass
    conservation per response, sign preservation (w_min > 0), bounds, reduction to the base
    estimator (kappa = 0 gives A bit for bit); the weights are monotone in c.

    Args:
      batch: the batch; reads the two log-prob fields below, [R, T] each.
      teacher: the rubric-conditioned log-probs: the name of an [R, T] extra, or
        ``"old_logprobs"``.
      student: the criteria-free log-probs, named the same way.
      kappa: >= 0, the strength of the weights.
      tau: > 0, the temperature of the tanh.
      w_min, w_max: the weight bounds, 0 < w_min <= 1 <= w_max.
      absolute: use |c_t| (any contrast raises the weight).
      shuffle: permute the raw token weights within each response first.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("kappa", kappa)
    check_positive("tau", tau)
    _check_weight_bounds(w_min, w_max)
    b = segments.local_view(batch, axis_name)
    c = _gap(b, teacher, student, "cort")
    c = jnp.abs(c) if absolute else c
    raw = jnp.where(valid_tokens(b), jnp.clip(1.0 + kappa * jnp.tanh(c / tau), w_min, w_max), 0.0)
    return _reweight(adv, batch, b, raw, per="token", clip_min=w_min, clip_max=w_max,
                     shuffle=shuffle, seed=seed, axis_name=axis_name)


# ----------------------------------------------------------------------------- RVCO


def _segment_median(x, seg, valid, num_segments):
    """Per-segment median [S] of x [M] over ``valid`` entries (the mean of the two middle
    values for an even count; 0 for an empty segment). Sort-based."""
    x = x.reshape(-1)
    seg = jnp.where(valid.reshape(-1), seg.reshape(-1), num_segments)
    order = jnp.lexsort((x, seg))
    xs, ss = x[order], seg[order]
    pos = jnp.arange(x.shape[0], dtype=jnp.int32)
    start = jax.ops.segment_min(pos, ss, num_segments)
    count = jax.ops.segment_sum(jnp.ones_like(pos), ss, num_segments)
    safe = jnp.clip(ss, 0, num_segments - 1)
    rank = pos - start[safe]
    c = count[safe]
    real = ss < num_segments
    lo = jax.ops.segment_sum(jnp.where(real & (rank == (c - 1) // 2), xs, 0.0), ss, num_segments)
    hi = jax.ops.segment_sum(jnp.where(real & (rank == c // 2), xs, 0.0), ss, num_segments)
    return 0.5 * (lo + hi)


@register("rvco", kind="transform")
def visual_evidence_reweight(adv: Advantages, batch: TrajectoryBatch, *,
                             teacher: str = "teacher_logprobs", student: str = "old_logprobs",
                             tau: float = 1.0, beta: float = 0.1, absolute: bool = True,
                             eps: float = 1e-6, shuffle: bool = False, seed: int = 0,
                             axis_name=None) -> Advantages:
    """RVCO (Residual Visual Credit Optimization): token weights as a budgeted entropic router
    over the visual evidence of each token.

        e_t = |lp(y_t | image) - lp(y_t | corrupted image)|   (|``teacher`` - ``student``|;
              signed with absolute=False)
        z_t = (e_t - median e) / (MAD e + eps)                 (robust, per trajectory)
        p_t = softmax_t(z_t / tau),  w_t = (1 - beta) N p_t + beta   (N valid tokens)
        A'_t = A_t w_t

    This is our reading of the RVCO paper, which describes the step in words. The mean of w
    is exactly 1 (``token_weights`` with ``floor=beta``). Mass conservation, sign preservation
    (w >= beta), bounds (w <= (1 - beta) N + beta), invariant to e -> a e + c (a > 0);
    tau -> 0 is hard selection of the argmax, tau -> inf uniform.

    Args:
      batch: the batch; reads the two log-prob fields below, [R, T] each.
      teacher: the log-probs given the image: the name of an [R, T] extra, or
        ``"old_logprobs"``.
      student: the log-probs given the corrupted image, named the same way.
      tau: > 0, the softmax temperature.
      beta: in [0, 1], the uniform floor of the weights.
      absolute: use |teacher - student| (False: the signed difference).
      eps: > 0, added to the MAD.
      shuffle: permute the raw token weights within each trajectory first.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_positive("tau", tau)
    check_unit("beta", beta)
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    e = _gap(b, teacher, student, "rvco")
    e = jnp.abs(e) if absolute else e
    valid = valid_tokens(b)
    seg = token_trajectories(b)
    n = b.num_traj
    med = _segment_median(e, seg, valid, n)[seg]
    mad = _segment_median(jnp.abs(e - med), seg, valid, n)[seg]
    z = jnp.where(valid, (e - med) / (mad + eps) / tau, 0.0)
    top = jax.ops.segment_max(jnp.where(valid, z, -jnp.inf).reshape(-1), seg.reshape(-1), n)
    raw = jnp.where(valid, jnp.exp(z - top[seg]), 0.0)
    return _reweight(adv, batch, b, raw, per="token", floor=beta, shuffle=shuffle, seed=seed,
                     axis_name=axis_name)


# ----------------------------------------------------------------------------- AgentOPSD


def belief_revisions(e, valid, l0, rho: float = 1.0):
    """Recursive log-odds belief over turns: l_k = l_0 + rho (l_{k-1} - l_0) + e_k (damping
    pulls the belief back toward the prior, so no evidence means no revision), and the
    revisions Delta_k = sigmoid(l_k) - sigmoid(l_{k-1}) (0 on missing turns).

    Args:
      e: [N, K] turn evidence; valid: [N, K] bool; l0: [N] prior log-odds.
    Returns:
      (l [N, K] belief after each turn, delta [N, K]).
    """
    def step(prev, xs):
        e_k, v_k = xs
        cur = jnp.where(v_k, l0 + rho * (prev - l0) + e_k, prev)
        return cur, (cur, jnp.where(v_k, jax.nn.sigmoid(cur) - jax.nn.sigmoid(prev), 0.0))

    # the carry starts as l0 broadcast like the evidence, so under shard_map its type (varying
    # over the batch axes) matches the step's output even when l0 is a batch-wide prior
    init = l0.astype(jnp.float32) + jnp.zeros_like(e[:, 0], jnp.float32)
    _, (l, delta) = lax.scan(step, init, (e.T, valid.T))
    return l.T, delta.T


@register("agentopsd", kind="transform")
def belief_revision_reweight(adv: Advantages, batch: TrajectoryBatch, *,
                             teacher: str = "teacher_logprobs", student: str = "old_logprobs",
                             p0: float | None = 0.5, rho: float = 1.0, alpha: float = 0.5,
                             w_min: float = 0.2, w_max: float = 3.0, eps: float = 1e-6,
                             mode: str = "reweight", shuffle: bool = False, seed: int = 0,
                             axis_name=None) -> Advantages:
    """AgentOPSD: turn credit from the revisions of a recursive Bayesian belief over turns,
    fed by teacher-student evidence.

        e_k = sum_{t in k} (lp_T - lp_S)             (turn log-likelihood ratio)
        l_0 = logit(p0),  l_k = l_0 + rho (l_{k-1} - l_0) + e_k,
        Delta_k = sigmoid(l_k) - sigmoid(l_{k-1})
        reweight: w_k = clip(1 + alpha sign(A_k) Delta_k / (std_k Delta + eps), w_min, w_max),
                  renormalised to token mass 1 per trajectory (inside the bounds); A' = A w
        additive: A'_k = A_k + alpha Delta_k

    This is our reading of the AgentOPSD paper, which describes the method in words.
    ``p0=None`` takes the group success rate, mean_g clip(outcome, 0, 1), clipped to
    [1e-3, 1 - 1e-3]. The damping ``rho`` < 1 decays the belief toward the prior, not toward
    0 (our reading of a recursion "l_k = rho l_{k-1} + e_k", which would revise the belief
    with no evidence when p0 != 0.5). Sum_k Delta_k telescopes; e = 0 (teacher =
    student) gives A bit for bit (reduction to the base estimator); mass conservation/sign
    preservation in ``reweight`` mode.

    Args:
      batch: the batch; reads the two log-prob fields below, [R, T] each (and ``outcome`` [N]
        with ``p0=None``).
      teacher: the teacher log-probs: the name of an [R, T] extra, or ``"old_logprobs"``.
      student: the student log-probs, named the same way (default the rollout's).
      p0: the prior success probability in (0, 1), or None for the group success rate.
      rho: >= 0, the damping of the belief toward the prior (1: none).
      alpha: >= 0, the strength of the credit.
      w_min, w_max: the weight bounds of ``reweight``, 0 < w_min <= 1 <= w_max.
      eps: > 0, added to the std.
      mode: ``"reweight"`` or ``"additive"``.
      shuffle: permute the turn weights within each trajectory first (``reweight`` only).

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_choice("mode", mode, ("reweight", "additive"))
    if p0 is not None and not 0.0 < p0 < 1.0:
        raise ValueError(f"p0 must lie in (0, 1) or be None (group success rate), got {p0}")
    check_nonneg("alpha", alpha)
    check_nonneg("rho", rho)
    _check_weight_bounds(w_min, w_max)
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    e = segments.token_to_turn(_gap(b, teacher, student, "agentopsd"), b, "sum")
    if p0 is None:
        rate, _, _ = segments.group_stats(jnp.clip(b.outcome, 0.0, 1.0), b.group_ids, b.traj_mask)
        p = jnp.clip(rate, 1e-3, 1.0 - 1e-3)
    else:
        p = jnp.full((b.num_traj,), p0, jnp.float32)
    _, delta = belief_revisions(e, segments.valid_turns(b), jnp.log(p) - jnp.log1p(-p), rho)
    if mode == "additive":
        return _set_token(adv, _base_token(adv, b) + alpha * segments.turn_to_token(delta, b), b)
    return _signed_turn_credit(adv, batch, b, delta, alpha=alpha, w_min=w_min, w_max=w_max,
                               eps=eps, mode=mode, shuffle=shuffle, seed=seed,
                               axis_name=axis_name)


# ----------------------------------------------------------------------------- PBSD


@register("pbsd", kind="transform")
def privileged_gap_reweight(adv: Advantages, batch: TrajectoryBatch, *,
                            teacher: str = "teacher_logprobs", student: str = "old_logprobs",
                            alpha: float = 0.5, w_min: float = 0.2, w_max: float = 3.0,
                            eps: float = 1e-6, mode: str = "reweight", shuffle: bool = False,
                            seed: int = 0, axis_name=None) -> Advantages:
    """PBSD: privileged Bayesian self-distillation turn credit, from the log-prob gain of
    each turn when the teacher also sees the answer.

        s_k = sum_{t in k} (lp(y_t | x, a*, y<t) - lp(y_t | x, y<t)),   sum_k s_k = S
        reweight: w_k = clip(1 + alpha sign(A_k) s_k / (std_k s + eps), w_min, w_max),
                  renormalised to token mass 1 per trajectory;  A' = A w
        additive: A'_k = A_k + alpha s_k / (std_k s + eps)

    s_k is the Bayes decomposition given in the PBSD abstract; the map from s to weights is
    our reading of the paper, which describes it in words (the map of
    ``belief_revision_reweight`` without the recursion). The answer-conditioned teacher
    log-probs are ``teacher``; the student is the rollout policy. Teacher = student gives
    s = 0 and A bit for bit.

    Args:
      batch: the batch; reads the two log-prob fields below, [R, T] each.
      teacher: the answer-conditioned log-probs: the name of an [R, T] extra, or
        ``"old_logprobs"``.
      student: the student log-probs, named the same way (default the rollout's).
      alpha, w_min, w_max, eps, mode, shuffle: as in ``belief_revision_reweight``.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_choice("mode", mode, ("reweight", "additive"))
    check_nonneg("alpha", alpha)
    _check_weight_bounds(w_min, w_max)
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    s = segments.token_to_turn(_gap(b, teacher, student, "pbsd"), b, "sum")
    return _signed_turn_credit(adv, batch, b, s, alpha=alpha, w_min=w_min, w_max=w_max, eps=eps,
                               mode=mode, shuffle=shuffle, seed=seed, axis_name=axis_name)


# ----------------------------------------------------------------------------- DCSD


@register("dcsd", kind="transform", renamed={"lam": "weight"})
def probe_directed_bonus(adv: Advantages, batch: TrajectoryBatch, *,
                         teacher: str = "teacher_logprobs", student: str = "old_logprobs",
                         probe: str = "probe", q_init: float = 0.5, weight: float = 0.1,
                         temperature: float = 1.0, axis_name=None) -> Advantages:
    """DCSD: decoupled credit direction and magnitude, an add-on whose direction comes from a
    success probe and whose size from the teacher-student gap.

        d_k   = sign(q_k - q_{k-1})   (q = ``extras[probe]`` [N, K], the probed probability of
                the correct answer after step k; q_{-1} = ``q_init``)
        mag_k = |sum_{t in k} (lp_T - lp_S)| / mean_k |...|   (mean 1 over the trajectory's
                steps; 0 when every step's gap sums to 0)
        w_t   = n_k softmax_{t in k}(|g_t| / temperature)     (mean 1 within the step)
        A'_t  = A_t + weight d_{k(t)} mag_{k(t)} w_t

    This is our reading of the DCSD paper, which describes the step in words. The direction
    never depends on the teacher; an unchanged probe gives no credit; weight = 0 gives A bit
    for bit. Sign-changing by design (an add-on, not sign preservation).

    Args:
      batch: the batch; reads the two log-prob fields below, [R, T] each, and
        ``extras[probe]`` [N, K].
      teacher: the teacher log-probs: the name of an [R, T] extra, or ``"old_logprobs"``.
      student: the student log-probs, named the same way (default the rollout's).
      probe: the name of the per-turn probed success probability extra, [N, K].
      q_init: the probe's value before the first step.
      weight: >= 0, the coefficient of the add-on.
      temperature: > 0, the softmax temperature within a step.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("weight", weight)
    check_positive("temperature", temperature)
    b = segments.local_view(batch, axis_name)
    g = _gap(b, teacher, student, "dcsd")
    q = turn_field(b, probe, "dcsd", "probed success probability per turn [N, K]",
                   stop_gradient=True)
    valid = segments.valid_turns(b)
    prev = jnp.concatenate([jnp.full_like(q[:, :1], q_init), q[:, :-1]], axis=1)
    d = jnp.where(valid, jnp.sign(q - prev), 0.0)
    mag = jnp.abs(segments.token_to_turn(g, b, "sum"))
    total = jnp.sum(mag, axis=1, keepdims=True)
    count = jnp.sum(valid, axis=1, keepdims=True).astype(jnp.float32)
    mag = jnp.where(valid & (total > 0), mag * count / jnp.where(total > 0, total, 1.0), 0.0)
    a = jnp.abs(g) / temperature
    soft = jnp.where(b.action_mask, jnp.exp(a - _turn_max(a, b)), 0.0)
    w = token_weights(soft, b, level="turn", per="token")
    credit = segments.turn_to_token(d * mag, b) * w
    if weight == 0:
        return _set_token(adv, _base_token(adv, b), b)
    return _set_token(adv, _base_token(adv, b) + weight * credit, b)


# ----------------------------------------------------------------------------- VERPO


@register("verpo", kind="transform", renamed={"lam": "shrink"})
def accepted_evidence_bonus(adv: Advantages, batch: TrajectoryBatch, *,
                            teacher: str = "teacher_logprobs", student: str = "old_logprobs",
                            eta: float = 0.1, shrink: float = 1.0,
                            axis_name=None) -> Advantages:
    """VERPO: accepted, cost-shrunk evidence corrections: tokens whose evidence contrast
    agrees with the sign of their advantage get a larger advantage.

        c_t = lp(y_t | x, evidence) - lp(y_t | x)     (``teacher`` - ``student``)
        accept_t = c_t A_t > 0,  s_t = |c_t| / (1 + shrink c_t^2)
        A'_t = A_t + eta sign(A_t) s_t 1[accept_t]

    This is our reading of the VERPO paper, which describes the step in words. Only
    magnitudes grow, in A's direction (sign preservation); eta = 0 gives A bit for bit. The
    Fisher evidence contrast projection needs hidden states: pass an already corrected c as
    the teacher field.

    Args:
      batch: the batch; reads the two log-prob fields below, [R, T] each.
      teacher: the evidence-conditioned log-probs: the name of an [R, T] extra, or
        ``"old_logprobs"``.
      student: the log-probs without the evidence, named the same way.
      eta: >= 0, the size of the correction.
      shrink: >= 0, how strongly large contrasts are shrunk (the cost term).

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("eta", eta)
    check_nonneg("shrink", shrink)
    b = segments.local_view(batch, axis_name)
    c = _gap(b, teacher, student, "verpo")
    a = _base_token(adv, b)
    accept = (c * a > 0) & b.action_mask
    s = jnp.abs(c) / (1.0 + shrink * c * c)
    return _set_token(adv, jnp.where(accept, a + eta * jnp.sign(a) * s, a), b)


# ----------------------------------------------------------------------------- TACO


@register("taco", kind="transform", renamed={"lam": "damping"})
def tail_risk_damping(adv: Advantages, batch: TrajectoryBatch, *,
                      logprobs: str = "old_logprobs", entropy: str = "entropy",
                      alpha: float = 0.01, damping: float = 0.9,
                      axis_name=None) -> Advantages:
    """TACO: tail-aware credit calibration, damping the positive advantage of tokens in the
    low-probability tail. Pinned: xiuyilou/TACO
    ``verl/trainer/ppo/core_algos.py::compute_taco_token_advantages`` (defaults of
    ``actor.yaml``: alpha = 0.01, lambda = 0.9; ``damping`` is the repository's lambda).

        risk_t = -log pi(y_t) - H_t + log alpha
        w_t = 1 - damping (1 - exp(-risk_t)) if risk_t > 0 else 1    (w in (1 - damping, 1])
        A'_t = w_t A_t where A_t > 0; A_t unchanged (bit for bit) where A_t <= 0

    A dampening, not a re-allocation: no mass conservation. damping = 0 gives A bit for bit.

    Args:
      batch: the batch; reads the two fields below, [R, T] each.
      logprobs: the log-probs of the sampled tokens: the name of an [R, T] extra, or
        ``"old_logprobs"`` (the repository uses the current forward pass, detached).
      entropy: the name of the policy-entropy extra at each token, [R, T].
      alpha: in (0, 1], the tail threshold (risk > 0 where pi(y_t) e^{H_t} < alpha).
      damping: in [0, 1], the largest fraction of a positive advantage removed.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
    check_unit("damping", damping)
    b = segments.local_view(batch, axis_name)
    lp = token_field(b, logprobs, "taco", "log-probs of the sampled tokens [R, T]",
                     stop_gradient=True, valid_only=True)
    h = token_field(b, entropy, "taco", "policy entropy at each token [R, T]",
                    stop_gradient=True, valid_only=True)
    risk = -lp - h + jnp.log(jnp.float32(alpha))
    w = jnp.where(risk > 0, 1.0 + damping * jnp.expm1(-jnp.where(risk > 0, risk, 0.0)), 1.0)
    a = _base_token(adv, b)
    return _set_token(adv, jnp.where(a > 0, w * a, a), b)


# ----------------------------------------------------------------------------- EAPO


@register("eapo", kind="transform")
def entropy_reweight(adv: Advantages, batch: TrajectoryBatch, *, entropy: str = "entropy",
                     a: float = 1.0, shuffle: bool = False, seed: int = 0,
                     axis_name=None) -> Advantages:
    """EAPO: entropic advantage re-allocation, token weights from the policy entropy.

        h~_t = (H_t - min H) / (max H - min H)   (per response; 0 when H is constant)
        w_t  = 1 + a h~_t        where A_t > 0   (surprising successes reinforced more)
             = 1 + a (1 - h~_t)  elsewhere       (confident failures penalised more)
        w <- mean 1 per response;  A'_t = A_t w_t

    This is our reading of the EAPO paper, which describes the step in words. Mass
    conservation (per response), sign preservation, reduction to the base estimator (a = 0
    gives A bit for bit).

    Args:
      batch: the batch; reads ``extras[entropy]`` [R, T].
      entropy: the name of the policy-entropy extra at each token.
      a: >= 0, the strength of the weights.
      shuffle: permute the raw token weights within each response first.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("a", a)
    b = segments.local_view(batch, axis_name)
    h = token_field(b, entropy, "eapo", "policy entropy at each token [R, T]",
                    stop_gradient=True, valid_only=True)
    valid = valid_tokens(b)
    seg = token_trajectories(b)
    n = b.num_traj
    hmin = jax.ops.segment_min(jnp.where(valid, h, jnp.inf).reshape(-1), seg.reshape(-1), n)[seg]
    hmax = jax.ops.segment_max(jnp.where(valid, h, -jnp.inf).reshape(-1), seg.reshape(-1), n)[seg]
    span = hmax - hmin
    hn = jnp.where(valid & (span > 0), (h - hmin) / jnp.where(span > 0, span, 1.0), 0.0)
    raw = jnp.where(_base_token(adv, b) > 0, 1.0 + a * hn, 1.0 + a * (1.0 - hn))
    return _reweight(adv, batch, b, jnp.where(valid, raw, 0.0), per="token", shuffle=shuffle,
                     seed=seed, axis_name=axis_name)


# ----------------------------------------------------------------------------- FIPO


@register("fipo", kind="transform")
def future_kl_reweight(adv: Advantages, batch: TrajectoryBatch, *,
                       current: str = "old_logprobs", gamma: float = 0.99, alpha: float = 0.5,
                       clip: float = 1.0, kl: str = "k1", eps: float = 1e-8,
                       axis_name=None) -> Advantages:
    """FIPO: future-KL influenced token weights: a token's advantage grows or shrinks with
    the discounted policy drift of the tokens after it.

        kl_j = lp_theta(y_j) - lp_old(y_j)   (``current`` - ``batch.old_logprobs``; k3:
               exp(-kl) - 1 + kl)
        F_t  = sum_{j > t} gamma^{j - t} kl_j   over the trajectory's later action tokens
        A'_t = A_t (1 + alpha clip(F_t / s, -clip, clip)),  s = batch std of F (+ eps)

    This is our reading of the FIPO paper, which describes the step in words. With the
    default ``current="old_logprobs"`` (the first PPO epoch) F = 0 and this is the base
    estimator bit for bit. s is the population std over every valid action token of the batch
    (psum over ``axis_name``). The weight lies in [1 - alpha clip, 1 + alpha clip]; alpha clip
    <= 1 keeps signs (sign preservation). Not mass-conserving.

    Args:
      batch: the batch; reads ``old_logprobs`` and the ``current`` field, [R, T] each.
      current: the current policy's log-probs of the sampled tokens (detached): the name of
        an [R, T] extra, or ``"old_logprobs"``.
      gamma: in [0, 1], the discount over later tokens.
      alpha: >= 0, the strength of the weights (alpha clip <= 1).
      clip: > 0, the bound on the standardised influence F_t / s.
      kl: ``"k1"`` or ``"k3"``, the per-token KL estimator.
      eps: > 0, added to s.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_choice("kl", kl, ("k1", "k3"))
    check_unit("gamma", gamma)
    check_nonneg("alpha", alpha)
    check_positive("clip", clip)
    check_positive("eps", eps)
    if alpha * clip > 1.0:
        raise ValueError(f"alpha * clip must be <= 1 (weights >= 0), got {alpha} * {clip}")
    b = segments.local_view(batch, axis_name)
    valid = valid_tokens(b)
    r = token_field(b, current, "fipo", "current-policy log-probs [R, T]",
                    stop_gradient=True, valid_only=True) - lax.stop_gradient(
        jnp.where(valid, b.old_logprobs, 0.0))
    x = r if kl == "k1" else jnp.expm1(-r) + r
    _, nxt = segments.trajectory_reverse_scan(jnp.where(valid, x, 0.0), gamma, b)
    f = jnp.where(valid, gamma * nxt, 0.0)
    _, var = segments.masked_mean_var(f, valid, axis_name)
    ratio = jnp.clip(f / (segments.safe_sqrt(var) + eps), -clip, clip)
    return _set_token(adv, _base_token(adv, b) * (1.0 + alpha * ratio), b)


# ----------------------------------------------------------------------------- CRAFT CTI


@register("craft_cti", kind="transform", renamed={"lam": "weight"})
def counterfactual_importance_bonus(adv: Advantages, batch: TrajectoryBatch, *,
                                    teacher: str = "teacher_logprobs",
                                    student: str = "old_logprobs", temperature: float = 1.0,
                                    weight: float = 0.1, anchor: str = "state",
                                    scale: str = "sign", axis_name=None) -> Advantages:
    """CRAFT's counterfactual token importance (CTI, the first pillar of CRAFT) as an add-on:
    how much re-weighting an anchor group's turns by the teacher's preference moves its mean
    advantage.

        delta_m = sum_{t in step of m} (lp_T - lp_S)            (per turn of member m)
        w_m     = exp(delta_m / temperature)                     (SNIS over the anchor group S)
        CTI(S)  = sum_m w_m A_m / sum_m w_m - mean_m A_m
        c_t     = CTI(S(k(t))) sign(g_t)   (``scale="relative"``: CTI g_t / max_{t' in k}|g|)
        A'_t    = A_t + weight c_t

    This is our reading of the CRAFT paper, which describes the step in words; the
    self-normalised importance sampling (SNIS) follows gitrxh/ADRS-arxiv ``cce_utils.py``.
    Anchor groups S: ``"state"`` = turns of one task group with equal ``state_keys`` (GiGPO
    anchors; at the first step usually the whole prompt group), ``"step"`` = turns of one task
    group with equal turn index (note: ``jaxrl_agent.losses.distill.craft_credit`` with
    ``level="step"`` means the ``"state"`` anchor here, and its ``credit="relative"`` divides
    by the trajectory's max |g| where ``scale="relative"`` here divides by the turn's).
    Sign-changing by design (not sign preservation). Equal delta in a group gives CTI = 0
    exactly (A bit for bit); SNIS is invariant to a constant added to a group's delta.
    A_m is ``adv.turn`` (the token mean per turn when it is None); g_t = lp_T - lp_S.

    Args:
      batch: the batch; reads the two log-prob fields below, [R, T] each, ``group_ids`` [N]
        and (``anchor="state"``) ``state_keys`` [N, K].
      teacher: the teacher log-probs: the name of an [R, T] extra, or ``"old_logprobs"``.
      student: the student log-probs, named the same way (default the rollout's).
      temperature: > 0, the temperature of the importance weights.
      weight: >= 0, the coefficient of the add-on.
      anchor: ``"state"`` or ``"step"``, the anchor groups above.
      scale: ``"sign"`` or ``"relative"``, how CTI is spread over a turn's tokens.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_positive("temperature", temperature)
    check_nonneg("weight", weight)
    check_choice("anchor", anchor, ("state", "step"))
    check_choice("scale", scale, ("sign", "relative"))
    b = segments.local_view(batch, axis_name)
    g = _gap(b, teacher, student, "craft_cti")
    n, k = b.num_traj, b.num_turns
    valid = segments.valid_turns(b)
    key = b.state_keys if anchor == "state" else jnp.broadcast_to(jnp.arange(k)[None, :], (n, k))
    ids = segments.turn_key_ids(b, key).reshape(-1)
    ok = valid.reshape(-1)
    x = (segments.token_to_turn(g, b, "sum") / temperature).reshape(-1)
    a = _base_turn(adv, b).reshape(-1)

    def seg_sum(v):
        return jax.ops.segment_sum(jnp.where(ok, v, 0.0), ids, n * k)

    top = jax.ops.segment_max(jnp.where(ok, x, -jnp.inf), ids, n * k)
    safe = jnp.clip(ids, 0, n * k - 1)
    w = jnp.where(ok, jnp.exp(x - top[safe]), 0.0)
    sw, cnt = seg_sum(w), seg_sum(jnp.ones_like(w))
    cti = seg_sum(w * a) / jnp.where(sw > 0, sw, 1.0) - seg_sum(a) / jnp.maximum(cnt, 1.0)
    cti = jnp.where(ok, cti[safe], 0.0).reshape(n, k)
    if scale == "sign":
        unit = jnp.sign(g)
    else:
        gmax = _turn_max(jnp.abs(g), b)
        unit = jnp.where(gmax > 0, g / jnp.where(gmax > 0, gmax, 1.0), 0.0)
    if weight == 0:
        return _set_token(adv, _base_token(adv, b), b)
    return _set_token(adv, _base_token(adv, b) + weight * segments.turn_to_token(cti, b) * unit,
                      b)
