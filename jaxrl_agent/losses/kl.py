"""KL penalties against a reference policy, and the entropy bonus.

Per-token estimators of KL(pi || pi_ref) from the log-probs of the sampled tokens
(Schulman 2020, "Approximating KL divergence"; names as in verl ``kl_penalty``), with
lp = current log-probs, ref = reference log-probs, d = ref - lp:

======== ================================================== ===========================
name     value                                              gradient w.r.t. lp
======== ================================================== ===========================
k1       lp - ref                                           1
k2       0.5 (lp - ref)^2                                   lp - ref
k3       exp(d) - d - 1 (d clamped to [-20, 20], the value  1 - exp(d)
         to [-10, 10]; verl ``low_var_kl``)
k1_st    value of k1, gradient of k2 (straight-through)     lp - ref
k3_st    value of k3, gradient of k2 (verl ``k3+``)          lp - ref
======== ================================================== ===========================

k2, k3 >= 0 and all are 0 at lp = ref. The loss wrappers ``k1 ... k3_st`` read
``batch.extras["ref_logprobs"]`` (or ``ref_logprobs=``), stop its gradient, and aggregate like
every loss here into ``(sum, denominator)``; the trainer adds ``beta * sum / denominator``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agent.batch import TrajectoryBatch
from jaxrl_agent.losses.aggregation import aggregate, check_mode, check_token_array
from jaxrl_agent.registry import register

sg = jax.lax.stop_gradient


# ----------------------------------------------------------------------------- per token


def kl_k1(lp, ref):
    """k1 = lp - ref (unbiased, high variance, can be negative)."""
    return lp - ref


def kl_k2(lp, ref):
    """k2 = 0.5 (lp - ref)^2 (>= 0; its gradient is the one of the true reverse KL on-policy)."""
    return 0.5 * jnp.square(lp - ref)


def kl_k3(lp, ref):
    """k3 = exp(d) - d - 1 with d = clip(ref - lp, -20, 20), clipped to [-10, 10] (>= 0)."""
    d = jnp.clip(ref - lp, -20.0, 20.0)
    return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


def _straight_through(value, surrogate):
    # forward: value; backward: d surrogate.
    return surrogate + sg(value - surrogate)


def kl_k1_st(lp, ref):
    """Forward value k1, gradient of k2 (straight-through)."""
    return _straight_through(kl_k1(lp, ref), kl_k2(lp, ref))


def kl_k3_st(lp, ref):
    """Forward value k3, gradient of k2 (straight-through; verl ``low_var_kl+``/``k3+``)."""
    return _straight_through(kl_k3(lp, ref), kl_k2(lp, ref))


# ----------------------------------------------------------------------------- losses


def _ref_logprobs(batch: TrajectoryBatch, ref_logprobs, name):
    if ref_logprobs is None:
        ref_logprobs = batch.extras.get("ref_logprobs")
    if ref_logprobs is None:
        raise ValueError(f"{name} needs extras['ref_logprobs'] [R, T] (reference-model "
                         f"log-probs), or pass ref_logprobs=")
    return check_token_array("ref_logprobs", ref_logprobs, batch)


def _kl_loss(fn, name, logprobs, batch, ref_logprobs, agg, agg_constant, axis_name):
    check_mode(agg)
    ref = _ref_logprobs(batch, ref_logprobs, name)
    check_token_array("logprobs", logprobs, batch)
    m = batch.action_mask
    lp = jnp.where(m, jnp.asarray(logprobs, jnp.float32), 0.0)
    ref = sg(jnp.where(m, jnp.asarray(ref, jnp.float32), 0.0))
    return aggregate(fn(lp, ref), batch, agg, constant=agg_constant, axis_name=axis_name)


def _kl_penalty(name, per_token, doc):
    """The registered loss ``name``: ``per_token`` (one of the ``kl_*`` above) between the
    current and the reference log-probs, aggregated over the action tokens."""
    def loss(logprobs, batch: TrajectoryBatch, *, ref_logprobs=None, agg="token_mean",
             agg_constant=None, axis_name=None):
        return _kl_loss(per_token, name, logprobs, batch, ref_logprobs, agg, agg_constant,
                        axis_name)

    loss.__name__ = loss.__qualname__ = name
    loss.__doc__ = doc
    return register(name, kind="loss")(loss)


k1 = _kl_penalty("k1", kl_k1, "KL penalty with ``kl_k1``: ``(sum, denominator)`` of lp - sg(ref) "
                 "over action tokens.")
k2 = _kl_penalty("k2", kl_k2, "KL penalty with ``kl_k2``: 0.5 (lp - sg(ref))^2.")
k3 = _kl_penalty("k3", kl_k3, "KL penalty with ``kl_k3`` (low-variance, >= 0; GRPO's KL term).")
k1_st = _kl_penalty("k1_st", kl_k1_st,
                    "KL penalty valued as k1, differentiated as k2 (``kl_k1_st``).")
k3_st = _kl_penalty("k3_st", kl_k3_st,
                    "KL penalty valued as k3, differentiated as k2 (``kl_k3_st``).")


# ----------------------------------------------------------------------------- entropy


def entropy_from_logits(logits):
    """Categorical entropy per position, H = -sum_v p_v log p_v with log p = log_softmax.

    Args:
      logits: [..., V]; entries may be -inf (masked vocabulary): they contribute 0, and the
        gradient stays finite.

    Returns:
      [...] float32 (e.g. [R, T] for [R, T, V] logits).
    """
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    p = jnp.exp(logp)
    logp = jnp.where(p > 0, logp, 0.0)  # 0 * log 0 = 0, also in the gradient
    return -jnp.sum(p * logp, axis=-1)


@register("entropy", kind="loss")
def entropy(token_entropy, batch: TrajectoryBatch, *, agg="token_mean", agg_constant=None,
            axis_name=None):
    """The entropy itself, aggregated: ``(sum, denominator)`` of H over action tokens.

    It is a bonus: the trainer subtracts ``coef * sum / denominator`` from the loss.
    ``token_entropy`` [R, T] comes from ``entropy_from_logits``.
    """
    return aggregate(token_entropy, batch, agg, constant=agg_constant, axis_name=axis_name)
