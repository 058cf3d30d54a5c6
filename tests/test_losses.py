"""Tests of jaxrl_agent.losses: references, P15 stop-grad, P16 shard/micro-batch invariance,
P18 normalisation, the PPO family's own properties and degenerate input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_agent import losses as L
from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages
from tests.reference import losses_ref as ref
from tests.strategies import PAD, make_batch, random_records, records

LAYOUTS = ("concatenated", "per_step")
VOCAB = 100
RTOL, ATOL = 2e-4, 2e-4
_seeds = st.integers(0, 2**32 - 1)
# Compile-time budget: the bundles below are big graphs of tiny ops; XLA's CPU backend
# optimisations buy nothing at these sizes but cost most of the test time.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0,
                                                    "xla_llvm_disable_expensive_passes": True})


def _np(batch):
    return {f: np.asarray(getattr(batch, f)) for f in
            ("action_mask", "row_traj", "turn_ids", "old_logprobs", "tokens")}


def _random_inputs(batch, seed):
    """lp near old_logprobs (ratios spread around the clip range), advantages, proximal lp."""
    rng = np.random.default_rng(seed)
    shape = batch.action_mask.shape
    old = np.asarray(batch.old_logprobs)
    lp = (old + rng.normal(0, 0.4, shape)).astype(np.float32)
    adv = rng.normal(0, 1, shape).astype(np.float32)
    prox = (old + rng.normal(0, 0.5, shape)).astype(np.float32)
    return lp, adv, prox


def _close(actual, desired, **kw):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(desired, np.float64),
                               rtol=kw.get("rtol", RTOL), atol=kw.get("atol", ATOL))


def _pair_close(actual, desired):
    _close(actual[0], desired[0])
    _close(actual[1], desired[1])


# ----------------------------------------------------------------------------- jitted bundles


@_jit
def _agg_all(x, batch):
    out = {mode: L.aggregate(x, batch, mode) for mode in L.AGG_MODES}
    out["sum_norm_c7"] = L.aggregate(x, batch, "seq_mean_token_sum_norm", constant=7.0)
    return out


@_jit
def _policy_all(lp, batch, adv, prox):
    w_tok = L.truncated_is_weights(prox, batch)
    return {
        "ppo": L.ppo(lp, batch, adv),
        "ppo_asym": L.ppo(lp, batch, adv, clip_low=0.1, clip_high=0.28, dual_clip=None,
                          agg="seq_mean_token_sum"),
        "ppo_decoupled": L.ppo(lp, batch, Advantages(token=adv), old_logprobs=prox,
                               is_weights=w_tok, agg="traj_mean_token_mean"),
        "gspo_seq": L.gspo(lp, batch, adv),
        "gspo_turn": L.gspo(lp, batch, adv, level="turn", clip_low=0.1, clip_high=0.2,
                            agg="token_mean"),
        "cispo": L.cispo(lp, batch, adv),
        "cispo_2": L.cispo(lp, batch, adv, clip_low=0.2, clip_high=0.28,
                           agg="seq_mean_token_mean"),
        "soft_gate": L.soft_gate(lp, batch, adv),
        "reinforce": L.reinforce(lp, batch, adv),
        "reinforce_w": L.reinforce(lp, batch, adv, is_weights=w_tok,
                                   agg="seq_mean_token_sum_norm"),
        "w_tok": w_tok,
        "w_seq": L.truncated_is_weights(prox, batch, level="sequence", cap=1.5),
        "w_tok_mask": L.truncated_is_weights(prox, batch, mode="mask", lower=0.8, cap=1.3),
        "w_seq_mask": L.truncated_is_weights(prox, batch, level="sequence", mode="mask"),
        "metrics": L.policy_metrics(lp, batch, adv, clip_low=0.1, clip_high=0.3, dual_clip=1.5),
    }


@_jit
def _kl_all(lp, batch, ref_lp):
    out = {name: L.get(name)(lp, batch) for name in ("k1", "k2", "k3", "k1_st", "k3_st")}
    out["k3_arg"] = L.k3(lp, batch, ref_logprobs=ref_lp, agg="seq_mean_token_mean")
    out["entropy"] = L.entropy(jnp.abs(lp), batch, agg="traj_mean_token_mean")
    return out


# ----------------------------------------------------------------------------- references


@pytest.mark.parametrize("layout", LAYOUTS)
@given(recs=records(), seed=_seeds)
def test_aggregate_matches_reference(layout, recs, seed):
    batch = make_batch(recs, layout)
    b = _np(batch)
    x = np.random.default_rng(seed).normal(size=b["action_mask"].shape).astype(np.float32)
    out = _agg_all(x, batch)
    for mode in L.AGG_MODES:
        _pair_close(out[mode], ref.aggregate(x, b["action_mask"], b["row_traj"], mode))
    _pair_close(out["sum_norm_c7"], ref.aggregate(x, b["action_mask"], b["row_traj"],
                                                  "seq_mean_token_sum_norm", constant=7.0))


def test_reference_distinguishes_modes():
    """Guards the reference tests: on uneven rows every mode gives a different loss."""
    recs = random_records(np.random.default_rng(3), num_traj=6, max_turns=4, max_act=3)
    batch = make_batch(recs, "per_step")
    b = _np(batch)
    x = np.random.default_rng(0).normal(size=b["action_mask"].shape)
    vals = [s / d for s, d in (ref.aggregate(x, b["action_mask"], b["row_traj"], mode)
                               for mode in L.AGG_MODES)]
    assert len(set(np.round(vals, 6))) == len(L.AGG_MODES)
    out = _agg_all(x.astype(np.float32), batch)
    assert abs(float(out["token_mean"][0] / out["token_mean"][1]) - vals[1]) > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
@given(recs=records(logprobs=True), seed=_seeds)
def test_policy_losses_match_reference(layout, recs, seed):
    batch = make_batch(recs, layout)
    b = _np(batch)
    m, rt, tid, old = b["action_mask"], b["row_traj"], b["turn_ids"], b["old_logprobs"]
    lp, adv, prox = _random_inputs(batch, seed)
    out = _policy_all(lp, batch, adv, prox)

    def agg(per_token, mode="token_mean", constant=None):
        return ref.aggregate(per_token, m, rt, mode, constant)

    w_tok = ref.is_weights(prox, old, m)
    _close(out["w_tok"], w_tok)
    _close(out["w_seq"], ref.is_weights(prox, old, m, level="sequence", cap=1.5))
    _close(out["w_tok_mask"], ref.is_weights(prox, old, m, mode="mask", lower=0.8, cap=1.3))
    _close(out["w_seq_mask"], ref.is_weights(prox, old, m, level="sequence", mode="mask"))
    _pair_close(out["ppo"], agg(ref.ppo_tokens(lp, old, adv, m)))
    _pair_close(out["ppo_asym"], agg(ref.ppo_tokens(lp, old, adv, m, 0.1, 0.28, None),
                                     "seq_mean_token_sum"))
    _pair_close(out["ppo_decoupled"], agg(ref.ppo_tokens(lp, prox, adv, m, weights=w_tok),
                                          "traj_mean_token_mean"))
    _pair_close(out["gspo_seq"], agg(ref.gspo_tokens(lp, old, adv, m, rt, tid, "sequence",
                                                     3e-4, 4e-4), "seq_mean_token_mean"))
    _pair_close(out["gspo_turn"], agg(ref.gspo_tokens(lp, old, adv, m, rt, tid, "turn",
                                                      0.1, 0.2)))
    _pair_close(out["cispo"], agg(ref.cispo_tokens(lp, old, adv, m)))
    _pair_close(out["cispo_2"], agg(ref.cispo_tokens(lp, old, adv, m, 0.2, 0.28),
                                    "seq_mean_token_mean"))
    _pair_close(out["soft_gate"], agg(ref.soft_gate_tokens(lp, old, adv, m)))
    _pair_close(out["reinforce"], agg(ref.reinforce_tokens(lp, adv, m)))
    _pair_close(out["reinforce_w"], agg(ref.reinforce_tokens(lp, adv, m, w_tok),
                                        "seq_mean_token_sum_norm"))
    ratio = np.exp(np.clip(lp - old, -20, 20))
    clipped = (adv * np.clip(ratio, 0.9, 1.3) < adv * ratio) & m
    _pair_close(out["metrics"]["clip_fraction"], (clipped.sum(), m.sum()))
    _pair_close(out["metrics"]["approx_kl"], agg(np.where(m, old - lp, 0.0)))
    low, high = (adv < 0) & (ratio < 0.9) & m, (adv > 0) & (ratio > 1.3) & m
    _pair_close(out["metrics"]["clip_low_fraction"], (low.sum(), m.sum()))
    _pair_close(out["metrics"]["clip_high_fraction"], (high.sum(), m.sum()))
    _pair_close(out["metrics"]["dual_clip_fraction"],
                (((adv < 0) & (ratio > 1.5) & m).sum(), m.sum()))
    log_r = np.clip(lp - old, -20, 20)
    _pair_close(out["metrics"]["approx_kl_k3"], agg(np.where(m, ratio - 1 - log_r, 0.0)))


@pytest.mark.parametrize("layout", LAYOUTS)
@given(recs=records(ref_logprobs=True), seed=_seeds)
def test_kl_and_entropy_match_reference(layout, recs, seed):
    batch = make_batch(recs, layout)
    b = _np(batch)
    m, rt = b["action_mask"], b["row_traj"]
    rng = np.random.default_rng(seed)
    lp = (np.asarray(batch.extras["ref_logprobs"]) + rng.normal(0, 2, m.shape)).astype(np.float32)
    ref_lp = np.asarray(batch.extras["ref_logprobs"])
    other_ref = rng.normal(-1, 3, m.shape).astype(np.float32)
    out = _kl_all(lp, batch, other_ref)
    for name in ("k1", "k2", "k3", "k1_st", "k3_st"):
        _pair_close(out[name], ref.aggregate(ref.kl_tokens(lp, ref_lp, m, name), m, rt,
                                             "token_mean"))
    _pair_close(out["k3_arg"], ref.aggregate(ref.kl_tokens(lp, other_ref, m, "k3"), m, rt,
                                             "seq_mean_token_mean"))
    _pair_close(out["entropy"], ref.aggregate(np.abs(lp), m, rt, "traj_mean_token_mean"))


def test_entropy_from_logits_matches_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (3, 5, 7)).astype(np.float32)
    logits[0, 0, :3] = -np.inf  # masked vocabulary entries
    logits[1, 2, 4] = 60.0  # nearly deterministic
    h, g = _entropy_and_grad(logits)
    _close(h, ref.entropy_from_logits(logits), rtol=1e-4, atol=1e-5)
    assert np.isfinite(np.asarray(g)).all()
    _close(_entropy_and_grad(np.zeros((3, 5, 7), np.float32))[0], np.full((3, 5), np.log(7.0)),
           rtol=1e-6)


_entropy_and_grad = _jit(lambda x: (L.entropy_from_logits(x),
                                    jax.grad(lambda y: L.entropy_from_logits(y).sum())(x)))


@given(seed=_seeds, clip=st.sampled_from([None, 0.2]))
def test_value_matches_reference(seed, clip):
    rng = np.random.default_rng(seed)
    shape = (8, 4)
    v, ret, old = (rng.normal(size=shape).astype(np.float32) for _ in range(3))
    mask = rng.random(shape) < 0.6
    out = _value_jit(v, ret, mask, old, clip)
    _pair_close(out, ref.value(v, ret, mask, old, clip))


_value_jit = _jit(lambda v, r, m, o, clip: L.value(v, r, m, old_values=o, clip=clip),
                     static_argnums=4)


# ----------------------------------------------------------------------------- P18


def _token_features(batch):
    """Per-token values that depend only on the record (token id, turn id), not the packing."""
    return jnp.sin(batch.tokens.astype(jnp.float32)) + 0.1 * batch.turn_ids


@pytest.mark.parametrize("layout", LAYOUTS)
@given(recs=records())
def test_padding_invariance(layout, recs):
    small = make_batch(recs, layout)
    big_pad = {k: 2 * v for k, v in PAD[layout].items()}
    if layout == "concatenated":
        big_pad["num_traj"] = 16
    big = make_batch(recs, layout, pad_to=big_pad)
    a, b = _agg_all(_token_features(small), small), _agg_all(_token_features(big), big)
    for mode in L.AGG_MODES:
        if mode == "seq_mean_token_sum_norm":  # C = padded T changes with the padding
            continue
        _pair_close(a[mode], b[mode])
    _pair_close(a["sum_norm_c7"], b["sum_norm_c7"])
    assert float(b["seq_mean_token_sum_norm"][1]) == 2 * float(a["seq_mean_token_sum_norm"][1])


_agg_grad = _jit(jax.grad(lambda x, batch, mode: L.aggregate(x, batch, mode)[0]),
                 static_argnums=2)


@pytest.mark.parametrize("layout", LAYOUTS)
@given(recs=records(), seed=_seeds)
def test_seq_mean_gives_rows_equal_weight(layout, recs, seed):
    batch = make_batch(recs, layout)
    m = np.asarray(batch.action_mask)
    rows = m.any(axis=1)
    c = np.random.default_rng(seed).normal(size=m.shape[0]).astype(np.float32)
    x = np.broadcast_to(c[:, None], m.shape)
    total, denom = _agg_all(x, batch)["seq_mean_token_mean"]
    _close(total, c[rows].sum())
    assert float(denom) == rows.sum()
    g = np.asarray(_agg_grad(x, batch, "seq_mean_token_mean"))
    _close(g.sum(axis=1)[rows], 1.0, rtol=1e-6)
    assert (g[~m] == 0).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@given(recs=records())
def test_traj_mean_gives_trajectories_equal_weight(layout, recs):
    batch = make_batch(recs, layout)
    g = np.asarray(_agg_grad(_token_features(batch), batch, "traj_mean_token_mean"))
    per_traj = np.zeros(batch.num_traj)
    np.add.at(per_traj, np.asarray(batch.row_traj), g.sum(axis=1))
    _close(per_traj, np.asarray(batch.traj_mask, np.float64), rtol=1e-6)


@given(recs=records())
def test_traj_mean_same_in_both_layouts(recs):
    cat, per = make_batch(recs, "concatenated"), make_batch(recs, "per_step")
    a, b = _agg_all(_token_features(cat), cat), _agg_all(_token_features(per), per)
    _pair_close(a["traj_mean_token_mean"], b["traj_mean_token_mean"])
    _pair_close(a["traj_mean_token_mean"], a["seq_mean_token_mean"])
    _pair_close(a["token_mean"], b["token_mean"])
    assert float(b["traj_mean_token_mean"][1]) == len(recs)


@pytest.mark.parametrize("layout", LAYOUTS)
@given(recs=records(), data=st.data())
def test_sum_norm_denominator_independent_of_lengths(layout, recs, data):
    # every action becomes 1 or 3 tokens long (3 = MAX_ACT keeps the shape bucket)
    other = [dict(r, turns=[dict(t, action=t["action"][:1] if data.draw(st.booleans())
                                 else (t["action"] * 3)[:3]) for t in r["turns"]]) for r in recs]
    a, b = make_batch(recs, layout), make_batch(other, layout)
    da = _agg_all(_token_features(a), a)
    db = _agg_all(_token_features(b), b)
    rows = np.asarray(a.action_mask).any(axis=1).sum()
    assert float(da["seq_mean_token_sum_norm"][1]) == float(db["seq_mean_token_sum_norm"][1])
    assert float(da["seq_mean_token_sum_norm"][1]) == rows * a.row_len
    assert float(da["sum_norm_c7"][1]) == float(db["sum_norm_c7"][1]) == 7.0 * rows


# ----------------------------------------------------------------------------- P16: splits


def _model(theta, batch):
    """A tiny 'policy': per-token log-probs, entropies and values from a vocabulary table."""
    emb = theta[batch.tokens] + 0.3 * batch.turn_ids
    return jax.nn.log_sigmoid(emb), jax.nn.softplus(emb), jnp.tanh(emb)


def _pairs(theta, theta_old, batch, names, axis_name=None):
    """(sum, denominator) of the named losses for the model's log-probs."""
    lp, ent, val = _model(theta, batch)
    old = jax.lax.stop_gradient(_model(theta_old, batch)[0])
    batch = batch.replace(old_logprobs=jnp.where(batch.action_mask, old, 0.0))
    adv = segments.turn_to_token(batch.turn_rewards, segments.localize(batch, axis_name))
    kw = dict(axis_name=axis_name)

    def is_w():
        return L.truncated_is_weights(old + 0.1 * jnp.sin(1.0 * batch.tokens), batch,
                                      level="sequence")

    make = {f"ppo_{mode}": functools.partial(L.ppo, lp, batch, adv, agg=mode, **kw)
            for mode in L.AGG_MODES}
    make.update({
        "ppo_c5": lambda: L.ppo(lp, batch, adv, agg="seq_mean_token_sum_norm", agg_constant=5.0),
        "gspo_seq": lambda: L.gspo(lp, batch, adv, clip_low=0.2, clip_high=0.28, **kw),
        "gspo_turn": lambda: L.gspo(lp, batch, Advantages(token=adv), level="turn",
                                    clip_low=0.2, clip_high=0.28, agg="traj_mean_token_mean",
                                    **kw),
        "cispo": lambda: L.cispo(lp, batch, adv, is_weights=is_w(), **kw),
        "soft_gate": lambda: L.soft_gate(lp, batch, adv, agg="seq_mean_token_sum", **kw),
        "reinforce": lambda: L.reinforce(lp, batch, adv, agg="seq_mean_token_mean", **kw),
        "entropy": lambda: L.entropy(ent, batch, agg="traj_mean_token_mean", **kw),
        "value": lambda: L.value(val, adv, batch.action_mask, old_values=0.5 * adv, clip=0.2),
    })
    for name in ("k1", "k2", "k3", "k1_st", "k3_st"):
        make[name] = functools.partial(L.get(name), lp, batch, **kw)
    return {k: make[k]() for k in names}


# every aggregation mode, every loss that couples tokens (GSPO, sequence-level IS weights), and
# one of each other kind (the remaining losses are per-token like these: see the references)
MB_PAIRS = tuple(f"ppo_{mode}" for mode in L.AGG_MODES) + (
    "ppo_c5", "gspo_seq", "gspo_turn", "cispo", "entropy", "value", "k3_st")
# under shard_map: the modes/losses that group across rows, plus one of each kind
SHARD_PAIRS = ("ppo_token_mean", "ppo_traj_mean_token_mean", "gspo_turn", "k3_st")


@_jit
def _pairs_and_grad(theta, theta_old, batch, weights):
    """The MB_PAIRS pairs, and d/d theta of sum_k weights[k] * sum_k (one backward pass).

    The objective is linear in the sums and the denominators do not depend on theta, so with
    weights = c / (full-batch denominators) the gradients of the pieces add up to the full
    batch's gradient of sum_k c_k * loss_k.
    """
    def combined(th):
        pairs = _pairs(th, theta_old, batch, MB_PAIRS)
        return sum(w * pairs[k][0] for w, k in zip(weights, MB_PAIRS)), pairs

    grad, pairs = jax.grad(combined, has_aux=True)(theta)
    return pairs, grad


def _thetas(seed=0):
    rng = np.random.default_rng(seed)
    theta = rng.normal(0, 1, VOCAB).astype(np.float32)
    return theta, (theta + rng.normal(0, 0.3, VOCAB)).astype(np.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@given(recs=records(min_traj=2, ref_logprobs=True), data=st.data(), seed=_seeds)
def test_micro_batch_invariance(layout, recs, data, seed):
    part = data.draw(st.lists(st.booleans(), min_size=len(recs), max_size=len(recs)))
    part[0], part[-1] = True, False
    first = [r for r, p in zip(recs, part) if p]
    second = [r for r, p in zip(recs, part) if not p]
    theta, theta_old = _thetas(seed)
    batches = [make_batch(x, layout) for x in (recs, first, second)]
    ones = np.ones(len(MB_PAIRS), np.float32)
    full, _ = _pairs_and_grad(theta, theta_old, batches[0], ones)
    one, _ = _pairs_and_grad(theta, theta_old, batches[1], ones)
    two, _ = _pairs_and_grad(theta, theta_old, batches[2], ones)
    for name, (s, d) in full.items():
        (s1, d1), (s2, d2) = one[name], two[name]
        _close(d1 + d2, d)
        assert float(d) > 0
        _close((s1 + s2) / (d1 + d2), s / d, atol=1e-5)
    c = np.random.default_rng(seed).uniform(0.5, 1.5, len(MB_PAIRS))
    w = (c / np.array([float(full[k][1]) for k in MB_PAIRS])).astype(np.float32)
    g_full = _pairs_and_grad(theta, theta_old, batches[0], w)[1]
    g_one = _pairs_and_grad(theta, theta_old, batches[1], w)[1]
    g_two = _pairs_and_grad(theta, theta_old, batches[2], w)[1]
    assert np.abs(np.asarray(g_full)).sum() > 0
    _close(g_one + g_two, g_full, atol=1e-5)


_SHARD_PAD = {
    "concatenated": {"num_traj": 64, "num_turns": 4, "row_len": 32},
    "per_step": {"num_traj": 64, "num_turns": 4, "num_rows": 256, "row_len": 8},
}


def _global_losses(theta, theta_old, batch, axis_name=None):
    pairs = _pairs(theta, theta_old, batch, SHARD_PAIRS, axis_name)
    red = (lambda x: x) if axis_name is None else (lambda x: jax.lax.psum(x, axis_name))
    return {k: L.safe_ratio(red(s), red(d)) for k, (s, d) in pairs.items()}


def _sharded_losses(theta, theta_old, batch):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    f = jax.shard_map(lambda th, tho, b: _global_losses(th, tho, b, "data"), mesh=mesh,
                      in_specs=(P(), P(), P("data")), out_specs=P())
    return f(theta, theta_old, batch)


def _value_and_combined_grad(losses):
    """Each loss, and the gradient of a fixed combination of them (one backward pass)."""
    def combined(th, tho, b):
        out = losses(th, tho, b)
        return sum((i + 1.0) * out[k] for i, k in enumerate(SHARD_PAIRS)), out

    return _jit(lambda th, tho, b: jax.grad(combined, has_aux=True)(th, tho, b)[::-1])


_sharded = _value_and_combined_grad(_sharded_losses)
_unsharded = _value_and_combined_grad(_global_losses)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_invariance(layout):
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    recs = random_records(np.random.default_rng(7), num_traj=16, num_groups=8,
                          ref_logprobs=True)
    batch = make_batch(recs, layout, num_shards=8, pad_to=_SHARD_PAD[layout])
    block = batch.num_traj // 8
    assert len(set(np.asarray(batch.row_traj)[np.asarray(batch.action_mask).any(1)] // block)) > 3
    theta, theta_old = _thetas(1)
    vals, grad = _sharded(theta, theta_old, batch)
    vals0, grad0 = _unsharded(theta, theta_old, batch)
    for k in SHARD_PAIRS:
        _close(vals[k], vals0[k], atol=1e-5)
    _close(grad, grad0, atol=1e-5)
    assert np.abs(np.asarray(grad0)).sum() > 0


# ----------------------------------------------------------------------------- PPO family


def _fixed(layout="concatenated", seed=0, **kw):
    recs = random_records(np.random.default_rng(seed), logprobs=True, ref_logprobs=True, **kw)
    batch = make_batch(recs, layout)
    m = np.asarray(batch.action_mask)
    adv = np.random.default_rng(seed + 1).normal(size=m.shape).astype(np.float32)
    adv[m & (np.abs(adv) < 0.05)] = 0.5
    return batch, m, adv, np.asarray(batch.old_logprobs)


@functools.lru_cache(maxsize=None)
def _compiled(fn, kw_items, kind):
    """Jitted fn(lp, *args, **kw): its pair, value_and_grad of sum/denom, or grad of sum."""
    kw = dict(kw_items)

    def pair(lp, *args):
        return fn(lp, *args, **kw)

    if kind == "pair":
        return _jit(pair)
    if kind == "sum_grad":
        return _jit(jax.grad(lambda lp, *args: pair(lp, *args)[0]))
    return _jit(jax.value_and_grad(lambda lp, *args: pair(lp, *args)[0] / pair(lp, *args)[1]))


def _loss_and_grad(fn, lp, *args, **kw):
    """(sum / denominator, its gradient w.r.t. lp), jitted."""
    return _compiled(fn, tuple(sorted(kw.items())), "mean_vg")(jnp.asarray(lp), *args)


def _pair(fn, lp, *args, **kw):
    return _compiled(fn, tuple(sorted(kw.items())), "pair")(jnp.asarray(lp), *args)


def _sum_grad(fn, lp, *args, **kw):
    return _compiled(fn, tuple(sorted(kw.items())), "sum_grad")(jnp.asarray(lp), *args)


def test_ppo_gradient_at_ratio_one():
    batch, m, adv, old = _fixed()
    for name in ("ppo", "gspo", "soft_gate"):
        kw = {"agg": "token_mean"} if name == "gspo" else {}
        _, g = _loss_and_grad(L.get(name), old, batch, adv, **kw)
        _close(g, np.where(m, -adv, 0.0) / m.sum(), rtol=1e-5, atol=1e-7)


def test_ppo_zero_gradient_outside_clip_in_direction_of_advantage():
    batch, m, adv, old = _fixed()
    # A > 0 pushed above 1 + eps, A < 0 pushed below 1 - eps: clipped, no gradient.
    lp = old + np.where(adv > 0, np.log(1.5), np.log(0.5))
    _, g = _loss_and_grad(L.ppo, lp, batch, adv)
    assert (np.asarray(g) == 0).all()
    # The other directions stay live: gradient -A r / denom.
    lp = old + np.where(adv > 0, np.log(0.5), np.log(1.5))
    ratio = np.where(adv > 0, 0.5, 1.5)
    _, g = _loss_and_grad(L.ppo, lp, batch, adv, dual_clip=None)
    _close(g, np.where(m, -adv * ratio, 0.0) / m.sum(), rtol=1e-5, atol=1e-7)


def test_ppo_dual_clip_bounds_negative_advantage_loss():
    batch, m, adv, old = _fixed()
    adv = -np.abs(adv)
    lp = old + np.log(10.0)
    s, d = _pair(L.ppo, lp, batch, adv, dual_clip=3.0)
    _close(s, np.sum(np.where(m, -adv * 3.0, 0.0)), rtol=1e-5)
    _, g = _loss_and_grad(L.ppo, lp, batch, adv, dual_clip=3.0)
    assert (np.asarray(g) == 0).all()
    s_none, _ = _pair(L.ppo, lp, batch, adv, dual_clip=None)
    _close(s_none, np.sum(np.where(m, -adv * 10.0, 0.0)), rtol=1e-5)
    for ratio in (0.3, 1.0, 2.0, 50.0):
        s, _ = _pair(L.ppo, old + np.log(ratio), batch, adv, dual_clip=3.0)
        assert float(s) <= float(np.sum(np.where(m, -adv * 3.0, 0.0))) + 1e-4


def test_ppo_asymmetric_clip():
    batch, m, adv, old = _fixed()
    cases = [(1.2, 1.0, True), (1.35, 1.0, False), (0.85, -1.0, False), (0.95, -1.0, True)]
    for ratio, sign, live in cases:
        a = sign * np.abs(adv)
        _, g = _loss_and_grad(L.ppo, old + np.log(ratio), batch, a, clip_low=0.1,
                              clip_high=0.3)
        if live:
            _close(g, np.where(m, -a * ratio, 0.0) / m.sum(), rtol=1e-5, atol=1e-7)
        else:
            assert (np.asarray(g) == 0).all(), (ratio, sign)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gspo_turn_equals_ppo_for_one_token_turns(layout):
    batch, m, adv, old = _fixed(layout, max_act=1)
    lp = old + np.random.default_rng(5).normal(0, 0.3, m.shape).astype(np.float32)
    for agg in ("traj_mean_token_mean",):
        kw = dict(clip_low=0.2, clip_high=0.28, agg=agg)
        v1, g1 = _loss_and_grad(L.gspo, lp, batch, adv, level="turn", **kw)
        v2, g2 = _loss_and_grad(L.ppo, lp, batch, adv, dual_clip=None, **kw)
        _close(v1, v2, rtol=1e-5)
        _close(g1, g2, rtol=1e-5, atol=1e-7)
        assert np.abs(np.asarray(g1)).sum() > 0


_gspo_log_ratio_and_grad = _jit(
    lambda x, b, level: (L.gspo_log_ratio(x, b, level=level),
                         jax.grad(lambda y: L.gspo_log_ratio(y, b, level=level).sum())(x)),
    static_argnums=2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gspo_ratio_constant_within_turn_and_row(layout):
    batch, m, adv, old = _fixed(layout, seed=2)
    lp = old + np.random.default_rng(6).normal(0, 0.3, m.shape).astype(np.float32)
    for level in ("turn", "sequence"):
        r, g = _gspo_log_ratio_and_grad(lp, batch, level)
        r = np.asarray(r)
        groups = {}
        for i, t in zip(*np.nonzero(m)):
            key = (int(batch.row_traj[i]), int(batch.turn_ids[i, t])) if level == "turn" else i
            groups.setdefault(key, []).append(r[i, t])
        assert all(np.ptp(v) < 1e-6 for v in groups.values())
        assert any(len(v) > 1 for v in groups.values())
        # gradient of the log-ratio is the per-token d lp (the GSPO-token form)
        assert (np.asarray(g) == m).all()


def test_cispo_gradient_is_clipped_weight_times_advantage():
    batch, m, adv, old = _fixed()
    lp = old + np.random.default_rng(3).normal(0, 0.5, m.shape).astype(np.float32)
    g = _sum_grad(L.cispo, lp, batch, adv, clip_low=0.2, clip_high=0.28)
    w = np.clip(np.exp(lp - old), 0.8, 1.28)
    _close(g, np.where(m, -w * adv, 0.0), rtol=1e-5, atol=1e-7)
    assert (np.exp(lp - old)[m] > 1.28).any() and (np.exp(lp - old)[m] < 0.8).any()


def test_soft_gate_slope_one_at_ratio_one():
    eps = 1e-3
    for tau in (1.0, 1.05, 3.0):
        slope = (L.soft_gate_fn(1.0 + eps, tau) - L.soft_gate_fn(1.0 - eps, tau)) / (2 * eps)
        _close(slope, 1.0, rtol=1e-3)
        _close(jax.grad(L.soft_gate_fn)(1.0, tau), 1.0, rtol=1e-6)
    batch, m, adv, old = _fixed()
    g = _sum_grad(L.soft_gate, old, batch, adv)
    _close(g, np.where(m, -adv, 0.0), rtol=1e-5, atol=1e-7)


@_jit
def _is_bundle(prox, batch):
    return {f"{level}/{mode}": L.truncated_is_weights(prox, batch, level=level, mode=mode)
            for level in ("token", "sequence") for mode in ("truncate", "mask")}


def test_is_weights_are_one_on_policy():
    batch, m, adv, old = _fixed("per_step")
    for key, w in _is_bundle(old, batch).items():
        w = np.asarray(w)
        assert (w[m] == 1).all() and (w[~m] == 0).all(), key


# ----------------------------------------------------------------------------- KL


_KL_FNS = {"k1": L.kl_k1, "k2": L.kl_k2, "k3": L.kl_k3, "k1_st": L.kl_k1_st,
           "k3_st": L.kl_k3_st}


@_jit
def _kl_bundle(lp, rf):
    vals = {k: f(lp, rf) for k, f in _KL_FNS.items()}
    at_ref = {k: f(lp, lp) for k, f in _KL_FNS.items()}
    grads = {k: jax.grad(lambda x, f=f: f(x, rf).sum())(lp) for k, f in _KL_FNS.items()}
    return vals, at_ref, grads


def test_kl_properties():
    rng = np.random.default_rng(0)
    lp = np.concatenate([rng.normal(-2, 3, 200), [-40.0, 30.0, 0.0]]).astype(np.float32)
    rf = np.concatenate([rng.normal(-2, 3, 200), [10.0, -30.0, 0.0]]).astype(np.float32)
    vals, at_ref, grads = _kl_bundle(lp, rf)
    assert (np.asarray(vals["k2"]) >= 0).all() and (np.asarray(vals["k3"]) >= 0).all()
    assert np.asarray(vals["k3"]).max() == 10.0  # the output clamp is hit by the extreme pair
    for k in _KL_FNS:
        assert (np.asarray(at_ref[k]) == 0).all(), k
    _close(vals["k1_st"], vals["k1"], rtol=1e-6)
    _close(vals["k3_st"], vals["k3"], rtol=1e-6)
    _close(grads["k1_st"], grads["k2"], rtol=1e-6)
    _close(grads["k3_st"], grads["k2"], rtol=1e-6)
    _close(grads["k2"], lp - rf, rtol=1e-6)
    # and through the loss wrappers
    batch, m, adv, old = _fixed()
    g2 = _sum_grad(L.k2, old + 0.3, batch)
    for name in ("k1_st", "k3_st"):
        _close(_sum_grad(L.get(name), old + 0.3, batch), g2, rtol=1e-6)
        assert np.abs(np.asarray(g2)).sum() > 0


# ----------------------------------------------------------------------------- P15


@_jit
def _stop_grad_grads(inputs, lp, batch):
    def total(x):
        b = batch.replace(old_logprobs=x["old"], extras={**batch.extras, "ref_logprobs": x["ref"]})
        adv = Advantages(token=x["adv"])
        w = L.truncated_is_weights(x["prox"], b, level="sequence")
        out = [
            L.ppo(lp, b, adv, is_weights=w), L.ppo(lp, b, adv, old_logprobs=x["prox"]),
            L.gspo(lp, b, adv, level="turn"), L.gspo(lp, b, adv),
            L.cispo(lp, b, adv, is_weights=w), L.soft_gate(lp, b, adv),
            L.reinforce(lp, b, x["adv"], is_weights=w),
            L.k1(lp, b), L.k2(lp, b), L.k3(lp, b), L.k1_st(lp, b), L.k3_st(lp, b),
            L.value(lp, x["ret"], b.action_mask, old_values=x["old"], clip=0.1),
            L.value(lp, x["ret"], b.action_mask),
        ]
        out += list(L.policy_metrics(lp, b, adv).values())
        return sum(s + d for s, d in out)

    return jax.grad(total)(inputs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stop_gradient_on_everything_but_logprobs(layout):
    batch, m, adv, old = _fixed(layout)
    rng = np.random.default_rng(4)
    lp = old + rng.normal(0, 0.3, m.shape).astype(np.float32)
    inputs = {"adv": adv, "old": old, "ref": np.asarray(batch.extras["ref_logprobs"]),
              "prox": old + rng.normal(0, 0.3, m.shape).astype(np.float32),
              "ret": rng.normal(size=m.shape).astype(np.float32)}
    grads = _stop_grad_grads(inputs, lp, batch)
    for k, g in grads.items():
        assert (np.asarray(g) == 0).all(), k


# ----------------------------------------------------------------------------- degenerate


_EVERY_LOSS = ([("ppo", mode) for mode in L.AGG_MODES]
               + [(name, None) for name in ("gspo", "cispo", "soft_gate", "reinforce", "k1",
                                            "k2", "k3", "k1_st", "k3_st", "entropy")])


@_jit
def _every_loss(lp, batch, adv, ret):
    """(sum, denominator) of every loss (every mode for PPO), and d(sum of sums) / d lp."""
    def pairs(x):
        out = {}
        for name, agg in _EVERY_LOSS:
            fn = L.get(name)
            args = (batch,) if name.startswith("k") or name == "entropy" else (batch, adv)
            out[f"{name}/{agg}"] = fn(x, *args, **({} if agg is None else {"agg": agg}))
        out["gspo/turn"] = L.gspo(x, batch, adv, level="turn", agg="traj_mean_token_mean")
        out["value/clip"] = L.value(x, ret, batch.action_mask, old_values=ret, clip=0.1)
        return out

    def total(x):
        p = pairs(x)
        return sum(v[0] for v in p.values()), p

    # one backward pass: a NaN or inf in any loss's gradient shows in the total
    grad, p = jax.grad(total, has_aux=True)(lp)
    return p, grad


def test_all_masked_batch_gives_zero_and_finite_gradient():
    # per_step: rows != trajectories, so every mode has its own code path here
    batch, m, adv, old = _fixed("per_step")
    empty = batch.replace(action_mask=np.zeros_like(m),
                          turn_ids=np.full(m.shape, -1, np.int32))
    out, grad = _every_loss(old, empty, adv, adv)
    assert len(out) == len(_EVERY_LOSS) + 2
    for name, (s, d) in out.items():
        assert float(s) == 0 and float(d) == 0, name
    assert (np.asarray(grad) == 0).all()
    for k, (s, d) in _pair(L.policy_metrics, old, empty, adv).items():
        assert float(s) == 0 and float(d) == 0
    assert float(L.safe_ratio(0.0, 0.0)) == 0.0
    assert all((np.asarray(w) == 0).all() for w in _is_bundle(old, empty).values())


def test_garbage_outside_mask_never_leaks():
    batch, m, adv, old = _fixed("per_step")
    lp = np.where(m, old - 0.1, -np.inf).astype(np.float32)
    bad = np.where(m, adv, np.nan).astype(np.float32)
    b = batch.replace(old_logprobs=np.where(m, old, np.inf).astype(np.float32),
                      extras={"ref_logprobs": np.where(m, old, np.nan).astype(np.float32)})
    out, grad = _every_loss(lp, b, bad, bad)
    for key, (s, d) in out.items():
        assert np.isfinite(float(s)) and float(d) > 0, key
    assert np.isfinite(np.asarray(grad)).all() and (np.asarray(grad)[~m] == 0).all()


# ----------------------------------------------------------------------------- errors, registry


def test_errors_name_the_field():
    batch, m, adv, old = _fixed()
    with pytest.raises(ValueError, match="token_mean.*traj_mean_token_mean"):
        L.aggregate(adv, batch, "mean")
    with pytest.raises(ValueError, match="seq_mean_token_mean"):
        L.ppo(old, batch, adv, agg="seq-mean-token-mean")
    with pytest.raises(ValueError, match=r"needs extras\['ref_logprobs'\] \[R, T\]"):
        L.k3(old, batch.replace(extras={}))
    with pytest.raises(ValueError, match="unknown loss 'sapo'.*entropy.*ppo"):
        L.get("sapo")
    with pytest.raises(ValueError, match="level"):
        L.gspo(old, batch, adv, level="token")
    with pytest.raises(ValueError, match="mode"):
        L.truncated_is_weights(old, batch, mode="clip")
    with pytest.raises(ValueError, match="level"):
        L.truncated_is_weights(old, batch, level="turn")
    with pytest.raises(ValueError, match="logprobs must have shape"):
        L.ppo(old[:, :5], batch, adv)
    with pytest.raises(ValueError, match="advantages must have shape"):
        L.reinforce(old, batch, adv[:2])
    with pytest.raises(ValueError, match="old_values"):
        L.value(old, old, m, clip=0.2)
    with pytest.raises(ValueError, match="dual_clip"):
        L.ppo(old, batch, adv, dual_clip=0.5)


def test_registry():
    assert L.names() == tuple(sorted((
        "ppo", "gspo", "cispo", "soft_gate", "reinforce", "value", "sarsa", "k1", "k2", "k3",
        "k1_st", "k3_st", "entropy", "sdl", "sdar", "edge", "ucob", "icsd", "craft", "treeopsd",
        "t_reg", "weighted_sft", "topk_kl")))
    from tests.reference import distill_ref
    from tests.registered import defined_in
    assert set(distill_ref.LOSS_REFERENCES) == set(defined_in(L.distill, ("loss",)))
    assert L.get("soft_gate") is L.soft_gate and L.get("value") is L.value
    assert L.AGG_MODES == ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                           "seq_mean_token_sum_norm", "traj_mean_token_mean")
