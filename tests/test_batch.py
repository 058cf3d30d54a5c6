"""pack_records (parse -> plan -> pack) / validate_batch: the batch contract.

Expected arrays are written out by hand (small examples) or computed with plain Python from
the records; error tests check that the message names the field and the record index.
"""

import copy
import math

import numpy as np
import pytest

from jaxrl_agent.batch import TrajectoryBatch, round_up_to_step, validate_batch
from jaxrl_agent.rollout.records import (RecordError, pack, pack_records, parse_records,
                                         plan_packing, stable_key)
from tests.strategies import random_records

LAYOUTS = ("concatenated", "per_step")


def _next_pow2(n, minimum=1):
    p = 1
    while p < max(n, minimum):
        p *= 2
    return p


# ----------------------------------------------------------------------------- hand example

# Three records; groups "g1" (records 0 and 2) and 7 (record 1, no task: task = its group).
# Packing keeps groups together in first-seen order, so trajectories are
#   traj 0 = record 0, traj 1 = record 2, traj 2 = record 1.
HAND = [
    {"group": "g1", "task": "A", "outcome": 1.0, "turns": [
        {"observation": [10, 11], "action": [20, 21], "reward": 0.5, "logprobs": [-0.1, -0.2],
         "value": 0.3, "values": [0.1, 0.2], "ref_logprobs": [-0.3, -0.4]},
        {"observation": [12], "action": [22], "reward": 0.25, "logprobs": [-0.5],
         "value": 0.6, "values": [0.7], "ref_logprobs": [-0.8], "state_key": 42}]},
    {"group": 7, "outcome": 0.0, "turns": [
        {"observation": [], "action": [30, 31, 32], "reward": -1.0,
         "logprobs": [-1.0, -1.5, -2.0], "value": -0.5, "values": [0.0, 0.5, 1.0],
         "ref_logprobs": [-1.1, -1.6, -2.1], "state_key": "s"}]},
    {"group": "g1", "task": "B", "outcome": 2.0, "turns": [
        {"observation": [13], "action": [23], "reward": 2.0, "logprobs": [-0.05],
         "value": 1.5, "values": [1.25], "ref_logprobs": [-0.06]}]},
]

# (row, start) -> values of each row, for the two layouts
HAND_ROWS = {
    "concatenated": {
        "tokens": {0: [10, 11, 20, 21, 12, 22], 1: [13, 23], 2: [30, 31, 32]},
        "turn_ids": {0: [-1, -1, 0, 0, -1, 1], 1: [-1, 0], 2: [0, 0, 0]},
        "old_logprobs": {0: [0, 0, -0.1, -0.2, 0, -0.5], 1: [0, -0.05], 2: [-1.0, -1.5, -2.0]},
        "token_values": {0: [0, 0, 0.1, 0.2, 0, 0.7], 1: [0, 1.25], 2: [0.0, 0.5, 1.0]},
        "ref_logprobs": {0: [0, 0, -0.3, -0.4, 0, -0.8], 1: [0, -0.06], 2: [-1.1, -1.6, -2.1]},
        "row_traj": {0: 0, 1: 1, 2: 2},
        "spans": [[(0, 2, 4), (0, 5, 6)], [(2, 0, 3)], [(1, 1, 2)]],
        "shape": (8, 16),
    },
    "per_step": {
        "tokens": {0: [10, 11, 20, 21], 1: [12, 22], 2: [13, 23], 3: [30, 31, 32]},
        "turn_ids": {0: [-1, -1, 0, 0], 1: [-1, 1], 2: [-1, 0], 3: [0, 0, 0]},
        "old_logprobs": {0: [0, 0, -0.1, -0.2], 1: [0, -0.5], 2: [0, -0.05],
                         3: [-1.0, -1.5, -2.0]},
        "token_values": {0: [0, 0, 0.1, 0.2], 1: [0, 0.7], 2: [0, 1.25], 3: [0.0, 0.5, 1.0]},
        "ref_logprobs": {0: [0, 0, -0.3, -0.4], 1: [0, -0.8], 2: [0, -0.06],
                         3: [-1.1, -1.6, -2.1]},
        "row_traj": {0: 0, 1: 0, 2: 1, 3: 2},
        "spans": [[(0, 2, 4), (1, 1, 2)], [(3, 0, 3)], [(2, 1, 2)]],
        "shape": (8, 16),
    },
}


def _rows(spec, shape, fill, dtype):
    out = np.full(shape, fill, dtype)
    for r, v in spec.items():
        out[r, :len(v)] = v
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hand_example_fields(layout):
    b, idx = pack_records(HAND, layout=layout)
    e = HAND_ROWS[layout]
    R, T = e["shape"]
    assert b.layout == layout
    assert b.tokens.shape == (R, T) and b.turn_mask.shape == (8, 2)
    np.testing.assert_array_equal(b.tokens, _rows(e["tokens"], (R, T), 0, np.int32))
    tid = _rows(e["turn_ids"], (R, T), -1, np.int32)
    np.testing.assert_array_equal(b.turn_ids, tid)
    np.testing.assert_array_equal(b.action_mask, tid >= 0)
    np.testing.assert_allclose(b.old_logprobs, _rows(e["old_logprobs"], (R, T), 0, np.float32))
    np.testing.assert_allclose(b.extras["token_values"],
                               _rows(e["token_values"], (R, T), 0, np.float32))
    np.testing.assert_allclose(b.extras["ref_logprobs"],
                               _rows(e["ref_logprobs"], (R, T), 0, np.float32))
    for r, n in e["row_traj"].items():
        assert b.row_traj[r] == n
    assert np.all((b.row_traj >= 0) & (b.row_traj < 8))
    tm = np.zeros((8, 2), bool)
    tm[0, :2] = tm[1, 0] = tm[2, 0] = True
    np.testing.assert_array_equal(b.turn_mask, tm)
    tr = np.zeros((8, 2), np.float32)
    tr[0] = [0.5, 0.25]
    tr[1, 0], tr[2, 0] = 2.0, -1.0
    np.testing.assert_allclose(b.turn_rewards, tr)
    tv = np.zeros((8, 2), np.float32)
    tv[0] = [0.3, 0.6]
    tv[1, 0], tv[2, 0] = 1.5, -0.5
    np.testing.assert_allclose(b.extras["turn_values"], tv)
    assert sorted(b.extras) == ["ref_logprobs", "token_values", "turn_values"]
    np.testing.assert_array_equal(b.traj_mask, [1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(b.group_ids[:3], [0, 0, 2])  # index of first member
    np.testing.assert_array_equal(b.task_ids[:3], [0, 2, 1])  # A=0, 7=1, B=2 (record order)
    assert idx.task_index == {"A": 0, 7: 1, "B": 2}
    np.testing.assert_allclose(b.outcome, [1.0, 2.0, 0.0, 0, 0, 0, 0, 0])
    sk = np.zeros((8, 2), np.uint32)
    sk[0] = [stable_key([10, 11]), stable_key(42)]
    sk[1, 0], sk[2, 0] = stable_key([13]), stable_key("s")
    np.testing.assert_array_equal(b.state_keys, sk)
    ak = np.zeros((8, 2), np.uint32)
    ak[0] = [stable_key([20, 21]), stable_key([22])]
    ak[1, 0], ak[2, 0] = stable_key([23]), stable_key([30, 31, 32])
    np.testing.assert_array_equal(b.action_keys, ak)
    # dtypes of the contract
    for f, dt in (("tokens", np.int32), ("action_mask", bool), ("turn_ids", np.int32),
                  ("row_traj", np.int32), ("old_logprobs", np.float32), ("turn_mask", bool),
                  ("turn_rewards", np.float32), ("state_keys", np.uint32),
                  ("action_keys", np.uint32), ("group_ids", np.int32), ("task_ids", np.int32),
                  ("traj_mask", bool), ("outcome", np.float32)):
        assert np.asarray(getattr(b, f)).dtype == dt, f
    # the record index
    assert idx.traj == [0, 2, 1]
    assert idx.spans == e["spans"]
    # the three steps by hand give the same batch
    recs = parse_records(HAND)
    b2, _ = pack(recs, plan_packing(recs, layout))
    for f in ("tokens", "turn_ids", "row_traj", "group_ids", "task_ids", "state_keys"):
        np.testing.assert_array_equal(getattr(b2, f), getattr(b, f))


def _strip(recs, *fields):
    recs = copy.deepcopy(recs)
    for r in recs:
        for t in r["turns"]:
            for f in fields:
                t.pop(f, None)
    return recs


def test_no_optional_fields_gives_no_extras_and_zero_logprobs():
    b = pack_records(_strip(HAND, "logprobs", "value", "values", "ref_logprobs"))[0]
    assert b.extras == {}
    assert not np.any(b.old_logprobs)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_record_index_spans_point_at_the_right_tokens(seed, layout):
    rng = np.random.default_rng(seed)
    recs = random_records(rng, num_traj=int(rng.integers(1, 12)), logprobs=True)
    b, idx = pack_records(recs, layout=layout)
    used = np.zeros(b.tokens.shape, bool)
    assert sorted(idx.traj) == list(range(len(recs)))
    for i, rec in enumerate(recs):
        n = idx.traj[i]
        assert b.traj_mask[n] and b.outcome[n] == np.float32(rec["outcome"])
        assert len(idx.spans[i]) == len(rec["turns"]) == b.turn_mask[n].sum()
        prev_row = None
        for k, ((r, s0, s1), turn) in enumerate(zip(idx.spans[i], rec["turns"])):
            assert b.row_traj[r] == n
            np.testing.assert_array_equal(b.tokens[r, s0:s1], turn["action"])
            obs = turn["observation"]
            np.testing.assert_array_equal(b.tokens[r, s0 - len(obs):s0], obs)
            assert b.action_mask[r, s0:s1].all() and (b.turn_ids[r, s0:s1] == k).all()
            np.testing.assert_allclose(b.old_logprobs[r, s0:s1], turn["logprobs"])
            assert b.turn_rewards[n, k] == np.float32(turn["reward"])
            if layout == "per_step":
                assert s0 == len(obs) and r != prev_row  # one row per turn
            elif prev_row is not None:
                assert r == prev_row  # one row per trajectory
            prev_row = r
            used[r, s0:s1] = True
    np.testing.assert_array_equal(used, b.action_mask)  # no other action tokens


# ----------------------------------------------------------------------------- rewards, outcome


def test_outcome_only_record_puts_outcome_on_last_turn():
    rec = {"group": 0, "outcome": 0.75, "turns": [{"action": [1]}, {"action": [2]},
                                                  {"action": [3, 4]}]}
    b = pack_records([rec])[0]
    np.testing.assert_allclose(b.turn_rewards[0, :3], [0, 0, 0.75])
    assert b.outcome[0] == np.float32(0.75)


def test_missing_outcome_is_sum_of_rewards():
    rec = {"group": 0, "turns": [{"action": [1], "reward": 0.5}, {"action": [2]},
                                 {"action": [3], "reward": -2.25}]}
    b = pack_records([rec])[0]
    assert b.outcome[0] == np.float32(-1.75)
    np.testing.assert_allclose(b.turn_rewards[0, :3], [0.5, 0.0, -2.25])


def test_rewards_and_outcome_are_kept_apart():
    rec = {"group": 0, "outcome": 1.0, "turns": [{"action": [1], "reward": 0.5},
                                                 {"action": [2], "reward": 0.0}]}
    b = pack_records([rec])[0]
    assert b.outcome[0] == 1.0
    np.testing.assert_allclose(b.turn_rewards[0, :2], [0.5, 0.0])


# ----------------------------------------------------------------------------- keys, tasks

# Hard-coded once (jaxrl-agent 0.1.0, blake2b with a type prefix). Python's own hash() of str is
# salted per process (PYTHONHASHSEED), so a state key built on it would differ between the
# trainer and the sampler processes and between runs; these constants pin the key across
# processes, machines and versions: if they change, persisted per-state statistics break.
STABLE = [("1", 586682156), (1, 1419308671), ([1], 385635228), ("abc", 2816584780),
          (12345, 1464960788), ([1, 2, 3], 3089792350), ([], 3762531983),
          ("état", 202240270), (2**31, 206084667), ([0, 2**31 - 1], 1023509942)]


@pytest.mark.parametrize("value,key", STABLE, ids=[repr(v) for v, _ in STABLE])
def test_stable_key_hard_coded(value, key):
    assert stable_key(value) == key
    assert 0 <= stable_key(value) < 2**32


def test_stable_key_types():
    assert stable_key("1") != stable_key(1) != stable_key([1])
    assert stable_key("1") != stable_key([1])
    assert stable_key(np.int64(1)) == stable_key(1) == stable_key(np.uint32(1))
    assert stable_key((1, 2, 3)) == stable_key([1, 2, 3]) == stable_key(np.array([1, 2, 3]))


def test_state_key_default_and_explicit():
    recs = [{"group": 0, "outcome": 1.0, "turns": [
        {"observation": [5, 6], "action": [1]},
        {"observation": [5, 6], "action": [2]},  # same observation: same key
        {"observation": [7], "action": [3], "state_key": 9},
        {"observation": [7], "action": [4], "state_key": "9"},
        {"observation": [8], "action": [5], "state_key": 9},
        {"action": [6]}]}]  # no observation: hash of []
    b = pack_records(recs)[0]
    sk = b.state_keys[0, :6]
    np.testing.assert_array_equal(
        sk, [stable_key([5, 6]), stable_key([5, 6]), stable_key(9), stable_key("9"),
             stable_key(9), stable_key([])])
    assert sk[2] != sk[3]  # str "9" and int 9 are different states
    assert sk[2] == sk[4]  # explicit key wins over the observation
    assert sk[2] != stable_key([7])
    np.testing.assert_array_equal(b.action_keys[0, :2], [stable_key([1]), stable_key([2])])


def test_task_ids_first_seen_order_and_default_to_group():
    recs = [{"group": "x", "outcome": 0.0, "turns": [{"action": [1]}]},  # task "x"
            {"group": "y", "task": "z", "outcome": 0.0, "turns": [{"action": [1]}]},
            {"group": "y", "task": "x", "outcome": 0.0, "turns": [{"action": [1]}]},
            {"group": 3, "outcome": 0.0, "turns": [{"action": [1]}]}]
    b, idx = pack_records(recs)
    assert idx.task_index == {"x": 0, "z": 1, 3: 2}
    tasks = [int(b.task_ids[idx.traj[i]]) for i in range(4)]
    assert tasks == [0, 1, 0, 2]
    groups = [int(b.group_ids[idx.traj[i]]) for i in range(4)]
    assert groups[1] == groups[2] == min(idx.traj[1], idx.traj[2]) and groups[0] == idx.traj[0]
    # a task_index from earlier steps keeps its ids and is extended in place
    known = {"z": 5, "old": 0}
    b, idx = pack_records(recs, task_index=known)
    assert idx.task_index is known and known == {"z": 5, "old": 0, "x": 2, 3: 3}
    assert [int(b.task_ids[idx.traj[i]]) for i in range(4)] == [2, 5, 2, 3]


def test_group_labels_str_and_int_differ():
    recs = [{"group": "1", "outcome": 0.0, "turns": [{"action": [1]}]},
            {"group": 1, "outcome": 1.0, "turns": [{"action": [1]}]},
            {"group": "1", "outcome": 1.0, "turns": [{"action": [1]}]}]
    b, idx = pack_records(recs)
    g = [int(b.group_ids[idx.traj[i]]) for i in range(3)]
    assert g[0] == g[2] != g[1]


# ----------------------------------------------------------------------------- bucketing


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bucketed_shapes_are_powers_of_two(seed, layout):
    rng = np.random.default_rng(seed)
    recs = random_records(rng, num_traj=int(rng.integers(1, 21)), max_turns=int(rng.integers(1, 7)),
                          max_obs=int(rng.integers(0, 12)), max_act=int(rng.integers(1, 12)))
    b = pack_records(recs, layout=layout)[0]
    n, k = len(recs), max(len(r["turns"]) for r in recs)
    lens = [[len(t["observation"]) + len(t["action"]) for t in r["turns"]] for r in recs]
    if layout == "concatenated":
        t, rows = max(sum(x) for x in lens), n
    else:
        t, rows = max(max(x) for x in lens), sum(len(x) for x in lens)
    N, K = b.turn_mask.shape
    R, T = b.tokens.shape
    assert N == _next_pow2(n, 8) and K == _next_pow2(k) and T == _next_pow2(t, 16)
    assert R == (N if layout == "concatenated" else _next_pow2(rows, 8))
    for v in (N, K, R, T):
        assert v & (v - 1) == 0
    assert N >= 8 and T >= 16


@pytest.mark.parametrize("full,steps,multiple", [(768, 8, 1), (768, 8, 8), (100, 8, 4),
                                                 (12, 8, 12), (7, 3, 1)])
def test_round_up_to_step(full, steps, multiple):
    sizes = {round_up_to_step(n, full, steps, multiple) for n in range(full + 1)}
    for n in range(full + 1):
        r = round_up_to_step(n, full, steps, multiple)
        assert n <= r <= full and r % multiple == 0
    assert len(sizes) <= steps and full in sizes
    with pytest.raises(ValueError, match="n <= full"):
        round_up_to_step(full + 1, full, steps, multiple)
    # steps of at least min_step: a small size takes one value
    assert {round_up_to_step(n, full, steps, multiple, min_step=full)
            for n in range(full + 1)} == {full}


@pytest.mark.parametrize("layout,pad,shape", [
    ("concatenated", {"num_traj": 16, "num_turns": 8, "row_len": 64}, (16, 8, 16, 64)),
    ("concatenated", {"num_rows": 16}, (16, 4, 16, 16)),
    ("concatenated", {"num_traj": 12, "num_rows": 12, "row_len": 20}, (12, 4, 12, 20)),
    ("per_step", {"num_traj": 16, "num_turns": 4, "num_rows": 24, "row_len": 20},
     (16, 4, 24, 20)),
    ("per_step", {"num_traj": 5, "num_rows": 10}, (5, 4, 10, 16)),
])
def test_pad_to_fixes_shapes(layout, pad, shape):
    recs = [{"group": i % 2, "outcome": 1.0,
             "turns": [{"observation": [1, 2], "action": [3]}] * (1 + i % 3 + (i == 0))}
            for i in range(5)]  # 5 trajectories of 2, 2, 3, 1, 2 turns: K = 4, 10 rows
    b = pack_records(recs, layout=layout, pad_to=pad)[0]
    assert b.turn_mask.shape == shape[:2] and b.tokens.shape == shape[2:]


def test_pad_to_num_traj_below_bucket_minimum_is_honoured():
    recs = [{"group": 0, "outcome": 1.0, "turns": [{"action": [1]}]}] * 3
    b = pack_records(recs, pad_to={"num_traj": 4})[0]
    assert b.turn_mask.shape[0] == 4 and b.tokens.shape[0] == 4


def _small():
    return [{"group": 0, "outcome": 1.0, "turns": [{"observation": [1, 2], "action": [3, 4]}] * 3},
            {"group": 1, "outcome": 0.0, "turns": [{"action": [5]}]}]


@pytest.mark.parametrize("layout,pad,key", [
    ("concatenated", {"num_traj": 1}, "num_traj"),
    ("concatenated", {"num_turns": 2}, "num_turns"),
    ("concatenated", {"row_len": 11}, "row_len"),
    ("concatenated", {"num_rows": 1}, "num_rows"),
    ("per_step", {"num_rows": 3}, "num_rows"),
    ("per_step", {"row_len": 3}, "row_len"),
    ("per_step", {"num_traj": 1}, "num_traj"),
])
def test_pad_to_too_small(layout, pad, key):
    with pytest.raises(ValueError, match=rf"pad_to\['{key}'\]"):
        pack_records(_small(), layout=layout, pad_to=pad)


@pytest.mark.parametrize("layout,pad,key", [
    ("concatenated", {"num_traj": 9}, "num_traj"),
    ("per_step", {"num_rows": 9}, "num_rows"),
    ("per_step", {"num_traj": 7}, "num_traj"),
])
def test_pad_to_not_divisible_by_num_shards(layout, pad, key):
    with pytest.raises(ValueError, match=rf"pad_to\['{key}'\].*num_shards=2"):
        pack_records(_small(), layout=layout, pad_to=pad, num_shards=2)


@pytest.mark.parametrize("pad,match", [
    ({"num_tokens": 8}, "num_tokens"),
    ({"row_len": 0}, r"pad_to\['row_len'\]"),
    ({"num_turns": -4}, r"pad_to\['num_turns'\]"),
    ({"num_traj": 8.0}, r"pad_to\['num_traj'\]"),
    ({"num_traj": True}, r"pad_to\['num_traj'\]"),
    ([("num_traj", 8)], "pad_to"),
    (16, "pad_to"),
])
def test_pad_to_invalid(pad, match):
    with pytest.raises(ValueError, match=match):
        pack_records(_small(), pad_to=pad)


def test_pad_to_concatenated_rows_must_equal_traj():
    with pytest.raises(ValueError, match="num_rows must equal num_traj"):
        pack_records(_small(), pad_to={"num_traj": 8, "num_rows": 16})


# ----------------------------------------------------------------------------- shards


def _grouped_records(rng, n_groups, layout_rows=False):
    recs = []
    for g in rng.permutation(n_groups):
        for _ in range(int(rng.integers(1, 5))):
            nk = int(rng.integers(1, 5))
            recs.append({"group": f"g{g}", "task": int(g % 5),
                         "outcome": float(rng.integers(0, 2)),
                         "turns": [{"observation": [int(x) for x in rng.integers(0, 50, 2)],
                                    "action": [int(x) for x in rng.integers(0, 50, 2)],
                                    "reward": 0.1} for _ in range(nk)]})
    order = rng.permutation(len(recs))  # members of a group are not adjacent in the input
    return [recs[i] for i in order]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pad", [None, "fixed"])
def test_num_shards_keeps_groups_whole_per_block(seed, layout, pad):
    rng = np.random.default_rng(seed)
    recs = _grouped_records(rng, int(rng.integers(2, 10)))
    pad_to = ({"num_traj": 64, "num_rows": 8 * 64} if layout == "per_step"
              else {"num_traj": 64}) if pad else None
    b, idx = pack_records(recs, layout=layout, num_shards=8, pad_to=pad_to)
    N, R = b.turn_mask.shape[0], b.tokens.shape[0]
    assert N % 8 == 0 and R % 8 == 0
    n_loc, r_loc = N // 8, R // 8
    if pad is None:
        sizes = {}
        for r in recs:
            sizes[r["group"]] = sizes.get(r["group"], 0) + 1
        assert n_loc >= max(sizes.values()) and n_loc & (n_loc - 1) == 0
    members = {}
    for i, r in enumerate(recs):
        members.setdefault(r["group"], []).append(idx.traj[i])
    for g, trajs in members.items():
        blocks = {n // n_loc for n in trajs}
        assert len(blocks) == 1, (g, trajs)  # whole group in one block
        for n in trajs:
            assert b.group_ids[n] == min(trajs)  # the group's first trajectory
    # every row of block d points into trajectory block d
    np.testing.assert_array_equal(b.row_traj // n_loc, np.arange(R) // r_loc)
    # the action tokens are still right
    for i, r in enumerate(recs):
        for (row, s0, s1), t in zip(idx.spans[i], r["turns"]):
            np.testing.assert_array_equal(b.tokens[row, s0:s1], t["action"])
            assert b.row_traj[row] == idx.traj[i]
    b.validate(num_shards=8)
    b.validate(num_shards=4)  # coarser blocks are unions of finer ones
    validate_batch(b, num_shards=2)


def _sharded(layout="concatenated"):
    rng = np.random.default_rng(3)
    return pack_records(_grouped_records(rng, 6), layout=layout, num_shards=8)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_rule_violations_raise(layout):
    b = _sharded(layout)
    N, R = b.turn_mask.shape[0], b.tokens.shape[0]
    n_loc, r_loc = N // 8, R // 8
    tm = np.asarray(b.traj_mask)
    # a group split across blocks: a valid trajectory of block 1 joins a group of block 0
    i = int(np.nonzero(tm[n_loc:2 * n_loc])[0][0]) + n_loc
    j = int(np.nonzero(tm[:n_loc])[0][0])
    gid = np.array(b.group_ids)
    gid[i] = j
    bad = b.replace(group_ids=gid)
    bad.validate()  # fine as one block
    with pytest.raises(ValueError, match=rf"group_ids\[{i}\].*shard block"):
        bad.validate(num_shards=8)
    # a padding row of block 6 (6 groups fill blocks 0-5 only) points into block 0
    rt = np.array(b.row_traj)
    r = 6 * r_loc
    assert not b.action_mask[r].any()
    rt[r] = 0
    bad = b.replace(row_traj=rt)
    bad.validate()
    with pytest.raises(ValueError, match=rf"row_traj\[{r}\].*shard block"):
        bad.validate(num_shards=8)
    with pytest.raises(ValueError, match="num_shards=3 must divide"):
        b.validate(num_shards=3)


def test_unsharded_packing_violates_blocks():
    # 8 trajectories in 2 groups of 4, packed without num_shards: 4 per group spans 4 blocks
    recs = [{"group": g, "outcome": float(i % 2), "turns": [{"action": [1]}]}
            for g in (0, 1) for i in range(4)]
    b = pack_records(recs)[0]
    b.validate()
    with pytest.raises(ValueError, match="group_ids.*shard block"):
        b.validate(num_shards=8)


@pytest.mark.parametrize("num_shards", [0, -1])
def test_validate_rejects_invalid_num_shards(num_shards):
    with pytest.raises(ValueError, match="num_shards"):
        _sharded().validate(num_shards=num_shards)


# ----------------------------------------------------------------------------- record errors


def _good(**over):
    r = {"group": "g", "task": "t", "outcome": 1.0, "turns": [
        {"observation": [1, 2], "action": [3, 4], "reward": 0.5},
        {"observation": [5], "action": [6, 7], "reward": 0.5}]}
    r.update(over)
    return r


def _turn(k=0, **over):
    def mutate(r):
        r["turns"][k].update(over)
        return r
    return mutate


def _del_turn(field, k=0):
    def mutate(r):
        del r["turns"][k][field]
        return r
    return mutate


def _set(**over):
    def mutate(r):
        r.update(over)
        return r
    return mutate


def _del(field):
    def mutate(r):
        del r[field]
        return r
    return mutate


def _strip_rewards(r):
    for t in r["turns"]:
        t.pop("reward")
    r.pop("outcome")
    return r


RECORD_ERRORS = [
    ("not_object_list", lambda r: [r], "expected an object"),
    ("not_object_str", lambda r: "record", "expected an object, got str"),
    ("missing_group", _del("group"), "'group'"),
    ("group_float", _set(group=1.0), "'group' must be a str or int, got float"),
    ("group_bool", _set(group=True), "'group' must be a str or int, got bool"),
    ("group_list", _set(group=[1]), "'group' must be a str or int, got list"),
    ("group_none", _set(group=None), "'group' must be a str or int"),
    ("task_float", _set(task=2.0), "'task' must be a str or int, got float"),
    ("missing_turns", _del("turns"), "'turns'"),
    ("turns_str", _set(turns="abc"), "'turns' must be a list, got str"),
    ("turns_dict", _set(turns={"action": [1]}), "'turns' must be a list, got dict"),
    ("empty_turns", _set(turns=[]), "empty trajectory: 'turns'"),
    ("turn_not_object", _set(turns=[[1, 2]]), r"turns\[0\] must be an object, got list"),
    ("turn_not_object_2", lambda r: (r["turns"].append(3), r)[1],
     r"turns\[2\] must be an object, got int"),
    ("missing_action", _del_turn("action", 1), r"turns\[1\]: missing field 'action'"),
    ("empty_action", _turn(1, action=[]), r"turns\[1\]\.action is empty"),
    ("action_not_list", _turn(0, action=3), r"turns\[0\]\.action must be a list"),
    ("token_negative", _turn(1, action=[6, -1]), r"turns\[1\]\.action\[1\].*-1"),
    ("token_float", _turn(0, action=[3.0]), r"turns\[0\]\.action\[0\].*3\.0"),
    ("token_bool", _turn(0, action=[3, True]), r"turns\[0\]\.action\[1\].*True"),
    ("token_too_big", _turn(0, action=[2**31]), r"turns\[0\]\.action\[0\].*2147483648"),
    ("token_str", _turn(0, action=["3"]), r"turns\[0\]\.action\[0\]"),
    ("obs_negative", _turn(1, observation=[-5]), r"turns\[1\]\.observation\[0\].*-5"),
    ("obs_not_list", _turn(1, observation="ab"), r"turns\[1\]\.observation must be a list"),
    ("reward_nan", _turn(1, reward=float("nan")), r"turns\[1\]\.reward must be finite"),
    ("reward_inf", _turn(0, reward=float("inf")), r"turns\[0\]\.reward must be finite"),
    ("reward_ninf", _turn(0, reward=-math.inf), r"turns\[0\]\.reward must be finite"),
    ("reward_str", _turn(0, reward="1.0"), r"turns\[0\]\.reward must be a number, got str"),
    ("reward_bool", _turn(0, reward=True), r"turns\[0\]\.reward must be a number, got bool"),
    ("reward_none", _turn(0, reward=None), r"turns\[0\]\.reward must be a number"),
    ("outcome_nan", _set(outcome=float("nan")), "'outcome' must be finite"),
    ("outcome_inf", _set(outcome=float("inf")), "'outcome' must be finite"),
    ("outcome_str", _set(outcome="1"), "'outcome' must be a number"),
    ("no_outcome_no_rewards", _strip_rewards, "missing field 'outcome'"),
    ("logprobs_short", _turn(1, logprobs=[-0.1]),
     r"turns\[1\]\.logprobs has 1 entries but turns\[1\]\.action has 2"),
    ("logprobs_long", _turn(0, logprobs=[-0.1, -0.2, -0.3]),
     r"turns\[0\]\.logprobs has 3 entries"),
    ("logprobs_nan", _turn(0, logprobs=[-0.1, float("nan")]),
     r"turns\[0\]\.logprobs\[1\] must be finite"),
    ("logprobs_inf", _turn(0, logprobs=[-math.inf, -0.1]),
     r"turns\[0\]\.logprobs\[0\] must be finite"),
    ("logprobs_not_list", _turn(0, logprobs=-0.1), r"turns\[0\]\.logprobs must be a list"),
    ("ref_logprobs_short", _turn(0, ref_logprobs=[-0.1]), r"turns\[0\]\.ref_logprobs has 1"),
    ("ref_logprobs_nan", _turn(0, ref_logprobs=[0.0, float("nan")]),
     r"turns\[0\]\.ref_logprobs\[1\] must be finite"),
    ("values_short", _turn(1, values=[0.1, 0.2, 0.3]), r"turns\[1\]\.values has 3"),
    ("values_inf", _turn(1, values=[0.1, math.inf]), r"turns\[1\]\.values\[1\] must be finite"),
    ("value_nan", _turn(1, value=float("nan")), r"turns\[1\]\.value must be finite"),
    ("value_list", _turn(1, value=[0.5]), r"turns\[1\]\.value must be a number, got list"),
    ("state_key_float", _turn(1, state_key=1.5), r"turns\[1\]\.state_key must be a str or int"),
    ("state_key_bool", _turn(0, state_key=False), r"turns\[0\]\.state_key .*got bool"),
    ("state_key_list", _turn(0, state_key=[1, 2]), r"turns\[0\]\.state_key .*got list"),
]


@pytest.mark.parametrize("mutate,match", [(m, s) for _, m, s in RECORD_ERRORS],
                         ids=[n for n, _, _ in RECORD_ERRORS])
def test_record_errors_name_field_and_index(mutate, match):
    recs = [_good(), _good(group="h"), mutate(_good()), _good()]
    with pytest.raises(ValueError, match=r"^record 2: .*" + match) as info:
        pack_records(recs)
    assert isinstance(info.value, RecordError) and info.value.index == 2
    with pytest.raises(RecordError, match="record 2"):
        pack_records(recs, layout="per_step")


def _with_all(field, value_of):
    r = _good()
    for t in r["turns"]:
        t[field] = value_of(t)
    return r


OPTIONAL = {"logprobs": lambda t: [-0.5] * len(t["action"]),
            "ref_logprobs": lambda t: [-0.25] * len(t["action"]),
            "values": lambda t: [0.5] * len(t["action"]), "value": lambda t: 0.5}


@pytest.mark.parametrize("field", sorted(OPTIONAL))
def test_optional_turn_fields_all_or_none(field):
    full = _with_all(field, OPTIONAL[field])
    pack_records([full, copy.deepcopy(full)])  # all: fine
    pack_records([_good(), _good()])  # none: fine
    # a later record without the field
    with pytest.raises(RecordError, match=rf"^record 2: .*'{field}'") as info:
        pack_records([full, copy.deepcopy(full), _good()])
    assert info.value.index == 2
    # the first record without it, a later one with it
    with pytest.raises(RecordError, match=rf"^record 0: .*'{field}'"):
        pack_records([_good(), full])
    # within one record: one turn has it, the other not
    half = copy.deepcopy(full)
    del half["turns"][1][field]
    with pytest.raises(RecordError, match=rf"^record 1: .*'{field}'"):
        pack_records([full, half])


@pytest.mark.parametrize("layout", ["concat", "", None, "PER_STEP"])
def test_invalid_layout(layout):
    with pytest.raises(ValueError, match="layout"):
        pack_records([_good()], layout=layout)


@pytest.mark.parametrize("num_shards", [0, -1, 1.5, True, "2", None])
def test_invalid_num_shards(num_shards):
    with pytest.raises(ValueError, match="num_shards"):
        pack_records([_good()], num_shards=num_shards)


@pytest.mark.parametrize("records", [[], (), iter([])])
def test_no_records(records):
    with pytest.raises(ValueError, match="records"):
        pack_records(records)


def test_records_from_a_generator_and_numpy_ints():
    recs = (dict(_good(), group=np.int64(3), turns=[{"action": [np.int32(5), np.int64(6)],
                                                     "reward": np.float32(0.5)}])
            for _ in range(2))
    b = pack_records(recs)[0]
    np.testing.assert_array_equal(b.tokens[0, :2], [5, 6])
    assert b.group_ids[1] == 0


# ----------------------------------------------------------------------------- validate_batch


def _base(layout="concatenated"):
    return pack_records(HAND, layout=layout)[0]


def _mod(field, fn, layout="concatenated"):
    """A copy of the hand batch with fn applied to a copy of one field (or extras key)."""
    def build():
        b = _base(layout)
        if field.startswith("extras."):
            key = field[7:]
            ex = dict(b.extras)
            ex[key] = fn(np.array(ex[key]))
            return b.replace(extras=ex)
        return b.replace(**{field: fn(np.array(getattr(b, field)))})
    return build


def _at(idx, value):
    def fn(a):
        a[idx] = value
        return a
    return fn


def _seq(*builders):
    """Applies several (field, fn) edits."""
    def build():
        b = _base()
        for field, fn in builders:
            b = b.replace(**{field: fn(np.array(getattr(b, field)))})
        return b
    return build


def _cast(field, dtype):
    """A VALIDATE_ERRORS row: ``field`` cast to ``dtype`` (one it must not have)."""
    return (f"{field}_{np.dtype(dtype).name}", _mod(field, lambda a: a.astype(dtype)),
            f"{field} must have dtype")


# a dtype each field must not have
WRONG_DTYPES = {"tokens": np.float32, "action_mask": np.int32, "turn_ids": np.float32,
                "row_traj": np.float64, "old_logprobs": np.int32, "turn_mask": np.float32,
                "turn_rewards": np.int32, "state_keys": np.float32, "group_ids": bool,
                "traj_mask": np.int8, "outcome": np.int32}

VALIDATE_ERRORS = [
    # shapes
    ("tokens_1d", _mod("tokens", lambda a: a[0]), r"tokens must be \[R, T\]"),
    ("turn_mask_1d", _mod("turn_mask", lambda a: a[:, 0]), r"turn_mask \[N, K\]"),
    ("action_mask_shape", _mod("action_mask", lambda a: a[:, :-1]),
     r"action_mask must have shape \[R, T\] = \(8, 16\), got \(8, 15\)"),
    ("turn_ids_shape", _mod("turn_ids", lambda a: a[:-1]), r"turn_ids must have shape \[R, T\]"),
    ("old_logprobs_shape", _mod("old_logprobs", lambda a: a[:, :, None]),
     r"old_logprobs must have shape \[R, T\]"),
    ("row_traj_shape", _mod("row_traj", lambda a: a[:-1]),
     r"row_traj must have shape \[R\] = \(8,\), got \(7,\)"),
    ("turn_rewards_shape", _mod("turn_rewards", lambda a: a[:, :1]),
     r"turn_rewards must have shape \[N, K\] = \(8, 2\), got \(8, 1\)"),
    ("state_keys_shape", _mod("state_keys", lambda a: a.T), r"state_keys must have shape \[N, K\]"),
    ("action_keys_shape", _mod("action_keys", lambda a: a[:4]),
     r"action_keys must have shape \[N, K\]"),
    ("group_ids_shape", _mod("group_ids", lambda a: np.append(a, 0)),
     r"group_ids must have shape \[N\] = \(8,\), got \(9,\)"),
    ("task_ids_shape", _mod("task_ids", lambda a: a[:, None]), r"task_ids must have shape \[N\]"),
    ("traj_mask_shape", _mod("traj_mask", lambda a: a[:3]), r"traj_mask must have shape \[N\]"),
    ("outcome_shape", _mod("outcome", lambda a: a[:7]), r"outcome must have shape \[N\]"),
    # dtypes
    *(_cast(field, dtype) for field, dtype in WRONG_DTYPES.items()),
    # index ranges
    ("row_traj_too_big", _mod("row_traj", _at(1, 8)),
     r"row_traj\[1\] = 8 is out of range \[0, 8\)"),
    ("row_traj_negative", _mod("row_traj", _at(5, -1)), r"row_traj\[5\] = -1 is out of range"),
    ("group_ids_out_of_range", _mod("group_ids", _at(1, 8)),
     r"group_ids\[1\] = 8 is out of range \[0, 8\)"),
    ("group_ids_negative", _mod("group_ids", _at(2, -3)), r"group_ids\[2\] = -3 is out of range"),
    ("group_ids_padding", _mod("group_ids", _at(1, 5)),
     r"group_ids\[1\] points at a padding trajectory"),
    ("task_ids_negative", _mod("task_ids", _at(0, -1)), r"task_ids\[0\] = -1 is out of range"),
    ("turn_ids_ge_k", _mod("turn_ids", _at((0, 5), 2)), r"turn_ids\[0, 5\] = 2 is out of range"),
    ("turn_ids_negative_on_action", _mod("turn_ids", _at((2, 1), -1)),
     r"turn_ids\[2, 1\] = -1 is out of range"),
    ("turn_ids_off_action", _mod("turn_ids", _at((0, 0), 0)),
     r"turn_ids\[0, 0\] must be -1 outside action_mask"),
    ("turn_ids_off_action_padding_row", _mod("turn_ids", _at((6, 3), 1)),
     r"turn_ids\[6, 3\] must be -1 outside action_mask"),
    ("action_on_missing_turn", _mod("turn_mask", _at((0, 1), False)),
     r"action_mask\[0, 5\].*turn_mask is False"),
    ("action_on_missing_turn_2",
     _seq(("turn_ids", _at((2, 2), 1)), ("turn_ids", _at((2, 1), 1))),  # traj 2 has no turn 1
     r"action_mask\[2, 1\].*turn_mask is False"),
    ("turn_ids_decreasing", _mod("turn_ids", lambda a: (a.__setitem__((0, slice(2, 4)), 1),
                                                        a.__setitem__((0, 5), 0), a)[-1]),
     r"turn_ids\[0, 5\]: turn ids must not decrease"),
    ("turn_mask_on_padding", _mod("turn_mask", _at((4, 0), True)),
     r"turn_mask\[4, 0\] is set on a padding trajectory"),
    ("empty_valid_trajectory", _mod("traj_mask", _at(5, True)),
     r"traj_mask\[5\]: empty trajectory"),
    ("empty_valid_trajectory_2", _seq(("turn_mask", _at((2, 0), False)),
                                      ("action_mask", _at((2, slice(0, 3)), False)),
                                      ("turn_ids", _at((2, slice(0, 3)), -1))),
     r"traj_mask\[2\]: empty trajectory"),
    # finiteness on valid entries
    ("turn_rewards_nan", _mod("turn_rewards", _at((0, 1), np.nan)),
     r"turn_rewards\[0, 1\].*finite"),
    ("turn_rewards_inf", _mod("turn_rewards", _at((2, 0), -np.inf)),
     r"turn_rewards\[2, 0\].*finite"),
    ("outcome_nan", _mod("outcome", _at(1, np.nan)), r"outcome\[1\].*not finite"),
    ("outcome_inf", _mod("outcome", _at(0, np.inf)), r"outcome\[0\].*not finite"),
    ("old_logprobs_nan", _mod("old_logprobs", _at((0, 3), np.nan)),
     r"old_logprobs\[0, 3\].*finite"),
    ("old_logprobs_inf", _mod("old_logprobs", _at((2, 2), -np.inf)),
     r"old_logprobs\[2, 2\].*finite"),
    # extras
    ("ref_logprobs_shape", _mod("extras.ref_logprobs", lambda a: a[:, :8]),
     r"extras\['ref_logprobs'\] must have shape \[R, T\] = \(8, 16\), got \(8, 8\)"),
    ("token_values_shape", _mod("extras.token_values", lambda a: a[:4]),
     r"extras\['token_values'\] must have shape \[R, T\]"),
    ("turn_values_shape", _mod("extras.turn_values", lambda a: a[:, 0]),
     r"extras\['turn_values'\] must have shape \[N, K\] = \(8, 2\), got \(8,\)"),
    ("token_values_nan", _mod("extras.token_values", _at((2, 0), np.nan)),
     r"extras\['token_values'\]\[2, 0\] is not finite"),
    ("turn_values_inf", _mod("extras.turn_values", _at((0, 1), np.inf)),
     r"extras\['turn_values'\]\[0, 1\] is not finite"),
]


@pytest.mark.parametrize("build,match", [(b, m) for _, b, m in VALIDATE_ERRORS],
                         ids=[n for n, _, _ in VALIDATE_ERRORS])
def test_validate_batch_errors(build, match):
    b = build()
    with pytest.raises(ValueError, match=match):
        validate_batch(b)
    with pytest.raises(ValueError, match=match):
        b.validate()


def test_validate_turn_split_across_rows():
    b = _base("per_step")  # rows 0 and 1 hold turns 0 and 1 of trajectory 0
    tid = np.array(b.turn_ids)
    tid[1, 1] = 0  # turn 0 now also in row 1; turn 1 keeps its turn_mask but no tokens
    with pytest.raises(ValueError, match="turn 0 of trajectory 0 is split across rows 0 and 1"):
        b.replace(turn_ids=tid).validate()
    # concatenated: two rows of one trajectory holding the same turn
    b = _base()
    rt = np.array(b.row_traj)
    rt[1] = 0  # row 1 (turn 0 of traj 1) now claims to be trajectory 0's turn 0 too
    with pytest.raises(ValueError, match="turn 0 of trajectory 0 is split across rows 0 and 1"):
        b.replace(row_traj=rt).validate()


def test_validate_turn_tokens_must_be_one_contiguous_span():
    b = _base()  # row 0: o o a0 a0 o a1
    am, tid = np.array(b.action_mask), np.array(b.turn_ids)
    am[0, 6], tid[0, 6] = True, 1  # a1 a1 contiguous: fine
    b.replace(action_mask=am, turn_ids=tid).validate()
    am[0, 7], tid[0, 7] = True, 1
    am[0, 6], tid[0, 6] = False, -1  # a1 . a1: a gap inside turn 1
    with pytest.raises(ValueError, match="turn 1 of trajectory 0 are not one contiguous span"):
        b.replace(action_mask=am, turn_ids=tid).validate()


def test_validate_concatenated_trajectory_in_one_row():
    # per_step rows relabelled as concatenated (R = N = 8): trajectory 0's two turns sit in
    # rows 0 and 1
    b = _base("per_step")
    b.validate()
    with pytest.raises(ValueError, match="each trajectory's action tokens must lie in one row"):
        b.replace(layout="concatenated").validate()


def test_validate_concatenated_needs_one_row_per_trajectory():
    b = _base("per_step")
    rows = np.array(b.tokens).shape[0]

    def pad_rows(f):  # append 8 empty padding rows
        x = np.asarray(getattr(b, f))
        fill = {"turn_ids": -1}.get(f, 0)
        return np.concatenate([x, np.full_like(x, fill)])

    big = b.replace(**{f: pad_rows(f) for f in
                       ("tokens", "action_mask", "turn_ids", "row_traj", "old_logprobs")},
                    extras={})
    big.validate()  # per_step with 16 rows is fine
    with pytest.raises(ValueError, match=rf"concatenated layout.*R = {2 * rows} rows and N = 8"):
        big.replace(layout="concatenated").validate()


@pytest.mark.parametrize("layout", ["concat", "", None])
def test_validate_invalid_layout(layout):
    with pytest.raises(ValueError, match="layout"):
        _base().replace(layout=layout).validate()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_validate_accepts_nonfinite_padding(layout):
    b = _base(layout)
    am, tm, trm = (np.asarray(x) for x in (b.action_mask, b.turn_mask, b.traj_mask))
    ex = {"token_values": np.where(am, b.extras["token_values"], np.nan).astype(np.float32),
          "ref_logprobs": np.where(am, b.extras["ref_logprobs"], -np.inf).astype(np.float32),
          "turn_values": np.where(tm, b.extras["turn_values"], np.nan).astype(np.float32)}
    nb = b.replace(turn_rewards=np.where(tm, b.turn_rewards, np.nan).astype(np.float32),
                   outcome=np.where(trm, b.outcome, np.inf).astype(np.float32),
                   old_logprobs=np.where(am, b.old_logprobs, np.nan).astype(np.float32),
                   extras=ex)
    assert nb.validate() is nb
    # also: state_keys given as int32 (what a JAX round trip may give) and extra unknown extras
    nb.replace(state_keys=np.asarray(b.state_keys).astype(np.int32),
               extras=dict(ex, hidden=np.zeros((8, 2, 3), np.float32))).validate()


# That NaN / inf on padding never changes any registered method's output, under jit and
# eagerly, is checked for every method in tests/test_conformance.py.

