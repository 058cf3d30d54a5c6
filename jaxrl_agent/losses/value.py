"""Value-function (critic) loss, at token level [R, T] or turn level [N, K]."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jaxrl_agent.registry import register

sg = jax.lax.stop_gradient


@register("value", kind="loss")
def value(values, returns, mask, *, old_values=None, clip=None):
    """Squared-error value loss, optionally PPO-style clipped, as ``(sum, denominator)``.

    l = 0.5 (v - sg(R))^2. With ``clip`` = eps and ``old_values``:
    v_c = sg(v_old) + clip(v - sg(v_old), -eps, eps) and
    l = 0.5 max((v - sg(R))^2, (v_c - sg(R))^2)  (verl ``compute_value_loss``).
    sum = sum(mask l), denominator = sum(mask).

    Works at any level as long as the arrays and the mask match: token level
    (``values``/``returns`` [R, T] with ``batch.action_mask``) or turn level ([N, K] with
    ``batch.turn_mask``). Only ``values`` carries gradient. Entries outside ``mask``
    are selected away, so they may hold anything; an empty mask gives (0, 0).

    Args:
      values: predicted values V(s).
      returns: targets (e.g. ``Advantages.token_returns`` or ``turn_returns``).
      mask: bool (or 0/1) array of the same shape.
      old_values: the values at sampling time; required when ``clip`` is set.
      clip: eps of the clipped loss, or None.
    """
    shape = jnp.shape(values)
    for name, x in (("returns", returns), ("mask", mask), ("old_values", old_values)):
        if x is not None and jnp.shape(x) != shape:
            raise ValueError(f"{name} must have the shape of values {shape}, got {jnp.shape(x)}")
    if clip is not None and old_values is None:
        raise ValueError("value: clip needs old_values (the values at sampling time)")
    if isinstance(clip, numbers.Real) and clip < 0:
        raise ValueError(f"value: clip must be >= 0, got {clip}")
    m = jnp.asarray(mask).astype(bool)
    v = jnp.where(m, jnp.asarray(values, jnp.float32), 0.0)
    ret = sg(jnp.where(m, jnp.asarray(returns, jnp.float32), 0.0))
    err = jnp.square(v - ret)
    if clip is not None:
        old = sg(jnp.where(m, jnp.asarray(old_values, jnp.float32), 0.0))
        v_clipped = old + jnp.clip(v - old, -clip, clip)
        err = jnp.maximum(err, jnp.square(v_clipped - ret))
    per = jnp.where(m, 0.5 * err, 0.0)
    return jnp.sum(per), jnp.sum(m.astype(jnp.float32))


@register("sarsa", kind="loss")
def sarsa(q_values, batch, *, gamma: float = 1.0):
    """SAPO's auxiliary on-policy SARSA loss over turns, as ``(sum, denominator)``.

    Q_k = Q(s_k, a_k), the value head read after action k (``segments.turn_values_from_tokens
    (values, batch, "last_action")``), [N, K]. Target y_k = r_k + gamma sg(Q_{k+1}), with
    Q past the trajectory's last turn = 0 (terminal), so a one-turn episode regresses Q on r.
    l = 0.5 (Q_k - y_k)^2; sum over valid turns, denominator = number of valid turns. Only
    Q_k carries gradient (the target is stop-gradient).
    """
    n, k = batch.turn_mask.shape
    if jnp.shape(q_values) != (n, k):
        raise ValueError(f"sarsa: q_values must have shape [N, K] = {(n, k)}, got "
                         f"{jnp.shape(q_values)}")
    if isinstance(gamma, numbers.Real) and not 0.0 <= gamma <= 1.0:
        raise ValueError(f"sarsa: gamma must lie in [0, 1], got {gamma}")
    m = jnp.asarray(batch.turn_mask).astype(bool)
    q = jnp.where(m, jnp.asarray(q_values, jnp.float32), 0.0)
    q_next = jnp.concatenate([q[:, 1:], jnp.zeros_like(q[:, :1])], axis=1)
    r = jnp.where(m, jnp.asarray(batch.turn_rewards, jnp.float32), 0.0)
    target = sg(r + gamma * q_next)
    per = jnp.where(m, 0.5 * jnp.square(q - target), 0.0)
    return jnp.sum(per), jnp.sum(m.astype(jnp.float32))
