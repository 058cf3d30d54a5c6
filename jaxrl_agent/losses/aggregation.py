"""Loss aggregation: per-token losses [R, T] -> a ``(sum, denominator)`` pair.

Every loss in this package returns a pair of float32 scalars instead of a mean. The trainer
adds the pairs of all micro-batches and devices and divides once at the end::

    loss = (sum_1 + sum_2 + ...) / (denom_1 + denom_2 + ...)

Every denominator below is a *count* (of tokens, rows or trajectories, optionally times a
constant), i.e. additive over disjoint pieces of the batch. So when a batch is split by whole
trajectories (micro-batches, or shard blocks under ``shard_map``), the summed pairs give exactly
the loss and gradient of the whole batch. Within one piece the denominator never depends on
the parameters, so ``grad(loss) = sum_pieces grad(sum_piece) / total_denom``.

Modes (``m`` = ``batch.action_mask``, ``l`` = per-token loss, r = row, i = trajectory):

* ``token_mean``:              sum = sum_{r,t} m l;                     denom = sum_{r,t} m
* ``seq_mean_token_mean``:     sum = sum_r (sum_t m l) / n_r;           denom = #{r : n_r > 0}
* ``seq_mean_token_sum``:      sum = sum_{r,t} m l;                     denom = #{r : n_r > 0}
* ``seq_mean_token_sum_norm``: sum = sum_{r,t} m l;                     denom = C #{r : n_r > 0}
* ``traj_mean_token_mean``:    sum = sum_i (sum_{tokens of i} l) / n_i; denom = #{i : n_i > 0}

with n_r = sum_t m[r, t] (action tokens of row r) and n_i = sum_{r: row_traj[r] = i} n_r
(action tokens of trajectory i over all its rows). A "sequence" is a row: in the
``concatenated`` layout a whole trajectory, in the ``per_step`` layout one turn.

* ``seq_mean_token_sum_norm`` is Dr.GRPO's constant normalisation (Liu et al. 2025,
  "Understanding R1-Zero-Like Training"): C = ``constant`` or the padded row length T, so the
  denominator does not depend on response lengths.
* ``traj_mean_token_mean`` is the per-rollout mean of Agent Lightning
  (``agentlightning/verl/per_rollout_loss.py``): every trajectory gets equal total weight
  however many rows it spans. In the ``concatenated`` layout (one row per trajectory) it
  equals ``seq_mean_token_mean``.

Degenerate input: rows/trajectories without action tokens contribute nothing; an all-masked
batch gives ``(0, 0)`` with a finite (zero) gradient. Dividing by a zero denominator is the
caller's job (see ``safe_ratio``).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_agent import segments
from jaxrl_agent.batch import TrajectoryBatch

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
             "seq_mean_token_sum_norm", "traj_mean_token_mean")


def check_mode(mode: str) -> str:
    """Returns ``mode`` if it is one of ``AGG_MODES``; raises ``ValueError`` listing them."""
    if mode not in AGG_MODES:
        raise ValueError(f"agg mode must be one of {AGG_MODES}, got {mode!r}")
    return mode


def check_token_array(name: str, x, batch: TrajectoryBatch):
    """Host-side shape check of a per-token array: raises ``ValueError`` naming ``name``."""
    shape = tuple(batch.action_mask.shape)
    if tuple(jnp.shape(x)) != shape:
        raise ValueError(f"{name} must have shape [R, T] = {shape}, got {tuple(jnp.shape(x))}")
    return x


def aggregate(per_token, batch: TrajectoryBatch, mode: str = "token_mean", *, constant=None,
              axis_name=None):
    """Aggregates a per-token loss over ``batch.action_mask`` into ``(sum, denominator)``.

    See the module docstring for the formula of each mode.

    Args:
      per_token: [R, T] per-token loss. Entries outside ``action_mask`` are ignored (they may
        hold anything, even inf or NaN: they are selected away, not multiplied by 0).
      batch: the ``TrajectoryBatch`` (``action_mask``; ``row_traj`` for the trajectory mode).
      mode: one of ``AGG_MODES``.
      constant: C of ``seq_mean_token_sum_norm``; default the padded row length T.
      axis_name: only for ``traj_mean_token_mean`` inside ``shard_map``: converts the global
        ``row_traj`` of this shard block to block-local indices (``segments.localize``). The
        returned pair is still this shard's share: ``psum`` both over the axis yourself.

    Returns:
      ``(sum, denominator)``, float32 scalars. Both are 0 for an all-masked batch.
    """
    check_mode(mode)
    check_token_array("per_token", per_token, batch)
    m = batch.action_mask
    x = jnp.where(m, jnp.asarray(per_token, jnp.float32), 0.0)
    mf = m.astype(jnp.float32)
    n_row = jnp.sum(mf, axis=1)  # [R]
    rows = jnp.sum((n_row > 0).astype(jnp.float32))

    if mode == "token_mean":
        return jnp.sum(x), jnp.sum(mf)
    if mode == "seq_mean_token_mean":
        return jnp.sum(jnp.sum(x, axis=1) / jnp.maximum(n_row, 1.0)), rows
    if mode == "seq_mean_token_sum":
        return jnp.sum(x), rows
    if mode == "seq_mean_token_sum_norm":
        c = batch.row_len if constant is None else constant
        return jnp.sum(x), jnp.asarray(c, jnp.float32) * rows
    # traj_mean_token_mean
    b = segments.localize(batch, axis_name)
    n_traj = segments.traj_token_counts(b)  # [N]
    n_of_row = n_traj[jnp.clip(b.row_traj, 0, b.num_traj - 1)]  # [R]
    total = jnp.sum(jnp.sum(x, axis=1) / jnp.maximum(n_of_row, 1.0))
    return total, jnp.sum((n_traj > 0).astype(jnp.float32))


def safe_ratio(total, denom):
    """``total / denom``, and 0 where ``denom == 0`` (never NaN, also in the gradient)."""
    denom = jnp.asarray(denom, jnp.float32)
    ok = denom > 0
    return jnp.where(ok, total / jnp.where(ok, denom, 1.0), 0.0)


def add_pairs(*pairs):
    """Adds ``(sum, denominator)`` pairs elementwise (e.g. over micro-batches)."""
    total = sum(p[0] for p in pairs)
    denom = sum(p[1] for p in pairs)
    return total, denom

