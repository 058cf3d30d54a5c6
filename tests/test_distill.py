"""Tests of the distillation methods (jaxrl_agent/losses/distill.py and
jaxrl_agent/estimators/distill.py): references in both layouts and every aggregation mode,
gradients against finite differences of the reference, stop-gradient of every teacher and
signal input, teacher = student, NaN in padding, degenerate batches, each method's invariants,
clear errors, and shard invariance on 8 host devices of the losses (the distillation credit's
padding, permutation and shard invariance: tests/test_conformance.py)."""

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
from jaxrl_agent import losses as L
from jaxrl_agent.estimators import distill as DE
from jaxrl_agent.losses import distill as D
from tests.registered import defined_in
from tests.reference import distill_ref as ref
from tests.reference.losses_ref import aggregate as aggregate_ref
from tests.strategies import make_batch, random_records, step_records

LAYOUTS = ("concatenated", "per_step")
AGGS = L.AGG_MODES
M_NEG = 3
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0,
                                                    "xla_llvm_disable_expensive_passes": True})
LOSSES = defined_in(D, kinds=("loss",))
STATE = D.craft_init(lambda_distill=1.7)

# (registry name, hyper-parameters): every setting runs in one jitted program per shape.
SETTINGS = (
    ("sdl", {}),
    ("sdar", {}),
    ("sdar", {"gate": "none"}),
    ("sdar", {"gate": "external", "weight": "weight"}),
    ("sdar", {"gate_delta_sign": "dsign", "gate_beta": 2.0}),
    ("sdar", {"gate_delta_sign": -1.0}),
    ("edge", {}),
    ("edge", {"above_f_mean": True}),
    ("ucob", {}),
    ("ucob", {"gate": "none", "gap": "turn_gap"}),
    ("icsd", {}),
    ("icsd", {"trust": "sdl", "w_min": 0.2}),
    ("craft", {"cti": False, "polarize": False}),
    ("craft", {"cti": True, "polarize": False}),
    ("craft", {"cti": False, "polarize": True}),
    ("craft", {}),
    ("craft", {"controller": True}),
    ("craft", {"level": "step", "credit": "scaled", "temperature": 0.5}),
    ("treeopsd", {}),
    ("treeopsd", {"beta": 0.5, "delta": 0.3}),
    ("t_reg", {"sign": "pref"}),
    ("t_reg", {"sign": "pref", "reference": None, "temperature": 0.5}),
    ("weighted_sft", {}),
    ("weighted_sft", {"weights": "weight", "mask": "selection_mask"}),
)
EST_SETTINGS = (
    ("opd", {}),
    ("opd", {"beta": 0.5, "mask": "selection_mask", "clip": 0.5}),
    ("credit", {}),
    ("credit", {"level": "sequence", "beta": 2.0}),
    ("credit", {"variant": "mean"}),
    ("seed", {"weight": 0.3}),
    ("seed", {"student": "contrast_logprobs", "clip": 0.4}),
    ("cny", {"weight": 2.0}),
)


def _lib_kw(name, hp):
    kw = dict(hp)
    if name == "craft" and kw.get("controller"):
        kw["controller_state"] = STATE
    return kw


def _ref_kw(name, hp):
    kw = dict(hp)
    if name == "craft" and kw.get("controller"):
        kw["lambda_distill"] = float(STATE.lambda_distill)
    return kw


# ----------------------------------------------------------------------------- batches


def with_signals(batch, seed, *, lp_noise=0.3):
    """Adds every signal the module reads (random, 0 in padding) and returns (batch, lp)."""
    rng = np.random.default_rng(seed)
    m = np.asarray(batch.action_mask)
    tm = np.asarray(batch.turn_mask)
    trm = np.asarray(batch.traj_mask)
    shape, (n, k) = m.shape, tm.shape

    def tok(x):
        return np.where(m, x, 0.0).astype(np.float32)

    old = tok(-np.abs(rng.normal(0.8, 0.6, shape)))
    ex = dict(batch.extras)
    ex["teacher_logprobs"] = tok(old + rng.normal(0, 0.6, shape))
    ex["other_logprobs"] = tok(old + rng.normal(0, 0.6, shape))
    ex["contrast_logprobs"] = tok(old + rng.normal(0, 0.6, shape))
    ex["ref_logprobs"] = tok(old + rng.normal(0, 0.2, shape))
    ex["negative_logprobs"] = np.where(m[..., None], old[..., None]
                                       + rng.normal(0, 0.8, shape + (M_NEG,)),
                                       0.0).astype(np.float32)
    ex["selection_mask"] = m & (rng.random(shape) < 0.5)
    ex["gate"] = tok(rng.random(shape))
    ex["weight"] = np.where(tm, rng.random((n, k)) * 2, 0.0).astype(np.float32)
    ex["turn_gap"] = np.where(tm, rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], (n, k)),
                              0.0).astype(np.float32)
    ex["tree_credit"] = np.where(tm, rng.normal(0, 0.6, (n, k)), 0.0).astype(np.float32)
    ex["dsign"] = np.where(trm, rng.choice([-1.0, 1.0], n), 0.0).astype(np.float32)
    ex["view"] = np.where(trm, rng.integers(0, 2, n), 0.0).astype(np.float32)
    ex["return_gap"] = np.where(trm, rng.choice([-1.0, 0.0, 0.5, 1.0], n), 0.0).astype(
        np.float32)
    ex["advantages"] = np.where(trm, rng.normal(0, 1, n), 0.0).astype(np.float32)
    ex["pref"] = np.where(trm, rng.choice([-1.0, 0.0, 1.0], n), 0.0).astype(np.float32)
    lp = tok(old + rng.normal(0, lp_noise, shape))
    b = batch.replace(old_logprobs=old, extras=ex)
    return jax.tree.map(jnp.asarray, b), jnp.asarray(lp)


def signal_batch(recs, layout, seed):
    """``with_signals`` on the records' batch in ``layout``: (batch, lp, the batch's host copy
    for the references)."""
    batch, lp = with_signals(make_batch(recs, layout), seed)
    return batch, lp, ref.host(batch)


def _fixed(layout="concatenated", seed=0, num_traj=8):
    recs = random_records(np.random.default_rng(seed), num_traj=num_traj, num_groups=3)
    return with_signals(make_batch(recs, layout), seed)


# ----------------------------------------------------------------------------- jitted bundles


@_jit
def _losses(lp, batch):
    """Every setting: its pair in every aggregation mode and the gradient of the token_mean
    sum w.r.t. lp."""
    out, seen = [], set()
    for name, hp in SETTINGS:
        fn = LOSSES[name]
        kw = _lib_kw(name, hp)
        (_, pair), grad = jax.value_and_grad(lambda x: (fn(x, batch, **kw)[0],
                                                        fn(x, batch, **kw)), has_aux=True)(lp)
        pairs = {"token_mean": pair}
        if name not in seen:  # every mode for the first setting of each loss (compile time)
            pairs.update({agg: fn(lp, batch, agg=agg, **kw) for agg in AGGS[1:]})
        seen.add(name)
        out.append((pairs, grad))
    return out


@_jit
def _advantages(batch):
    base = E.get("grpo")(batch)
    out = []
    for name, hp in EST_SETTINGS:
        spec = E.spec(name)
        adv = spec.fn(batch, **hp) if spec.kind == "estimator" else spec.fn(base, batch, **hp)
        out.append((adv.token, adv.turn))
    return base.token, out


def _close(actual, desired, rtol=2e-4, atol=2e-4):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(desired, np.float64),
                               rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- references


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=10)
@given(recs=step_records(min_traj=2), seed=st.integers(0, 2**31 - 1))
def test_losses_match_reference(layout, recs, seed):
    batch, lp, nb = signal_batch(recs, layout, seed)
    lp64 = np.asarray(lp, np.float64)
    for (name, hp), (pairs, grad) in zip(SETTINGS, _losses(lp, batch)):
        kw = _ref_kw(name, hp)
        per_token, mask = ref.LOSS_TOKENS[name](nb, lp64, **kw)
        for agg in pairs:
            want = aggregate_ref(per_token, mask, nb["row_traj"], agg)
            scale = 1.0 + abs(want[0])
            _close(pairs[agg][0], want[0], atol=3e-4 * scale)
            _close(pairs[agg][1], want[1])
        g = ref.token_gradient(name, nb, lp64, **kw)
        _close(grad, g, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=10)
@given(recs=step_records(min_traj=1), seed=st.integers(0, 2**31 - 1))
def test_advantages_match_reference(layout, recs, seed):
    batch, _, nb = signal_batch(recs, layout, seed)
    base, outs = _advantages(batch)
    base = np.asarray(base, np.float64)
    for (name, hp), (tok, turn) in zip(EST_SETTINGS, outs):
        fn = ref.REFERENCES[name]
        want = fn(nb, **hp) if E.spec(name).kind == "estimator" else fn(nb, base, **hp)
        _close(tok, want["token"], atol=5e-4)
        _close(turn, want["turn"], atol=5e-4)


def test_every_registered_name_has_a_reference():
    credit = defined_in(DE)
    assert set(credit) <= set(ref.REFERENCES)
    assert set(LOSSES) == set(ref.LOSS_REFERENCES)
    assert {E.spec(n).kind for n in credit} == {"estimator", "transform"}
    tested = {n for n, _ in SETTINGS} | {n for n, _ in EST_SETTINGS} | {"topk_kl"}  # below
    assert tested == set(LOSSES) | set(credit)


def test_pipeline_composes_a_transform():
    batch, _ = _fixed()
    pipe = E.Pipeline.build("grpo", then=[("seed", {"weight": 0.5})])
    adv = jax.jit(pipe)(batch)
    want = ref.seed(ref.host(batch), np.asarray(E.get("grpo")(batch).token), weight=0.5)
    _close(adv.token, want["token"])
    # ``lam`` is the former name of ``weight``: a pipeline that still uses it gets the same.
    former = jax.jit(E.Pipeline.build("grpo", then=[("seed", {"lam": 0.5})]))(batch)
    np.testing.assert_array_equal(np.asarray(former.token), np.asarray(adv.token))


# ----------------------------------------------------------------------------- no gradient, padding


def _float_leaves(batch):
    floats = {k: v for k, v in batch.extras.items() if jnp.issubdtype(v.dtype, jnp.floating)}
    floats["old_logprobs"] = batch.old_logprobs
    return floats


def _rebuild(batch, floats):
    ex = {**batch.extras, **{k: v for k, v in floats.items() if k != "old_logprobs"}}
    return batch.replace(old_logprobs=floats["old_logprobs"], extras=ex)


@_jit
def _signal_grads(lp, batch):
    floats = _float_leaves(batch)
    out = []
    for name, hp in SETTINGS:
        kw = _lib_kw(name, hp)
        out.append(jax.grad(lambda f: LOSSES[name](lp, _rebuild(batch, f), **kw)[0])(floats))
    base = E.get("grpo")(batch)
    for name, hp in EST_SETTINGS:
        spec = E.spec(name)

        def total(f):
            b = _rebuild(batch, f)
            adv = spec.fn(b, **hp) if spec.kind == "estimator" else spec.fn(base, b, **hp)
            return jnp.sum(adv.token) + jnp.sum(adv.turn)
        out.append(jax.grad(total)(floats))
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_gradient_into_teacher_or_signals(layout):
    """Every teacher, behaviour, reward, gap, credit and weight input is stop-gradient."""
    batch, lp = _fixed(layout, seed=3)
    for grads in _signal_grads(lp, batch):
        for name, g in grads.items():
            assert not np.any(np.asarray(g)), name


def _nan_padding(batch, lp):
    m = np.asarray(batch.action_mask)
    tm = np.asarray(batch.turn_mask)
    trm = np.asarray(batch.traj_mask)

    def spoil(x):
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            return x
        if x.shape[:2] == m.shape:
            keep = m.reshape(m.shape + (1,) * (x.ndim - 2))
        elif x.shape[:2] == tm.shape:
            keep = tm
        else:
            keep = trm
        return np.where(keep, x, np.nan).astype(x.dtype)

    ex = {k: spoil(v) for k, v in batch.extras.items()}
    b = batch.replace(old_logprobs=spoil(batch.old_logprobs), extras=ex,
                      outcome=spoil(batch.outcome))
    return jax.tree.map(jnp.asarray, b), jnp.asarray(spoil(lp))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nan_in_padding_changes_nothing(layout):
    """NaN in every padded entry (log-probs, extras, outcome) changes no loss value or
    gradient (the losses have no conformance row; the distillation credit's padding,
    permutation and shard invariance: tests/test_conformance.py)."""
    batch, lp = _fixed(layout, seed=5, num_traj=6)
    bad_batch, bad_lp = _nan_padding(batch, lp)
    for (p0, g0), (p1, g1) in zip(_losses(lp, batch), _losses(bad_lp, bad_batch)):
        for agg in p0:
            np.testing.assert_array_equal(np.asarray(p0[agg]), np.asarray(p1[agg]))
        np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_masked_batch_gives_zero_pairs_and_finite_gradients(layout):
    batch, lp = _fixed(layout, seed=6)
    empty = batch.replace(action_mask=jnp.zeros_like(batch.action_mask),
                          traj_mask=jnp.zeros_like(batch.traj_mask),
                          turn_mask=jnp.zeros_like(batch.turn_mask))
    for pairs, grad in _losses(lp, empty):
        for agg in pairs:
            assert float(pairs[agg][0]) == 0.0 and float(pairs[agg][1]) == 0.0
        assert not np.any(np.asarray(grad))


def _one_per_loss(lp, batch):
    out, seen = [], set()
    for name, hp in SETTINGS:
        if name not in seen:
            seen.add(name)
            out.append(LOSSES[name](lp, batch, agg="traj_mean_token_mean", **_lib_kw(name, hp)))
    gate = batch.extras["gate"]
    no_gate = batch.replace(extras={k: v for k, v in batch.extras.items() if k != "gate"})
    out.append(D.confidence_gated_distillation(lp, no_gate, gate="external", gate_values=gate))
    return out


_one_per_loss_jit = _jit(_one_per_loss)


def test_extra_padding_changes_nothing():
    """More padding trajectories, turns, rows and columns give the same pairs."""
    recs = random_records(np.random.default_rng(22), num_traj=5, num_groups=2)
    small, lp = with_signals(make_batch(recs, "per_step"), 22)
    big_pad = {"num_traj": 16, "num_turns": 8, "num_rows": 64, "row_len": 16}
    big = make_batch(recs, "per_step", pad_to=big_pad)
    m_s, m_b = np.asarray(small.action_mask), np.asarray(big.action_mask)
    tm_s, tm_b = np.asarray(small.turn_mask), np.asarray(big.turn_mask)

    def move(x):  # copy the real entries of a small-batch array into the big layout
        x = np.asarray(x)
        if x.shape[:2] == m_s.shape:
            out = np.zeros(m_b.shape + x.shape[2:], x.dtype)
            out[m_b] = x[m_s]
        elif x.shape[:2] == tm_s.shape:
            out = np.zeros(tm_b.shape + x.shape[2:], x.dtype)
            out[tm_b] = x[tm_s]
        else:
            out = np.zeros((big.num_traj,) + x.shape[1:], x.dtype)
            out[:x.shape[0]] = x
        return out

    big = big.replace(old_logprobs=move(small.old_logprobs),
                      extras={k: move(v) for k, v in small.extras.items()})
    big = jax.tree.map(jnp.asarray, big)
    for p0, p1 in zip(_one_per_loss_jit(lp, small), _one_per_loss_jit(jnp.asarray(move(lp)), big)):
        _close(p1[0], p0[0], atol=1e-5)
        _close(p1[1], p0[1], atol=0)
    _close(_one_per_loss_jit(lp, small)[-1][0],
           D.confidence_gated_distillation(lp, small, gate="external")[0],
           atol=1e-6)  # gate_values= is the same external gate as the extras field


# ----------------------------------------------------------------------------- teacher = student


@_jit
def _teacher_is_student(lp, batch):
    """Every loss with lp_T = lp_S (and the behaviour = lp_S where it is the teacher)."""
    ex = dict(batch.extras, teacher_logprobs=lp, other_logprobs=lp,
              negative_logprobs=jnp.repeat(lp[..., None], M_NEG, axis=-1))
    b = batch.replace(extras=ex)
    b_edge = b.replace(old_logprobs=lp)
    out = {}
    for name, hp in (("sdl", {}), ("edge", {}), ("icsd", {"trust": "sdl"}), ("craft", {}),
                     ("craft", {"level": "step", "credit": "scaled"}),
                     ("craft", {"cti": False, "polarize": True}), ("sdar", {}),
                     ("ucob", {})):
        bb = b_edge if name == "edge" else b
        kw = _lib_kw(name, hp)
        out[f"{name} {hp}"] = jax.value_and_grad(lambda x: LOSSES[name](x, bb, **kw)[0])(lp)
    base = E.get("grpo")(batch)
    b_opd = b.replace(old_logprobs=lp)
    out["opd"] = E.get("opd")(b_opd).token
    out["seed"] = (base.token, E.spec("seed").fn(base, b_opd, weight=0.7).token)
    out["cny"] = (base.token, E.spec("cny").fn(base, b_opd).token)
    out["credit"] = (E.get("credit")(b).token, E.get("credit")(b, level="sequence").token)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_teacher_equal_to_student(layout):
    batch, lp = _fixed(layout, seed=7)
    out = _teacher_is_student(lp, batch)
    m = np.asarray(batch.action_mask)
    for key, val in out.items():
        if key in ("opd",):
            assert not np.any(np.asarray(val))
        elif key in ("seed", "cny"):
            np.testing.assert_array_equal(np.asarray(val[0]), np.asarray(val[1]))
        elif key == "credit":
            assert not np.any(np.asarray(val[0])) and not np.any(np.asarray(val[1]))
        elif key.split()[0] in ("sdar", "ucob"):
            # SDAR keeps pulling toward the teacher: loss 0, gradient -g = -1/2 per token
            # (UCOB with a nonzero gap: -|d| / 2).
            value, grad = val
            assert abs(float(value)) < 1e-6
            if key.startswith("sdar"):
                _close(grad, np.where(m, -0.5, 0.0), atol=1e-6)
        else:
            value, grad = val
            assert float(value) == 0.0, key
            assert not np.any(np.asarray(grad)), key


# ----------------------------------------------------------------------------- methods


def test_opd_is_linear_in_beta_and_zero_off_mask():
    batch, _ = _fixed(seed=8)
    a1 = E.get("opd")(batch).token
    a3 = E.get("opd")(batch, beta=3.0).token
    _close(a3, 3.0 * np.asarray(a1), atol=1e-6)
    am = np.asarray(E.get("opd")(batch, mask="selection_mask").token)
    assert not np.any(am[~np.asarray(batch.extras["selection_mask"])])


def test_sdl_nonnegative():
    batch, lp = _fixed(seed=9)
    per = D.sdl_tokens(lp, batch.extras["teacher_logprobs"], batch.old_logprobs)
    assert np.all(np.asarray(per)[np.asarray(batch.action_mask)] >= -1e-6)


def test_sdar_gate_bounds_gradient_and_off_gate_is_cross_entropy():
    batch, lp = _fixed(seed=10)
    m = np.asarray(batch.action_mask)
    g = jax.grad(lambda x: D.confidence_gated_distillation(x, batch)[0])(lp)
    g = np.asarray(g)[m]
    assert np.all((g < 0) & (g > -1))
    ce = jax.grad(lambda x: D.confidence_gated_distillation(x, batch, gate="none")[0])(lp)
    np.testing.assert_array_equal(np.asarray(ce), np.where(m, -1.0, 0.0))


def test_edge_gate_needs_positive_gain():
    batch, lp = _fixed(seed=11)
    view = np.asarray(batch.extras["view"])
    # E-trajectories score lower than every F one: no group admits distillation
    worse = np.where(view > 0.5, -5.0, 5.0).astype(np.float32)
    b = batch.replace(outcome=jnp.asarray(worse))
    total, denom = D.gain_gated_experience_distillation(lp, b)
    assert float(total) == 0.0 and float(denom) == 0.0
    grad = jax.grad(lambda x: D.gain_gated_experience_distillation(x, b)[0])(lp)
    assert not np.any(np.asarray(grad))
    better = batch.replace(outcome=jnp.asarray(-worse))
    admit, gain = D.edge_admitted(better)
    assert np.asarray(admit).any() and np.all(np.asarray(gain)[np.asarray(admit)] > 0)


def test_ucob_antisymmetric_and_zero_gap():
    batch, lp = _fixed(seed=12)
    other = batch.extras["other_logprobs"]
    gap = batch.extras["return_gap"]
    neg = batch.replace(extras=dict(batch.extras, return_gap=-gap))

    def loss(a, b_, bb):
        return D.return_gap_bidirectional_distillation(a, bb, other_logprobs=b_)[0]

    v1, (ga1, gb1) = jax.value_and_grad(loss, argnums=(0, 1))(lp, other, batch)
    v2, (ga2, gb2) = jax.value_and_grad(loss, argnums=(0, 1))(other, lp, neg)
    _close(v1, v2, atol=1e-6)
    _close(ga1, gb2, atol=1e-6)
    _close(gb1, ga2, atol=1e-6)
    assert np.any(np.asarray(ga1)) and np.any(np.asarray(gb1))
    zero = batch.replace(extras=dict(batch.extras, return_gap=jnp.zeros_like(gap)))
    v0, g0 = jax.value_and_grad(lambda x: D.return_gap_bidirectional_distillation(
        x, zero, other_logprobs=other)[0])(lp)
    assert float(v0) == 0.0 and not np.any(np.asarray(g0))


def test_icsd_weights_properties():
    batch, lp = _fixed("per_step", seed=13)
    m = np.asarray(batch.action_mask)
    weights = _jit(D.icsd_weights, static_argnames=("normalize_mass", "w_min"))
    w, c = weights(lp, batch)
    w, c = np.asarray(w), np.asarray(c)
    nb = ref.host(batch)
    # mass conservation per turn: sum c w = sum c
    _close(ref._turn_of_tokens(nb, w * c), ref._turn_of_tokens(nb, c), atol=1e-5)
    # u < 0 gives w < 1 before the mass step, u > 0 gives w > 1
    raw, _ = weights(lp, batch, normalize_mass=False, w_min=0.0)
    raw = np.asarray(raw)
    lt, old = np.asarray(batch.extras["teacher_logprobs"]), np.asarray(batch.old_logprobs)
    g = lt - np.asarray(lp)
    gbar = np.asarray(jnp.asarray(ref._turn_of_tokens(nb, g)))
    gbar_tok = np.zeros_like(g)
    for r, t in zip(*np.nonzero(m)):
        gbar_tok[r, t] = gbar[nb["row_traj"][r], nb["turn_ids"][r, t]]
    a = np.asarray(batch.extras["advantages"])[nb["row_traj"]][:, None]
    u = np.exp(np.asarray(lp) - old) * a * (g - gbar_tok)
    assert np.all(raw[m & (u < -1e-4)] < 1) and np.all(raw[m & (u > 1e-4)] > 1)
    # A = 0 everywhere: w = 1 exactly before the mass step, and after it up to rounding
    zero = batch.replace(extras=dict(batch.extras, advantages=jnp.zeros_like(
        batch.extras["advantages"])))
    w0, _ = weights(lp, zero, normalize_mass=False)
    np.testing.assert_array_equal(np.asarray(w0), np.where(m, 1.0, 0.0))
    w1, _ = weights(lp, zero)
    _close(w1, np.where(m, 1.0, 0.0), atol=1e-6)


@_jit
def _craft_off_and_k3(lp, batch):
    out = []
    for agg in AGGS:
        def off(x):
            return D.counterfactual_sign_aware_distillation(x, batch, cti=False, controller=False,
                                                            polarize=False, agg=agg)

        def base(x):
            return L.k3(x, batch, ref_logprobs=batch.extras["teacher_logprobs"], agg=agg)

        out.append(((off(lp), jax.grad(lambda y: off(y)[0])(lp)),
                    (base(lp), jax.grad(lambda y: base(y)[0])(lp))))
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_craft_all_pillars_off_is_bit_identical_to_baseline(layout):
    batch, lp = _fixed(layout, seed=14)
    for (p0, g0), (p1, g1) in _craft_off_and_k3(lp, batch):
        assert jnp.array_equal(p0[0], p1[0]) and jnp.array_equal(p0[1], p1[1])
        assert jnp.array_equal(g0, g1)
        assert float(p0[0]) > 0


def test_craft_each_pillar_switch_matters():
    batch, lp = _fixed(seed=15)
    outs = {}
    for cti in (False, True):
        for ctl in (False, True):
            for pol in (False, True):
                outs[(cti, ctl, pol)] = D.counterfactual_sign_aware_distillation(
                    lp, batch, cti=cti, controller=ctl, polarize=pol, controller_state=STATE)[0]
    for i in range(3):
        for key, val in outs.items():
            if key[i]:
                other = list(key)
                other[i] = False
                assert float(val) != float(outs[tuple(other)]), (i, key)


def test_craft_cti_zero_for_equal_deltas_and_shift_invariant():
    batch, lp = _fixed(seed=16)
    m = np.asarray(batch.action_mask)
    nb = ref.host(batch)
    counts = np.zeros(batch.num_traj)
    for r, t in zip(*np.nonzero(m)):
        counts[nb["row_traj"][r]] += 1
    per_tok = (0.7 / np.maximum(counts, 1))[nb["row_traj"]][:, None]
    equal = np.where(m, np.asarray(lp) + per_tok, 0.0).astype(np.float32)
    c = D.craft_credit(lp, batch, teacher_logprobs=jnp.asarray(equal))
    _close(c, 0.0, atol=1e-5)
    c0 = np.asarray(D.craft_credit(lp, batch))
    assert np.abs(c0).max() > 1e-3
    shifted = np.asarray(batch.extras["teacher_logprobs"]) + np.where(m, per_tok, 0.0)
    c1 = D.craft_credit(lp, batch, teacher_logprobs=jnp.asarray(shifted, jnp.float32))
    # same CTI per group (the token signs follow the shifted g_t)
    _close(np.abs(c1), np.abs(c0), atol=1e-5)


def test_craft_controller_is_a_pure_update():
    s = D.craft_init(lambda_distill=1.0, lambda_kl=2.0, activity=0.5)
    same = D.craft_controller(s, 0.5, target=0.5)
    _close(same.lambda_distill, 1.0, atol=0)
    _close(same.lambda_kl, 2.0, atol=0)
    up = jax.jit(functools.partial(D.craft_controller, eta=0.2))(s, 1.0)
    assert float(up.activity) == pytest.approx(0.55)
    assert float(up.lambda_distill) == pytest.approx(np.exp(0.2 * 0.05))
    assert float(up.lambda_kl) == pytest.approx(2.0 * np.exp(-0.2 * 0.05))
    conv = D.craft_controller(s, 1.0, eta=0.2, converse=True)
    assert float(conv.lambda_distill) < 1.0 < float(up.lambda_distill)


def test_treeopsd_target_gradient_and_finite_difference():
    batch, _ = _fixed("per_step", seed=17)
    m = np.asarray(batch.action_mask)
    old = batch.old_logprobs
    nb = ref.host(batch)
    beta, delta = 0.5, 0.4
    target = np.zeros(m.shape, np.float32)
    credit = np.asarray(batch.extras["tree_credit"])
    for r, t in zip(*np.nonzero(m)):
        target[r, t] = credit[nb["row_traj"][r], nb["turn_ids"][r, t]]
    target = np.where(m, np.clip(target / beta, -delta, delta), 0.0).astype(np.float32)
    assert np.abs(target).max() <= delta

    def loss(x):
        return D.tree_credit_log_ratio_regression(x, batch, beta=beta, delta=delta)[0]

    # zero gradient at the target ratio
    at = jnp.asarray(np.asarray(old) + target)
    assert np.abs(np.asarray(jax.grad(loss)(at))).max() < 1e-6
    # at pi_theta = pi_b the gradient is the policy gradient with A = l*
    g = jax.grad(loss)(old)
    pg = jax.grad(lambda x: L.reinforce(x, batch, jnp.asarray(target))[0])(old)
    _close(g, pg, atol=1e-6)
    v = np.where(m, np.random.default_rng(0).normal(size=m.shape), 0.0).astype(np.float32)
    h = 1e-2
    fd = (loss(old + h * v) - loss(old - h * v)) / (2 * h)
    _close(fd, -np.sum(target * v), rtol=1e-3, atol=1e-3)


def test_credit_infonce_bound():
    batch, _ = _fixed(seed=18)
    m = np.asarray(batch.action_mask)
    big = np.where(m, 0.0, 0.0).astype(np.float32)
    negs = np.where(m[..., None], -30.0, 0.0).astype(np.float32) + np.zeros(
        (1, 1, M_NEG), np.float32)
    b = batch.replace(extras=dict(batch.extras, teacher_logprobs=jnp.asarray(big),
                                  negative_logprobs=jnp.asarray(negs)))
    bound = np.log(M_NEG + 1)
    for level in ("token", "sequence"):
        tok = np.asarray(E.get("credit")(b, level=level).token)
        assert np.all(tok[m] <= bound + 1e-5)
        assert tok[m].max() > bound - 1e-3  # the bound is attained by a dominant teacher
        rand = np.asarray(E.get("credit")(batch, level=level).token)
        assert np.all(rand[m] <= bound + 1e-5)


def test_weighted_sft_masks_and_weights():
    batch, lp = _fixed("per_step", seed=19)
    sel = np.asarray(batch.extras["selection_mask"])
    total, denom = D.weighted_sft(lp, batch, mask="selection_mask")
    assert float(denom) == sel.sum()
    _close(total, -np.asarray(lp)[sel].sum(), atol=1e-5)
    g = np.asarray(jax.grad(lambda x: D.weighted_sft(x, batch, mask="selection_mask")[0])(lp))
    np.testing.assert_array_equal(g, np.where(sel, -1.0, 0.0))


# ----------------------------------------------------------------------------- errors


def test_clear_errors():
    batch, lp = _fixed(seed=20)
    bare = batch.replace(extras={})
    with pytest.raises(ValueError, match="teacher_logprobs"):
        D.ratio_weighted_reverse_kl(lp, bare)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        E.get("opd")(bare)
    with pytest.raises(ValueError, match="negative_logprobs"):
        E.get("credit")(batch.replace(extras={"teacher_logprobs": batch.extras[
            "teacher_logprobs"]}))
    with pytest.raises(ValueError, match="view"):
        D.gain_gated_experience_distillation(lp, bare)
    with pytest.raises(ValueError, match="return_gap"):
        D.return_gap_bidirectional_distillation(
            lp, bare.replace(extras={"other_logprobs": batch.extras["other_logprobs"]}))
    with pytest.raises(ValueError, match="gate must be one of"):
        D.confidence_gated_distillation(lp, batch, gate="hard")
    with pytest.raises(ValueError, match="gate_beta"):
        D.confidence_gated_distillation(lp, batch, gate_beta=0.0)
    with pytest.raises(ValueError, match="beta"):
        E.get("opd")(batch, beta=-1.0)
    with pytest.raises(ValueError, match="controller_state"):
        D.counterfactual_sign_aware_distillation(lp, batch, controller=True)
    with pytest.raises(ValueError, match="level"):
        D.counterfactual_sign_aware_distillation(lp, batch, level="turn")
    with pytest.raises(ValueError, match="delta"):
        D.tree_credit_log_ratio_regression(lp, batch, delta=0.0)
    with pytest.raises(ValueError, match="w_min"):
        D.influence_weighted_distillation(lp, batch, w_min=1.5)
    with pytest.raises(ValueError, match="shape"):
        D.ratio_weighted_reverse_kl(lp[:, :5], batch)
    with pytest.raises(ValueError, match="shape"):
        D.ratio_weighted_reverse_kl(lp, batch, teacher_logprobs=lp[:, :5])
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        D.weighted_sft(lp, batch.replace(extras=dict(batch.extras, weight=jnp.ones(3))),
                       weights="weight")
    with pytest.raises(ValueError, match="mask"):
        E.spec("cny").fn(E.get("grpo")(batch), batch, mask=None)
    with pytest.raises(ValueError, match="agg mode"):
        D.ratio_weighted_reverse_kl(lp, batch, agg="mean")
    with pytest.raises(ValueError, match="M >= 1"):
        E.get("credit")(batch.replace(extras=dict(
            batch.extras, negative_logprobs=batch.extras["teacher_logprobs"])))


# ----------------------------------------------------------------------------- sharding

_SHARD_PAD = {"num_traj": 64, "num_turns": 4, "num_rows": 256, "row_len": 8}
# the losses with statistics beyond one token: batch-wide (ICSD), per group (EDGE, CRAFT),
# per trajectory (T-REG)
SHARD_SETTINGS = (("icsd", {}), ("edge", {}), ("craft", {}), ("t_reg", {"sign": "pref"}))


def _global(lp, batch, axis_name=None):
    red = (lambda x: x) if axis_name is None else (lambda x: jax.lax.psum(x, axis_name))
    out = []
    for name, hp in SHARD_SETTINGS:
        aggs = ("token_mean", "traj_mean_token_mean") if name == "edge" else ("token_mean",)
        for agg in aggs:
            s, d = LOSSES[name](lp, batch, agg=agg, axis_name=axis_name, **hp)
            out.append(L.safe_ratio(red(s), red(d)))
    return jnp.stack(out)


def _value_and_grad(f):
    def combined(lp, batch):
        v = f(lp, batch)
        return jnp.sum(v * (1.0 + jnp.arange(v.shape[0]))), v
    return _jit(lambda lp, b: jax.grad(combined, has_aux=True)(lp, b)[::-1])


def _sharded(lp, batch):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    return jax.shard_map(lambda x, b: _global(x, b, "data"), mesh=mesh,
                         in_specs=(P("data"), P("data")), out_specs=P())(lp, batch)


def test_shard_invariance():
    """Over 8 devices (groups whole per shard) every loss and its gradient equals the
    unsharded run; ICSD's batch std is psummed. The per-step layout only: the losses run the
    same code on both, and here a shard block holds several rows per trajectory."""
    assert len(jax.devices()) == 8
    recs = random_records(np.random.default_rng(21), num_traj=16, num_groups=8)
    batch = make_batch(recs, "per_step", num_shards=8, pad_to=_SHARD_PAD)
    batch, lp = with_signals(batch, 21)
    vals, grad = _value_and_grad(_sharded)(lp, batch)
    vals0, grad0 = _value_and_grad(_global)(lp, batch)
    _close(vals, vals0, atol=1e-5)
    _close(grad, grad0, atol=1e-5)
    assert np.abs(np.asarray(grad0)).sum() > 0


# ----------------------------------------------------------------------------- top-K forward KL
# ``topk_kl`` reads the student's log-probs of the teacher's top-K ids (``student_topk_logprobs``
# [R, T, K]), not ``logprobs``: its own tests, on the same batches.

TOPK, VOCAB = 3, 6


def _topk_inputs(batch, seed, k=TOPK, vocab=VOCAB, same=False):
    """Teacher and student next-token distributions over ``vocab`` ids at every position
    (random logits; the student's equal to the teacher's with ``same``): the batch with the
    teacher's top-k log-probs (largest first) in extras['teacher_topk_logprobs'], the student's
    log-probs of the same ids, and both full log-softmaxes [R, T, vocab]. 0 outside the action
    tokens."""
    rng = np.random.default_rng(seed)
    m = np.asarray(batch.action_mask)
    zt = rng.normal(0, 1.5, m.shape + (vocab,))
    zs = zt if same else rng.normal(0, 1.5, m.shape + (vocab,))
    lt_full = zt - np.log(np.exp(zt).sum(-1, keepdims=True))
    ls_full = zs - np.log(np.exp(zs).sum(-1, keepdims=True))
    ids = np.argsort(-lt_full, axis=-1, kind="stable")[..., :k]
    keep = m[..., None]
    lt = np.where(keep, np.take_along_axis(lt_full, ids, -1), 0.0).astype(np.float32)
    ls = np.where(keep, np.take_along_axis(ls_full, ids, -1), 0.0).astype(np.float32)
    b = batch.replace(extras={**batch.extras, "teacher_topk_logprobs": jnp.asarray(lt)})
    return b, jnp.asarray(ls), lt_full, ls_full


@_jit
def _topk_pairs(ls, batch):
    """Every aggregation mode's pair, and the gradient of the token_mean sum w.r.t. ``ls``."""
    lp = jnp.zeros(batch.action_mask.shape)
    pairs = {agg: D.topk_forward_kl(lp, batch, student_topk_logprobs=ls, agg=agg)
             for agg in AGGS}
    grad = jax.grad(lambda x: D.topk_forward_kl(lp, batch, student_topk_logprobs=x)[0])(ls)
    return pairs, grad


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=10)
@given(recs=step_records(min_traj=2), seed=st.integers(0, 2**31 - 1))
def test_topk_kl_matches_reference(layout, recs, seed):
    batch, ls, _, _ = _topk_inputs(make_batch(recs, layout), seed)
    nb = ref.host(batch)
    pairs, grad = _topk_pairs(ls, batch)
    lp = np.zeros(nb["action_mask"].shape)
    for agg in AGGS:
        want = ref.LOSS_REFERENCES["topk_kl"](nb, lp, student_topk=np.asarray(ls), agg=agg)
        _close(pairs[agg][0], want[0], atol=3e-4 * (1.0 + abs(want[0])))
        _close(pairs[agg][1], want[1])
    # d sum / d ls = -p_T on the action tokens: a cross-entropy toward the teacher's top K
    lt = np.asarray(batch.extras["teacher_topk_logprobs"], np.float64)
    want_g = np.where(nb["action_mask"][..., None], -np.exp(lt), 0.0)
    _close(grad, want_g, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_topk_kl_with_every_token_is_the_forward_kl(layout):
    """K = V: the value is KL(p_T || p_S) at every action token, >= 0; with the student equal
    to the teacher it is 0, and so is its gradient w.r.t. the student's logits (with K < V
    the value is 0 there too, but the mass outside the top K is still pushed onto it)."""
    batch, ls, lt_full, ls_full = _topk_inputs(_fixed(layout, seed=3)[0], seed=3, k=VOCAB)
    m = np.asarray(batch.action_mask)
    kl = np.where(m, (np.exp(lt_full) * (lt_full - ls_full)).sum(-1), 0.0)
    s, d = D.topk_forward_kl(jnp.zeros(m.shape), batch, student_topk_logprobs=ls)
    _close(s, kl.sum(), atol=1e-4)
    _close(d, m.sum())
    assert kl[m].min() >= 0 and kl[m].max() > 0

    def from_logits(z, b, ids):  # student logits -> log-probs of the teacher's top-k ids
        ls_k = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), ids, axis=-1)
        return D.topk_forward_kl(jnp.zeros(m.shape), b, student_topk_logprobs=ls_k)[0]

    for k in (VOCAB, TOPK):
        same, _, lt_same, _ = _topk_inputs(_fixed(layout, seed=4)[0], seed=4, k=k, same=True)
        ids = jnp.asarray(np.argsort(-lt_same, axis=-1, kind="stable")[..., :k])
        v, g = jax.value_and_grad(from_logits)(jnp.asarray(lt_same, jnp.float32), same, ids)
        assert abs(float(v)) < 1e-5
        g = np.abs(np.asarray(g))
        assert g.max() < 1e-5 if k == VOCAB else g.max() > 1e-3


def test_topk_kl_padding_teacher_zeros_and_no_teacher_gradient():
    """NaN in every padded entry changes nothing; a teacher entry of probability 0 (-inf) on an
    action token adds 0 and a finite gradient; no gradient reaches the teacher's log-probs."""
    batch, ls = _topk_inputs(_fixed("per_step", seed=5, num_traj=6)[0], seed=5)[:2]
    m = np.asarray(batch.action_mask)[..., None]
    spoiled = batch.replace(extras={**batch.extras, "teacher_topk_logprobs": jnp.asarray(
        np.where(m, batch.extras["teacher_topk_logprobs"], np.nan))})
    (p0, g0), (p1, g1) = (_topk_pairs(ls, batch),
                          _topk_pairs(jnp.where(m, ls, jnp.nan), spoiled))
    for agg in AGGS:
        np.testing.assert_array_equal(np.asarray(p0[agg]), np.asarray(p1[agg]))
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))
    lt = np.asarray(batch.extras["teacher_topk_logprobs"]).copy()
    r, t = np.argwhere(m[..., 0])[0]
    lt[r, t, -1] = -np.inf
    inf_b = batch.replace(extras={**batch.extras, "teacher_topk_logprobs": jnp.asarray(lt)})
    pairs, grad = _topk_pairs(ls, inf_b)
    assert np.isfinite(float(pairs["token_mean"][0])) and np.isfinite(np.asarray(grad)).all()
    assert float(grad[r, t, -1]) == 0.0
    lp = jnp.zeros(m.shape[:2])
    g_t = jax.grad(lambda x: D.topk_forward_kl(lp, batch.replace(extras={
        **batch.extras, "teacher_topk_logprobs": x}), student_topk_logprobs=ls)[0])(
        batch.extras["teacher_topk_logprobs"])
    assert not np.any(np.asarray(g_t))


def test_topk_kl_errors_name_the_input():
    batch, ls = _topk_inputs(_fixed("per_step", seed=6)[0], seed=6)[:2]
    lp = jnp.zeros(batch.action_mask.shape)
    with pytest.raises(ValueError, match="student_topk_logprobs .* must be given"):
        D.topk_forward_kl(lp, batch)
    with pytest.raises(ValueError, match=r"topk_kl: student_topk_logprobs must have shape"):
        D.topk_forward_kl(lp, batch, student_topk_logprobs=ls[..., :2])
    no_field = batch.replace(extras={k: v for k, v in batch.extras.items()
                                     if k != "teacher_topk_logprobs"})
    with pytest.raises(E.MissingInput, match=r"topk_kl needs extras\['teacher_topk_logprobs'\]"):
        D.topk_forward_kl(lp, no_field, student_topk_logprobs=ls)
    flat = batch.replace(extras={**batch.extras, "teacher_topk_logprobs": lp})
    with pytest.raises(ValueError, match=r"extras\['teacher_topk_logprobs'\] must have shape "
                                         r"\[R, T, K\]"):
        D.topk_forward_kl(lp, flat, student_topk_logprobs=ls)
    assert L.step_given(D.topk_forward_kl, advantages=1, student_topk_logprobs=2) == {
        "student_topk_logprobs": 2}
    with pytest.raises(ValueError, match="unknown inputs"):
        L.step_given(D.topk_forward_kl, logits=1)


def test_topk_kl_shard_invariance():
    """Over 8 devices (groups whole per shard) the value and gradient equal the unsharded
    run, for the token and the trajectory means."""
    assert len(jax.devices()) == 8
    recs = random_records(np.random.default_rng(23), num_traj=16, num_groups=8)
    batch = make_batch(recs, "per_step", num_shards=8, pad_to=_SHARD_PAD)
    batch, ls = _topk_inputs(batch, 23)[:2]
    lp = jnp.zeros(batch.action_mask.shape)

    def values(x, b, axis_name=None):
        red = (lambda v: v) if axis_name is None else (lambda v: jax.lax.psum(v, axis_name))
        out = [L.safe_ratio(*map(red, D.topk_forward_kl(lp if axis_name is None else
                                                         jnp.zeros(b.action_mask.shape), b,
                                                         student_topk_logprobs=x, agg=agg,
                                                         axis_name=axis_name)))
               for agg in ("token_mean", "traj_mean_token_mean")]
        return jnp.stack(out)

    def sharded(x, b):
        mesh = Mesh(np.array(jax.devices()), ("data",))
        return jax.shard_map(lambda y, c: values(y, c, "data"), mesh=mesh,
                             in_specs=(P("data"), P("data")), out_specs=P())(x, b)

    def vg(f):
        return _jit(lambda x, b: jax.value_and_grad(lambda y: jnp.sum(
            f(y, b) * jnp.array([1.0, 2.0])))(x))

    (v1, g1), (v0, g0) = vg(sharded)(ls, batch), vg(values)(ls, batch)
    _close(v1, v0, atol=1e-5)
    _close(g1, g0, atol=1e-5)
    assert np.abs(np.asarray(g0)).sum() > 0


def test_topk_kl_all_masked_gives_zero_pairs_and_gradient():
    batch, ls = _topk_inputs(_fixed("concatenated", seed=7)[0], seed=7)[:2]
    empty = batch.replace(action_mask=jnp.zeros_like(batch.action_mask),
                          traj_mask=jnp.zeros_like(batch.traj_mask),
                          turn_mask=jnp.zeros_like(batch.turn_mask))
    pairs, grad = _topk_pairs(ls, empty)
    for agg in AGGS:
        assert float(pairs[agg][0]) == 0.0 and float(pairs[agg][1]) == 0.0
    assert not np.any(np.asarray(grad))
