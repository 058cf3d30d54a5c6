"""The training loop: end-to-end smoke run, resume equality, env faults, staleness, config errors,
and the train step's own invariants (micro-batching, data parallelism, non-finite skips)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_agent import cli, envs, registry
from jaxrl_agent import config as config_lib
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.envs.gridworld import GridWorld
from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import Transformer
from jaxrl_agent.train import loop, rundir
from jaxrl_agent.train.checkpoint import Checkpointer
from jaxrl_agent.sampling.jax_sampler import JaxSampler
from jaxrl_agent.train.metrics import read_metrics
from jaxrl_agent.train.step import StepConfig, init_state, make_optimizer, make_train_step

from tests.runs import TINY, deterministic as _deterministic, tiny_config  # noqa: F401


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    cfg = tiny_config(d, "trainer.steps=4", "trainer.warmup_sft_steps=2",
                      "metrics.policy_drift=true")
    summary = loop.Trainer(cfg, progress=False).run()
    return d, cfg, summary


def test_smoke_run_writes_everything(full_run):
    d, cfg, summary = full_run
    assert summary.steps == 4
    rows = read_metrics(d / "metrics" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for r in rows[1:]:
        for k in ("train/reward", "train/success", "train/loss", "train/grad_norm",
                  "train/entropy", "train/approx_kl", "train/approx_kl_k3",
                  "train/clip_fraction", "train/clip_low_fraction", "train/clip_high_fraction",
                  "train/group_zero_frac", "train/adv_std", "train/response_len_turn",
                  "train/response_len_traj", "train/updates", "train/idle_total",
                  "train/kl_after_update", "train/kl_to_start", "train/truncated",
                  "train/noop_turns", "train/repeat_turns", "train/credit_failed",
                  "train/credit_no_success_groups"):
            assert math.isfinite(r[k]), (k, r)
        assert r["train/kl_after_update"] > 0  # every step moves the policy
        assert r["train/update_skipped"] == 0 and r["train/entropy"] > 0
        assert 1 <= r["train/response_len_turn"] <= 8  # rollout.max_new_tokens
    assert "eval/success" in rows[2] and "eval/success" in rows[4]
    assert Checkpointer(d / "checkpoints", every=2, keep=3).all_steps() == [2, 4]
    for p in summary.plots:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    for folder in ("final_model", "warmup_model", "base_model"):
        assert (d / folder / "config.json").exists() and (d / folder / "tokenizer.json").exists()
    assert config_lib.read_yaml(d / "config.yaml") == config_lib.to_dict(cfg)


def test_resume_equals_uninterrupted_run(full_run, tmp_path, monkeypatch):
    d_full, _, full_summary = full_run
    cfg = tiny_config(tmp_path, "trainer.steps=4", "trainer.warmup_sft_steps=2",
                      "metrics.policy_drift=true")
    real_step = loop.Trainer._one_step

    def crash_at_3(self, state, s):
        if s == 3:
            raise KeyboardInterrupt
        return real_step(self, state, s)

    monkeypatch.setattr(loop.Trainer, "_one_step", crash_at_3)
    with pytest.raises(KeyboardInterrupt):
        loop.Trainer(cfg, progress=False).run()
    # steps 1-3 finished: 2 by the schedule, 3 saved at exit
    assert Checkpointer(tmp_path / "checkpoints", every=2, keep=3).all_steps() == [2, 3]
    monkeypatch.setattr(loop.Trainer, "_one_step", real_step)
    with pytest.raises(config_lib.ConfigError, match="--resume"):
        loop.Trainer(cfg, progress=False).run()  # a fresh run must not overwrite checkpoints
    summary = loop.Trainer(cfg, resume=True, progress=False).run()
    assert summary.steps == 4
    full = _deterministic(read_metrics(d_full / "metrics" / "metrics.jsonl"))
    resumed = _deterministic(read_metrics(tmp_path / "metrics" / "metrics.jsonl"))
    assert resumed == full
    assert summary.eval_final == full_summary.eval_final


def test_two_runs_never_share_a_checkpoint_dir(tmp_path):
    cfg = tiny_config(tmp_path)
    held = rundir.lock_run_dir(config_lib.run_paths(cfg).root)
    try:
        with pytest.raises(rundir.RunLockedError, match="another process"):
            loop.Trainer(cfg, progress=False).run()
    finally:
        held.close()


def test_resume_refuses_changed_config(full_run):
    d, _, _ = full_run
    cfg = tiny_config(d, "trainer.steps=6", "optimizer.lr=5e-4", "rollout.group_size=4")
    with pytest.raises(config_lib.ConfigError,
                       match=r"optimizer.lr: the run has 0.001, now 0.0005; rollout.group_size: "
                             r"the run has 2, now 4"):
        loop.Trainer(cfg, resume=True, progress=False).run()


def test_eval_command(full_run, capsys):
    d, _, _ = full_run
    assert cli.main(["eval", str(d), "--tasks", "3"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["step"] == 4 and res["tasks"] == 3 and 0.0 <= res["success"] <= 1.0


class _Flaky(GridWorld):
    """Raises on the third step of every episode."""

    def step(self, action):
        self._calls = getattr(self, "_calls", 0) + 1
        if self._calls == 3:
            raise RuntimeError("simulated env crash")
        return super().step(action)


def test_env_faults_do_not_end_the_run(tmp_path, request):
    envs.register("flaky_grid_test", _Flaky)
    request.addfinalizer(lambda: registry.unregister("flaky_grid_test", "env"))
    cfg = tiny_config(tmp_path, "env.name=flaky_grid_test", "trainer.steps=2",
                      "trainer.eval_every=0", "rollout.max_turns=4", "checkpoint.every=0",
                      "rollout.temperature=0.0")
    summary = loop.Trainer(cfg, progress=False).run()
    rows = read_metrics(tmp_path / "metrics" / "metrics.jsonl")
    assert summary.steps == 2
    assert sum(r["train/env_errors"] for r in rows) > 0


def test_demonstrations_skip_faulty_episodes():
    from jaxrl_agent.rollout.collect import ByteCodec, RolloutConfig
    from jaxrl_agent.train.sft import demonstration_records
    env = _Flaky(max_turns=12)
    tasks = env.sample_tasks(0, 4, "train")
    with pytest.raises(RuntimeError, match="every demonstration episode failed"):
        demonstration_records(env, tasks, ByteCodec(), RolloutConfig(max_turns=12))
    good = demonstration_records(GridWorld(max_turns=12), tasks, ByteCodec(),
                                 RolloutConfig(max_turns=12))
    assert len(good) == 4 and all(r["turns"][-1]["reward"] == 1.0 for r in good)


def test_noisy_demonstrator():
    """``noise`` = eps: each demonstration turn is a uniformly random action with probability
    eps (the episode follows it), else the solver's; reproducible from the seed."""
    from jaxrl_agent.envs.base import Env
    from jaxrl_agent.envs.calculator import Calculator
    from jaxrl_agent.rollout.collect import ByteCodec, RolloutConfig
    from jaxrl_agent.train.sft import demonstration_records
    env = GridWorld(max_turns=12, action_names="letters")
    tasks = env.sample_tasks(0, 200, "train")
    cfg = RolloutConfig(max_turns=12, history="last")
    codec = ByteCodec()

    by_id = {t.id: t for t in tasks}

    def off_solver(recs):  # replay the episodes; count actions that are not the solver's
        n = bad = 0
        e = env.clone()
        for r in recs:  # history "last": one record per turn, "<task>#<turn>"
            if r["group"].endswith("#0"):
                e.reset(by_id[r["task"]])
            act = codec.decode(r["turns"][0]["action"][:-1])
            bad += act != e.solver()
            n += 1
            e.step(act)
        return bad / n

    clean = demonstration_records(env, tasks[:50], codec, cfg)
    assert clean == demonstration_records(env, tasks[:50], codec, cfg, noise=0.0, seed=5)
    recs = [demonstration_records(env, tasks, codec, cfg, noise=0.3, seed=s) for s in (1, 1, 2)]
    assert recs[0] == recs[1] and recs[0] != recs[2]
    # a random action equals the solver's 1/6 of the time: expected 0.3 * 5/6 = 0.25
    assert 0.2 < off_solver(recs[0]) < 0.3 and off_solver(clean) == 0.0
    assert not hasattr(Calculator, "random_action") or \
        Calculator.random_action is Env.random_action
    with pytest.raises(ValueError, match="random_action"):
        demonstration_records(Calculator(), Calculator().sample_tasks(0, 2, "train"), codec,
                              cfg, noise=0.1)


def test_refuse_stale_drops_whole_groups():
    recs = [{"group": "a", "turns": [{"policy_version": 3}, {"policy_version": 4}]},
            {"group": "a", "turns": [{"policy_version": 4}]},
            {"group": "b", "turns": [{"policy_version": 4}]}]
    kept, refused = loop.refuse_stale(recs, version=4, max_lag=0)
    assert [r["group"] for r in kept] == ["b"] and refused == 2
    kept, refused = loop.refuse_stale(recs, version=4, max_lag=1)
    assert len(kept) == 3 and refused == 0


def test_staleness_guard_in_the_loop(tmp_path, monkeypatch):
    # A sampler that never receives new weights (nor frees its old ones during the step) keeps
    # stamping version 0.
    monkeypatch.setattr(loop.Trainer, "_sync", lambda self, state: None)
    monkeypatch.setattr(JaxSampler, "release_weights", lambda self: None)
    cfg = tiny_config(tmp_path, "trainer.steps=3", "trainer.eval_every=0",
                      "checkpoint.every=0", "trainer.max_policy_lag=1")
    with pytest.raises(loop.StaleBatchError, match="max_policy_lag"):
        loop.Trainer(cfg, progress=False).run()
    rows = read_metrics(tmp_path / "metrics" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]  # versions 0 and 1 were within the lag


def test_cli_train_config_errors(tmp_path, capsys):
    assert cli.main(["train", "--set", "trainer.stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "trainer.stepz" in err and "steps" in err
    assert cli.main(["train", "--set", "rollout.history=last",
                     "--set", "trainer.layout=concatenated"]) == 2
    assert "per_step" in capsys.readouterr().err
    assert cli.main(["train", str(tmp_path / "missing.yaml")]) == 2


# ----------------------------------------------------------------------------- train step


def _model(value_head=False):
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2, value_head=value_head)
    return Transformer(cfg, rngs=nnx.Rngs(0))


def _records(n_groups=4, g=2, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n_groups * g):
        turns = [{"observation": rng.integers(3, 64, 3).tolist(),
                  "action": rng.integers(3, 64, int(rng.integers(1, 4))).tolist(),
                  "reward": 0.0, "logprobs": (-rng.random(3)).tolist()}
                 for _ in range(int(rng.integers(1, 3)))]
        for t in turns:
            t["logprobs"] = t["logprobs"][:len(t["action"])]
        recs.append({"group": f"g{i // g}", "outcome": float(rng.random() < 0.5), "turns": turns})
    return recs


def _run_step(step_cfg, batch, model=None, devices=1, opt=None):
    model = model or _model(step_cfg.needs_values)
    opt = opt or make_optimizer(1e-2, total_steps=10)
    state = init_state(model, opt, seed=0, with_reference=step_cfg.kl_coef > 0)
    fn = make_train_step(model, opt, step_cfg)
    if devices > 1:
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]), ("data",))
        batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
        state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return fn(state, batch)


@pytest.mark.parametrize("layout,extra", [
    ("concatenated", {}),
    ("per_step", {"kl_coef": 0.1, "entropy_coef": 0.01, "agg": "traj_mean_token_mean"}),
    # SAPO's SARSA term (turns of the micro-batch's own trajectories) and an auxiliary loss
    ("concatenated", {"estimator": "turn_gae", "sarsa_coef": 0.5,
                      "aux_losses": (("weighted_sft", 0.3, ()),)})])
def test_micro_batches_and_data_parallel_match_one_pass(layout, extra):
    # SGD with lr 1: the parameter change is the gradient itself (Adam's first step would
    # amplify float noise of near-zero gradients to +-lr).
    sgd = optax.sgd(1.0)
    recs = _records()
    b1, _ = pack_records(recs, layout=layout, num_shards=4)
    s1, o1 = _run_step(StepConfig(**extra), b1, opt=sgd)
    s2, o2 = _run_step(StepConfig(**extra, micro_batches=4), b1, opt=sgd)
    s3, o3 = _run_step(StepConfig(**extra, micro_batches=2, data_shards=2), b1, devices=2,
                       opt=sgd)
    for s, o in ((s2, o2), (s3, o3)):
        np.testing.assert_allclose(o["metrics"]["loss"], o1["metrics"]["loss"], rtol=1e-5,
                                   atol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                     s.params, s1.params)
    assert int(s1.step) == 1 and int(s1.skipped) == 0
    for term in ("sarsa", "aux_weighted_sft"):  # the terms ran (and were compared above)
        if term in o1["metrics"] or extra.get("sarsa_coef"):
            assert float(o1["metrics"][f"loss_{term}"]) > 0, term


def test_critic_estimator_step_trains_the_value_head():
    recs = _records()
    b, _ = pack_records(recs, layout="concatenated")
    state0_model = _model(value_head=True)
    before = nnx.state(state0_model, nnx.Param)["value_head"]["kernel"][...]
    s, o = _run_step(StepConfig(estimator="gae", value_coef=0.5), b, model=state0_model)
    assert math.isfinite(float(o["metrics"]["loss_value"]))
    after = s.params["value_head"]["kernel"][...]
    assert not np.allclose(before, after)


def test_non_finite_loss_skips_the_update():
    recs = _records()
    b, _ = pack_records(recs, layout="concatenated")
    bad = b.replace(old_logprobs=jnp.where(b.action_mask, jnp.nan, b.old_logprobs))
    model = _model()
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    s2, o2 = _run_step(StepConfig(), bad, model=model)
    assert float(o2["metrics"]["update_skipped"]) == 1.0 and int(s2.skipped) == 1
    jax.tree.map(lambda a, b_: np.testing.assert_array_equal(np.asarray(a), b_), s2.params, before)


@pytest.mark.parametrize("estimator,params,value_head", [
    ("gigpo", {}, False),
    ("gigpo", {"anchor": "similar", "sim_threshold": 0.5}, False),
    ("bipace", {"tau": 0.5}, False),
    ("hae", {}, True),
])
def test_step_level_estimators_in_the_train_step(estimator, params, value_head):
    """The loop supplies what these read: state keys (records), the policy's hidden state at
    each decision point (bipace, similarity anchors), values and a single segment (hae)."""
    recs = _records()
    for r in recs:  # recurring states: every first turn of a group sees the same observation
        r["turns"][0]["state_key"] = r["group"]
    b, _ = pack_records(recs, layout="per_step")
    cfg = StepConfig(estimator=estimator, estimator_params=tuple(params.items()))
    assert cfg.needs_hidden == (estimator == "bipace" or "anchor" in params)
    s, o = _run_step(cfg, b, model=_model(value_head))
    assert math.isfinite(float(o["metrics"]["loss"])) and int(s.skipped) == 0
