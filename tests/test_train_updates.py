"""The train step's updates: PPO epochs and mini-batches, log-probs of the distribution the
rollouts were sampled from (temperature, top-k, top-p), no update from zero advantages, the
learning-rate warm-up, and the diagnostics it reports."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_agent.rollout.records import assign_shards, pack_records
from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import Transformer
from jaxrl_agent.sampling import JaxSampler, SamplingParams
from jaxrl_agent.train.step import (StepConfig, advantage_metrics, init_state, make_optimizer,
                                    make_train_step, sampled_logprobs, warmup_schedule)

MODEL = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=2)


def _model():
    return Transformer(MODEL, rngs=nnx.Rngs(0))


def _records(n_groups=4, g=2, seed=0, outcomes=None):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n_groups * g):
        turns = [{"observation": rng.integers(3, 64, 3).tolist(),
                  "action": rng.integers(3, 64, int(rng.integers(1, 4))).tolist(),
                  "reward": 0.0} for _ in range(int(rng.integers(1, 3)))]
        for t in turns:
            t["logprobs"] = (-rng.random(len(t["action"])) - 0.5).tolist()
        out = float(rng.random() < 0.5) if outcomes is None else outcomes[i]
        recs.append({"group": f"g{i // g}", "outcome": out, "turns": turns})
    return recs


def _step(cfg, opt):
    model = _model()
    return init_state(model, opt, seed=0, with_reference=cfg.kl_coef > 0), \
        make_train_step(model, opt, cfg)


def _same(a, b, rtol=1e-5, atol=1e-7):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         rtol=rtol, atol=atol), a, b)


# ----------------------------------------------------------------------------- epochs


@pytest.mark.parametrize("agg", ["token_mean", "traj_mean_token_mean"])
def test_ppo_epochs_equal_repeated_steps_on_the_same_rollouts(agg):
    """Epoch e + 1 is an update on the same rollouts, with the same (sampler's) old
    log-probs and the same advantages, from where epoch e left the parameters and Adam."""
    opt = make_optimizer(3e-2, total_steps=10)
    b, _ = pack_records(_records(), layout="per_step")
    s0, one = _step(StepConfig(agg=agg), opt)
    _, three = _step(StepConfig(agg=agg, ppo_epochs=3), opt)
    s1, _ = one(s0, b)
    s2, _ = one(s1, b)
    s3, o3 = one(s2, b)
    t, ot = three(s0, b)
    _same(t.params, s3.params)
    _same(t.opt_state, s3.opt_state)
    m = jax.device_get(ot["metrics"])
    assert int(t.step) == 1 and m["updates"] == 3
    # the later epochs saw a moved policy: the ratio left 1 and the clip range was reached
    assert m["approx_kl_k3"] > 0 and m["clip_fraction"] > 0


def _split_by_block(recs, blocks):
    """The records of each block of ``pack_records(recs, num_shards=blocks)`` (whole groups,
    placed by ``assign_shards``)."""
    groups: dict = {}
    for r in recs:
        groups.setdefault(r["group"], []).append(r)
    where = assign_shards([len(g) for g in groups.values()], blocks)
    out = [[] for _ in range(blocks)]
    for g, k in zip(groups.values(), where):
        out[k].extend(g)
    return out


@pytest.mark.parametrize("layout,agg", [("concatenated", "seq_mean_token_mean"),
                                        ("per_step", "traj_mean_token_mean"),
                                        ("per_step", "token_mean")])
def test_mini_batches_are_sequential_updates_on_their_own_rows(layout, agg):
    """mini_batches = 2: two updates, each on its own half of the groups with its own
    denominators: the same as two steps on two separately packed batches (GRPO's advantages
    are per group, so they do not depend on the split)."""
    opt = make_optimizer(3e-2, total_steps=10)
    recs = _records(n_groups=4, g=2, seed=1)
    b, _ = pack_records(recs, layout=layout, num_shards=2)
    halves = _split_by_block(recs, 2)
    assert all(halves) and sum(map(len, halves)) == len(recs)
    s0, one = _step(StepConfig(agg=agg), opt)
    s = s0
    for half in halves:
        bh, _ = pack_records(half, layout=layout)
        s, _ = one(s, bh)
    _, two = _step(StepConfig(agg=agg, mini_batches=2), opt)
    t, _ = two(s0, b)
    _same(t.params, s.params, rtol=1e-4, atol=1e-6)


def test_micro_batches_within_mini_batches_match_one_pass():
    """With the 4-block packing, (mini 2 x micro 2) equals (mini 2 x micro 1) on the same
    grouping of blocks into mini-batches."""
    opt = optax.sgd(1.0)
    recs = _records(n_groups=8, g=2, seed=2)
    b4, _ = pack_records(recs, layout="per_step", num_shards=4)
    s0, by_micro = _step(StepConfig(mini_batches=2, micro_batches=2), opt)
    u, ou = by_micro(s0, b4)
    # the same mini-batches as two 2-block batches, each trained in one pass
    quarters = _split_by_block(recs, 4)
    s = s0
    _, one = _step(StepConfig(), opt)
    for j in range(2):
        bj, _ = pack_records(quarters[2 * j] + quarters[2 * j + 1], layout="per_step")
        s, _ = one(s, bj)
    _same(u.params, s.params, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- no signal


def test_all_zero_advantages_skip_the_update():
    """Every group scored alike: GRPO's advantages are all 0. Adam's update would still move
    the parameters (momentum, and the KL term alone); the step leaves them and the optimizer
    state untouched and counts the update as idle."""
    opt = make_optimizer(1e-2, total_steps=10)
    flat = _records(outcomes=[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    b, _ = pack_records(flat, layout="per_step")
    cfg = StepConfig(kl_coef=0.1, ppo_epochs=2)
    s0, fn = _step(cfg, opt)
    s1, o = fn(s0, b)
    m = jax.device_get(o["metrics"])
    assert m["adv_zero_frac"] == 1.0 and m["group_zero_frac"] == 1.0
    assert int(s1.idle) == 2 and int(s1.skipped) == 0 and m["updates"] == 0
    _same(s1.params, s0.params, rtol=0, atol=0)
    _same(s1.opt_state, s0.opt_state, rtol=0, atol=0)
    assert int(s1.step) == 1  # the policy version still advances (one step was taken)
    mixed, _ = pack_records(_records(outcomes=[1.0, 0.0] + [1.0] * 6), layout="per_step")
    s2, o2 = fn(s0, mixed)
    assert int(s2.idle) == 0 and float(o2["metrics"]["updates"]) == 2
    assert not np.allclose(s2.params["embed_tokens"]["embedding"][...],
                           s0.params["embed_tokens"]["embedding"][...])


def test_learning_rate_warmup_starts_above_zero():
    sched = warmup_schedule(1e-3, total_steps=100, warmup_steps=9)
    assert float(sched(0)) == pytest.approx(1e-4)
    assert float(sched(4)) == pytest.approx(5e-4)
    assert float(sched(9)) == pytest.approx(1e-3)
    assert float(sched(100)) == pytest.approx(1e-4, rel=1e-3)
    opt = make_optimizer(1e-3, total_steps=100, warmup_steps=10)
    b, _ = pack_records(_records(outcomes=[1.0, 0.0] * 4), layout="per_step")
    s0, fn = _step(StepConfig(), opt)
    s1, _ = fn(s0, b)
    assert not np.allclose(s1.params["embed_tokens"]["embedding"][...],
                           s0.params["embed_tokens"]["embedding"][...])


# ----------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.9), (1.3, 5, 1.0),
                                                     (0.7, 8, 0.8), (1.0, 0, 1.0)])
def test_train_logprobs_equal_the_samplers_at_its_temperature_and_truncation(
        temperature, top_k, top_p):
    model = _model()
    sampler = JaxSampler(model, max_len=32, seed=0)
    prompts = [[1, 5, 9], [1, 7], [1, 3, 4, 11, 2]]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            max_new_tokens=10, seed=3)
    outs = sampler.generate(prompts, params)
    seqs = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
    T = max(map(len, seqs))
    tokens = jnp.asarray([s + [0] * (T - len(s)) for s in seqs])
    logits = model(tokens).logits
    lp, outside, _ = sampled_logprobs(logits, tokens, temperature=temperature, top_k=top_k,
                                      top_p=top_p)
    plain, _, _ = sampled_logprobs(logits, tokens)
    worst, mismatch = 0.0, 0.0
    for i, (p, o) in enumerate(zip(prompts, outs)):
        got = np.asarray(lp[i, len(p):len(p) + len(o.token_ids)])
        worst = max(worst, float(np.max(np.abs(got - np.asarray(o.logprobs)))))
        mismatch = max(mismatch, float(np.max(np.abs(
            np.asarray(plain[i, len(p):len(p) + len(o.token_ids)]) - np.asarray(o.logprobs)))))
        assert not np.asarray(outside[i, len(p):len(p) + len(o.token_ids)]).any()
    assert worst < 1e-5
    if (temperature, top_k, top_p) != (1.0, 0, 1.0):  # the untempered log-probs differ
        assert mismatch > 1e-2


def test_first_update_ratio_is_one_for_tempered_rollouts():
    """Through the whole step: the sampler's old log-probs at T = 0.7 with top-p, and a step
    configured with the same parameters, give ratio 1 before the update (k1 and k3 of the
    sampler-trainer KL are 0); a step that ignores the temperature does not."""
    model = _model()
    sampler = JaxSampler(model, max_len=32, seed=0)
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=6, stop_token_ids=(2,),
                        seed=1)
    prompts = [[1, 3 + i, 9] for i in range(8)]
    outs = sampler.generate(prompts, sp)
    recs = [{"group": f"g{i // 2}", "outcome": float(i % 2),
             "turns": [{"observation": p, "action": list(o.token_ids),
                        "logprobs": list(o.logprobs), "reward": 0.0}]}
            for i, (p, o) in enumerate(zip(prompts, outs))]
    b, _ = pack_records(recs, layout="per_step")
    opt = make_optimizer(1e-2, total_steps=10)
    for cfg, close in ((StepConfig(temperature=0.7, top_p=0.9), True), (StepConfig(), False)):
        s0 = init_state(model, opt, seed=0)
        _, o = make_train_step(model, opt, cfg)(s0, b)
        m = jax.device_get(o["metrics"])
        if close:
            assert abs(m["approx_kl"]) < 1e-6 and m["approx_kl_k3"] < 1e-9
            assert m["outside_truncation_frac"] == 0
        else:
            assert abs(m["approx_kl"]) > 1e-2


# ----------------------------------------------------------------------------- metrics


def test_advantage_metrics_against_numpy():
    recs = _records(n_groups=4, g=3, seed=4,
                    outcomes=[1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 1])
    b, _ = pack_records(recs, layout="per_step", pad_to={"num_traj": 16, "num_turns": 2,
                                                         "num_rows": 32, "row_len": 16})
    adv = np.zeros(b.tokens.shape, np.float32)
    m = np.asarray(b.action_mask)
    rt = np.asarray(b.row_traj)
    # non-zero advantages only in the trajectories of groups 1 and 3
    gid = np.asarray(b.group_ids)
    for r in range(b.num_rows):
        if m[r].any() and gid[rt[r]] in (gid[3], gid[9]):
            adv[r] = np.where(m[r], np.linspace(-1, 2, adv.shape[1]), 0.0)
    out = jax.device_get(advantage_metrics(jnp.asarray(adv), b))
    a = adv[m]
    assert out["adv_mean"] == pytest.approx(a.mean(), abs=1e-6)
    assert out["adv_std"] == pytest.approx(a.std(), abs=1e-5)
    assert out["adv_min"] == pytest.approx(a.min()) and out["adv_max"] == pytest.approx(a.max())
    assert out["adv_pos_frac"] == pytest.approx((a > 0).mean())
    assert out["adv_zero_frac"] == pytest.approx((a == 0).mean())
    assert out["group_zero_frac"] == pytest.approx(0.5)  # 2 of the 4 real groups
