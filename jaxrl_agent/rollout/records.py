"""Rollout records on the host: their format, their checks, and packing them into the batch
contract (``jaxrl_agent.batch.TrajectoryBatch``).

A record is what the collector (``collect_groups``) emits and what ``jaxrl-agent credit`` reads
from JSONL, one per trajectory (the format: ``pack_records``). Packing runs in three steps:

    records --parse_records--> [Record] --plan_packing--> PackPlan --pack--> (batch, RecordIndex)

* ``parse_records`` checks every field and names the record and field of a mistake
  (``RecordError``), returning ``Record`` / ``Turn`` dataclasses;
* ``plan_packing`` decides the shapes (N trajectories, K turns, R rows of T tokens, each a
  power of two unless fixed) and which trajectories go to which shard (whole groups per shard);
  ``PackPlan.padded`` fixes sizes (the trainer fixes them for a few compiles per run);
* ``pack`` allocates the arrays and fills them, then validates the batch.

``pack_records`` does the three in one call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from jaxrl_agent.batch import LAYOUTS, TrajectoryBatch, bucket, validate_batch

__all__ = ["LOGPROB_TOLERANCE", "PAD_KEYS", "RECORD_FIELDS", "TURN_FIELDS", "PackPlan", "Record",
           "RecordError", "RecordIndex", "Turn", "UnknownFieldWarning", "assign_shards", "pack",
           "pack_records", "parse_record", "parse_records", "plan_packing", "stable_key",
           "unknown_fields"]

class RecordError(ValueError):
    """A malformed rollout record; ``index`` is its position in the input sequence."""

    def __init__(self, index: int, message: str):
        self.index = index
        self.detail = message
        super().__init__(f"record {index}: {message}")


# ----------------------------------------------------------------------------- keys


def stable_key(value) -> int:
    """A uint32 hash of a str, int or token list that is the same in every process."""
    if isinstance(value, str):
        data = b"s:" + value.encode("utf-8")
    elif isinstance(value, (int, np.integer)):
        data = b"i:" + str(int(value)).encode()
    else:
        data = b"t:" + np.asarray(value, np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little")


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
                 "context_truncated", "num_turns", "teacher_context")
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
    token (length = the action's length) a list of numbers or bools, one per action token, or
    a list of equal-length lists of numbers (a vector per token)."""
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
        elif isinstance(x, (list, tuple)) and x and all(isinstance(y, (list, tuple)) for y in x):
            if len(x) != length:
                raise RecordError(idx, f"{w} has {len(x)} entries but the action has {length}")
            if not x[0] or any(len(y) != len(x[0]) for y in x):
                raise RecordError(idx, f"{w}: the per-token vectors must be non-empty and of "
                                       f"one length")
            out[name] = [_check_floats(idx, f"{w}[{j}]", y, len(x[0]), f"{w}[0]")
                         for j, y in enumerate(x)]
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
class Turn:
    """One checked turn of a record: token ids, reward, hashed keys and the optional per-token
    and per-turn fields (``None`` where the record does not give them)."""

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
class Record:
    """One checked rollout record (``parse_records``): its group and task labels, outcome, turns
    (``Turn``), trajectory-level extras and turn-to-turn edges."""

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


def parse_record(idx: int, rec) -> Record:
    """One record (a dict, e.g. a JSONL line) checked and converted; ``RecordError`` naming
    record ``idx`` and the field otherwise. See ``pack_records`` for the format."""
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
        turns.append(Turn(obs, act, reward, state_key, action_key, lp, value, values, ref,
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
    return Record(group, task if task is not None else group, outcome, turns, traj_extras, edges)


def _extras_layout(trajs: list) -> dict:
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
                        kind = (np.bool_ if isinstance(x[0], bool) else np.float32,
                                len(x[0]) if isinstance(x[0], list) else None)
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


def assign_shards(group_sizes: list, num_shards: int) -> list:
    """Whole groups to shards, greedily to the least-loaded shard, in first-seen order."""
    load = [0] * num_shards
    shard_of = []
    for size in group_sizes:
        s = min(range(num_shards), key=lambda d: (load[d], d))
        shard_of.append(s)
        load[s] += size
    return shard_of


# ----------------------------------------------------------------------------- parse


def parse_records(records: Iterable[Mapping], strict: bool = False) -> list:
    """Checks rollout records and returns them as ``Record``s.

    A field that is neither read here nor written by the collector (``RECORD_FIELDS``,
    ``TURN_FIELDS``) gives an ``UnknownFieldWarning`` with the closest known name
    (``strict=True``: a ``RecordError``). ``logprobs``/``value``/``values``/``ref_logprobs``/
    ``turn_key`` and ``edges`` must be given everywhere or nowhere.
    """
    records = list(records)
    for i, key, hint in unknown_fields(records):
        msg = f"unknown field {key!r}" + (f" (did you mean {hint!r}?)" if hint else "") + \
            "; it is not read"
        if strict:
            raise RecordError(i, msg)
        warnings.warn(UnknownFieldWarning(f"record {i}: {msg}"), stacklevel=3)
    recs = [parse_record(i, r) for i, r in enumerate(records)]
    if not recs:
        raise ValueError("records: no rollout records given")
    for name in _OPTIONAL_TURN_FIELDS:
        have = [getattr(t, name) is not None for tr in recs for t in tr.turns]
        if any(have) and not all(have):
            i = next(i for i, tr in enumerate(recs)
                     if any(getattr(t, name) is None for t in tr.turns))
            raise RecordError(i, f"turns lack '{name}' while other turns have it: give "
                                 f"'{name}' on every turn of every record or on none")
    with_edges = [tr.edges is not None for tr in recs]
    if any(with_edges) and not all(with_edges):
        raise RecordError(with_edges.index(False), "lacks 'edges' while other records have "
                                                   "them: give 'edges' (maybe []) on every "
                                                   "record or on none")
    return recs


# ----------------------------------------------------------------------------- plan


#: the sizes a plan decides, and ``pad_to`` / ``PackPlan.padded`` may fix
PAD_KEYS = ("num_traj", "num_turns", "num_rows", "row_len")


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where every record goes and how large the arrays are.

    Attributes:
      layout: ``"concatenated"`` (one row per trajectory) or ``"per_step"`` (one per turn).
      shards: per shard, the indices of its records in packing order (whole groups).
      need: the smallest sizes these records fit (``PAD_KEYS``; trajectories and rows counted
        as ``num_shards`` times the fullest shard's).
      sizes: the chosen sizes (``PAD_KEYS``), each >= ``need``.
      extras: ``(level, name) -> (dtype, vector size or None)`` of the free-form extras.
      optional: the optional per-turn fields the records carry (``logprobs``, ``value``, ...).
      num_edges: the padded number of edges per trajectory, or None without edges.
    """

    layout: str
    shards: tuple
    need: dict
    sizes: dict
    extras: dict
    optional: tuple
    num_edges: int | None

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def padded(self, **sizes) -> PackPlan:
        """This plan with some sizes fixed (keys from ``PAD_KEYS``). Raises ValueError for a
        size below ``need``, a trajectory or row count not divisible by the shards, or (in the
        concatenated layout, where R is N) different ``num_traj`` and ``num_rows``."""
        bad = set(sizes) - set(PAD_KEYS)
        if bad:
            raise ValueError(f"pad_to: unknown keys {sorted(bad)}; expected some of {PAD_KEYS}")
        d = self.num_shards
        for key, value in sizes.items():
            if not _is_int(value) or value < 1:
                raise ValueError(f"pad_to['{key}'] must be a positive int, got {value!r}")
            if value < self.need[key] or value % (d if key in ("num_traj", "num_rows") else 1):
                raise ValueError(f"pad_to['{key}'] = {value} is too small or not divisible by "
                                 f"num_shards={d}: these records need {self.need[key]}")
        new = dict(self.sizes, **sizes)
        if self.layout == "concatenated":  # one row per trajectory: R is N
            if "num_rows" in sizes and "num_traj" in sizes and \
                    sizes["num_rows"] != sizes["num_traj"]:
                raise ValueError("pad_to: the concatenated layout has one row per trajectory, "
                                 "so num_rows must equal num_traj")
            new["num_traj"] = new["num_rows"] = sizes.get("num_traj", sizes.get(
                "num_rows", self.sizes["num_traj"]))
        return dataclasses.replace(self, sizes=new)


def _row_lengths(rec: Record, layout: str) -> list:
    lens = [len(t.observation) + len(t.action) for t in rec.turns]
    return [sum(lens)] if layout == "concatenated" else lens


def plan_packing(recs: list, layout: str = "concatenated", num_shards: int = 1,
                 pad_to: Mapping | None = None) -> PackPlan:
    """The packing plan of parsed records (``parse_records``).

    Groups go whole to shards (``assign_shards``); each size is the power of two (``bucket``)
    above what the records need (trajectories and rows at least 8 in all, rows at least 16
    tokens), unless ``pad_to`` (a dict with keys from ``PAD_KEYS``) fixes it. Raises
    ValueError for an unknown layout, a bad ``num_shards`` or ``pad_to``, and ``RecordError``
    when records disagree on which extras they carry.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not _is_int(num_shards) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    if pad_to is not None and not isinstance(pad_to, Mapping):
        raise ValueError(f"pad_to must be a dict with keys from {PAD_KEYS}, got {pad_to!r}")
    extras = _extras_layout(recs)
    group_order: dict = {}
    for i, tr in enumerate(recs):
        group_order.setdefault(tr.group, []).append(i)
    groups = list(group_order.values())
    per_shard = [[] for _ in range(num_shards)]
    for g, s in zip(groups, assign_shards([len(g) for g in groups], num_shards)):
        per_shard[s].extend(g)

    max_k = max(len(tr.turns) for tr in recs)
    max_t = max(max(_row_lengths(tr, layout)) for tr in recs)
    most = max(len(s) for s in per_shard)
    rows = max(sum(len(_row_lengths(recs[i], layout)) for i in s) for s in per_shard)
    least = 8 // num_shards or 1
    n_local = bucket(most, least)
    r_local = n_local if layout == "concatenated" else bucket(rows, least)
    sizes = {"num_traj": n_local * num_shards, "num_turns": bucket(max_k),
             "num_rows": r_local * num_shards, "row_len": bucket(max_t, 16)}
    need = {"num_traj": most * num_shards, "num_turns": max_k, "num_rows": rows * num_shards,
            "row_len": max_t}
    first = recs[0].turns[0]
    optional = tuple(n for n in _OPTIONAL_TURN_FIELDS if getattr(first, n) is not None)
    num_edges = (bucket(max(len(tr.edges) for tr in recs), 4)
                 if recs[0].edges is not None else None)
    plan = PackPlan(layout, tuple(tuple(s) for s in per_shard), need, sizes, extras, optional,
                    num_edges)
    return plan.padded(**pad_to) if pad_to else plan


# ----------------------------------------------------------------------------- pack


def _allocate(plan: PackPlan) -> tuple:
    """Zeroed arrays of the batch fields and of the extras the plan's records fill (padding
    values included)."""
    N, K, R, T = (plan.sizes[k] for k in PAD_KEYS)
    a = {"tokens": np.zeros((R, T), np.int32), "action_mask": np.zeros((R, T), bool),
         "turn_ids": np.full((R, T), -1, np.int32), "row_traj": np.zeros((R,), np.int32),
         "old_logprobs": np.zeros((R, T), np.float32), "turn_mask": np.zeros((N, K), bool),
         "turn_rewards": np.zeros((N, K), np.float32),
         "state_keys": np.zeros((N, K), np.uint32), "action_keys": np.zeros((N, K), np.uint32),
         "group_ids": np.zeros((N,), np.int32), "task_ids": np.zeros((N,), np.int32),
         "traj_mask": np.zeros((N,), bool), "outcome": np.zeros((N,), np.float32)}
    extras = {}
    if "ref_logprobs" in plan.optional:
        extras["ref_logprobs"] = np.zeros((R, T), np.float32)
    if "values" in plan.optional:
        extras["token_values"] = np.zeros((R, T), np.float32)
    if "value" in plan.optional:
        extras["turn_values"] = np.zeros((N, K), np.float32)
    if "turn_key" in plan.optional:
        extras["turn_keys"] = np.zeros((N, K), np.uint32)
    for (level, name), (dtype, dim) in plan.extras.items():
        lead = {"token": (R, T), "turn": (N, K), "traj": (N,)}[level]
        extras[name] = np.zeros(lead + (() if not dim else (dim,)), dtype)
    if plan.num_edges is not None:
        extras["edges"] = np.full((N, plan.num_edges, 3), -1, np.int32)
    return a, extras


def _fill(a: dict, extras: dict, recs: list, plan: PackPlan, task_index: dict) -> RecordIndex:
    """Writes every record into its planned place; returns where each landed."""
    n_local = plan.sizes["num_traj"] // plan.num_shards
    r_local = plan.sizes["num_rows"] // plan.num_shards
    rec_traj, rec_spans = [0] * len(recs), [None] * len(recs)
    group_id_of: dict = {}
    for s, members in enumerate(plan.shards):
        n0, r0 = s * n_local, s * r_local
        # padding rows point into their own block (concatenated: at their own padding slot)
        a["row_traj"][r0:r0 + r_local] = (np.arange(n0, n0 + r_local)
                                          if plan.layout == "concatenated" else n0)
        row = r0
        for j, i in enumerate(members):
            tr, n = recs[i], n0 + j
            rec_traj[i] = n
            a["group_ids"][n] = group_id_of.setdefault(tr.group, n)
            a["task_ids"][n], a["traj_mask"][n], a["outcome"][n] = (task_index[tr.task], True,
                                                                    tr.outcome)
            for name, x in tr.traj_extras.items():
                extras[name][n] = x
            if tr.edges:
                extras["edges"][n, :len(tr.edges)] = tr.edges
            spans, pos = [], 0
            for k, t in enumerate(tr.turns):
                if plan.layout == "per_step" and k > 0:
                    row, pos = row + 1, 0
                a["row_traj"][row] = n
                o, m = len(t.observation), len(t.action)
                a["tokens"][row, pos:pos + o] = t.observation
                a["tokens"][row, pos + o:pos + o + m] = t.action
                act = slice(pos + o, pos + o + m)
                a["action_mask"][row, act] = True
                a["turn_ids"][row, act] = k
                if t.logprobs is not None:
                    a["old_logprobs"][row, act] = t.logprobs
                if t.ref_logprobs is not None:
                    extras["ref_logprobs"][row, act] = t.ref_logprobs
                if t.values is not None:
                    extras["token_values"][row, act] = t.values
                if t.value is not None:
                    extras["turn_values"][n, k] = t.value
                if t.turn_key is not None:
                    extras["turn_keys"][n, k] = t.turn_key
                for name, x in t.turn_extras.items():
                    extras[name][n, k] = x
                for name, x in t.token_extras.items():
                    extras[name][row, act] = x
                a["turn_mask"][n, k] = True
                a["turn_rewards"][n, k] = t.reward
                a["state_keys"][n, k], a["action_keys"][n, k] = t.state_key, t.action_key
                spans.append((row, act.start, act.stop))
                pos += o + m
            row += 1
            rec_spans[i] = spans
    return RecordIndex(rec_traj, rec_spans, task_index)


def pack(recs: list, plan: PackPlan, task_index: dict | None = None):
    """Packs parsed records by their plan into a validated ``TrajectoryBatch``.

    ``task_index`` (task label -> id) is extended with new tasks, in place, and only once the
    batch is valid. Returns ``(batch, RecordIndex)``.
    """
    index = {} if task_index is None else dict(task_index)
    for tr in recs:
        index.setdefault(tr.task, len(index))
    a, extras = _allocate(plan)
    where = _fill(a, extras, recs, plan, index)
    levels = {"ref_logprobs": "token", "token_values": "token", "turn_values": "turn",
              "turn_keys": "turn", "edges": "traj"}
    levels = {name: lvl for name, lvl in levels.items() if name in extras}
    levels.update({name: level for (level, name) in plan.extras})
    batch = TrajectoryBatch(**a, extras=extras, layout=plan.layout,
                            extra_levels=tuple(sorted(levels.items())))
    validate_batch(batch, num_shards=plan.num_shards)
    if task_index is not None:  # extended in place, only once everything succeeded
        task_index.update(index)
        where.task_index = task_index
    return batch, where


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
    recs = parse_records(records, strict=strict)
    plan = plan_packing(recs, layout, num_shards, pad_to)
    return pack(recs, plan, task_index)
