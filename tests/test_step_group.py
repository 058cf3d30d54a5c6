"""GiGPO, the configurable step-group estimator and MatchTIR (estimators/step_group.py).

Compared with the dictionary-of-groups references of tests/reference/step_ref.py on batches
whose states, actions and histories collide (tests.strategies.step_records), then checked for
the reduction lattice (all anchors distinct or w = 0 gives GRPO), zero-sum step terms,
singleton anchors, layout invariance and degenerate groups. Padding, permutation and shard
invariance and degenerate batches: tests/test_conformance.py (with the settings of each
name's row).
"""

from __future__ import annotations

import copy
import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_agent import estimators as E
from jaxrl_agent import segments
from jaxrl_agent.batch import LAYOUTS
from tests.reference import estimators_ref as ref
from tests.reference import step_ref
from tests.families import (colliding_records, config_checks, layouts_agree_test, on_host,
                            packer, reference_test, shapes_of, unique_keys)
from tests.strategies import PAD, step_records

EX = settings(max_examples=20, deadline=None)
DIRECTIONS = np.eye(3, dtype=np.float32)  # feature vectors far from any cosine threshold

CONFIGS = {
    "gigpo": ("gigpo", {}),
    "gigpo_mean_steps": ("gigpo", dict(normalization="mean_norm", episode_weighting="steps",
                                       gamma=0.9, step_weight=0.5)),
    "gigpo_raw": ("gigpo", dict(singleton="raw", gamma=1.0, eps=1e-3)),
    "gigpo_bucket": ("gigpo", dict(anchor="bucket", bucket_width=0.5)),
    "gigpo_similar": ("gigpo", dict(anchor="similar", sim_threshold=0.9)),
    "sg_history_reward": ("step_group", dict(key="history", target="reward",
                                             episode_weight=0.0)),
    "sg_state_action": ("step_group", dict(key="state_action", step_weight=0.5, gamma=0.8)),
    "sg_action_outcome": ("step_group", dict(key="action", target="outcome",
                                             normalization="mean_norm")),
    "sg_turn_key": ("step_group", dict(key="turn_key", episode_weighting="steps")),
    "sg_turn_mean": ("step_group", dict(key="turn", combine_as="mean", singleton="raw",
                                        step_singleton="raw", episode_reward="reward_sum")),
    "matchtir": ("matchtir", {}),
    "matchtir_gamma05": ("matchtir", dict(gamma=0.5, eps=1e-4)),
}


def _estimate(ids, batch):
    return {cid: E.get(CONFIGS[cid][0])(batch, **CONFIGS[cid][1]) for cid in ids}


run_all = on_host(jax.jit(functools.partial(_estimate, tuple(CONFIGS))))


@functools.lru_cache(maxsize=None)
def _jitted(name, hp):
    return jax.jit(functools.partial(E.get(name), **dict(hp)))


def est(name, batch, **hp):
    """One estimator jitted (cached per setting; one compile per batch shape)."""
    return jax.tree.map(np.asarray, _jitted(name, tuple(sorted(hp.items())))(batch))


def add_extras(draw, rec):
    """Every turn: a turn_key from a tiny alphabet and a state feature vector built from the
    observation (so 'bucket' and 'similar' anchors mostly agree with exact ones) or drawn."""
    for t in rec["turns"]:
        t["turn_key"] = draw(st.sampled_from(["a", "b", 7]))
        d = DIRECTIONS[t["observation"][0] if draw(st.booleans()) else draw(st.integers(0, 2))]
        t["turn_extras"] = {"state_features": [float(x) * 2 for x in d]}


def records(**kw):
    return step_records(extras=add_extras, **kw)


def np_records(seed, num_traj=8, groups=3):
    """Deterministic colliding records (tiny alphabets, shared prefixes) for plain tests."""
    def turn(rng):
        obs = int(rng.integers(3))
        return {"observation": [obs],
                "action": [int(x) for x in rng.integers(0, 2, rng.integers(1, 3))],
                "reward": float(rng.choice([-1.0, 0.0, 0.5, 1.0])),
                "turn_key": int(rng.integers(3)),
                "turn_extras": {"state_features": [float(x) * 2 for x in DIRECTIONS[obs]]}}

    return colliding_records(seed, turn, lambda rng, rec: dict(rec, outcome=float(
        rng.integers(2))), num_traj, groups)


pack = packer(PAD)


# ----------------------------------------------------------------------------- vs reference


test_matches_reference = reference_test(
    EX, records(), pack, run_all,
    functools.partial(config_checks, CONFIGS, step_ref.REFERENCES, CONFIGS))


def test_public_compute_path():
    recs = np_records(1)
    batch, index = pack(recs, "per_step")
    adv = jax.tree.map(np.asarray, E.compute("gigpo", batch, gamma=0.9))
    placed = ref.place(step_ref.gigpo(recs, gamma=0.9), index, shapes_of(batch))
    np.testing.assert_allclose(adv.turn, placed["turn"][0], atol=1e-4)


# ----------------------------------------------------------------------------- reductions


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_all_anchors_distinct_or_w0_equals_grpo(layout, recs):
    """The reduction lattice: distinct anchors, or step weight 0, give GRPO exactly (mean_norm:
    Dr.GRPO); singleton anchor groups contribute 0."""
    batch, _ = pack(recs, layout)
    dist, _ = pack(unique_keys(recs), layout)
    grpo = np.asarray(est("grpo", batch).token)
    dr = np.asarray(est("dr_grpo", batch).token)
    np.testing.assert_allclose(est("gigpo", dist).token, grpo, atol=1e-6)
    np.testing.assert_allclose(est("gigpo", batch, step_weight=0.0).token, grpo, atol=1e-6)
    np.testing.assert_allclose(est("gigpo", dist, normalization="mean_norm").token, dr, atol=1e-6)
    np.testing.assert_allclose(est("step_group", dist, key="state").token, grpo, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_step_term_sums_to_zero_in_each_anchor_group(layout, recs):
    batch, index = pack(recs, layout)
    a = np.asarray(est("gigpo", batch, normalization="mean_norm").turn)
    a_ep = np.asarray(est("dr_grpo", batch).turn)
    step = a - a_ep
    sums = {}
    trajs = step_ref.parse_steps(recs)
    for i, tr in enumerate(trajs):
        for k, t in enumerate(tr.turns):
            key = (tr.group, t.state)
            sums.setdefault(key, []).append(step[index.traj[i], k])
    for key, xs in sums.items():
        assert abs(sum(xs)) <= 1e-4 * max(1, len(xs)), (key, xs)
        if len(xs) == 1:
            assert xs[0] == 0.0, f"singleton anchor {key} got {xs[0]}"


def test_step_term_is_not_shift_invariant_with_unequal_remaining_lengths():
    """GiGPO's step term is not shift invariant: adding c to every step reward shifts G by
    c * (remaining length); anchor peers with different remaining lengths then see different
    shifts."""
    def rec(g, rewards, outcome):
        turns = [{"observation": [0 if k == 0 else 10 + k + 10 * g], "action": [1],
                  "reward": r} for k, r in enumerate(rewards)]
        return {"group": 0, "outcome": outcome, "turns": turns}

    base = [rec(0, [0.0, 1.0], 1.0), rec(1, [0.0, 0.0, 0.0], 0.0)]
    shifted = [rec(0, [0.5, 1.5], 1.0), rec(1, [0.5, 0.5, 0.5], 0.0)]
    a = np.asarray(est("gigpo", pack(base, "concatenated")[0], gamma=1.0,
                                  normalization="mean_norm").turn)
    b = np.asarray(est("gigpo", pack(shifted, "concatenated")[0], gamma=1.0,
                                  normalization="mean_norm").turn)
    assert not np.allclose(a[:2, 0], b[:2, 0])  # the shared first state: 2 vs 3 steps left
    # equal remaining lengths: the shift cancels
    eq = [rec(0, [0.0, 1.0], 1.0), rec(1, [0.0, 0.0], 0.0)]
    eq_s = [rec(0, [0.5, 1.5], 1.0), rec(1, [0.5, 0.5], 0.0)]
    a = np.asarray(est("gigpo", pack(eq, "concatenated")[0], normalization="mean_norm").turn)
    b = np.asarray(est("gigpo", pack(eq_s, "concatenated")[0], normalization="mean_norm").turn)
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_hand_built_gigpo_example():
    """Two rollouts of one task both start in state S. Rollout 0: S -a-> T (r=0) -b-> success
    (r=1), R=1. Rollout 1: S -c-> S (r=0, a loop back to S) -d-> failure (r=0), R=0.
    gamma = 0.5, normalize mean_norm:
      episode: mean R = 0.5, A_ep = (+0.5, -0.5);
      returns: G0 = (0.5, 1), G1 = (0, 0);
      anchor S holds (0,0) G=0.5, (1,0) G=0, (1,1) G=0: mean 1/6, step terms 1/3, -1/6, -1/6;
      anchor T holds only (0,1): singleton, step term 0.
    A0 = (0.5 + 1/3, 0.5), A1 = (-0.5 - 1/6, -0.5 - 1/6)."""
    recs = [{"group": "t", "outcome": 1.0, "turns": [
                {"observation": [1], "action": [5], "reward": 0.0},
                {"observation": [2], "action": [6], "reward": 1.0}]},
            {"group": "t", "outcome": 0.0, "turns": [
                {"observation": [1], "action": [7], "reward": 0.0},
                {"observation": [1], "action": [8], "reward": 0.0}]}]
    for layout in LAYOUTS:
        turn = np.asarray(est("gigpo", pack(recs, layout)[0], gamma=0.5,
                                         normalization="mean_norm").turn)
        np.testing.assert_allclose(turn[:2, :2], [[0.5 + 1 / 3, 0.5], [-2 / 3, -2 / 3]],
                                   atol=1e-6)


def test_episode_weighting_by_steps_leans_toward_long_episodes():
    """Rollout 0 succeeds in 1 step (R=1), rollout 1 fails after 3 (R=0). Counting steps, the
    baseline is (1 + 0 * 3) / 4 = 0.25 instead of 0.5, so mean_norm gives (0.75, -0.25)."""
    recs = [{"group": 0, "outcome": 1.0, "turns": [{"observation": [1], "action": [1]}]},
            {"group": 0, "outcome": 0.0, "turns": [{"observation": [k + 2], "action": [1]}
                                                   for k in range(3)]}]
    b = pack(recs, "per_step")[0]
    t = np.asarray(est("gigpo", b, normalization="mean_norm").turn)
    np.testing.assert_allclose(t[:2, 0], [0.5, -0.5], atol=1e-6)
    t = np.asarray(est("gigpo", b, normalization="mean_norm", episode_weighting="steps").turn)
    np.testing.assert_allclose(t[:2, 0], [0.75, -0.25], atol=1e-6)


def test_matchtir_is_the_mean_of_grpo_and_turn_cohorts():
    recs = np_records(2)
    for r in recs:
        r.pop("outcome")  # MatchTIR's trajectory reward is the sum of its turn rewards
    b = pack(recs, "concatenated")[0]
    a = np.asarray(est("matchtir", b).turn)
    ep = np.asarray(est("grpo", b, singleton="raw").turn)
    st_ = np.asarray(est("step_group", b, key="turn", gamma=0.9, episode_weight=0.0,
                                         step_singleton="raw").turn)
    np.testing.assert_allclose(a, (ep + st_) / 2, atol=1e-5)


# ----------------------------------------------------------------------------- invariances


test_layouts_agree = layouts_agree_test(EX, records(), run_all, pack, CONFIGS)


# ----------------------------------------------------------------------------- degenerate


@pytest.mark.parametrize("layout", LAYOUTS)
def test_degenerate_groups(layout):
    """A lone trajectory: GiGPO gives 0 (singleton group and anchor), 'raw' gives R / (1 +
    eps); identical trajectories: every setting exactly 0. (Finite credit on degenerate and
    all-padding batches, padding, permutation and shards: tests/test_conformance.py.)"""
    one = [{"group": 0, "outcome": 1.0, "turns": [
        {"observation": [1], "action": [1], "reward": 1.0, "turn_key": 1,
         "turn_extras": {"state_features": [0.0, 0.0, 0.0]}}]}]
    out = run_all(pack(one, layout)[0])
    for cid, adv in out.items():
        assert np.isfinite(adv.token).all() and np.isfinite(adv.turn).all(), cid
    assert out["gigpo"].turn[0, 0] == 0.0  # singleton task group and singleton anchor
    assert out["gigpo_raw"].turn[0, 0] == pytest.approx(1.0 / (1 + 1e-3) + 0.0)
    same = [copy.deepcopy(one[0]) for _ in range(4)]
    for cid, adv in run_all(pack(same, layout)[0]).items():  # all equal: exactly 0
        assert (adv.turn == 0).all() and (adv.token == 0).all(), cid


# ----------------------------------------------------------------------------- keys


@jax.jit
def _history_keys(batch):
    return segments.history_keys(batch) + segments.history_keys(batch, depth=1)


@EX
@given(recs=step_records())
def test_history_keys_identify_exact_histories(recs):
    batch, index = pack(recs, "per_step")
    h1, h2, *d1 = (np.asarray(x) for x in _history_keys(batch))
    trajs = step_ref.parse_steps(recs)
    seen, seen_d = {}, {}
    for i, tr in enumerate(trajs):
        n = index.traj[i]
        for k in range(len(tr.turns)):
            hist = tr.history(k)
            key = (int(h1[n, k]), int(h2[n, k]))
            assert seen.setdefault(key, hist) == hist, "two histories share a key"
            short = hist[-3:] if k >= 1 else ("start",) + hist
            key_d = (int(d1[0][n, k]), int(d1[1][n, k]))
            assert seen_d.setdefault(key_d, short) == short
    assert len(set(seen.values())) == len(seen), "one history got two keys"


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name,hp,needle", [
    ("gigpo", {"normalization": "z"}, "normalization must be one of"),
    ("gigpo", {"anchor": "fuzzy"}, "anchor must be one of"),
    ("gigpo", {"gamma": 1.5}, "gamma must lie in"),
    ("gigpo", {"anchor": "similar"}, r"extras\['state_features'\]"),
    ("gigpo", {"anchor": "bucket", "bucket_width": 0.0}, "bucket_width must be > 0"),
    ("step_group", {"key": "turn_key"}, r"extras\['turn_keys'\]"),
    ("step_group", {"key": "obs"}, "key must be one of"),
    ("step_group", {"target": "q"}, "target must be one of"),
    ("matchtir", {"eps": 0.0}, "eps must be > 0"),
])
def test_errors_name_the_problem(one_turn_batch, name, hp, needle):
    with pytest.raises(ValueError, match=needle):
        E.get(name)(one_turn_batch, **hp)
