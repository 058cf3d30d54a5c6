"""Tests of the rollout-tree estimators: rtmc (RTMC), tree_value (TreePS-RAG / SPO-tree / TEMPO /
TreeMem) and progpo (ProGPO).

Compile budget: every setting in ``GROUPS`` (plus the internal term dictionaries and the
comparison estimators of ``HELPER_GROUPS``) runs inside ONE jitted program per batch shape
(``run_all``); settings that differ only in numeric hyper-parameters share one vmapped call.
Batches use the fixed ``PAD`` buckets of ``tests/strategies.py``. References:
``tests/reference/tree_ref.py`` (dict-of-history loops in float64) with per-record float32
tolerances. Padding, permutation and shard invariance and degenerate batches:
tests/test_conformance.py (with the settings of each name's row).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_agent import estimators as E
from jaxrl_agent import segments
from jaxrl_agent.batch import LAYOUTS
from jaxrl_agent.estimators import tree as T
from tests.reference import step_ref
from tests.reference import tree_ref as ref
from tests.reference.estimators_ref import place
from tests.families import (assert_padding_zero, assert_same_records, packer, per_record,
                            shapes_of)
from tests.strategies import PAD, step_records

FIELDS = ("token", "turn")


# ----------------------------------------------------------------------------- configurations
#
# Settings are grouped by their structural (static) hyper-parameters; inside a group the
# numeric ones (kappa, gamma, weights, prior_std) are traced and vmapped, so a group costs one
# compile however many numeric settings it holds.

GROUPS = [  # (estimator, static hyper-parameters, {setting id: numeric hyper-parameters})
    ("rtmc", {}, {"rtmc": {}, "rtmc_k0": {"kappa": 0.0}, "rtmc_tiny": {"kappa": 1e-4},
                  "rtmc_big": {"kappa": 1e6},
                  "rtmc_ep": {"kappa": 0.5, "gamma": 0.9, "episode_weight": 0.5}}),
    ("rtmc", {"signature": "state", "target": "outcome", "normalization": "mean_norm",
              "episode_weighting": "steps"},
     {"rtmc_state_k0": {"kappa": 0.0}, "rtmc_state": {"kappa": 2.0},
      "rtmc_state_ep": {"kappa": 0.5, "episode_weight": 0.5}}),
    ("tree_value", {}, {"tree": {}, "tree_proc": {"episode_weight": 0.0},
                        "tree_grpo": {"step_weight": 0.0}}),
    ("tree_value", {"baseline": "siblings"}, {"tree_sib": {"episode_weight": 0.0}}),
    ("tree_value", {"child": "action", "normalization": "mean_norm", "episode_weighting": "steps"},
     {"tree_act": {"step_weight": 0.5}}),
    ("progpo", {}, {"progpo": {}}),
    ("progpo", {"max_depth": 1, "terminal": "td", "prefix_normalization": "mean_std_norm",
                "singleton": "raw"},
     {"progpo_td": {"gamma": 0.9, "prior_std": 1.0},
      "progpo_nt": {"gamma": 0.95, "transition_weight": 0.0}}),
    ("progpo", {"max_depth": 0, "normalization": "mean_norm"},
     {"progpo_d0": {"prefix_weight": 0.0, "transition_weight": 0.5},
      "progpo_nt_mn": {"transition_weight": 0.0, "prefix_weight": 0.5}}),
]
# Estimators of other modules that the reductions are compared with (no reference here).
HELPER_GROUPS = [
    ("grpo", {}, {"grpo": {}}),
    ("dr_grpo", {}, {"dr_grpo": {}}),
    ("step_group", {"key": "history", "singleton": "raw"}, {"step_hist": {"gamma": 0.95}}),
    ("step_group", {"key": "history", "normalization": "mean_norm"},
     {"step_hist_mn": {"step_weight": 0.5}}),
]


@dataclasses.dataclass(frozen=True)
class Config:
    id: str
    name: str
    hp: dict


CFG = {cid: Config(cid, name, {**static, **num})
       for name, static, settings_ in GROUPS + HELPER_GROUPS for cid, num in settings_.items()}
OWN = tuple(cid for _, _, s in GROUPS for cid in s)
TERMS = {  # internal pieces, for the invariants (the numeric values of the named settings)
    "progpo": lambda b: T._progpo_terms(b, gamma=1.0, max_depth=2, prior_std=0.5,
                                        terminal="outcome", prefix_normalization="mean_norm",
                                        eps=1e-6),
    "progpo_td": lambda b: T._progpo_terms(b, gamma=0.9, max_depth=1, prior_std=1.0,
                                           terminal="td", prefix_normalization="mean_std_norm",
                                           eps=1e-6),
    "tree": lambda b: T._tree_terms(b, child="history", baseline="parent"),
    "tree_act": lambda b: T._tree_terms(b, child="action", baseline="parent"),
    "rtmc_k0": lambda b: T._rtmc_terms(b, kappa=0.0, signature="history", target="return",
                                       gamma=1.0),
}


def _call_group(name, static, settings_, batch, axis_name):
    fn = E.get(name)
    keys = sorted({k for num in settings_.values() for k in num})
    if not keys:
        return {cid: fn(batch, axis_name=axis_name, **static) for cid in settings_}
    defaults = E.spec(name).hyper_params
    vals = {k: jnp.asarray([float(num.get(k, defaults[k])) for num in settings_.values()],
                           jnp.float32) for k in keys}
    out = jax.vmap(lambda v: fn(batch, axis_name=axis_name, **static, **v))(vals)
    return {cid: jax.tree.map(lambda x, j=j: x[j], out) for j, cid in enumerate(settings_)}


def _estimate(groups, terms, batch, axis_name=None):
    out = {}
    for name, static, settings_ in groups:
        out.update(_call_group(name, static, settings_, batch, axis_name))
    if terms:
        b = segments.local_view(batch, axis_name)
        out["terms"] = {k: f(b) for k, f in TERMS.items()}
    return out


# LLVM optimisation off: the programs are tiny, and compiling them dominates the test time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
_run_all_jit = jax.jit(functools.partial(_estimate, GROUPS + HELPER_GROUPS, True),
                       compiler_options=FAST_COMPILE)


def run_all(batch):
    return jax.tree.map(np.asarray, _run_all_jit(batch))


pack = packer(PAD, validate=True)


def reference(cid, records):
    c = CFG[cid]
    return ref.REFERENCES[c.name](records, **c.hp)


# ----------------------------------------------------------------------------- comparisons


def assert_close(got, exp, tol, what):
    got = np.asarray(got, np.float64)
    assert got.shape == exp.shape, f"{what}: shape {got.shape} != {exp.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    bad = np.abs(got - exp) > tol
    if bad.any():
        p = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} entries off; first at {p}: got {got[p]!r}, "
                             f"expected {exp[p]!r} (tol {tol[p]:.3g})")


def check_ref(cid, out, records, index, batch):
    placed = place(reference(cid, records), index, shapes_of(batch))
    for f in FIELDS:
        assert_close(getattr(out[cid], f), *placed[f], f"{cid}.{f} [{batch.layout}]")


def node_members(records, index, child="history"):
    """Python-side tree: node -> [(n, k)] batch positions of its turns, node -> {child key:
    [(n, k)]}."""
    trajs = step_ref.parse_steps(records)
    members, kids = defaultdict(list), defaultdict(lambda: defaultdict(list))
    for i, row in enumerate(ref.tree_nodes(trajs, child)):
        for k, (node, kid) in enumerate(row):
            members[node].append((index.traj[i], k))
            kids[node][kid].append((index.traj[i], k))
    return members, kids


# ----------------------------------------------------------------------------- 1. reference


@given(records=step_records())
def test_matches_reference_in_both_layouts(records):
    """Every setting against its reference, in both layouts; the per-turn values of the two
    layouts agree (the estimators are layout-free)."""
    failures, turns = [], {}
    for layout in LAYOUTS:
        batch, index = pack(records, layout)
        out = run_all(batch)
        for cid in OWN:
            try:
                check_ref(cid, out, records, index, batch)
                assert_padding_zero(out[cid], batch, cid)
            except AssertionError as e:
                failures.append(str(e))
        turns[layout] = (out, index)
    assert not failures, "\n".join(failures)
    (o1, i1), (o2, i2) = turns["concatenated"], turns["per_step"]
    for cid in OWN:
        a, b = per_record(o1[cid], i1), per_record(o2[cid], i2)
        assert_same_records(a, b, reference(cid, records), f"layouts {cid}")


# ----------------------------------------------------------------------------- 2. invariants


def _scale(batch):
    return 1.0 + float(np.abs(np.asarray(batch.turn_rewards)).sum(axis=1).max())


@given(records=step_records())
def test_rtmc_kappa_limits_and_tree_consistency(records):
    """kappa -> 0 tends to the raw MC estimate (kappa = 0, checked against the reference);
    kappa -> inf sends A to 0; at kappa = 0 the step terms of a history node sum to 0 over its
    trajectories (sum_a N(s, a) (Q_hat - V_hat) = 0), and V_hat(s) is the visit-weighted mean
    of Q_hat(s, .) (tree consistency)."""
    batch, index = pack(records, "concatenated")
    out = run_all(batch)
    s = _scale(batch)
    a0, tiny, big = out["rtmc_k0"].turn, out["rtmc_tiny"].turn, out["rtmc_big"].turn
    assert np.abs(tiny - a0).max() <= 1e-3 * s, np.abs(tiny - a0).max()
    assert np.abs(big).max() <= 1e-4 * s, np.abs(big).max()
    t = out["terms"]["rtmc_k0"]
    members, _ = node_members(records, index)
    for node, pos in members.items():
        rows, cols = np.array(pos).T
        assert abs(a0[rows, cols].sum()) <= 1e-5 * s * len(pos), (node, a0[rows, cols])
        np.testing.assert_allclose(t["q_hat"][rows, cols].mean(), t["v_hat"][rows[0], cols[0]],
                                   atol=1e-5 * s)
        assert (t["n_s"][rows, cols] == len(pos)).all()


def _loop(records, which):
    """Records whose trajectories in ``which`` repeat their own turns once more, with reward 0
    (a loop back through the same states and actions that leaves every earlier return
    unchanged); turns are truncated to 2 first so the result fits K = 4."""
    recs = copy.deepcopy(records)
    for r in recs:
        r["turns"] = r["turns"][:2]
    looped = copy.deepcopy(recs)
    for i in which:
        again = [{**t, "reward": 0.0} for t in looped[i]["turns"]]
        looped[i]["turns"] = looped[i]["turns"] + again
    return recs, looped


@given(records=step_records(), data=st.data())
def test_rtmc_first_visit_ignores_loops(records, data):
    """State signature: a trajectory that loops back through (s, a) pairs it already visited
    (with zero reward, so no earlier return changes) leaves every advantage unchanged
    (first-visit MC), and the repeated turns get the advantage of their first visit.
    (Counting every visit would re-weight the means and the prior's weight.)"""
    which = data.draw(st.sets(st.integers(0, len(records) - 1)), label="looped")
    recs, looped = _loop(records, which)
    b1, i1 = pack(recs, "concatenated")
    b2, i2 = pack(looped, "concatenated")
    o1, o2 = run_all(b1), run_all(b2)
    for cid in ("rtmc_state_k0", "rtmc_state"):
        r = reference(cid, recs)
        for i in range(len(recs)):
            n1, n2, k = i1.traj[i], i2.traj[i], len(recs[i]["turns"])
            tol = 2 * r.tol["turn"][i]
            a, b = o1[cid].turn[n1, :k], o2[cid].turn[n2, :len(looped[i]["turns"])]
            np.testing.assert_allclose(b[:k], a, atol=tol, rtol=0, err_msg=cid)
            np.testing.assert_allclose(b[k:], a[:len(b) - k], atol=tol, rtol=0, err_msg=cid)


@given(records=step_records())
def test_tree_value_consistency_and_branch_gating(records):
    """Tree consistency: V(parent) is the leaf-count weighted mean of its children (the mean of
    V(child) over the node's trajectories) and sum_c N_c (V(c) - V(p)) = 0; N(p) = sum_c N_c;
    the step term is exactly 0 where a node has one child (TEMPO's gating); step_weight = 0 is
    GRPO."""
    batch, index = pack(records, "concatenated")
    out = run_all(batch)
    for child, tid in (("history", "tree"), ("action", "tree_act")):
        t = out["terms"][tid]
        members, kids = node_members(records, index, child)
        for node, pos in members.items():
            rows, cols = np.array(pos).T
            vp = t["v_parent"][rows[0], cols[0]]
            np.testing.assert_allclose(t["v_child"][rows, cols].mean(), vp, atol=1e-5)
            assert (t["n_children"][rows, cols] == len(kids[node])).all()
            for kid_pos in kids[node].values():  # N(c) per child; N(p) = sum_c N(c)
                assert all(t["n_child"][p] == len(kid_pos) for p in kid_pos)
            assert sum(len(v) for v in kids[node].values()) == len(pos)
            if len(kids[node]) == 1:
                assert (t["a_proc"][rows, cols] == 0).all()
                if child == "history":
                    assert (out["tree_proc"].turn[rows, cols] == 0).all()
                    assert (out["tree_sib"].turn[rows, cols] == 0).all()
            if child == "history":
                assert abs(out["tree_proc"].turn[rows, cols].sum()) <= 1e-5 * len(pos)
    np.testing.assert_allclose(out["tree_grpo"].turn, out["grpo"].turn, atol=1e-6, rtol=0)
    np.testing.assert_allclose(out["tree_grpo"].token, out["grpo"].token, atol=1e-6, rtol=0)


@st.composite
def depth_one_trees(draw):
    """Groups sharing one first observation, each member with its own first action (no
    shared prefixes below the root); later turns arbitrary."""
    recs = []
    for g in range(draw(st.integers(1, 2))):
        for j in range(draw(st.integers(1, 4))):
            turns = [{"observation": [7], "action": [10 + j]}]
            for _ in range(draw(st.integers(0, 3))):
                turns.append({"observation": [draw(st.integers(0, 2))],
                              "action": [draw(st.integers(0, 1))]})
            recs.append({"group": g, "outcome": draw(st.floats(-2, 2, width=32)),
                         "turns": turns})
    return recs


@given(records=depth_one_trees())
def test_tree_of_depth_one_is_dr_grpo(records):
    """No shared prefixes below the root: A_proc = R_i - mean_g R at the first turn (for both
    baselines), and 0 at every later turn (one child per node)."""
    batch, _ = pack(records, "concatenated")
    out = run_all(batch)
    dr = out["dr_grpo"].turn[:, 0]
    for cid in ("tree_proc", "tree_sib"):
        np.testing.assert_allclose(out[cid].turn[:, 0], dr, atol=1e-5, err_msg=cid)
        assert (out[cid].turn[:, 1:] == 0).all(), cid


@given(records=step_records())
def test_progpo_fusion_telescoping_and_reduction(records):
    """Fusion weights >= 0; Phi within [min_d Phi_d, max_d Phi_d] (a convex combination);
    sum_k gamma^k C = gamma^{K_i} R_i - Phi(s_0) (Phi(terminal) = R) or G_0 - Phi(s_0) (TD);
    transition_weight = 0 equals step_group(key="history") (exact-prefix GiGPO)."""
    batch, index = pack(records, "concatenated")
    out = run_all(batch)
    valid = np.asarray(batch.turn_mask)
    outcome = np.asarray(batch.outcome, np.float64)
    s = _scale(batch)
    for tid, gamma, terminal in (("progpo", 1.0, "outcome"), ("progpo_td", 0.9, "td")):
        t = out["terms"][tid]
        w, pd, phi = t["w_d"], t["phi_d"], t["phi"]
        assert (w >= 0).all() and np.isfinite(w).all()
        assert (w[valid] > 0).all()
        lo, hi = pd.min(-1), pd.max(-1)
        assert (phi[valid] >= lo[valid] - 1e-5 * s).all() and \
            (phi[valid] <= hi[valid] + 1e-5 * s).all(), tid
        for i in range(len(records)):
            n, k = index.traj[i], len(records[i]["turns"])
            disc = gamma ** np.arange(k)
            total = float((disc * t["credit"][n, :k]).sum())
            end = gamma ** k * outcome[n] if terminal == "outcome" else t["g"][n, 0]
            assert abs(total - (end - phi[n, 0])) <= 1e-4 * s, (tid, i, total, end, phi[n, 0])
    for a, b in (("progpo_nt", "step_hist"), ("progpo_nt_mn", "step_hist_mn")):
        np.testing.assert_allclose(out[a].turn, out[b].turn, atol=1e-5, rtol=0, err_msg=a)
        np.testing.assert_allclose(out[a].token, out[b].token, atol=1e-5, rtol=0, err_msg=a)


@given(records=step_records(), data=st.data())
def test_arbitrary_key_values(records, data):
    """Keys only matter through equality: any bijective relabelling of the uint32 state and
    action keys (here x -> a x + c mod 2^32, a odd, so 0 and 2^32 - 1 occur too) gives the
    same advantages."""
    batch, index = pack(records, "per_step")
    mult = data.draw(st.integers(0, 2 ** 31 - 1), label="a") * 2 + 1
    add = data.draw(st.integers(0, 2 ** 32 - 1), label="c")

    def remap(x):
        return ((np.asarray(x, np.uint64) * mult + add) % 2 ** 32).astype(np.uint32)

    b2 = batch.replace(state_keys=remap(batch.state_keys), action_keys=remap(batch.action_keys))
    o1, o2 = run_all(batch), run_all(b2)
    for cid in OWN:
        r = reference(cid, records)
        assert_same_records(per_record(o1[cid], index), per_record(o2[cid], index), r,
                            f"keys {cid}")


# ----------------------------------------------------------------------------- 3. degenerate


@given(records=step_records())
def test_singleton_groups(records):
    """Each trajectory its own group: tree_value, rtmc(kappa=0, history) and the prefix and
    episode terms are 0. ProGPO: when no state recurs inside the lone trajectory every depth
    key is a singleton, so Phi = G exactly and C = gamma G_{k+1} - G_k with G_K := R."""
    recs = copy.deepcopy(records)
    for i, r in enumerate(recs):
        r["group"] = f"alone-{i}"
    batch, _ = pack(recs, "concatenated")
    out = run_all(batch)
    for cid in ("tree", "tree_proc", "tree_sib", "tree_act", "tree_grpo", "rtmc_k0",
                "progpo_nt_mn"):
        assert (out[cid].turn == 0).all() and (out[cid].token == 0).all(), cid
    for cid in OWN:
        assert_padding_zero(out[cid], batch, cid)
    for r in recs:
        for k, t in enumerate(r["turns"]):
            t["observation"] = [50 + k]
    batch, _ = pack(recs, "concatenated")
    t = run_all(batch)["terms"]["progpo"]
    valid = np.asarray(batch.turn_mask)
    last = valid & ~np.concatenate([valid[:, 1:], np.zeros_like(valid[:, :1])], 1)
    np.testing.assert_array_equal(t["phi"], t["g"])
    nxt = np.where(last, np.asarray(batch.outcome)[:, None],
                   np.concatenate([t["g"][:, 1:], np.zeros_like(t["g"][:, :1])], 1))
    np.testing.assert_allclose(t["credit"], np.where(valid, nxt - t["g"], 0.0), atol=1e-6)


@given(records=step_records(), value=st.sampled_from([-1.0, 0.0, 0.5, 2.0]))
def test_all_outcomes_equal_give_exact_zero(records, value):
    """Outcome-only records with one outcome everywhere: every setting whose returns are then
    constant (gamma = 1 or target outcome) gives exactly 0."""
    recs = copy.deepcopy(records)
    for r in recs:
        r["outcome"] = value
        for t in r["turns"]:
            t.pop("reward", None)
    batch, _ = pack(recs, "per_step")
    out = run_all(batch)
    for cid in OWN:
        if CFG[cid].hp.get("gamma", 1.0) < 1:  # returns not constant
            assert np.isfinite(out[cid].turn).all()
            continue
        assert (out[cid].turn == 0).all() and (out[cid].token == 0).all(), \
            (cid, out[cid].turn)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_single_trajectory(layout):
    """One trajectory revisiting its state: every setting gives its reference values (the
    all-padding batch: tests/test_conformance.py)."""
    recs = [{"group": 0, "outcome": 0.75, "turns": [
        {"observation": [1], "action": [2, 3], "reward": 0.5},
        {"observation": [1], "action": [2, 3], "reward": 0.25}]}]
    batch, index = pack(recs, layout)
    out = run_all(batch)
    for cid in OWN:
        assert_padding_zero(out[cid], batch, cid)
        check_ref(cid, out, recs, index, batch)


# ----------------------------------------------------------------------------- 4. by hand


def _hand_records():
    def t(o, a):
        return {"observation": [o], "action": [a]}
    # One group, outcome-only rewards (G = R at every turn). States s0, s1 = observations
    # [0], [1]; actions a0, a1 = [0], [1].
    return [{"group": 0, "outcome": 1.0, "turns": [t(0, 0), t(1, 0)]},  # T1
            {"group": 0, "outcome": 0.0, "turns": [t(0, 0), t(1, 1)]},  # T2
            {"group": 0, "outcome": 1.0, "turns": [t(0, 1)]},  # T3
            {"group": 0, "outcome": 1.0, "turns": [t(0, 1), t(1, 0)]}]  # T4


# Tree: root r = (s0); n1 = (s0 a0 s1) [T1, T2]; n2 = (s0 a1 s1) [T4]; leaf (r, a1) [T3];
# leaves (n1, a0) [T1], (n1, a1) [T2], (n2, a0) [T4].
# V: r = 3/4, n1 = 1/2, n2 = 1, leaf(r, a1) = 1, leaves 1, 0, 1.
# GRPO: mean 3/4, unbiased std = sqrt((3 (1/4)^2 + (3/4)^2) / 3) = 1/2, A_ep = 1/2, -3/2, 1/2, 1/2.
# tree_value (parent): turn 0: T1, T2: 1/2 - 3/4 = -1/4; T3, T4: 1 - 3/4 = 1/4.
#   turn 1: T1 +1/2, T2 -1/2 (n1 has two children), T4 0 (n2 has one child).
#   A = A_ep + A_proc: T1 [1/4, 1], T2 [-7/4, -2], T3 [3/4], T4 [3/4, 1/2].
# siblings: root children n1, leaf, n2 with V 1/2, 1, 1, plain mean 5/6:
#   turn 0: T1, T2: -1/3; T3, T4: 1/6; turn 1 as above.
# RTMC kappa = 1 (history): root prior = 3/4; V~(r) = (3 + 3/4) / 5 = 3/4;
#   Q~(r, a0) = (1 + 3/4) / 3 = 7/12, Q~(r, a1) = (2 + 3/4) / 3 = 11/12 -> turn 0: -/+ 1/6.
#   V~(n1) = (1 + 3/4) / 3 = 7/12; Q~(n1, a0) = (1 + 7/12) / 2 = 19/24 -> T1: 5/24;
#   Q~(n1, a1) = 7/24 -> T2: -7/24. V~(n2) = (1 + 3/4) / 2 = 7/8, Q~ = (1 + 7/8) / 2 = 15/16
#   -> T4: 1/16.
# RTMC kappa = 0, state signature: V(s0) = 3/4, Q(s0, a0) = 1/2, Q(s0, a1) = 1;
#   V(s1) = 2/3 (T1, T2, T4), Q(s1, a0) = 1, Q(s1, a1) = 0 -> turn 1: T1 1/3, T2 -2/3, T4 1/3.
# ProGPO, defaults: D = 2, s0 = 1/2 (s0^2 = 1/4), gamma = 1, w1 = w2 = 1, A_pre mean-only:
#   turn 0: every depth key groups T1..T4: mean 3/4, var 1/4, w = 4 / (1/2) = 8: Phi = 3/4.
#   Turn 1, depth 0 (s1: T1, T2, T4 = 1, 0, 1): mean 2/3, var 1/3, w = 3 / (7/12) = 36/7.
#   Depths 1 and 2 (the same grouping here): (s0 a0 s1) {T1, T2}: mean 1/2, var 1/2,
#   w = 2 / (3/4) = 8/3 each; (s0 a1 s1) {T4}: mean 1, var := s0^2, w = 1 / (1/2) = 2 each.
#   Phi(T1/T2, 1) = (36/7 * 2/3 + 2 * 8/3 * 1/2) / (36/7 + 2 * 8/3) = 32/55;
#   Phi(T4, 1) = (36/7 * 2/3 + 2 * 2 * 1) / (36/7 + 2 * 2) = 13/16.
#   C: T1 [32/55 - 3/4, 1 - 32/55] = [-37/220, 23/55]; T2 [-37/220, -32/55]; T3 [1/4];
#   T4 [13/16 - 3/4, 1 - 13/16] = [1/16, 3/16].
#   A_pre: root: 1/4, -3/4, 1/4, 1/4; n1: +-1/2; n2: 0 (singleton).
#   A = A_ep + A_pre + C: T1 [1/2 + 1/4 - 37/220, 1/2 + 1/2 + 23/55],
#   T2 [-3/2 - 3/4 - 37/220, -3/2 - 1/2 - 32/55], T3 [1/2 + 1/4 + 1/4],
#   T4 [1/2 + 1/4 + 1/16, 1/2 + 0 + 3/16].
HAND = {
    "tree": [[1 / 4, 1], [-7 / 4, -2], [3 / 4], [3 / 4, 1 / 2]],
    "tree_sib": [[-1 / 3, 1 / 2], [-1 / 3, -1 / 2], [1 / 6], [1 / 6, 0]],
    "rtmc": [[-1 / 6, 5 / 24], [-1 / 6, -7 / 24], [1 / 6], [1 / 6, 1 / 16]],
    "rtmc_state_k0": [[-1 / 4, 1 / 3], [-1 / 4, -2 / 3], [1 / 4], [1 / 4, 1 / 3]],
    "progpo": [[3 / 4 - 37 / 220, 1 + 23 / 55], [-9 / 4 - 37 / 220, -2 - 32 / 55], [1.0],
               [3 / 4 + 1 / 16, 1 / 2 + 3 / 16]],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hand_built_tree(layout):
    recs = _hand_records()
    batch, index = pack(recs, layout)
    out = run_all(batch)
    for cid, expected in HAND.items():  # (atol: GRPO's std + eps, eps = 1e-6)
        got = per_record(out[cid], index)
        for i, exp in enumerate(expected):
            np.testing.assert_allclose(got["turn"][i], exp, atol=1e-5, err_msg=cid)
            tok = np.repeat(exp, [len(t["action"]) for t in recs[i]["turns"]])
            np.testing.assert_allclose(got["token"][i], tok, atol=1e-5, err_msg=cid)
        r = reference(cid, recs)  # the reference agrees with the hand computation too
        for i, exp in enumerate(expected):
            np.testing.assert_allclose(r.turn[i], exp, atol=1e-5, err_msg=cid)


# ----------------------------------------------------------------------------- 5. errors


@pytest.mark.parametrize("name,hp,needle", [
    ("rtmc", {"kappa": -1.0}, "kappa"),
    ("rtmc", {"kappa": float("inf")}, "kappa"),
    ("rtmc", {"signature": "prefix"}, "signature"),
    ("rtmc", {"target": "reward"}, "target"),
    ("rtmc", {"gamma": 1.5}, "gamma"),
    ("rtmc", {"normalization": "z"}, "normalization"),
    ("tree_value", {"baseline": "uncle"}, "baseline"),
    ("tree_value", {"child": "node"}, "child"),
    ("tree_value", {"eps": 0.0}, "eps"),
    ("tree_value", {"episode_weighting": "token"}, "episode_weighting"),
    ("progpo", {"max_depth": -1}, "max_depth"),
    ("progpo", {"max_depth": 1.5}, "max_depth"),
    ("progpo", {"prior_std": 0.0}, "prior_std"),
    ("progpo", {"terminal": "zero"}, "terminal"),
    ("progpo", {"prefix_normalization": "std"}, "prefix_normalization"),
    ("progpo", {"gamma": -0.1}, "gamma"),
    ("progpo", {"singleton": "one"}, "singleton"),
    ("progpo", {"kappa": 1.0}, "kappa"),  # not a hyper-parameter of progpo: the valid ones listed
])
def test_bad_hyper_parameters_name_the_field(name, hp, needle):
    batch, _ = pack(_hand_records(), "concatenated")
    with pytest.raises(ValueError, match=needle):
        E.compute(name, batch, **hp)


def test_registry_lists_the_hyper_parameters():
    assert set(E.spec("rtmc").hyper_params) >= {"kappa", "signature", "target", "gamma"}
    assert set(E.spec("tree_value").hyper_params) >= {"baseline", "child", "step_weight"}
    assert set(E.spec("progpo").hyper_params) >= {"max_depth", "prior_std", "terminal",
                                                  "prefix_weight", "transition_weight"}
    for name in ("rtmc", "tree_value", "progpo"):
        assert name in ref.REFERENCES
