"""Asynchronous rollouts: the worker threads' staleness gate and ordering, version tags and
staleness metrics, the off-policy correction in the train step (against a slow reference),
env latency and concurrent env steps, and async training runs with resume."""

import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_agent import config as config_lib
from jaxrl_agent import run_checks
from jaxrl_agent.envs.gridworld import GridWorld
from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import Transformer
from jaxrl_agent.rollout import collect_groups
from jaxrl_agent.rollout.collect import ByteCodec, RolloutConfig
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.rollout.workers import RolloutWorkers
from jaxrl_agent.sampling import JaxSampler
from jaxrl_agent.train import loop
from jaxrl_agent.train.metrics import read_metrics
from jaxrl_agent.models.transformer import token_logprobs
from jaxrl_agent.train.step import (StepConfig, init_state, make_optimizer, make_train_step,
                                    off_policy_metrics)

from tests.runs import tiny_config

# ----------------------------------------------------------------------------- workers


@pytest.mark.parametrize("lag,workers", [(1, 1), (1, 3), (2, 2), (3, 2)])
def test_workers_never_start_a_step_beyond_the_lag(lag, workers):
    """Step s starts only once the version is >= s - lag; results come back in step order
    and the trainer's version never runs ahead of what it has received."""
    version = [0]
    started = {}
    lock = threading.Lock()

    def collect(s):
        with lock:
            started[s] = version[0]
        time.sleep(0.01 * ((s * 7) % 3))  # finish out of order
        return ("step", s)

    with RolloutWorkers(collect, workers=workers, max_lag=lag, first_step=0, last_step=12,
                        version=0) as w:
        for s in range(12):
            assert w.get(s, timeout=10) == ("step", s)
            with lock:
                version[0] = s + 1  # trained step s: version s + 1
            w.advance(s + 1)
    assert sorted(started) == list(range(12))
    for s, v in started.items():
        assert v >= s - lag, (s, v)


def test_workers_resume_from_a_later_step_and_raise_a_workers_error():
    def collect(s):
        if s == 7:
            raise ValueError("env exploded at step 7")
        return s

    w = RolloutWorkers(collect, workers=2, max_lag=1, first_step=5, last_step=9, version=5)
    try:
        assert w.get(5, timeout=10) == 5
        w.advance(6)
        assert w.get(6, timeout=10) == 6
        w.advance(7)
        with pytest.raises(ValueError, match="step 7"):
            w.get(7, timeout=10)
    finally:
        w.close()


def test_workers_close_while_waiting_on_the_gate():
    calls = []
    w = RolloutWorkers(calls.append, workers=2, max_lag=1, first_step=0, last_step=100,
                       version=0)
    time.sleep(0.2)
    w.close(timeout=2)
    assert not any(t.is_alive() for t in w._threads)
    assert calls == [0, 1]  # steps 0 and 1 pass the gate at version 0; step 2 never starts
    with pytest.raises(ValueError, match="max_lag >= 1"):
        RolloutWorkers(calls.append, workers=1, max_lag=0, first_step=0, last_step=1, version=0)


def test_staleness_metrics():
    recs = [{"turns": [{"policy_version": 3}, {"policy_version": 4}]},
            {"turns": [{"policy_version": 5}]},
            {"turns": [{"policy_version": 4}, {"policy_version": 4}]}]
    m = loop.staleness_metrics(recs, version=5)
    assert m["async/lag_mean"] == pytest.approx((2 + 1 + 0 + 1 + 1) / 5)
    assert m["async/lag_max"] == 2
    assert (m["async/lag_0"], m["async/lag_1"], m["async/lag_2"]) == (0.2, 0.6, 0.2)
    assert m["async/mixed_version_frac"] == pytest.approx(1 / 3)
    assert loop.staleness_metrics([], 3) == {}


# ----------------------------------------------------------------------------- env latency


def test_env_threads_collect_the_same_records():
    """Stepping a turn's envs in a thread pool (for envs that wait: here a 20 ms simulated
    latency) changes nothing in the records: requests are seeded per trajectory and turn."""
    model = Transformer(ModelConfig(vocab_size=260, hidden_size=16, intermediate_size=32,
                                    num_layers=1, num_heads=2, num_kv_heads=2),
                        rngs=nnx.Rngs(0))
    sampler = JaxSampler(model, max_len=128, seed=0)
    env = GridWorld(max_turns=12, action_names="letters", step_latency_s=0.02)
    tasks = env.sample_tasks(np.random.default_rng(0), 4)
    out = {}
    for threads in (1, 16):
        cfg = RolloutConfig(group_size=4, max_turns=3, max_new_tokens=2, history="last",
                            env_threads=threads)
        out[threads] = collect_groups(env, tasks, sampler, ByteCodec(), cfg, seed=1)
    assert out[1][0] == out[16][0]
    assert out[1][1]["turns"] == out[16][1]["turns"] >= 16
    with pytest.raises(ValueError, match="step_latency_s"):
        GridWorld(step_latency_s=-1)
    with pytest.raises(ValueError, match="env_threads"):
        RolloutConfig(env_threads=0)


# ----------------------------------------------------------------------------- the correction

MODEL = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=2)


def _own_logprobs(model, b):
    return token_logprobs(model(b.tokens).logits, b.tokens)


def _records(model, shift, seed=0):
    """Records whose behaviour log-probs are the model's own plus ``shift`` per token (a
    sampler that is some versions behind)."""
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(8):
        turns = [{"observation": rng.integers(3, 64, 3).tolist(),
                  "action": rng.integers(3, 64, int(rng.integers(1, 4))).tolist(),
                  "reward": 0.0} for _ in range(int(rng.integers(1, 3)))]
        recs.append({"group": f"g{i // 2}", "outcome": float(rng.random() < 0.5),
                     "turns": turns})
    b, _ = pack_records([dict(r, turns=[dict(t, logprobs=[-1.0] * len(t["action"]))
                                        for t in r["turns"]]) for r in recs], layout="per_step")
    own = np.asarray(_own_logprobs(model, b))
    row = 0
    for r in recs:
        for t in r["turns"]:
            n = len(t["action"])
            start = len(t["observation"])
            noise = shift * rng.standard_normal(n)
            t["logprobs"] = (own[row, start:start + n] + noise).astype(float).tolist()
            row += 1
    return recs


def test_correction_is_a_no_op_on_policy():
    """With behaviour = proximal log-probs, decoupled PPO with truncated or masked weights is
    plain PPO: every weight is 1 and the ratio is taken against the same log-probs."""
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    b, _ = pack_records(_records(model, 0.0), layout="per_step")
    opt = make_optimizer(3e-2, total_steps=10)
    outs = {}
    for name, kw in {"plain": {}, "tis": dict(is_weights="truncate", decoupled=True),
                     "mis_seq": dict(is_weights="mask", is_level="sequence", decoupled=True,
                                     is_cap=1.01, is_lower=0.99)}.items():
        cfg = StepConfig(agg="traj_mean_token_mean", ppo_epochs=2, **kw)
        state = init_state(model, opt, seed=0)
        outs[name] = make_train_step(model, opt, cfg)(state, b)
    for name in ("tis", "mis_seq"):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6),
                     outs[name][0].params, outs["plain"][0].params)
        m = jax.device_get(outs[name][1]["metrics"])
        assert m["behaviour_kl_k3"] < 1e-6 and abs(m["is_ess"] - 1) < 1e-5
        assert m["is_corrected_frac"] == 0


def _reference_gradient(prox, beh, adv, mask, cap):
    """d loss / d lp at lp = prox of decoupled PPO with truncated weights, token_mean, one
    token at a time: the ratio against prox is 1 (inside the clip range), so the gradient is
    -A min(exp(prox - beh), cap) / n on every action token."""
    n = mask.sum()
    g = np.zeros_like(prox)
    for i, j in zip(*np.nonzero(mask)):
        g[i, j] = -adv[i, j] * min(np.exp(prox[i, j] - beh[i, j]), cap) / n
    return g


def test_decoupled_truncated_gradient_against_a_slow_reference():
    """d loss / d lp at the proximal point: -A min(p/b, cap) / n for decoupled TIS (the ratio
    against p is 1), from the loss the step builds (losses.ppo with the step's inputs)."""
    from jaxrl_agent import losses
    model = Transformer(MODEL, rngs=nnx.Rngs(1))
    b, _ = pack_records(_records(model, 0.5, seed=3), layout="per_step")
    prox = _own_logprobs(model, b)
    adv = np.where(b.action_mask, np.random.default_rng(0).standard_normal(b.tokens.shape), 0.0)
    adv = adv.astype(np.float32)
    w = losses.truncated_is_weights(prox, b, cap=1.5)

    def loss(lp):
        s, d = losses.ppo(lp, b, adv, old_logprobs=prox, is_weights=w, dual_clip=None)
        return s / d
    got = np.asarray(jax.grad(loss)(prox))
    want = _reference_gradient(np.asarray(prox), np.asarray(b.old_logprobs), adv,
                               np.asarray(b.action_mask), 1.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # the metrics of the step against numpy
    m = off_policy_metrics(prox, b, w, StepConfig(is_weights="truncate", decoupled=True,
                                                  is_cap=1.5))
    mask = np.asarray(b.action_mask)
    r = np.exp(np.asarray(prox) - np.asarray(b.old_logprobs))[mask]
    np.testing.assert_allclose(m["behaviour_kl_k3"], np.mean(r - 1 - np.log(r)), rtol=1e-4)
    np.testing.assert_allclose(m["is_ess"], r.sum() ** 2 / (r.size * (r ** 2).sum()), rtol=1e-4)
    np.testing.assert_allclose(m["is_corrected_frac"], np.mean(r > 1.5), rtol=1e-6)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("sets,match", [
    (["trainer.async_rollouts=true"], "max_policy_lag to 1"),
    (["loss.decoupled=true"], "is_weights: truncate"),
    (["loss.is_weights=truncate"], "count twice"),
    (["loss.is_weights=clip"], "loss.is_weights"),
    (["loss.is_weights=mask", "loss.is_lower=3"], "is_lower"),
    (["loss.is_weights=truncate", "loss.decoupled=true", "loss.policy=reinforce"],
     "takes no old_logprobs"),
])
def test_config_refuses_inconsistent_off_policy_settings(sets, match):
    with pytest.raises(config_lib.ConfigError, match=match):
        run_checks.load(None, sets)


# ----------------------------------------------------------------------------- runs


def test_async_run_tags_versions_bounds_lag_and_resumes(tmp_path):
    """An async run with lag 2: every step trains, the lag never exceeds 2 and is reached,
    the correction's metrics are logged; resumed to more steps, it goes on from its
    checkpoint."""
    sets = ["trainer.async_rollouts=true", "trainer.max_policy_lag=2",
            "trainer.rollout_workers=2", "loss.is_weights=truncate", "loss.decoupled=true",
            "trainer.eval_every=0", "rollout.env_threads=4"]
    cfg = tiny_config(tmp_path, "trainer.steps=4", *sets)
    loop.Trainer(cfg, progress=False).run()
    rows = [r for r in read_metrics(tmp_path / "metrics" / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["async/lag_max"] <= 2 and r["train/stale_refused"] == 0 for r in rows)
    assert max(r["async/lag_max"] for r in rows) >= 1
    assert all(np.isfinite(r["train/behaviour_kl_k3"]) and 0 < r["train/is_ess"] <= 1 + 1e-6
               for r in rows)
    cfg = tiny_config(tmp_path, "trainer.steps=6", *sets)
    loop.Trainer(cfg, resume=True, progress=False).run()
    rows = [r for r in read_metrics(tmp_path / "metrics" / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["async/lag_max"] <= 2 for r in rows)
