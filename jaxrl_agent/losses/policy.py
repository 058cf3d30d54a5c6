"""Policy-gradient losses: PPO-clip, GSPO, CISPO, the soft gate, REINFORCE, and IS weights.

Every loss is ``f(logprobs, batch, advantages, *, hyper-params, agg, agg_constant, axis_name)
-> (sum, denominator)``:

* ``logprobs`` [R, T]: log-probs of ``batch.tokens`` under the current policy (differentiable).
* ``advantages``: an [R, T] array or anything with a ``.token`` [R, T] attribute
  (``jaxrl_agent.batch.Advantages``).
* the pair is aggregated over ``batch.action_mask`` by ``aggregation.aggregate`` with mode
  ``agg`` (``agg_constant`` is C of ``seq_mean_token_sum_norm``; ``axis_name`` localises
  ``row_traj`` inside ``shard_map`` and is needed only by ``traj_mean_token_mean`` and
  GSPO's ``level="turn"``). Divide only after summing pairs over micro-batches and devices.

Only ``logprobs`` carries gradient: advantages, old/proximal log-probs and IS weights are
wrapped in ``jax.lax.stop_gradient``. Entries outside ``action_mask`` are replaced by 0
before any arithmetic, so padding never produces NaN, in the value or in the gradient.

Notation: lp = ``logprobs``, lp_old = the log-probs the ratio is taken against (default
``batch.old_logprobs``), A = advantages, m = ``action_mask``, sg = stop_gradient,
ratio r = exp(clip(lp - lp_old, -20, 20)).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from jaxrl_agent import segments
from jaxrl_agent.batch import TrajectoryBatch
from jaxrl_agent.checks import check_choice
from jaxrl_agent.losses.aggregation import aggregate, check_mode, check_token_array
from jaxrl_agent.registry import register

sg = jax.lax.stop_gradient
LOG_RATIO_CLAMP = 20.0
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
GSPO_LEVELS = ("sequence", "turn")


# ----------------------------------------------------------------------------- helpers


def advantage_array(advantages):
    """The [R, T] token advantages of an array or of an object with a ``.token`` attribute."""
    return getattr(advantages, "token", advantages)


def _masked(x, mask, name, batch):
    check_token_array(name, x, batch)
    return jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0)


def _prepare(logprobs, batch: TrajectoryBatch, advantages, old_logprobs=None, is_weights=None):
    """Masked float32 inputs: (m, lp, sg(lp_old), sg(A), sg(w) or None)."""
    m = batch.action_mask
    lp = _masked(logprobs, m, "logprobs", batch)
    old = batch.old_logprobs if old_logprobs is None else old_logprobs
    old = sg(_masked(old, m, "old_logprobs", batch))
    adv = sg(_masked(advantage_array(advantages), m, "advantages", batch))
    w = None if is_weights is None else sg(_masked(is_weights, m, "is_weights", batch))
    return m, lp, old, adv, w


def log_ratio(logprobs, old_logprobs):
    """clip(lp - lp_old, -20, 20): the clamp keeps exp() finite (as verl does)."""
    return jnp.clip(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip=None):
    """Per-token PPO-clip loss.

    l1 = -A r,  l2 = -A clip(r, 1 - clip_low, 1 + clip_high),  l = max(l1, l2);
    dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"): for A < 0,
    l = min(l, -A c) with c = ``dual_clip`` > 1, which bounds the loss of negative-advantage
    tokens whose ratio exploded.

    All arguments broadcast (clip bounds may be [R, T] arrays, e.g. per-turn clip ranges).
    The gradient w.r.t. r is -A inside the clip region and 0 once r has left it in the
    direction that A pushes (r > 1 + clip_high for A > 0, r < 1 - clip_low for A < 0).
    """
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(l1, l2)
    if dual_clip is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -adv * dual_clip), loss)
    return loss


def _finish(per_token, w, batch, agg, agg_constant, axis_name):
    if w is not None:
        per_token = per_token * w
    return aggregate(per_token, batch, agg, constant=agg_constant, axis_name=axis_name)


# ----------------------------------------------------------------------------- losses


@register("ppo", kind="loss")
def ppo(logprobs, batch: TrajectoryBatch, advantages, *, clip_low=0.2, clip_high=0.2,
        dual_clip=3.0, old_logprobs=None, is_weights=None, agg="token_mean",
        agg_constant=None, axis_name=None):
    """PPO clipped surrogate with asymmetric ("clip-higher") and dual clip.

    r = exp(clip(lp - lp_old, -20, 20));  l = ``clipped_surrogate(r, A, clip_low, clip_high,
    dual_clip)``;  l *= w if ``is_weights`` is given; aggregated with ``agg``.

    Schulman et al. 2017 (PPO); clip-higher from DAPO (Yu et al. 2025, which uses
    clip_high = 0.28); dual clip c = 3 as in verl ``compute_policy_loss_vanilla``.

    Args:
      logprobs: [R, T] current log-probs (differentiable).
      batch: the batch; ``old_logprobs`` is the default lp_old.
      advantages: [R, T] array or ``Advantages``.
      clip_low, clip_high: clip range [1 - clip_low, 1 + clip_high]; scalars or [R, T].
      dual_clip: c > 1 of the dual clip, or None to disable it.
      old_logprobs: [R, T] lp_old overriding ``batch.old_logprobs`` (e.g. the proximal
        policy of decoupled PPO, with ``is_weights`` from ``truncated_is_weights``).
      is_weights: optional [R, T] per-token weights (stop-gradient), e.g. rollout IS weights.
      agg, agg_constant, axis_name: see ``aggregation.aggregate``.

    Returns:
      ``(sum, denominator)``. At r = 1 the gradient of sum / denominator w.r.t. lp is
      -A m / denominator (token_mean). All-masked batch: (0, 0).
    """
    check_mode(agg)
    if isinstance(dual_clip, numbers.Real) and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    m, lp, old, adv, w = _prepare(logprobs, batch, advantages, old_logprobs, is_weights)
    ratio = jnp.exp(log_ratio(lp, old))
    per_token = clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    return _finish(per_token, w, batch, agg, agg_constant, axis_name)


def gspo_log_ratio(logprobs, batch: TrajectoryBatch, *, old_logprobs=None, level="sequence",
                   axis_name=None):
    """GSPO's length-normalised log-ratio, per token, with a per-token gradient [R, T].

    log s = mean of (lp - lp_old) over the action tokens of the token's row
    (``level="sequence"``) or of its turn (``level="turn"``: grouped by (row_traj, turn_id),
    the action-level ratio of GAGPO / StepPO / MA-RLHF; in the ``per_step`` layout both levels
    coincide). Returned value: sg(clip(log s, -20, 20)) + lp - sg(lp), i.e. log s in the
    forward pass and d/d lp = 1 per token, so exp() of it is GSPO-token's
    s_{i,t} = sg(s_i) pi(y_t) / sg(pi(y_t)). The value is constant within a row (turn); 0
    outside ``action_mask``. Rows/turns without action tokens give 0 (no NaN).
    """
    check_choice("level", level, GSPO_LEVELS)
    m = batch.action_mask
    lp = _masked(logprobs, m, "logprobs", batch)
    old = batch.old_logprobs if old_logprobs is None else old_logprobs
    diff = sg(lp - _masked(old, m, "old_logprobs", batch))
    if level == "sequence":
        n = jnp.sum(m, axis=1, keepdims=True).astype(jnp.float32)
        log_s = jnp.broadcast_to(jnp.sum(diff, axis=1, keepdims=True) / jnp.maximum(n, 1.0),
                                 diff.shape)
    else:
        b = segments.localize(batch, axis_name)
        log_s = segments.turn_to_token(segments.token_to_turn(diff, b, reduce="mean"), b)
    log_s = jnp.clip(log_s, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.where(m, log_s + lp - sg(lp), 0.0)


@register("gspo", kind="loss")
def gspo(logprobs, batch: TrajectoryBatch, advantages, *, clip_low=3e-4, clip_high=4e-4,
         level="sequence", old_logprobs=None, is_weights=None, agg="seq_mean_token_mean",
         agg_constant=None, axis_name=None):
    """GSPO: PPO-clip with a sequence- (or turn-) level, length-normalised ratio.

    s = exp(``gspo_log_ratio``) (constant within a row / turn in value; gradient per token);
    l = max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high)) (no dual clip); l *= w if
    ``is_weights``; aggregated with ``agg`` (default seq_mean_token_mean, as in the paper).

    Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv 2507.18071); the default
    clip range 3e-4 / 4e-4 is the paper's. ``level="turn"`` is the per-turn (action-level)
    variant. For turns (sequences) of one action token it equals ``ppo`` with the same clip
    range and ``dual_clip=None``.

    Returns:
      ``(sum, denominator)``; all-masked batch: (0, 0).
    """
    check_mode(agg)
    check_choice("level", level, GSPO_LEVELS)
    _, _, _, adv, w = _prepare(logprobs, batch, advantages, old_logprobs, is_weights)
    ratio = jnp.exp(gspo_log_ratio(logprobs, batch, old_logprobs=old_logprobs, level=level,
                                   axis_name=axis_name))
    per_token = clipped_surrogate(ratio, adv, clip_low, clip_high, None)
    return _finish(per_token, w, batch, agg, agg_constant, axis_name)


@register("cispo", kind="loss")
def cispo(logprobs, batch: TrajectoryBatch, advantages, *, clip_low=1.0, clip_high=0.2,
          old_logprobs=None, is_weights=None, agg="token_mean", agg_constant=None,
          axis_name=None):
    """CISPO: REINFORCE weighted by a clipped, stop-gradient IS ratio.

    l = -sg(clip(r, 1 - clip_low, 1 + clip_high)) A lp;  d l / d lp = -clip(r) A, so no token's
    gradient is ever dropped (only its weight is capped). l *= w if ``is_weights``.

    MiniMax-M1 (arXiv 2506.13585): no lower bound on the IS weight and only the upper bound
    tuned; hence clip_low = 1 (lower bound 0, never active) by default. The upper default
    clip_high = 0.2 is verl's CISPO example
    (``examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh``: ``clip_ratio_low=10``,
    ``clip_ratio_high=0.2``). ScaleRL (arXiv 2510.13786) caps the weight at 5 instead
    (TRL ``loss_type="cispo", epsilon_high=5.0``, an absolute cap), i.e. clip_high = 4 here.
    Note the value of the loss depends on lp itself; only its gradient is meaningful.

    Returns:
      ``(sum, denominator)``; all-masked batch: (0, 0).
    """
    check_mode(agg)
    m, lp, old, adv, w = _prepare(logprobs, batch, advantages, old_logprobs, is_weights)
    weight = sg(jnp.clip(jnp.exp(log_ratio(lp, old)), 1.0 - clip_low, 1.0 + clip_high))
    return _finish(-weight * adv * lp, w, batch, agg, agg_constant, axis_name)


def soft_gate_fn(ratio, tau):
    """f(r) = sigmoid(tau (r - 1)) 4 / tau: f(1) = 2 / tau, f'(1) = 1, bounded in (0, 4/tau)."""
    return jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


@register("soft_gate", kind="loss")
def soft_gate(logprobs, batch: TrajectoryBatch, advantages, *, tau_pos=1.0, tau_neg=1.05,
              old_logprobs=None, is_weights=None, agg="token_mean", agg_constant=None,
              axis_name=None):
    """Soft-gated ratio loss of Soft Adaptive Policy Optimization (Gao et al. 2025,
    arXiv 2511.20347), which verl and TRL call ``sapo``.

    NOT this project's "SAPO" (Single-rollout Autoregressive Policy Optimization, an advantage
    estimator); hence the name ``soft_gate``.

    l = -A f(r),  f(r) = sigmoid(tau (r - 1)) 4 / tau,  tau = tau_pos if A > 0 else tau_neg.
    f'(1) = 1, so at r = 1 the gradient equals the plain policy gradient -A d lp; away from
    r = 1 it decays smoothly instead of being cut by a hard clip. Defaults (1.0, 1.05) are
    the paper's, also verl's and TRL's. l *= w if ``is_weights``.

    Returns:
      ``(sum, denominator)``; all-masked batch: (0, 0).
    """
    check_mode(agg)
    m, lp, old, adv, w = _prepare(logprobs, batch, advantages, old_logprobs, is_weights)
    ratio = jnp.exp(log_ratio(lp, old))
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    return _finish(-adv * soft_gate_fn(ratio, tau), w, batch, agg, agg_constant, axis_name)


@register("reinforce", kind="loss")
def reinforce(logprobs, batch: TrajectoryBatch, advantages, *, is_weights=None,
              agg="token_mean", agg_constant=None, axis_name=None):
    """REINFORCE / vanilla policy gradient: l = -A lp (times sg(w) if ``is_weights``).

    Williams 1992. With IS weights w = pi_prox / pi_sampler it is the off-policy-corrected
    policy gradient (verl ``bypass_mode`` with ``loss_type: reinforce``).

    Returns:
      ``(sum, denominator)``; all-masked batch: (0, 0).
    """
    check_mode(agg)
    m, lp, _, adv, w = _prepare(logprobs, batch, advantages, None, is_weights)
    return _finish(-adv * lp, w, batch, agg, agg_constant, axis_name)


# ----------------------------------------------------------------------------- IS weights


def truncated_is_weights(proximal_logprobs, batch: TrajectoryBatch, *, level="token", cap=2.0,
                         mode="truncate", lower=None):
    """Importance weights for the sampler/trainer mismatch, stop-gradient [R, T].

    w = exp(lp_prox - lp_sampler) with lp_sampler = ``batch.old_logprobs`` (what the sampler
    reported) and lp_prox = ``proximal_logprobs`` (the trainer's recomputation, e.g. before
    the update). ``level="token"``: one weight per token; ``level="sequence"``: the geometric
    mean over the row's action tokens, exp(mean_t (lp_prox - lp_sampler)), on every token of
    the row. The log-ratio is clamped to [-20, 20].

    ``mode="truncate"``: w := min(w, cap) (truncated IS, Ionides 2008; verl ``rollout_is``
    with ``rollout_is_threshold``). ``mode="mask"``: w := 1 if lower <= w <= cap else 0 (the
    token / sequence is dropped; ``lower`` defaults to 0).

    With lp_prox = lp_sampler every weight is 1. 0 outside ``action_mask``; rows without action
    tokens give 0, never NaN. Multiply into a loss with ``is_weights=``.
    """
    check_choice("level", level, IS_LEVELS)
    check_choice("mode", mode, IS_MODES)
    m = batch.action_mask
    diff = sg(_masked(proximal_logprobs, m, "proximal_logprobs", batch)
              - _masked(batch.old_logprobs, m, "old_logprobs", batch))
    if level == "sequence":
        n = jnp.sum(m, axis=1, keepdims=True).astype(jnp.float32)
        diff = jnp.broadcast_to(jnp.sum(diff, axis=1, keepdims=True) / jnp.maximum(n, 1.0),
                                diff.shape)
    w = jnp.exp(jnp.clip(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode == "truncate":
        w = jnp.minimum(w, cap)
    else:
        lo = 0.0 if lower is None else lower
        w = ((w >= lo) & (w <= cap)).astype(jnp.float32)
    return sg(jnp.where(m, w, 0.0))


# ----------------------------------------------------------------------------- metrics


def policy_metrics(logprobs, batch: TrajectoryBatch, advantages, *, clip_low=0.2,
                   clip_high=0.2, dual_clip=None, old_logprobs=None):
    """Diagnostics as token-mean ``(sum, denominator)`` pairs (no gradient), with
    r = exp(clip(lp - lp_old, -20, 20)) and A the advantages:

    * ``clip_fraction``: share of action tokens whose clipped term is active,
      -A clip(r) > -A r (their gradient is cut), as verl's ``pg_clipfrac``;
    * ``clip_low_fraction``: A < 0 and r < 1 - clip_low (the lower bound cut the gradient);
    * ``clip_high_fraction``: A > 0 and r > 1 + clip_high (the upper bound cut it);
      ``clip_fraction`` = low + high;
    * ``dual_clip_fraction``: A < 0 and r > ``dual_clip`` (only when ``dual_clip`` is given):
      tokens whose loss the dual clip bounds (verl's ``pg_clipfrac_lower``);
    * ``approx_kl``: mean of lp_old - lp (verl's ``ppo_kl``), the k1 estimate of
      KL(old || new) from tokens sampled by the old policy (unbiased, can be negative);
    * ``approx_kl_k3``: mean of (r - 1) - log r, the k3 estimate of the same KL (unbiased
      too, never negative, lower variance).

    All are 0 when the policy has not moved (r = 1), e.g. in the first update of a step
    whose log-probs equal the sampler's.
    """
    m, lp, old, adv, _ = _prepare(sg(logprobs), batch, advantages, old_logprobs)
    lr = log_ratio(lp, old)
    ratio = jnp.exp(lr)
    low = (adv < 0) & (ratio < 1.0 - clip_low)
    high = (adv > 0) & (ratio > 1.0 + clip_high)
    f = lambda x: aggregate(x.astype(jnp.float32), batch)  # noqa: E731
    out = {"clip_fraction": f(low | high), "clip_low_fraction": f(low),
           "clip_high_fraction": f(high)}
    if dual_clip is not None:
        out["dual_clip_fraction"] = f((adv < 0) & (ratio > dual_clip))
    out["approx_kl"] = aggregate(old - lp, batch)
    out["approx_kl_k3"] = aggregate(ratio - 1.0 - lr, batch)
    return out
