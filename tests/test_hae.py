"""HiPER's hierarchical advantage estimation (estimators/hierarchical.py: ``hae``,
``hae_streams``).

Compared with the loop-over-segments reference of tests/reference/hae_ref.py on step_records
batches (both layouts) with random subgoal boundaries, value heads and token masks; then the
method's reductions (one segment = turn GAE; every turn a boundary = one-step SMDP bootstrap),
GAE limits per level, disjoint token streams, layout invariance, degenerate input, a
hand-worked example and the error messages. Padding, permutation and shard invariance (the
batch-wide normalisations too) and degenerate batches: tests/test_conformance.py.

Compile budget: every setting in CONFIGS runs inside one jitted function per batch shape.
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_agent import estimators as E
from jaxrl_agent.batch import LAYOUTS
from jaxrl_agent.estimators.hierarchical import hae_streams
from tests.reference import estimators_ref as ref
from tests.reference import hae_ref
from tests.families import assert_placed, on_host, packer, reference_test, shapes_of
from tests.strategies import PAD, step_records

EX = settings(max_examples=20, deadline=None)
MASKS = ("subgoal_mask", "switch_mask")

STREAM_HP = dict(gamma=0.9, lam_turn=0.8, lam_seg=0.6)

# id -> (hyper-parameters, extras dropped before the call)
CONFIGS = {
    "default": ({}, ()),
    "g": (STREAM_HP, ()),
    "norm_turn": (dict(gamma=0.95, lam_turn=0.9, lam_seg=0.9, normalization="turn", eps=1e-6), ()),
    "norm_token_high": (dict(gamma=0.9, switch_stream="high", normalization="token"), ()),
    "no_high_values": (dict(gamma=0.9, lam_turn=0.7, lam_seg=0.6), ("high_values",)),
    "no_masks_no_term": (dict(gamma=0.9, normalization="turn"), MASKS + ("term_values",)),
    "no_masks": (STREAM_HP, MASKS),  # every action token low level
    "half": (dict(gamma=0.5, lam_turn=0.5, lam_seg=0.5), ()),
}
# hae_streams settings, compared with the reference streams too
STREAMS = {
    "streams": STREAM_HP,  # switch_stream "auto" = "term" (V_term given): the streams of "g"
    "s_lam1": dict(gamma=0.9, lam_turn=1.0, lam_seg=1.0),
    "s_lam0": dict(gamma=0.8, lam_turn=0.0, lam_seg=0.0),
    "s_high": dict(switch_stream="high"),
    "s_none": dict(switch_stream="none", gamma=0.95),
    "s_half": dict(gamma=0.5, lam_turn=0.5, lam_seg=0.5),
}


def _drop(batch, names):
    return batch.replace(extras={k: v for k, v in batch.extras.items() if k not in names})


def _estimate(ids, sids, batch, axis_name=None, flat=True):
    """The hae settings ``ids``, the hae_streams settings ``sids`` and (``flat``) turn_gae
    with the low-level hyper-parameters of STREAM_HP (for the one-segment reduction)."""
    out = {cid: E.get("hae")(_drop(batch, CONFIGS[cid][1]), axis_name=axis_name,
                             **CONFIGS[cid][0]) for cid in ids}
    out.update({sid: hae_streams(batch, axis_name=axis_name, **STREAMS[sid]) for sid in sids})
    if not flat:
        return out
    out["turn_gae"] = E.get("turn_gae")(batch, gamma=STREAM_HP["gamma"],
                                        lam=STREAM_HP["lam_turn"], normalization="none",
                                        axis_name=axis_name)
    return out


run_all = on_host(jax.jit(functools.partial(_estimate, tuple(CONFIGS), tuple(STREAMS))))


def add_hae(draw, rec):
    """Per turn: V_low, V_high, V_term, a switch flag (p = 0.4) and per-token subgoal/switch
    masks (each token plain, subgoal, switch or both), from a drawn numpy seed."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    for t in rec["turns"]:
        cats = rng.integers(0, 4, len(t["action"]))
        t["value"] = float(np.float32(rng.normal()))
        t["turn_extras"] = {"high_values": float(np.float32(2 * rng.normal())),
                            "switch": float(rng.random() < 0.4),
                            "term_values": float(np.float32(rng.normal()))}
        t["token_extras"] = {"subgoal_mask": [bool(c in (1, 3)) for c in cats],
                             "switch_mask": [bool(c >= 2) for c in cats]}


def records(**kw):
    return step_records(extras=add_hae, **kw)


def seeded_records(seed, num_groups=3, num_traj=8):
    """Deterministic records like ``records()`` (tiny alphabets, random boundaries and masks)
    from a numpy seed, for the non-hypothesis tests."""
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(num_traj):
        turns = [{"observation": [int(rng.integers(0, 3))],
                  "action": [int(x) for x in rng.integers(0, 2, rng.integers(1, 3))],
                  "reward": float(np.float32(rng.normal()))}
                 for _ in range(int(rng.integers(1, 5)))]
        rec = {"group": f"{seed}-{i % num_groups}", "outcome": float(rng.integers(0, 2)),
               "turns": turns}
        add_hae(lambda *a, **k: int(rng.integers(0, 2 ** 32 - 1)), rec)
        recs.append(rec)
    return recs


def strip(recs, names):
    recs = copy.deepcopy(recs)
    for r in recs:
        for t in r["turns"]:
            for level in ("turn_extras", "token_extras"):
                for n in names:
                    t.get(level, {}).pop(n, None)
    return recs


def set_switch(recs, value):
    recs = copy.deepcopy(recs)
    for r in recs:
        for t in r["turns"]:
            t["turn_extras"]["switch"] = value
    return recs


pack = packer(PAD)


def check(cid, adv, recs, index, batch):
    hp, drop = CONFIGS[cid]
    placed = ref.place(hae_ref.hae(strip(recs, drop), **hp), index, shapes_of(batch))
    assert_placed(cid, adv, placed, batch.layout, ("token", "turn", "turn_returns"))


def check_streams(sid, s, recs, index):
    per = hae_ref.streams(recs, **STREAMS[sid])
    routed = {"low_tokens": "low", "high_tokens": "high", "term_tokens": "term"}
    for i, p in enumerate(per):
        n, k = index.traj[i], len(p["low"])
        tol = ref.BASE_ATOL + ref.BASE_RTOL * p["scale"]
        for name in ("low", "low_returns", "high", "high_returns", "term_returns", "term"):
            np.testing.assert_allclose(s[name][n, :k], p[name], atol=tol, rtol=0,
                                       err_msg=f"{sid}.{name} record {i}")
        np.testing.assert_array_equal(s["boundary"][n, :k], p["boundary"])
        for field, label in routed.items():
            got = [s[field][row, a:b].tolist() for row, a, b in index.spans[i]]
            exp = [[lab == label for lab in labels] for labels in p["route"]]
            assert got == exp, f"{sid}.{field} record {i}: {got} != {exp}"


# ----------------------------------------------------------------------------- vs reference


def reference_checks(out, recs, index, batch):
    """Every hae setting and every hae_streams setting against the reference."""
    return ([("", functools.partial(check, cid, out[cid], recs, index, batch)) for cid in CONFIGS]
            + [(f"[{batch.layout}]", functools.partial(check_streams, sid, out[sid], recs, index))
               for sid in STREAMS])


test_matches_reference = reference_test(EX, records(), pack, run_all, reference_checks)


def test_public_compute_path_and_registry():
    recs = seeded_records(1)
    batch, index = pack(recs, "per_step")
    assert E.get("hae") is E.hae
    assert E.spec("hae").hyper_params["lam_seg"] == 0.95
    hp = CONFIGS["g"][0]
    adv = jax.tree.map(np.asarray, E.compute("hae", batch, **hp))
    check("g", adv, recs, index, batch)


# ----------------------------------------------------------------------------- reductions


def _discounted(x, gamma):
    g, out = 0.0, []
    for v in reversed(list(x)):
        g = v + gamma * g
        out.append(g)
    return out[::-1]


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_single_segment_is_turn_gae(layout, recs):
    """No switches: A_low is flat turn GAE with the terminal bootstrap (and, without token
    masks, so is every token); A_high is the one-step SMDP TD over the whole episode."""
    batch, index = pack(set_switch(recs, 0.0), layout)
    out = run_all(batch)
    s, flat = out["streams"], out["turn_gae"]
    np.testing.assert_allclose(s["low"], flat.turn, atol=2e-5)
    np.testing.assert_allclose(s["low_returns"], flat.turn_returns, atol=2e-5)
    np.testing.assert_allclose(out["no_masks"].token, flat.token, atol=2e-5)
    np.testing.assert_allclose(out["no_masks"].turn, flat.turn, atol=2e-5)
    r, vh = np.asarray(batch.turn_rewards), np.asarray(batch.extras["high_values"])
    for i, rec in enumerate(recs):
        n, k = index.traj[i], len(rec["turns"])
        g0 = _discounted(r[n, :k], STREAM_HP["gamma"])[0]
        assert s["boundary"][n, :k].tolist() == [True] + [False] * (k - 1)
        assert s["high"][n, 0] == pytest.approx(g0 - vh[n, 0], abs=2e-5)
        assert (s["high"][n, 1:] == 0).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_every_turn_a_boundary(layout, recs):
    """Segments of length 1: A_low_k = r_k + gamma V_high(k+1) - V_low(k) (0 past the end);
    A_high_k = delta_k + gamma lam_seg A_high_{k+1} with delta_k = r_k + gamma V_high(k+1) -
    V_high(k)."""
    batch, index = pack(set_switch(recs, 1.0), layout)
    s = run_all(batch)["streams"]
    g, ls = STREAM_HP["gamma"], STREAM_HP["lam_seg"]
    r = np.asarray(batch.turn_rewards, np.float64)
    vl = np.asarray(batch.extras["turn_values"], np.float64)
    vh = np.asarray(batch.extras["high_values"], np.float64)
    for i, rec in enumerate(recs):
        n, k = index.traj[i], len(rec["turns"])
        nxt = np.append(vh[n, 1:k], 0.0)
        np.testing.assert_allclose(s["low"][n, :k], r[n, :k] + g * nxt - vl[n, :k], atol=2e-5)
        delta = r[n, :k] + g * nxt - vh[n, :k]
        np.testing.assert_allclose(s["high"][n, :k], _discounted(delta, g * ls), atol=2e-5)
        assert s["boundary"][n, :k].all()


def _segment_ends(boundary, k):
    """Per turn: (end of its segment, next boundary or None)."""
    starts = [j for j in range(k) if boundary[j]]
    res = []
    for j in range(k):
        nxt = next((b for b in starts if b > j), None)
        res.append(((nxt - 1) if nxt is not None else k - 1, nxt))
    return res


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_gae_limits_per_level(layout, recs):
    """The GAE limits for each level: lam = 1 gives return - value (low: return to the segment
    end plus the V_high bootstrap; high: the whole discounted return - V_high, the later V_high
    telescoping away); lam = 0 gives the one-step TD error of the level."""
    batch, index = pack(recs, layout)
    out = run_all(batch)
    g1, g0 = STREAMS["s_lam1"]["gamma"], STREAMS["s_lam0"]["gamma"]
    r = np.asarray(batch.turn_rewards, np.float64)
    vl = np.asarray(batch.extras["turn_values"], np.float64)
    vh = np.asarray(batch.extras["high_values"], np.float64)
    lam1, lam0 = out["s_lam1"], out["s_lam0"]
    for i, rec in enumerate(recs):
        n, k = index.traj[i], len(rec["turns"])
        bnd = lam1["boundary"][n, :k]
        for j, (e, nxt) in enumerate(_segment_ends(bnd, k)):
            boot = vh[n, nxt] if nxt is not None else 0.0
            g = sum(g1 ** (p - j) * r[n, p] for p in range(j, e + 1)) + g1 ** (e - j + 1) * boot
            assert lam1["low"][n, j] == pytest.approx(g - vl[n, j], abs=2e-5)
            v_next = vl[n, j + 1] if j < e else boot
            assert lam0["low"][n, j] == pytest.approx(r[n, j] + g0 * v_next - vl[n, j],
                                                      abs=2e-5)
            if bnd[j]:
                whole = sum(g1 ** (p - j) * r[n, p] for p in range(j, k))
                assert lam1["high"][n, j] == pytest.approx(whole - vh[n, j], abs=2e-5)
                seg = sum(g0 ** (p - j) * r[n, p] for p in range(j, e + 1))
                d0 = seg + g0 ** (e - j + 1) * (vh[n, nxt] if nxt is not None else 0.0) \
                    - vh[n, j]
                assert lam0["high"][n, j] == pytest.approx(d0, abs=2e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_each_token_gets_at_most_one_stream(layout, recs):
    """Low/high/term token sets are disjoint, inside action_mask, and the token output is
    exactly the masked sum of the three broadcast streams. The uncovered action tokens are
    exactly the kept-subgoal tokens and the switch tokens of streams switched off."""
    batch, index = pack(recs, layout)
    out = run_all(batch)
    am = np.asarray(batch.action_mask)
    sub = np.asarray(batch.extras["subgoal_mask"]) & am
    swm = np.asarray(batch.extras["switch_mask"]) & am
    for sid in ("streams", "s_high", "s_none"):
        s, mode = out[sid], STREAMS[sid].get("switch_stream", "term")
        lo, hi, te = s["low_tokens"], s["high_tokens"], s["term_tokens"]
        assert not (lo & hi).any() and not (lo & te).any() and not (hi & te).any()
        assert not ((lo | hi | te) & ~am).any()
        btok = np.zeros_like(am)
        for row in range(am.shape[0]):
            for t in np.nonzero(am[row])[0]:
                btok[row, t] = s["boundary"][int(np.asarray(batch.row_traj)[row]),
                                             int(np.asarray(batch.turn_ids)[row, t])]
        uncovered = am & ~(lo | hi | te)
        expected = (sub & ~swm & ~btok)
        if mode == "none":
            expected |= swm
        elif mode == "high":
            expected |= swm & ~btok
        np.testing.assert_array_equal(uncovered, expected)
        assert (lo == (am & ~sub & ~swm)).all()
    # token output of the default setting = sum of the streams routed by the masks
    d = out["streams"]  # the streams of setting "g"
    rows, tids = np.asarray(batch.row_traj), np.clip(np.asarray(batch.turn_ids), 0, None)
    tok = lambda x: x[rows[:, None], tids]  # noqa: E731
    expect = (np.where(d["low_tokens"], tok(d["low"]), 0) + np.where(d["high_tokens"],
              tok(d["high"]), 0) + np.where(d["term_tokens"], tok(d["term"]), 0))
    np.testing.assert_allclose(out["g"].token, expect, atol=1e-6)


# ----------------------------------------------------------------------------- invariances


@EX
@given(recs=records())
def test_layouts_agree(recs):
    a, ia = pack(recs, "concatenated")
    c, ic = pack(recs, "per_step")
    oa, oc = run_all(a), run_all(c)
    for cid in CONFIGS:
        np.testing.assert_allclose(oa[cid].turn, oc[cid].turn, atol=1e-6, err_msg=cid)
        for i in range(len(recs)):
            ta = np.concatenate([oa[cid].token[r, s:e] for r, s, e in ia.spans[i]])
            tc = np.concatenate([oc[cid].token[r, s:e] for r, s, e in ic.spans[i]])
            np.testing.assert_allclose(ta, tc, atol=1e-6, err_msg=cid)


# ----------------------------------------------------------------------------- degenerate


def _turn(obs, act, r, v, vh, sw, vt, sub, swm):
    return {"observation": obs, "action": act, "reward": r, "value": v,
            "turn_extras": {"high_values": vh, "switch": sw, "term_values": vt},
            "token_extras": {"subgoal_mask": sub, "switch_mask": swm}}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_degenerate_inputs(layout):
    """A one-turn episode: A_low = r - V_low, A_high = r - V_high, A_term = r - V_term;
    normalised settings stay finite. All-equal streams standardise to exactly 0. (The
    all-padding batch: tests/test_conformance.py.)"""
    one = [{"group": 0, "turns": [_turn([1], [1, 2, 3], 1.0, 0.25, 0.5, 0.0, 2.0,
                                        [False, True, False], [True, False, False])]}]
    batch, _ = pack(one, layout)
    out = run_all(batch)
    for cid in CONFIGS:
        adv = out[cid]
        assert np.isfinite(adv.token).all() and np.isfinite(adv.turn).all(), cid
    s = out["streams"]
    assert s["low"][0, 0] == 0.75 and s["high"][0, 0] == 0.5 and s["term"][0, 0] == -1.0
    row = np.asarray(out["default"].token)[0]
    first = 1  # after the one observation token
    assert row[first:first + 3].tolist() == [-1.0, 0.5, 0.75]
    # all equal: every trajectory identical -> every stream constant -> exactly 0
    same = [copy.deepcopy(one[0]) for _ in range(5)]
    for cid in ("norm_turn", "norm_token_high", "no_masks_no_term"):
        adv = run_all(pack(same, layout)[0])[cid]
        assert (adv.turn == 0).all() and (adv.token == 0).all(), cid


# ----------------------------------------------------------------------------- by hand


def test_hand_built_example():
    """gamma = lam_turn = lam_seg = 1/2, one trajectory of 4 turns, a new subgoal at turn 2:
    segments [0, 1] and [2, 3].
      r      = [0, 1, 0, 2]        V_low = [1, 1.5, 0.5, 1]
      V_high = [2, -, 1, -] (read at boundaries 0 and 2; the others are never read)
      V_term = [0.5] * 4
    Low level (backwards in each segment, V_high(2) = 1 bootstraps turn 1):
      k=3: delta = 2 + 0 - 1 = 1                      A = 1
      k=2: delta = 0 + .5*1 - .5 = 0                  A = 0 + .25*1 = 0.25
      k=1: delta = 1 + .5*V_high(2)=.5 - 1.5 = 0      A = 0  (segment end: no carry)
      k=0: delta = 0 + .5*1.5 - 1 = -0.25             A = -0.25 + .25*0 = -0.25
    High level: seg 1: R = 0 + .5*2 = 1, delta = 1 + 0 - 1 = 0, A = 0;
      seg 0: R = 0 + .5*1 = .5, delta = .5 + .25*1 - 2 = -1.25, A = -1.25 + .25*.5*0 = -1.25.
    Term returns: k=3: 2; k=2: 0 + .5*2 = 1; k=1: 1 + .5*V_high(2) = 1.5; k=0: .5*1.5 = .75;
      A_term = [0.25, 1, 0.5, 1.5].
    Each turn's 3 action tokens are [switch, subgoal, plain]: switch tokens get A_term, the
    subgoal token A_high on boundary turns (0, 2) and nothing on kept turns (1, 3), the plain
    token A_low."""
    sub, swm = [False, True, False], [True, False, False]
    rec = {"group": 0, "turns": [_turn([1], [1, 2, 3], 0.0, 1.0, 2.0, 0.0, 0.5, sub, swm),
                                 _turn([2], [1, 2, 3], 1.0, 1.5, 9.0, 0.0, 0.5, sub, swm),
                                 _turn([3], [1, 2, 3], 0.0, 0.5, 1.0, 1.0, 0.5, sub, swm),
                                 _turn([4], [1, 2, 3], 2.0, 1.0, 9.0, 0.0, 0.5, sub, swm)]}
    expected = [[0.25, -1.25, -0.25], [1.0, 0.0, 0.0], [0.5, 0.0, 0.25], [1.5, 0.0, 1.0]]
    for layout in LAYOUTS:
        batch, index = pack([rec], layout)
        out = run_all(batch)
        adv = out["half"]
        got = [adv.token[r, a:b].tolist() for r, a, b in index.spans[0]]
        assert got == expected, (layout, got)
        assert adv.turn[0, :4].tolist() == [-0.25, 0.0, 0.25, 1.0]
        assert adv.turn_returns[0, :4].tolist() == [0.75, 1.5, 0.75, 2.0]
        s = out["s_half"]
        assert s["high"][0, :4].tolist() == [-1.25, 0.0, 0.0, 0.0]
        assert s["high_returns"][0, :4].tolist() == [0.75, 0.0, 1.0, 0.0]
        assert s["term_returns"][0, :4].tolist() == [0.75, 1.5, 1.0, 2.0]
        assert s["term"][0, :4].tolist() == [0.25, 1.0, 0.5, 1.5]
    assert hae_ref.hae([rec], gamma=0.5, lam_turn=0.5, lam_seg=0.5).token[0] == expected


# ----------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def plain():
    return pack([{"group": 0, "turns": [_turn([1], [1], 1.0, 0.0, 0.0, 0.0, 0.0, [False],
                                               [False])]}], "concatenated")[0]


@pytest.mark.parametrize("hp,drop,needle", [
    ({"gamma": 1.5}, (), "gamma must lie in"),
    ({"lam_turn": -0.1}, (), "lam_turn must lie in"),
    ({"lam_seg": 2.0}, (), "lam_seg must lie in"),
    ({"normalization": "batch"}, (), "normalization must be one of"),
    ({"switch_stream": "low"}, (), "switch_stream must be one of"),
    ({"eps": 0.0}, (), "eps must be > 0"),
    ({}, ("turn_values",), r"extras\['turn_values'\]"),
    ({}, ("switch",), r"extras\['switch'\]"),
    ({"switch_stream": "term"}, ("term_values",), r"extras\['term_values'\]"),
])
def test_errors_name_the_problem(plain, hp, drop, needle):
    with pytest.raises(ValueError, match=needle):
        E.hae(_drop(plain, drop), **hp)


def test_bad_mask_shape_is_named(plain):
    bad = plain.replace(extras={**plain.extras, "subgoal_mask": jnp.zeros((1, 3), bool)})
    with pytest.raises(ValueError, match=r"extras\['subgoal_mask'\] must have shape"):
        E.hae(bad)
