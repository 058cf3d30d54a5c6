"""segments.py primitives against plain numpy loops (float64 references, written from the
docstrings), on seeded random inputs in a few fixed shapes (one compile per shape)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agent import segments
from jaxrl_agent.batch import TrajectoryBatch
from jaxrl_agent.rollout.records import pack_records
from tests.strategies import PAD, make_batch, random_records

SEEDS = range(6)
LAYOUTS = ("concatenated", "per_step")

# ----------------------------------------------------------------------------- batches


def _packed(seed, layout, **kw):
    rng = np.random.default_rng(seed)
    recs = random_records(rng, num_traj=int(rng.integers(1, 9)), **kw)
    return make_batch(recs, layout=layout)


def _scrambled(seed, layout):
    """A hand-made valid batch that pack_records never produces: trajectories at random
    positions among N (padding in between), rows in random order, and (per_step) several
    consecutive turns sharing one row. Observation tokens are interleaved between turns."""
    rng = np.random.default_rng(1000 + seed)
    n, k, t = PAD[layout]["num_traj"], PAD[layout]["num_turns"], PAD[layout]["row_len"]
    rows = PAD[layout].get("num_rows", n)  # same shapes as make_batch: no extra compiles
    r_total = n if layout == "concatenated" else rows
    tokens = np.zeros((r_total, t), np.int32)
    am = np.zeros((r_total, t), bool)
    tid = np.full((r_total, t), -1, np.int32)
    row_traj = rng.integers(0, n, r_total).astype(np.int32)  # padding rows: anything valid
    turn_mask = np.zeros((n, k), bool)
    n_valid = int(rng.integers(1, n + 1))
    valid = np.sort(rng.permutation(n)[:n_valid])
    traj_mask = np.zeros(n, bool)
    traj_mask[valid] = True
    chunks = []  # (traj, [turns]) -> one row each
    for i in valid:
        nk = int(rng.integers(1, k + 1))
        turn_mask[i, :nk] = True
        if layout == "concatenated":
            chunks.append((i, list(range(nk))))
        else:
            lo = 0
            while lo < nk:  # rows of 1 or 2 consecutive turns (row_len 8 fits two)
                c = min(nk, lo + int(rng.integers(1, 3)))
                chunks.append((i, list(range(lo, c))))
                lo = c
    if layout == "concatenated":
        row_of = {i: r for r, i in zip(rng.permutation(n), range(n))}
        row_traj = np.array([0] * n, np.int32)
        for i, r in row_of.items():
            row_traj[r] = i
        placement = [row_of[i] for i, _ in chunks]
    else:
        placement = rng.permutation(r_total)[:len(chunks)]
    for (i, turns), r in zip(chunks, placement):
        row_traj[r] = i
        pos = 0
        for kk in turns:
            o, a = int(rng.integers(0, 2)), int(rng.integers(1, 3))
            tokens[r, pos:pos + o + a] = rng.integers(0, 100, o + a)
            am[r, pos + o:pos + o + a] = True
            tid[r, pos + o:pos + o + a] = kk
            pos += o + a
    groups = rng.integers(0, 3, n)
    group_ids = np.arange(n, dtype=np.int32)
    for i in valid:
        group_ids[i] = min(j for j in valid if groups[j] == groups[i])
    batch = TrajectoryBatch(
        tokens=tokens, action_mask=am, turn_ids=tid, row_traj=row_traj,
        old_logprobs=np.where(am, -rng.random((r_total, t)), 0).astype(np.float32),
        turn_mask=turn_mask,
        turn_rewards=np.where(turn_mask, rng.normal(size=(n, k)), 0).astype(np.float32),
        state_keys=rng.integers(0, 2**32, (n, k), dtype=np.uint32),
        action_keys=rng.integers(0, 2**32, (n, k), dtype=np.uint32),
        group_ids=group_ids, task_ids=np.zeros(n, np.int32), traj_mask=traj_mask,
        outcome=np.where(traj_mask, rng.normal(size=n), 0).astype(np.float32),
        extras={"token_rewards": np.where(am, rng.normal(size=(r_total, t)), 0).astype(np.float32)},
        layout=layout)
    return batch.validate()


def _batches():
    for layout in LAYOUTS:
        for seed in range(3):
            yield pytest.param(("packed", seed, layout), id=f"packed-{layout}-{seed}")
            yield pytest.param(("scrambled", seed, layout), id=f"scrambled-{layout}-{seed}")


def _get(spec):
    kind, seed, layout = spec
    return _packed(seed, layout) if kind == "packed" else _scrambled(seed, layout)


def _np(b):
    return {f: np.asarray(getattr(b, f)) for f in
            ("tokens", "action_mask", "turn_ids", "row_traj", "turn_mask", "turn_rewards",
             "traj_mask")}


# ----------------------------------------------------------------------------- references


def ref_segment_stats(x, ids, valid, s, ddof):
    x = np.asarray(x, np.float64)
    mean, std, count = np.zeros(s), np.zeros(s), np.zeros(s)
    for seg in range(s):
        v = [x[i] for i in range(len(x)) if valid[i] and ids[i] == seg]
        if not v:
            continue
        m = sum(v) / len(v)
        mean[seg], count[seg] = m, len(v)
        std[seg] = np.sqrt(sum((e - m) ** 2 for e in v) / max(len(v) - ddof, 1))
    return mean, std, count


def ref_turn_to_token(x, b):
    a = _np(b)
    out = np.zeros(a["tokens"].shape)
    for r, t in zip(*np.nonzero(a["action_mask"])):
        out[r, t] = x[a["row_traj"][r], a["turn_ids"][r, t]]
    return out


def ref_traj_to_token(x, b):
    a = _np(b)
    out = np.zeros(a["tokens"].shape)
    for r, t in zip(*np.nonzero(a["action_mask"])):
        out[r, t] = x[a["row_traj"][r]]
    return out


def ref_token_to_turn(x, b, reduce):
    a = _np(b)
    n, k = a["turn_mask"].shape
    tot, cnt = np.zeros((n, k)), np.zeros((n, k))
    for r, t in zip(*np.nonzero(a["action_mask"])):
        i, kk = a["row_traj"][r], a["turn_ids"][r, t]
        tot[i, kk] += x[r, t]
        cnt[i, kk] += 1
    if reduce == "sum":
        return tot
    return np.where(cnt > 0, tot / np.maximum(cnt, 1), 0.0)


def ref_boundaries(b):
    a = _np(b)
    first = np.zeros(a["tokens"].shape, bool)
    last = np.zeros(a["tokens"].shape, bool)
    for r in range(a["tokens"].shape[0]):
        cols = np.nonzero(a["action_mask"][r])[0]
        for kk in set(a["turn_ids"][r, cols].tolist()):
            c = cols[a["turn_ids"][r, cols] == kk]
            first[r, c.min()] = True
            last[r, c.max()] = True
    return first, last


def ref_reverse_scan_1d(x, d):
    y, acc = np.zeros(len(x)), 0.0
    for t in range(len(x) - 1, -1, -1):
        acc = x[t] + d[t] * acc
        y[t] = acc
    return y


def ref_trajectory_reverse_scan(x, d, b):
    """Walks each trajectory's action tokens in turn order (then position); y = x + d y_next.
    Non-action tokens get the value at the next action token of the stream."""
    a = _np(b)
    am, tid, rt = a["action_mask"], a["turn_ids"], a["row_traj"]
    x = np.broadcast_to(np.asarray(x, np.float64), am.shape)
    d = np.broadcast_to(np.asarray(d, np.float64), am.shape)
    inc, exc = np.zeros(am.shape), np.zeros(am.shape)
    for n in range(a["turn_mask"].shape[0]):
        stream = sorted((tid[r, t], t, r) for r, t in zip(*np.nonzero(am)) if rt[r] == n)
        after = 0.0
        for kk, t, r in reversed(stream):
            exc[r, t] = after
            after = x[r, t] + d[r, t] * after
            inc[r, t] = after
    for r in range(am.shape[0]):
        cols = np.nonzero(am[r])[0]
        if len(cols) == 0:
            continue  # a row without action tokens: nothing comes after, 0
        for t in range(am.shape[1]):
            if am[r, t]:
                continue
            later = cols[cols > t]
            v = inc[r, later[0]] if len(later) else exc[r, cols[-1]]
            inc[r, t] = exc[r, t] = v
    return inc, exc


# ----------------------------------------------------------------------------- segment stats

_seg_stats = jax.jit(segments.segment_stats, static_argnames=("num_segments", "ddof"))


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("seed", SEEDS)
def test_segment_stats_vs_loop(seed, ddof):
    rng = np.random.default_rng(seed)
    m, s = 64, 16  # ids only reach [0, 10): segments 10..15 are empty
    x = rng.normal(size=m).astype(np.float32) * 3
    ids = rng.integers(0, 10, m).astype(np.int32)
    ids[rng.random(m) < 0.1] = -1  # out of range: dropped
    ids[rng.random(m) < 0.1] = s  # out of range: dropped
    valid = rng.random(m) < 0.7
    x[~valid & (rng.random(m) < 0.5)] = np.nan  # ignored entries may hold anything
    mean, std, count = _seg_stats(x, ids, valid, num_segments=s, ddof=ddof)
    keep = valid & (ids >= 0) & (ids < s)
    rm, rs, rc = ref_segment_stats(x, ids, keep, s, ddof)
    np.testing.assert_array_equal(np.asarray(count), rc)
    np.testing.assert_allclose(mean, rm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(std, rs, rtol=1e-5, atol=1e-5)
    # empty segments: exactly 0, never NaN
    assert np.all(np.asarray(mean)[10:] == 0) and np.all(np.asarray(std)[10:] == 0)
    assert np.all(np.isfinite(mean)) and np.all(np.isfinite(std))


@pytest.mark.parametrize("ddof", [0, 1])
def test_segment_stats_singletons_and_all_empty(ddof):
    x = np.array([5.0, 2.0, 7.0, 1.0], np.float32)
    mean, std, count = _seg_stats(x, np.array([0, 1, 2, 3], np.int32),
                                  np.array([True, True, False, False]), num_segments=4,
                                  ddof=ddof)
    np.testing.assert_array_equal(mean, [5.0, 2.0, 0.0, 0.0])
    np.testing.assert_array_equal(std, [0.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(count, [1, 1, 0, 0])
    mean, std, count = _seg_stats(x, np.zeros(4, np.int32), np.zeros(4, bool), num_segments=4,
                                  ddof=ddof)
    assert not np.any(np.asarray(mean)) and not np.any(np.asarray(std))
    assert not np.any(np.asarray(count))


@pytest.mark.parametrize("value", [0.1, 0.7, 3.3, 100.1, 1234.567, 1e6 + 0.25, -7.9])
def test_segment_stats_equal_values_give_exact_zero_std(value):
    m = 64
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 4, m).astype(np.int32)
    x = np.where(ids == 2, value, rng.normal(size=m)).astype(np.float32)
    for ddof in (0, 1):
        mean, std, _ = _seg_stats(x, ids, np.ones(m, bool), num_segments=16, ddof=ddof)
        assert float(std[2]) == 0.0
        assert float(mean[2]) == float(np.float32(value))
    # group_stats gathers the same exact zero to every member
    g = np.where(ids == 2, 2, 10 + ids).astype(np.int32)  # group id 2 lies in [0, m)
    _, gstd, _ = jax.jit(segments.group_stats)(x, g, np.ones(m, bool))
    assert np.all(np.asarray(gstd)[ids == 2] == 0.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_segment_stats_large_offset_keeps_precision(seed):
    rng = np.random.default_rng(seed)
    m, s = 64, 16
    ids = rng.integers(0, 6, m).astype(np.int32)
    noise = rng.uniform(-2, 2, m)
    x = (1e6 + 1e3 * ids + noise).astype(np.float32)  # float32: ulp(1e6) = 0.0625
    for ddof in (0, 1):
        mean, std, count = _seg_stats(x, ids, np.ones(m, bool), num_segments=s, ddof=ddof)
        rm, rs, _ = ref_segment_stats(x.astype(np.float64), ids, np.ones(m, bool), s, ddof)
        np.testing.assert_allclose(mean, rm, rtol=2e-7, atol=0.07)
        # the deviations are ~1; a naive E[x^2] - E[x]^2 in float32 would be off by ~1e5
        np.testing.assert_allclose(std, rs, rtol=1e-3, atol=1e-3)


def test_segment_stats_cannot_overflow_for_finite_values():
    """Huge but finite values: no square or sum overflows float32 (std 1e20 / sqrt(2), not
    inf), so GRPO still gives +-0.707; ties stay exactly symmetric."""
    x = np.array([1e20, 0.0, -1e38, 1e38, 1.0, 1.0 + 2 ** -23, 5.0], np.float32)
    ids = np.array([0, 0, 1, 1, 2, 2, 3], np.int32)
    mean, std, count = _seg_stats(x, ids, np.ones(7, bool), num_segments=4, ddof=1)
    np.testing.assert_allclose(mean[:2], [5e19, 0.0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(std[:2], [1e20 / np.sqrt(2), 2e38 / np.sqrt(2)], rtol=1e-6)
    assert np.isfinite(std).all() and std[3] == 0.0
    recs = [{"group": "g", "outcome": o, "turns": [{"observation": [3], "action": [4]}]}
            for o in (1e20, 0.0)]
    from jaxrl_agent import estimators
    adv = estimators.compute("grpo", pack_records(recs)[0])
    np.testing.assert_allclose(np.asarray(adv.turn)[:2, 0], [0.7071, -0.7071], atol=1e-4)
    recs = [{"group": "g", "outcome": o, "turns": [{"observation": [3], "action": [4]}]}
            for o in (0.1, 0.1 + 1e-9, 0.3)]  # the first two are equal in float32
    turn = np.asarray(estimators.compute("rloo", pack_records(recs)[0]).turn)[:3, 0]
    assert turn[0] == turn[1]


@pytest.mark.parametrize("seed", SEEDS)
def test_group_stats_vs_loop(seed):
    rng = np.random.default_rng(seed)
    n = 16
    leaders = rng.integers(0, n, 5)
    gid = leaders[rng.integers(0, 5, n)].astype(np.int32)
    valid = rng.random(n) < 0.8
    x = rng.normal(size=n).astype(np.float32)
    for ddof in (0, 1):
        mean, std, count = jax.jit(segments.group_stats, static_argnames="ddof")(
            x, gid, valid, ddof=ddof)
        rm, rs, rc = ref_segment_stats(x, gid, valid, n, ddof)
        np.testing.assert_allclose(mean, rm[gid], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(std, rs[gid], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(count), rc[gid])


# ----------------------------------------------------------------------------- dense ids

_dense2 = jax.jit(lambda a, b, v: segments.dense_ids(a, b, valid=v))
_dense1 = jax.jit(lambda a, v: segments.dense_ids(a, valid=v))


def _check_dense(ids, num, keys, valid):
    ids, num = np.asarray(ids), int(num)
    m = len(valid)
    tuples = [tuple(int(k[i]) for k in keys) for i in range(m)]
    uniq = sorted({tuples[i] for i in range(m) if valid[i]})  # Python ints: unsigned order
    assert num == len(uniq)
    expected = [uniq.index(tuples[i]) if valid[i] else m for i in range(m)]
    np.testing.assert_array_equal(ids, expected)
    assert ids.dtype == np.int32


@pytest.mark.parametrize("seed", SEEDS)
def test_dense_ids_two_uint32_keys_in_jit(seed):
    rng = np.random.default_rng(seed)
    m = 64
    pool = np.array([0, 1, 5, 2**31 - 1, 2**31, 2**31 + 7, 3_000_000_000, 2**32 - 1], np.uint32)
    a = pool[rng.integers(0, len(pool), m)]
    b = pool[rng.integers(0, 3, m) * 3]  # few values: many repeated tuples
    valid = rng.random(m) < 0.8
    ids, num = _dense2(a, b, valid)
    _check_dense(ids, num, (a, b), valid)
    # equal tuples <-> equal ids, dense range
    ids = np.asarray(ids)
    for i in range(m):
        for j in range(m):
            if valid[i] and valid[j]:
                assert (ids[i] == ids[j]) == (a[i] == a[j] and b[i] == b[j])
    assert set(ids[valid].tolist()) == set(range(int(num)))


def test_dense_ids_single_key_and_edge_cases():
    m = 16
    a = np.array([2**32 - 1, 0, 2**31, 2**31, 5, 5, 5, 2**31 - 1] * 2, np.uint32)
    valid = np.ones(m, bool)
    _check_dense(*_dense1(a, valid), (a,), valid)
    valid = np.zeros(m, bool)  # no valid row: 0 unique, every id = M
    ids, num = _dense1(a, valid)
    assert int(num) == 0 and np.all(np.asarray(ids) == m)
    signed = np.array([-3, 7, -3, 0, 2**31 - 1, -(2**31), 7, 0] * 2, np.int32)
    valid = np.arange(m) % 5 != 0
    _check_dense(*_dense1(signed, valid), (signed,), valid)


# ----------------------------------------------------------------------------- turn <-> token


_tok2turn = jax.jit(segments.token_to_turn, static_argnames="reduce")


@pytest.mark.parametrize("spec", list(_batches()))
def test_turn_token_broadcast_and_reduce(spec):
    b = _get(spec)
    a = _np(b)
    n, k = a["turn_mask"].shape
    rng = np.random.default_rng(7)
    xt = rng.normal(size=(n, k)).astype(np.float32)
    xn = rng.normal(size=n).astype(np.float32)
    xr = rng.normal(size=a["tokens"].shape).astype(np.float32)
    np.testing.assert_allclose(jax.jit(segments.turn_to_token)(xt, b), ref_turn_to_token(xt, b),
                               atol=1e-6)
    np.testing.assert_allclose(jax.jit(segments.traj_to_token)(xn, b), ref_traj_to_token(xn, b),
                               atol=1e-6)
    for red in ("sum", "mean"):
        got = _tok2turn(xr, b, reduce=red)
        np.testing.assert_allclose(got, ref_token_to_turn(xr, b, red), rtol=1e-5, atol=1e-5)
    ones = np.ones(a["tokens"].shape)
    np.testing.assert_array_equal(jax.jit(segments.turn_token_counts)(b),
                                  ref_token_to_turn(ones, b, "sum"))
    np.testing.assert_array_equal(jax.jit(segments.traj_token_counts)(b),
                                  ref_token_to_turn(ones, b, "sum").sum(axis=1))


def test_token_to_turn_rejects_unknown_reduce():
    b = _packed(0, "concatenated")
    with pytest.raises(ValueError, match="reduce"):
        segments.token_to_turn(np.zeros(b.tokens.shape, np.float32), b, reduce="max")


@pytest.mark.parametrize("spec", list(_batches()))
def test_turn_boundary_masks_and_token_rewards(spec):
    b = _get(spec)
    first, last = jax.jit(segments.turn_boundary_masks)(b)
    rf, rl = ref_boundaries(b)
    np.testing.assert_array_equal(first, rf)
    np.testing.assert_array_equal(last, rl)
    a = _np(b)
    expected = np.zeros(a["tokens"].shape)
    for r, t in zip(*np.nonzero(rl)):
        expected[r, t] += a["turn_rewards"][a["row_traj"][r], a["turn_ids"][r, t]]
    if "token_rewards" in b.extras:
        expected += np.where(a["action_mask"], b.extras["token_rewards"], 0.0)
    np.testing.assert_allclose(jax.jit(segments.token_rewards)(b), expected, atol=1e-6)


def test_token_rewards_hand_example():
    recs = [{"group": 0, "turns": [{"observation": [1], "action": [2, 3], "reward": 0.5},
                                   {"observation": [4, 5], "action": [6, 7, 8], "reward": 2.0}]}]
    b = pack_records(recs)[0]
    r = np.asarray(segments.token_rewards(b))[0]
    np.testing.assert_array_equal(r[:9], [0, 0, 0.5, 0, 0, 0, 0, 2.0, 0])
    dense = np.zeros(b.tokens.shape, np.float32)
    dense[0, :9] = np.arange(1, 10)  # also on observation tokens: they must be ignored
    b = b.replace(extras={"token_rewards": dense})
    r = np.asarray(segments.token_rewards(b))[0]
    np.testing.assert_array_equal(r[:9], [0, 2, 3 + 0.5, 0, 0, 6, 7, 8 + 2.0, 0])


# ----------------------------------------------------------------------------- reverse scans


_rscan = jax.jit(segments.reverse_scan, static_argnames=("axis", "method"))
_excl = jax.jit(segments.exclusive_reverse_cumprod, static_argnames=("axis", "method"))
METHODS = ("sequential", "associative", "auto")


def ref_reverse_scan_masked(x, d, where, init):
    """y_t = x_t + d_t y_{t+1} where `where`, else y_{t+1}; y past the end = init."""
    y, acc = np.zeros(len(x)), float(init)
    for t in range(len(x) - 1, -1, -1):
        if where[t]:
            acc = x[t] + d[t] * acc
        y[t] = acc
    return y


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", SEEDS[:4])
def test_reverse_scan_vs_loop(seed, method):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(5, 12)).astype(np.float32)
    d = rng.uniform(0, 1, size=(5, 12)).astype(np.float32)
    # carry-through positions: x = 0, d = 1 passes the running value unchanged
    through = rng.random((5, 12)) < 0.3
    x[through], d[through] = 0.0, 1.0
    y1 = _rscan(x, d, axis=1, method=method)
    y0 = _rscan(x.T, d.T, axis=0, method=method)
    ym = _rscan(x, d, method=method)  # default axis = -1
    ref = np.stack([ref_reverse_scan_1d(x[i], d[i]) for i in range(5)])
    np.testing.assert_allclose(y1, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y0, ref.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ym, ref, rtol=1e-5, atol=1e-5)
    for i, t in zip(*np.nonzero(through[:, :-1])):
        np.testing.assert_allclose(y1[i, t], y1[i, t + 1], rtol=1e-6)
    # scalar discount broadcasts
    ys = _rscan(x, np.float32(0.9), axis=1, method=method)
    ref = np.stack([ref_reverse_scan_1d(x[i], np.full(12, 0.9)) for i in range(5)])
    np.testing.assert_allclose(ys, ref, rtol=1e-5, atol=1e-5)
    # `where` (skipped positions carry the value through, whatever x and d hold there) and a
    # per-row bootstrap `init`, along both axes
    where = rng.random((5, 12)) < 0.6
    init = rng.normal(size=5).astype(np.float32)
    ref = np.stack([ref_reverse_scan_masked(x[i], d[i], where[i], init[i]) for i in range(5)])
    np.testing.assert_allclose(_rscan(x, d, axis=1, init=init, where=where, method=method), ref,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_rscan(x.T, d.T, axis=0, init=init, where=where.T, method=method),
                               ref.T, rtol=1e-5, atol=1e-5)
    ref = np.stack([ref_reverse_scan_masked(x[i], np.full(12, 0.9), where[i], 2.0)
                    for i in range(5)])
    np.testing.assert_allclose(_rscan(x, np.float32(0.9), axis=1, init=np.float32(2.0),
                                      where=where, method=method), ref, rtol=1e-5, atol=1e-5)


def test_reverse_scan_rejects_unknown_method():
    with pytest.raises(ValueError, match="method"):
        segments.reverse_scan(jnp.ones(4), 0.5, method="parallel")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", SEEDS[:3])
def test_exclusive_reverse_cumprod_vs_loop(seed, method):
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.2, 1.5, size=(4, 9)).astype(np.float32)
    where = rng.random((4, 9)) < 0.6
    ref, ref_w = np.ones((4, 9)), np.ones((4, 9))
    for i in range(4):
        for t in range(9):
            ref[i, t] = np.prod(d[i, t + 1:].astype(np.float64))
            ref_w[i, t] = np.prod(d[i, t + 1:].astype(np.float64)[where[i, t + 1:]])
    np.testing.assert_allclose(_excl(d, axis=1, method=method), ref, rtol=1e-5)
    np.testing.assert_allclose(_excl(d.T, axis=0, method=method), ref.T, rtol=1e-5)
    np.testing.assert_allclose(_excl(d, method=method), ref, rtol=1e-5)
    np.testing.assert_allclose(_excl(d, axis=1, where=where, method=method), ref_w, rtol=1e-5)
    np.testing.assert_allclose(_excl(d.T, axis=0, where=where.T, method=method), ref_w.T,
                               rtol=1e-5)
    # scalar discount with a mask: prod over the later masked positions = 0.8^count
    later = np.cumsum(where[:, ::-1], axis=1)[:, ::-1] - where
    np.testing.assert_allclose(_excl(np.float32(0.8), axis=1, where=where, method=method),
                               0.8 ** later, rtol=1e-5)


_traj_scan = jax.jit(segments.trajectory_reverse_scan)


@pytest.mark.parametrize("spec", list(_batches()))
def test_trajectory_reverse_scan_vs_loop(spec):
    b = _get(spec)
    shape = b.tokens.shape
    rng = np.random.default_rng(11)
    x = rng.normal(size=shape).astype(np.float32)  # also non-zero off actions: must be ignored
    d = rng.uniform(0.3, 1.0, size=shape).astype(np.float32)
    inc, exc = _traj_scan(x, d, b)
    ri, re = ref_trajectory_reverse_scan(np.where(b.action_mask, x, 0), d, b)
    np.testing.assert_allclose(inc, ri, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(exc, re, rtol=1e-5, atol=1e-5)
    # scalar discount
    inc, exc = _traj_scan(x, np.float32(0.9), b)
    ri, re = ref_trajectory_reverse_scan(np.where(b.action_mask, x, 0), 0.9, b)
    np.testing.assert_allclose(inc, ri, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(exc, re, rtol=1e-5, atol=1e-5)


def test_trajectory_reverse_scan_hand_example():
    # one trajectory, turns [a0 a1] [a2] [a3]; x = 1 on every action token, discount 1
    recs = [{"group": 0, "outcome": 0.0, "turns": [
        {"observation": [1], "action": [2, 3]}, {"observation": [4], "action": [5]},
        {"observation": [6], "action": [7]}]}]
    for layout in LAYOUTS:
        b = make_batch(recs, layout=layout)
        x = np.where(b.action_mask, 1.0, 0.0).astype(np.float32)
        inc, exc = (np.asarray(v) for v in _traj_scan(x, np.float32(1.0), b))
        if layout == "concatenated":
            # tokens o a a o a o a pad
            np.testing.assert_array_equal(inc[0, :8], [4, 4, 3, 2, 2, 1, 1, 0])
            np.testing.assert_array_equal(exc[0, :8], [4, 3, 2, 2, 1, 1, 0, 0])
        else:
            np.testing.assert_array_equal(inc[:3, :4], [[4, 4, 3, 2], [2, 2, 1, 1], [1, 1, 0, 0]])
            np.testing.assert_array_equal(exc[:3, :4], [[4, 3, 2, 2], [2, 1, 1, 1], [1, 0, 0, 0]])


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_trajectory_reverse_scan_same_in_both_layouts(seed):
    rng = np.random.default_rng(seed)
    recs = random_records(rng, num_traj=6)
    out = {}
    for layout in LAYOUTS:
        b, idx = pack_records(recs, layout=layout, pad_to=PAD[layout])
        # x and discount keyed by (record, turn, action position): layout-free
        x = np.zeros(b.tokens.shape, np.float32)
        d = np.ones(b.tokens.shape, np.float32)
        for i, spans in enumerate(idx.spans):
            for kk, (r, s0, s1) in enumerate(spans):
                for j in range(s1 - s0):
                    x[r, s0 + j] = (i + 1) * 0.1 + kk + 0.01 * j
                    d[r, s0 + j] = 0.5 + 0.1 * ((i + kk + j) % 5)
        inc, exc = _traj_scan(x, d, b)
        out[layout] = [[(np.asarray(inc)[r, s0:s1], np.asarray(exc)[r, s0:s1])
                        for r, s0, s1 in spans] for spans in idx.spans]
    for a, c in zip(out["concatenated"], out["per_step"]):
        for (ia, ea), (ic, ec) in zip(a, c):
            np.testing.assert_allclose(ia, ic, rtol=1e-6)
            np.testing.assert_allclose(ea, ec, rtol=1e-6)


def test_trajectory_reverse_scan_valid_turn_without_tokens():
    recs = [{"group": 0, "outcome": 0.0, "turns": [
        {"observation": [1], "action": [2, 3]}, {"observation": [4], "action": [5]},
        {"observation": [6], "action": [7]}]}]
    b = make_batch(recs, layout="per_step")
    am, tid = np.array(b.action_mask), np.array(b.turn_ids)
    am[1], tid[1] = False, -1  # turn 1 keeps turn_mask True but loses its only token
    b = b.replace(action_mask=am, turn_ids=tid)
    try:
        b.validate()
    except ValueError:
        return  # rejecting such a batch is an acceptable resolution
    x = np.where(am, 1.0, 0.0).astype(np.float32)
    inc, exc = _traj_scan(x, np.float32(1.0), b)
    ri, re = ref_trajectory_reverse_scan(x, 1.0, b)  # stream a0 a1 a3: [3, 2, 1]
    np.testing.assert_allclose(inc, ri)
    np.testing.assert_allclose(exc, re)


# ----------------------------------------------------------------------------- normalisation


def ref_masked_mean_var(x, m, ddof=0):
    v = np.asarray(x, np.float64)[np.asarray(m, bool)]
    if v.size == 0:
        return 0.0, 0.0
    mean = v.mean()
    return mean, ((v - mean) ** 2).sum() / max(v.size - ddof, 1)


_mmv = jax.jit(segments.masked_mean_var, static_argnames=("axis_name", "ddof"))
_whiten = jax.jit(segments.masked_whiten, static_argnames=("axis_name", "ddof", "shift_mean"))


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_mean_var_and_whiten_vs_numpy(seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(6, 10)) * 2 + 1).astype(np.float32)
    m = rng.random((6, 10)) < 0.6
    for ddof in (0, 1):
        mean, var = _mmv(x, m, ddof=ddof)
        rm, rv = ref_masked_mean_var(x, m, ddof)
        np.testing.assert_allclose(mean, rm, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(var, rv, rtol=1e-5, atol=1e-6)
        for shift in (True, False):
            eps = 1e-6
            got = _whiten(x, m, eps=eps, ddof=ddof, shift_mean=shift)
            ref = (x - rm) / np.sqrt(rv + eps) + (0.0 if shift else rm)
            np.testing.assert_allclose(got, np.where(m, ref, 0.0), rtol=1e-5, atol=1e-5)


def test_masked_mean_var_degenerate():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for fn in (_mmv, segments.masked_mean_var):
        mean, var = fn(x, np.zeros((3, 4), bool))
        assert float(mean) == 0.0 and float(var) == 0.0
        mean, var = fn(x, np.eye(3, 4, dtype=bool) & (np.arange(4) == 2))  # one entry
        assert float(mean) == 10.0 and float(var) == 0.0
    w = _whiten(x, np.zeros((3, 4), bool))
    assert np.all(np.asarray(w) == 0.0)
    # zero variance: 0, not NaN 
    for value in (0.5, -2.5, 4.0):
        got = np.asarray(_whiten(np.full((3, 4), value, np.float32), np.ones((3, 4), bool)))
        assert np.all(np.isfinite(got)) and np.abs(got).max() < 1e-3, (value, got)
    one = np.asarray(_whiten(x, np.eye(3, 4, dtype=bool) & (np.arange(4) == 2)))
    assert np.all(one == 0.0)


def test_masked_whiten_zero_variance_gives_zero():
    m = np.ones(13, bool)
    for value in (0.7, 100.1, 1e6 + 0.25):  # got max |whiten| 1.2e-3, 0.15, 1.0
        x = np.full((13,), value, np.float32)
        _, var = _mmv(x, m)
        got = np.asarray(_whiten(x, m))
        assert float(var) == 0.0 and np.abs(got).max() < 1e-4, (value, float(var), got)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_masked_mean_var_ignores_nonfinite_outside_mask_eager():
    x = np.array([1.0, 2.0, np.nan, np.inf], np.float32)
    m = np.array([True, True, False, False])
    mean, var = segments.masked_mean_var(x, m)
    assert float(mean) == 1.5 and float(var) == 0.25


def test_masked_mean_var_ignores_nonfinite_outside_mask_jit():
    x = np.array([1.0, 2.0, np.nan, np.inf], np.float32)
    m = np.array([True, True, False, False])
    mean, var = _mmv(x, m)
    assert float(mean) == 1.5 and float(var) == 0.25
    np.testing.assert_allclose(_whiten(x, m, eps=0.0), [-1.0, 1.0, 0.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_weighted_mean_var_vs_numpy(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=20).astype(np.float32)
    w = rng.integers(0, 5, 20).astype(np.float32)
    mean, var = jax.jit(segments.weighted_mean_var)(x, w)
    xd, wd = x.astype(np.float64), w.astype(np.float64)
    rm = (wd * xd).sum() / wd.sum()
    rv = (wd * (xd - rm) ** 2).sum() / wd.sum()
    np.testing.assert_allclose(mean, rm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, rv, rtol=1e-5, atol=1e-6)
    # frequency weights = repetition
    rep = np.repeat(xd, w.astype(int))
    np.testing.assert_allclose(mean, rep.mean(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, rep.var(), rtol=1e-5, atol=1e-6)
    mean, var = segments.weighted_mean_var(x, np.zeros(20, np.float32))
    assert float(mean) == 0.0 and float(var) == 0.0


# ----------------------------------------------------------------------------- mesh helpers


def test_psum_and_localize_are_identity_without_axis():
    x = jnp.arange(5.0)
    assert segments.psum(x) is x and segments.psum(x, None) is x
    b = _packed(0, "per_step")
    assert segments.localize(b) is b and segments.localize(b, None) is b


def test_localize_is_idempotent_under_shard_map():
    """Localising twice (a helper called on its caller's local view) moves the indices once."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    from tests.signals import signal_records
    b, _ = pack_records(signal_records(), num_shards=4)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))

    def both(x):
        once = segments.localize(x, "data")
        twice = segments.local_view(once, "data")  # what a helper does with its caller's view
        return once.row_traj, twice.row_traj, once.group_ids, twice.group_ids

    outs = jax.shard_map(both, mesh=mesh, in_specs=(P("data"),), out_specs=P("data"))(b)
    once_rt, twice_rt, once_g, twice_g = map(np.asarray, outs)
    np.testing.assert_array_equal(once_rt, twice_rt)
    np.testing.assert_array_equal(once_g, twice_g)
    n_local = b.num_traj // 4
    real = np.asarray(b.traj_mask)
    assert once_rt.max() < n_local and np.all(once_g[real] < n_local) and np.all(once_g[real] >= 0)


def test_turn_key_ids_under_grad_with_a_numpy_batch():
    """Eager jax.grad over a function of a host (numpy) batch: the sort fallback's cond
    traces with a traced order, which must not index numpy arrays."""
    from tests.signals import signal_records
    b, _ = pack_records(signal_records())
    ids = np.asarray(segments.turn_key_ids(b, b.state_keys))
    g = jax.grad(lambda x: jnp.sum(x * segments.turn_key_ids(b, b.state_keys)))(1.0)
    assert float(g) == float(ids.sum())
