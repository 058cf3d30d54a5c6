"""Per-step diagnostics: how far a step moved the policy (``step.drift_metrics``, checked
against log-probs recomputed from the returned parameters) and what a step's episodes did and
where its credit went (``train.diagnostics``, checked on hand-made records)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import Transformer
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.train.diagnostics import credit_metrics, episode_metrics, shuffled_outcomes
from jaxrl_agent.train.step import (StepConfig, init_state, make_train_step,
                                    sampled_logprobs)


def _records(seed=0, n=8, g=2):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        turns = [{"observation": rng.integers(3, 64, 3).tolist(),
                  "action": rng.integers(3, 64, int(rng.integers(1, 4))).tolist(),
                  "reward": 0.0} for _ in range(int(rng.integers(1, 3)))]
        for t in turns:
            t["logprobs"] = (-rng.random(len(t["action"])) - 2.0).tolist()
        recs.append({"group": i // g, "outcome": float(i % 2), "turns": turns})
    return recs


def _k3(new, old, mask):
    lr = np.where(mask, np.asarray(new) - np.asarray(old), 0.0)
    return float(np.sum(np.where(mask, np.exp(lr) - 1.0 - lr, 0.0)) / max(mask.sum(), 1))


@pytest.mark.parametrize("kl_coef,micro", [(0.0, 1), (0.1, 2)])
def test_drift_metrics_match_logprobs_of_the_returned_params(kl_coef, micro):
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    batch, _ = pack_records(_records(), layout="concatenated", num_shards=micro)
    step_cfg = StepConfig(policy_drift=True, kl_coef=kl_coef, micro_batches=micro)
    opt = optax.adam(1e-2)
    state = init_state(model, opt, seed=0, with_reference=True)
    new_state, out = make_train_step(model, opt, step_cfg)(state, batch)
    m = out["metrics"]
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def logprobs(params):
        logits = nnx.merge(graphdef, params, rest)(batch.tokens).logits
        return sampled_logprobs(logits, batch.tokens)[0]

    mask = np.asarray(batch.action_mask)
    want_after = _k3(logprobs(new_state.params), batch.old_logprobs, mask)
    want_start = _k3(logprobs(state.params), batch.old_logprobs, mask)
    np.testing.assert_allclose(float(m["kl_after_update"]), want_after, rtol=1e-4)
    np.testing.assert_allclose(float(m["kl_to_start"]), want_start, rtol=1e-4)
    assert want_after != pytest.approx(want_start)  # the update moved the policy


def test_drift_is_zero_when_nothing_moved():
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    batch, _ = pack_records(_records(1), layout="concatenated")
    logits = model(batch.tokens).logits
    own = jnp.where(batch.action_mask, sampled_logprobs(logits, batch.tokens)[0], 0.0)
    batch = batch.replace(old_logprobs=own)  # sampled by these very weights
    opt = optax.sgd(0.0)
    state = init_state(model, opt, seed=0, with_reference=True)
    _, out = make_train_step(model, opt, StepConfig(policy_drift=True))(state, batch)
    assert abs(float(out["metrics"]["kl_after_update"])) < 1e-6
    assert abs(float(out["metrics"]["kl_to_start"])) < 1e-6


def test_no_drift_metrics_unless_asked():
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    batch, _ = pack_records(_records(), layout="concatenated")
    opt = optax.adam(1e-3)
    _, out = make_train_step(model, opt, StepConfig())(init_state(model, opt, seed=0), batch)
    assert "kl_after_update" not in out["metrics"] and "kl_to_start" not in out["metrics"]
    jax.block_until_ready(out["metrics"]["loss"])


def _turns(*keys):
    return [{"state_key": k, "action": [1], "reward": 0.0} for k in keys]


def test_episode_metrics_count_noops_loops_and_timeouts():
    recs = [{"group": 0, "turns": _turns("a", "b", "b", "a"), "truncated": True},   # noop, loop
            {"group": 0, "turns": _turns("a", "b", "c"), "truncated": False},
            {"group": 1, "turns": _turns("x"), "truncated": False}]
    m = episode_metrics(recs)
    assert m["train/truncated"] == pytest.approx(1 / 3)
    # successor pairs: 3 + 2 + 0 = 5; no-ops: (b, b) = 1; repeats: turn 2 (b) and 3 (a) = 2
    assert m["train/noop_turns"] == pytest.approx(1 / 5)
    assert m["train/repeat_turns"] == pytest.approx(2 / 5)
    assert episode_metrics([]) == {}


def test_credit_metrics_split_the_mass_by_outcome_and_group():
    recs = [{"group": 0, "success": 1.0, "turns": _turns("a", "b")},
            {"group": 0, "success": 0.0, "turns": _turns("a")},
            {"group": 1, "success": 0.0, "turns": _turns("a", "b")},   # a group of failures
            {"group": 1, "success": 0.0, "turns": _turns("a")}]
    turn = np.array([[1.0, 1.0, 9.0],    # col 2 is past the end: ignored
                     [-2.0, 0.0, 0.0],
                     [0.5, 0.5, 0.0],
                     [-1.0, 5.0, 0.0]])   # col 1 past the end
    m = credit_metrics(recs, turn)
    total = 2.0 + 2.0 + 1.0 + 1.0
    assert m["train/credit_failed"] == pytest.approx(4.0 / total)
    assert m["train/credit_no_success_groups"] == pytest.approx(2.0 / total)
    assert m["train/credit_failed_signed"] == pytest.approx((-2.0 + 1.0 - 1.0) / total)
    zero = credit_metrics(recs, np.zeros((4, 3)))
    assert set(zero.values()) == {0.0}


def test_shuffled_outcomes_permute_the_returns_and_keep_the_rest():
    recs = [{"group": i // 3, "success": float(i == 4), "outcome": float(i),
             "turns": [dict(t, reward=-0.1) for t in _turns(*"abc"[:1 + i % 3])]}
            for i in range(6)]
    recs.append({"group": 2, "success": 0.0, "turns": [dict(t, reward=0.25) for t in
                                                        _turns("a", "b")]})  # no outcome: 0.5
    before = [dict(r) for r in recs]
    out = shuffled_outcomes(recs, seed=3)
    assert recs == before                                   # the inputs are untouched
    assert sorted(r["outcome"] for r in out) == sorted([0.0, 1, 2, 3, 4, 5, 0.5])
    assert [r["outcome"] for r in out] != [r.get("outcome", 0.5) for r in recs]  # some move
    for r, o in zip(recs, out):
        assert [t["reward"] for t in o["turns"]] == [0.0] * (len(r["turns"]) - 1) + [o["outcome"]]
        assert o["success"] == r["success"] and o["group"] == r["group"]
        assert [t["state_key"] for t in o["turns"]] == [t["state_key"] for t in r["turns"]]
    assert shuffled_outcomes(recs, seed=3) == out            # seeded
    assert shuffled_outcomes(recs[:1], seed=0) == recs[:1]


def test_samples_fill_the_limit_and_carry_each_records_own_credit():
    from jaxrl_agent.train.samples import credit_trajectories
    recs = [{"group": g, "task": f"t{g}", "outcome": float(i), "success": float(i),
             "turns": [{"action_text": f"a{g}{i}", "reward": 0.0}]}
            for g in range(2) for i in range(2)]
    turn = np.arange(4, dtype=float)[:, None] * 10.0  # record i's credit is 10 i
    rows = credit_trajectories(recs, turn, limit=4)
    assert len(rows) == 4  # 2 groups: one mixed group's best and worst, then the rest
    for r in rows:
        g, i = (int(c) for c in r["turns"][0]["action"][1:])
        assert r["turns"][0]["credit"] == 10.0 * (2 * g + i)
    assert len(credit_trajectories(recs, turn, limit=10)) == 4


def test_the_start_up_says_which_prompt_format_a_run_uses():
    import types
    from jaxrl_agent import config as config_lib
    from jaxrl_agent.train.loop import Trainer
    say = lambda chat, template: Trainer.prompt_summary(types.SimpleNamespace(  # noqa: E731
        cfg=config_lib.load(None, [f"rollout.chat={str(chat).lower()}"], validate=False),
        codec=types.SimpleNamespace(chat_template=template)))
    assert say(True, "{{ x }}") == "prompts: the checkpoint's chat template (rollout.chat: true)"
    assert say(False, None) == "prompts: raw text, no chat template (rollout.chat: false)"
    assert "has a chat template, unused (rollout.chat: true uses it; a task with a system " \
           "message is refused without it)" in say(
        False, "{{ x }}")
