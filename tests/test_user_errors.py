"""What a new user trips over (issue 34), done as the user does it: the CLI in a subprocess on
the tiny built-in model with a task file and a reward function of their own."""

import importlib.machinery
import os
import subprocess
import sys

import pytest

from tests.processes import child_env
from tests.runs import TINY

TASKS = "\n".join(f'{{"id": "t{i}", "prompt": "What is {i} + 1?", "answer": "{i + 1}", '
                  f'"split": "{"test" if i == 5 else "train"}"}}' for i in range(6))


def _train(tmp_path, *sets, timeout=600):
    env = child_env(None)
    cmd = [sys.executable, "-m", "jaxrl_agent.cli", "train", *sum((["--set", s] for s in
                                                                   [*TINY, *sets]), [])]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _train_with_reward(tmp_path, body: str, *sets):
    """A run on TASKS with the reward ``def score(task, messages):`` + ``body`` in
    ``my_reward.py`` (conversations in one row each), into ``tmp_path / "run"``."""
    (tmp_path / "tasks.jsonl").write_text(TASKS + "\n")
    (tmp_path / "my_reward.py").write_text("def score(task, messages):\n" + body)
    return _train(tmp_path, "env.name=tasks",
                  "env.kwargs={path: tasks.jsonl, reward: 'my_reward.py:score'}",
                  "rollout.history=full", "trainer.layout=concatenated", *sets, "run.dir=run")


def test_a_task_file_without_test_tasks_is_one_line(tmp_path):
    (tmp_path / "tasks.jsonl").write_text(TASKS.replace('"split": "test"', '"split": "train"'))
    p = _train(tmp_path, "env.name=tasks", "run.dir=run",
               "env.kwargs={path: tasks.jsonl, reward: 'jaxrl_agent.envs.tasks:answer_reward'}")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "tasks.jsonl: no 'test' tasks" in p.stderr


def test_a_reward_that_raises_is_shown_once_and_stops_the_run(tmp_path):
    """A typo'd key in the reward function: the KeyError and the user's line are printed (once)
    and saved in the run directory; every trajectory failing for trainer.max_failed_steps
    steps stops the run with a message that names the exception, not the group size."""
    p = _train_with_reward(tmp_path, "    return float(messages[-1]['content'] == "
                                     "task['answr'])\n", "trainer.steps=6",
                           "trainer.max_failed_steps=2")
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert "KeyError" in out and "my_reward.py" in out and "task['answr']" in out
    assert out.count("an environment raised") == 1  # once, not per trajectory
    # the first rollouts are step 0's evaluation: it stops there, labelled as evaluation
    assert "evaluation at step 0: an environment raised RewardError" in out
    assert "evaluation at step 0: every held-out episode ended in an environment error" in out
    assert "trainer.max_failed_steps" in out and "group_size" not in out.split("error:")[-1]
    log = (tmp_path / "run" / "env_errors.log").read_text()
    assert "KeyError" in log and "answr" in log


def test_reward_errors_on_held_out_tasks_are_counted_as_the_evaluations(tmp_path):
    """A reward that raises only on the held-out task: shown once as the evaluation's, counted
    in eval/env_errors (train/env_errors stays 0), and said to count as failures."""
    p = _train_with_reward(tmp_path, "    if task['id'] == 't5':\n"
                                     "        raise KeyError('held-out only')\n"
                                     "    return 0.0\n", "trainer.steps=2",
                           "trainer.max_failed_steps=0")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "evaluation at step 0: an environment raised RewardError" in out
    assert out.count("an environment raised") == 1
    assert "evaluation at step 0: 4 of 4 held-out episodes ended in an environment error " \
           "(eval/env_errors); eval/success counts them as failures" in out
    import json
    rows = [json.loads(x) for x in
            (tmp_path / "run" / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/env_errors"] for r in rows if "eval/env_errors" in r] == [4, 4]
    assert "8 held-out episodes ended in an environment error" in out.split("done:")[-1]
    assert all(r["train/env_errors"] == 0 for r in rows if "train/env_errors" in r)


def test_an_mcp_server_that_does_not_exist_is_one_line_naming_it(tmp_path):
    """Every trajectory fails at reset: the run stops at once naming the server command and
    the OS error, with no traceback and no policy-lag message (issue 45)."""
    p = _train(tmp_path, "env.name=mcp:/nonexistent/server-binary", "trainer.eval_every=0",
               "run.dir=run")
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxrl-agent train: error: step 1: every trajectory failed before "
                           "its first turn: MCPServerError"), last
    assert "/nonexistent/server-binary" in last and "No such file or directory" in last
    assert "Traceback" not in out and "max_policy_lag" not in out


def test_switching_env_estimator_or_loss_starts_their_settings_empty():
    from jaxrl_agent import run_checks
    load = lambda *s: run_checks.load(None, list(s), validate=False)  # noqa: E731
    assert load().env.kwargs["action_names"] == "letters"  # the grid world's default
    cfg = load("env.name=tasks", "env.kwargs.path=examples/tasks.jsonl",
               "env.kwargs.reward=jaxrl_agent.envs.tasks:answer_reward")
    assert cfg.env.kwargs == {"path": "examples/tasks.jsonl",
                              "reward": "jaxrl_agent.envs.tasks:answer_reward"}
    assert load("env.kwargs.extra_walls=1", "env.name=gridworld").env.kwargs["extra_walls"] == 1
    assert load("estimator.params.gamma=0.9", "estimator.name=gae").estimator.params == {
        "gamma": 0.9}  # set before the switch: kept
    assert load("estimator.name=grpo").estimator.params == {}
    # a YAML env section without kwargs does not inherit the grid world's either
    assert run_checks.from_dict({"env": {"name": "chain"}}).env.kwargs == {}


def test_an_estimator_hyper_parameter_one_level_too_high_gets_a_did_you_mean(tmp_path):
    p = _train(tmp_path, "estimator.gamma=0.9")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "did you mean estimator.params.gamma?" in p.stderr


def test_the_tpu_attention_kernel_off_a_tpu_is_one_line(tmp_path):
    """trainer.attention: splash on this CPU (and with prefix trees) names the key to change."""
    p = _train(tmp_path, "trainer.attention=splash")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "splash is a TPU kernel" in p.stderr and "trainer.attention: blocked" in p.stderr
    p = _train(tmp_path, "trainer.attention=splash", "trainer.prefix_sharing=true")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "prefix_sharing" in p.stderr


def test_a_failed_start_does_not_block_the_corrected_command(tmp_path):
    """A wrong reward path fails the start after config.yaml was written; the corrected
    command runs (the run had no checkpoint, nothing to keep), and so does --resume of a run
    with no checkpoint given a changed value."""
    (tmp_path / "tasks.jsonl").write_text(TASKS + "\n")
    bad = _train(tmp_path, "env.name=tasks", "run.dir=run", "trainer.steps=1",
                 "env.kwargs={path: tasks.jsonl, reward: 'nowhere.py:score'}")
    assert bad.returncode == 2 and "nowhere" in bad.stderr
    os.makedirs(tmp_path / "run", exist_ok=True)  # (as if the config had been written)
    (tmp_path / "run" / "config.yaml").write_text("name: old\n")
    good = _train(tmp_path, "env.name=tasks", "run.dir=run", "trainer.steps=1",
                  "trainer.max_failed_steps=0",
                  "env.kwargs={path: tasks.jsonl, reward: 'jaxrl_agent.envs.tasks:answer_reward'}")
    assert good.returncode == 0, good.stderr[-2000:]
    out = good.stdout + good.stderr
    assert "stopped before its first checkpoint" in out
    # the split is said at start-up, and the evaluation's error counts distinct tasks
    assert "tasks: 5 train, 1 held-out" in out and "each about 4 times" in out
    assert "standard error, 1 distinct held-out tasks, 4 episodes" in out
    # one evaluation of the start weights: the summary quotes the printed one, with the same
    # count (issue 45)
    import re
    printed = re.search(r"held-out success at step 0: ([0-9.]+) \+- ", out).group(1)
    assert f"held-out success: {printed} at start" in out, out[-1500:]
    assert "before warm-up" not in out
    assert re.search(r"at start.*1 distinct held-out tasks, 4 episodes\)", out)
    assert (tmp_path / "run" / "checkpoints").is_dir()
    # the learning rate and the share of replies cut at max_new_tokens are logged
    import json
    rows = [json.loads(x) for x in
            (tmp_path / "run" / "metrics" / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if r.get("step") == 1][-1]
    assert step["train/lr"] > 0 and 0 <= step["train/response_truncated_frac"] <= 1
    # what the model said: samples of the step as text, and `jaxrl-agent show`
    sample = json.loads((tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text()
                        .splitlines()[0])
    assert sample["step"] == 1 and "What is" in sample["turns"][0]["observation"]
    shown = subprocess.run([sys.executable, "-m", "jaxrl_agent.cli", "show", "run"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert shown.returncode == 0, shown.stderr
    assert "== step 1  task tasks:t" in shown.stdout and "reply:" in shown.stdout
    assert "What is" in shown.stdout and "credit" in shown.stdout
    none = subprocess.run([sys.executable, "-m", "jaxrl_agent.cli", "show", "run", "--step", "9"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert none.returncode == 2 and "no samples of step 9" in none.stderr
    # a run with a checkpoint is still refused
    again = _train(tmp_path, "env.name=tasks", "run.dir=run", "trainer.steps=1",
                   "env.kwargs={path: tasks.jsonl, reward: 'jaxrl_agent.envs.tasks:answer_reward'}")
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_a_task_env_gets_chat_sized_replies_unless_the_config_sets_them():
    """The run default (8 new tokens) is the grid world's one-letter action: a task file,
    MCP or chat config that does not set rollout.max_new_tokens gets 256."""
    from jaxrl_agent import config as config_lib
    from jaxrl_agent import run_checks
    tasks = ["env.name=tasks",
             "env.kwargs={path: examples/tasks.jsonl, reward: 'jaxrl_agent.envs.tasks:answer_reward'}"]
    assert run_checks.load(None, tasks).rollout.max_new_tokens == config_lib.CHAT_MAX_NEW_TOKENS
    assert run_checks.load(None, [*tasks, "rollout.max_new_tokens=12"]).rollout.max_new_tokens == 12
    assert run_checks.load(None, []).rollout.max_new_tokens == 8  # the grid world keeps 8
    # and GRPO rather than the grid world's GiGPO, unless the estimator is named
    assert run_checks.load(None, tasks).estimator.name == "grpo"
    assert run_checks.load(None, [*tasks, "estimator.name=rloo"]).estimator.name == "rloo"
    assert run_checks.load(None, [*tasks, "estimator={name: gigpo}"]).estimator.name == "gigpo"
    assert run_checks.load(None, []).estimator.name == "gigpo"


def test_weights_and_biases_logging_is_optional_and_resumable(tmp_path, monkeypatch):
    """metrics.wandb: true without the package is a config error naming the extra; with it,
    every metrics row goes to wandb.log at its step, a resumed run reuses the W&B run id, and
    the run is finished on close (a stand-in wandb module: no network)."""
    import sys
    import types

    from jaxrl_agent import config as config_lib
    from jaxrl_agent import run_checks
    from jaxrl_agent.train.metrics import MetricsLogger

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(config_lib.ConfigError, match=r"jaxrl-agent\[wandb\]"):
        run_checks.load(None, ["metrics.wandb=true"])
    calls = []

    class Run:
        def log(self, row, step):
            calls.append(("log", step, dict(row)))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert run_checks.load(None, ["metrics.wandb=true"]).metrics.wandb
    for resume in (None, 1):
        with MetricsLogger(tmp_path / "m", total_steps=2, tensorboard=False, progress=False,
                           wandb={"project": "p", "name": "n"}, resume_from_step=resume) as lg:
            lg.log(1 if resume is None else 2, {"train/reward": 0.5, "note": "x"})
    inits = [c[1] for c in calls if c[0] == "init"]
    assert inits[0]["id"] == inits[1]["id"] and inits[0]["resume"] == "allow"
    assert inits[0]["project"] == "p" and inits[0]["name"] == "n"
    logs = [c for c in calls if c[0] == "log"]
    assert [c[1] for c in logs] == [1, 2] and logs[0][2] == {"train/reward": 0.5}
    assert calls.count(("finish",)) == 2


def test_config_files_expand_environment_variables(tmp_path, monkeypatch):
    """${NAME:-default} in a config file: the variable when set, else the default; an unset
    variable without a default names the key and the variable. The tiny configs take their
    checkpoint path from JAXRL_TINY_CHECKPOINT this way."""
    from jaxrl_agent import config as config_lib
    path = tmp_path / "c.yaml"
    path.write_text("name: ${RUN_NAME:-fallback}\nmodel:\n  hf_path: ${MY_CKPT}\n")
    monkeypatch.delenv("RUN_NAME", raising=False)
    monkeypatch.delenv("MY_CKPT", raising=False)
    with pytest.raises(config_lib.ConfigError, match=r"model\.hf_path: environment variable "
                                                    r"MY_CKPT is not set"):
        config_lib.read_yaml(path)
    monkeypatch.setenv("MY_CKPT", "/somewhere/ckpt")
    raw = config_lib.read_yaml(path)
    assert raw["name"] == "fallback" and raw["model"]["hf_path"] == "/somewhere/ckpt"
    monkeypatch.setenv("JAXRL_TINY_CHECKPOINT", str(tmp_path / "tiny"))
    raw = config_lib.read_yaml(os.path.join(os.path.dirname(__file__), "..", "configs",
                                            "tiny_chat_tasks.yaml"))
    assert raw["model"]["hf_path"] == str(tmp_path / "tiny")
