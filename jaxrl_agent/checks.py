"""Checks and field readers shared by estimators and losses: clear errors instead of NaN or
garbage, at trace time.

The checks run when a function is traced (before anything is compiled), on Python values;
traced hyper-parameters (passed as jit arguments) are not checked. ``require`` raises
``MissingInput`` (a ValueError naming the field), so callers can tell a missing input from a
bad value without reading the message.
"""

import numbers

import jax.numpy as jnp

from jaxrl_agent import segments
from jaxrl_agent.batch import TrajectoryBatch
from jaxrl_agent.registry import MissingInput


def is_static_real(x) -> bool:
    """A Python (or NumPy) real number, not a bool and not a tracer: a value we can check."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_unit(name, value):
    if is_static_real(value) and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


def check_positive(name, value):
    if is_static_real(value) and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def check_optional_positive(name, value):
    """``None`` (off) or > 0."""
    if value is not None:
        check_positive(name, value)


def check_nonneg(name, value):
    """A scale whose sign would invert the method must be >= 0."""
    if is_static_real(value) and not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def require(batch, field, who, what):
    """``batch.extras[field]``, or ``MissingInput`` naming the missing field and its shape."""
    if field not in batch.extras:
        have = sorted(batch.extras) or "none"
        raise MissingInput(f"{who} needs extras['{field}'] ({what}); the batch has extras: "
                           f"{have}", field)
    return batch.extras[field]


# ----------------------------------------------------------------------------- batch fields


def shape_error(who, name, what, shape, got):
    return ValueError(f"{who}: {name} must have shape {what} = {shape}, got {tuple(got)}")


def token_field(batch: TrajectoryBatch, name: str, who: str, *, override=None,
                what: str = "log-probs of the sampled tokens"):
    """A per-token float array [R, T], 0 outside ``action_mask``, NOT stop-gradient.

    ``override`` (an array) wins over the field; ``name == "old_logprobs"`` reads
    ``batch.old_logprobs``; otherwise ``batch.extras[name]`` (ValueError naming the field).
    """
    if override is not None:
        x, label = override, f"the array given for {name!r}"
    elif name == "old_logprobs":
        x, label = batch.old_logprobs, "old_logprobs"
    else:
        x, label = require(batch, name, who, f"[R, T] {what}"), f"extras['{name}']"
    shape = tuple(batch.action_mask.shape)
    if tuple(jnp.shape(x)) != shape:
        raise shape_error(who, label, "[R, T]", shape, jnp.shape(x))
    return jnp.where(batch.action_mask, jnp.asarray(x, jnp.float32), 0.0)


def spread_field(batch: TrajectoryBatch, name: str, who: str, what: str, *, override=None):
    """A per-token view [R, T] of a signal given per token [R, T], per turn [N, K] (each token
    of turn k gets the turn's value) or per trajectory [N]; 0 outside ``action_mask``.
    ``name == "outcome"`` reads ``batch.outcome``. ``batch`` must be block-local."""
    if override is not None:
        x = override
    elif name == "outcome":
        x = batch.outcome
    elif name == "old_logprobs":
        x = batch.old_logprobs
    else:
        x = require(batch, name, who, f"{what}: [R, T], [N, K] or [N]")
    x = jnp.asarray(x)
    shape = tuple(x.shape)
    m = batch.action_mask
    if shape == tuple(m.shape):
        return jnp.where(m, x.astype(jnp.float32), 0.0)
    if shape == tuple(batch.turn_mask.shape):
        x = jnp.where(batch.turn_mask, x.astype(jnp.float32), 0.0)
        return segments.turn_to_token(x, batch)
    if shape == (batch.num_traj,):
        x = jnp.where(batch.traj_mask, x.astype(jnp.float32), 0.0)
        return segments.traj_to_token(x, batch)
    raise ValueError(f"{who}: {name!r} ({what}) must have shape [R, T] = {tuple(m.shape)}, "
                     f"[N, K] = {tuple(batch.turn_mask.shape)} or [N] = ({batch.num_traj},), "
                     f"got {shape}")


def token_mask(batch: TrajectoryBatch, name, who: str, what: str = "token mask"):
    """``action_mask`` restricted by a per-token mask field (bool, or > 0.5 if float); the
    whole ``action_mask`` when ``name`` is None."""
    m = batch.action_mask
    if name is None:
        return m
    x = jnp.asarray(require(batch, name, who, f"[R, T] {what}"))
    if tuple(x.shape) != tuple(m.shape):
        raise shape_error(who, f"extras['{name}']", "[R, T]", tuple(m.shape), x.shape)
    on = x if x.dtype == jnp.bool_ else (jnp.where(m, x, 0.0) > 0.5)
    return m & on
