"""SAPO (Single-rollout Autoregressive PO): estimator, per-turn value reads, SARSA loss. The
estimator's padding, permutation and shard invariance: tests/test_conformance.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_agent import segments
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.estimators.temporal import sapo
from jaxrl_agent.losses import sarsa
from tests.reference import sapo_ref as ref
from tests.strategies import PAD, random_records, records


def _pack(recs, layout):
    return pack_records(recs, layout=layout, pad_to=PAD[layout])


@functools.lru_cache(maxsize=None)
def _sapo_jit(gamma, lam, normalize):
    return jax.jit(functools.partial(sapo, gamma=gamma, lam=lam, normalization=normalize))


@settings(max_examples=15)
@given(recs=records(values=True), layout=st.sampled_from(["concatenated", "per_step"]),
       hp=st.sampled_from([(1.0, 0.95, "token"), (0.9, 0.5, "turn"), (0.99, 1.0, "token")]))
def test_sapo_matches_reference(recs, layout, hp):
    gamma, lam, normalize = hp
    batch, index = _pack(recs, layout)
    out = _sapo_jit(gamma, lam, normalize)(batch)
    trajs = [([t["reward"] for t in r["turns"]], [t["value"] for t in r["turns"]],
              [len(t["action"]) for t in r["turns"]]) for r in recs]
    # float32 rounding of the inputs, as the batch stores them
    trajs = [([float(np.float32(x)) for x in a], [float(np.float32(x)) for x in b], c)
             for a, b, c in trajs]
    norm, targets = ref.sapo(trajs, gamma, lam, 1e-8, normalize)
    turn, ret = np.asarray(out.turn), np.asarray(out.turn_returns)
    scale = 1.0 + max(abs(x) for n in norm for x in n)
    for i, n in enumerate(index.traj):
        k = len(recs[i]["turns"])
        np.testing.assert_allclose(ret[n, :k], targets[i], atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(turn[n, :k], norm[i], atol=1e-3 * scale, rtol=1e-4)
        assert np.all(turn[n, k:] == 0)
    tok = np.asarray(out.token)
    for i, n in enumerate(index.traj):
        for k, (row, a, b) in enumerate(index.spans[i]):
            assert np.all(tok[row, a:b] == turn[n, k])


def test_sapo_token_weighted_mean_is_zero_and_limits():
    rng = np.random.default_rng(0)
    recs = random_records(rng, values=True)
    batch, _ = _pack(recs, "concatenated")
    out = _sapo_jit(1.0, 0.95, "token")(batch)
    tok = np.asarray(out.token)
    assert abs(tok[np.asarray(batch.action_mask)].mean()) < 1e-5
    # lam = 1: targets are the discounted returns; lam = 0: r_k + gamma V_{k+1}
    g = 0.9
    full = _sapo_jit(g, 1.0, "token")(batch)
    one = _sapo_jit(g, 0.0, "token")(batch)
    r = np.asarray(batch.turn_rewards, np.float64)
    v = np.asarray(batch.extras["turn_values"], np.float64)
    m = np.asarray(batch.turn_mask)
    for n in range(batch.num_traj):
        k_n = int(m[n].sum())
        ret = 0.0
        for k in reversed(range(k_n)):
            ret = r[n, k] + g * ret
            assert abs(float(full.turn_returns[n, k]) - ret) < 1e-4
            v_next = v[n, k + 1] if k + 1 < k_n else 0.0
            assert abs(float(one.turn_returns[n, k]) - (r[n, k] + g * v_next)) < 1e-4


def test_sapo_rejects_no_normalisation():
    batch, _ = _pack(random_records(np.random.default_rng(1), values=True), "concatenated")
    with pytest.raises(ValueError, match="normalization"):
        sapo(batch, normalization="none")


def test_sapo_needs_turn_values():
    batch, _ = _pack(random_records(np.random.default_rng(1)), "concatenated")
    with pytest.raises(ValueError, match="turn_values"):
        sapo(batch)


@settings(max_examples=10)
@given(recs=records(), layout=st.sampled_from(["concatenated", "per_step"]))
def test_turn_values_from_tokens(recs, layout):
    batch, index = _pack(recs, layout)
    values = np.random.default_rng(len(recs)).normal(size=batch.tokens.shape).astype(np.float32)
    for at in ("before_action", "last_action"):
        got = np.asarray(_reads(at)(jnp.asarray(values), batch))
        for i, n in enumerate(index.traj):
            want = ref.turn_reads(values, index.spans[i], at)
            np.testing.assert_array_equal(got[n, :len(want)], np.float32(want))
            assert np.all(got[n, len(want):] == 0)


@functools.lru_cache(maxsize=None)
def _reads(at):
    return jax.jit(functools.partial(segments.turn_values_from_tokens, at=at))


def test_turn_values_from_tokens_bad_position():
    batch, _ = _pack(random_records(np.random.default_rng(2)), "concatenated")
    with pytest.raises(ValueError, match="before_action"):
        segments.turn_values_from_tokens(jnp.zeros(batch.tokens.shape), batch, at="after")


_sarsa = jax.jit(sarsa, static_argnames="gamma")


@settings(max_examples=15)
@given(recs=records(), gamma=st.sampled_from([1.0, 0.9]))
def test_sarsa_matches_reference_and_gradient(recs, gamma):
    batch, index = _pack(recs, "concatenated")
    q = np.random.default_rng(len(recs)).normal(size=batch.turn_mask.shape).astype(np.float32)
    total, denom = _sarsa(jnp.asarray(q), batch, gamma=gamma)
    qs = [[float(q[n, k]) for k in range(len(recs[i]["turns"]))] for i, n in enumerate(index.traj)]
    rs = [[float(np.float32(t["reward"])) for t in r["turns"]] for r in recs]
    want, count = ref.sarsa(qs, rs, gamma)
    assert float(denom) == count
    np.testing.assert_allclose(float(total), want, rtol=1e-5, atol=1e-5)
    # only Q_k carries gradient: d/dQ_k = Q_k - (r_k + gamma Q_{k+1}) on valid turns
    grad = np.asarray(jax.grad(lambda x: _sarsa(x, batch, gamma=gamma)[0])(jnp.asarray(q)))
    for i, n in enumerate(index.traj):
        k_n = len(qs[i])
        for k in range(k_n):
            q_next = qs[i][k + 1] if k + 1 < k_n else 0.0
            assert abs(grad[n, k] - (qs[i][k] - rs[i][k] - gamma * q_next)) < 1e-4
        assert np.all(grad[n, k_n:] == 0)


def test_sarsa_one_step_target_is_reward_and_no_reward_grad():
    recs = [{"group": 0, "outcome": 0.7, "turns": [{"observation": [1], "action": [2]}]}]
    batch, _ = _pack(recs, "concatenated")
    q = jnp.zeros(batch.turn_mask.shape).at[0, 0].set(0.2)
    total, denom = sarsa(q, batch)
    assert float(denom) == 1.0 and abs(float(total) - 0.5 * (0.2 - 0.7) ** 2) < 1e-7
    g = jax.grad(lambda r: sarsa(q, batch.replace(turn_rewards=r))[0])(batch.turn_rewards)
    assert np.all(np.asarray(g) == 0)
    with pytest.raises(ValueError, match="q_values"):
        sarsa(jnp.zeros((2, 2)), batch)


# ----------------------------------------------------------------------------- with the model


def test_sapo_objective_end_to_end_with_the_value_head():
    """Policy and value from one backbone: V read before each action, Q after it; the value
    terms train the value head (and the backbone unless value_stop_gradient)."""
    from flax import nnx

    from jaxrl_agent import estimators, losses
    from jaxrl_agent.models import ModelConfig, policy_forward
    from tests.test_models import BASE, _model

    recs = random_records(np.random.default_rng(4), num_traj=4, max_turns=3, logprobs=True)
    for r in recs:
        for t in r["turns"]:
            t["observation"] = [1] + t["observation"]  # a prompt token before every action
    batch, _ = _pack(recs, "per_step")
    coefs = {"policy": 1.0, "value": 0.5, "sarsa": 0.25}

    def objective(model, batch, coefs):
        logprobs, values = policy_forward(model, batch, value_alignment="at_token")
        v_turn = segments.turn_values_from_tokens(values, batch, "before_action")
        adv = estimators.sapo(batch.replace(extras={**batch.extras,
                                                    "turn_values": jax.lax.stop_gradient(v_turn)}))
        terms = losses.sapo_terms(logprobs, values, batch, adv, gamma=0.9)
        return losses.weighted_total(terms, coefs), terms

    for stop in (False, True):
        model = _model(ModelConfig(**BASE, family="qwen2", qkv_bias=True, value_head=True,
                                   value_stop_gradient=stop))
        graphdef, state = nnx.split(model)

        @jax.jit
        def grads(state, coefs):
            def f(state):
                return objective(nnx.merge(graphdef, state), batch, coefs)
            return jax.grad(f, has_aux=True)(state)

        g_all, terms = grads(state, coefs)
        for name, (total, denom) in terms.items():
            assert np.isfinite(float(total)) and float(denom) > 0, name
        g_value, _ = grads(state, {"value": 1.0, "sarsa": 1.0})
        flat = {"/".join(map(str, k)): np.asarray(v) for k, v in
                nnx.to_flat_state(g_value)}
        head = [v for k, v in flat.items() if k.startswith("value_head")]
        backbone = [v for k, v in flat.items() if not k.startswith("value_head")]
        assert max(np.abs(h).max() for h in head) > 0
        backbone_max = max(np.abs(b).max() for b in backbone)
        assert (backbone_max == 0) if stop else (backbone_max > 0)
        g_pol, _ = grads(state, {"policy": 1.0})
        flat = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(g_pol)}
        assert all(np.all(v == 0) for k, v in flat.items() if k.startswith("value_head"))


def test_weighted_total_and_errors():
    from jaxrl_agent.losses import weighted_total

    terms = {"a": (jnp.float32(3.0), jnp.float32(2.0)), "b": (jnp.float32(1.0), jnp.float32(0.0))}
    assert float(weighted_total(terms, {"a": 2.0, "b": 5.0})) == 3.0
    with pytest.raises(ValueError, match="unknown terms"):
        weighted_total(terms, {"c": 1.0})


def test_sarsa_padding_and_shard_invariance():
    rng = np.random.default_rng(7)
    recs = random_records(rng, num_traj=16)
    for i, r in enumerate(recs):
        r["group"] = i // 2
    small, idx_s = pack_records(recs, pad_to={"num_traj": 16, "num_turns": 4, "row_len": 32})
    big, idx_b = pack_records(recs, pad_to={"num_traj": 32, "num_turns": 8, "row_len": 32})
    q_rows = [rng.normal(size=len(r["turns"])).astype(np.float32) for r in recs]

    def q_of(batch, index):
        q = np.full(batch.turn_mask.shape, np.nan, np.float32)  # padding holds NaN
        for i, n in enumerate(index.traj):
            q[n, :len(q_rows[i])] = q_rows[i]
        return jnp.asarray(q)

    s1, d1 = sarsa(q_of(small, idx_s), small, gamma=0.9)
    s2, d2 = sarsa(q_of(big, idx_b), big, gamma=0.9)
    assert float(d1) == float(d2) and abs(float(s1) - float(s2)) < 1e-5 and np.isfinite(float(s1))
    sharded_b, idx_8 = pack_records(recs, num_shards=8,
                                    pad_to={"num_traj": 16, "num_turns": 4, "row_len": 32})
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))

    def per_shard(q, b):
        s, d = sarsa(q, b, gamma=0.9)
        return jax.lax.psum(s, "data"), jax.lax.psum(d, "data")

    fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("data"), P("data")),
                               out_specs=(P(), P())))
    s3, d3 = fn(q_of(sharded_b, idx_8), sharded_b)
    assert float(d3) == float(d1) and abs(float(s3) - float(s1)) < 1e-5
