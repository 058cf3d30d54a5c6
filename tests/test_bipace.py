"""BiPACE (estimators/bipace.py) and a review of segments.similarity_clusters.

BiPACE is compared with the union-find reference of tests/reference/bipace_ref.py on
step_records batches (colliding states and actions) whose hidden vectors come from a small
catalogue of directions, so every cosine lies far from every threshold used here (float32
rounding can never flip a link). Then: its reductions (tau > 1 gives the episode term; with
merged state keys and distinct actions it is GiGPO), identical actions give 0, the plain step
term sums to 0 over each cluster, layout invariance, no gradient into the hidden states,
degenerate groups, a hand-worked example and error messages. The last section checks
segments.similarity_clusters against union-find, its convergence on long paths and zero
vectors at thresholds <= 0. Padding, permutation and shard invariance and degenerate batches:
tests/test_conformance.py (with the settings of bipace's row).

Compile budget: every setting runs inside one jitted program per batch shape (``_run_all``).
"""

from __future__ import annotations

import copy
import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_agent import estimators as E
from jaxrl_agent import segments
from jaxrl_agent.batch import LAYOUTS
from tests.reference import bipace_ref
from tests.reference import step_ref
from tests.families import (assert_matches, layouts_agree_test, on_host, packer,
                            reference_test, unique_keys)
from tests.strategies import PAD, step_records

# (the package re-exports the function ``bipace`` under the module's name)
bipace_mod = importlib.import_module("jaxrl_agent.estimators.bipace")

EX = settings(max_examples=20, deadline=None)

# Hidden-state catalogue: unit vectors at 0, 20, ..., 100 degrees in the xy-plane, the z axis
# and the zero vector. Pairwise cosines are cos(20 j deg) (1, .940, .766, .5, .174, -.174), 0
# (z vs the plane, zero vector): tau = 0.9 links neighbours 20 deg apart (chains of up to 6
# directions), tau = 0.6 links up to 40 deg; tau = 1.5 links nothing.
_ANGLES = [math.radians(20 * j) for j in range(6)]
CATALOGUE = [[math.cos(a), math.sin(a), 0.0] for a in _ANGLES] + [[0.0, 0.0, 1.0],
                                                                   [0.0, 0.0, 0.0]]

CONFIGS = {
    "plain": dict(gamma=1.0, normalization="mean_norm"),
    "loo_std": dict(leave_one_out=True, step_normalization="mean_std_norm", gamma=1.0,
                    normalization="mean_norm", merge_state_keys=True, singleton="raw"),
    "wide_merge": dict(tau=0.6, merge_state_keys=True, step_weight=0.5),
    "merge_only_std": dict(tau=1.5, merge_state_keys=True, step_normalization="mean_std_norm",
                           episode_weighting="steps"),
    "merge_only_mean": dict(tau=1.5, merge_state_keys=True, normalization="mean_norm"),
    "none": dict(tau=1.5, normalization="mean_norm"),
}
PLAIN = ("plain", "wide_merge", "merge_only_std", "merge_only_mean", "none")  # not LOO


def _episode(batch, hp):
    b = segments.local_view(batch)
    a = E.episode_advantage(b, normalization=hp.get("normalization", "mean_std_norm"),
                            weighting=hp.get("episode_weighting", "trajectory"),
                            eps=hp.get("eps", 1e-6), singleton=hp.get("singleton", "zero"))
    return jnp.where(segments.valid_turns(b), a[:, None], 0.0)


def _estimate(ids, batch, extra=False):
    """cid -> {"adv": Advantages, "pace": A_PACE [N, K] recovered as (A - A_ep) / w}; with
    ``extra`` also GiGPO (mean_norm; steps weighting), Dr.GRPO and the estimator's clusters
    (tau 0.6, with and without merged state keys) on the same batch."""
    out = {}
    for cid in ids:
        hp = CONFIGS[cid]
        adv = E.bipace(batch, **hp)
        out[cid] = {"adv": adv,
                    "pace": (adv.turn - _episode(batch, hp)) / hp.get("step_weight", 1.0)}
    if extra:
        out["gigpo_mean_norm"] = E.gigpo(batch, normalization="mean_norm")
        out["gigpo_steps"] = E.gigpo(batch, episode_weighting="steps")
        out["dr_grpo"] = E.get("dr_grpo")(batch)
        b = segments.local_view(batch)
        out["clusters_wide"] = bipace_mod.cluster_ids(b, tau=0.6)
        out["clusters_wide_merge"] = bipace_mod.cluster_ids(b, tau=0.6, merge_state_keys=True)
    return out


run_all = on_host(jax.jit(functools.partial(_estimate, tuple(CONFIGS), extra=True)))


def add_hidden(draw, rec):
    """Every turn gets a hidden vector: the catalogue direction of its observation (so hidden
    clusters and state keys mostly agree) or a drawn one, times a drawn positive scale."""
    for t in rec["turns"]:
        j = 2 * t["observation"][0] if draw(st.booleans()) else draw(st.integers(0, 7))
        s = draw(st.sampled_from([0.5, 1.0, 3.0]))
        t["turn_extras"] = {"hidden": [s * x for x in CATALOGUE[j]]}


def records(**kw):
    return step_records(extras=add_hidden, **kw)


def rng_records(rng, group_sizes):
    """Deterministic records of the same kind (numpy Generator), for the non-hypothesis
    tests: tiny observation/action alphabets, catalogue hidden vectors; group g holds
    group_sizes[g] trajectories."""
    recs = []
    for g in (g for g, size in enumerate(group_sizes) for _ in range(size)):
        turns = []
        for _ in range(int(rng.integers(1, 5))):
            obs = int(rng.integers(0, 3))
            j = 2 * obs if rng.random() < 0.5 else int(rng.integers(0, 8))
            turns.append({"observation": [obs], "action": [int(rng.integers(0, 2))],
                          "reward": float(rng.choice([-1.0, 0.0, 0.5, 1.0])),
                          "turn_extras": {"hidden": [float(rng.choice([0.5, 3.0])) * x
                                                     for x in CATALOGUE[j]]}})
        recs.append({"group": f"g{g}",
                     "outcome": float(rng.integers(0, 2)), "turns": turns})
    return recs


pack = packer(PAD)


def clusters_of(recs, tau, merge=False):
    """Reference clusters: list of [(record, turn)] lists."""
    trajs = step_ref.parse_steps(recs)
    roots = bipace_ref.union_find_clusters(trajs, tau, merge)
    groups: dict = {}
    for v, r in roots.items():
        groups.setdefault(r, []).append(v)
    return list(groups.values())


def check_partition(labels, recs, index, tau, merge, what):
    """The estimator's cluster labels [N, K] induce exactly the reference partition, and each
    label is the smallest flat index of its cluster."""
    k_pad = labels.shape[1]
    for c in clusters_of(recs, tau, merge):
        flat = sorted(index.traj[i] * k_pad + k for i, k in c)
        got = {int(labels[index.traj[i], k]) for i, k in c}
        assert got == {flat[0]}, f"{what}: cluster {c} has labels {got}, expected {flat[0]}"


# ----------------------------------------------------------------------------- vs reference


def reference_checks(out, recs, index, batch):
    """Every setting against the union-find reference; the estimator's clusters (tau 0.6,
    with and without merged state keys) against the reference partition."""
    return ([("", functools.partial(assert_matches, cid, out[cid]["adv"],
                                    bipace_ref.bipace(recs, **CONFIGS[cid]), index, batch))
             for cid in CONFIGS]
            + [("", functools.partial(check_partition, out["clusters_wide"], recs, index, 0.6,
                                      False, "clusters")),
               ("", functools.partial(check_partition, out["clusters_wide_merge"], recs, index,
                                      0.6, True, "merged clusters"))])


test_matches_reference = reference_test(EX, records(), pack, run_all, reference_checks)


# ----------------------------------------------------------------------------- reductions


def assert_same_tokens(a, b):
    """Two advantages' per-token values agree (to 1e-6)."""
    np.testing.assert_allclose(a.token, b.token, atol=1e-6)


def _same_actions(recs):
    recs = copy.deepcopy(recs)
    for r in recs:
        for t in r["turns"]:
            t["action_key"] = "same"
    return recs


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_tau_above_one_gives_the_episode_term(layout, recs):
    """tau > 1: every cluster is a singleton, so A_PACE = 0 exactly (GiGPO's step term is 0 on
    singleton anchors too) and A is the episode term alone: GiGPO with all anchors distinct
    (here mean_norm: Dr.GRPO)."""
    out = run_all(pack(recs, layout)[0])
    assert (out["none"]["pace"] == 0).all()
    assert_same_tokens(out["none"]["adv"], out["dr_grpo"])
    dist = run_all(pack(unique_keys(recs, "state_key"), layout)[0])
    assert_same_tokens(out["none"]["adv"], dist["gigpo_mean_norm"])


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_merged_keys_with_distinct_actions_is_gigpo(layout, recs):
    """tau > 1 with merge_state_keys: clusters are GiGPO's exact anchor groups; with every
    action distinct Q_hat(c, a) = G, so A_PACE = G - V_hat(c) is GiGPO's step term (mean_norm;
    step_normalize mean_std_norm: its z-score). With one shared action it is 0 instead."""
    out = run_all(pack(unique_keys(recs, "action_key"), layout)[0])
    np.testing.assert_allclose(out["merge_only_std"]["adv"].turn, out["gigpo_steps"].turn,
                               atol=1e-5)
    assert_same_tokens(out["merge_only_mean"]["adv"], out["gigpo_mean_norm"])
    out = run_all(pack(_same_actions(recs), layout)[0])
    assert_same_tokens(out["merge_only_mean"]["adv"], out["dr_grpo"])


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_identical_actions_give_zero_step_term(layout, recs):
    out = run_all(pack(_same_actions(recs), layout)[0])
    for cid in CONFIGS:
        assert (out[cid]["pace"] == 0).all(), cid


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_plain_step_term_sums_to_zero_in_each_cluster(layout, recs):
    """sum over a cluster of (Q_hat(c, a_ik) - V_hat(c)) = sum_a n_ca (Q_hat - V_hat) = 0
    (and the std-scaled version too); singleton clusters are exactly 0."""
    batch, index = pack(recs, layout)
    out = run_all(batch)
    for cid in PLAIN:
        hp = CONFIGS[cid]
        pace = out[cid]["pace"]
        for c in clusters_of(recs, hp.get("tau", 0.9), hp.get("merge_state_keys", False)):
            xs = [pace[index.traj[i], k] for i, k in c]
            assert abs(sum(xs)) <= 1e-4 * len(xs), (cid, c, xs)
            if len(c) == 1:
                assert xs[0] == 0.0, (cid, c)


# ----------------------------------------------------------------------------- invariances


test_layouts_agree = layouts_agree_test(EX, records(), run_all, pack, CONFIGS,
                                        pick=lambda out: out["adv"].turn)


# --------------------------------------------------------------- no gradient into hidden states


GRAD_HP = dict(tau=0.6, merge_state_keys=True)


@jax.jit
def _grads(batch, w):
    """d sum(w * A.token) / d (hidden, turn_rewards)."""
    def loss(h, r):
        b = batch.replace(extras={**batch.extras, "hidden": h}, turn_rewards=r)
        return jnp.sum(w * E.bipace(b, **GRAD_HP).token)

    return jax.grad(loss, argnums=(0, 1))(batch.extras["hidden"], batch.turn_rewards)


def test_no_gradient_into_hidden_states():
    """The hidden states only choose clusters: d loss / d hidden = 0, while the same loss
    does depend on the rewards (so the harness really differentiates)."""
    batch = pack(rng_records(np.random.default_rng(2), [5, 3]), "concatenated")[0]
    w = jnp.asarray(np.random.default_rng(0).normal(size=np.shape(batch.tokens)), jnp.float32)
    gh, gr = jax.tree.map(np.asarray, _grads(batch, w))
    assert (gh == 0).all()
    assert np.isfinite(gr).all() and np.abs(gr).max() > 0
    # two peers in one cluster with distinct actions: A_PACE(0, 0) = G0 - (G0 + G1) / 2, and
    # w picks turn (0, 0)'s only action token, so the loss is A(0, 0)
    uniq = pack(unique_keys([{"group": 0, "outcome": o, "turns": [
        {"observation": [0], "action": [1], "reward": o,
         "turn_extras": {"hidden": [1.0, 0.0, 0.0]}}]} for o in (0.0, 1.0)], "action_key"),
        "concatenated")[0]
    pick = (np.asarray(uniq.row_traj)[:, None] == 0) & np.asarray(uniq.action_mask)
    assert pick.sum() == 1
    _, g0 = _grads(uniq, jnp.asarray(pick, jnp.float32))
    np.testing.assert_allclose(np.asarray(g0)[:2, 0], [0.5, -0.5], atol=1e-6)


# ----------------------------------------------------------------------------- degenerate


@pytest.mark.parametrize("layout", LAYOUTS)
def test_degenerate_inputs(layout):
    one = [{"group": 0, "outcome": 1.0, "turns": [
        {"observation": [1], "action": [1], "reward": 1.0,
         "turn_extras": {"hidden": [0.0, 0.0, 0.0]}}]}]
    out = run_all(pack(one, layout)[0])
    for cid in CONFIGS:
        adv = out[cid]["adv"]
        assert np.isfinite(adv.token).all() and np.isfinite(adv.turn).all(), cid
        assert out[cid]["pace"][0, 0] == 0.0, cid  # singleton cluster
    assert out["plain"]["adv"].turn[0, 0] == 0.0  # singleton task group
    assert out["loo_std"]["adv"].turn[0, 0] == 1.0  # singleton="raw", mean_norm: A_ep = R
    # all equal (same hidden, actions, rewards): exactly 0 everywhere
    same = [copy.deepcopy(one[0]) for _ in range(4)]
    for t in (r["turns"][0] for r in same):
        t["turn_extras"]["hidden"] = [1.0, 2.0, 0.0]
    out = run_all(pack(same, layout)[0])
    for cid in CONFIGS:
        adv = out[cid]["adv"]
        assert (adv.turn == 0).all() and (adv.token == 0).all(), cid
    # equal returns, different actions, one cluster: zero variance -> exactly 0 (no NaN)
    for n, r in enumerate(same):
        r["turns"][0]["action_key"] = n
    out = run_all(pack(same, layout)[0])
    for cid in CONFIGS:
        assert (out[cid]["adv"].turn == 0).all(), cid


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padding_turns_join_no_cluster(layout):
    """Padding turns get the sentinel cluster N K (no valid turn's cluster), merged state keys
    or not. (Credit on an all-padding batch, padding, permutation and shards:
    tests/test_conformance.py.)"""
    b = pack([{"group": 0, "outcome": 1.0, "turns": [
        {"observation": [1], "action": [1], "turn_extras": {"hidden": [1.0, 0.0, 0.0]}}]}],
        layout)[0]
    out = run_all(b)
    tm = np.asarray(b.turn_mask)
    for key in ("clusters_wide", "clusters_wide_merge"):
        assert (out[key][~tm] == b.num_traj * b.num_turns).all(), key
        assert (out[key][tm] < b.num_traj * b.num_turns).all(), key


# ----------------------------------------------------------------------------- hand-built


def _hturn(obs, act, reward, h):
    return {"observation": [obs], "action": [obs], "action_key": act, "reward": reward,
            "turn_extras": {"hidden": h + [0.0]}}


HAND = [  # one task group, three rollouts
    {"group": "t", "outcome": 1.0, "turns": [_hturn(1, "go", 0.0, [1.0, 0.0]),
                                             _hturn(2, "x", 1.0, [0.0, 1.0])]},
    {"group": "t", "outcome": 0.0, "turns": [_hturn(3, "go", 0.0, [2.0, 0.2]),
                                             _hturn(4, "y", 0.0, [0.0, 3.0])]},
    {"group": "t", "outcome": 0.0, "turns": [_hturn(5, "stay", 0.0, [0.9, 0.05])]},
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hand_built_example(layout):
    """gamma = 1, normalize mean_norm, tau = 0.9. Returns G0 = (1, 1), G1 = (0, 0), G2 = (0).
    Episode: mean R = 1/3, A_ep = (2/3, -1/3, -1/3).
    Clusters (cos >= 0.9): A = {(0,0) go G=1, (1,0) go G=0, (2,0) stay G=0} (cosines .995,
    .998, .999), B = {(0,1) x G=1, (1,1) y G=0} (cosine 1); A and B are orthogonal.
    Plain ("plain"): V(A) = 1/3, Q(A, go) = 1/2, Q(A, stay) = 0 -> A_PACE = 1/6, 1/6, -1/3
    (count-weighted sum 2/6 - 1/3 = 0); V(B) = 1/2, distinct actions -> +1/2, -1/2.
      A0 = (2/3 + 1/6, 2/3 + 1/2) = (5/6, 7/6), A1 = (-1/3 + 1/6, -1/3 - 1/2) = (-1/6, -5/6),
      A2 = -1/3 - 1/3 = -2/3.
    Leave-one-out: (0,0): Q_- = 0 (the other go), V_- = mean(0, 0) = 0 -> 0; (1,0): Q_- = 1,
    V_- = mean(1, 0) = 1/2 -> 1/2; (2,0) stay alone: G - V_- = 0 - 1/2; B: (0,1): 1 - 0 = 1,
    (1,1): 0 - 1 = -1. Scaled by the cluster std ("loo_std"; its merge_state_keys and
    singleton="raw" change nothing here: all observations differ, one task group):
    std(A) = sqrt((4/9 + 1/9 + 1/9) / 2) = 1/sqrt(3), std(B) = sqrt(1/2 / 1) = 1/sqrt(2):
      A0 = (2/3 + 0, 2/3 + sqrt 2), A1 = (-1/3 + sqrt(3)/2, -1/3 - sqrt 2),
      A2 = -1/3 - sqrt(3)/2.
    tau > 1 with merged state keys ("merge_only_mean"): every observation differs, so every
    cluster is a singleton and A = A_ep.
    """
    out = run_all(pack(HAND, layout)[0])
    np.testing.assert_allclose(out["plain"]["adv"].turn[:3, :2],
                               [[5 / 6, 7 / 6], [-1 / 6, -5 / 6], [-2 / 3, 0]], atol=1e-6)
    s3, s2 = math.sqrt(3), math.sqrt(2)
    np.testing.assert_allclose(out["loo_std"]["adv"].turn[:3, :2],
                               [[2 / 3, 2 / 3 + s2], [-1 / 3 + s3 / 2, -1 / 3 - s2],
                                [-1 / 3 - s3 / 2, 0]], atol=1e-5)
    np.testing.assert_allclose(out["merge_only_mean"]["adv"].turn[:3, :2],
                               [[2 / 3, 2 / 3], [-1 / 3, -1 / 3], [-1 / 3, 0]], atol=1e-6)


def test_hand_built_merge_joins_similarity_and_state_clusters():
    """tau = 0.6. p and t are similar (cos 1); q and r share an observation; r and s are
    similar (cos .89); every other cosine is <= 0. With merged state keys q - r - s is one
    cluster, through a chain mixing both kinds of link; without, q is alone. Labels are the
    smallest flat index (n K + k, K = 4) of the cluster."""
    def turn(obs, h):
        return {"observation": [obs], "action": [obs], "turn_extras": {"hidden": h + [0.0]}}
    recs = [{"group": 0, "outcome": 0.0, "turns": [turn(1, [1.0, 0.0]), turn(2, [0.0, 1.0])]},
            {"group": 0, "outcome": 0.0, "turns": [turn(2, [-1.0, 0.0]),
                                                   turn(3, [-1.0, -0.5])]},
            {"group": 0, "outcome": 0.0, "turns": [turn(4, [2.0, 0.0])]}]
    batch, index = pack(recs, "concatenated")
    assert index.traj == [0, 1, 2]
    out = run_all(batch)
    pos = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]  # p q r s t -> flat 0 1 4 5 8
    assert [out["clusters_wide_merge"][p] for p in pos] == [0, 1, 1, 1, 0]
    assert [out["clusters_wide"][p] for p in pos] == [0, 1, 4, 4, 0]


# ----------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def with_hidden():
    return pack([{"group": 0, "outcome": 1.0, "turns": [
        {"observation": [1], "action": [1], "turn_extras": {"hidden": [1.0, 0.0]}}]}],
        "concatenated")[0]


@pytest.mark.parametrize("hp,needle", [
    ({"tau": 0.0}, "tau must be > 0"),
    ({"tau": -0.5}, "tau must be > 0"),
    ({"sim_iters": 0}, "sim_iters must be a positive int"),
    ({"sim_iters": 2.5}, "sim_iters must be a positive int"),
    ({"step_normalization": "z"}, "step_normalization must be one of"),
    ({"normalization": "z"}, "normalization must be one of"),
    ({"merge_state_keys": "yes"}, "merge_state_keys must be one of"),
    ({"leave_one_out": None}, "leave_one_out must be one of"),
    ({"gamma": 1.5}, "gamma must lie in"),
    ({"eps": 0.0}, "eps must be > 0"),
    ({"singleton": "one"}, "singleton must be one of"),
    ({"episode_weighting": "tokens"}, "episode_weighting must be one of"),
])
def test_bad_hyper_parameters_name_the_problem(with_hidden, hp, needle):
    with pytest.raises(ValueError, match=needle):
        E.bipace(with_hidden, **hp)


def test_missing_or_misshaped_hidden_names_the_field():
    plain = pack([{"group": 0, "outcome": 1.0, "turns": [{"observation": [1], "action": [1]}]}],
                 "concatenated")[0]
    with pytest.raises(ValueError, match=r"extras\['hidden'\].*\[N, K, D\].*turn_extras.hidden"):
        E.bipace(plain)
    with pytest.raises(ValueError, match=r"extras\['hidden'\]"):
        E.compute("bipace", plain)
    scalar = pack([{"group": 0, "outcome": 1.0, "turns": [
        {"observation": [1], "action": [1], "turn_extras": {"hidden": 0.5}}]}],
        "concatenated")[0]
    with pytest.raises(ValueError, match=r"extras\['hidden'\] must be \[N, K, D\]"):
        E.bipace(scalar)


# ----------------------------------------------------------------------------- segments review


N_SC, K_SC, D_SC = 8, 4, 3
M_SC = N_SC * K_SC


@functools.partial(jax.jit, static_argnames=("iters", "block"))
def _sc(f, scope, valid, tau, iters=8, block=1024):
    return segments.similarity_clusters(f, scope, valid, tau, iters, block)


def _adjacency(f, scope, valid, tau):
    """float64 links of the thresholded cosine graph (no self links)."""
    nrm = np.linalg.norm(f, axis=1)
    ok = valid & (nrm > 0)
    cos = (f @ f.T) / np.maximum(np.outer(nrm, nrm), 1e-300)
    adj = (cos >= tau) & ok[:, None] & ok[None, :] & (scope[:, None] == scope[None, :])
    np.fill_diagonal(adj, False)
    return adj


def uf_partition(adj, valid):
    """Union-find over the links: flat index -> smallest member of its component; M invalid."""
    m = len(adj)
    parent = list(range(m))

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for a, b in zip(*np.nonzero(np.triu(adj))):
        ra, rb = find(int(a)), find(int(b))
        parent[max(ra, rb)] = min(ra, rb)
    return np.array([find(x) if valid[x] else m for x in range(m)])


def max_diameter(adj):
    """Largest shortest-path distance inside any component (BFS from every node)."""
    best = 0
    for s in range(len(adj)):
        dist, frontier, d = {s}, [s], 0
        while frontier:
            nxt = [int(v) for u in frontier for v in np.nonzero(adj[u])[0] if int(v) not in dist]
            nxt = list(dict.fromkeys(nxt))
            if not nxt:
                break
            dist.update(nxt)
            frontier, d = nxt, d + 1
        best = max(best, d)
    return best


def _random_case(rng):
    """Integer features in {-2..2}^3 (some zero vectors), random scopes and validity, and the
    thresholds (of a fixed candidate list) that lie >= 1e-3 from every pairwise cosine."""
    f = rng.integers(-2, 3, size=(N_SC, K_SC, D_SC)).astype(np.float64)
    f[rng.random((N_SC, K_SC)) < 0.05] = 0.0
    scope = rng.integers(0, 3, size=N_SC)
    valid = rng.random((N_SC, K_SC)) < 0.85
    flat = f.reshape(-1, D_SC)
    nrm = np.linalg.norm(flat, axis=1)
    ok = nrm > 0
    cos = (flat[ok] @ flat[ok].T) / np.outer(nrm[ok], nrm[ok])
    taus = [t for t in (0.2, 0.45, 0.62, 0.75, 0.85, 0.93) if np.abs(cos - t).min() >= 1e-3]
    return f, scope, valid, taus


def test_similarity_clusters_match_union_find():
    """segments.similarity_clusters (default 8 rounds) against union-find on random features
    (thresholds away from every cosine), in one and in several row blocks, wherever every
    component has diameter <= 8 (exact by its docstring; the others are counted, not
    compared): labels are the smallest flat index of the component, M for invalid turns."""
    rng = np.random.default_rng(11)
    checked = skipped = 0
    for _ in range(12):
        f, scope, valid, taus = _random_case(rng)
        scope_nk = np.broadcast_to(scope[:, None], (N_SC, K_SC))
        for tau in taus:
            adj = _adjacency(f.reshape(M_SC, D_SC), scope_nk.reshape(-1), valid.reshape(-1),
                             tau)
            if max_diameter(adj) > 8:
                skipped += 1
                continue
            exp = uf_partition(adj, valid.reshape(-1))
            for block in (1024, 5):
                got = np.asarray(_sc(jnp.asarray(f, jnp.float32), jnp.asarray(scope),
                                     jnp.asarray(valid), tau, block=block)).reshape(-1)
                np.testing.assert_array_equal(got, exp, err_msg=f"tau={tau} block={block}")
            checked += 1
    assert checked >= 30 and skipped <= checked // 4, (checked, skipped)


def test_similarity_cluster_partition_is_invariant_to_permuting_rows():
    rng = np.random.default_rng(5)
    done = 0
    while done < 6:
        f, scope, valid, taus = _random_case(rng)
        tau = taus[len(taus) // 2]
        scope_nk = np.broadcast_to(scope[:, None], (N_SC, K_SC)).reshape(-1)
        if max_diameter(_adjacency(f.reshape(M_SC, D_SC), scope_nk, valid.reshape(-1),
                                   tau)) > 8:
            continue
        perm = rng.permutation(M_SC)
        base = np.asarray(_sc(jnp.asarray(f, jnp.float32), jnp.asarray(scope_nk.reshape(
            N_SC, K_SC)), jnp.asarray(valid), tau)).reshape(-1)
        fp = f.reshape(M_SC, D_SC)[perm].reshape(N_SC, K_SC, D_SC)
        sp = scope_nk[perm].reshape(N_SC, K_SC)
        vp = valid.reshape(-1)[perm].reshape(N_SC, K_SC)
        got = np.asarray(_sc(jnp.asarray(fp, jnp.float32), jnp.asarray(sp), jnp.asarray(vp),
                             tau)).reshape(-1)
        np.testing.assert_array_equal(base[perm][:, None] == base[perm][None, :],
                                      got[:, None] == got[None, :])
        done += 1


def _path(order, m=M_SC):
    """Path order[0] - order[1] - ... as (features, scope, valid) of shape (8, 4, .): node
    order[j] (a flat index) at angle 10 j degrees, so with tau = cos 15 deg only path
    neighbours link; the other flat positions are invalid."""
    f = np.zeros((m, D_SC))
    valid = np.zeros(m, bool)
    for j, node in enumerate(order):
        f[node, :2] = [math.cos(math.radians(10 * j)), math.sin(math.radians(10 * j))]
        valid[node] = True
    return (jnp.asarray(f.reshape(N_SC, K_SC, D_SC), jnp.float32),
            jnp.zeros((N_SC,), jnp.int32), jnp.asarray(valid.reshape(N_SC, K_SC)))


PATH_TAU = math.cos(math.radians(15))
# A path of 8 nodes (diameter 7) whose flat indices are ordered so that pointer jumping never
# helps: min-label propagation then needs 7 rounds, one per hop (found by exhaustive search).
SLOW_PATH = (0, 3, 4, 2, 5, 6, 7, 1)


def test_similarity_clusters_exact_when_diameter_at_most_iters():
    """The documented guarantee: a component of diameter <= iters is exact whatever the order
    of its flat indices (random orders of a 9-node path, iters = 8; the slow 8-node path)."""
    rng = np.random.default_rng(0)
    for _ in range(100):
        order = [int(x) for x in rng.permutation(M_SC)[:9]]
        got = np.asarray(_sc(*_path(order), PATH_TAU)).reshape(-1)
        assert (got[order] == min(order)).all(), order
    got = np.asarray(_sc(*_path(SLOW_PATH), PATH_TAU)).reshape(-1)
    assert (got[list(SLOW_PATH)] == 0).all()


def test_similarity_clusters_converge_in_log_rounds():
    got = np.asarray(_sc(*_path(SLOW_PATH), PATH_TAU, iters=3)).reshape(-1)
    assert (got[list(SLOW_PATH)] == 0).all(), got[list(SLOW_PATH)]  # 2^3 = 8 > diameter 7


def _points(vectors):
    f = np.zeros((M_SC, D_SC))
    f[:len(vectors)] = vectors
    valid = np.arange(M_SC) < len(vectors)
    return (jnp.asarray(f.reshape(N_SC, K_SC, D_SC), jnp.float32),
            jnp.zeros((N_SC,), jnp.int32), jnp.asarray(valid.reshape(N_SC, K_SC)))


def test_zero_vectors_are_singletons_for_positive_thresholds():
    """What bipace relies on (it requires tau > 0): a zero vector links to nothing."""
    got = np.asarray(_sc(*_points([[0, 0, 0], [0, 0, 0], [1, 0, 0], [2, 0, 0]]), 1e-3))
    assert list(got.reshape(-1)[:4]) == [0, 1, 2, 2]


def test_zero_vector_links_to_nothing_for_any_threshold():
    got = np.asarray(_sc(*_points([[0, 0, 0], [1, 0, 0], [-1, 0, 0]]), -0.5))
    assert list(got.reshape(-1)[:3]) == [0, 1, 2], got.reshape(-1)[:3]


def test_merge_partitions_matches_union_find():
    """bipace._merge_partitions (exact union of two partitions) against union-find."""
    rng = np.random.default_rng(3)
    f = jax.jit(bipace_mod._merge_partitions)
    m = 24
    for _ in range(30):
        valid = rng.random(m) < 0.9
        a_raw = rng.integers(0, 8, size=m)
        b_raw = rng.integers(0, 10, size=m)
        a = np.array([min(j for j in range(m) if a_raw[j] == a_raw[i] and valid[j])
                      if valid[i] else m for i in range(m)])  # A as min-index labels
        b = np.where(valid, b_raw, m)  # B as arbitrary ids
        adj = (valid[:, None] & valid[None, :]
               & ((a_raw[:, None] == a_raw[None, :]) | (b_raw[:, None] == b_raw[None, :])))
        np.fill_diagonal(adj, False)
        exp = uf_partition(adj, valid)
        got = np.asarray(f(jnp.asarray(a.reshape(4, 6), jnp.int32),
                           jnp.asarray(b.reshape(4, 6), jnp.int32),
                           jnp.asarray(valid.reshape(4, 6)))).reshape(-1)
        np.testing.assert_array_equal(got, exp)
