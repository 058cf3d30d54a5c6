"""Value-function (critic) loss, at token level [R, T] or turn level [N, K]."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

sg = jax.lax.stop_gradient


def value(values, returns, mask, *, old_values=None, clip=None):
    """Squared-error value loss, optionally PPO-style clipped, as ``(sum, denominator)``.

    l = 0.5 (v - sg(R))^2. With ``clip`` = eps and ``old_values``:
    v_c = sg(v_old) + clip(v - sg(v_old), -eps, eps) and
    l = 0.5 max((v - sg(R))^2, (v_c - sg(R))^2)  (verl ``compute_value_loss``).
    sum = sum(mask l), denominator = sum(mask).

    Works at any level as long as the arrays and the mask match: token level
    (``values``/``returns`` [R, T] with ``batch.action_mask``) or turn level ([N, K] with
    ``batch.turn_mask``). Only ``values`` carries gradient (P15). Entries outside ``mask``
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
