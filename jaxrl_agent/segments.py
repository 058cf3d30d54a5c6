"""Group and segment primitives that every estimator shares. All pure, jittable, shard-aware.

Conventions: ``mask`` arrays select what counts; everything outside a mask is ignored and
outputs there are 0. Every batch-wide statistic takes ``axis_name`` and, when it is set,
reduces across that mesh axis under ``jax.shard_map`` (numerators and denominators are summed
with ``psum`` before dividing, so the sharded result equals the unsharded one).

The turn<->token maps index with ``row_traj`` as given: inside ``shard_map`` call
``localize(batch, axis_name)`` first (every estimator does), or out-of-block indices are
clamped or dropped silently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_agent.batch import TrajectoryBatch


# ----------------------------------------------------------------------------- mesh helpers


def psum(x, axis_name=None):
    """``lax.psum`` over ``axis_name``, or the identity when it is None."""
    return x if axis_name is None else lax.psum(x, axis_name)


def localize(batch: TrajectoryBatch, axis_name=None) -> TrajectoryBatch:
    """Turns the global ``row_traj``/``group_ids`` of one shard block into block-local indices.

    Inside ``shard_map`` each device sees one block of N_local trajectories; block d holds
    global trajectories [d * N_local, (d + 1) * N_local). Outside a mesh this is the identity.
    Idempotent: the result is marked ``local``, and a local batch is returned as it is, so a
    function may localise a batch its caller already localised.
    """
    if axis_name is None or batch.local:
        return batch
    offset = lax.axis_index(axis_name) * batch.num_traj
    return batch.replace(row_traj=batch.row_traj - offset, group_ids=batch.group_ids - offset,
                         local=True)


def zero_padding(batch: TrajectoryBatch) -> TrajectoryBatch:
    """Sets every float entry outside its mask to 0 (padding may hold anything, NaN too).

    Token-level arrays are masked by ``action_mask``, turn-level by ``turn_mask``,
    trajectory-level by ``traj_mask``; extras by their level (``batch.extra_level``: declared
    in ``extra_levels``, else told by the shape).
    """
    masks = {"token": batch.action_mask, "turn": batch.turn_mask, "traj": batch.traj_mask}

    def clean(x, level):
        if level is None or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x
        m = masks[level]
        return jnp.where(m.reshape(m.shape + (1,) * (jnp.ndim(x) - m.ndim)), x, 0.0)

    return batch.replace(
        old_logprobs=clean(batch.old_logprobs, "token"),
        turn_rewards=clean(batch.turn_rewards, "turn"), outcome=clean(batch.outcome, "traj"),
        extras={name: clean(x, batch.extra_level(name, jnp.shape(x)))
                for name, x in batch.extras.items()})


def local_view(batch: TrajectoryBatch, axis_name=None) -> TrajectoryBatch:
    """What every estimator starts from: block-local indices (``localize``) and padding
    entries set to 0 (``zero_padding``), so padding can never leak into a result. Idempotent
    (both steps are), so public helpers call it whatever their caller did before."""
    return zero_padding(localize(batch, axis_name))


# ----------------------------------------------------------------------------- segment statistics


def safe_sqrt(x):
    """sqrt with a finite gradient at 0 (the gradient there is taken as 0, not inf)."""
    pos = x > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1.0)), 0.0)


def segment_stats(x, ids, valid, num_segments: int, ddof: int = 1, weights=None):
    """Per-segment mean, std and count of ``x`` over entries with ``valid``.

    mean_s = sum_{i: id_i = s} w_i x_i / n_s,  n_s = sum w_i,
    std_s = sqrt(sum w_i (x_i - mean_s)^2 / max(n_s - ddof, 1)),
    with frequency ``weights`` w (default 1).

    Empty segments give mean 0, std 0, count 0 (never NaN, and finite gradients). Equal values
    give exactly 0 deviations and std 0. Nothing overflows for finite x (the sums run on x
    divided by a power of two close to the segment's largest |x|): values 1e20 and 0 have
    std 7.07e19. Entries with ids outside [0, num_segments) are dropped.

    Returns:
      (mean [S], std [S], count [S] float32).
    """
    ok = valid.astype(bool)
    w = ok.astype(x.dtype) if weights is None else jnp.where(ok, weights, 0.0).astype(x.dtype)
    ok = ok & (w > 0)
    ids = jnp.where(ok, ids, num_segments)
    safe = jnp.clip(ids, 0, num_segments - 1)
    # Scale by a power of two >= half the segment's largest |x| (exact: only the exponent
    # changes; |x / scale| < 2), so no sum or square below can overflow for finite x (outcomes
    # 1e20 and 0: std 7e19, not inf). Then shift by the segment maximum: equal values cancel exactly (zero-variance
    # groups give exactly 0 deviations) and large offsets do not eat precision.
    big = jax.ops.segment_max(jnp.where(ok, jnp.abs(x), 0.0), ids, num_segments)
    big = jnp.where(jnp.isfinite(big) & (big > 0), big, 1.0)
    scale = jnp.ldexp(jnp.ones_like(big), jnp.frexp(big)[1] - 1)
    u = jnp.where(ok, x / scale[safe], 0.0)
    top = jax.ops.segment_max(jnp.where(ok, u, -jnp.inf), ids, num_segments)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    us = jnp.where(ok, u - top[safe], 0.0)
    count = jax.ops.segment_sum(w, ids, num_segments)
    mean_s = jax.ops.segment_sum(w * us, ids, num_segments) / jnp.maximum(count, 1.0)
    dev = jnp.where(ok, us - mean_s[safe], 0.0)
    ssd = jax.ops.segment_sum(w * dev * dev, ids, num_segments)
    std = safe_sqrt(ssd / jnp.maximum(count - ddof, 1.0))
    return scale * (top + mean_s), scale * std, count


def group_stats(x, group_ids, valid, ddof: int = 1, weights=None):
    """``segment_stats`` over dense group ids in [0, len(x)), gathered back to every member.

    Returns:
      (mean [N], std [N], count [N]): the statistics of each entry's own group (``count`` is
      the total weight when ``weights`` are given).
    """
    n = x.shape[0]
    mean, std, count = segment_stats(x, group_ids, valid, n, ddof, weights)
    gid = jnp.clip(group_ids, 0, n - 1)
    return mean[gid], std[gid], count[gid]


def dense_ids(*keys, valid):
    """Dense ids in [0, num_unique) for rows of equal key tuples, inside jit (sort-based).

    Args:
      *keys: arrays of equal shape [M] (any integer dtype, e.g. uint32 hashes); rows with equal
        values in every key array share an id.
      valid: [M] bool; invalid rows get id M (out of range, so segment ops drop them).

    Returns:
      (ids [M] int32, num_unique scalar int32). Ids follow the sorted order of the keys.
    """
    valid = jnp.asarray(valid)  # numpy inputs cannot be indexed by a traced order
    keys = tuple(jnp.asarray(k) for k in keys)
    m = valid.shape[0]
    order = jnp.lexsort(tuple(reversed(keys)) + (~valid,))
    sorted_keys = [k[order] for k in keys]
    sorted_valid = valid[order]
    new = jnp.zeros((m,), bool).at[0].set(True)
    for k in sorted_keys:
        new = new | jnp.concatenate([jnp.ones((1,), bool), k[1:] != k[:-1]])
    new = new & sorted_valid
    ids_sorted = jnp.cumsum(new.astype(jnp.int32)) - 1
    ids_sorted = jnp.where(sorted_valid, ids_sorted, m)
    ids = jnp.zeros((m,), jnp.int32).at[order].set(ids_sorted)
    return ids, jnp.sum(new.astype(jnp.int32))


# ----------------------------------------------------------------------------- turn <-> token


def turn_to_token(x, batch: TrajectoryBatch):
    """Broadcasts a per-turn array [N, K] onto its action tokens [R, T]; 0 elsewhere.

    out[r, t] = x[row_traj[r], turn_ids[r, t]] * action_mask[r, t].
    """
    k = jnp.clip(batch.turn_ids, 0, batch.num_turns - 1)
    out = x[batch.row_traj[:, None], k]
    return jnp.where(batch.action_mask, out, jnp.zeros((), out.dtype))


def traj_to_token(x, batch: TrajectoryBatch):
    """Broadcasts a per-trajectory array [N] onto every action token of its rows [R, T]."""
    return jnp.where(batch.action_mask, x[batch.row_traj][:, None], jnp.zeros((), x.dtype))


def _flat_turn_index(batch: TrajectoryBatch):
    n, k = batch.num_traj, batch.num_turns
    idx = batch.row_traj[:, None] * k + jnp.clip(batch.turn_ids, 0, k - 1)
    return jnp.where(batch.action_mask, idx, n * k)


def token_to_turn(x, batch: TrajectoryBatch, reduce: str = "sum"):
    """Reduces a per-token array [R, T] over each turn's action tokens into [N, K].

    ``reduce`` is ``"sum"`` or ``"mean"`` (the token-weighted mean; 0 for empty turns).
    """
    n, k = batch.num_traj, batch.num_turns
    idx = _flat_turn_index(batch)
    xm = jnp.where(batch.action_mask, x, 0)
    out = jax.ops.segment_sum(xm.reshape(-1), idx.reshape(-1), n * k).reshape(n, k)
    if reduce == "sum":
        return out
    if reduce == "mean":
        return out / jnp.maximum(turn_token_counts(batch), 1)
    raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}")


def turn_token_counts(batch: TrajectoryBatch):
    """Number of action tokens of every turn, [N, K] float32."""
    return token_to_turn(batch.action_mask.astype(jnp.float32), batch)


def traj_token_counts(batch: TrajectoryBatch):
    """Number of action tokens of every trajectory, [N] float32."""
    return jax.ops.segment_sum(batch.action_mask.sum(axis=1).astype(jnp.float32),
                               batch.row_traj, batch.num_traj)


def turn_boundary_masks(batch: TrajectoryBatch):
    """[R, T] masks of the first and the last action token of each turn.

    Relies on the layout rules that ``validate_batch`` checks: a turn's action tokens are one
    contiguous span of one row, and turn ids never decrease along a row.
    """
    m, tid = batch.action_mask, batch.turn_ids

    def shifted(x, fill, by):  # x[t - by] (by = 1) or x[t + 1] (by = -1), padded with fill
        pad = ((0, 0), (1, 0)) if by == 1 else ((0, 0), (0, 1))
        x = jnp.pad(x, pad, constant_values=fill)
        return x[:, :-1] if by == 1 else x[:, 1:]

    first = m & ~(shifted(m, False, 1) & (shifted(tid, -1, 1) == tid))
    last = m & ~(shifted(m, False, -1) & (shifted(tid, -1, -1) == tid))
    return first, last


def align_action_tokens(x, mask_from, mask_to):
    """Moves per-token values between two views of the same rows whose action tokens are the
    same and in the same order, but whose prompts differ (a teacher's prompt with a context
    the policy does not see).

        out[r, t] = x[r, p_r(k)]   where t is row r's k-th action token of ``mask_to`` and
                                   p_r(k) the position of its k-th action token in ``mask_from``

    ``x``, ``mask_from``: [R, T1]; ``mask_to``: [R, T2]; 0 outside ``mask_to``. A row with
    fewer action tokens in ``mask_from`` than in ``mask_to`` (not the same actions) reads its
    last position for the extra ones: callers keep both views from the same records.
    """
    t1 = x.shape[1]
    order = jnp.argsort(~mask_from, axis=1, stable=True)  # action positions first, in order
    ranked = jnp.take_along_axis(x, order, axis=1)
    rank = jnp.cumsum(mask_to.astype(jnp.int32), axis=1) - 1
    out = jnp.take_along_axis(ranked, jnp.clip(rank, 0, t1 - 1), axis=1)
    return jnp.where(mask_to, out, jnp.zeros((), x.dtype))


def turn_values_from_tokens(values, batch: TrajectoryBatch, at: str = "before_action"):
    """Reads one value per turn [N, K] out of per-position values [R, T] of the same rows.

    ``values[r, t]`` is the value-head output at position t (the causal state after tokens
    0..t). ``at="before_action"`` reads V(s_k) at the position just before turn k's first
    action token (the last prompt/observation token); ``at="last_action"`` reads Q(s_k, a_k)
    at the turn's last action token (SAPO's two causal boundaries). A turn whose first action
    token sits at position 0 has no earlier position and reads position 0 itself. Missing
    turns give 0.
    """
    first, last = turn_boundary_masks(batch)
    if at == "before_action":
        earlier = jnp.concatenate([values[:, :1], values[:, :-1]], axis=1)
        return token_to_turn(jnp.where(first, earlier, 0.0), batch)
    if at == "last_action":
        return token_to_turn(jnp.where(last, values, 0.0), batch)
    raise ValueError(f"at must be 'before_action' or 'last_action', got {at!r}")


def token_rewards(batch: TrajectoryBatch):
    """Per-token rewards [R, T]: each turn reward sits on the last action token of its turn,
    plus ``extras['token_rewards']`` where given (dense shaping)."""
    _, last = turn_boundary_masks(batch)
    r = jnp.where(last, turn_to_token(batch.turn_rewards.astype(jnp.float32), batch), 0.0)
    if "token_rewards" in batch.extras:
        r = r + jnp.where(batch.action_mask, batch.extras["token_rewards"], 0.0)
    return r


# ----------------------------------------------------------------------------- reverse scans


def _affine_compose(later, earlier):
    a_l, b_l = later
    a_e, b_e = earlier
    return a_e * a_l, b_e + a_e * b_l


def _scan_method(method: str) -> str:
    if method == "auto":  # a sequential scan is ~3x faster on CPU; log-depth wins elsewhere
        return "sequential" if jax.default_backend() == "cpu" else "associative"
    if method not in ("sequential", "associative"):
        raise ValueError(f"method must be 'auto', 'sequential' or 'associative', got {method!r}")
    return method


def reverse_scan(x, discount, axis: int = -1, init=0.0, where=None, method: str = "auto"):
    """Reverse discounted cumulative sum with per-position discounts.

    y_t = x_t + discount_t * y_{t+1} where ``where`` holds (default: everywhere), and
    y_t = y_{t+1} elsewhere (the running value is carried through unchanged); y past the end is
    ``init`` (broadcast against x without ``axis``). ``discount`` broadcasts against ``x``.
    ``method``: ``"sequential"`` (``lax.scan``, fastest on CPU), ``"associative"``
    (log-depth ``lax.associative_scan``, for accelerators) or ``"auto"`` (by backend); both
    give the same numbers up to float rounding.
    """
    axis = axis % x.ndim
    discount = jnp.asarray(discount, x.dtype)
    init = jnp.broadcast_to(jnp.asarray(init, x.dtype), x.shape[:axis] + x.shape[axis + 1:])
    if _scan_method(method) == "associative":
        d = jnp.broadcast_to(discount, x.shape)
        if where is not None:
            x, d = jnp.where(where, x, 0.0), jnp.where(where, d, 1.0)
        prod, y = lax.associative_scan(_affine_compose, (d, x), reverse=True, axis=axis)
        return y + prod * jnp.expand_dims(init, axis)

    def to_time_major(a):
        return jnp.moveaxis(jnp.broadcast_to(a, x.shape), axis, 0)

    # Scalar discounts stay out of the scanned inputs: half the memory traffic per step.
    scalar_d = discount.ndim == 0
    xs = {"x": to_time_major(x)}
    if not scalar_d:
        xs["d"] = to_time_major(discount)
    if where is not None:
        xs["m"] = to_time_major(where)

    # The carry must vary over the same mesh axes as the inputs (shard_map type check), so
    # it is built from their first slices rather than from a constant alone.
    init = init + sum(jnp.zeros_like(v[0], dtype=x.dtype) for v in xs.values())

    def step(carry, inp):
        y = inp["x"] + (discount if scalar_d else inp["d"]) * carry
        if where is not None:
            y = jnp.where(inp["m"], y, carry)
        return y, y

    _, ys = lax.scan(step, init, xs, reverse=True)
    return jnp.moveaxis(ys, 0, axis)


def exclusive_reverse_cumprod(d, axis: int = -1, where=None, method: str = "auto"):
    """c_t = prod_{s > t, where_s} d_s along ``axis`` (1 at the last position)."""
    zeros = jnp.zeros_like(d) if jnp.ndim(d) else jnp.zeros_like(where, dtype=jnp.float32)
    incl = reverse_scan(zeros,
                        d, axis=axis, init=1.0, where=where, method=method)
    incl = jnp.moveaxis(incl, axis, -1)
    excl = jnp.concatenate([incl[..., 1:], jnp.ones_like(incl[..., :1])], axis=-1)
    return jnp.moveaxis(excl, -1, axis)


def trajectory_reverse_scan(x, discount, batch: TrajectoryBatch):
    """Reverse scan over each trajectory's action tokens in order (turn by turn), any layout.

    Along the stream of a trajectory's action tokens, y_t = x_t + discount_t * y_next(t),
    where next(t) is the trajectory's next action token (in the same row or in the row holding
    the following turn) and y past the last action token is 0. Non-action tokens carry the
    running value through. The result is the same in the concatenated and per-step layouts.

    Method: one scan per row with zero bootstrap, then a turn-level affine scan that carries
    each row's bootstrap (the value at the first token of the turn after the row) across rows.

    Args:
      x, discount: [R, T] (discount may be a scalar); only action-token entries are read.

    Returns:
      (inclusive [R, T], exclusive [R, T]): y_t, and y_next(t) (the value after t); on
      non-action tokens both equal the value at the next action token.
    """
    m = batch.action_mask
    n, k = batch.num_traj, batch.num_turns
    x = jnp.where(m, x, 0.0)
    y0 = reverse_scan(x, discount, axis=1, where=m)
    y0_excl = jnp.concatenate([y0[:, 1:], jnp.zeros_like(y0[:, :1])], axis=1)
    if batch.layout == "concatenated":  # each row holds a whole trajectory: no bootstrap
        return y0, y0_excl
    discount = jnp.asarray(discount, x.dtype)
    p_excl = exclusive_reverse_cumprod(discount if discount.ndim == 0 else
                                       jnp.broadcast_to(discount, x.shape), axis=1, where=m)
    d = jnp.where(m, jnp.broadcast_to(discount, x.shape), 1.0)
    p_incl = d * p_excl  # coefficient of the row bootstrap

    first, _ = turn_boundary_masks(batch)
    row_last_turn = jnp.max(jnp.where(m, batch.turn_ids, -1), axis=1)  # [R]
    f0 = token_to_turn(jnp.where(first, y0, 0.0), batch)  # y0 at each turn's first token
    c = token_to_turn(jnp.where(first, p_incl, 0.0), batch)
    is_last = token_to_turn((first & (batch.turn_ids == row_last_turn[:, None])).astype(x.dtype),
                            batch)
    f0_next = jnp.concatenate([f0[:, 1:], jnp.zeros((n, 1), x.dtype)], axis=1)
    c_next = jnp.concatenate([c[:, 1:], jnp.zeros((n, 1), x.dtype)], axis=1)
    valid = batch.turn_mask.astype(x.dtype)
    # S_k: bootstrap of the row holding turn k. S_k = L_k (F0_{k+1} + C_{k+1} S_{k+1})
    # + (1 - L_k) S_{k+1}.
    s = reverse_scan(valid * is_last * f0_next, valid * (is_last * c_next + (1 - is_last)),
                     axis=1)
    boot = jnp.where(row_last_turn >= 0,
                     s[batch.row_traj, jnp.clip(row_last_turn, 0, k - 1)], 0.0)[:, None]
    return y0 + p_incl * boot, y0_excl + p_excl * boot


# ----------------------------------------------------------------------------- normalisation


def masked_mean_var(x, mask, axis_name=None, ddof: int = 0):
    """Mask-weighted mean and variance over all entries (and across ``axis_name``).

    mean = sum(m x) / sum(m), var = sum(m (x - mean)^2) / max(sum(m) - ddof, 1). An empty mask
    gives mean 0, var 0; entries outside the mask are never read (NaN there is harmless).
    The sums run on x shifted by its masked maximum, so constant input has exactly 0 variance.
    """
    mask = mask.astype(bool)
    count = psum(jnp.sum(mask.astype(jnp.float32)), axis_name)
    top = jnp.max(jnp.where(mask, x, -jnp.inf))
    if axis_name is not None:
        top = lax.pmax(top, axis_name)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    xs = jnp.where(mask, x - top, 0.0)
    mean_s = psum(jnp.sum(xs), axis_name) / jnp.maximum(count, 1.0)
    dev = jnp.where(mask, xs - mean_s, 0.0)
    var = psum(jnp.sum(dev * dev), axis_name) / jnp.maximum(count - ddof, 1.0)
    return top + mean_s, var


def masked_whiten(x, mask, axis_name=None, eps: float = 1e-8, ddof: int = 0,
                  shift_mean: bool = True):
    """Token-weighted standardisation: (x - mean) / sqrt(var + eps) on ``mask``, 0 elsewhere.

    With ``shift_mean=False`` the mean is added back (verl's option for GAE). Zero variance
    gives 0 (not NaN) because of ``eps``.
    """
    mean, var = masked_mean_var(x, mask, axis_name, ddof)
    out = (x - mean) * lax.rsqrt(var + eps)  # x - mean is exactly 0 for constant x
    if not shift_mean:
        out = out + mean
    return jnp.where(mask, out, 0.0)


def weighted_mean_var(x, weights, axis_name=None):
    """Mean and (population) variance of ``x`` [M] under non-negative ``weights`` [M].

    Entries with weight 0 are never read. Zero total weight gives mean 0, var 0. Computed on x
    shifted by its maximum (over positive weights, across ``axis_name``), so equal values give
    exactly 0 variance and x - mean exactly 0.
    """
    on = weights > 0
    w = jnp.where(on, weights, 0.0)
    top = jnp.max(jnp.where(on, x, -jnp.inf))
    if axis_name is not None:
        top = lax.pmax(top, axis_name)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    xs = jnp.where(on, x - top, 0.0)
    total = psum(jnp.sum(w), axis_name)
    mean_s = psum(jnp.sum(w * xs), axis_name) / jnp.maximum(total, 1e-30)
    dev = jnp.where(on, xs - mean_s, 0.0)
    var = psum(jnp.sum(w * dev * dev), axis_name) / jnp.maximum(total, 1e-30)
    return top + mean_s, var


# ----------------------------------------------------------------------------- turn keys


def next_turn(x, fill=0):
    """x[:, k + 1] at position k of an [N, K, ...] array; ``fill`` past the last column."""
    pad = jnp.full_like(x[:, :1], fill)
    return jnp.concatenate([x[:, 1:], pad], axis=1)


def valid_turns(batch: TrajectoryBatch):
    """[N, K] bool: the turn exists in a real trajectory."""
    return batch.turn_mask & batch.traj_mask[:, None]


def turn_key_ids(batch: TrajectoryBatch, *keys, valid=None, max_rounds: int = 64):
    """Ids [N, K] of turns whose key tuples are equal *inside one task group*.

    Keys are always scoped by ``group_ids`` (GiGPO's ``(index, anchor_obs)``): two turns share
    an id iff they belong to the same group and every key array agrees (keys are compared,
    not only hashed: the grouping is exact). Each key broadcasts to [N, K].

    Method (sort-free; a multi-key sort is slow on CPU): an open-addressing hash table of
    2 N K slots with linear probing, run as rounds of vectorised scatter/gather. A turn's
    first slot is a hash of its keys inside a window owned by its group (groups packed as
    consecutive trajectories get disjoint windows, so probing stays local). Each round every
    unresolved turn whose slot is empty bids its flat index for it (scatter-min); turns whose
    keys equal those of the slot's owner take the owner's index, the rest move one slot on.
    All turns of one key move together, so they always agree. A handful of rounds suffice in
    practice; after ``max_rounds`` (adversarial clustering) it falls back to a sort
    (``dense_ids``), which gives the same grouping.

    Returns:
      ids [N, K] int32 in [0, N * K): the smallest flat index (i * K + k) among the turns of
      the key (not dense); invalid turns (missing turns, padding trajectories, ``valid``
      False) get N * K, which segment reductions drop.
    """
    n, k = batch.num_traj, batch.num_turns
    m = n * k
    ok = valid_turns(batch) if valid is None else valid & valid_turns(batch)
    ok = ok.reshape(-1)
    g = jnp.broadcast_to(batch.group_ids[:, None], (n, k)).reshape(-1)
    cols = [g.astype(jnp.uint32)] + [jnp.broadcast_to(x, (n, k)).reshape(-1).astype(jnp.uint32)
                                     for x in keys]
    size = 2 * m
    h = cols[1] if len(cols) > 1 else jnp.zeros_like(cols[0])
    for c in cols[2:]:
        h = hash_combine(h, c)
    h = _fmix32(h + jnp.uint32(0x7F4A7C15))
    members = jax.ops.segment_sum(ok.astype(jnp.int32), jnp.where(ok, g, n), n)
    width = jnp.maximum(members[jnp.clip(g, 0, n - 1)], 1).astype(jnp.uint32) * jnp.uint32(2)
    slot = ((jnp.clip(g, 0, n - 1) * 2 * k).astype(jnp.uint32) + h % width).astype(jnp.int32)
    slot = slot % size
    flat = jnp.arange(m, dtype=jnp.int32)

    def same_keys(owner):
        eq = jnp.ones((m,), bool)
        for c in cols:
            eq = eq & (c[owner] == c)
        return eq

    def body(carry):
        table, slot, ids, _, rounds = carry
        active = ids < 0
        free = table[slot] == m
        table = table.at[jnp.where(active & free, slot, size)].min(flat, mode="drop")
        owner = jnp.clip(table[slot], 0, m - 1)
        ids = jnp.where(active & (table[slot] < m) & same_keys(owner), owner, ids)
        active = ids < 0
        slot = jnp.where(active, jnp.where(slot + 1 == size, 0, slot + 1), slot)
        return table, slot, ids, jnp.any(active), rounds + 1

    ids = jnp.where(ok, -1, m).astype(jnp.int32)
    zero = jnp.min(ids) * 0  # built from the inputs: varies over a mesh axis like them
    init = (jnp.full((size,), m, jnp.int32) + zero, slot, ids, jnp.any(ok), zero)
    _, _, ids, unresolved, _ = lax.while_loop(lambda c: c[3] & (c[4] < max_rounds), body, init)

    def by_sort(_):
        dense, _ = dense_ids(*cols, valid=ok)
        first = jax.ops.segment_min(flat, dense, m + 1)  # smallest flat index of each key
        return jnp.where(ok, first[jnp.clip(dense, 0, m)], m).astype(jnp.int32)

    ids = lax.cond(unresolved, by_sort, lambda _: ids, None)
    return ids.reshape(n, k)


def key_stats(x, ids, valid, ddof: int = 1, weights=None):
    """``segment_stats`` of a per-turn array [N, K] over key ids from ``turn_key_ids``,
    gathered back to every turn: (mean, std, count), each [N, K]."""
    n, k = x.shape
    mean, std, count = segment_stats(x.reshape(-1), ids.reshape(-1), valid.reshape(-1), n * k,
                                     ddof, None if weights is None else weights.reshape(-1))
    safe = jnp.clip(ids, 0, n * k - 1)
    return mean[safe], std[safe], count[safe]


_GOLDEN = 0x9E3779B1


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser (uint32 arithmetic wraps)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def hash_combine(h, v):
    """A new uint32 hash of the pair (h, v); order-sensitive."""
    h = jnp.asarray(h, jnp.uint32)
    v = jnp.asarray(v, jnp.uint32)
    return _fmix32(h * jnp.uint32(_GOLDEN) + _fmix32(v + jnp.uint32(0x7F4A7C15)))


_SEEDS = (0x243F6A88, 0x85A308D3)  # two independent streams: 64-bit prefix identity


def history_keys(batch: TrajectoryBatch, depth: int | None = None):
    """Keys of the history a turn was taken from, two uint32 streams (64 bits), [N, K] each.

    H_k hashes (s_0, a_0, s_1, a_1, ..., a_{k-1}, s_k) from ``state_keys`` (s) and
    ``action_keys`` (a): turns share H_k iff their whole histories agree (the exact-prefix tree
    node before action k, up to a 2^-64 collision chance). With ``depth=d`` only the last d
    turns enter: (s_{k-d}, a_{k-d}, ..., a_{k-1}, s_k), each earlier slot hashed with a flag
    saying whether that turn exists (so no key value can pose as a missing turn); ``depth=0``
    is the current state alone. Pair the two streams as two keys of ``turn_key_ids``.
    """
    s = batch.state_keys.astype(jnp.uint32)
    a = batch.action_keys.astype(jnp.uint32)
    n, k = s.shape
    out = []
    for seed in _SEEDS:
        if depth is None:
            def step(h, xs):
                s_k, a_prev, first = xs
                h = jnp.where(first, jnp.uint32(seed), hash_combine(h, a_prev))
                h = hash_combine(h, s_k)
                return h, h

            a_prev = jnp.concatenate([jnp.zeros_like(a[:, :1]), a[:, :-1]], axis=1)
            first = jnp.broadcast_to(jnp.arange(k) == 0, (n, k))
            init = jnp.zeros_like(s[:, 0])
            _, hs = lax.scan(step, init, (s.T, a_prev.T, first.T))
            out.append(hs.T)
            continue
        h = hash_combine(jnp.full_like(s, seed), s)
        for j in range(1, depth + 1):  # fold in (s_{k-j}, a_{k-j}) going back
            s_back = jnp.pad(s, ((0, 0), (j, 0)))[:, :k]
            a_back = jnp.pad(a, ((0, 0), (j, 0)))[:, :k]
            exists = jnp.broadcast_to(jnp.arange(k)[None, :] >= j, (n, k))
            h = hash_combine(h, exists.astype(jnp.uint32))  # a missing turn is no key value
            h = hash_combine(hash_combine(h, jnp.where(exists, a_back, 0)),
                             jnp.where(exists, s_back, 0))
        out.append(h)
    return tuple(out)


def bucket_keys(features, width: float):
    """uint32 keys [N, K] of feature vectors [N, K, D] quantised to a grid of ``width``:
    equal keys iff round(f / width) agrees in every coordinate (up to hash collisions)."""
    q = jnp.round(features / width).astype(jnp.int32).astype(jnp.uint32)
    h = jnp.full(features.shape[:-1], _SEEDS[0], jnp.uint32)
    for j in range(features.shape[-1]):
        h = hash_combine(h, q[..., j])
    return h


def similarity_clusters(features, scope, valid, threshold: float, iters: int = 32,
                        block: int = 1024):
    """Connected components of a thresholded cosine-similarity graph, inside jit.

    Turns a and b ([N, K] positions, flattened to M = N K) are linked iff they are valid, share
    ``scope`` (e.g. the task group, [N] or [N, K]), both feature vectors are non-zero and
    cos(f_a, f_b) >= ``threshold`` - 1e-6 (the slack lets threshold 1 link identical vectors
    despite float32 rounding). Labels start as each turn's flat index; every round hooks each
    label's root to the smallest label among its members' neighbours and then jumps every
    label to its label's label (pointer jumping), until nothing changes or ``iters`` rounds
    have run (a few rounds for ordinary clusters; a long path of d hops needs at most d). The
    label is the smallest flat index in the component, so it serves directly as a segment id
    in [0, M); invalid turns get M. Which turns share a label does not depend on the order of
    rows (only the label values do).

    Cost: O(M^2 D) per round, computed in row blocks of ``block`` (memory O(block M)); for
    very large batches prefer ``bucket_keys``.
    """
    features = jnp.asarray(features)
    n, k, d = features.shape
    m = n * k
    f = features.reshape(m, d).astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(f * f, axis=1, keepdims=True))
    nonzero = norm[:, 0] > 0
    f = jnp.where(nonzero[:, None], f / jnp.where(nonzero[:, None], norm, 1.0), 0.0)
    scope = jnp.asarray(scope)
    sc = jnp.broadcast_to(scope if scope.ndim == 2 else scope[:, None], (n, k)).reshape(m)
    ok = jnp.asarray(valid).reshape(m)
    linkable = ok & nonzero
    idx = jnp.arange(m, dtype=jnp.int32)
    bs = min(block, m)
    nb = -(-m // bs)
    rows = jnp.minimum(jnp.arange(nb * bs, dtype=jnp.int32), m - 1).reshape(nb, bs)

    def neighbours_min(labels):
        def one(r):
            adj = ((f[r] @ f.T >= threshold - 1e-6) & (sc[r][:, None] == sc[None, :])
                   & linkable[r][:, None] & linkable[None, :])
            return jnp.min(jnp.where(adj, labels[None, :], m), axis=1)
        return lax.map(one, rows).reshape(-1)[:m]

    def body(carry):
        labels, _, rounds = carry
        nb_min = jnp.minimum(labels, neighbours_min(labels))
        new = labels.at[jnp.where(ok, labels, m)].min(nb_min, mode="drop")  # hook roots
        new = jnp.minimum(new, nb_min)
        new = jnp.where(ok, new[jnp.clip(new, 0, m - 1)], m)  # jump
        new = jnp.where(ok, new[jnp.clip(new, 0, m - 1)], m)
        return new, jnp.any(new != labels), rounds + 1

    labels = jnp.where(ok, idx, m)
    zero = jnp.min(labels) * 0  # varies over a mesh axis like the inputs
    labels, _, _ = lax.while_loop(lambda c: c[1] & (c[2] < iters), body,
                                  (labels, jnp.any(ok), zero))
    return labels.reshape(n, k)
