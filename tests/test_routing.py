"""Label-, citation- and graph-driven credit routing (estimators/routing.py).

Every registered setting in CONFIGS is compared with the loop-over-records reference of
tests/reference/routing_ref.py in both layouts, on two bases: GRPO (trajectory-constant) and a
dyadic per-turn base (so "A_i" as the token mean and per-token multiplication are exercised).
Then the methods' own properties: mass conservation, sign preservation, exact
reductions on neutral labels, bounds, STAMP's group ranking, the shuffled control's
multiset, ProAS/ECHO/Neos/GGPO masking rules, SkillGate's disjoint channels, Shapley
efficiency / symmetry / null player, the TRIAGE projection as the least-squares minimiser
(and its constants' shard invariance), exact zeros on degenerate groups, stop-gradient and
the error messages. Padding (NaN in padding too), permutation and shard invariance and
degenerate batches of every registered name: tests/test_conformance.py.

Compile budget: every setting runs inside one jitted function per batch shape.
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
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_agent import estimators as E
from jaxrl_agent import segments
from jaxrl_agent.batch import LAYOUTS, Advantages
from tests.registered import defined_in
from jaxrl_agent.estimators import routing
from tests.reference import routing_ref
from tests.families import assert_matches, config_checks, on_host, packer, reference_test
from tests.strategies import PAD, step_records

EX = settings(max_examples=15, deadline=None)
# the triage-constants shard test's shape (8 blocks)
SHARD_PAD = {"num_traj": 32, "num_turns": 8, "num_rows": 128, "row_len": 8}
NUM_AGENTS = 4  # = num_turns of PAD: [N, 4] traj vectors look like [N, K] turn arrays
BASE_VALUES = (-2.0, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 1.5)  # dyadic: exact sums

# id -> (registry name, hyper-parameters)
CONFIGS = {
    "stamp": ("stamp", {}),
    "stamp_a": ("stamp", {"alpha": 2.5}),
    "iapo": ("iapo", {}),
    "iapo_b0": ("iapo", {"alpha": 0.5, "beta": 0.0, "dedup": False}),
    "self_credit": ("self_credit", {}),
    "self_credit_c": ("self_credit", {"variant": "conserve", "alpha": 2.0, "alpha_fail": 1.0,
                                      "w_min": 0.2}),
    "triage": ("triage", {}),
    "triage_sc": ("triage", {"sign_consistent": True, "bound": 1.0, "c_exploration": -0.25}),
    "serl": ("serl", {}),
    "serl_tok": ("serl", {"relevance": "tok_relevance", "alpha": 3.0}),
    "vict": ("vict", {}),
    "vict_all": ("vict", {"complete": None, "alpha": 0.5}),
    "echo": ("echo", {}),
    "echo_n": ("echo", {"normalize": True, "eta": 2.0}),
    "skillgate": ("skillgate", {}),
    "skillgate_raw": ("skillgate", {"normalization": "raw"}),
    "proas": ("proas", {}),
    "proas_b1": ("proas", {"alpha": 2.0, "beta": 1.0}),
    "neos": ("neos", {}),
    "neos_zero": ("neos", {"after": "zero"}),
    "ggpo": ("ggpo", {}),
    "ggpo_tok": ("ggpo", {"redundant": "tok_redundant"}),
}
ESTIMATOR_CONFIGS = {
    "ccpo": ("ccpo", {}),
    "ccpo_l": ("ccpo", {"weight": 0.5, "ddof": 0}),
    "sharp": ("sharp", {}),
    "sharp_t": ("sharp", {"beta": 0.5, "tool_rewards": "tool_rewards", "delta": 0.3}),
}
# the shuffled control of every re-allocation (compared with its unshuffled config)
SHUFFLED = {"stamp": 3, "iapo": 1, "self_credit_c": 2, "serl_tok": 5, "vict": 7, "echo_n": 11,
            "proas": 13}
# settings whose weights keep each trajectory's advantage mass (on a trajectory-constant base)
CONSERVING = ("stamp", "stamp_a", "iapo", "iapo_b0", "self_credit_c", "serl", "serl_tok",
              "vict", "vict_all", "echo_n")
SIGNED = tuple(c for c in CONFIGS if c not in ("triage", "skillgate", "skillgate_raw"))
BASES = ("grpo", "turn")


def _base(kind, batch, axis_name):
    if kind == "grpo":
        return E.get("grpo")(batch, axis_name=axis_name)
    b = segments.local_view(batch, axis_name)
    x = jnp.where(segments.valid_turns(b), b.extras["base"], 0.0)
    return Advantages(token=segments.turn_to_token(x, b), turn=x)


def _estimate(batch, axis_name=None, shuffled=True, configs=tuple(CONFIGS), bases=BASES):
    ax = {"axis_name": axis_name}
    out = {}
    for kind in bases:
        base = _base(kind, batch, axis_name)
        out[f"base@{kind}"] = base
        for cid in configs:
            name, hp = CONFIGS[cid]
            out[f"{cid}@{kind}"] = E.get(name)(base, batch, **hp, **ax)
        if shuffled and kind == "grpo":
            for cid, seed in SHUFFLED.items():
                name, hp = CONFIGS[cid]
                out[f"{cid}~shuffle"] = E.get(name)(base, batch, **hp, shuffle=True, seed=seed,
                                                    **ax)
    for cid, (name, hp) in ESTIMATOR_CONFIGS.items():
        out[cid] = E.get(name)(batch, **hp, **ax)
    return out


run_all = on_host(jax.jit(_estimate))


# ----------------------------------------------------------------------------- records


def add_routing(rng, rec):
    """Every label the module reads, from a numpy Generator."""
    k = len(rec["turns"])
    for t in rec["turns"]:
        n = len(t["action"])
        t["turn_extras"] = {
            "base": float(rng.choice(BASE_VALUES)),
            "supported_citations": float(rng.integers(0, 3)),
            "cite": float(rng.random() < 0.5),
            "role": float(rng.choice([0, 1, 2, 3, 0, 3, -1, 2.5])),
            "relevance": float(np.float32(rng.random())),
            "atoms": float(rng.integers(0, 3)),
            "selected": float(rng.random() < 0.5),
            "reasonable": float(rng.random() < 0.6),
            "deviation": float(rng.integers(0, 3) * (rng.random() < 0.5)),
            "redundant": float(rng.random() < 0.3),
            "agent": float(rng.integers(0, NUM_AGENTS)),
        }
        t["token_extras"] = {
            "skill_mask": [bool(rng.random() < 0.3) for _ in range(n)],
            "tok_relevance": [float(np.float32(rng.random())) for _ in range(n)],
            "tok_redundant": [bool(rng.random() < 0.3) for _ in range(n)],
        }
    rec["edges"] = [[int(rng.integers(0, k)), int(rng.integers(0, k)), int(rng.integers(0, 3))]
                    for _ in range(int(rng.integers(0, 5)))]
    small = lambda size: [float(x) for x in rng.choice([0.0, 0.5, 1.0], size)]  # noqa: E731
    rec["traj_extras"] = {
        "trace_complete": float(rng.random() < 0.7),
        "read_correct": float(rng.integers(-1, 2)),
        "divergence_step": float(rng.integers(-1, 4)),
        "counterfactual_outcome": small(NUM_AGENTS),
        "coalition_values": [float(np.float32(x)) for x in rng.normal(size=8)],
        "tool_rewards": small(3),
        "pair_active": small(2),
    }


def _add(draw, rec):
    add_routing(np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1), label="seed")), rec)


def records(**kw):
    return step_records(extras=_add, **kw)


def seeded_records(seed, num_traj=8, num_groups=3):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(num_traj):
        turns = [{"observation": [int(rng.integers(0, 3))],
                  "action": [int(x) for x in rng.integers(0, 2, rng.integers(1, 3))],
                  "reward": 0.0} for _ in range(int(rng.integers(1, 5)))]
        rec = {"group": f"{seed}-{i % num_groups}", "outcome": float(rng.integers(0, 2)),
               "turns": turns}
        add_routing(rng, rec)
        recs.append(rec)
    return recs


pack = packer(PAD)


def per_record_tokens(token, index):
    return [[np.asarray(token[r, s:e], np.float64).tolist() for r, s, e in spans]
            for spans in index.spans]


# ----------------------------------------------------------------------------- vs reference


def reference_checks(out, recs, index, batch):
    """Every transform setting on both bases and every estimator setting against its
    reference."""
    checks = []
    for kind in BASES:
        base = per_record_tokens(out[f"base@{kind}"].token, index)
        checks += [("", functools.partial(
            assert_matches, f"{cid}@{kind}", out[f"{cid}@{kind}"],
            routing_ref.REFERENCES[name](recs, base, **hp), index, batch))
            for cid, (name, hp) in CONFIGS.items()]
    return checks + config_checks(ESTIMATOR_CONFIGS, routing_ref.REFERENCES, ESTIMATOR_CONFIGS,
                                  out, recs, index, batch)


test_matches_reference = reference_test(EX, records(), pack, run_all, reference_checks)


def test_registry_and_pipeline():
    mine = defined_in(routing)
    assert {E.spec(n).kind for n in mine} == {"estimator", "transform"}
    assert set(routing_ref.REFERENCES) == set(mine)
    for name in (n for n in mine if E.spec(n).kind == "transform"):
        hp = E.spec(name).hyper_params
        assert all(isinstance(v, (str, int, float, bool, type(None))) for v in hp.values())
    recs = seeded_records(3)
    batch, _ = pack(recs, "concatenated")
    pipe = E.Pipeline.build("grpo", then=[("stamp", {"alpha": 2.5}), ("ggpo", {})])
    got = jax.jit(pipe)(batch)
    out = run_all(batch)  # stamp_a then ggpo, by hand
    exp = routing.redundant_credit_pruning(jax.tree.map(jnp.asarray, out["stamp_a@grpo"]), batch)
    np.testing.assert_array_equal(np.asarray(got.token), np.asarray(exp.token))


# ----------------------------------------------------------------------------- properties


def _traj_sums(tok, batch):
    n = batch.num_traj
    rt = np.asarray(batch.row_traj)
    am = np.asarray(batch.action_mask)
    s = np.zeros(n)
    cnt = np.zeros(n)
    for r in range(tok.shape[0]):
        s[rt[r]] += np.where(am[r], tok[r], 0.0).sum()
        cnt[rt[r]] += am[r].sum()
    return s, cnt


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_mass_sign_and_bounds(layout, recs):
    """Mass conservation on the GRPO base for the conserving settings (and ProAS's APR on
    failed rollouts, every shuffled control); sign preservation token by token for the
    sign-preserving settings; bounds for TRIAGE; exact zeros off the action mask."""
    batch, index = pack(recs, layout)
    out = run_all(batch)
    am = np.asarray(batch.action_mask)
    base = out["base@grpo"].token
    a_sum, cnt = _traj_sums(base, batch)
    a_i = np.where(cnt > 0, a_sum / np.maximum(cnt, 1), 0.0)
    keys = [f"{c}@grpo" for c in CONSERVING] + [f"{c}~shuffle" for c in SHUFFLED]
    for key in keys:
        s, _ = _traj_sums(out[key].token, batch)
        if key.startswith("proas"):
            sel = a_i < 0
            s, a_sum_sel = s[sel], a_sum[sel]
        else:
            a_sum_sel = a_sum
        np.testing.assert_allclose(s, a_sum_sel, atol=1e-4, rtol=1e-5, err_msg=key)
    for kind in BASES:
        b = out[f"base@{kind}"].token
        for cid in SIGNED:
            tok = out[f"{cid}@{kind}"].token
            if cid == "triage_sc":  # sign of A_i (the trajectory), not of the token
                continue
            assert ((np.sign(tok) == np.sign(b)) | (tok == 0)).all(), f"{cid}@{kind}"
        for cid, (_, hp) in (("triage", CONFIGS["triage"]), ("triage_sc", CONFIGS["triage_sc"])):
            if cid == "triage_sc" and kind == "turn":  # clipping to sign(A_i) may move more
                continue
            tok = out[f"{cid}@{kind}"].token
            bound = hp.get("bound", 0.5)
            assert (np.abs(tok - b) <= bound + 1e-6).all(), cid
    sc = out["triage_sc@grpo"].token
    a_tok = np.where(am, a_i[np.asarray(batch.row_traj)][:, None], 0.0)
    assert ((np.sign(sc) == np.sign(a_tok)) | (sc == 0)).all()
    for key, adv in out.items():
        tok = adv.token
        assert np.isfinite(tok).all() and (tok[~am] == 0).all(), key


@EX
@given(recs=records(min_traj=2))
def test_stamp_keeps_the_group_ranking(recs):
    """STAMP keeps each trajectory mean, so within a group the trajectory means of A' are
    ordered as A_i (and, for equal lengths, so are the sums), while the per-turn credit
    differs from GRPO whenever citations differ within a trajectory."""
    batch, index = pack(recs, "per_step")
    out = run_all(batch)
    a_sum, cnt = _traj_sums(out["base@grpo"].token, batch)
    a_i = np.where(cnt > 0, a_sum / np.maximum(cnt, 1), 0.0)
    for cid in ("stamp", "stamp_a"):
        s, _ = _traj_sums(out[f"{cid}@grpo"].token, batch)
        mean = np.where(cnt > 0, s / np.maximum(cnt, 1), 0.0)
        gid = np.asarray(batch.group_ids)
        for i in range(batch.num_traj):
            for j in range(batch.num_traj):
                if cnt[i] == 0 or cnt[j] == 0 or gid[i] != gid[j]:
                    continue
                if a_i[i] < a_i[j] - 1e-6:
                    assert mean[i] < mean[j], (cid, i, j)
                    if cnt[i] == cnt[j]:
                        assert s[i] < s[j], (cid, i, j)


@EX
@given(recs=records())
def test_shuffled_control_keeps_the_weight_multiset(recs):
    """The shuffled control permutes the raw weights within each trajectory: the sorted
    per-turn weights (A'/A_i, up to the renormalisation constant) match the unshuffled
    setting's; the control is deterministic for a seed."""
    batch, index = pack(recs, "concatenated")
    out = run_all(batch)
    base = out["base@grpo"].turn
    for cid in SHUFFLED:
        for i, rec in enumerate(recs):
            n, k = index.traj[i], len(rec["turns"])
            a = base[n, 0]
            if a == 0:
                continue
            if cid == "serl_tok":  # per-token weights, permuted over the action tokens
                w0, w1 = (np.sort(np.concatenate([out[key].token[r, s:e] for r, s, e
                                                  in index.spans[i]]) / a)
                          for key in (f"{cid}@grpo", f"{cid}~shuffle"))
            else:
                w0 = np.sort(out[f"{cid}@grpo"].turn[n, :k] / a)
                w1 = np.sort(out[f"{cid}~shuffle"].turn[n, :k] / a)
            if w0.max() <= 0 or w1.max() <= 0:
                continue
            np.testing.assert_allclose(w1 / w1.max(), w0 / w0.max(), atol=1e-5, err_msg=cid)
    again = run_all(batch)
    for cid in SHUFFLED:
        np.testing.assert_array_equal(again[f"{cid}~shuffle"].token, out[f"{cid}~shuffle"].token)


def test_shuffle_moves_the_weights():
    """With distinct citation counts the shuffled control places them differently for some
    seed (a control that never moved anything could not fail the multiset test)."""
    recs = seeded_records(11, num_traj=8)
    for r in recs:
        for j, t in enumerate(r["turns"]):
            t["turn_extras"]["supported_citations"] = float(j)
    batch, _ = pack(recs, "concatenated")
    base = E.get("grpo")(batch)
    run = jax.jit(routing.supported_citation_reweight, static_argnames=("shuffle",))
    plain = np.asarray(run(base, batch).token)
    moved = [not np.array_equal(np.asarray(run(base, batch, shuffle=True, seed=s).token), plain)
             for s in range(4)]
    assert any(moved)


def _neutral(recs):
    recs = copy.deepcopy(recs)
    for r in recs:
        for t in r["turns"]:
            t["turn_extras"].update(supported_citations=0.0, cite=0.0, role=2.0,
                                    relevance=0.3, atoms=0.0, selected=0.0, redundant=0.0,
                                    reasonable=1.0, deviation=0.0)
            t["token_extras"].update(tok_relevance=[0.7] * len(t["action"]),
                                     skill_mask=[False] * len(t["action"]),
                                     tok_redundant=[False] * len(t["action"]))
        r["edges"] = []
        r["traj_extras"]["divergence_step"] = -1.0
    return recs


REDUCE = ("stamp", "stamp_a", "iapo_b0", "self_credit", "self_credit_c", "triage", "triage_sc",
          "serl", "serl_tok", "vict", "vict_all", "echo", "echo_n", "skillgate",
          "skillgate_raw", "proas", "proas_b1", "neos", "neos_zero", "ggpo", "ggpo_tok")


@pytest.mark.parametrize("layout", LAYOUTS)
@EX
@given(recs=records())
def test_neutral_labels_give_the_base_exactly(layout, recs):
    """Reduction to the base, bit for bit on tokens: no citations, no edges (beta = 0),
    all-infrastructure roles, constant relevance, no atoms, no selection, no skill tokens,
    every action reasonable and none deviating, no divergence, nothing redundant. Also the
    abstain path of VICT and IAPO's failed rollouts without edges under the default beta."""
    batch, _ = pack(_neutral(recs), layout)
    out = run_all(batch)
    for kind in BASES:
        base = out[f"base@{kind}"]
        for cid in REDUCE:
            adv = out[f"{cid}@{kind}"]
            if cid == "triage_sc":  # clipping to the sign of A_i is the only change
                continue
            np.testing.assert_array_equal(adv.token, base.token, err_msg=f"{cid}@{kind}")
            np.testing.assert_allclose(adv.turn, base.turn, atol=1e-6, err_msg=cid)
        a_sum, _ = _traj_sums(base.token, batch)
        fail = (a_sum < 0)[np.asarray(batch.row_traj)][:, None] & np.asarray(batch.action_mask)
        np.testing.assert_array_equal(np.where(fail, out[f"iapo@{kind}"].token, 0),
                                      np.where(fail, base.token, 0))
    abstain = copy.deepcopy(recs)
    for r in abstain:
        r["traj_extras"]["trace_complete"] = 0.0
    b2, _ = pack(abstain, layout)
    o2 = run_all(b2)
    np.testing.assert_array_equal(o2["vict@grpo"].token, o2["base@grpo"].token)


def test_masking_rules():
    """ProAS MUI never adds positive mass and zeroes unreasonable actions of successful
    rollouts; ECHO leaves A_i <= 0 untouched bit for bit; Neos zeroes the prefix before the
    divergence of failed rollouts only; GGPO keeps penalties and removes rewards."""
    checked = 0
    for seed in range(4):
        recs = seeded_records(seed)
        batch, index = pack(recs, "per_step")
        out = run_all(batch)
        base = out["base@grpo"].token
        rt = np.asarray(batch.row_traj)
        a_sum, cnt = _traj_sums(base, batch)
        pos_tok = (a_sum > 0)[rt][:, None] & np.asarray(batch.action_mask)
        neg_tok = (a_sum <= 0)[rt][:, None] & np.asarray(batch.action_mask)
        mui = out["proas@grpo"].token
        assert (mui[pos_tok] <= base[pos_tok] + 1e-7).all()
        assert set(np.unique(mui[pos_tok] / base[pos_tok])) <= {0.0, 1.0}
        np.testing.assert_array_equal(out["echo@grpo"].token[neg_tok], base[neg_tok])
        assert (out["echo@grpo"].token[pos_tok] >= base[pos_tok]).all()
        for cid in ("ggpo", "ggpo_tok"):
            g = out[f"{cid}@grpo"].token
            assert (g[neg_tok] == base[neg_tok]).all() and (g <= np.maximum(base, 0)).all()
        for i, rec in enumerate(recs):
            n, k = index.traj[i], len(rec["turns"])
            d = int(rec["traj_extras"]["divergence_step"])
            turn = out["neos@grpo"].turn[n, :k]
            zero = out["neos_zero@grpo"].turn[n, :k]
            b = out["base@grpo"].turn[n, :k]
            if b[0] < 0 and 0 <= d < k:
                checked += 1
                assert (turn[:d] == 0).all() and turn[d] == pytest.approx(b[d])
                assert (zero[d + 1:] == 0).all() and (turn[d + 1:] == pytest.approx(b[d + 1:]))
            else:
                np.testing.assert_allclose(turn, b, atol=1e-7)
    assert checked > 0


def test_skillgate_channels_are_disjoint():
    recs = [r for s in range(4) for r in seeded_records(s)]
    batch, _ = pack(recs, "concatenated", pad={"num_traj": 32, "num_turns": 4, "row_len": 32})
    exe, skill = routing.skillgate_channels(batch)
    am = np.asarray(batch.action_mask)
    exe, skill = np.asarray(exe), np.asarray(skill)
    assert not (exe & skill).any() and ((exe | skill) == am).all() and skill.any()
    base = E.get("grpo")(batch)
    out = np.asarray(routing.skill_channel_credit(base, batch, normalization="raw").token)
    zero_base = routing.skill_channel_credit(base.replace(token=jnp.zeros_like(base.token)),
                                             batch, normalization="raw")
    zb = np.asarray(zero_base.token)
    assert (zb[exe] == 0).all()  # outcome channel only on execution tokens
    np.testing.assert_array_equal(out[exe], np.asarray(base.token)[exe])
    rc = np.asarray(batch.extras["read_correct"])[np.asarray(batch.row_traj)][:, None]
    np.testing.assert_array_equal(out[skill], np.broadcast_to(rc, am.shape)[skill])
    no_read = batch.replace(extras={**batch.extras,
                                    "read_correct": jnp.zeros_like(batch.extras["read_correct"])})
    zs = np.asarray(routing.skill_channel_credit(base, no_read).token)
    assert (zs[skill] == 0).all()  # a_sel never leaks into the outcome channel and back


# ----------------------------------------------------------------------------- functions


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_shapley_values(n):
    """Matches the average-over-orderings reference; efficiency, symmetry, null player."""
    rng = np.random.default_rng(n)
    v = np.float32(rng.normal(size=(5, 2 ** n)))
    v[:, 0] = 0.0
    phi = np.asarray(routing.shapley_values(v))
    for row, p in zip(v, phi):
        np.testing.assert_allclose(p, routing_ref.shapley(row.astype(np.float64).tolist()),
                                   atol=1e-5)
        assert p.sum() == pytest.approx(row[-1] - row[0], abs=1e-5)  # efficiency
    if n >= 2:  # agents 0 and 1 symmetric: v(S + 0) = v(S + 1) for S without both
        sym = np.float32(rng.normal(size=2 ** n))
        for s in range(2 ** n):
            if (s & 1) and not (s & 2):
                sym[s] = sym[(s & ~1) | 2]
        p = np.asarray(routing.shapley_values(sym))
        assert p[0] == pytest.approx(p[1], abs=1e-5)
    null = np.float32(rng.normal(size=2 ** n))  # the last agent adds nothing
    top = 1 << (n - 1)
    for s in range(top):
        null[s | top] = null[s]
    assert np.asarray(routing.shapley_values(null))[-1] == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ValueError, match="2\\^n entries"):
        routing.shapley_values(np.zeros(6))


def test_ccpo_null_agent_and_weight_zero():
    """An agent whose removal does not change R gets c_a = 0 (R_a = R): then, and with
    weight = 0, CCPO is GRPO of R within each (group, agent); with one agent acting everywhere
    that is GRPO itself."""
    recs = seeded_records(5)
    for r in recs:
        r["traj_extras"]["counterfactual_outcome"] = [r["outcome"]] * NUM_AGENTS
        for t in r["turns"]:
            t["turn_extras"]["agent"] = 2.0
    batch, _ = pack(recs, "concatenated")
    grpo = np.asarray(E.get("grpo")(batch).token)
    ccpo, sharp = routing.counterfactual_agent_advantage, routing.shapley_agent_advantage
    for hp in ({}, {"weight": 3.0}, {"weight": 0.0}):
        np.testing.assert_allclose(np.asarray(ccpo(batch, **hp).token), grpo, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sharp(batch, beta=0.0).token), grpo, atol=1e-6)


def test_triage_constants_are_the_least_squares_minimiser():
    recs = [r for s in range(3) for r in seeded_records(s)]
    batch, index = pack(recs, "concatenated", pad={"num_traj": 32, "num_turns": 4,
                                                   "row_len": 32})
    rng = np.random.default_rng(0)
    target = np.float32(rng.normal(size=batch.turn_mask.shape))
    base = np.asarray(E.get("grpo")(batch).turn)
    c = np.asarray(routing.triage_constants(target, base, batch))
    # least squares over the labelled valid turns with a one-hot role design
    role = np.asarray(batch.extras["role"])
    valid = np.asarray(batch.turn_mask) & np.asarray(batch.traj_mask)[:, None]
    lab = valid & np.isin(role, [0, 1, 2, 3])
    x = np.eye(4)[role[lab].astype(int)]
    y = (target - base)[lab].astype(np.float64)
    sol = np.linalg.lstsq(x, y, rcond=None)[0]
    np.testing.assert_allclose(c, sol, atol=1e-5)
    tg = [target[index.traj[i], :len(r["turns"])].tolist() for i, r in enumerate(recs)]
    bs = [base[index.traj[i], :len(r["turns"])].tolist() for i, r in enumerate(recs)]
    np.testing.assert_allclose(c, routing_ref.triage_constants(recs, tg, bs), atol=1e-5)
    # any other constants do worse
    def loss(cc):
        return float(((y - x @ cc) ** 2).sum())
    for _ in range(5):
        assert loss(c.astype(np.float64)) <= loss(c + rng.normal(size=4) * 0.1) + 1e-9


def test_grse_credit_matches_reference():
    recs = [r for s in range(3) for r in seeded_records(s)]
    batch, index = pack(recs, "per_step", pad={"num_traj": 32, "num_turns": 4, "num_rows": 128,
                                               "row_len": 8})
    got = np.asarray(routing.grse_credit(batch))
    exp = routing_ref.grse_credit(recs)
    for i in range(len(recs)):
        np.testing.assert_allclose(got[index.traj[i]], exp[i], atol=1e-6)
    assert np.abs(got).sum() > 0
    pad = np.ones(batch.num_traj, bool)
    pad[index.traj] = False
    assert (got[pad] == 0).all()


# ----------------------------------------------------------------------------- triage constants


def _constants(batch, axis_name=None):
    base = E.get("grpo")(batch, axis_name=axis_name)
    return routing.triage_constants(segments.local_view(batch, axis_name).extras["base"],
                                    base.turn, batch, axis_name=axis_name)


def test_triage_constants_shard_invariance():
    """The TRIAGE constants are batch-wide (psum over the axis): on 8 host devices, groups
    whole per block, the unsharded values (the registered names' shard invariance is in
    tests/test_conformance.py)."""
    devs = jax.devices()
    assert len(devs) >= 8
    mesh = Mesh(np.array(devs[:8]), ("data",))
    recs = [r for seed in range(6) for r in seeded_records(seed, num_traj=4, num_groups=2)]
    batch = pack(recs, "per_step", pad=SHARD_PAD, num_shards=8)[0]
    sm = jax.shard_map(functools.partial(_constants, axis_name="data"), mesh=mesh,
                       in_specs=(P("data"),), out_specs=P())
    got = np.asarray(jax.jit(sm)(batch))
    want = np.asarray(jax.jit(_constants)(batch))
    assert np.any(want != 0)
    np.testing.assert_allclose(got, want, atol=1e-5)


# ----------------------------------------------------------------------------- degenerate


def _one(outcome=1.0, group=0):
    rec = {"group": group, "outcome": outcome,
           "turns": [{"observation": [1], "action": [1, 2], "reward": 0.0},
                     {"observation": [2], "action": [3], "reward": 0.0}]}
    add_routing(np.random.default_rng(7), rec)
    return rec


def test_degenerate_groups_give_exact_zeros():
    """Singleton groups and zero-variance groups: GRPO gives 0, so every re-allocation (and
    its shuffled control) gives exactly 0 (no NaN). Finite credit and the all-padding batch:
    tests/test_conformance.py."""
    single = [_one(1.0, g) for g in range(3)]
    same = [_one(0.5, 0) for _ in range(4)]
    for recs in (single, same):
        out = run_all(pack(recs, "concatenated")[0])
        for key, adv in out.items():
            if key.endswith("@turn"):
                continue
            assert np.isfinite(adv.token).all() and np.isfinite(adv.turn).all(), key
            if key in ("triage@grpo", "triage_sc@grpo", "skillgate@grpo",
                       "skillgate_raw@grpo", "ccpo", "ccpo_l", "sharp", "sharp_t"):
                continue  # additive channels / per-agent rewards need not vanish
            assert (adv.token == 0).all(), key


def test_stop_gradient():
    """Stop-gradient: the labels carry no gradient into the result."""
    recs = seeded_records(2)
    batch, _ = pack(recs, "concatenated")
    batch = jax.tree.map(jnp.asarray, batch)
    floats = {k: v for k, v in batch.extras.items() if v.dtype == jnp.float32}

    def total(ex):
        b = batch.replace(extras={**batch.extras, **ex})
        out = _estimate(b, shuffled=False)
        return sum(jnp.sum(v.token) for k, v in out.items() if not k.startswith("base"))

    grads = jax.jit(jax.grad(total))(floats)
    for name, g in grads.items():
        if name == "base":  # the base advantage itself may carry gradient
            continue
        assert (np.asarray(g) == 0).all(), name


# ----------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def plain():
    batch, _ = pack([_one(1.0), _one(0.0)], "concatenated")
    return batch, E.get("grpo")(batch)


def _drop(batch, name):
    return batch.replace(extras={k: v for k, v in batch.extras.items() if k != name})


# registered name -> the extras it reads (a batch without one fails, naming it)
NEEDS = {"stamp": ("supported_citations",), "iapo": ("edges",), "self_credit": ("cite",),
         "triage": ("role",), "serl": ("relevance",), "vict": ("trace_complete", "atoms"),
         "skillgate": ("skill_mask",), "proas": ("deviation",), "neos": ("divergence_step",),
         "ggpo": ("redundant",), "ccpo": ("counterfactual_outcome", "agent"),
         "sharp": ("coalition_values",)}
# registered name -> its bad hyper-parameters, each with the message that names it
BAD_HYPER_PARAMS = {
    "stamp": [({"alpha": -1.0}, "alpha must be >= 0")],
    "iapo": [({"beta": -0.5}, "beta must be >= 0")],
    "self_credit": [({"variant": "both"}, "variant must be one of"),
                    ({"w_min": 2.0}, "w_min must lie in")],
    "triage": [({"c_progress": 1.5}, r"c_progress must lie in \[-1.0, 1.0\]"),
               ({"bound": -1.0}, "bound must be >= 0")],
    "echo": [({"eta": -1.0}, "eta must be >= 0")],
    "skillgate": [({"normalization": "batch"}, "normalization must be one of"),
                  ({"eps": 0.0}, "eps must be > 0")],
    "proas": [({"beta": 1.5}, "beta must lie in")],
    "neos": [({"after": "all"}, "after must be one of")],
    "ccpo": [({"eps": -1.0}, "eps must be > 0")],
    "sharp": [({"tool_rewards": "pair_active"}, "one entry per agent"),
              ({"ddof": 2}, "ddof must be 0 or 1")],
}
# (name, hyper-parameters, the extra dropped from the batch or None, the message)
ERRORS = ([(name, {}, extra, rf"extras\['{extra}'\]") for name, extras in NEEDS.items()
           for extra in extras]
          + [(name, hp, None, needle) for name, bad in BAD_HYPER_PARAMS.items()
             for hp, needle in bad])


@pytest.mark.parametrize("name,hp,drop,needle", ERRORS)
def test_errors_name_the_problem(plain, name, hp, drop, needle):
    batch, base = plain
    if drop:
        batch = _drop(batch, drop)
    args = (base, batch) if E.spec(name).kind == "transform" else (batch,)
    with pytest.raises(ValueError, match=needle):
        E.get(name)(*args, **hp)


def test_bad_shapes_are_named(plain):
    batch, base = plain
    bad = batch.replace(extras={**batch.extras, "role": jnp.zeros((2, 3))})
    with pytest.raises(ValueError, match=r"extras\['role'\] must have shape"):
        routing.segment_role_bonus(base, bad)
    bad = batch.replace(extras={**batch.extras, "edges": jnp.zeros((2, 4, 2), jnp.int32)})
    with pytest.raises(ValueError, match=r"extras\['edges'\] must have shape \[N, E, 3\]"):
        routing.influence_graph_reweight(base, bad)
    bad = batch.replace(extras={**batch.extras, "coalition_values": jnp.zeros((8, 6))})
    with pytest.raises(ValueError, match="2\\^n entries"):
        routing.shapley_agent_advantage(bad)


def test_former_hyper_parameter_names():
    """Renamed hyper-parameters keep working under their former names through the registry:
    echo's ``renormalize`` is ``normalize``, ccpo's ``lam`` is ``weight``."""
    for name, old, new in (("echo", "renormalize", "normalize"), ("ccpo", "lam", "weight")):
        assert E.spec(name).canonical({old: 1.0}) == {new: 1.0}, name
        with pytest.raises(ValueError, match=new):
            E.spec(name).canonical({old: 1.0, new: 1.0})
