"""Every input a method reads has a source in training (``train.inputs``): the teacher, the
policy's entropies, the reference policy, the environment's reports and signal plug-ins.

* every registered credit method and auxiliary loss validates in a run that configures the
  sources it reads (the test plug-in ``tests.signal_plugin`` stands in for judges), and every
  registered loss has a config key;
* the step's teacher / entropy / reference pass equals the same step on records that carry
  those log-probs precomputed by the dense reference (so the values are right, nothing of
  them is trained, and an EMA teacher moves by its formula);
* a teacher of another vocabulary or tokenizer, a judge that raises or returns the wrong
  shape, a field configured nowhere: one clear error each;
* a run with a teacher, an auxiliary loss, the grid world's potential and a judge trains,
  saves its records, and ``jaxrl-agent credit`` reads them.

``JAXRL_FULL_CONFORMANCE=1`` also runs one train step per registered method (about 87
compiles; minutes): ``test_every_method_trains_one_step``.
"""

from __future__ import annotations

import json
import re
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_agent import config as C
from jaxrl_agent import losses, registry, run_checks
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.train.signals import SignalError, SignalShapeError, run_signals
from jaxrl_agent.train.step import (StepConfig, init_state, make_optimizer, make_train_step,
                                    sampled_logprobs)
import tests.signal_plugin  # noqa: F401  (registers every_signal)
from tests.test_train import _model, _records

PLUGIN = ["imports=[tests.signal_plugin]", "signals=[every_signal]", "teacher.source=live",
          "teacher.top_k=4",
          "model.value_head=true", "trainer.warmup_sft_steps=0"]


def all_methods() -> list:
    """``(kind, name)`` of every credit method and auxiliary loss."""
    return ([(k, e.name) for k in ("estimator", "shaping", "transform")
             for e in registry.entries(k)] + [("loss", n) for n in run_checks.aux_loss_names()])


def method_overrides(kind: str, name: str) -> list:
    """The config overrides that run method ``name`` (a stage after / before grpo, or grpo with
    an auxiliary loss)."""
    return {"estimator": [f"estimator.name={name}"],
            "shaping": ["estimator.name=grpo", f"estimator.shaping=[{name}]"],
            "transform": ["estimator.name=grpo", f"estimator.then=[{name}]"],
            "loss": ["estimator.name=grpo", f"loss.aux=[{name}]"]}[kind]


def test_every_registered_loss_has_a_config_key():
    """Each registered loss is the run's policy loss, KL estimator, entropy or value term, or
    an auxiliary loss (``loss.aux``); naming one under the wrong key says which key is its."""
    for name in losses.names():
        assert name in run_checks.LOSS_KEYS or name in run_checks.aux_loss_names(), name
    assert set(run_checks.aux_loss_names()) >= {"sdl", "sdar", "edge", "ucob", "icsd", "craft",
                                                "treeopsd", "t_reg", "weighted_sft"}
    with pytest.raises(C.ConfigError, match=r"loss.aux\[0\]: 'k3' has a key of its own: "
                                            r"loss.kl_estimator"):
        run_checks.load(None, ["loss.aux=[k3]"])
    with pytest.raises(C.ConfigError, match=r"unknown key 'loss.aux\[0\].params.tau' for loss "
                                            r"'sdl'; valid keys: teacher, behavior"):
        run_checks.load(None, ["teacher.source=live", "loss.aux=[{name: sdl, params: {tau: 1}}]"])


def test_every_method_validates_with_its_sources():
    """100 registered methods: the credit methods and auxiliary losses validate in a run whose
    sources supply what they read (teacher: the live policy; a value head; the grid world's
    potential; the test judge for the rest), and the step reads what ``estimators --sources``
    lists."""
    refused = []
    for kind, name in all_methods():
        try:
            cfg = run_checks.load(None, PLUGIN + method_overrides(kind, name))
        except C.ConfigError as e:
            refused.append((name, str(e)))
            continue
        listed = {f for f, _ in run_checks.method_reads(kind, name)}
        step = set(run_checks.step_reads(cfg))
        assert step <= listed, (name, step, listed)
    assert not refused
    n_losses = len(run_checks.LOSS_KEYS)
    assert len(all_methods()) + n_losses == len(registry.names("estimator")) + len(
        registry.names("shaping")) + len(registry.names("transform")) + len(losses.names())


@pytest.mark.parametrize("overrides,match", [
    (["estimator.name=opd"], r"opd reads extras\['teacher_logprobs'\].*set teacher.source"),
    (["loss.aux=[sdl]"], r"loss.aux: sdl reads extras\['teacher_logprobs'\].*teacher.source"),
    (["estimator.then=[procredit]"],
     r"procredit reads extras\['progress'\], which no source of this run supplies: an "
     r"environment that reports it.*signals:"),
    (["signals=[no_such_judge]"], r"signals\[0\]: unknown signal 'no_such_judge'"),
    (["teacher.ema_decay=1.0"], r"teacher.ema_decay must lie in \(0, 1\)"),
])
def test_a_field_configured_nowhere_names_its_key(overrides, match):
    with pytest.raises(C.ConfigError, match=match):
        run_checks.load(None, overrides)


def test_sources_listing(capsys):
    from jaxrl_agent import cli
    assert cli.main(["estimators", "--sources"]) == 0
    out = capsys.readouterr().out
    assert "opd                  estimator  teacher_logprobs <- teacher (teacher.source" in out
    assert "pbrs                 shaping    potential <- env (reported by gridworld, sokoban)" in out
    assert "taco                 transform  entropy <- policy" in out
    assert "oprl" in out and "ref_logprobs <- reference" in out
    assert f"{len(all_methods())} methods;" in out


# ----------------------------------------------------------------------------- the step


def _dense(model, batch, temperature):
    """Log-probs and entropies of the sampled tokens from the full logits (the reference)."""
    logits = model(batch.tokens, positions=batch.extras.get("positions"),
                   segment_ids=batch.extras.get("segment_ids")).logits
    lp, _, z = sampled_logprobs(logits, batch.tokens, temperature=temperature)
    ent = losses.entropy_from_logits(z)
    ent = jnp.concatenate([jnp.zeros_like(ent[:, :1]), ent[:, :-1]], axis=1)
    m = batch.action_mask
    return jnp.where(m, lp, 0.0), jnp.where(m, ent, 0.0)


def test_step_sources_equal_precomputed_inputs(micro=2):
    """An EMA teacher, the policy's entropies and the reference policy computed in the step
    (one micro-batch of rows at a time; the single-pass case is the next test's) give the
    same update as the same step
    on a batch that carries them precomputed from the full logits (teacher and reference:
    another model A, the policy: model B, on-policy rollouts); the EMA teacher then equals
    d A + (1 - d) B'."""
    from flax import nnx

    from jaxrl_agent.models.transformer import Transformer
    temp = 0.7
    teacher_model, policy = _model(), _model()
    policy = Transformer(policy.config, rngs=nnx.Rngs(1))
    batch, _ = pack_records(_records(), layout="per_step", num_shards=micro)
    lp_t, _ = _dense(teacher_model, batch, temp)
    lp_p, ent = _dense(policy, batch, temp)
    batch = batch.replace(old_logprobs=lp_p)  # on-policy: the PPO ratio starts at 1
    common = dict(estimator="opd", then=(("eapo", ()), ("oprl", (("prm", "teacher_logprobs"),))),
                  aux_losses=(("sdl", 0.5, ()),), temperature=temp, micro_batches=micro)
    in_step = StepConfig(**common, teacher="ema", teacher_ema=0.9,
                         extra_reads=("entropy", "ref_logprobs", "teacher_logprobs"))
    opt = optax.sgd(0.1)  # Adam would amplify float noise of near-zero gradients
    a = nnx.state(teacher_model, nnx.Param)
    state = init_state(policy, opt, seed=0, with_reference=True, ema_teacher=True)
    state = state.replace(ref_params=a, teacher_params=a)
    s1, o1 = make_train_step(policy, opt, in_step)(state, batch)
    pre = batch.replace(extras={**batch.extras, "teacher_logprobs": lp_t, "ref_logprobs": lp_t,
                                "entropy": ent})
    s2, o2 = make_train_step(policy, opt, StepConfig(**common))(
        init_state(policy, opt, seed=0), pre)
    m1, m2 = jax.device_get(o1["metrics"]), jax.device_get(o2["metrics"])
    assert m1["loss_aux_sdl"] > 0 and m1["grad_norm"] > 0 and m1["adv_abs"] > 0
    for k in ("loss", "loss_policy", "loss_aux_sdl", "grad_norm", "adv_abs"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=2e-4, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(np.asarray(o1["advantages"].token),
                               np.asarray(o2["advantages"].token), rtol=2e-4, atol=1e-5)
    for x, y in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
    # the sampled-token estimate of KL(rollout policy || teacher)
    m = np.asarray(batch.action_mask)
    want = (np.asarray(lp_p) - np.asarray(lp_t))[m].mean()
    np.testing.assert_allclose(m1["teacher_kl"], want, rtol=1e-4, atol=1e-6)
    for t, p0, p1 in zip(jax.tree.leaves(s1.teacher_params), jax.tree.leaves(a),
                         jax.tree.leaves(s1.params)):
        np.testing.assert_allclose(np.asarray(t), 0.9 * np.asarray(p0) + 0.1 * np.asarray(p1),
                                   rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- the teacher


def _save(tmp_path, name, vocab):
    from flax import nnx

    from jaxrl_agent.models.config import ModelConfig
    from jaxrl_agent.models.hf import save_hf
    from jaxrl_agent.models.transformer import Transformer
    from jaxrl_agent.rollout.collect import ByteCodec
    mc = ModelConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1,
                     num_heads=2, num_kv_heads=2)
    folder = tmp_path / name
    save_hf(Transformer(mc, rngs=nnx.Rngs(0)), mc, str(folder))
    ByteCodec().save_pretrained(str(folder))
    return folder


def test_teacher_of_another_vocabulary_or_tokenizer_is_refused(tmp_path):
    from jaxrl_agent.rollout.collect import ByteCodec
    from jaxrl_agent.train.teacher import load_teacher
    student = _model()  # vocabulary 64
    other = _save(tmp_path, "other_vocab", 96)
    cfg = run_checks.load(None, [f"teacher.source={other}", "estimator.name=opd"])
    with pytest.raises(C.ConfigError, match=r"teacher.source: the teacher .*other_vocab' has a "
                                            r"vocabulary of 96 tokens, the student .* 64"):
        load_teacher(cfg, student, ByteCodec())
    same = _save(tmp_path, "same_vocab", 64)

    class Shifted(ByteCodec):
        def encode(self, text):
            return [i + 1 for i in super().encode(text)]

    cfg = run_checks.load(None, [f"teacher.source={same}", "estimator.name=opd"])
    with pytest.raises(C.ConfigError, match="encode the same text differently"):
        load_teacher(cfg, student, Shifted())
    assert load_teacher(cfg, student, ByteCodec()).config.vocab_size == 64
    with pytest.raises(C.ConfigError, match="neither none, base, live, ema nor a checkpoint"):
        C.check_paths(run_checks.load(None, [f"teacher.source={tmp_path / 'nothing'}"]))


# ----------------------------------------------------------------------------- signals


@registry.register("raising_judge", kind="signal", provides={"verified": "turn"})
def raising_judge(records, *, fail: bool = True):
    if fail:
        raise KeyError("the judge's endpoint answered 503")
    return [{"turn_extras": {"verified": [1.0] * len(r["turns"])}} for r in records]


@registry.register("sloppy_judge", kind="signal", provides={"verified": "turn"})
def sloppy_judge(records, *, mode: str = "short"):
    if mode == "short":
        return [{"turn_extras": {"verified": [1.0]}} for r in records]
    if mode == "nan":
        return [{"turn_extras": {"verified": [float("nan")] * len(r["turns"])}}
                for r in records]
    if mode == "undeclared":
        return [{"turn_extras": {"verified": [1.0] * len(r["turns"]), "x": [0.0]}}
                for r in records]
    return records[:1]


def test_signals_write_the_records_form():
    recs = _records(n_groups=2)
    out = run_signals(recs, (("every_signal", ()),))
    assert "turn_extras" not in recs[0]["turns"][0]  # the input records are not changed
    batch, _ = pack_records(out, layout="per_step")
    n, k = batch.turn_mask.shape
    assert batch.extras["progress"].shape == (n, k)
    assert batch.extras["prefix_scores"].shape == batch.tokens.shape
    assert batch.extras["negative_logprobs"].shape == batch.tokens.shape + (2,)
    assert batch.extras["rubric_scores"].shape == (n, 3)
    assert batch.extras["edges"].shape[0] == n
    again = run_signals(recs, (("every_signal", ()),))
    assert again == out  # a judge of the records alone: the same records, the same signals


@pytest.mark.parametrize("mode,match", [
    ("short", r"signal 'sloppy_judge', record 0: turn_extras\['verified'\] must hold one entry "
              r"per turn \(\d\), got 1"),
    ("nan", r"turn_extras\['verified'\]\[0\] must be a finite number, got nan"),
    ("undeclared", r"returned 'x', which it does not declare"),
    ("list", r"expected a list of one dict per record \(8\), got 1"),
])
def test_a_signal_of_the_wrong_shape_is_named(mode, match):
    with pytest.raises(SignalShapeError, match=match):
        run_signals(_records(), (("sloppy_judge", (("mode", mode),)),))


def test_a_raising_signal_keeps_its_traceback():
    with pytest.raises(SignalError) as info:
        run_signals(_records(), (("raising_judge", ()),))
    assert "signal 'raising_judge' raised KeyError" in info.value.head
    assert "the judge's endpoint answered 503" in info.value.tb
    assert "raising_judge" in info.value.tb  # the user's own frame


def test_a_raising_judge_stops_the_run_after_max_failed_steps(tmp_path, capsys):
    """A judge that raises on every step: shown once with its traceback, counted, nothing is
    trained, and the run stops after trainer.max_failed_steps steps in a row."""
    from jaxrl_agent.train.loop import EnvFailureError, Trainer
    from tests.runs import tiny_config
    cfg = tiny_config(tmp_path / "run", "imports=[tests.test_sources]",
                      "signals=[raising_judge]", "estimator.name=grpo",
                      "trainer.max_failed_steps=2", "trainer.eval_every=0")
    with pytest.raises(EnvFailureError, match=r"steps 1-2: a signal plug-in failed on every "
                                              r"step \(signal 'raising_judge' raised KeyError"):
        Trainer(cfg, progress=True).run()
    out = capsys.readouterr()
    text = out.out + out.err
    assert text.count("this step trains on nothing") == 1  # shown once, with its traceback
    assert "the judge's endpoint answered 503" in text
    assert "train/signal_errors" in text
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics" / "metrics.jsonl")]
    assert [r.get("train/signal_errors") for r in rows if "train/signal_errors" in r] == [1.0]


def test_a_run_with_every_source_trains_and_saves_credit_records(tmp_path):
    """Two steps of a run whose methods read the teacher (an EMA of the policy, shown the
    grid world's plan in its own prompt), the grid world's potential (PBRS shaping) and a judge
    (re-allocation weights), with SDL as an auxiliary loss: finite losses, the teacher's KL
    logged, and the saved records give ``jaxrl-agent credit`` the run's batch."""
    from jaxrl_agent import cli
    from jaxrl_agent.train.loop import Trainer
    from tests.runs import tiny_config
    run = tmp_path / "run"
    cfg = tiny_config(run, "imports=[tests.signal_plugin]", "signals=[every_signal]",
                      "teacher.source=ema", "teacher.context=true",
                      "estimator.name=grpo", "estimator.shaping=[pbrs]",
                      "estimator.then=[reallocate]", "loss.aux=[{name: sdl, coef: 0.1}]",
                      "metrics.save_records=true", "trainer.steps=2", "trainer.eval_every=0")
    Trainer(cfg, progress=False).run()
    rows = [json.loads(x) for x in open(run / "metrics" / "metrics.jsonl")]
    last = [r for r in rows if "train/loss" in r][-1]
    for k in ("train/loss", "train/loss_aux_sdl", "train/teacher_kl"):
        assert np.isfinite(last[k]), k
    saved = run / "rollouts" / "records_2.jsonl"
    recs = [json.loads(x) for x in open(saved)]
    assert all("potential" in t["turn_extras"] and "weights" in t["turn_extras"]
               for r in recs for t in r["turns"])
    out = tmp_path / "credit.jsonl"
    assert cli.main(["credit", str(saved), "--estimator", "grpo", "--shaping", "pbrs",
                     "--then", "reallocate", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == len(recs)


@pytest.mark.skipif(not os.environ.get("JAXRL_FULL_CONFORMANCE"),
                    reason="one train step per registered method (minutes): set "
                           "JAXRL_FULL_CONFORMANCE=1")
@pytest.mark.parametrize("kind,name", all_methods())
def test_every_method_trains_one_step(kind, name):
    """One train step of every registered method with its sources: finite loss and
    gradient, and an update that moved the parameters."""
    from jaxrl_agent.train.build import step_config
    cfg = run_checks.load(None, PLUGIN + method_overrides(kind, name))
    scfg = step_config(cfg, 1)
    model = _model(value_head=True)
    recs = run_signals(_records(), C.signal_stages(cfg))
    batch, _ = pack_records(recs, layout="per_step")
    opt = make_optimizer(1e-2, total_steps=10)
    state = init_state(model, opt, seed=0, with_reference=scfg.needs_reference,
                       est_state=scfg.pipeline.init(64))
    new, out = make_train_step(model, opt, scfg)(state, batch)
    m = jax.device_get(out["metrics"])
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]), m
    assert m["update_skipped"] == 0


# ----------------------------------------------------------------------------- privileged context


def test_align_action_tokens_moves_the_kth_action_token():
    """Row by row, the values at ``mask_from``'s action positions, in order, land on
    ``mask_to``'s action positions, in order; 0 elsewhere."""
    from jaxrl_agent import segments
    rng = np.random.default_rng(0)
    r, t1, t2 = 6, 19, 11
    x = rng.normal(size=(r, t1)).astype(np.float32)
    mask_to = rng.random((r, t2)) < 0.4
    mask_from = np.zeros((r, t1), bool)
    for i in range(r):  # the same number of action tokens, at other positions
        mask_from[i, np.sort(rng.choice(t1, mask_to[i].sum(), replace=False))] = True
    out = np.asarray(segments.align_action_tokens(jnp.asarray(x), jnp.asarray(mask_from),
                                                  jnp.asarray(mask_to)))
    for i in range(r):
        np.testing.assert_array_equal(out[i, mask_to[i]], x[i, mask_from[i]])
        assert np.all(out[i, ~mask_to[i]] == 0)


@pytest.mark.parametrize("layout", ["per_step", "concatenated"])
def test_teacher_view_holds_the_same_actions_after_its_context(layout):
    """The teacher's view of grid-world records: the context after the BOS of the first prompt
    (concatenated) or of every prompt (per-step), the sampled tokens unchanged and in the same
    rows, token for token."""
    from jaxrl_agent.rollout import ByteCodec, RolloutConfig
    from jaxrl_agent.train.teacher import teacher_records
    from tests.test_env_reports import collect
    from tests.test_rollout import HintGrid
    codec = ByteCodec()
    cfg = RolloutConfig(group_size=2, max_new_tokens=8, prompt_prefix=(codec.bos_token_id,))
    recs, _ = collect(HintGrid(), cfg)
    assert all(r["teacher_context"].startswith("plan: ") for r in recs)
    run = run_checks.load(None, ["teacher.source=live", "teacher.context=true",
                        "teacher.system_prompt=You are the teacher."])
    view = teacher_records(recs, run, codec.encode, cfg.prompt_prefix, layout)
    for rec, tv in zip(recs, view):
        ctx = codec.encode("You are the teacher.\n" + rec["teacher_context"] + "\n")
        for k, (a, b) in enumerate(zip(rec["turns"], tv["turns"])):
            assert a["action"] == b["action"]
            obs = a["observation"]
            n = int(obs[:1] == [codec.bos_token_id])  # after the BOS where the prompt has one
            assert n == 1 or k > 0
            want = obs[:n] + ctx + obs[n:] if k == 0 or layout == "per_step" else obs
            assert b["observation"] == want
    student, _ = pack_records(recs, layout=layout)
    teacher, _ = pack_records(view, layout=layout)
    for i in range(student.num_rows):
        sm, tm = np.asarray(student.action_mask[i]), np.asarray(teacher.action_mask[i])
        np.testing.assert_array_equal(np.asarray(student.tokens[i])[sm],
                                      np.asarray(teacher.tokens[i])[tm])


def test_teacher_context_needs_a_teacher_and_raw_prompts():
    with pytest.raises(C.ConfigError, match="teacher.context / teacher.system_prompt give a "
                                            "teacher its own prompt: set teacher.source"):
        run_checks.load(None, ["teacher.context=true"])
    with pytest.raises(C.ConfigError, match="trainer.prefix_sharing is not supported"):
        run_checks.load(None, ["teacher.source=live", "teacher.system_prompt=hint",
                      "trainer.prefix_sharing=true"])


def test_a_teacher_with_its_own_prompt_scores_the_policys_tokens():
    """The step's teacher pass on the teacher's rows (a context before each prompt) gives the
    update of the same step on a batch carrying those log-probs precomputed from the full
    logits of the teacher's rows and moved to the policy's tokens by a plain loop."""
    from jaxrl_agent.train.step import TEACHER_VIEW
    recs = _records()
    view = [dict(r, turns=[dict(t, observation=[7, 8, 9] + t["observation"])
                           for t in r["turns"]]) for r in recs]
    batch, _ = pack_records(recs, layout="per_step")
    tb, _ = pack_records(view, layout="per_step")
    model = _model()
    lp_t, _ = _dense(model, tb, 1.0)
    lp_t, tm, sm = np.asarray(lp_t), np.asarray(tb.action_mask), np.asarray(batch.action_mask)
    moved = np.zeros(sm.shape, np.float32)
    for i in range(sm.shape[0]):
        moved[i, sm[i]] = lp_t[i, tm[i]]
    lp_p, _ = _dense(model, batch, 1.0)
    batch = batch.replace(old_logprobs=lp_p)
    with_view = batch.replace(extras={**batch.extras, TEACHER_VIEW[0]: tb.tokens,
                                      TEACHER_VIEW[1]: tb.action_mask})
    opt = optax.sgd(0.1)
    s1, o1 = make_train_step(model, opt, StepConfig(
        estimator="opd", teacher="live", teacher_view=True,
        extra_reads=("teacher_logprobs",)))(init_state(model, opt, seed=0), with_view)
    pre = batch.replace(extras={**batch.extras, "teacher_logprobs": jnp.asarray(moved)})
    s2, o2 = make_train_step(model, opt, StepConfig(estimator="opd"))(
        init_state(model, opt, seed=0), pre)
    np.testing.assert_allclose(np.asarray(o1["advantages"].token),
                               np.asarray(o2["advantages"].token), rtol=1e-4, atol=1e-5)
    assert float(o1["metrics"]["adv_abs"]) > 1e-4  # the context changed the teacher
    for x, y in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("teacher", ["live", "base"])
def test_a_teacher_at_its_own_temperature(teacher, micro=2):
    """``teacher_temperature``: the teacher's log-probs are those of its logits / tau (the
    dense reference), while the policy's entropies (``live``: the pass a teacher at the
    rollouts' temperature would share) and the reference's log-probs (``base``: likewise,
    read by the KL term) stay at the rollouts' temperature: the step equals the same step on
    a batch carrying all three precomputed."""
    from flax import nnx

    from jaxrl_agent.models.transformer import Transformer
    temp, tau = 1.0, 0.5
    policy = _model()
    other = Transformer(policy.config, rngs=nnx.Rngs(1))
    tmodel = policy if teacher == "live" else other
    batch, _ = pack_records(_records(), layout="per_step", num_shards=micro)
    lp_t, _ = _dense(tmodel, batch, tau)
    lp_ref, _ = _dense(other, batch, temp)
    lp_p, ent = _dense(policy, batch, temp)
    assert float(jnp.max(jnp.abs(lp_t - _dense(tmodel, batch, temp)[0]))) > 1e-2
    batch = batch.replace(old_logprobs=lp_p)
    common = dict(estimator="opd", temperature=temp, micro_batches=micro, kl_coef=0.1,
                  entropy_coef=0.01)
    opt = optax.sgd(0.1)
    state = init_state(policy, opt, seed=0, with_reference=True)
    state = state.replace(ref_params=nnx.state(other, nnx.Param))
    s1, o1 = make_train_step(policy, opt, StepConfig(
        **common, teacher=teacher, teacher_temperature=tau,
        extra_reads=("teacher_logprobs", "entropy", "ref_logprobs")))(state, batch)
    pre = batch.replace(extras={**batch.extras, "teacher_logprobs": lp_t, "ref_logprobs": lp_ref,
                                "entropy": ent})
    s2, o2 = make_train_step(policy, opt, StepConfig(**common))(state, pre)
    np.testing.assert_allclose(np.asarray(o1["advantages"].token),
                               np.asarray(o2["advantages"].token), rtol=2e-4, atol=1e-5)
    m1, m2 = jax.device_get(o1["metrics"]), jax.device_get(o2["metrics"])
    for k in ("loss", "loss_policy", "loss_kl", "loss_entropy", "grad_norm"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=2e-4, atol=1e-6, err_msg=k)
    for x, y in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


def test_teacher_temperature_config():
    """``teacher.temperature`` needs a teacher and a number > 0; the start-up line says the
    teacher's temperature and the rollouts'; the step config carries it."""
    from jaxrl_agent.train.build import step_config
    from jaxrl_agent.train.teacher import teacher_summary
    with pytest.raises(C.ConfigError, match=r"teacher.temperature: the temperature the teacher"
                                            r".*set teacher.source"):
        run_checks.load(None, ["teacher.temperature=0.5"])
    for bad, match in (("0", "must be a number > 0"), ("-1", "must be a number > 0"),
                       ("true", "must be float | null"), ("hot", "must be float | null")):
        with pytest.raises(C.ConfigError, match=r"teacher.temperature.* " + re.escape(match)):
            run_checks.load(None, ["teacher.source=base", "estimator.name=opd",
                                   f"teacher.temperature={bad}"])
    cfg = run_checks.load(None, ["teacher.source=base", "estimator.name=opd",
                                 "teacher.temperature=0.5"])
    line = teacher_summary(cfg, run_checks.step_reads(cfg))
    assert "at temperature 0.5 (the rollouts' is 1)" in line, line
    scfg = step_config(cfg, 1)
    assert scfg.teacher_temperature == 0.5 and scfg.retempered_teacher


# ----------------------------------------------------------------------------- top-K teacher


def _dense_lsm(model, tokens, temperature):
    """log softmax of the tempered logits at t - 1, for each position t >= 1: [R, T - 1, V]."""
    logits = model(tokens).logits[:, :-1].astype(jnp.float32)
    return jax.nn.log_softmax(logits / temperature, axis=-1)


@pytest.mark.parametrize("view", [False, True])
def test_topk_teacher_in_the_step_equals_the_dense_distillation(view, k=3, micro=2):
    """``teacher.top_k`` with ``topk_kl``: the step's top-K teacher pass (the start weights,
    another model A's; with ``view`` on rows of its own with a context before each prompt,
    moved onto the policy's tokens) and the student's log-probs of the same ids, one
    micro-batch at a time, give the loss and the plain-SGD update of the dense computation:
    mean over action tokens of sum_k p_A(v_k) (log p_A(v_k) - log p_B(v_k)), v = A's top K at
    the rollouts' temperature; OPD at beta 0 adds no policy gradient."""
    from flax import nnx

    from jaxrl_agent.models.transformer import Transformer
    from jaxrl_agent.train.step import TEACHER_VIEW
    temp = 0.7
    teacher_model = _model()
    policy = Transformer(teacher_model.config, rngs=nnx.Rngs(1))
    recs = _records()
    batch, _ = pack_records(recs, layout="per_step", num_shards=micro)
    tb = batch
    if view:
        tb, _ = pack_records([dict(r, turns=[dict(t, observation=[7, 8, 9] + t["observation"])
                                             for t in r["turns"]]) for r in recs],
                             layout="per_step", num_shards=micro)
        batch = batch.replace(extras={**batch.extras, TEACHER_VIEW[0]: tb.tokens,
                                      TEACHER_VIEW[1]: tb.action_mask})
    lt_full = np.asarray(_dense_lsm(teacher_model, tb.tokens, temp))
    ids_t = np.argsort(-lt_full, axis=-1, kind="stable")[..., :k]
    lt_t = np.take_along_axis(lt_full, ids_t, -1)
    sm, tm = np.asarray(batch.action_mask), np.asarray(tb.action_mask)
    ids = np.zeros(sm.shape + (k,), np.int32)
    lt = np.zeros(sm.shape + (k,), np.float32)
    for i in range(sm.shape[0]):  # the teacher's k-th action position -> the policy's k-th
        src, dst = np.nonzero(tm[i])[0], np.nonzero(sm[i])[0]
        ids[i, dst] = ids_t[i, src - 1]
        lt[i, dst] = lt_t[i, src - 1]
    ids, lt = jnp.asarray(ids), jnp.asarray(lt)
    m = batch.action_mask

    def dense_loss(params):
        model = nnx.merge(nnx.graphdef(policy), params, nnx.state(policy, nnx.Not(nnx.Param)))
        lsm = jnp.concatenate([jnp.zeros_like(_dense_lsm(model, batch.tokens, temp)[:, :1]),
                               _dense_lsm(model, batch.tokens, temp)], axis=1)
        ls = jnp.take_along_axis(lsm, ids, -1)
        per = jnp.sum(jnp.exp(lt) * (lt - ls), -1)
        return jnp.sum(jnp.where(m, per, 0.0)) / jnp.sum(m)

    p0 = nnx.state(policy, nnx.Param)
    want, grad = jax.value_and_grad(dense_loss)(p0)
    opt = optax.sgd(0.1)
    scfg = StepConfig(estimator="opd", estimator_params=(("beta", 0.0),), teacher="base",
                      teacher_top_k=k, teacher_view=view, temperature=temp,
                      micro_batches=micro, aux_losses=(("topk_kl", 1.0, ()),),
                      extra_reads=("teacher_logprobs", "teacher_topk_logprobs"))
    assert scfg.needs_teacher and scfg.topk == k
    state = init_state(policy, opt, seed=0, with_reference=True)
    state = state.replace(ref_params=nnx.state(teacher_model, nnx.Param))
    new, out = make_train_step(policy, opt, scfg)(state, batch)
    got = jax.device_get(out["metrics"])
    assert float(want) > 1e-3 and float(optax.tree.norm(grad)) > 1e-3
    np.testing.assert_allclose(got["loss_aux_topk_kl"], float(want), rtol=1e-4)
    assert got["adv_abs"] == 0
    for x, p, g in zip(jax.tree.leaves(new.params), jax.tree.leaves(p0), jax.tree.leaves(grad)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(p) - 0.1 * np.asarray(g),
                                   rtol=1e-4, atol=1e-6)


def test_topk_teacher_config():
    """``teacher.top_k`` needs a teacher and a non-negative int; ``topk_kl`` without it names
    both keys; the start-up line says the top K is scored."""
    from jaxrl_agent.train.teacher import teacher_summary
    with pytest.raises(C.ConfigError, match="teacher.top_k: the top-K tokens are the teacher's"):
        run_checks.load(None, ["teacher.top_k=4"])
    with pytest.raises(C.ConfigError, match=r"teacher.top_k must be an integer >= 0"):
        run_checks.load(None, ["teacher.source=live", "teacher.top_k=-1"])
    with pytest.raises(C.ConfigError, match=r"loss.aux: topk_kl reads "
                                            r"extras\['teacher_topk_logprobs'\].*teacher.top_k: K"):
        run_checks.load(None, ["teacher.source=live", "loss.aux=[topk_kl]"])
    cfg = run_checks.load(None, ["teacher.source=live", "teacher.top_k=4", "loss.aux=[topk_kl]"])
    reads = run_checks.step_reads(cfg)
    assert reads == ("teacher_topk_logprobs",)
    assert "and its top 4 next tokens" in teacher_summary(cfg, reads)


def test_topk_teacher_bad_settings_are_named():
    """A top K larger than the vocabulary, the step's own input given as a hyper-parameter, a
    top K that no loss reads: each named before anything runs."""
    from jaxrl_agent.train.teacher import teacher_summary
    with pytest.raises(C.ConfigError, match=r"teacher.top_k 100000 is larger than the "
                                            r"vocabulary of the built-in model \(260 tokens\)"):
        run_checks.load(None, ["teacher.source=live", "teacher.top_k=100000",
                               "loss.aux=[topk_kl]"])
    with pytest.raises(C.ConfigError, match=r"unknown key 'loss.aux\[0\].params."
                                            r"student_topk_logprobs' for loss 'topk_kl'"):
        run_checks.load(None, ["teacher.source=live", "teacher.top_k=4", "loss.aux=[{name: "
                               "topk_kl, params: {student_topk_logprobs: 1}}]"])
    cfg = run_checks.load(None, ["teacher.source=live", "teacher.top_k=4",
                                 "estimator.name=opd"])
    assert "teacher.top_k 4 is set, but no loss of this run reads the top K" in \
        teacher_summary(cfg, run_checks.step_reads(cfg))
    # a field of no listed level stays "?" (the teacher's top-K level is not a fallback)
    assert dict(run_checks.method_reads("estimator", "credit"))["negative_logprobs"] == "?"
