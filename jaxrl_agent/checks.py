"""Checks and field readers shared by estimators and losses: clear errors instead of NaN or
garbage, at trace time.

The checks run when a function is traced (before anything is compiled), on Python values;
traced hyper-parameters (passed as jit arguments) are not checked. ``require`` raises
``MissingInput`` (a ValueError naming the field), so callers can tell a missing input from a
bad value without reading the message.
"""

import numbers

import jax.numpy as jnp
from jax import lax

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


#: field names that read the batch's own arrays instead of ``extras``
BATCH_FIELDS = ("outcome", "turn_rewards", "old_logprobs")

#: level -> (shape name, the batch array whose shape the field must have)
FIELD_LEVELS = {"token": ("[R, T]", "action_mask"), "turn": ("[N, K]", "turn_mask"),
                "traj": ("[N]", "traj_mask")}


def field_source(batch: TrajectoryBatch, name: str, who: str, what: str):
    """The raw array behind a field name: ``batch.outcome`` / ``turn_rewards`` /
    ``old_logprobs`` for those names (``BATCH_FIELDS``), else ``extras[name]`` (``MissingInput``
    naming the field and ``what`` it should hold when absent)."""
    if name in BATCH_FIELDS:
        return getattr(batch, name)
    return require(batch, name, who, what)


def read_field(batch: TrajectoryBatch, name: str, who: str, *, level: str, stop_gradient: bool,
               what: str, override=None, default=None, valid_only: bool = False):
    """The one reader of a named float signal of the batch, as float32.

    ``level``: ``"token"`` ([R, T], 0 outside ``action_mask``; with ``valid_only`` also 0 on
    the rows of padding trajectories), ``"turn"`` ([N, K], 0 outside the valid turns,
    ``segments.valid_turns``) or ``"traj"`` ([N], 0 outside ``traj_mask``).

    ``stop_gradient`` has no default, so every method says what a learned signal gets: credit
    methods read the signals they weigh or reward with (a teacher's or a reward model's
    log-probs, entropies, probe scores, potentials) with ``True``, so no gradient reaches the
    model that produced them; a loss reads its own differentiable input with ``False``.

    ``override`` (an array) is read instead of the field; ``default`` (a float) fills the
    field when the batch does not have it. A wrong shape raises a ValueError naming the field,
    the method and both shapes.
    """
    shape_name, like = FIELD_LEVELS[level]
    if override is not None:
        x, label = override, f"the array given for {name!r}"
    elif default is not None and name not in BATCH_FIELDS and name not in batch.extras:
        x, label = jnp.full(getattr(batch, like).shape, default, jnp.float32), name
    else:
        x = field_source(batch, name, who,
                         what if shape_name in what else f"{what} {shape_name}")
        label = name if name in BATCH_FIELDS else f"extras['{name}']"
    x = jnp.asarray(x)
    shape = tuple(getattr(batch, like).shape)
    if tuple(x.shape) != shape:
        raise shape_error(who, label, shape_name, shape, x.shape)
    if level == "token":
        mask = batch.action_mask
        if valid_only:
            mask = mask & batch.traj_mask[jnp.clip(batch.row_traj, 0, batch.num_traj - 1)][:, None]
    elif level == "turn":
        mask = segments.valid_turns(batch)
    else:
        mask = batch.traj_mask
    x = jnp.where(mask, x.astype(jnp.float32), 0.0)
    return lax.stop_gradient(x) if stop_gradient else x


def token_field(batch: TrajectoryBatch, name: str, who: str, what: str = "per-token values", *,
                stop_gradient: bool, override=None, valid_only: bool = False):
    """``read_field`` at the token level: [R, T], 0 outside ``action_mask``."""
    return read_field(batch, name, who, level="token", stop_gradient=stop_gradient, what=what,
                      override=override, valid_only=valid_only)


def turn_field(batch: TrajectoryBatch, name: str, who: str, what: str = "per-turn values", *,
               stop_gradient: bool):
    """``read_field`` at the turn level: [N, K], 0 outside the valid turns."""
    return read_field(batch, name, who, level="turn", stop_gradient=stop_gradient, what=what)


def traj_field(batch: TrajectoryBatch, name: str, who: str, what: str = "per-trajectory values",
               *, stop_gradient: bool, default=None):
    """``read_field`` at the trajectory level: [N], 0 outside ``traj_mask``."""
    return read_field(batch, name, who, level="traj", stop_gradient=stop_gradient, what=what,
                      default=default)


def spread_field(batch: TrajectoryBatch, name: str, who: str, what: str, *, override=None):
    """A per-token view [R, T] of a signal given per token [R, T], per turn [N, K] (each token
    of turn k gets the turn's value) or per trajectory [N]; 0 outside ``action_mask``.
    ``name == "outcome"`` reads ``batch.outcome``. ``batch`` must be block-local."""
    x = jnp.asarray(override if override is not None else
                    field_source(batch, name, who, f"{what}: [R, T], [N, K] or [N]"))
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
