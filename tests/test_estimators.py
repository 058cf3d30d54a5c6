"""Tests of the registered trajectory-level baselines (``estimators/outcome.py``) and of the
returns and critics (``estimators/temporal.py``).

Every registered estimator is compared with a slow reference written from its docstring
(``tests/reference/estimators_ref.py``) on hypothesis-generated records in both layouts, then
checked against the properties that apply to it (group-shift invariance, scale, the SPO
trackers' order- and padding-freedom, singleton and all-equal groups, the GAE limits), against
rlax, on degenerate inputs, and for its error messages. Padding, permutation and shard
invariance of the credit and degenerate batches: tests/test_conformance.py (with the settings
of each name's row).

Compile budget: every estimator setting in ``CONFIGS`` runs inside ONE jitted program
(``_run_all_jit``, hyper-parameters static as in ``estimators.compute``), so a batch shape
costs one compile; all batches use the fixed ``PAD`` buckets of ``tests/strategies.py`` (plus
one larger bucket, for the SPO tracker alone).

Tolerances: the references return a float32 error model per record (``RefOut.tol``): about
1e-5 absolute + 1e-5 relative, plus, for standardised outputs, float32 precision times the
input scale over the denominator (nearly-equal inputs are ill-conditioned for any float32
implementation). Exactly-equal inputs are held to exact zeros by the all-equal-group tests instead.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_agent import estimators as E
from jaxrl_agent.batch import LAYOUTS
from jaxrl_agent.rollout.records import pack_records
from tests.reference import estimators_ref as ref
from tests import families
from tests.families import assert_each, assert_same_records, shapes_of
from tests.strategies import PAD
from tests.strategies import records as records_st

P_TASKS = 8  # size of every SPO tracker state (task ids of the strategies are < 5)
FIELDS = ("token", "turn", "token_returns", "turn_returns")
BIG_PAD = {
    "concatenated": {"num_traj": 12, "num_turns": 6, "row_len": 40},
    "per_step": {"num_traj": 12, "num_turns": 6, "num_rows": 40, "row_len": 12},
}


# ----------------------------------------------------------------------------- configurations


@dataclasses.dataclass(frozen=True)
class Config:
    id: str
    name: str
    hp: dict
    drop: tuple = ()  # extras removed before the call (e.g. token_values: use turn values)


def _c(cid, name, drop=(), **hp):
    return Config(cid, name, hp, drop)


CONFIGS = [
    _c("grpo", "grpo"),
    _c("grpo_raw_ddof0", "grpo", singleton="raw", ddof=0, eps=1e-3),
    _c("dr_grpo", "dr_grpo"),
    _c("dr_grpo_raw", "dr_grpo", singleton="raw"),
    _c("rloo", "rloo"),
    _c("rloo_raw", "rloo", singleton="raw"),
    _c("reinforce_pp", "reinforce_pp"),
    _c("reinforce_pp_kl", "reinforce_pp", gamma=0.9, kl_coef=0.1, eps=1e-4),
    _c("reinforce_pp_baseline", "reinforce_pp_baseline"),
    _c("reinforce_pp_baseline_eps", "reinforce_pp_baseline", eps=1e-2),
    _c("spo", "spo"),
    _c("spo_rho05", "spo", rho=0.5, eps=1e-3),
    _c("spo_rho1", "spo", rho=1.0),
    _c("spo_rho0", "spo", rho=0.0),
    _c("spo_pp", "spo_pp"),
    _c("spo_pp_rho1", "spo_pp", rho=1.0, eps=1e-3),
    _c("rollout_level", "rollout_level"),
    _c("rollout_level_nostd_raw", "rollout_level", normalize=False, singleton="raw"),
    _c("rollout_level_rw", "rollout_level", row_weighted=True),
    _c("rollout_level_rw_nostd", "rollout_level", row_weighted=True, normalize=False,
       ddof=0, singleton="raw"),
    _c("returns", "returns"),
    _c("returns_g09", "returns", gamma=0.9),
    _c("gae", "gae"),
    _c("gae_nw", "gae", gamma=0.9, lam=0.8, normalize=False),
    _c("gae_nw_11", "gae", normalize=False),
    _c("gae_nw_lam1", "gae", gamma=0.9, lam=1.0, normalize=False),
    _c("gae_nw_lam0_turnv", "gae", drop=("token_values",), gamma=0.9, lam=0.0, normalize=False),
    _c("gae_turnv", "gae", drop=("token_values",), gamma=0.95, lam=0.5, eps=1e-4),
    _c("turn_gae", "turn_gae"),
    _c("turn_gae_turn", "turn_gae", gamma=0.9, lam=0.7, normalization="turn", eps=1e-4),
    _c("turn_gae_none", "turn_gae", gamma=0.8, lam=0.5, normalization="none"),
    _c("turn_gae_11", "turn_gae", normalization="none"),
    _c("turn_gae_lam1", "turn_gae", gamma=0.9, lam=1.0, normalization="none"),
    _c("turn_gae_lam0", "turn_gae", gamma=0.9, lam=0.0, normalization="none"),
    _c("lambda_returns", "lambda_returns"),
    _c("lambda_returns_g", "lambda_returns", gamma=0.9, lam=0.7),
    _c("lambda_returns_tok", "lambda_returns", level="token"),
    _c("lambda_returns_tok_g", "lambda_returns", level="token", gamma=0.9, lam=0.6),
    _c("sapo", "sapo"),
    _c("sapo_turn", "sapo", gamma=0.9, lam=0.7, normalization="turn", eps=1e-4),
]
CFG = {c.id: c for c in CONFIGS}
# Designed to depend on the layout (counts a rollout once per row): excluded from the
# layout-invariance test, checked against the reference in each layout instead.
LAYOUT_DEPENDENT = ("rollout_level_rw", "rollout_level_rw_nostd")


def _drop(batch, names):
    return batch.replace(extras={k: v for k, v in batch.extras.items() if k not in names})


def _estimate(ids, batch, state):
    """The configured settings ``ids`` on one batch: id -> (Advantages, new state or None)."""
    out = {}
    for cid in ids:
        c = CFG[cid]
        b = _drop(batch, c.drop) if c.drop else batch
        fn = E.get(c.name)
        out[cid] = (fn(b, state=state, **c.hp) if E.spec(c.name).stateful
                    else (fn(b, **c.hp), None))
    return out


# One compile per batch shape for every setting above.
_run_all_jit = jax.jit(functools.partial(_estimate, tuple(CFG)))


def run_all(batch, state=None):
    """All configured estimators on ``batch``, as host numpy: id -> (Advantages, new state)."""
    if state is None:
        state = E.spo_init(P_TASKS)
    return jax.tree.map(np.asarray, _run_all_jit(batch, state))


# ----------------------------------------------------------------------------- records


def fill(records):
    """A deep copy in which every turn has value/values/logprobs/ref_logprobs/token_rewards
    (zeros where missing), so every batch has the same extras (one pytree structure)."""
    recs = copy.deepcopy(records)
    for r in recs:
        for t in r["turns"]:
            n = len(t["action"])
            t.setdefault("value", 0.0)
            for key in ("values", "logprobs", "ref_logprobs", "token_rewards"):
                t.setdefault(key, [0.0] * n)
    return recs


def pack(records, layout, pad=None, task_index=None):
    """(filled records, batch with extras['token_rewards'] from the records, RecordIndex)."""
    recs = fill(records)
    batch, index = pack_records(recs, layout=layout, pad_to=pad or PAD[layout],
                                task_index=None if task_index is None else dict(task_index))
    dense = np.zeros(np.shape(batch.tokens), np.float32)
    for i, rec in enumerate(recs):
        for (row, s, e), t in zip(index.spans[i], rec["turns"]):
            dense[row, s:e] = t["token_rewards"]
    batch = batch.replace(extras={**batch.extras, "token_rewards": dense}).validate()
    return recs, batch, index


def pack_and_run(records, layout, state=None):
    """(filled records, batch, RecordIndex, ``run_all``'s outputs) of ``records`` packed in
    ``layout``."""
    recs, batch, index = pack(records, layout)
    return recs, batch, index, run_all(batch, state)


_f32 = st.floats(-3, 3, allow_nan=False, width=32)


def _r32(x):
    return [float(v) for v in np.asarray(x, np.float32)]


@st.composite
def full_records(draw, min_traj=1, max_traj=8, binary=None, dense=None):
    """strategies.records (structure, observations, actions, rewards, outcomes, groups, tasks)
    with every optional per-turn numeric field: value, values, logprobs, ref_logprobs and
    dense token_rewards. The per-token floats come from a drawn numpy seed (float32 values):
    drawing each of them through hypothesis would triple the generation time."""
    binary = draw(st.booleans()) if binary is None else binary
    recs = draw(records_st(min_traj=min_traj, max_traj=max_traj, binary=binary))
    dense = draw(st.booleans()) if dense is None else dense
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    for r in recs:
        for t in r["turns"]:
            n = len(t["action"])
            t["value"] = float(np.float32(rng.normal())) if rng.random() > 0.1 else 0.0
            t["values"] = _r32(rng.normal(size=n))
            t["logprobs"] = _r32(-rng.exponential(size=n))
            t["ref_logprobs"] = _r32(-rng.exponential(size=n))
            t["token_rewards"] = _r32(rng.uniform(-1, 1, size=n)) if dense else [0.0] * n
    return recs


@st.composite
def spo_states(draw):
    pos = st.floats(0.0625, 5.0, width=32)
    alpha = draw(st.lists(pos, min_size=P_TASKS, max_size=P_TASKS))
    beta = draw(st.lists(pos, min_size=P_TASKS, max_size=P_TASKS))
    return E.SPOState(alpha=jnp.asarray(alpha, jnp.float32), beta=jnp.asarray(beta, jnp.float32))


def strip_values(records):
    recs = copy.deepcopy(records)
    for r in recs:
        for t in r["turns"]:
            t.pop("values", None)
    return recs


def reference(c: Config, records, layout, state=None, task_index=None) -> ref.RefOut:
    recs = strip_values(records) if "token_values" in c.drop else records
    kw = dict(c.hp)
    if E.spec(c.name).stateful:
        state = E.spo_init(P_TASKS) if state is None else state
        kw.update(state=(np.asarray(state.alpha), np.asarray(state.beta)),
                  task_index=task_index)
    if c.name == "rollout_level":
        kw["layout"] = layout
    return ref.REFERENCES[c.name](recs, **kw)


# ----------------------------------------------------------------------------- comparisons


def assert_close(got, exp, tol, what):
    if got is None or exp is None:
        assert got is None and exp is None, f"{what}: got {got is None=} expected {exp is None=}"
        return
    got = np.asarray(got, np.float64)
    assert got.shape == exp.shape, f"{what}: shape {got.shape} != {exp.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite output {got}"
    err = np.abs(got - exp)
    bad = err > tol
    if bad.any():
        p = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} entries off; first at {p}: got {got[p]!r}, "
                             f"expected {exp[p]!r} (tol {tol[p]:.3g}); max err {err.max():.3g}")


def check_ref(cid, out, refout, index, batch):
    adv, new_state = out[cid]
    placed = ref.place(refout, index, shapes_of(batch))
    for f in FIELDS:
        exp = placed[f]
        assert_close(getattr(adv, f), *(exp if exp is not None else (None, None)),
                     f"{cid}.{f} [{batch.layout}]")
    if refout.state is not None:
        np.testing.assert_allclose(new_state.alpha, refout.state[0], rtol=1e-6, atol=1e-6,
                                   err_msg=f"{cid}: tracker alpha")
        np.testing.assert_allclose(new_state.beta, refout.state[1], rtol=1e-6, atol=1e-6,
                                   err_msg=f"{cid}: tracker beta")


# the record helpers of tests/families.py over every output field (returns too)
per_record = functools.partial(families.per_record, fields=FIELDS)
assert_padding_zero = functools.partial(families.assert_padding_zero, fields=FIELDS)


def group_members(batch):
    gid, tm = np.asarray(batch.group_ids), np.asarray(batch.traj_mask)
    groups = {}
    for n in np.nonzero(tm)[0]:
        groups.setdefault(int(gid[n]), []).append(int(n))
    return groups


# ----------------------------------------------------------------------------- 0. bookkeeping


def test_every_registered_estimator_has_a_reference():
    from tests.reference import all_refs
    assert set(E.names("all")) == set(all_refs.REFERENCES), \
        "a registered estimator, shaping or transform lacks a reference (or v.v.)"
    for module, refs in all_refs.MODULES.items():
        assert refs, f"{module}: no references"
    assert not set.intersection(*map(set, all_refs.MODULES.values()))


def test_every_estimator_here_is_configured():
    names = set(ref.REFERENCES)
    for name in names:
        assert sum(c.name == name for c in CONFIGS) >= 2, f"{name}: one setting only"
        for c in CONFIGS:
            if c.name == name:
                E.check_hyper_params(name, c.hp)  # settings use real hyper-parameters


def test_reference_reads_back_a_batch():
    """records_from_batch (the numpy route into the references) gives the same placed
    reference values as the records themselves."""
    from tests.strategies import random_records
    recs = random_records(np.random.default_rng(3), values=True, token_values=True,
                          logprobs=True, ref_logprobs=True)
    for layout in LAYOUTS:
        recs_f, batch, index = pack(recs, layout)
        back, idx = ref.records_from_batch(jax.tree.map(np.asarray, batch))
        assert sorted(idx.traj) == sorted(index.traj)
        for c in CONFIGS:
            if E.spec(c.name).stateful:
                continue  # task labels differ (ids vs names); the tracker is tested elsewhere
            a = ref.place(reference(c, recs_f, layout), index, shapes_of(batch))
            b = ref.place(reference(c, back, layout), idx, shapes_of(batch))
            for f in FIELDS:
                assert (a[f] is None) == (b[f] is None)
                if a[f] is not None:
                    np.testing.assert_allclose(a[f][0], b[f][0], rtol=1e-6, atol=1e-6,
                                               err_msg=f"{c.id}.{f}")


# ----------------------------------------------------------------------------- 1. vs reference


@pytest.mark.parametrize("layout", LAYOUTS)
@given(data=st.data())
def test_matches_reference(layout, data):
    """Every configured setting of every registered estimator against its reference (all
    settings on each example; the failure message lists every failing setting)."""
    records = data.draw(full_records(), label="records")
    state = data.draw(spo_states(), label="state")
    recs, batch, index, out = pack_and_run(records, layout, state)
    assert_each(("", functools.partial(
        check_ref, c.id, out, reference(c, recs, layout, state, index.task_index), index, batch))
        for c in CONFIGS)


def test_public_compute_path_matches_reference():
    """estimators.compute (host validation + its own jit cache) gives the reference values."""
    rng = np.random.default_rng(7)
    from tests.strategies import random_records
    recs = random_records(rng, num_groups=3)
    recs_f, batch, index = pack(recs, "concatenated")
    c = CFG["grpo_raw_ddof0"]
    adv = jax.tree.map(np.asarray, E.compute("grpo", batch, **c.hp))
    check_ref(c.id, {c.id: (adv, None)}, reference(c, recs_f, "concatenated"), index, batch)
    st0 = E.spo_init(P_TASKS)
    adv, new = jax.tree.map(np.asarray, E.compute("spo_pp", batch, state=st0))
    check_ref("spo_pp", {"spo_pp": (adv, new)},
              reference(CFG["spo_pp"], recs_f, "concatenated", st0, index.task_index),
              index, batch)


# ----------------------------------------------------------------------------- 2. properties

def on_grid(records, step=0.25):
    """Outcomes rounded to a coarse binary grid, so shifts and power-of-two scalings are exact
    in float32 (the properties are exact identities; the grid keeps float rounding out)."""
    recs = copy.deepcopy(records)
    for r in recs:
        r["outcome"] = float(np.round(r["outcome"] / step) * step)
    return recs


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records())
def test_p1_zero_sum_within_groups(layout, records):
    recs, batch, index, out = pack_and_run(records, layout)
    for cid in ("grpo", "dr_grpo", "rloo", "rollout_level"):
        turn = out[cid][0].turn
        r = reference(CFG[cid], recs, layout)
        tol_rec = dict(zip(index.traj, r.tol["turn"]))
        for members in group_members(batch).values():
            a = turn[members, 0]
            tol = sum(tol_rec[n] for n in members)
            assert abs(a.sum()) <= tol, f"{cid}: group {members} sums to {a.sum()}"


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records(), data=st.data())
def test_p2_groupwise_shift_invariance(layout, records, data):
    recs = on_grid(records)
    groups = sorted({r["group"] for r in recs})
    shift = {g: data.draw(st.integers(-8, 8), label=f"shift{g}") / 4 for g in groups}
    shifted = copy.deepcopy(recs)
    for r in shifted:
        r["outcome"] += shift[r["group"]]
    recs_f, b1, i1 = pack(recs, layout)
    _, b2, i2 = pack(shifted, layout)
    o1, o2 = run_all(b1), run_all(b2)
    for cid in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "rollout_level",
                "rollout_level_rw"):
        r = reference(CFG[cid], recs_f, layout)
        assert_same_records(per_record(o1[cid][0], i1), per_record(o2[cid][0], i2), r,
                            f"group shift {cid}")
    # SPO / SPO++ standardise over the whole batch: invariant to one global shift.
    c = data.draw(st.integers(-8, 8), label="global") / 4
    glob = copy.deepcopy(recs)
    for r in glob:
        r["outcome"] += c
    _, b3, i3 = pack(glob, layout)
    o3 = run_all(b3)
    for cid in ("spo", "spo_pp"):
        r = reference(CFG[cid], recs_f, layout, task_index=i1.task_index)
        assert_same_records(per_record(o1[cid][0], i1), per_record(o3[cid][0], i3), r,
                            f"global shift {cid}", factor=4.0)


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records(), scale=st.sampled_from([0.5, 2.0, 3.0, 4.0]))
def test_p3_scale(layout, records, scale):
    recs = on_grid(records)
    scaled = copy.deepcopy(recs)
    for r in scaled:
        r["outcome"] *= scale
    _, b1, i1 = pack(recs, layout)
    _, b2, _ = pack(scaled, layout)
    o1, o2 = run_all(b1), run_all(b2)
    tm = np.asarray(b1.turn_mask)
    for cid in ("grpo", "rollout_level", "rollout_level_rw", "reinforce_pp_baseline"):
        a1, a2 = o1[cid][0].turn, o2[cid][0].turn
        # invariant up to the eps in the denominator: |dA| <= |A| eps / std (std >= 0.08 on
        # the 1/4 grid for non-degenerate groups)
        np.testing.assert_allclose(a2, a1, rtol=2e-4, atol=1e-5, err_msg=f"scale {cid} x{scale}")
    for cid in ("dr_grpo", "rloo", "dr_grpo_raw", "rloo_raw", "rollout_level_nostd_raw"):
        a1, a2 = o1[cid][0].turn, o2[cid][0].turn
        np.testing.assert_allclose(a2, scale * a1, rtol=1e-5, atol=1e-6,
                                   err_msg=f"scale {cid} homogeneous x{scale}")
        assert (a2[~tm] == 0).all()


@functools.partial(jax.jit, static_argnames=("rho",))
def _spo_new_state(batch, state, rho):
    return E.get("spo")(batch, state=state, rho=rho)[1]


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=10)
@given(records=full_records(min_traj=2), data=st.data())
def test_p4_p5_spo_tracker_ignores_order_and_padding(layout, records, data):
    """The SPO trackers' new state depends on the batch's (task, outcome) pairs only: reordering
    the records (groups relabelled) or padding more changes none of it. (The credit's padding,
    permutation and shard invariance, every registered estimator: tests/test_conformance.py.)"""
    perm = data.draw(st.permutations(range(len(records))), label="perm")
    state = data.draw(spo_states(), label="state")
    recs = fill(records)
    task_index = ref.task_index_of(recs)
    permuted = []
    for j in perm:
        r = copy.deepcopy(recs[j])
        r["group"] = f"relabelled-{r['group'] * 7 + 3}"
        permuted.append(r)
    _, b1, _ = pack(recs, layout, task_index=task_index)
    _, b2, _ = pack(permuted, layout, task_index=task_index)
    _, b3, _ = pack(recs, layout, pad=BIG_PAD[layout], task_index=task_index)
    assert b3.num_traj > b1.num_traj and b3.num_turns > b1.num_turns
    o1, o2 = run_all(b1, state), run_all(b2, state)
    for c in CONFIGS:
        if o1[c.id][1] is not None:
            np.testing.assert_allclose(o1[c.id][1].alpha, o2[c.id][1].alpha, rtol=1e-6)
            np.testing.assert_allclose(o1[c.id][1].beta, o2[c.id][1].beta, rtol=1e-6)
    big = jax.tree.map(np.asarray, _spo_new_state(b3, state, rho=0.96))
    np.testing.assert_array_equal(big.alpha, o1["spo"][1].alpha)
    np.testing.assert_array_equal(big.beta, o1["spo"][1].beta)


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records())
def test_p6_singleton_groups(layout, records):
    recs = copy.deepcopy(records)
    for i, r in enumerate(recs):
        r["group"] = f"alone-{i}"
    _, batch, _ = pack(recs, layout)
    out = run_all(batch)
    tm = np.asarray(batch.turn_mask)
    outcome = np.asarray(batch.outcome)
    raw = np.where(tm, outcome[:, None], 0.0)
    for cid in ("grpo", "dr_grpo", "rloo", "rollout_level", "rollout_level_rw",
                "reinforce_pp_baseline"):
        assert (out[cid][0].turn == 0).all(), f"singleton {cid}: not 0"
        assert (out[cid][0].token == 0).all()
    for cid in ("grpo_raw_ddof0", "dr_grpo_raw", "rloo_raw", "rollout_level_nostd_raw",
                "rollout_level_rw_nostd"):
        np.testing.assert_array_equal(out[cid][0].turn, raw, err_msg=f"singleton {cid}: raw != R")


def _equalise_groups(records, data):
    recs = copy.deepcopy(records)
    value = {g: data.draw(_f32, label=f"value{g}") for g in sorted({r["group"] for r in recs})}
    for r in recs:
        r["outcome"] = value[r["group"]]
    return recs


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records(), data=st.data())
def test_p7_all_equal_groups_give_exact_zero(layout, records, data):
    recs = _equalise_groups(records, data)
    _, batch, _ = pack(recs, layout)
    out = run_all(batch)
    for cid in ("grpo", "grpo_raw_ddof0", "dr_grpo", "rloo", "rloo_raw", "dr_grpo_raw",
                "rollout_level", "rollout_level_nostd_raw", "reinforce_pp_baseline",
                "reinforce_pp_baseline_eps"):
        adv = out[cid][0]
        sizes = {g: len(m) for g, m in group_members(batch).items()}
        gid = np.asarray(batch.group_ids)
        raw_single = cid in ("grpo_raw_ddof0", "rloo_raw", "dr_grpo_raw",
                             "rollout_level_nostd_raw")
        for n in np.nonzero(np.asarray(batch.traj_mask))[0]:
            if raw_single and sizes[int(gid[n])] == 1:
                continue  # singleton under "raw": A = R
            assert (adv.turn[n] == 0).all(), f"all equal {cid}: trajectory {n} got {adv.turn[n]}"


# Deterministic counter-examples (found by hypothesis and a seeded search): groups whose
# members all have the same outcome, with unequal row counts in the per-step layout.
_RW_EQUAL = {
    "per_step": [{"group": 0, "outcome": 1.9662156105041504, "turns": [{"action": [1]}] * k}
                 for k in (2, 2, 3, 3)],
    "concatenated": [{"group": 0, "outcome": -1.779268503189087, "turns": [{"action": [1]}] * k}
                     for k in (3, 1, 4)],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_p7_rollout_level_row_weighted_all_equal_group(layout):
    _, batch, _ = pack(_RW_EQUAL[layout], layout)
    out = run_all(batch)
    for cid in ("rollout_level_rw", "rollout_level_rw_nostd"):
        assert (out[cid][0].turn == 0).all(), f"{cid}: {out[cid][0].turn[:, 0]}"


_SPO_EQUAL = [{"group": j, "task": "same", "outcome": -1.2017287015914917,
               "turns": [{"action": [1, 2]}]} for j in range(5)]


def test_p7_spo_equal_residuals_give_zero():
    _, batch, _ = pack(_SPO_EQUAL, "concatenated")
    out = run_all(batch)
    assert (out["spo"][0].turn == 0).all(), out["spo"][0].turn[:5, 0]


def test_p7_spo_pp_equal_residuals_near_zero():
    """SPO++ puts eps inside the sqrt, which damps the same 1-ulp effect to ~1e-3."""
    _, batch, _ = pack(_SPO_EQUAL, "concatenated")
    out = run_all(batch)
    assert np.abs(out["spo_pp"][0].turn).max() < 1e-2


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records())
def test_rloo_is_n_over_n_minus_1_dr_grpo(layout, records):
    _, batch, _, out = pack_and_run(records, layout)
    for members in group_members(batch).values():
        n = len(members)
        for cid_r, cid_d in (("rloo", "dr_grpo"), ("rloo_raw", "dr_grpo_raw")):
            r, d = out[cid_r][0].turn[members, 0], out[cid_d][0].turn[members, 0]
            if n == 1:
                np.testing.assert_array_equal(r, d)  # both 0 or both R
            else:
                np.testing.assert_allclose(r, n / (n - 1) * d, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records())
def test_rollout_level_unweighted_equals_grpo(layout, records):
    _, batch, _, out = pack_and_run(records, layout)
    for f in ("token", "turn"):
        np.testing.assert_array_equal(getattr(out["rollout_level"][0], f),
                                      getattr(out["grpo"][0], f))
        np.testing.assert_array_equal(getattr(out["rollout_level_nostd_raw"][0], f),
                                      getattr(out["dr_grpo_raw"][0], f))
    if layout == "concatenated":  # one row per rollout: row weights are all 1
        np.testing.assert_allclose(out["rollout_level_rw"][0].turn, out["grpo"][0].turn,
                                   rtol=1e-5, atol=1e-5)


def test_rollout_level_invariant_to_splitting_a_rollout_into_rows():
    """Per-step layout: one rollout as 1 row (1 turn) or as 3 rows (3 turns, same actions and
    the same total reward, so the same outcome). What is invariant: the rollout's advantage
    (on every turn/token of it) and every other rollout's advantage. What is not: the number
    of rows and token positions. row_weighted=True (verl-agent cross-step statistics) is not
    invariant: the split rollout gets 3x the weight."""
    others = [{"group": "g", "turns": [{"action": [7, 8], "reward": 0.0}]},
              {"group": "g", "turns": [{"action": [9], "reward": 0.5}]},
              {"group": "h", "turns": [{"action": [5], "reward": 2.0}]}]
    one = {"group": "g", "turns": [{"observation": [1], "action": [1, 2, 3, 4, 5, 6],
                                    "reward": 1.0}]}
    split = {"group": "g", "turns": [
        {"observation": [1], "action": [1, 2], "reward": 0.25},
        {"observation": [2], "action": [3, 4], "reward": 0.25},
        {"observation": [3], "action": [5, 6], "reward": 0.5}]}
    res = {}
    for key, rec in (("one", one), ("split", split)):
        _, batch, index = pack([rec] + others, "per_step")
        assert int(np.asarray(batch.outcome)[index.traj[0]]) == 1
        out = run_all(batch)
        res[key] = {cid: per_record(out[cid][0], index) for cid in
                    ("rollout_level", "rollout_level_rw", "grpo")}
        assert np.asarray(batch.action_mask).any(1).sum() == (6 if key == "split" else 4)
    for cid in ("rollout_level", "grpo"):
        a, b = res["one"][cid], res["split"][cid]
        for i in range(4):
            # every action token of rollout i carries the same value in both packings
            assert np.unique(a["token"][i]).size == 1 and np.unique(b["token"][i]).size == 1
            np.testing.assert_allclose(a["token"][i][0], b["token"][i][0], rtol=1e-6)
            np.testing.assert_allclose(b["turn"][i], b["token"][i][0], rtol=1e-6)
    a, b = res["one"]["rollout_level_rw"], res["split"]["rollout_level_rw"]
    assert abs(a["token"][1][0] - b["token"][1][0]) > 1e-3, "row weights had no effect"


# ---- SPO / SPO++


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records(), state=spo_states())
def test_spo_pp_token_weighted_mean_zero_and_unit_variance(layout, records, state):
    recs, batch, index, out = pack_and_run(records, layout, state)
    am = np.asarray(batch.action_mask)
    for cid in ("spo_pp", "spo_pp_rho1", "reinforce_pp_baseline", "reinforce_pp",
                "reinforce_pp_kl", "gae", "gae_turnv"):
        tok = out[cid][0].token
        r = reference(CFG[cid], recs, layout, state, index.task_index)
        tol = ref.place(r, index, shapes_of(batch))["token"][1]
        assert abs(tok[am].sum()) <= tol[am].sum() + 1e-5, f"{cid}: token sum {tok[am].sum()}"
    # token-weighted second moment of SPO++ = var / (var + eps), var that of the residuals
    tm = np.asarray(batch.traj_mask)
    alpha, beta = np.asarray(state.alpha, np.float64), np.asarray(state.beta, np.float64)
    task = np.asarray(batch.task_ids)
    resid = np.asarray(batch.outcome, np.float64) - alpha[task] / (alpha[task] + beta[task])
    n_tok = np.bincount(np.asarray(batch.row_traj), weights=am.sum(1),
                        minlength=batch.num_traj) * tm
    mu = (n_tok * resid).sum() / n_tok.sum()
    var = (n_tok * (resid - mu) ** 2).sum() / n_tok.sum()
    if var > 1e-3:
        m2 = (out["spo_pp"][0].token[am].astype(np.float64) ** 2).mean()
        assert m2 == pytest.approx(var / (var + 1e-8), abs=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records(min_traj=2), state=spo_states())
def test_spo_trajectory_mean_zero(layout, records, state):
    recs, batch, index, out = pack_and_run(records, layout, state)
    tm = np.asarray(batch.traj_mask)
    r = reference(CFG["spo"], recs, layout, state, index.task_index)
    a = out["spo"][0].turn[tm, 0]
    assert abs(a.sum()) <= sum(r.tol["turn"]) + 1e-5


def test_spo_vs_spo_pp_with_unequal_lengths():
    """SPO: sum_i A_i = 0 but sum_i n_i A_i != 0 for unequal lengths; SPO++: sum_{i,t} m A = 0."""
    recs = [{"group": 0, "task": "a", "outcome": 1.0, "turns": [{"action": [1]}]},
            {"group": 1, "task": "b", "outcome": 0.0, "turns": [{"action": [1, 2, 3]}]},
            {"group": 2, "task": "c", "outcome": 1.0,
             "turns": [{"action": [1, 2, 3]}, {"observation": [4], "action": [5, 6, 7]},
                       {"action": [1, 2, 3]}]}]
    for layout in LAYOUTS:
        _, batch, _ = pack(recs, layout)
        out = run_all(batch)
        am = np.asarray(batch.action_mask)
        spo_turn = out["spo"][0].turn[:3, 0]
        assert abs(spo_turn.sum()) < 1e-6
        assert abs(out["spo"][0].token[am].sum()) > 0.5, "SPO is centred per token?"
        assert abs(out["spo_pp"][0].token[am].sum()) < 1e-5
        np.testing.assert_allclose((out["spo_pp"][0].token[am] ** 2).mean(), 1.0, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records(binary=True, min_traj=2))
def test_spo_pp_equals_reinforce_pp_baseline_when_p_hat_is_the_group_mean(layout, records):
    """Honest construction: one task per group, and a tracker whose alpha/beta are the
    group's success/failure counts, so p_hat(task) = alpha / (alpha + beta) = mean_g R."""
    recs = copy.deepcopy(records)
    for r in recs:
        r["task"] = r["group"]
    _, batch, index = pack(recs, layout)
    alpha, beta = np.full(P_TASKS, 0.5, np.float32), np.full(P_TASKS, 0.5, np.float32)
    for r in recs:
        k = index.task_index[r["task"]]
        alpha[k] = beta[k] = 0.0
    for r in recs:
        k = index.task_index[r["task"]]
        alpha[k] += r["outcome"]
        beta[k] += 1.0 - r["outcome"]
    out = run_all(batch, E.SPOState(alpha=jnp.asarray(alpha), beta=jnp.asarray(beta)))
    a, b = out["spo_pp"][0], out["reinforce_pp_baseline"][0]
    np.testing.assert_allclose(a.turn, b.turn, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.token, b.token, rtol=1e-5, atol=1e-5)


# ---- tracker


def _p_hat(state):
    return np.asarray(state.alpha) / (np.asarray(state.alpha) + np.asarray(state.beta))


@given(batches=st.lists(full_records(binary=True), min_size=1, max_size=3))
@settings(max_examples=15)
def test_tracker_rho1_gives_add_half_counts(batches):
    """rho = 1, binary R, prior 0.5/0.5: p_hat = (s + 0.5) / (n + 1) over all batches seen
    (add-1/2, Krichevsky-Trofimov smoothing, also called Laplace-smoothed)."""
    ti = {k: k for k in range(4)}
    state = E.spo_init(P_TASKS)
    s, n = np.zeros(P_TASKS), np.zeros(P_TASKS)
    for recs in batches:
        _, batch, _ = pack(recs, "concatenated", task_index=ti)
        out = run_all(batch, state)
        state = out["spo_rho1"][1]
        np.testing.assert_allclose(out["spo_pp_rho1"][1].alpha, state.alpha, rtol=1e-6)
        for r in recs:
            s[r["task"]] += r["outcome"]
            n[r["task"]] += 1
        np.testing.assert_allclose(_p_hat(state), (s + 0.5) / (n + 1), rtol=1e-5)
        np.testing.assert_allclose(state.alpha + state.beta, n + 1.0, rtol=1e-5)


@given(recs=full_records(binary=True))
@settings(max_examples=10)
def test_tracker_rho1_with_uniform_prior_is_laplace(recs):
    ti = {k: k for k in range(4)}
    _, batch, _ = pack(recs, "concatenated", task_index=ti)
    state = E.spo_init(P_TASKS, alpha0=1.0, beta0=1.0)
    new = run_all(batch, state)["spo_rho1"][1]
    s, n = np.zeros(P_TASKS), np.zeros(P_TASKS)
    for r in recs:
        s[r["task"]] += r["outcome"]
        n[r["task"]] += 1
    np.testing.assert_allclose(_p_hat(new), (s + 1) / (n + 2), rtol=1e-5)


def test_tracker_one_decay_per_batch_and_absent_tasks_untouched():
    recs = [{"group": 0, "task": 0, "outcome": 1.0, "turns": [{"action": [1]}]},
            {"group": 0, "task": 0, "outcome": 0.0, "turns": [{"action": [1]}]},
            {"group": 1, "task": 0, "outcome": 1.0, "turns": [{"action": [1]}]},
            {"group": 2, "task": 2, "outcome": 1.7, "turns": [{"action": [1]}]},   # clipped
            {"group": 3, "task": 3, "outcome": -0.4, "turns": [{"action": [1]}]}]  # clipped
    ti = {k: k for k in range(4)}
    _, batch, _ = pack(recs, "per_step", task_index=ti)
    state = E.SPOState(alpha=jnp.arange(1, 9, dtype=jnp.float32),
                       beta=jnp.arange(2, 10, dtype=jnp.float32))
    out = run_all(batch, state)
    a0, b0 = np.arange(1, 9.0), np.arange(2, 10.0)
    for cid, rho in (("spo", 0.96), ("spo_rho05", 0.5), ("spo_rho0", 0.0), ("spo_pp", 0.96)):
        new = out[cid][1]
        exp_a, exp_b = a0.copy(), b0.copy()
        exp_a[0], exp_b[0] = rho * a0[0] + 2, rho * b0[0] + 1  # one decay for 3 samples
        exp_a[2], exp_b[2] = rho * a0[2] + 1, rho * b0[2] + 0
        exp_a[3], exp_b[3] = rho * a0[3] + 0, rho * b0[3] + 1
        np.testing.assert_allclose(new.alpha, exp_a, rtol=1e-6, err_msg=cid)
        np.testing.assert_allclose(new.beta, exp_b, rtol=1e-6, err_msg=cid)
    # rho = 0 forgets everything but the last batch's evidence
    new = out["spo_rho0"][1]
    np.testing.assert_allclose(_p_hat(new)[[0, 2, 3]], [2 / 3, 1.0, 0.0])


@given(batches=st.lists(full_records(), min_size=1, max_size=5))
@settings(max_examples=15)
def test_tracker_p_hat_stays_in_open_unit_interval(batches):
    """For rho in (0, 1] and a positive prior, p_hat stays in (0, 1) whatever the outcomes
    (they are clipped to [0, 1] for the update). rho = 0 can reach 0 or 1 (see the report)."""
    ti = {k: k for k in range(4)}
    states = {cid: E.spo_init(P_TASKS) for cid in ("spo", "spo_rho05", "spo_rho1")}
    for recs in batches:
        _, batch, _ = pack(recs, "concatenated", task_index=ti)
        for cid in states:
            out = run_all(batch, states[cid])
            states[cid] = out[cid][1]
            p = _p_hat(states[cid])
            assert np.all((p > 0) & (p < 1)), f"{cid}: p_hat {p}"
            assert np.isfinite(out[cid][0].token).all()


# ---- GAE limits


def _token_streams(recs, index, batch, key):
    """Per record: flattened per-token arrays of rewards (turn reward on the last token +
    dense) or values, in the trajectory's action-token order."""
    out = []
    for i, r in enumerate(recs):
        xs = []
        for t in r["turns"]:
            n = len(t["action"])
            if key == "reward":
                x = np.array(t["token_rewards"], np.float64)
                x[-1] += np.float32(t["reward"])
            elif key == "values":
                x = np.array(t["values"], np.float64)
            else:
                x = np.full(n, np.float32(t["value"]), np.float64)
            xs.append(np.float32(x).astype(np.float64))
        out.append(np.concatenate(xs))
    return out


def _rtg(r, gamma):
    g, acc = np.zeros_like(r), 0.0
    for t in reversed(range(len(r))):
        acc = r[t] + gamma * acc
        g[t] = acc
    return g


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records())
def test_p14_gae_limits(layout, records):
    recs, batch, index, out = pack_and_run(records, layout)
    tok = {cid: per_record(out[cid][0], index) for cid in
           ("gae_nw_11", "gae_nw_lam1", "gae_nw_lam0_turnv")}
    rew = _token_streams(recs, index, batch, "reward")
    val = _token_streams(recs, index, batch, "values")
    tval = _token_streams(recs, index, batch, "value")
    for i in range(len(recs)):
        tol = 1e-5 * (1 + np.abs(rew[i]).sum() + np.abs(val[i]).sum())
        # lam = 1: A = G - V (gamma = 1 and gamma = 0.9), returns = G
        for cid, g in (("gae_nw_11", 1.0), ("gae_nw_lam1", 0.9)):
            G = _rtg(rew[i], g)
            np.testing.assert_allclose(tok[cid]["token"][i], G - val[i], atol=tol, rtol=0)
            np.testing.assert_allclose(tok[cid]["token_returns"][i], G, atol=tol, rtol=0)
        # lam = 0: A = delta = r + gamma V_next - V (turn values on every token of the turn)
        v_next = np.append(tval[i][1:], 0.0)
        np.testing.assert_allclose(tok["gae_nw_lam0_turnv"]["token"][i],
                                   rew[i] + 0.9 * v_next - tval[i], atol=tol, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records(dense=False))
def test_p14_gae_reward_to_go_with_zero_values(layout, records):
    """V = 0, gamma = lam = 1: token GAE is the reward-to-go; at each turn's last action token
    it equals the turn-level return G_k (``returns``), and turn_gae equals ``returns``."""
    recs = copy.deepcopy(records)
    for r in recs:
        for t in r["turns"]:
            t["value"], t["values"] = 0.0, [0.0] * len(t["action"])
    recs, batch, index = pack(recs, layout)
    out = run_all(batch)
    rew = _token_streams(recs, index, batch, "reward")
    g_tok = per_record(out["gae_nw_11"][0], index)["token"]
    for i in range(len(recs)):
        np.testing.assert_allclose(g_tok[i], _rtg(rew[i], 1.0), atol=1e-5)
    tm = np.asarray(batch.turn_mask)
    np.testing.assert_allclose(out["turn_gae_11"][0].turn, out["returns"][0].turn, atol=1e-5)
    for i, spans in enumerate(index.spans):
        for k, (row, s, e) in enumerate(spans):
            np.testing.assert_allclose(out["gae_nw_11"][0].token[row, e - 1],
                                       out["returns"][0].turn[index.traj[i], k], atol=1e-5)
    assert (out["turn_gae_11"][0].turn[~tm] == 0).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records())
def test_p14_turn_gae_limits(layout, records):
    _, batch, _, out = pack_and_run(records, layout)
    tm = np.asarray(batch.turn_mask)
    v = np.where(tm, np.asarray(batch.extras["turn_values"], np.float64), 0.0)
    r = np.where(tm, np.asarray(batch.turn_rewards, np.float64), 0.0)
    v_next = np.concatenate([v[:, 1:], np.zeros_like(v[:, :1])], axis=1)
    tol = 1e-5 * (1 + np.abs(r).sum(1, keepdims=True) + np.abs(v).sum(1, keepdims=True))
    lam1 = out["turn_gae_lam1"][0]
    G = out["returns_g09"][0].turn
    assert np.all(np.abs(lam1.turn - np.where(tm, G - v, 0)) <= tol), "lam=1: A != G - V"
    assert np.all(np.abs(lam1.turn_returns - G) <= tol), "lam=1: returns != G"
    lam0 = out["turn_gae_lam0"][0]
    assert np.all(np.abs(lam0.turn - np.where(tm, r + 0.9 * v_next - v, 0)) <= tol)
    # lambda-returns = A^GAE + V: turn_gae's (unnormalised) returns at gamma .9, lam .7
    np.testing.assert_allclose(out["lambda_returns_g"][0].turn,
                               out["turn_gae_turn"][0].turn_returns, rtol=1e-5, atol=1e-5)
    # lam = 1: the lambda-return is the plain discounted return
    np.testing.assert_allclose(out["lambda_returns"][0].turn, out["returns"][0].turn,
                               rtol=1e-5, atol=1e-5)


# ---- multi-turn key test


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records(), data=st.data())
def test_inserting_observation_tokens_changes_nothing(layout, records, data):
    """Observation tokens (mask 0) anywhere in a row leave every estimator unchanged on the
    action tokens: GAE/REINFORCE++ carry the bootstrap and the running return through them."""
    recs = fill(records)
    more = copy.deepcopy(recs)
    budget = 8  # the concatenated row (32) holds 4 turns x (3 + 3) = 24 tokens + 8
    for r in more:
        left = budget
        for t in r["turns"]:
            k = data.draw(st.integers(0, min(2, left)), label="extra")
            left -= k
            for _ in range(k):
                pos = data.draw(st.integers(0, len(t["observation"])), label="pos")
                t["observation"].insert(pos, data.draw(st.integers(0, 99), label="tok"))
    _, b1, i1 = pack(recs, layout)
    _, b2, i2 = pack(more, layout)
    o1, o2 = run_all(b1), run_all(b2)
    for c in CONFIGS:
        r = reference(c, recs, layout, None, i1.task_index)
        assert_same_records(per_record(o1[c.id][0], i1), per_record(o2[c.id][0], i2), r,
                            f"obs-insert {c.id}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reinforce_pp_outcome_reaches_earlier_turns(layout):
    """A 3-turn trajectory whose only reward is terminal, with observation blocks between
    turns: with gamma = 1 its return is 1 on every turn (verl's reset-at-mask REINFORCE++
    would give 0 on turns 0 and 1); after whitening its turn-0 tokens equal its turn-2 tokens
    and are positive, and the token-weighted mean of A is 0."""
    recs = [{"group": 0, "outcome": 1.0, "turns": [
        {"observation": [1, 2, 3], "action": [4, 5], "reward": 0.0},
        {"observation": [6, 7], "action": [8], "reward": 0.0},
        {"observation": [9], "action": [10, 11, 12], "reward": 1.0}]},
        {"group": 0, "outcome": 0.0, "turns": [{"observation": [1], "action": [2, 3],
                                                "reward": 0.0}]}]
    recs, batch, index = pack(recs, layout)
    out = run_all(batch)
    tok = per_record(out["reinforce_pp"][0], index)["token"]
    assert np.all(tok[0] > 0.1) and np.all(tok[1] < -0.1)
    np.testing.assert_allclose(tok[0], tok[0][0], rtol=1e-6)  # G = 1 on all of its tokens
    am = np.asarray(batch.action_mask)
    assert abs(out["reinforce_pp"][0].token[am].sum()) < 1e-5
    # its value targets: with V = 0, gamma = lam = 1 the return on turn 0 is the outcome
    ret = per_record(out["gae_nw_11"][0], index)["token_returns"]
    np.testing.assert_array_equal(ret[0], np.ones(6))
    np.testing.assert_array_equal(ret[1], np.zeros(2))
    # token-level discounting (gamma = 0.9, V = 0): the return decays along the 6 action
    # tokens, across the observation blocks: turn 0's first token gets 0.9^5 of the outcome
    g = per_record(out["gae_nw_lam1"][0], index)["token_returns"][0]
    np.testing.assert_allclose(g, 0.9 ** np.arange(5, -1, -1), rtol=1e-6)


# ---- gradients


GRAD_NAMES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "rollout_level", "spo",
              "spo_pp")


def _grads(batch):
    """d sum(w * A.token) / d outcome for every name in GRAD_NAMES (one jitted program)."""
    w = jnp.asarray(np.random.default_rng(0).normal(size=np.shape(batch.tokens)), jnp.float32)

    def loss(name, o):
        b = batch.replace(outcome=o)
        if E.spec(name).stateful:
            adv = E.get(name)(b, state=E.spo_init(P_TASKS))[0]
        else:
            adv = E.get(name)(b)
        return jnp.sum(w * adv.token)

    return {name: jax.grad(functools.partial(loss, name))(batch.outcome) for name in GRAD_NAMES}


_grads_jit = jax.jit(_grads)

_GRAD_OK = [{"group": g, "task": g, "outcome": o, "turns": [{"action": [1] * (1 + j)}]}
            for j, (g, o) in enumerate([(0, 1.0), (0, 0.25), (0, -0.5), (1, 2.0), (1, 0.0)])]
_GRAD_RECORDS = {
    "ok": _GRAD_OK,
    "degenerate": _GRAD_OK + [
        {"group": 2, "task": 2, "outcome": 0.5, "turns": [{"action": [1]}]},     # singleton
        {"group": 3, "task": 3, "outcome": 0.5, "turns": [{"action": [1, 2]}]},  # all equal
        {"group": 3, "task": 3, "outcome": 0.5, "turns": [{"action": [1]}]}],
    # SPO has no groups: its degenerate case is a batch of equal residuals R - p_hat
    "equal_residuals": [dict(r, task=0, outcome=0.5) for r in _GRAD_OK],
}


@functools.lru_cache(maxsize=None)
def grads_of(which):
    _, batch, _ = pack(_GRAD_RECORDS[which], "concatenated")
    return jax.tree.map(np.asarray, _grads_jit(batch))


@pytest.mark.parametrize("name", GRAD_NAMES)
def test_grad_wrt_outcome_is_finite(name):
    """The stop-gradient on advantages belongs to the losses; here: differentiating an advantage
    w.r.t. the outcome is well defined on non-degenerate groups."""
    g = grads_of("ok")[name]
    assert np.isfinite(g).all(), g
    if name in ("dr_grpo", "rloo"):  # linear in R: the gradient is not identically 0
        assert np.abs(g).max() > 0


@pytest.mark.parametrize("name", GRAD_NAMES)
def test_grad_wrt_outcome_is_finite_on_degenerate_groups(name):
    g = grads_of("equal_residuals" if name in ("spo", "spo_pp") else "degenerate")[name]
    assert np.isfinite(g).all(), g


# ----------------------------------------------------------------------------- 3. layouts


@given(records=full_records(), state=spo_states())
def test_layout_invariance(records, state):
    """Concatenated vs per-step rows of the same records: the same .turn and the same values
    on every record's action tokens, for every configured estimator (the row-weighted
    rollout-level contrast is layout-dependent by design)."""
    recs, bc, ic = pack(records, "concatenated")
    _, bp, ip = pack(records, "per_step")
    oc, op = run_all(bc, state), run_all(bp, state)
    for c in CONFIGS:
        if c.id in LAYOUT_DEPENDENT:
            continue
        r = reference(c, recs, "concatenated", state, ic.task_index)
        assert_same_records(per_record(oc[c.id][0], ic), per_record(op[c.id][0], ip), r,
                            f"layout {c.id}")
        if oc[c.id][1] is not None:
            np.testing.assert_allclose(oc[c.id][1].alpha, op[c.id][1].alpha, rtol=1e-6)


# ----------------------------------------------------------------------------- 4. rlax oracle

rlax = pytest.importorskip("rlax")
_rlax_gae = jax.jit(jax.vmap(rlax.truncated_generalized_advantage_estimation,
                             in_axes=(0, 0, None, 0)))
_rlax_lambda = jax.jit(jax.vmap(rlax.lambda_returns, in_axes=(0, 0, 0, None)))


def _rlax_inputs(r, v, lengths, gamma):
    """r, v [B, L] zero-padded; discount gamma inside, 0 from each sequence's last step on
    (the episode ends there); values with a 0 bootstrap appended (length L + 1)."""
    L = r.shape[1]
    disc = np.where(np.arange(L)[None, :] < (lengths[:, None] - 1), gamma, 0.0)
    values = np.concatenate([v, np.zeros((v.shape[0], 1))], axis=1)
    return (jnp.asarray(r, jnp.float32), jnp.asarray(disc, jnp.float32),
            jnp.asarray(values, jnp.float32))


@given(seed=st.integers(0, 2 ** 31 - 1))
def test_token_gae_and_lambda_returns_match_rlax(seed):
    """Single-turn rows (the action is the whole row): token GAE (normalize=False) and token
    lambda-returns equal rlax's truncated GAE and lambda_returns (vmapped over rows)."""
    rng = np.random.default_rng(seed)
    T = PAD["concatenated"]["row_len"]
    n = int(rng.integers(1, 9))
    recs = []
    for i in range(n):
        L = int(rng.integers(1, T + 1))
        recs.append({"group": i % 3, "outcome": 0.0, "turns": [{
            "action": [int(x) for x in rng.integers(0, 100, L)],
            "reward": float(np.float32(rng.normal())),
            "value": 0.0,
            "values": [float(np.float32(x)) for x in rng.normal(size=L)],
            "token_rewards": [float(np.float32(x)) for x in rng.normal(size=L) * 0.3]}]})
    recs, batch, _ = pack(recs, "concatenated")
    out = run_all(batch)
    am = np.asarray(batch.action_mask)
    lengths = am.sum(1)
    r = np.asarray(batch.extras["token_rewards"], np.float64)
    r[np.arange(len(lengths)), np.maximum(lengths - 1, 0)] += \
        np.where(lengths > 0, np.asarray(batch.turn_rewards)[:, 0], 0.0)
    v = np.asarray(batch.extras["token_values"], np.float64)
    rr, disc, values = _rlax_inputs(r, v, lengths, 0.9)
    adv = np.where(am, np.asarray(_rlax_gae(rr, disc, 0.8, values)), 0.0)
    np.testing.assert_allclose(out["gae_nw"][0].token, adv, rtol=1e-5, atol=1e-5)
    lr = np.where(am, np.asarray(_rlax_lambda(rr, disc, values[:, 1:], 0.8)), 0.0)
    np.testing.assert_allclose(out["gae_nw"][0].token_returns, lr, rtol=1e-5, atol=1e-5)
    lr6 = np.where(am, np.asarray(_rlax_lambda(rr, disc, values[:, 1:], 0.6)), 0.0)
    np.testing.assert_allclose(out["lambda_returns_tok_g"][0].token, lr6, rtol=1e-5, atol=1e-5)


@given(records=full_records())
def test_turn_gae_and_lambda_returns_match_rlax(records):
    """Per-turn rewards and values, vmapped rlax over trajectories (values of length K + 1
    with a 0 bootstrap, discount 0 from the last valid turn on)."""
    _, batch, _ = pack(records, "per_step")
    out = run_all(batch)
    tm = np.asarray(batch.turn_mask)
    lengths = tm.sum(1)
    r = np.where(tm, np.asarray(batch.turn_rewards, np.float64), 0.0)
    v = np.where(tm, np.asarray(batch.extras["turn_values"], np.float64), 0.0)
    for cid, lr_cid, gamma, lam in (("turn_gae_none", None, 0.8, 0.5),
                                    ("turn_gae_11", "lambda_returns", 1.0, 1.0),
                                    ("turn_gae_lam0", None, 0.9, 0.0),
                                    (None, "lambda_returns_g", 0.9, 0.7)):
        rr, disc, values = _rlax_inputs(r, v, lengths, gamma)
        if cid is not None:
            adv = np.where(tm, np.asarray(_rlax_gae(rr, disc, lam, values)), 0.0)
            np.testing.assert_allclose(out[cid][0].turn, adv, rtol=1e-5, atol=1e-5,
                                       err_msg=cid)
            np.testing.assert_allclose(out[cid][0].turn_returns, np.where(tm, adv + v, 0.0),
                                       rtol=1e-5, atol=1e-5, err_msg=cid)
        if lr_cid is not None:
            lr = np.where(tm, np.asarray(_rlax_lambda(rr, disc, values[:, 1:], lam)), 0.0)
            np.testing.assert_allclose(out[lr_cid][0].turn, lr, rtol=1e-5, atol=1e-5,
                                       err_msg=lr_cid)


# ----------------------------------------------------------------------------- 5. degenerate


def _empty_batch(layout):
    """A batch in which every trajectory is padding (built from a packed one by masking)."""
    _, b, _ = pack([{"group": 0, "outcome": 1.0, "turns": [{"action": [1]}]}], layout)
    return b.replace(traj_mask=np.zeros_like(b.traj_mask), turn_mask=np.zeros_like(b.turn_mask),
                     action_mask=np.zeros_like(b.action_mask),
                     turn_ids=np.full_like(b.turn_ids, -1)).validate()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_padding_batch_leaves_the_tracker_untouched(layout):
    """No evidence: every SPO tracker keeps its state (the credit on an all-padding batch:
    tests/test_conformance.py)."""
    state = E.spo_init(P_TASKS)
    out = run_all(_empty_batch(layout), state)
    for c in CONFIGS:
        new = out[c.id][1]
        if new is not None:
            np.testing.assert_array_equal(new.alpha, state.alpha)
            np.testing.assert_array_equal(new.beta, state.beta)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_single_trajectory(layout):
    recs = [{"group": 0, "task": 0, "outcome": 0.75, "turns": [
        {"observation": [1], "action": [2, 3], "reward": 0.5, "value": 0.1},
        {"observation": [4], "action": [5], "reward": 0.25, "value": 0.2}]}]
    recs, batch, index = pack(recs, layout)
    out = run_all(batch)
    for c in CONFIGS:
        adv = out[c.id][0]
        assert_padding_zero(adv, batch, c.id)
        check_ref(c.id, out, reference(c, recs, layout, None, index.task_index), index, batch)
    for cid in ("grpo", "dr_grpo", "rloo", "rollout_level", "reinforce_pp_baseline", "spo",
                "spo_pp", "rollout_level_rw"):
        assert (out[cid][0].turn == 0).all(), cid  # a lone trajectory: 0
    for cid in ("grpo_raw_ddof0", "dr_grpo_raw", "rloo_raw", "rollout_level_nostd_raw"):
        np.testing.assert_array_equal(out[cid][0].turn[0, :2], [0.75, 0.75])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_rewards_and_values(layout):
    recs = [{"group": g, "task": g, "outcome": 0.0,
             "turns": [{"observation": [1], "action": [2] * (1 + k), "reward": 0.0}
                       for k in range(1 + g)]} for g in range(3)]
    recs, batch, _ = pack(recs, layout)
    out = run_all(batch)
    for c in CONFIGS:
        # (spo/spo_pp: R - p_hat = -0.5 for all, exactly representable: zero variance)
        for f in FIELDS:
            x = getattr(out[c.id][0], f)
            if x is not None:
                assert (x == 0).all(), f"{c.id}.{f}"


@pytest.mark.parametrize("layout", LAYOUTS)
@given(records=full_records(), data=st.data())
def test_all_outcomes_equal(layout, records, data):
    value = data.draw(_f32, label="value")
    recs = copy.deepcopy(records)
    for r in recs:
        r["outcome"] = value
    _, batch, _ = pack(recs, layout)
    out = run_all(batch)
    for cid in ("grpo", "dr_grpo", "rloo", "rollout_level", "reinforce_pp_baseline"):
        assert (out[cid][0].token == 0).all() and (out[cid][0].turn == 0).all(), cid
    for c in CONFIGS:
        for f in FIELDS:
            x = getattr(out[c.id][0], f)
            assert x is None or np.isfinite(x).all(), c.id


# ----------------------------------------------------------------------------- 6. errors


@pytest.fixture(scope="module")
def plain_batch():
    """A batch without any extras (no values, no reference log-probs)."""
    recs = [{"group": 0, "outcome": 1.0, "turns": [{"action": [1, 2]}]},
            {"group": 0, "outcome": 0.0, "turns": [{"action": [3]}]}]
    return pack_records(recs, pad_to=PAD["concatenated"])[0]


@pytest.mark.parametrize("name,hp,needle", [
    ("gae", {}, "token_values"),
    ("gae", {}, "turn_values"),
    ("turn_gae", {}, "turn_values"),
    ("lambda_returns", {}, "turn_values"),
    ("lambda_returns", {"level": "token"}, "token_values"),
    ("reinforce_pp", {"kl_coef": 0.1}, "ref_logprobs"),
])
def test_missing_extras_raise_naming_the_field(plain_batch, name, hp, needle):
    with pytest.raises(ValueError, match=needle):
        E.compute(name, plain_batch, **hp)


def test_spo_without_state(plain_batch):
    with pytest.raises(ValueError, match="state"):
        E.compute("spo", plain_batch)
    with pytest.raises(ValueError, match="state"):
        E.compute("spo_pp", plain_batch)
    with pytest.raises(ValueError, match="SPOState"):
        E.single_stream(plain_batch, state=None)
    with pytest.raises(ValueError, match="SPOState"):
        E.single_stream_pp(plain_batch, state={"alpha": 1})
    with pytest.raises(ValueError, match="takes no state"):
        E.compute("grpo", plain_batch, state=E.spo_init(P_TASKS))


def test_spo_task_ids_outside_the_tracker_raise():
    recs = [{"group": i, "task": i, "outcome": float(i % 2), "turns": [{"action": [1]}]}
            for i in range(4)]
    batch = pack_records(recs, pad_to=PAD["concatenated"])[0]
    with pytest.raises(ValueError, match="task"):
        jax.block_until_ready(E.compute("spo", batch, state=E.spo_init(2)))


def test_unknown_estimator_lists_the_known_ones(plain_batch):
    for call in (lambda: E.compute("grpoo", plain_batch), lambda: E.get("grpoo"),
                 lambda: E.check_hyper_params("grpoo", {})):
        with pytest.raises(ValueError) as e:
            call()
        assert "grpoo" in str(e.value)
        for name in E.names():
            assert name in str(e.value)


@pytest.mark.parametrize("name", sorted(ref.REFERENCES))
def test_unknown_hyper_parameter_lists_the_valid_ones(plain_batch, name):
    with pytest.raises(ValueError) as e:
        E.check_hyper_params(name, {"gama": 0.9})
    msg = str(e.value)
    assert "gama" in msg
    for hp in E.spec(name).hyper_params:
        assert f"{hp}=" in msg, f"{name}: {hp} not listed in {msg!r}"
    with pytest.raises(ValueError, match="gama"):
        E.compute(name, plain_batch, state=E.spo_init(P_TASKS) if E.spec(name).stateful
                  else None, gama=0.9)


@pytest.mark.parametrize("name,hp,needle", [
    ("returns", {"gamma": 1.5}, "gamma"),
    ("reinforce_pp", {"gamma": 1.5}, "gamma"),
    ("reinforce_pp", {"gamma": -0.1}, "gamma"),
    ("gae", {"gamma": 1.5}, "gamma"),
    ("gae", {"lam": 1.5}, "lam"),
    ("turn_gae", {"gamma": 1.5}, "gamma"),
    ("turn_gae", {"lam": -1.0}, "lam"),
    ("turn_gae", {"normalization": "batch"}, "normalization"),
    ("lambda_returns", {"gamma": 1.5}, "gamma"),
    ("lambda_returns", {"level": "step"}, "level"),
    ("spo", {"rho": 1.5}, "rho"),
    ("spo_pp", {"rho": -0.5}, "rho"),
    ("grpo", {"eps": 0.0}, "eps"),
    ("grpo", {"singleton": "one"}, "singleton"),
    ("rollout_level", {"eps": -1.0}, "eps"),
])
def test_invalid_hyper_parameter_values(name, hp, needle):
    recs = [{"group": 0, "outcome": 1.0, "turns": [{"action": [1], "value": 0.0}]}]
    _, batch, _ = pack(recs, "concatenated")
    state = E.spo_init(P_TASKS) if E.spec(name).stateful else None
    with pytest.raises(ValueError, match=needle):
        E.compute(name, batch, state=state, **hp)


@pytest.mark.parametrize("name,former,current", [
    ("gae", {"whiten": False}, {"normalize": False}),
    ("rollout_level", {"normalize_std": False}, {"normalize": False}),
])
def test_former_hyper_parameter_names_keep_working(name, former, current):
    """A renamed hyper-parameter still answers to its former name (configs written before)."""
    recs = [{"group": 0, "outcome": r, "turns": [{"action": [1, 2], "value": 0.25}]}
            for r in (1.0, 0.0, 0.5)]
    _, batch, _ = pack(recs, "concatenated")
    assert E.spec(name).canonical(former) == current
    np.testing.assert_array_equal(E.compute(name, batch, **former).token,
                                  E.compute(name, batch, **current).token)


@pytest.mark.parametrize("name,former,current", [
    ("hae", "norm_adv", "normalization"), ("matchtir", "lam", "gamma"),
    ("step_group", "mode", "normalization"), ("gigpo", "mode", "normalization"),
    ("bipace", "mode", "normalization"), ("bipace", "step_mode", "step_normalization"),
    ("rtmc", "mode", "normalization"), ("tree_value", "mode", "normalization"),
    ("progpo", "mode", "normalization"), ("progpo", "prefix_mode", "prefix_normalization"),
    # the string switches were called `normalize` before it became boolean-only
    ("gigpo", "normalize", "normalization"), ("turn_gae", "normalize", "normalization"),
    ("bipace", "step_normalize", "step_normalization"),
    ("progpo", "prefix_normalize", "prefix_normalization"),
])
def test_former_names_of_the_step_level_estimators(name, former, current):
    """The renamed hyper-parameters of the step-level, tree and hierarchical estimators map to
    their current names (what configs and pipelines written before the rename rely on)."""
    assert E.spec(name).canonical({former: 0.5}) == {current: 0.5}
    with pytest.raises(ValueError, match=current):
        E.spec(name).canonical({former: 0.5, current: 0.5})


def test_one_type_per_switch_name():
    """Across every registered method a hyper-parameter called ``normalize`` (or ``*_normalize``)
    is a boolean, and one called ``normalization`` (or ``*_normalization``) a string: the same
    name never means a flag in one method and a mode in another."""
    seen = {}
    for kind in ("estimator", "shaping", "transform"):
        for name in E.names(kind):
            for hp, default in E.spec(name).hyper_params.items():
                if hp == "normalize" or hp.endswith("_normalize"):
                    seen[(name, hp)] = isinstance(default, bool)
                elif hp == "normalization" or hp.endswith("_normalization"):
                    seen[(name, hp)] = isinstance(default, str)
    assert len(seen) > 20
    assert [k for k, ok in seen.items() if not ok] == []
