"""Dense reward / potential shaping and per-turn credit transforms
(jaxrl_agent/estimators/shaping.py, turn_credit.py).

Every registered name is compared with the loop references of tests/reference/shaping_ref.py
on hypothesis batches (both layouts; colliding states from tests.strategies.step_records,
extras from small discrete sets so ties are exact), then the methods' own invariants:
telescoping potentials, the GRPO invariance of PBRS, VTCA conservation, reductions to the
base estimator (bit-identical), bounds, A2TGPO's variance-does-not-drift property,
stop-gradient signals, degenerate groups and clear errors. Padding (NaN in padding too),
permutation and shard invariance and degenerate batches: tests/test_conformance.py.
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st

from jaxrl_agent import estimators as E
from jaxrl_agent.batch import LAYOUTS
from jaxrl_agent.estimators import shaping as S
from jaxrl_agent.estimators import turn_credit as T
from tests.registered import defined_in
from tests.reference import estimators_ref as eref
from tests.reference import shaping_ref as ref
from tests.families import colliding_records, packer, reference_test, shapes_of
from tests.strategies import PAD, step_records

EX = settings(max_examples=12, deadline=None)
Q = np.array([-1.0, -0.5, 0.0, 0.25, 0.5, 1.0])
U = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
J = 3  # rubric items (J != K, so [N, J] and [N, K] fields differ in shape)

CONFIGS = {
    "pbrs": ("pbrs", {}),
    "pbrs_disc": ("pbrs", dict(gamma=0.9, scale=0.5, to_outcome=True)),
    "uniform": ("uniform", {}),
    "uniform_score": ("uniform", dict(score="score", replace=False)),
    "spa": ("spa", {}),
    "spa_add": ("spa", dict(replace=False, bonus=0.3)),
    "rebel": ("rebel", {}),
    "rebel_w": ("rebel", dict(cw_state=0.5, cw_task=0.2, replace=True)),
    "red": ("red", {}),
    "red_2": ("red", dict(scale=2.0)),
    "vpr": ("vpr", {}),
    "vpr_both": ("vpr", dict(to="both", scale=0.5)),
    "vpr_turns": ("vpr", dict(to="turns", replace=True)),
    "nasa": ("nasa", {}),
    "nasa_thr": ("nasa", dict(threshold=0.25, replace=True)),
    "v_rubrics": ("v_rubrics", {}),
    "v_rubrics_prefix": ("v_rubrics", dict(mode="prefix", scale=0.5)),
    "rtg": ("reward_to_go", {}),
    "rtg_group": ("reward_to_go", dict(baseline="group", normalize=True)),
    "rtg_score": ("reward_to_go", dict(score="score", normalize=True)),
    "pica": ("pica", {}),
    "pica_joint": ("pica", dict(normalization="joint", gamma=0.9)),
    "pica_weighted": ("pica", dict(f1_weight=0.5, ig_weight=2.0)),
    "pica_rewards": ("pica", dict(potential=None, std_normalize=False, f1_weight=0.5,
                                  ig_weight=2.0)),
    "trace": ("trace", {}),
    "trace_group_acc": ("trace", dict(normalization="group", accumulate=True)),
    "trace_raw_len": ("trace", dict(normalization="none", length="answer_len")),
    "spae": ("spae", {}),
    "spae_accconf": ("spae", dict(potential=None, alpha=0.5, c_sat=0.5, saturation=0.3)),
    "efca": ("efca", {}),
    "efca_renorm": ("efca", dict(normalize=True, window=1)),
    "efca_clip": ("efca", dict(fb_coef=1.0, w_min=0.2, w_max=1.5)),
    "vtca": ("vtca", {}),
    "vtca_cohort": ("vtca", dict(normalization="cohort", rho=0.5, eta=0.5)),
    "procredit": ("procredit", {}),
    "procredit_state": ("procredit", dict(cohort="state", normalize=False)),
    "a2tgpo": ("a2tgpo", {}),
    "a2tgpo_g": ("a2tgpo", dict(gamma=0.8, weight=0.5)),
    "cast": ("cast", {}),
    "cast_slog": ("cast", dict(transform="signed_log")),
    "cast_id": ("cast", dict(transform="identity", normalization="none")),
    "oprl": ("oprl", {}),
    "oprl_state_old": ("oprl", dict(cohort="state", ref="old_logprobs")),
    "step_gain": ("step_gain", {}),
    "step_gain_mean": ("step_gain", dict(normalize=False)),
    "ups": ("ups", {}),
    "ups_group": ("ups", dict(center="group")),
    "capo": ("capo", {}),
    "capo_both": ("capo", dict(reward_correct=True)),
}

# Reductions: each of these must return the base advantage bit for bit.
NULL = {
    "trace": dict(beta=0.0), "spae": dict(alpha=0.0, c_sat=1.0),
    "efca": dict(fb_coef=0.0, loop_coef=0.0), "vtca": dict(eta=0.0),
    "procredit": dict(weight=0.0), "a2tgpo": dict(weight=0.0), "oprl": dict(weight=0.0),
    "step_gain": dict(weight=0.0), "ups": dict(weight=0.0), "capo": dict(kappa=0.0),
    "cast": dict(oracle="zero_oracle"),
}


def _apply(name, hp, batch, base, axis_name=None):
    kind = ref.KINDS[name]
    fn = E.get(name)
    ax = {} if axis_name is None else {"axis_name": axis_name}
    if kind == "shaping":
        sb = fn(batch, **hp, **ax)
        return {"turn_rewards": sb.turn_rewards, "outcome": sb.outcome,
                "token_rewards": sb.extras.get("token_rewards")}
    adv = fn(batch, **hp, **ax) if kind == "estimator" else fn(base, batch, **hp, **ax)
    return {"token": adv.token, "turn": adv.turn}


def _all(cids, batch, axis_name=None, null=False):
    ax = {} if axis_name is None else {"axis_name": axis_name}
    base = E.get("grpo")(batch, **ax)
    out = {cid: _apply(*CONFIGS[cid], batch, base, axis_name) for cid in cids}
    if null:
        out["_null"] = {n: _apply(n, hp, batch, base, axis_name)["token"]
                        for n, hp in NULL.items()}
    out["_base"] = base.token
    return out


# One config per registered name (the first listed): the programs of the per-step layout and
# of the gradient test; every variant runs in the concatenated layout.
BASIC = tuple({name: cid for cid, (name, _) in reversed(list(CONFIGS.items()))}.values())
_PROGRAMS = {"full": jax.jit(functools.partial(_all, tuple(CONFIGS), null=True)),
             "basic": jax.jit(functools.partial(_all, BASIC))}


def run_all(batch, which=None):
    which = which or ("full" if batch.layout == "concatenated" else "basic")
    return jax.tree.map(np.asarray, _PROGRAMS[which](batch))


def configs_of(out):
    return [cid for cid in CONFIGS if cid in out]


# ----------------------------------------------------------------------------- records


def fill_extras(rng, rec):
    """Every extra the module reads, from small discrete sets (exact ties and differences)."""
    q = lambda *s: [float(x) for x in rng.choice(Q, size=s)] if s else float(rng.choice(Q))  # noqa
    u = lambda *s: [float(x) for x in rng.choice(U, size=s)] if s else float(rng.choice(U))  # noqa
    rec["outcome"] = float(rng.choice([0.0, 0.5, 1.0]))
    k = len(rec["turns"])
    turns = []
    for t in rec["turns"]:
        t = dict(t)
        n = len(t["action"])
        t["turn_extras"] = {
            "potential": q(), "step_potential": q(), "progress": u(), "acc": u(), "conf": u(),
            "feedback": float(rng.choice([-1.0, 0.0, 1.0])), "contribution": q(),
            "grounded": float(rng.integers(2)), "verified": u(), "evidence": u(),
            "necessity": u(), "alignment": q(), "step_verdict": float(rng.choice([-1, 0, 1])),
            "oracle_advantage": float(rng.choice([-3.0, -1.0, 0.0, 0.0, 1.0, 2.0])),
            "zero_oracle": 0.0, "belief_state": u(), "belief_task": u(), "belief_pred": u(),
            "belief_format": u()}
        t["token_extras"] = {"prm_logprobs": q(n), "prefix_scores": q(n)}
        t["ref_logprobs"] = [-abs(x) for x in q(n)]  # log-probs are <= 0
        t["logprobs"] = [-abs(x) for x in q(n)]
        turns.append(t)
    rec["turns"] = turns
    ends = [int(x) for x in rng.integers(-1, 7, size=J)]
    rec["traj_extras"] = {
        "final_potential": q(), "final_progress": u(), "score": u(), "initial_score": q(),
        "answer_len": float(rng.integers(1, 4)), "rubric_scores": u(J),
        "rubric_start": [float(max(e - int(rng.integers(0, 3)), -1)) for e in ends],
        "rubric_end": [float(e) for e in ends]}
    rec["edges"] = [[int(rng.integers(k)), int(rng.integers(k))]
                    for _ in range(int(rng.integers(0, 5)))]


def add_extras(draw, rec):
    fill_extras(np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1))), rec)


def records(**kw):
    return step_records(extras=add_extras, **kw)


def np_records(seed, num_traj=8, groups=3):
    def turn(rng):
        return {"observation": [int(rng.integers(3))],
                "action": [int(x) for x in rng.integers(0, 2, rng.integers(1, 3))],
                "reward": float(rng.choice([-1.0, 0.0, 0.5, 1.0]))}

    def finish(rng, rec):
        fill_extras(rng, rec)
        return rec

    return colliding_records(seed, turn, finish, num_traj, groups)


pack = packer(PAD)


# ----------------------------------------------------------------------------- vs reference


def _placed_shaping(out, index, b):
    n, k, r, t = b.num_traj, b.num_turns, b.num_rows, b.row_len
    tr, oc = np.zeros((n, k)), np.zeros(n)
    for i, (v, o) in enumerate(zip(out.turn_rewards, out.outcome)):
        tr[index.traj[i], :len(v)] = v
        oc[index.traj[i]] = o
    tok = None
    if out.token_rewards is not None:
        tok = np.zeros((r, t))
        for i, per_turn in enumerate(out.token_rewards):
            for (row, a, z), v in zip(index.spans[i], per_turn):
                tok[row, a:z] = v
    return {"turn_rewards": tr, "outcome": oc, "token_rewards": tok}


def check(cid, got, recs, index, batch, base):
    name, hp = CONFIGS[cid]
    kind = ref.KINDS[name]
    fn = ref.REFERENCES[name]
    if kind == "shaping":
        exp = _placed_shaping(fn(recs, **hp), index, batch)
        for f, e in exp.items():
            g = got[f]
            if e is None:
                assert g is None, f"{cid}.{f}: expected no token rewards"
                continue
            g = np.asarray(g, np.float64)
            tol = ref.TOL_A + ref.TOL_R * np.abs(e)
            bad = np.abs(g - e) > tol
            assert not bad.any(), (f"{cid}.{f} [{batch.layout}] at "
                                   f"{np.argwhere(bad)[0]}: got {g[bad][0]}, exp {e[bad][0]}")
        return
    out = fn(recs, **hp) if kind == "estimator" else fn(recs, base, **hp)
    placed = eref.place(out, index, shapes_of(batch))
    for f in ("token", "turn"):
        e, tol = placed[f]
        g = np.asarray(got[f], np.float64)
        assert np.isfinite(g).all(), f"{cid}.{f}: non-finite"
        bad = np.abs(g - e) > tol
        assert not bad.any(), (f"{cid}.{f} [{batch.layout}] at {np.argwhere(bad)[0]}: "
                               f"got {g[bad][0]}, expected {e[bad][0]}")


def reference_checks(out, recs, index, batch):
    """Every setting the batch's layout runs against its reference (transforms of the
    reference GRPO advantage)."""
    base = eref.grpo(recs).turn
    return [("", functools.partial(check, cid, out[cid], recs, index, batch, base))
            for cid in configs_of(out)]


test_matches_reference = reference_test(EX, records(), pack, run_all, reference_checks)


def test_every_registered_name_has_a_reference_and_a_config():
    # adrs: tested in test_allocation.py (beside its reference)
    mine = (set(defined_in(S)) | set(defined_in(T))) - {"adrs"}
    assert mine == set(ref.REFERENCES)
    assert mine == {name for name, _ in CONFIGS.values()}
    for name in mine:
        assert E.spec(name).kind == ref.KINDS[name]


# ----------------------------------------------------------------------------- reductions, telescoping


@pytest.mark.parametrize("layout", ["concatenated"])
def test_null_settings_return_the_base_bit_for_bit(layout):
    out = run_all(pack(np_records(3), layout)[0], "full")
    for name, tok in out["_null"].items():
        np.testing.assert_array_equal(tok, out["_base"], err_msg=name)


_potential_rewards = jax.jit(S.potential_rewards, static_argnames=("gamma", "final_potential"))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_pbrs_telescopes(gamma):
    """sum_k gamma^k F_k = gamma^{K_i} Phi_{K_i} - Phi_0, whatever the middle states."""
    recs = np_records(5)
    b = pack(recs, "per_step")[0]
    f = np.asarray(_potential_rewards(b, gamma=gamma))
    phi = np.asarray(b.extras["potential"])
    fin = np.asarray(b.extras["final_potential"])
    kk = np.asarray(b.turn_mask).sum(1)
    disc = gamma ** np.arange(b.num_turns)
    for i in np.nonzero(np.asarray(b.traj_mask))[0]:
        np.testing.assert_allclose((f[i] * disc).sum(), gamma ** kk[i] * fin[i] - phi[i, 0],
                                   atol=1e-5)
    assert (f[~np.asarray(b.turn_mask)] == 0).all()


def test_pbrs_leaves_grpo_unchanged_when_the_group_shares_s0():
    """With Phi(terminal) = 0 and gamma = 1 each return moves by -Phi(s_0) only: GRPO
    advantages of a group that shares s_0 do not change."""
    recs = np_records(7)
    for r in recs:
        r["turns"][0]["turn_extras"]["potential"] = 0.25 * (r["group"] + 1)
    b = pack(recs, "concatenated")[0]
    base = np.asarray(E.compute("grpo", b).token)
    shaped = np.asarray(E.compute("grpo", b, shaping=[("pbrs", dict(
        to_outcome=True, final_potential="absent"))]).token)
    np.testing.assert_allclose(shaped, base, atol=1e-5)
    other = np.asarray(E.compute("grpo", b, shaping=[("pbrs", dict(to_outcome=True))]).token)
    assert not np.allclose(other, base, atol=1e-3)  # a real final potential does move it


def test_trace_rewards_telescope_and_ignore_shifts_and_duplicates():
    recs = np_records(11)
    b = pack(recs, "concatenated")[0]
    f = jax.jit(T.trace_rewards)
    r = np.asarray(f(b))
    phi = np.asarray(b.extras["potential"])
    fin = np.asarray(b.extras["final_potential"])
    tm = np.asarray(b.traj_mask)
    np.testing.assert_allclose(r.sum(1)[tm], (fin - phi[:, 0])[tm], atol=1e-6)
    shifted = b.replace(extras=dict(b.extras, potential=b.extras["potential"] + 3.0,
                                    final_potential=b.extras["final_potential"] + 3.0))
    np.testing.assert_allclose(np.asarray(f(shifted)), r, atol=1e-5)
    # a redundant call (a repeated state with an unchanged lp_gold): one more zero reward
    rec = copy.deepcopy(recs[0])
    dup = copy.deepcopy(rec["turns"][0])
    dup["turn_extras"]["potential"] = rec["turns"][1]["turn_extras"]["potential"] if \
        len(rec["turns"]) > 1 else rec["traj_extras"]["final_potential"]
    rec2 = copy.deepcopy(rec)
    rec2["turns"].insert(1, dup)
    r1 = ref.trace([rec], [[0.0] * len(rec["turns"])], normalization="none", beta=1.0).turn[0]
    r2 = ref.trace([rec2], [[0.0] * len(rec2["turns"])], normalization="none", beta=1.0).turn[0]
    assert r2[1] == 0.0 and abs(sum(r1) - sum(r2)) < 1e-9
    b2 = pack([rec2], "concatenated")[0]
    np.testing.assert_allclose(np.asarray(f(b2))[0, :len(r2)], r2, atol=1e-6)


def test_red_and_rubrics_and_uniform_conserve_mass():
    recs = np_records(13)
    for layout in LAYOUTS:
        b, index = pack(recs, layout)
        out = run_all(b)
        tm = np.asarray(b.traj_mask)
        rt = np.asarray(b.row_traj)
        per_traj = lambda x: np.bincount(rt, weights=x.sum(1), minlength=b.num_traj)  # noqa
        red = per_traj(out["red"]["token_rewards"])
        last = np.zeros(b.num_traj)
        for i, rec in enumerate(recs):
            last[index.traj[i]] = rec["turns"][-1]["token_extras"]["prefix_scores"][-1]
        np.testing.assert_allclose(red[tm], (last - np.asarray(b.extras["initial_score"]))[tm],
                                   atol=1e-5)
        rub = per_traj(out["v_rubrics"]["token_rewards"])
        np.testing.assert_allclose(rub[tm], np.asarray(b.extras["rubric_scores"]).sum(1)[tm],
                                   atol=1e-5)
        np.testing.assert_allclose(out["uniform"]["turn_rewards"].sum(1)[tm],
                                   np.asarray(b.outcome)[tm], atol=1e-6)
        nasa = out["nasa"]["turn_rewards"] - np.asarray(b.turn_rewards)
        sign = np.sign(np.asarray(b.outcome) - 0.5)
        np.testing.assert_allclose(nasa.sum(1)[tm], sign[tm], atol=1e-6)


def test_uniform_then_returns_is_the_reward_to_go():
    """Uniform redistribution composed with the turn-return reader gives S (K_i - k) / K_i,
    non-increasing in k for S >= 0."""
    recs = np_records(17)
    b = pack(recs, "per_step")[0]
    adv = E.compute("returns", b, shaping=[("uniform", dict(score="score"))])
    g = np.asarray(adv.turn)
    s = np.asarray(b.extras["score"])
    kk = np.asarray(b.turn_mask).sum(1)
    for i in np.nonzero(np.asarray(b.traj_mask))[0]:
        exp = s[i] * (kk[i] - np.arange(kk[i])) / kk[i]
        np.testing.assert_allclose(g[i, :kk[i]], exp, atol=1e-6)
        assert (np.diff(g[i, :kk[i]]) <= 1e-7).all()


def test_verifier_density():
    v = np.asarray(S.verifier_density(np.array([[1, 0, 1, 0], [1, 1, 1, 1]]),
                                      np.array([[1, 1, 1, 1], [1, 1, 0, 0]])))
    np.testing.assert_allclose(v, [0.5, 1.0])
    assert float(S.verifier_density(np.zeros((0,)))) == 0.0


# ----------------------------------------------------------------------------- method props


_vtca_credit = jax.jit(T.vtca_credit, static_argnames=("rho",))


@pytest.mark.parametrize("rho", [0.0, 0.3, 0.5, 1.0])
def test_vtca_conserves_progress_and_bounds_the_share(rho):
    recs = np_records(19, num_traj=8)
    b = pack(recs, "concatenated")[0]
    c = np.asarray(_vtca_credit(b, rho=rho))
    prog = np.asarray(b.extras["progress"])
    fin = np.asarray(b.extras["final_progress"])
    tm = np.asarray(b.traj_mask)
    np.testing.assert_allclose(c.sum(1)[tm], (fin - prog[:, 0])[tm], atol=1e-6)
    delta = np.asarray(S.potential_rewards(b, potential="progress",
                                           final_potential="final_progress"))
    # a turn keeps at least (1 - rho) of its own positive progress, all of its negative one
    pos = delta > 0
    assert (c[pos] >= (1 - rho) * delta[pos] - 1e-6).all()
    # no edges: c = Delta; only negative progress: nothing is passed
    no_edges = b.replace(extras=dict(b.extras, edges=jnp.full_like(b.extras["edges"], -1)))
    np.testing.assert_allclose(np.asarray(_vtca_credit(no_edges, rho=rho)), delta, atol=1e-7)
    falling = jnp.broadcast_to(jnp.arange(b.num_turns, 0, -1, dtype=jnp.float32), b.turn_mask.shape)
    neg = b.replace(extras=dict(b.extras, progress=falling,
                                final_progress=jnp.zeros(b.num_traj)))
    d_neg = np.asarray(S.potential_rewards(neg, potential="progress",
                                           final_potential="final_progress"))
    assert (d_neg <= 0).all()
    np.testing.assert_allclose(np.asarray(_vtca_credit(neg, rho=rho)), d_neg, atol=1e-7)


def test_vtca_hand_example():
    """Turns 0 -> 1 -> 2 with progress 0, 0, 0.5, 1 (Delta = 0, 0.5, 0.5); turn 2 used the
    artifacts of turns 0 and 1, turn 1 used turn 0's. rho = 0.4:
    turn 1 gives 0.2 to turn 0; turn 2 gives 0.2, split 0.1 / 0.1 to turns 0 and 1.
    c = (0.3, 0.4, 0.3), summing to 1."""
    rec = {"group": 0, "outcome": 1.0, "edges": [[0, 2], [1, 2], [0, 1], [0, 1], [2, 2]],
           "traj_extras": {"final_progress": 1.0},
           "turns": [{"observation": [k], "action": [1],
                      "turn_extras": {"progress": p}} for k, p in enumerate([0.0, 0.0, 0.5])]}
    b = pack([rec], "per_step")[0]
    np.testing.assert_allclose(np.asarray(_vtca_credit(b, rho=0.4))[0, :3], [0.3, 0.4, 0.3],
                               atol=1e-6)
    np.testing.assert_allclose(ref.vtca_credit(rec, rho=0.4), [0.3, 0.4, 0.3], atol=1e-9)


def test_pica_gamma_zero_gives_own_info_gain_plus_outcome():
    recs = np_records(23)
    b = pack(recs, "concatenated")[0]
    pica = S.pivot_info_gain_advantage
    adv = jax.tree.map(np.asarray, jax.jit(functools.partial(pica, gamma=0.0))(b))
    exp = ref.pica(recs, gamma=0.0)
    got = eref.place(exp, pack(recs, "concatenated")[1], shapes_of(b))["turn"][0]
    np.testing.assert_allclose(adv.turn, got, atol=1e-4)
    # gamma = 0: A_k - A_last = IG~_k, its own info gain only; gamma = 1 accumulates the later
    # ones: A1_k - A1_{k+1} = IG~_k = A0_k - A0_last on every intermediate turn
    a1 = np.asarray(jax.jit(functools.partial(pica, gamma=1.0))(b).turn)
    a0 = adv.turn
    moved = False
    for i, k_i in enumerate(np.asarray(b.turn_mask).sum(axis=1)):
        for k in range(int(k_i) - 1):
            np.testing.assert_allclose(a1[i, k] - a1[i, k + 1], a0[i, k] - a0[i, k_i - 1],
                                       atol=1e-4)
            moved |= abs(a1[i, k] - a0[i, k]) > 1e-4
    assert moved


def test_spae_potential_is_bounded_and_minus_one_when_confident_and_wrong():
    a, c = np.meshgrid(np.linspace(0, 1, 41), np.linspace(0, 1, 41))
    phi = np.asarray(T.spae_potential(a, c))
    assert phi.min() >= -1 - 1e-6 and phi.max() <= 1 + 1e-6
    assert float(T.spae_potential(0.0, 1.0)) == -1.0 and float(T.spae_potential(1.0, 1.0)) == 1.0


def test_a2tgpo_variance_does_not_drift_with_depth():
    rng = np.random.default_rng(0)
    n, k = 40000, 6
    x = rng.normal(size=(n, k)).astype(np.float32)
    lens = rng.integers(1, k + 1, size=n)
    valid = np.arange(k)[None, :] < lens[:, None]
    for gamma in (1.0, 0.9, 0.5):
        a = np.asarray(T.variance_rescaled_returns(jnp.asarray(x), jnp.asarray(valid), gamma))
        for j in range(k):
            v = a[valid[:, j], j]
            assert abs(v.var() - 1.0) < 0.05, (gamma, j, v.var())
        assert (a[~valid] == 0).all()
    # the plain discounted sum (gamma = 1) does drift: var = remaining length
    plain = np.where(valid, np.cumsum(np.where(valid, x, 0)[:, ::-1], 1)[:, ::-1], 0)
    assert plain[lens == k, 0].var() > 4


_clip = jax.jit(T.a2tgpo_clip_range, static_argnames=("eps0", "kappa", "eps_min", "eps_max"))


def test_a2tgpo_clip_range_matches_reference_is_bounded_and_monotone():
    recs = np_records(29)
    for layout in LAYOUTS:
        b, index = pack(recs, layout)
        c = np.asarray(_clip(b, eps0=0.2, kappa=0.8, eps_min=0.12, eps_max=0.3))
        exp = ref.a2tgpo_clip_range(recs, eps0=0.2, kappa=0.8, eps_min=0.12, eps_max=0.3)
        for i, per_turn in enumerate(exp):
            for (row, a, z), v in zip(index.spans[i], per_turn):
                np.testing.assert_allclose(c[row, a:z], v, atol=1e-6)
        am = np.asarray(b.action_mask)
        assert (c[~am] == 0).all() and c[am].min() >= 0.12 and c[am].max() <= 0.3
    # it plugs into the PPO loss as a per-token clip range
    from jaxrl_agent.losses.policy import ppo
    adv = E.compute("grpo", b)
    lp = jnp.asarray(b.old_logprobs) + 0.3
    s, d = ppo(lp, b, adv, clip_low=jnp.asarray(c), clip_high=jnp.asarray(c))
    assert np.isfinite(float(s)) and float(d) > 0


def test_cast_term_has_batch_rms_alpha_and_is_odd():
    recs = np_records(31)
    b = pack(recs, "concatenated")[0]
    out = run_all(b)
    term = out["cast"]["turn"] - np.asarray(E.compute("grpo", b).turn)
    tm = np.asarray(b.turn_mask)
    np.testing.assert_allclose(np.sqrt((term[tm] ** 2).mean()), 0.3, rtol=1e-5)
    a = np.asarray(b.extras["oracle_advantage"])
    assert (np.sign(term[tm]) == np.sign(a[tm])).all()


def test_rebel_schedules_and_bounds():
    steps = jnp.arange(0, 120)
    for sched in ("linear", "cosine", "exp", "constant"):
        w = np.asarray(S.decay_weight(steps, total_steps=100, schedule=sched, start=1.0,
                                      end=0.1, warmup=10))
        assert (np.diff(w) <= 1e-7).all(), sched
        assert w[0] == pytest.approx(1.0) and w[:11].min() == pytest.approx(1.0)
        if sched != "constant":
            assert w[-1] == pytest.approx(0.1, abs=1e-6)
    cw = [np.asarray(x) for x in S.rebel_component_weights(steps, total_steps=100,
                                                           consistency_exp=2.0)]
    for x in cw:
        assert (np.diff(x) <= 1e-7).all() and x.min() >= 0.01 - 1e-6 and x.max() <= 1.0
    out = run_all(pack(np_records(37), "concatenated")[0])
    r = out["rebel_w"]["turn_rewards"]
    assert r.min() >= 0 and r.max() <= 0.3 * 0.5 + 0.4 * 0.2 + 0.3 + 0.1 + 1e-6


def test_spa_bonus_is_a_bounded_indicator_and_decomposition_loss():
    recs = np_records(41)
    b = pack(recs, "per_step")[0]
    out = run_all(b)
    bonus = out["spa"]["turn_rewards"] - np.asarray(b.extras["contribution"])
    tm = np.asarray(b.turn_mask)
    assert set(np.round(bonus[tm], 6)) <= {0.0, 0.5, 1.0}
    assert (bonus[~tm] == 0).all()
    # the decomposition loss is minimised (0) by contributions that sum to R
    c = jnp.where(b.turn_mask, (b.outcome / jnp.maximum(b.turn_mask.sum(1), 1))[:, None], 0.0)
    assert float(S.spa_decomposition_loss(c, b)) < 1e-10
    g = jax.grad(lambda x: S.spa_decomposition_loss(x, b))(c + 0.1)
    assert np.abs(np.asarray(g)).sum() > 0  # trains the estimator


# ----------------------------------------------------------------------------- gradients


def test_signals_carry_no_gradient():
    """The gradient of every output with respect to every signal field is 0."""
    b = pack(np_records(43), "concatenated")[0]
    floats = {k: v for k, v in b.extras.items() if np.asarray(v).dtype.kind == "f"}

    def total(ex):
        out = _PROGRAMS["basic"](b.replace(extras=dict(b.extras, **ex)))
        leaves = [x for cid, x in out.items() if not cid.startswith("_")]
        return sum(jnp.sum(v) for d in leaves for v in jax.tree.leaves(d))

    grads = jax.grad(total)(floats)
    for k, g in grads.items():
        assert np.all(np.asarray(g) == 0), k


# ----------------------------------------------------------------------------- degenerate
# (padding, NaN in padding, permutation, shards, singleton / all-equal / all-padding batches:
# tests/test_conformance.py runs every registered name, with the settings of its row)


def test_degenerate_groups_give_no_contrast():
    """A lone trajectory: reward-to-go and step gain have no peers, so 0. Four identical
    trajectories: every peer-normalised term is exactly 0 (no contrast)."""
    one = np_records(53, num_traj=1)
    out = run_all(pack(one, "concatenated")[0])
    assert (out["rtg"]["turn"] == 0).all() and (out["step_gain"]["turn"] == 0).all()
    same = [copy.deepcopy(one[0]) for _ in range(4)]
    out = run_all(pack(same, "concatenated")[0])
    for cid in ("rtg", "rtg_group", "pica", "pica_joint", "trace", "procredit", "a2tgpo",
                "oprl", "step_gain", "vtca_cohort"):
        assert np.isfinite(out[cid]["turn"]).all(), cid
        assert (out[cid]["turn"] == 0).all(), cid  # identical members: no contrast


# ----------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def plain():
    return pack([{"group": 0, "outcome": 1.0, "turns": [{"observation": [1], "action": [1]}]}],
                "concatenated")[0]


@pytest.fixture(scope="module")
def full():
    return pack(np_records(59), "concatenated")[0]


@pytest.mark.parametrize("name", sorted(ref.REFERENCES))
def test_missing_extras_are_named(plain, name):
    base = E.compute("grpo", plain)
    hp = {"uniform": {"score": "score"}, "reward_to_go": {"score": "score"}}.get(name, {})
    with pytest.raises(ValueError, match=r"needs extras\['"):
        if ref.KINDS[name] == "transform":
            E.get(name)(base, plain, **hp)
        else:
            E.get(name)(plain, **hp)


@pytest.mark.parametrize("name,hp,needle", [
    ("pbrs", {"gamma": 1.5}, "gamma must lie in"),
    ("trace", {"normalization": "z"}, "normalization must be one of"),
    ("trace", {"eps": 0.0}, "eps must be > 0"),
    ("pica", {"normalization": "both"}, "normalization must be one of"),
    ("reward_to_go", {"baseline": "x"}, "baseline must be one of"),
    ("vtca", {"rho": 1.5}, "rho must lie in"),
    ("efca", {"window": -1}, "window must be"),
    ("efca", {"w_min": 2.0, "w_max": 1.0}, "w_min <= w_max"),
    ("procredit", {"cohort": "x"}, "cohort must be one of"),
    ("cast", {"transform": "tanh"}, "transform must be one of"),
    ("vpr", {"to": "x"}, "to must be one of"),
    ("v_rubrics", {"mode": "x"}, "mode must be one of"),
    ("ups", {"center": "x"}, "center must be one of"),
    ("trace", {"potential": "step_verdict", "final_potential": "rubric_scores"},
     r"must have shape \[N\] = "),
])
def test_bad_hyper_parameters_are_named(full, name, hp, needle):
    base = E.compute("grpo", full)
    with pytest.raises(ValueError, match=needle):
        if ref.KINDS[name] == "transform":
            E.get(name)(base, full, **hp)
        else:
            E.get(name)(full, **hp)


def test_bad_schedule_and_clip_arguments(full):
    with pytest.raises(ValueError, match="schedule must be one of"):
        S.decay_weight(0, total_steps=10, schedule="step")
    with pytest.raises(ValueError, match="exp schedule needs"):
        S.decay_weight(0, total_steps=10, schedule="exp", end=0.0)
    with pytest.raises(ValueError, match="must exceed warmup"):
        S.decay_weight(0, total_steps=10, warmup=10)
    with pytest.raises(ValueError, match="eps_min <= eps_max"):
        T.a2tgpo_clip_range(full, eps_min=0.3, eps_max=0.2)
