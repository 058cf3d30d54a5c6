"""G2PO, GraphGPO and GAGPO (estimators/graph.py).

Compared with the dictionary-of-groups references of tests/reference/graph_ref.py (distances
by BFS from SUCCESS, states as Python values) on batches whose states collide
(tests.strategies.step_records), in both layouts; then the methods' own properties: G2PO's
no-merge reduction and zero-mean edges, GraphGPO's distance ordering, all-failed and
all-singleton reductions to GRPO, GAGPO's lam limits (lam = 1: G - V_hat, the GiGPO residual;
lam = 0: G2PO's TD error) and zero-mean groups; layout invariance; degenerate groups;
hand-worked examples; error messages. Padding, permutation and shard invariance and
degenerate batches: tests/test_conformance.py (with the settings of each name's row).

Compile budget: every setting in CONFIGS runs in ONE jitted program per batch shape.
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
from jaxrl_agent.batch import LAYOUTS
from jaxrl_agent.estimators.graph import graph_distances
from tests.reference import graph_ref
from tests.reference.step_ref import parse_steps
from tests.families import (assert_matches, layouts_agree_test, on_host, packer, reference_test,
                            unique_keys)
from tests.strategies import PAD, step_records

EX = settings(max_examples=20, deadline=None)

CONFIGS = {
    "g2po": ("g2po", {}),
    "g2po_none": ("g2po", dict(normalization="none")),
    "g2po_batch_ep": ("g2po", dict(normalization="batch", episode_weight=0.5, gamma=0.8,
                                   episode_weighting="steps", eps=1e-4)),
    "graphgpo": ("graphgpo", {}),
    "graphgpo_half": ("graphgpo", dict(omega=0.5, success_reward=1.0)),
    "graphgpo_half_graph": ("graphgpo", dict(omega=0.5, success_reward=1.0,
                                             episode_weight=0.0)),
    "graphgpo_paper": ("graphgpo", dict(convention="paper", omega=0.5, success_reward=1.0,
                                        episode_weight=0.0)),
    "graphgpo_any": ("graphgpo", dict(episode_weight=0.0, omega=0.3, success_threshold=0.0)),
    "graphgpo_iters1": ("graphgpo", dict(max_iters=1, graph_weight=2.0,
                                         episode_weighting="steps")),
    "gagpo": ("gagpo", {}),
    "gagpo_half_none": ("gagpo", dict(normalization="none", lam=0.5)),
    "gagpo_half": ("gagpo", dict(lam=0.5)),
    "gagpo_lam1": ("gagpo", dict(normalization="none", lam=1.0)),
    "gagpo_lam0": ("gagpo", dict(normalization="none", lam=0.0)),
    "gagpo_batch": ("gagpo", dict(normalization="batch", gamma=0.9, lam=0.7, eps=1e-3)),
    # cross-checks against other estimators of the library (same batch, same program)
    "gigpo_residual": ("step_group", dict(key="state", normalization="mean_norm", episode_weight=0.0)),
    "grpo": ("grpo", {}),
}
OWN = [c for c, (name, _) in CONFIGS.items() if name in graph_ref.REFERENCES]
# graph_distances(batch, outcome >= threshold, max_iters) in the same program
DISTANCES = {"dist": (0.5, None), "dist_any": (0.0, None), "dist_cut1": (0.5, 1),
             "dist_cut2": (0.5, 2)}
FIELDS = ("token", "turn", "turn_returns")


def _estimate(ids, batch, distances=True):
    out = {cid: E.get(CONFIGS[cid][0])(batch, **CONFIGS[cid][1]) for cid in ids}
    if distances:
        for name, (thr, cut) in DISTANCES.items():
            out[name] = graph_distances(batch, batch.outcome >= thr, cut)
    return out


run_all = on_host(jax.jit(functools.partial(_estimate, tuple(CONFIGS))))
pack = packer(PAD)


def check(cid, adv, recs, index, batch):
    name, hp = CONFIGS[cid]
    assert_matches(cid, adv, graph_ref.REFERENCES[name](recs, **hp), index, batch, FIELDS)


def rng_records(seed, num_groups=6, max_size=4):
    """Deterministic records: groups of 1..max_size rollouts of 1-4 turns over three states
    (so states merge), binary outcomes placed as the last turn's reward."""
    rng = np.random.default_rng(seed)
    recs = []
    for g in range(num_groups):
        for _ in range(int(rng.integers(1, max_size + 1))):
            outcome = float(rng.integers(0, 2))
            turns = [{"observation": [int(rng.integers(0, 3))],
                      "action": [int(x) for x in rng.integers(0, 2, rng.integers(1, 3))]}
                     for _ in range(int(rng.integers(1, 5)))]
            recs.append({"group": f"g{g}", "outcome": outcome, "turns": turns})
    return recs


def per_turn(adv_turn, index, recs):
    """[record][turn] values out of an [N, K] array."""
    return [adv_turn[index.traj[i], :len(r["turns"])] for i, r in enumerate(recs)]


# ----------------------------------------------------------------------------- (1) reference


test_matches_reference = reference_test(
    EX, step_records(), pack, run_all,
    lambda out, recs, index, batch: [("", functools.partial(check, cid, out[cid], recs, index,
                                                            batch)) for cid in OWN])


# ----------------------------------------------------------------------------- (2) properties


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=step_records(), terminal_only=st.booleans())
def test_no_merging_gives_zero_td_and_gae(layout, recs, terminal_only):
    """Every state distinct: V(s_k) = G_k, so G2PO's delta and GAGPO's GAE are exactly 0 (the
    reduction test of ``g2po``'s docstring, stated for terminal-only rewards and gamma = 1; it
    holds for any rewards and gamma, bit for bit, because delta is computed from the residuals
    V - G). With
    the original (colliding) states the same settings are not all 0 whenever a merged state
    has different returns, so the check can fail."""
    if terminal_only:
        recs = copy.deepcopy(recs)
        for r in recs:
            for t in r["turns"][:-1]:
                t["reward"] = 0.0
    out = run_all(pack(unique_keys(recs), layout)[0])
    for cid in ("g2po", "g2po_none", "gagpo", "gagpo_half_none", "gagpo_half", "gagpo_lam1",
                "gagpo_lam0", "gagpo_batch"):  # exact, gamma = 0.9 (gagpo_batch) too
        assert (out[cid].turn == 0).all() and (out[cid].token == 0).all(), cid
    # every source state a singleton: A_graph = 0, so GraphGPO is GRPO (beta_ep = 1)
    for cid in ("graphgpo", "graphgpo_half"):
        np.testing.assert_array_equal(out[cid].token, out["grpo"].token, err_msg=cid)
        np.testing.assert_array_equal(out[cid].turn, out["grpo"].turn, err_msg=cid)
    for cid in ("graphgpo_any", "graphgpo_half_graph", "graphgpo_paper"):
        assert (out[cid].turn == 0).all(), cid


def test_merging_makes_td_nonzero():
    """The no-merging test's counterpart: a shared state with different returns."""
    recs = [{"group": 0, "outcome": 1.0, "turns": [{"observation": [1], "action": [1]},
                                                   {"observation": [2], "action": [1]}]},
            {"group": 0, "outcome": 0.0, "turns": [{"observation": [1], "action": [2]},
                                                   {"observation": [3], "action": [1]}]}]
    out = run_all(pack(recs, "concatenated")[0])
    for cid in ("g2po", "g2po_none", "gagpo", "gagpo_lam1", "graphgpo_half_graph"):
        assert np.abs(out[cid].turn).max() > 0.1, cid


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=step_records())
def test_zero_mean_after_normalisation(layout, recs):
    """G2PO's and GAGPO's normalised terms have zero mean over each task group's turns
    ("group") or over the batch ("batch"); and unit sample std where the values differ."""
    batch, index = pack(recs, layout)
    out = run_all(batch)
    groups = {}
    for i, r in enumerate(recs):
        for k in range(len(r["turns"])):
            groups.setdefault(r["group"], []).append((index.traj[i], k))
    for cid in ("g2po", "gagpo"):
        t = out[cid].turn
        for members in groups.values():
            xs = np.array([t[p] for p in members], np.float64)
            assert abs(xs.sum()) <= 1e-4 * len(xs), (cid, xs)
            if len(xs) > 1 and np.abs(xs).max() > 0.1:  # std s / (s + eps) <= 1
                assert 0.98 < xs.std(ddof=1) < 1.0 + 1e-4, (cid, xs)
    # g2po_batch_ep = batch-normalised TD + 0.5 * A_ep with steps weighting; that episode
    # term sums to 0 over turns too (trajectory i counted K_i times in its group's mean)
    td = out["g2po_batch_ep"].turn
    assert abs(td[np.asarray(batch.turn_mask)].sum()) <= 1e-4 * 32
    assert abs(out["gagpo_batch"].turn.sum()) <= 1e-4 * 32


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=step_records())
def test_gagpo_lambda_limits(layout, recs):
    """GAE limits: lam = 1 gives G - V_hat(s) (= the GiGPO step residual, mean_norm, no episode
    term); lam = 0 gives the TD error delta (= G2PO before normalisation)."""
    batch, index = pack(recs, layout)
    out = run_all(batch)
    np.testing.assert_allclose(out["gagpo_lam1"].turn, out["gigpo_residual"].turn, atol=2e-5)
    np.testing.assert_allclose(out["gagpo_lam0"].turn, out["g2po_none"].turn, atol=2e-5)
    # and straight from the definitions (float64): G - V_hat with gamma = 1
    trajs = parse_steps(recs)
    gs, v, _ = graph_ref.grouped_values(trajs, 1.0)
    got = per_turn(out["gagpo_lam1"].turn, index, recs)
    for i in range(len(recs)):
        np.testing.assert_allclose(got[i], np.subtract(gs[i], v[i]), atol=2e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=step_records())
def test_graph_distances_match_bfs(layout, recs):
    """d(next) of every turn equals the reference's BFS distance (unreachable: max_finite + 1),
    with exact and truncated (``max_iters``) Bellman-Ford."""
    batch, index = pack(recs, layout)
    out = run_all(batch)
    for name, cut in (("dist", None), ("dist_cut1", 1), ("dist_cut2", 2)):
        check_distances(recs, index, *out[name], cut)


def check_distances(recs, index, d, has, cut):
    trajs = parse_steps(recs)
    for g in {t.group for t in trajs}:
        members = [i for i, t in enumerate(trajs) if t.group == g]
        if not any(trajs[i].outcome >= 0.5 for i in members):
            assert not np.asarray(has)[[index.traj[i] for i in members]].any()
            continue
        edges, occ = [], []
        for i in members:
            tr = trajs[i]
            end = graph_ref.SUCCESS if tr.outcome >= 0.5 else graph_ref._dead_end(g)
            for k, t in enumerate(tr.turns):
                nxt = ("s", tr.turns[k + 1].state) if k + 1 < len(tr.turns) else end
                edges.append((("s", t.state), nxt))
                occ.append((i, k))
        dist = graph_ref.distances_to_success(edges, cut)
        for (i, k), (_, nxt) in zip(occ, edges):
            assert d[index.traj[i], k] == dist[nxt], (i, k, d[index.traj[i], k], dist[nxt])


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=step_records())
def test_graph_term_orders_edges_by_distance(layout, recs):
    """Within a source state: a smaller d(next) gives a strictly larger A_graph, equal d equal
    A_graph, and a transition into SUCCESS (d = 0) the largest."""
    batch, index = pack(recs, layout)
    res = run_all(batch)
    out = res["graphgpo_any"].turn  # success_threshold 0, omega 0.3, no episode term
    d = res["dist_any"][0]
    trajs = parse_steps(recs)
    by_src = {}
    for i, tr in enumerate(trajs):
        for k, t in enumerate(tr.turns):
            by_src.setdefault((tr.group, t.state), []).append((index.traj[i], k))
    for members in by_src.values():
        for p in members:
            for q in members:
                if d[p] < d[q]:
                    assert out[p] > out[q], (p, q, d[p], d[q], out[p], out[q])
                elif d[p] == d[q]:
                    assert out[p] == out[q]
            if d[p] == 0:
                assert out[p] == max(out[q] for q in members)


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=step_records())
def test_groups_without_success_get_exactly_grpo(layout, recs):
    """A group in which no trajectory succeeded has A_graph = 0 exactly, so GraphGPO = GRPO
    there; with every outcome a failure the whole batch is GRPO, bit for bit."""
    batch, index = pack(recs, layout)
    out = run_all(batch)
    for i, r in enumerate(recs):
        if not any(s["outcome"] >= 0.5 for s in recs if s["group"] == r["group"]):
            n = index.traj[i]
            np.testing.assert_array_equal(out["graphgpo"].turn[n], out["grpo"].turn[n])
    failed = [dict(r, outcome=min(r["outcome"], 0.25)) for r in recs]
    out = run_all(pack(failed, layout)[0])
    np.testing.assert_array_equal(out["graphgpo"].token, out["grpo"].token)
    np.testing.assert_array_equal(out["graphgpo"].turn, out["grpo"].turn)


@pytest.mark.parametrize("seed", [0, 1])
def test_arbitrary_key_values(seed):
    """Any uint32 state key works, the sentinel-like 0 and 2^32 - 1 included, and equal keys in
    different task groups stay apart: remapping the keys injectively changes nothing, and
    giving every group the same three key values changes nothing either."""
    recs = rng_records(seed, num_groups=2)
    batch, _ = pack(recs, "per_step")
    out = run_all(batch)
    keys = np.asarray(batch.state_keys)
    tm = np.asarray(batch.turn_mask)
    values = np.array([0, 0xFFFFFFFF, 0x80000000, 1, 7], np.uint32)
    uniq = {int(k) for k in keys[tm]}
    per_group = {}
    new = keys.copy()
    gid = np.asarray(batch.group_ids)
    for n, k in zip(*np.nonzero(tm)):
        table = per_group.setdefault(int(gid[n]), {})
        new[n, k] = values[table.setdefault(int(keys[n, k]), len(table))]
    assert len(uniq) <= 2 * len(values)
    out2 = run_all(batch.replace(state_keys=new))
    for cid in CONFIGS:
        np.testing.assert_array_equal(out2[cid].turn, out[cid].turn, err_msg=cid)
    for name in DISTANCES:
        np.testing.assert_array_equal(out2[name][0], out[name][0], err_msg=name)


# ----------------------------------------------------------------------------- (3) layouts


test_layouts_agree = layouts_agree_test(EX, step_records(), run_all, pack, OWN)


# ----------------------------------------------------------------------------- (4) degenerate


@pytest.mark.parametrize("layout", LAYOUTS)
def test_degenerate_inputs(layout):
    """One trajectory of one turn: every term is a singleton, so all outputs are 0 (G2PO's and
    GAGPO's unnormalised delta is r - G = 0 too). Four identical trajectories: exactly 0. A
    loop: finite, with BFS distances. (All-padding batches: tests/test_conformance.py.)"""
    one = [{"group": 0, "outcome": 1.0, "turns": [
        {"observation": [1], "action": [1], "reward": 1.0}]}]
    out = run_all(pack(one, layout)[0])
    for cid in OWN:
        assert (out[cid].turn == 0).all() and (out[cid].token == 0).all(), cid
    same = [{"group": 0, "outcome": 1.0, "turns": [
        {"observation": [1], "action": [1], "reward": 0.5},
        {"observation": [2], "action": [1, 0], "reward": 0.5}]} for _ in range(4)]
    out = run_all(pack(same, layout)[0])
    for cid in OWN:
        assert (out[cid].turn == 0).all() and (out[cid].token == 0).all(), cid
    # a loop (A -> A -> success): finite, distance 0 from the last turn, 1 from the first
    loop = [{"group": 0, "outcome": 1.0, "turns": [
        {"observation": [1], "action": [1]}, {"observation": [1], "action": [2]}]},
        {"group": 0, "outcome": 0.0, "turns": [{"observation": [1], "action": [3]}]}]
    out = run_all(pack(loop, layout)[0])
    d = out["dist"][0]
    assert d[0, 0] == 1 and d[0, 1] == 0 and d[1, 0] == 2  # dead end: max_finite 1, + 1
    for cid in CONFIGS:
        assert np.isfinite(out[cid].token).all(), cid


# ----------------------------------------------------------------------------- (5) by hand


def _hand_records():
    """One task, three rollouts, gamma = 1, terminal rewards only:
    T0: A -> B -> end, rewards (0, 1), outcome 1;  T1: A -> B -> end, (0, 0), 0;
    T2: A -> C -> end, (0, 0), 0."""
    def rec(states, rewards, outcome):
        return {"group": "t", "outcome": outcome, "turns": [
            {"observation": [s], "action": [7], "reward": r} for s, r in zip(states, rewards)]}
    return [rec([1, 2], [0.0, 1.0], 1.0), rec([1, 2], [0.0, 0.0], 0.0),
            rec([1, 3], [0.0, 0.0], 0.0)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hand_built_g2po_and_gagpo(layout):
    """G = T0 (1, 1), T1 (0, 0), T2 (0, 0): V(A) = 1/3, V(B) = 1/2, V(C) = 0.
    delta = r + V(s') - V(s):  T0 (1/2 - 1/3, 1 - 1/2) = (1/6, 1/2);  T1 (1/6, -1/2);
    T2 (0 - 1/3, 0 - 0) = (-1/3, 0). Mean 0, sum of squares 24/36, std = sqrt(2/15).
    GAGPO lam = 1/2: A_k = delta_k + (1/2) A_{k+1}: T0 (1/6 + 1/4, 1/2) = (5/12, 1/2);
    T1 (1/6 - 1/4, -1/2) = (-1/12, -1/2); T2 (-1/3, 0). Mean 0, sum of squares 114/144,
    std = sqrt(114/720). turn_returns = A + V(s): T0 (3/4, 1), T1 (1/4, 0), T2 (0, 0)."""
    out = run_all(pack(_hand_records(), layout)[0])
    delta = np.array([[1 / 6, 1 / 2], [1 / 6, -1 / 2], [-1 / 3, 0.0]])
    np.testing.assert_allclose(out["g2po_none"].turn[:3, :2], delta, atol=1e-6)
    np.testing.assert_allclose(out["g2po"].turn[:3, :2], delta / (np.sqrt(2 / 15) + 1e-6),
                               atol=1e-5)
    gae = np.array([[5 / 12, 1 / 2], [-1 / 12, -1 / 2], [-1 / 3, 0.0]])
    half = out["gagpo_half_none"]  # lam = 0.5, not normalised
    np.testing.assert_allclose(half.turn[:3, :2], gae, atol=1e-6)
    np.testing.assert_allclose(half.turn_returns[:3, :2],
                               [[0.75, 1.0], [0.25, 0.0], [0.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(out["gagpo_half"].turn[:3, :2],
                               gae / (np.sqrt(114 / 720) + 1e-6), atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hand_built_graphgpo(layout):
    """T0 succeeds: A -> B -> SUCCESS. T1 fails: A -> C -> dead end. T2 fails: C -> B -> dead.
    Distances: SUCCESS 0, B 1, A 2 (A -> B -> S), C 2 (C -> B -> S); dead end unreachable ->
    max_finite + 1 = 3. omega = 1/2, R_succ = 1: q = omega^d(next):
      T0: A->B 1/2, B->S 1;  T1: A->C 1/4, C->dead 1/8;  T2: C->B 1/2, B->dead 1/8.
    Source A: {1/2, 1/4}: deviations +-1/8, std (ddof 1) = sqrt2/8, z = +-1/sqrt2.
    Source B: {1, 1/8}: +-7/16 over 7 sqrt2/16;  source C: {1/8, 1/2}: the same +-1/sqrt2.
    Episode term: outcomes (1, 0, 0), mean 1/3, std sqrt(1/3): A_ep = (2/sqrt3, -1/sqrt3, ...).
    The paper convention multiplies every q by omega: same z up to eps."""
    recs = [{"group": 0, "outcome": 1.0, "turns": [{"observation": [1], "action": [1]},
                                                   {"observation": [2], "action": [1]}]},
            {"group": 0, "outcome": 0.0, "turns": [{"observation": [1], "action": [2]},
                                                   {"observation": [3], "action": [1]}]},
            {"group": 0, "outcome": 0.0, "turns": [{"observation": [3], "action": [2]},
                                                   {"observation": [2], "action": [2]}]}]
    out = run_all(pack(recs, layout)[0])
    np.testing.assert_array_equal(out["dist"][0][:3, :2], [[1, 0], [2, 3], [1, 3]])
    sign = np.array([[1, 1], [-1, -1], [1, -1]])
    za, zb = 1 / 8 / (np.sqrt(2) / 8 + 1e-6), 7 / 16 / (7 * np.sqrt(2) / 16 + 1e-6)
    z = sign * np.array([[za, zb], [za, za], [za, zb]])
    np.testing.assert_allclose(out["graphgpo_half_graph"].turn[:3, :2], z, atol=1e-5)
    ep = np.array([2, -1, -1]) / np.sqrt(3) * (np.sqrt(1 / 3) / (np.sqrt(1 / 3) + 1e-6))
    np.testing.assert_allclose(out["graphgpo_half"].turn[:3, :2], z + ep[:, None], atol=1e-5)
    np.testing.assert_allclose(out["graphgpo_paper"].turn[:3, :2], z, atol=1e-4)


# ----------------------------------------------------------------------------- (6) errors


@pytest.mark.parametrize("name,hp,needle", [
    ("g2po", {"normalization": "task"}, "normalization must be one of"),
    ("g2po", {"gamma": 1.5}, "gamma must lie in"),
    ("g2po", {"episode_weighting": "turns"}, "episode_weighting must be one of"),
    ("g2po", {"eps": 0.0}, "eps must be > 0"),
    ("graphgpo", {"omega": 1.5}, "omega must lie in"),
    ("graphgpo", {"success_reward": 0.0}, "success_reward must be > 0"),
    ("graphgpo", {"convention": "eq4"}, "convention must be one of"),
    ("graphgpo", {"max_iters": 0}, "max_iters must be None or a positive int"),
    ("graphgpo", {"max_iters": 2.5}, "max_iters must be None or a positive int"),
    ("graphgpo", {"episode_weighting": "x"}, "episode_weighting must be one of"),
    ("gagpo", {"lam": -0.1}, "lam must lie in"),
    ("gagpo", {"normalization": "token"}, "normalization must be one of"),
    ("gagpo", {"eps": -1.0}, "eps must be > 0"),
])
def test_errors_name_the_problem(one_turn_batch, name, hp, needle):
    with pytest.raises(ValueError, match=needle):
        E.get(name)(one_turn_batch, **hp)


def test_no_extras_needed(one_turn_batch):
    """The three estimators read only the core batch fields (state_keys, rewards, outcome):
    a batch without any extras works."""
    assert not one_turn_batch.extras
    out = run_all(one_turn_batch)
    for cid in OWN:
        assert np.isfinite(out[cid].token).all(), cid
    assert set(graph_ref.REFERENCES) <= set(E.names())
