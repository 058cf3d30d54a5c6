"""The batch contract: one padded, static-shape layout shared by every estimator and loss.

Three levels: N trajectories, each of at most K turns, stored as R token rows of length T.

* ``concatenated`` layout: one row per trajectory (R = N); the whole multi-turn history is one
  sequence and observation tokens are masked out of the loss.
* ``per_step`` layout: one row per turn; each row holds that turn's observation and action.

Estimators work at the turn level [N, K] and reach tokens through ``row_traj`` and ``turn_ids``,
so the same estimator gives the same per-turn advantages in both layouts.

Indices that point into the batch (``row_traj``, ``group_ids``) are *global* positions in
[0, N). When a batch is split over a mesh axis into D equal blocks along the leading axis, the
rows and groups of block d must refer only to trajectories of block d (``pack_records`` with
``num_shards=D`` arranges this and ``validate(num_shards=D)`` checks it); estimators then
convert to block-local indices with ``segments.localize``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
from typing import Any, Iterable, Mapping

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

    @classmethod
    def from_records(cls, records: Iterable[Mapping], layout: str = "concatenated", pad_to=None,
                     num_shards: int = 1, task_index: dict | None = None) -> "TrajectoryBatch":
        """Builds a validated batch from rollout records; see ``pack_records``."""
        return pack_records(records, layout=layout, pad_to=pad_to, num_shards=num_shards,
                            task_index=task_index)[0]

    def validate(self, num_shards: int = 1) -> "TrajectoryBatch":
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


class RecordError(ValueError):
    """A malformed rollout record; ``index`` is its position in the input sequence."""

    def __init__(self, index: int, message: str):
        self.index = index
        self.detail = message
        super().__init__(f"record {index}: {message}")


# ----------------------------------------------------------------------------- keys and buckets


def stable_key(value) -> int:
    """A uint32 hash of a str, int or token list that is the same in every process."""
    if isinstance(value, str):
        data = b"s:" + value.encode("utf-8")
    elif isinstance(value, (int, np.integer)):
        data = b"i:" + str(int(value)).encode()
    else:
        data = b"t:" + np.asarray(value, np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little")


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum): few static shapes, so few compiles."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


# ----------------------------------------------------------------------------- record checks


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_label(idx, rec, name, required):
    if name not in rec:
        if required:
            raise RecordError(idx, f"missing field '{name}' (a str or int)")
        return None
    v = rec[name]
    if not (isinstance(v, str) or _is_int(v)):
        raise RecordError(idx, f"field '{name}' must be a str or int, got {type(v).__name__}")
    return v


_F32_MAX = float(np.finfo(np.float32).max)


def _check_float(idx, where, v):
    if not _is_number(v):
        raise RecordError(idx, f"{where} must be a number, got {type(v).__name__}")
    if not math.isfinite(float(v)):
        raise RecordError(idx, f"{where} must be finite, got {v}")
    if abs(float(v)) > _F32_MAX:  # packed as float32: it would become inf there
        raise RecordError(idx, f"{where} = {v} does not fit float32 (|x| <= {_F32_MAX:.3g}), "
                               f"in which batches are packed; rescale it")
    return float(v)


#: log-probs a little above 0 are rounding noise of a log-softmax; larger ones are not
#: log-probabilities (probabilities or logits passed by mistake)
LOGPROB_TOLERANCE = 1e-4


def _check_logprobs(idx, where, v, length, length_name):
    out = _check_floats(idx, where, v, length, length_name)
    for j, x in enumerate(out):
        if x > LOGPROB_TOLERANCE:
            raise RecordError(idx, f"{where}[{j}] = {x} is not a log-probability (must be "
                                   f"<= 0); pass log-probs, not probabilities or logits")
    return out


#: the fields a record and a turn may carry: what ``pack_records`` reads, and what the
#: rollout collector writes besides (``rollout.collect_groups``); anything else is reported
RECORD_FIELDS = ("group", "task", "outcome", "turns", "traj_extras", "edges",
                 "success", "policy_version", "env_error", "invalid", "truncated",
                 "context_truncated", "num_turns")
TURN_FIELDS = ("observation", "action", "reward", "state_key", "logprobs", "value", "values",
               "ref_logprobs", "turn_key", "action_key", "turn_extras", "token_extras",
               "action_text", "finish_reason", "policy_version", "subgoal")


class UnknownFieldWarning(UserWarning):
    """A record or turn field that ``pack_records`` does not read (a misspelling?)."""


def unknown_fields(records) -> list[tuple[int, str, str]]:
    """``(record index, "field" or "turns[k].field", suggestion or "")`` for every field the
    packer does not know, first occurrence of each name per level only. The suggestion is a
    known field of that level whose name is close (``Outcome`` -> ``outcome``, ``rewards`` ->
    ``reward``)."""
    import difflib

    def suggest(key, known):
        low = {k.lower(): k for k in known}
        if key.lower() in low:
            return low[key.lower()]
        hit = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        return hit[0] if hit else ""

    seen, out = set(), []
    for i, rec in enumerate(records):
        if not isinstance(rec, Mapping):
            continue
        for key in rec:
            if key not in RECORD_FIELDS and ("rec", key) not in seen:
                seen.add(("rec", key))
                out.append((i, str(key), suggest(str(key), RECORD_FIELDS)))
        turns = rec.get("turns")
        for k, t in enumerate(turns if isinstance(turns, (list, tuple)) else ()):
            if isinstance(t, Mapping):
                for key in t:
                    if key not in TURN_FIELDS and ("turn", key) not in seen:
                        seen.add(("turn", key))
                        out.append((i, f"turns[{k}].{key}", suggest(str(key), TURN_FIELDS)))
    return out


def _check_tokens(idx, where, v, allow_empty):
    if not isinstance(v, (list, tuple)):
        raise RecordError(idx, f"{where} must be a list of token ids, got {type(v).__name__}")
    if not v and not allow_empty:
        raise RecordError(idx, f"{where} is empty: every turn needs at least one action token")
    for j, t in enumerate(v):
        if not _is_int(t) or not 0 <= t < 2**31:
            raise RecordError(idx, f"{where}[{j}] must be a token id in [0, 2^31), got {t!r}")
    return list(v)


def _check_key(idx, where, v) -> int:
    if not (isinstance(v, str) or _is_int(v)):
        raise RecordError(idx, f"{where} must be a str or int, got {type(v).__name__}")
    return stable_key(v)


def _check_extras(idx, where, v, length):
    """{name: value}: per turn (length None) a number or a list of numbers (a vector); per
    token (length = the action's length) a list of numbers or bools, one per action token."""
    if not isinstance(v, Mapping):
        raise RecordError(idx, f"{where} must be an object {{name: value}}, got {type(v).__name__}")
    out = {}
    for name, x in v.items():
        w = f"{where}.{name}"
        if name in _RESERVED_EXTRAS:
            raise RecordError(idx, f"{w}: '{name}' is built from its own record field; pick "
                                   f"another name")
        if length is None and not isinstance(x, (list, tuple)):
            out[name] = _check_float(idx, w, x)
        elif length is None:
            if not x:
                raise RecordError(idx, f"{w} is an empty vector")
            out[name] = [_check_float(idx, f"{w}[{j}]", y) for j, y in enumerate(x)]
        elif isinstance(x, (list, tuple)) and x and all(isinstance(y, bool) for y in x):
            if len(x) != length:
                raise RecordError(idx, f"{w} has {len(x)} entries but the action has {length}")
            out[name] = list(x)
        else:
            out[name] = _check_floats(idx, w, x, length, "the action")
    return out


def _check_floats(idx, where, v, length, length_name):
    if not isinstance(v, (list, tuple)):
        raise RecordError(idx, f"{where} must be a list of numbers, got {type(v).__name__}")
    if len(v) != length:
        raise RecordError(idx, f"{where} has {len(v)} entries but {length_name} has {length}")
    return [_check_float(idx, f"{where}[{j}]", x) for j, x in enumerate(v)]


@dataclasses.dataclass
class _Turn:
    observation: list
    action: list
    reward: float
    state_key: int
    action_key: int
    logprobs: list | None
    value: float | None
    values: list | None
    ref_logprobs: list | None
    turn_key: int | None = None
    turn_extras: dict = dataclasses.field(default_factory=dict)
    token_extras: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Traj:
    group: Any
    task: Any
    outcome: float
    turns: list
    traj_extras: dict = dataclasses.field(default_factory=dict)
    edges: list | None = None


def _check_edges(idx, v, num_turns):
    """[[src_turn, dst_turn] or [src_turn, dst_turn, type], ...] -> [(src, dst, type)]."""
    if not isinstance(v, (list, tuple)):
        raise RecordError(idx, f"field 'edges' must be a list of [src_turn, dst_turn(, type)], "
                               f"got {type(v).__name__}")
    out = []
    for j, e in enumerate(v):
        w = f"edges[{j}]"
        if not isinstance(e, (list, tuple)) or len(e) not in (2, 3) or \
                not all(_is_int(x) for x in e):
            raise RecordError(idx, f"{w} must be [src_turn, dst_turn] or [src_turn, dst_turn, "
                                   f"type] of ints, got {e!r}")
        src, dst, typ = (list(e) + [0])[:3]
        for name, x in (("src_turn", src), ("dst_turn", dst)):
            if not 0 <= x < num_turns:
                raise RecordError(idx, f"{w}: {name} = {x} is not a turn of this record "
                                       f"(it has {num_turns})")
        if typ < 0:
            raise RecordError(idx, f"{w}: type must be >= 0, got {typ}")
        out.append((int(src), int(dst), int(typ)))
    return out


_OPTIONAL_TURN_FIELDS = ("logprobs", "value", "values", "ref_logprobs", "turn_key")
# extras built from their own record fields (the other TOKEN_/TURN_EXTRAS names, e.g.
# teacher_logprobs or token_rewards, come from token_extras / turn_extras like any signal)
_RESERVED_EXTRAS = ("ref_logprobs", "token_values", "turn_values", "turn_keys", "edges")


def _parse_record(idx: int, rec) -> _Traj:
    if not isinstance(rec, Mapping):
        raise RecordError(idx, f"expected an object, got {type(rec).__name__}")
    group = _check_label(idx, rec, "group", required=True)
    task = _check_label(idx, rec, "task", required=False)
    turns_in = rec.get("turns")
    if turns_in is None:
        raise RecordError(idx, "missing field 'turns' (a non-empty list of turns)")
    if not isinstance(turns_in, (list, tuple)):
        raise RecordError(idx, f"field 'turns' must be a list, got {type(turns_in).__name__}")
    if not turns_in:
        raise RecordError(idx, "empty trajectory: 'turns' has no turns")
    turns, any_reward = [], False
    for k, t in enumerate(turns_in):
        w = f"turns[{k}]"
        if not isinstance(t, Mapping):
            raise RecordError(idx, f"{w} must be an object, got {type(t).__name__}")
        obs = _check_tokens(idx, f"{w}.observation", t.get("observation", []), allow_empty=True)
        if "action" not in t:
            raise RecordError(idx, f"{w}: missing field 'action' (a list of token ids)")
        act = _check_tokens(idx, f"{w}.action", t["action"], allow_empty=False)
        any_reward |= "reward" in t
        reward = _check_float(idx, f"{w}.reward", t["reward"]) if "reward" in t else 0.0
        state_key = (_check_key(idx, f"{w}.state_key", t["state_key"]) if "state_key" in t
                     else stable_key(obs))
        lp = (_check_logprobs(idx, f"{w}.logprobs", t["logprobs"], len(act), f"{w}.action")
              if "logprobs" in t else None)
        ref = (_check_logprobs(idx, f"{w}.ref_logprobs", t["ref_logprobs"], len(act),
                               f"{w}.action") if "ref_logprobs" in t else None)
        values = (_check_floats(idx, f"{w}.values", t["values"], len(act), f"{w}.action")
                  if "values" in t else None)
        value = _check_float(idx, f"{w}.value", t["value"]) if "value" in t else None
        action_key = _check_key(idx, f"{w}.action_key", t["action_key"]) if "action_key" in t \
            else stable_key(act)
        turn_key = _check_key(idx, f"{w}.turn_key", t["turn_key"]) if "turn_key" in t else None
        turn_extras = _check_extras(idx, f"{w}.turn_extras", t.get("turn_extras", {}), None)
        token_extras = _check_extras(idx, f"{w}.token_extras", t.get("token_extras", {}), len(act))
        turns.append(_Turn(obs, act, reward, state_key, action_key, lp, value, values, ref,
                           turn_key, turn_extras, token_extras))
    if "outcome" in rec:
        outcome = _check_float(idx, "field 'outcome'", rec["outcome"])
    elif any_reward:
        outcome = sum(t.reward for t in turns)
    else:
        raise RecordError(idx, "missing field 'outcome' (and no turn has a 'reward')")
    if not any_reward:
        turns[-1].reward = outcome  # outcome-only records: the outcome is the terminal reward
    traj_extras = _check_extras(idx, "traj_extras", rec.get("traj_extras", {}), None)
    edges = _check_edges(idx, rec["edges"], len(turns)) if "edges" in rec else None
    return _Traj(group, task if task is not None else group, outcome, turns, traj_extras, edges)


# ----------------------------------------------------------------------------- packing


def _extras_layout(trajs) -> dict:
    """(level, name) -> (dtype, vector size or None) of the free-form turn/token extras, after
    checking each name is given on every turn of every record (or on none) with one shape."""
    kinds: dict = {}
    where: dict = {}
    for i, tr in enumerate(trajs):
        for name, x in tr.traj_extras.items():
            kind = (np.float32, len(x) if isinstance(x, list) else None)
            seen = kinds.setdefault(("traj", name), kind)
            where.setdefault(("traj", name), (i, None))
            if seen != kind:
                raise RecordError(i, f"traj_extras.{name}: shape differs from record "
                                     f"{where['traj', name][0]}")
        for k, t in enumerate(tr.turns):
            for level, ex in (("turn", t.turn_extras), ("token", t.token_extras)):
                for name, x in ex.items():
                    if level == "token":
                        kind = (np.bool_ if isinstance(x[0], bool) else np.float32, None)
                    else:
                        kind = (np.float32, len(x) if isinstance(x, list) else None)
                    seen = kinds.setdefault((level, name), kind)
                    where.setdefault((level, name), (i, k))
                    if seen != kind:
                        raise RecordError(i, f"turns[{k}].{level}_extras.{name}: shape or type "
                                             f"differs from record {where[level, name][0]}, turn "
                                             f"{where[level, name][1]}")
    names = [n for _, n in kinds]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"extras {sorted(dup)} are given both per turn and per token")
    for (level, name) in kinds:
        for i, tr in enumerate(trajs):
            if level == "traj":
                if name not in tr.traj_extras:
                    raise RecordError(i, f"lacks traj_extras.{name} while other records have "
                                         f"it: give it on every record or on none")
                continue
            for k, t in enumerate(tr.turns):
                if name not in (t.turn_extras if level == "turn" else t.token_extras):
                    raise RecordError(i, f"turns[{k}] lacks {level}_extras.{name} while other "
                                         f"turns have it: give it on every turn or on none")
    return kinds



@dataclasses.dataclass
class RecordIndex:
    """Where each record landed: ``traj[i]`` its trajectory index, ``spans[i][k]`` the
    (row, start, stop) of turn k's action tokens."""

    traj: list
    spans: list
    task_index: dict


_PAD_KEYS = ("num_traj", "num_turns", "num_rows", "row_len")


def _parse_pad_to(pad_to):
    if pad_to is None:
        return {}
    if not isinstance(pad_to, Mapping):
        raise ValueError(f"pad_to must be a dict with keys from {_PAD_KEYS}, got {pad_to!r}")
    bad = set(pad_to) - set(_PAD_KEYS)
    if bad:
        raise ValueError(f"pad_to: unknown keys {sorted(bad)}; expected some of {_PAD_KEYS}")
    for k, v in pad_to.items():
        if not _is_int(v) or v < 1:
            raise ValueError(f"pad_to['{k}'] must be a positive int, got {v!r}")
    return dict(pad_to)


def assign_shards(group_sizes: list, num_shards: int) -> list:
    """Whole groups to shards, greedily to the least-loaded shard, in first-seen order."""
    load = [0] * num_shards
    shard_of = []
    for size in group_sizes:
        s = min(range(num_shards), key=lambda d: (load[d], d))
        shard_of.append(s)
        load[s] += size
    return shard_of


def pack_records(records: Iterable[Mapping], layout: str = "concatenated", pad_to=None,
                 num_shards: int = 1, task_index: dict | None = None, strict: bool = False):
    """Validates rollout records and packs them into a ``TrajectoryBatch``.

    A record (also one JSONL line) is::

        {"group": str|int, "task": str|int (default: the group), "outcome": float,
         "turns": [{"observation": [int], "action": [int], "reward": float,
                    "state_key": str|int, "logprobs": [float], "value": float,
                    "values": [float], "ref_logprobs": [float]}, ...]}

    ``reward``, ``state_key`` and the per-token lists are optional. Method-specific turn
    fields (all optional): ``"action_key": str|int`` (default: a hash of the action tokens;
    e.g. an AST signature of a shell command), ``"turn_key": str|int`` (any grouping key, e.g.
    a belief-state hash -> ``extras['turn_keys']`` [N, K] uint32), ``"turn_extras": {name:
    number or [numbers]}`` (-> ``extras[name]`` [N, K] or [N, K, D] float32, e.g.
    ``high_values``, ``state_features``) and ``"token_extras": {name: [number or bool per
    action token]}`` (-> ``extras[name]`` [R, T] float32 or bool, e.g. ``subgoal_mask``). A record without any turn
    reward gets its outcome as the last turn's reward; a record without ``outcome`` gets the sum
    of its turn rewards. ``logprobs``/``value``/``values``/``ref_logprobs`` must be given on
    every turn of every record or on none (half-known log-probs would silently train on zeros).
    ``state_key`` defaults to a hash of the turn's observation.

    Values must fit float32 (the batch's dtype); ``logprobs`` and ``ref_logprobs`` must be
    <= 0 (``LOGPROB_TOLERANCE`` of rounding noise allowed). A field that is neither read here
    nor written by the rollout collector (``RECORD_FIELDS``, ``TURN_FIELDS``) gives an
    ``UnknownFieldWarning`` with the closest known name (``strict=True``: a ``RecordError``).

    Per-shard sizes are padded to powers of two (``bucket``) unless ``pad_to`` (a dict with keys
    ``num_traj``, ``num_turns``, ``num_rows``, ``row_len``) fixes them. With ``num_shards`` = D
    the trajectories are split into D equal blocks keeping every group whole in one block.

    Returns:
      ``(batch, RecordIndex)``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not _is_int(num_shards) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    pads = _parse_pad_to(pad_to)
    records = list(records)
    for i, key, hint in unknown_fields(records):
        msg = f"unknown field {key!r}" + (f" (did you mean {hint!r}?)" if hint else "") + \
            "; it is not read"
        if strict:
            raise RecordError(i, msg)
        import warnings
        warnings.warn(UnknownFieldWarning(f"record {i}: {msg}"), stacklevel=2)
    trajs = [_parse_record(i, r) for i, r in enumerate(records)]
    if not trajs:
        raise ValueError("records: no rollout records given")
    for name in _OPTIONAL_TURN_FIELDS:
        have = [getattr(t, name) is not None for tr in trajs for t in tr.turns]
        if any(have) and not all(have):
            i = next(i for i, tr in enumerate(trajs)
                     if any(getattr(t, name) is None for t in tr.turns))
            raise RecordError(i, f"turns lack '{name}' while other turns have it: give "
                                 f"'{name}' on every turn of every record or on none")

    extra_kind = _extras_layout(trajs)

    caller_index = task_index
    task_index = {} if task_index is None else dict(task_index)
    group_order: dict = {}
    for i, tr in enumerate(trajs):
        group_order.setdefault(tr.group, []).append(i)
        task_index.setdefault(tr.task, len(task_index))
    groups = list(group_order.values())
    shard_of = assign_shards([len(g) for g in groups], num_shards)
    per_shard = [[] for _ in range(num_shards)]
    for g, s in zip(groups, shard_of):
        per_shard[s].extend(g)

    def row_lengths(tr):
        lens = [len(t.observation) + len(t.action) for t in tr.turns]
        return [sum(lens)] if layout == "concatenated" else lens

    max_k = max(len(tr.turns) for tr in trajs)
    max_t = max(max(row_lengths(tr)) for tr in trajs)
    rows_per_shard = [sum(len(row_lengths(trajs[i])) for i in s) for s in per_shard]
    n_local = bucket(max(len(s) for s in per_shard), 8 // num_shards or 1)
    r_local = n_local if layout == "concatenated" else bucket(max(rows_per_shard), 8 // num_shards or 1)
    sizes = {"num_traj": n_local * num_shards, "num_turns": bucket(max_k),
             "num_rows": r_local * num_shards, "row_len": bucket(max_t, 16)}
    need = {"num_traj": max(len(s) for s in per_shard) * num_shards, "num_turns": max_k,
            "num_rows": max(rows_per_shard) * num_shards, "row_len": max_t}
    for key, value in pads.items():
        if value < need[key] or value % (num_shards if key in ("num_traj", "num_rows") else 1):
            raise ValueError(f"pad_to['{key}'] = {value} is too small or not divisible by "
                             f"num_shards={num_shards}: these records need {need[key]}")
        sizes[key] = value
    if layout == "concatenated":  # one row per trajectory: R is N
        if "num_rows" in pads and "num_traj" in pads and pads["num_rows"] != pads["num_traj"]:
            raise ValueError("pad_to: the concatenated layout has one row per trajectory, so "
                             "num_rows must equal num_traj")
        sizes["num_traj"] = sizes["num_rows"] = pads.get("num_traj", pads.get(
            "num_rows", sizes["num_traj"]))
    N, K, R, T = sizes["num_traj"], sizes["num_turns"], sizes["num_rows"], sizes["row_len"]
    n_local, r_local = N // num_shards, R // num_shards

    tokens = np.zeros((R, T), np.int32)
    action_mask = np.zeros((R, T), bool)
    turn_ids = np.full((R, T), -1, np.int32)
    row_traj = np.zeros((R,), np.int32)
    old_lp = np.zeros((R, T), np.float32)
    turn_mask = np.zeros((N, K), bool)
    turn_rewards = np.zeros((N, K), np.float32)
    state_keys = np.zeros((N, K), np.uint32)
    action_keys = np.zeros((N, K), np.uint32)
    group_ids = np.zeros((N,), np.int32)
    task_ids = np.zeros((N,), np.int32)
    traj_mask = np.zeros((N,), bool)
    outcome = np.zeros((N,), np.float32)
    first = trajs[0].turns[0]
    tok_extra = {name: np.zeros((R, T), np.float32) for name, src in
                 (("ref_logprobs", first.ref_logprobs), ("token_values", first.values))
                 if src is not None}
    turn_values = np.zeros((N, K), np.float32) if first.value is not None else None
    turn_keys = np.zeros((N, K), np.uint32) if first.turn_key is not None else None
    free = {}
    for (level, name), (dtype, dim) in extra_kind.items():
        lead = {"token": (R, T), "turn": (N, K), "traj": (N,)}[level]
        free[name] = np.zeros(lead + (() if level == "token" or not dim else (dim,)), dtype)
    with_edges = [tr.edges is not None for tr in trajs]
    if any(with_edges) and not all(with_edges):
        raise RecordError(with_edges.index(False), "lacks 'edges' while other records have "
                                                   "them: give 'edges' (maybe []) on every record or on none")
    edges = (np.full((N, bucket(max(len(tr.edges) for tr in trajs), 4), 3), -1, np.int32)
             if all(with_edges) else None)

    rec_traj, rec_spans = [0] * len(trajs), [None] * len(trajs)
    group_id_of: dict = {}
    for s, members in enumerate(per_shard):
        n0, r0 = s * n_local, s * r_local
        # padding rows point into their own block (concatenated: at their own padding slot)
        row_traj[r0:r0 + r_local] = np.arange(n0, n0 + r_local) if layout == "concatenated" else n0
        row = r0
        for j, i in enumerate(members):
            tr, n = trajs[i], n0 + j
            rec_traj[i] = n
            group_ids[n] = group_id_of.setdefault(tr.group, n)
            task_ids[n], traj_mask[n], outcome[n] = task_index[tr.task], True, tr.outcome
            for name, x in tr.traj_extras.items():
                free[name][n] = x
            if edges is not None and tr.edges:
                edges[n, :len(tr.edges)] = tr.edges
            spans, pos = [], 0
            for k, t in enumerate(tr.turns):
                if layout == "per_step" and k > 0:
                    row, pos = row + 1, 0
                row_traj[row] = n
                o, a = len(t.observation), len(t.action)
                tokens[row, pos:pos + o] = t.observation
                tokens[row, pos + o:pos + o + a] = t.action
                act = slice(pos + o, pos + o + a)
                action_mask[row, act] = True
                turn_ids[row, act] = k
                if t.logprobs is not None:
                    old_lp[row, act] = t.logprobs
                if t.ref_logprobs is not None:
                    tok_extra["ref_logprobs"][row, act] = t.ref_logprobs
                if t.values is not None:
                    tok_extra["token_values"][row, act] = t.values
                if turn_values is not None:
                    turn_values[n, k] = t.value
                if turn_keys is not None:
                    turn_keys[n, k] = t.turn_key
                for name, x in t.turn_extras.items():
                    free[name][n, k] = x
                for name, x in t.token_extras.items():
                    free[name][row, act] = x
                turn_mask[n, k] = True
                turn_rewards[n, k] = t.reward
                state_keys[n, k], action_keys[n, k] = t.state_key, t.action_key
                spans.append((row, act.start, act.stop))
                pos += o + a
            row += 1
            rec_spans[i] = spans

    extras = dict(tok_extra)
    if turn_values is not None:
        extras["turn_values"] = turn_values
    if turn_keys is not None:
        extras["turn_keys"] = turn_keys
    extras.update(free)
    if edges is not None:
        extras["edges"] = edges
    levels = {name: "token" for name in tok_extra}
    levels.update({name: level for (level, name) in extra_kind})
    levels.update({name: "turn" for name in ("turn_values", "turn_keys") if name in extras})
    if edges is not None:
        levels["edges"] = "traj"
    batch = TrajectoryBatch(tokens=tokens, action_mask=action_mask, turn_ids=turn_ids,
                            row_traj=row_traj, old_logprobs=old_lp, turn_mask=turn_mask,
                            turn_rewards=turn_rewards, state_keys=state_keys,
                            action_keys=action_keys, group_ids=group_ids, task_ids=task_ids,
                            traj_mask=traj_mask, outcome=outcome, extras=extras, layout=layout,
                            extra_levels=tuple(sorted(levels.items())))
    validate_batch(batch, num_shards=num_shards)
    if caller_index is not None:  # extended in place, only once everything succeeded
        caller_index.update(task_index)
        task_index = caller_index
    return batch, RecordIndex(rec_traj, rec_spans, task_index)


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
    if not _is_int(num_shards) or num_shards < 1:
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

