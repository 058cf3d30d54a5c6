"""The batch contract: one padded, static-shape layout shared by every estimator and loss.

Three levels: N trajectories, each of at most K turns, stored as R token rows of length T.

* ``concatenated`` layout: one row per trajectory (R = N); the whole multi-turn history is one
  sequence and observation tokens are masked out of the loss.
* ``per_step`` layout: one row per turn; each row holds that turn's observation and action.

Estimators work at the turn level [N, K] and reach tokens through ``row_traj`` and ``turn_ids``,
so the same estimator gives the same per-turn advantages in both layouts.

Indices that point into the batch (``row_traj``, ``group_ids``) are *global* positions in
[0, N). When a batch is split over a mesh axis into D equal blocks along the leading axis, the
rows and groups of block d must refer only to trajectories of block d
(``jaxrl_agent.rollout.records.pack_records`` with ``num_shards=D`` arranges this and
``validate(num_shards=D)`` checks it); estimators then
convert to block-local indices with ``segments.localize``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np
from flax import struct

LAYOUTS = ("concatenated", "per_step")

# extras that pack_records knows how to build, with the level they live at.
TOKEN_EXTRAS = ("ref_logprobs", "teacher_logprobs", "token_values", "token_rewards")
TURN_EXTRAS = ("turn_values", "turn_labels", "turn_parents")


@struct.dataclass
class TrajectoryBatch:
    """Padded multi-turn rollouts. Shapes: tokens level [R, T], turn level [N, K], trajectory [N].

    Attributes:
      tokens: [R, T] int32 token ids of each row, left-aligned.
      action_mask: [R, T] bool, tokens the policy generated (the ones trained on).
      turn_ids: [R, T] int32 turn index k of each action token, -1 elsewhere.
      row_traj: [R] int32 trajectory index of each row, in [0, N). Padding rows have no action
        tokens; their ``row_traj`` may be any index of the row's shard block.
      old_logprobs: [R, T] float32 behaviour-policy log-probs of the tokens (0 where unknown).
      turn_mask: [N, K] bool, turn k exists.
      turn_rewards: [N, K] float32 environment reward after action k (terminal reward at the
        last turn).
      state_keys: [N, K] uint32 hash of the observation seen before action k.
      action_keys: [N, K] uint32 hash of action k.
      group_ids: [N] int32 rollouts of one task group share an id in [0, N) (by convention the
        index of the group's first trajectory).
      task_ids: [N] int32 stable id of the task across training steps (persistent baselines).
      traj_mask: [N] bool, the trajectory is real (not padding).
      outcome: [N] float32 final verifiable reward.
      extras: optional method-specific arrays, e.g. ``ref_logprobs`` [R, T], ``token_values``
        [R, T], ``turn_values`` [N, K].
      layout: static, ``"concatenated"`` or ``"per_step"``.
      extra_levels: static ``((name, level), ...)`` with level ``"token"`` [R, T, ...],
        ``"turn"`` [N, K, ...] or ``"traj"`` [N, ...] for extras whose level their shape alone
        does not tell (an [N, D] vector with D = K, an [N, K] array when N, K = R, T);
        ``pack_records`` fills it. Extras not listed are read by shape.
      local: static, True once ``segments.localize`` has made ``row_traj`` / ``group_ids``
        block-local (inside ``shard_map``), so localising again changes nothing.
    """

    tokens: Any
    action_mask: Any
    turn_ids: Any
    row_traj: Any
    old_logprobs: Any
    turn_mask: Any
    turn_rewards: Any
    state_keys: Any
    action_keys: Any
    group_ids: Any
    task_ids: Any
    traj_mask: Any
    outcome: Any
    extras: dict = dataclasses.field(default_factory=dict)
    layout: str = struct.field(pytree_node=False, default="concatenated")
    extra_levels: tuple = struct.field(pytree_node=False, default=())
    local: bool = struct.field(pytree_node=False, default=False)

    def extra_level(self, name: str, shape) -> str | None:
        """``"token"``, ``"turn"`` or ``"traj"``: the level of ``extras[name]`` (declared in
        ``extra_levels``, else told by its shape), or None for an unknown shape."""
        shape = tuple(shape)
        lead = {"token": (self.num_rows, self.row_len), "turn": (self.num_traj, self.num_turns),
                "traj": (self.num_traj,)}
        declared = dict(self.extra_levels).get(name)
        if declared is not None and shape[:len(lead[declared])] == lead[declared]:
            return declared  # (a replaced array of another shape is read by its shape)
        if shape[:2] == (self.num_rows, self.row_len):
            return "token"
        if shape[:2] == (self.num_traj, self.num_turns):
            return "turn"
        if shape[:1] == (self.num_traj,):
            return "traj"
        return None

    @property
    def num_traj(self) -> int:
        return self.turn_mask.shape[0]

    @property
    def num_turns(self) -> int:
        return self.turn_mask.shape[1]

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def row_len(self) -> int:
        return self.tokens.shape[1]

    def validate(self, num_shards: int = 1) -> TrajectoryBatch:
        """Host-side structural checks; raises ``ValueError`` naming the field. Returns self."""
        validate_batch(self, num_shards=num_shards)
        return self


@struct.dataclass
class Advantages:
    """What an estimator returns.

    Attributes:
      token: [R, T] float32 per-token credit, exactly 0 outside ``action_mask``.
      turn: [N, K] float32 per-turn credit where the method has one (0 on missing turns), else
        None.
      token_returns / turn_returns: value-function targets where the method has a critic.
    """

    token: Any
    turn: Any = None
    token_returns: Any = None
    turn_returns: Any = None


# ----------------------------------------------------------------------------- shapes


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum): few static shapes, so few compiles."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def round_up_to_step(n: int, full: int, steps: int = 8, multiple: int = 1,
                     min_step: int = 1) -> int:
    """``n`` rounded up to a multiple of ``q``, at most ``full``, where ``q`` is
    ``max(full / steps, min_step)`` rounded up to a multiple of ``multiple``: at most
    ``steps`` distinct sizes in ``[n, full]`` (one when ``min_step >= full``), each divisible
    by ``multiple`` (which must divide ``full``). For a size whose worst case ``full`` is known
    (rows of a per-turn batch: trajectories x max turns) but whose typical value is much
    smaller. ``n > full`` raises ValueError."""
    n, full, steps, multiple = int(n), int(full), int(steps), int(multiple)
    if n > full or full % multiple or steps < 1:
        raise ValueError(f"round_up_to_step: need n <= full, multiple | full and steps >= 1, "
                         f"got n={n}, full={full}, steps={steps}, multiple={multiple}")
    q = multiple * max(1, math.ceil(max(full / steps, min_step) / multiple))
    return min(full, q * max(1, math.ceil(n / q)))


# ----------------------------------------------------------------------------- array checks

_SPEC = {  # field: (level, dtype kind)
    "tokens": ("RT", "i"), "action_mask": ("RT", "b"), "turn_ids": ("RT", "i"),
    "row_traj": ("R", "i"), "old_logprobs": ("RT", "f"), "turn_mask": ("NK", "b"),
    "turn_rewards": ("NK", "f"), "state_keys": ("NK", "u"), "action_keys": ("NK", "u"),
    "group_ids": ("N", "i"), "task_ids": ("N", "i"), "traj_mask": ("N", "b"),
    "outcome": ("N", "f"),
}


def _validate_edges(x, N, K, turn_mask):
    """extras['edges']: [N, E, 3] int (src_turn, dst_turn, type); rows of -1 are padding."""
    if x.ndim != 3 or x.shape[0] != N or x.shape[2] != 3 or x.dtype.kind not in "iu":
        raise ValueError(f"extras['edges'] must be an int array [N, E, 3] = [{N}, E, 3] of "
                         f"(src_turn, dst_turn, type), -1 rows for padding; got {x.shape} "
                         f"{x.dtype}")
    pad = (x == -1).all(axis=2)
    real = ~pad
    turns = turn_mask.sum(axis=1)[:, None]
    bad = real & ((x[..., 0] < 0) | (x[..., 0] >= turns) | (x[..., 1] < 0)
                  | (x[..., 1] >= turns) | (x[..., 2] < 0))
    if bad.any():
        i, e = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"extras['edges'][{i}, {e}] = {x[i, e].tolist()}: src/dst must be turns "
                         f"of trajectory {i} (it has {int(turns[i, 0])}) and type >= 0")


def validate_batch(batch: TrajectoryBatch, num_shards: int = 1) -> None:
    """Checks shapes, dtypes, index ranges, masks and finiteness on the host.

    Raises:
      ValueError naming the field, the expected shape and the first offending position.
    """
    if batch.layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {batch.layout!r}")
    if not isinstance(num_shards, numbers.Integral) or isinstance(num_shards, bool) \
            or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    a = {f: np.asarray(getattr(batch, f)) for f in _SPEC}
    if a["tokens"].ndim != 2 or a["turn_mask"].ndim != 2:
        raise ValueError(f"tokens must be [R, T] and turn_mask [N, K]; got shapes "
                         f"{a['tokens'].shape} and {a['turn_mask'].shape}")
    (R, T), (N, K) = a["tokens"].shape, a["turn_mask"].shape
    dims = {"RT": (R, T), "R": (R,), "NK": (N, K), "N": (N,)}
    for f, (level, kind) in _SPEC.items():
        if a[f].shape != dims[level]:
            names = {"RT": "[R, T]", "R": "[R]", "NK": "[N, K]", "N": "[N]"}[level]
            raise ValueError(f"{f} must have shape {names} = {dims[level]}, got {a[f].shape}")
        if a[f].dtype.kind != kind and not (kind == "u" and a[f].dtype.kind == "i"):
            raise ValueError(f"{f} must have dtype kind '{kind}', got {a[f].dtype}")
    if batch.layout == "concatenated" and R != N:
        raise ValueError(f"row_traj: the concatenated layout has one row per trajectory, "
                         f"but R = {R} rows and N = {N} trajectories")

    def first_bad(mask):
        return tuple(int(x) for x in np.argwhere(mask)[0])

    def bad_range(f, lo, hi, where=None):
        x = a[f]
        bad = (x < lo) | (x >= hi)
        if where is not None:
            bad &= where
        if bad.any():
            p = first_bad(bad)
            raise ValueError(f"{f}{list(p)} = {x[p]} is out of range [{lo}, {hi})")

    bad_range("row_traj", 0, N)
    bad_range("group_ids", 0, N, where=a["traj_mask"])
    bad_range("task_ids", 0, 2**31)
    am, tid = a["action_mask"], a["turn_ids"]
    bad_range("turn_ids", 0, K, where=am)
    if (tid[~am] != -1).any():
        raise ValueError(f"turn_ids{list(first_bad(~am & (tid != -1)))} must be -1 outside "
                         f"action_mask")
    rt = a["row_traj"]
    running = np.maximum.accumulate(np.where(am, tid, -1), axis=1)
    if (am & (tid < running)).any():
        raise ValueError(f"turn_ids{list(first_bad(am & (tid < running)))}: turn ids must not "
                         f"decrease along a row")
    rows, cols = np.nonzero(am)
    keys = rt[rows].astype(np.int64) * K + tid[rows, cols]
    lo, hi = np.full(N * K, R), np.full(N * K, -1)
    np.minimum.at(lo, keys, rows)
    np.maximum.at(hi, keys, rows)
    split = (hi >= 0) & (lo != hi)
    if split.any():
        key = int(np.argmax(split))
        raise ValueError(f"turn_ids: turn {key % K} of trajectory {key // K} is split across "
                         f"rows {lo[key]} and {hi[key]}; a turn must live in one row")
    first_col, last_col = np.full(N * K, T), np.full(N * K, -1)
    np.minimum.at(first_col, keys, cols)
    np.maximum.at(last_col, keys, cols)
    gaps = (last_col >= 0) & (last_col - first_col + 1 != np.bincount(keys, minlength=N * K))
    if gaps.any():
        key = int(np.argmax(gaps))
        raise ValueError(f"action_mask: the action tokens of turn {key % K} of trajectory "
                         f"{key // K} are not one contiguous span of row {lo[key]}")
    if batch.layout == "concatenated":
        used = rt[am.any(axis=1)]
        if len(np.unique(used)) != len(used):
            raise ValueError("row_traj: in the concatenated layout each trajectory's action "
                             "tokens must lie in one row")
    valid_tok = am & a["turn_mask"][rt[:, None], np.clip(tid, 0, K - 1)]
    if (am & ~valid_tok).any():
        raise ValueError(f"action_mask{list(first_bad(am & ~valid_tok))}: an action token "
                         f"belongs to a turn whose turn_mask is False")
    if (a["turn_mask"] & ~a["traj_mask"][:, None]).any():
        raise ValueError(f"turn_mask{list(first_bad(a['turn_mask'] & ~a['traj_mask'][:, None]))}"
                         f" is set on a padding trajectory (traj_mask False)")
    if (a["traj_mask"] & ~a["turn_mask"].any(axis=1)).any():
        raise ValueError(f"traj_mask[{first_bad(a['traj_mask'] & ~a['turn_mask'].any(1))[0]}]: "
                         f"empty trajectory (no valid turn)")
    has_tokens = np.bincount(keys, minlength=N * K).reshape(N, K) > 0
    if (a["turn_mask"] & ~has_tokens).any():
        i, k = first_bad(a["turn_mask"] & ~has_tokens)
        raise ValueError(f"turn_mask[{i}, {k}]: turn {k} of trajectory {i} has no action tokens")
    gid = a["group_ids"]
    tm = a["traj_mask"]
    if (tm & ~tm[np.clip(gid, 0, N - 1)]).any():
        raise ValueError(f"group_ids[{first_bad(tm & ~tm[np.clip(gid, 0, N - 1)])[0]}] points "
                         f"at a padding trajectory")
    for f, where in (("turn_rewards", a["turn_mask"]), ("outcome", tm),
                     ("old_logprobs", am)):
        bad = ~np.isfinite(a[f]) & where
        if bad.any():
            raise ValueError(f"{f}{list(first_bad(bad))} = {a[f][first_bad(bad)]} is not finite")
    for name, x in batch.extras.items():
        x = np.asarray(x)
        if name == "edges":
            _validate_edges(x, N, K, a["turn_mask"])
            continue
        if name in TOKEN_EXTRAS and x.shape != (R, T):
            raise ValueError(f"extras['{name}'] must have shape [R, T] = {(R, T)}, got {x.shape}")
        if name in TURN_EXTRAS and x.shape != (N, K):
            raise ValueError(f"extras['{name}'] must have shape [N, K] = {(N, K)}, got {x.shape}")
        declared = dict(batch.extra_levels).get(name)
        lead = {"token": (R, T), "turn": (N, K), "traj": (N,)}.get(declared)
        level = batch.extra_level(name, x.shape)
        if lead is not None and x.shape[:len(lead)] != lead:
            raise ValueError(f"extras['{name}'] is declared per {declared} (extra_levels) and must "
                             f"have leading shape {list(lead)}, got {x.shape}")
        where = {"token": am, "turn": a["turn_mask"], "traj": tm}.get(level)
        if where is not None and x.dtype.kind == "f":
            where = where.reshape(where.shape + (1,) * (x.ndim - where.ndim))
            bad = ~np.isfinite(x) & where
            if bad.any():
                raise ValueError(f"extras['{name}']{list(first_bad(bad))} is not finite")
    if num_shards > 1:
        if N % num_shards or R % num_shards:
            raise ValueError(f"num_shards={num_shards} must divide N = {N} and R = {R}")
        n_loc, r_loc = N // num_shards, R // num_shards
        row_block = np.arange(R) // r_loc
        if (rt // n_loc != row_block).any():
            r = int(np.argmax(rt // n_loc != row_block))
            raise ValueError(f"row_traj[{r}] = {rt[r]} points outside its shard block "
                             f"{row_block[r]} (trajectories [{row_block[r] * n_loc}, "
                             f"{(row_block[r] + 1) * n_loc}))")
        traj_block = np.arange(N) // n_loc
        bad = tm & (gid // n_loc != traj_block)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"group_ids[{i}] = {gid[i]}: group split across shard blocks "
                             f"(pack with num_shards={num_shards} to keep groups whole)")

