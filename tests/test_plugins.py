"""Plug-ins: docs/estimators.md "Add your own method", done exactly as it says, from a module
outside the package: register an estimator and an environment, list them, `credit` with them,
train, then `eval` and `--resume` in fresh processes that load the module from the run's
record."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_agent import cli, registry
from jaxrl_agent import config as config_lib
from jaxrl_agent import run_checks
from tests.runs import TINY

REPO = Path(__file__).resolve().parents[1]


def _doc_plugin() -> str:
    """The plug-in module of docs/estimators.md's "Add your own method" section."""
    doc = (REPO / "docs" / "estimators.md").read_text()
    section = doc[doc.index("## Add your own method"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def plugin(tmp_path, request):
    path = tmp_path / "my_credit.py"
    path.write_text(_doc_plugin())

    def forget():
        registry.unregister("centered_outcome", "estimator")
        registry.unregister("small_grid", "env")
        for name in [m for m in sys.modules if m.startswith("jaxrl_user_")]:
            del sys.modules[name]
    request.addfinalizer(forget)
    return path


def _cli(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _fresh_process(*argv, cwd):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "jaxrl_agent.cli", *map(str, argv)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


def test_a_method_and_an_environment_from_outside_the_package(plugin, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = _cli(["estimators", "--import", "./my_credit.py"], capsys)
    assert rc == 0 and "centered_outcome" in out, err
    spec = registry.lookup("centered_outcome", "estimator")
    assert spec.origin.startswith("jaxrl_user_") and spec.hyper_params == {"scale": 1.0}

    # offline credit with it: scale 2 doubles the group-centred outcome (dr_grpo)
    src = REPO / "examples" / "rollouts.jsonl"
    rc, _, err = _cli(["credit", src, "--import", "my_credit.py", "--estimator",
                       "centered_outcome", "--set", "scale=2", "--out", "mine.jsonl"], capsys)
    assert rc == 0, err
    rc, _, err = _cli(["credit", src, "--estimator", "dr_grpo", "--out", "dr.jsonl"], capsys)
    assert rc == 0, err
    mine = [json.loads(x) for x in Path("mine.jsonl").read_text().splitlines()]
    dr = [json.loads(x) for x in Path("dr.jsonl").read_text().splitlines()]
    flat = lambda rows: [x for r in rows for x in r["turn_credit"]]  # noqa: E731
    assert any(flat(dr)) and flat(mine) == pytest.approx([2 * x for x in flat(dr)], abs=2e-4)
    # its own check runs at config time, with the key named
    rc, _, err = _cli(["credit", src, "--estimator", "centered_outcome", "--set", "scale=-1",
                       "--out", "bad.jsonl"], capsys)
    assert rc == 2 and "scale must be > 0" in err

    # train 2 steps on the plug-in's env with its estimator; the run records the plug-in
    run = tmp_path / "runs" / "mine"
    sets = TINY + [f"run.dir={run}", "trainer.steps=2", "estimator.name=centered_outcome",
                   "env.name=small_grid"]
    rc, _, err = _cli(["train", "--quiet", "--import", "./my_credit.py"]
                      + [a for s in sets for a in ("--set", s)], capsys)
    assert rc == 0, err
    saved = config_lib.read_yaml(run / "config.yaml")
    assert saved["imports"] == [str(plugin)] and saved["env"]["name"] == "small_grid"

    # eval and --resume in fresh processes, elsewhere, without --import
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = _fresh_process("eval", run, "--tasks", "2", cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    assert "success" in json.loads(res.stdout.strip().splitlines()[-1])
    res = _fresh_process("train", "--resume", run, "--quiet", "--set", "trainer.steps=3",
                         cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    assert any(json.loads(x).get("step") == 3
               for x in (run / "metrics" / "metrics.jsonl").read_text().splitlines())

    # the plug-in moved away: eval says which import is missing, no traceback
    plugin.rename(tmp_path / "moved.py")
    res = _fresh_process("eval", run, "--tasks", "2", cwd=elsewhere)
    assert res.returncode == 2 and "imports[0]" in res.stderr and "my_credit.py" in \
        res.stderr and "Traceback" not in res.stderr, res.stderr


def test_import_errors_are_messages(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = _cli(["estimators", "--import", "no_such_module_xyz"], capsys)
    assert rc == 2 and "no module 'no_such_module_xyz'" in err
    rc, _, err = _cli(["estimators", "--import", "./absent.py"], capsys)
    assert rc == 2 and "no such file" in err
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    rc, _, err = _cli(["estimators", "--import", "broken.py"], capsys)
    assert rc == 2 and "RuntimeError: boom" in err
    (tmp_path / "clash.py").write_text(
        "from jaxrl_agent import register\n@register('grpo')\ndef grpo(batch):\n    pass\n")
    rc, _, err = _cli(["estimators", "--import", "clash.py"], capsys)
    assert rc == 2 and "'grpo' is already registered" in err


def test_a_config_imports_relative_to_its_file(plugin, tmp_path):
    cfg_file = tmp_path / "conf" / "run.yaml"
    cfg_file.parent.mkdir()
    cfg_file.write_text("imports: [../my_credit.py]\nestimator: {name: centered_outcome}\n"
                        "env: {name: small_grid}\n")
    cfg = run_checks.load(cfg_file, TINY)
    assert cfg.imports == [str(plugin)] and cfg.estimator.name == "centered_outcome"


def test_reads_are_checked_against_what_the_loop_supplies(tmp_path, request):
    from jaxrl_agent import Advantages, register

    @register("needs_judge_test", reads=("judge",))
    def needs_judge_test(batch, *, axis_name=None):
        return Advantages(token=batch.old_logprobs * 0)

    @register("needs_critic_test", reads=("turn_values",))
    def needs_critic_test(batch, *, axis_name=None):
        return Advantages(token=batch.old_logprobs * 0)

    request.addfinalizer(lambda: [registry.unregister(n, "estimator")
                                  for n in ("needs_judge_test", "needs_critic_test")])
    with pytest.raises(config_lib.ConfigError, match=r"extras\['judge'\].*credit"):
        run_checks.load(None, TINY + ["estimator.name=needs_judge_test"])
    with pytest.raises(config_lib.ConfigError, match="model.value_head: true"):
        run_checks.load(None, TINY + ["estimator.name=needs_critic_test"])
    run_checks.load(None, TINY + ["estimator.name=needs_critic_test", "model.value_head=true"])


def test_the_loop_supplies_every_declared_loop_input():
    """Each loop input has a known source, a level and a provider (env inputs also a host-side
    one), and the train step runs the provider: a batch without the field gets it at its
    level's shape."""
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_agent.rollout.records import pack_records
    from jaxrl_agent.train import inputs
    from tests.signals import signal_records
    batch = pack_records(signal_records(0, num_groups=2, group_size=2), layout="concatenated")[0]
    n, k = batch.turn_mask.shape
    tok = jnp.ones(batch.tokens.shape, jnp.float32)
    outputs = {"values": tok, "hidden": jnp.ones((n, k, 3), jnp.float32),
               "teacher_logprobs": -tok, "ref_logprobs": -2 * tok, "entropy": 3 * tok,
               "teacher_topk_logprobs": -jnp.ones(batch.tokens.shape + (4,), jnp.float32)}
    shapes = {"token": batch.tokens.shape, "turn": (n, k), "vector": (n, k, 3),
              "token[top_k]": batch.tokens.shape + (4,)}
    out = inputs.provide(batch, tuple(inputs.LOOP_INPUTS), outputs)
    for name, spec in inputs.LOOP_INPUTS.items():
        assert spec.source in inputs.SOURCES, name
        assert (spec.source in inputs.STEP_SOURCES) == (spec.step is not None and
                                                        spec.from_turns is None), name
        assert out.extras[name].shape == shapes[spec.level], name
    # model outputs replace what the records carried, detached
    m = np.asarray(batch.action_mask)
    assert np.all(np.asarray(out.extras["teacher_logprobs"])[m] == -1.0)
    assert np.all(np.asarray(out.extras["entropy"])[m] == 3.0)


#: registry keys that already say what the method does (no descriptive alias needed)
DESCRIPTIVE_KEYS = {"lambda_returns", "reward_to_go", "rollout_level", "step_group", "tree_value",
                    "reallocate", "self_credit", "shuffled_control", "step_gain"}


def test_every_acronym_has_a_descriptive_alias(capsys):
    """Each credit method of the package answers to a descriptive name beside its key (its
    function's name, or an explicit alias); the alias resolves to the same entry in a config
    and is listed by `jaxrl-agent estimators`."""
    from jaxrl_agent import cli, registry, run_checks
    import jaxrl_agent.estimators  # noqa: F401
    entries = [e for kind in ("estimator", "shaping", "transform") for e in registry.entries(kind)
               if e.origin.startswith("jaxrl_agent.")]
    missing = [e.name for e in entries if not e.aliases and e.name not in DESCRIPTIVE_KEYS]
    assert not missing, f"registry keys without a descriptive alias: {missing}"
    for e in entries:
        for alias in e.aliases:
            assert registry.find(alias, e.kind) is e
    assert registry.find("group_normalized_outcome", "estimator").name == "grpo"
    cfg = run_checks.load(None, ["estimator.name=anchor_state_groups"])
    assert registry.find(cfg.estimator.name, "estimator").name == "gigpo"
    assert cli.main(["estimators"]) == 0
    assert "(also: group_normalized_outcome)" in capsys.readouterr().out


def test_a_plugin_function_named_like_a_method_gets_no_alias():
    """The automatic alias (the function's name) is skipped when another entry holds it, so a
    plugin never collides with the package through its function's name."""
    from jaxrl_agent import registry
    import jaxrl_agent.estimators  # noqa: F401

    def gae(batch, *, axis_name=None):  # the name of a package key
        raise NotImplementedError

    registry.register("plugin_gae_copy", gae)
    try:
        assert registry.find("plugin_gae_copy", "estimator").aliases == ()
        assert registry.find("gae", "estimator").name == "gae"
    finally:
        registry.unregister("plugin_gae_copy", "estimator")
