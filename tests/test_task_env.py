"""Task datasets with a plug-in reward function (``tasks``), reasoning-gym tasks, and the name
forms of ``make_env`` / ``env.name`` (``gymnasium:``, ``http:``, ``mcp:``, ``reasoning_gym:``)."""

from __future__ import annotations

import collections
import json
import sys
import types
from pathlib import Path

import pytest

from jaxrl_agent import config as C
from jaxrl_agent import run_checks
from jaxrl_agent import registry
from jaxrl_agent.envs import (GymnasiumTextAdapter, HTTPEnv, RewardError, SafeEnv, TaskEnv,
                              TaskFileError, load_reward, make_env, resolve_env, run_episode,
                              solver_policy)
from jaxrl_agent.envs.tasks import answer_reward, load_tasks, make_tasks
from jaxrl_agent.rollout import ByteCodec, RolloutConfig, collect_groups
from jaxrl_agent.rollout.chat import ChatError
from jaxrl_agent.sampling import SampleOutput

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = dict(path="examples/tasks.jsonl", reward="examples/task_reward.py:score")


@pytest.fixture
def at_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def example_env(**kw) -> TaskEnv:
    return make_env("tasks", **{**EXAMPLE, **kw})


def task_of(env, key):
    (task,) = [t for t in env.tasks if t.key == key]
    return task


def write(tmp_path, name, text) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def jsonl(*rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


# --- the shipped example -----------------------------------------------------------------------


def test_example_file_single_turn(at_repo):
    env = example_env()
    assert isinstance(env, TaskEnv) and env.max_turns == 1
    assert {t.split for t in env.tasks} == {"train", "test"}
    assert all(t.family == "tasks" and t.id == f"tasks:{t.key}" for t in env.tasks)
    # the solver (the "answer" field) solves every task, single- and multi-turn
    for task in env.tasks:
        ep = run_episode(env, solver_policy(env), task)
        assert ep.success and ep.rewards == [1.0], task.key

    task = task_of(env, "add-1")
    obs, info = env.reset(task)
    assert obs == "What is 7 + 5? Reply with the number only."
    assert info["observation_role"] == "user" and info["turn"] == 0
    assert env.system_prompt is None and env.context_messages == []
    res = env.step("The answer is 12.")
    assert (res.reward, res.done, res.info["success"]) == (1.0, True, True)
    env.reset(task)
    res = env.step("13")
    assert (res.reward, res.done, res.info["success"]) == (0.0, True, False)
    env.reset(task)
    res = env.step("   ")  # the reward function's info reaches the step's info
    assert res.reward == pytest.approx(-0.1) and res.info["invalid_action"] and res.done

    # a system message and a few-shot history from "messages" / "system"
    obs, _ = env.reset(task_of(env, "opposite-1"))
    assert obs == "The opposite of hot?" and env.system_prompt == "Answer with one word."
    assert env.context_messages == [{"role": "user", "content": "The opposite of up?"},
                                    {"role": "assistant", "content": "down"}]
    env.reset(task_of(env, "capital-1"))
    assert env.system_prompt == "Answer with one word."


def test_example_file_multi_turn(at_repo):
    env = example_env()
    task = task_of(env, "square-1")
    obs, info0 = env.reset(task)
    assert env.max_turns == 2
    res = env.step("I think 18")
    assert not res.done and res.reward == 0.0
    assert res.observation.startswith("Not quite. Hint: 9 squared is 9 * 9.")
    assert res.info["observation_role"] == "user" and res.info["turn"] == 1
    assert res.info["state_key"] != info0["state_key"]
    assert env.messages[-2:] == [{"role": "assistant", "content": "I think 18"},
                                 {"role": "user", "content": res.observation}]
    res = env.step("81")
    assert (res.reward, res.done, res.info["success"]) == (1.0, True, True)
    # wrong twice: the reward function ends it at the task's max_turns
    env.reset(task)
    env.step("18")
    res = env.step("19")
    assert (res.reward, res.done, res.info["success"]) == (0.0, True, False)
    with pytest.raises(RuntimeError, match="done"):
        env.step("81")


def test_group_copies_share_the_start_and_fork_is_independent(at_repo):
    env = example_env()
    task = task_of(env, "square-1")
    a, b = env.clone(), env.clone()
    ka, kb = a.reset(task)[1]["state_key"], b.reset(task)[1]["state_key"]
    assert ka == kb
    assert a.step("10").info["state_key"] != b.step("11").info["state_key"]
    assert a._splits is env._splits and a._reward_fn is env._reward_fn  # parsed once
    f = a.fork()
    assert f.step("81").done and not a.done and a.messages != f.messages
    assert a.step("80").info["success"] is False


def test_collector_runs_the_task_env(at_repo):
    codec = ByteCodec()
    eos = codec.eos_token_id

    class Answer:  # answers from the prompt text: right for "7 + 5", wrong first for squares
        def generate(self, prompts, params):
            outs = []
            for p in prompts:
                text = codec.decode(p)
                reply = "12" if "7 + 5" in text else ("81" if "Hint" in text else "80")
                ids = codec.encode(reply) + [eos]
                outs.append(SampleOutput(list(p), ids, [-0.5] * len(ids), "stop", 0))
            return outs

    env = example_env()
    tasks = [task_of(env, "add-1"), task_of(env, "square-1")]
    cfg = RolloutConfig(group_size=2, max_turns=4, max_new_tokens=8, max_context_tokens=512)
    records, stats = collect_groups(env, tasks, Answer(), codec, cfg, seed=0)
    assert [r["num_turns"] for r in records] == [1, 1, 2, 2]
    assert [r["outcome"] for r in records] == [1.0] * 4 and stats["success_rate"] == 1.0
    assert stats["env_errors"] == 0
    # raw-text prompts have no place for a task's system message: refused, never dropped
    with pytest.raises(ChatError, match=r"task \S*opposite-1: .*system message.*rollout.chat: true"):
        collect_groups(env, [task_of(env, "opposite-1")], Answer(), codec, cfg, seed=0)


# --- the reward contract ------------------------------------------------------------------------


REWARDS = '''
import math

def boom(task, messages):
    return 1 / 0

def forever(task, messages):
    return {"reward": 0.5, "observation": "again"}

def typo(task, messages):
    return {"rewards": 1.0}

def no_obs(task, messages):
    return {"reward": 1.0, "done": False}

def nan(task, messages):
    return math.nan

def text(task, messages):
    return "yes"

def flag(task, messages):
    return {"reward": True, "success": True, "done": True, "observation": "bye",
            "info": {"judge": task["judge"]}}

def seen(task, messages):
    task["mutated"] = True
    messages.append({"role": "user", "content": "injected"})
    return 0.0

def three(task, messages, extra):
    return 0.0

not_callable = 3
'''


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "rewards.py", REWARDS)
    write(tmp_path, "t.jsonl", jsonl({"id": 1, "prompt": "hi", "judge": "strict"},
                                     {"id": 2, "prompt": "ho", "split": "test"}))
    return lambda fn, **kw: make_env("tasks", path="t.jsonl", reward=f"rewards.py:{fn}", **kw)


def test_reward_that_raises_fails_the_trajectory_with_the_function_named(rewards):
    env = rewards("boom")
    task = env.sample_tasks(0, 1)[0]
    env.reset(task)
    with pytest.raises(RewardError, match=r"reward function rewards.py:boom raised "
                                          r"ZeroDivisionError: division by zero \(task tasks:1"):
        env.step("x")
    safe = SafeEnv(env.clone())
    ep = run_episode(safe, lambda _: "x", task)
    assert not ep.success and len(ep.actions) == 1
    err = ep.infos[-1]["env_error"]
    assert err.startswith("RewardError: reward function rewards.py:boom raised "
                          "ZeroDivisionError"), err


@pytest.mark.parametrize("fn, match", [
    ("typo", r"rewards.py:typo \(task tasks:1, turn 1\) returned a dict with unknown key "
             r"'rewards'; allowed: reward, observation"),
    ("no_obs", r"done=False without an 'observation'"),
    ("nan", r"its result is not finite"),
    ("text", r"must be a number or a dict with 'reward', got 'yes'"),
])
def test_results_outside_the_contract_are_named(rewards, fn, match):
    env = rewards(fn)
    env.reset(env.sample_tasks(0, 1)[0])
    with pytest.raises(RewardError, match=match):
        env.step("x")


def test_dict_results_turn_limits_and_isolation(rewards):
    env = rewards("flag")
    env.reset(env.sample_tasks(0, 1)[0])
    res = env.step("x")  # done wins over an observation; bool rewards; info passes through
    assert (res.reward, res.done, res.observation) == (1.0, True, "bye")
    assert res.info["success"] is True and res.info["judge"] == "strict"

    env = rewards("forever", max_turns=3)  # the env's turn limit truncates
    env.reset(env.sample_tasks(0, 1)[0])
    steps = [env.step(str(k)) for k in range(3)]
    assert [s.done for s in steps] == [False, False, True]
    assert steps[-1].info["truncated"] and steps[-1].info["success"] is False
    assert [m["role"] for m in env.messages] == ["user", "assistant", "user", "assistant",
                                                 "user", "assistant"]

    env = rewards("seen", max_turns=2)  # the function gets copies
    task = env.sample_tasks(0, 1)[0]
    env.reset(task)
    env.step("x")
    assert "mutated" not in task.data and env.messages[-1]["role"] == "assistant"

    env = rewards("forever")  # no solver without an "answer"
    env.reset(task)
    with pytest.raises(NotImplementedError, match=r'task tasks:1 has no "answer"'):
        env.solver()
    with pytest.raises(NotImplementedError, match="sft_noise"):
        env.random_action(None)


@pytest.mark.parametrize("spec, match", [
    ("rewards.py", r"must look like 'module:function'"),
    ("rewards.py:1x", r"'1x' is not a function name"),
    ("missing.py:score", r"reward 'missing.py:score': file 'missing.py': no such file"),
    ("rewards.py:nope", r"has no 'nope' \(its functions: boom, flag, forever"),
    ("rewards.py:not_callable", r"not_callable is a int, not a function"),
    ("rewards.py:three", r"must take two arguments \(task, messages\); its signature is "
                         r"three\(task, messages, extra\)"),
    ("no_such_mod_xyz:score", r"no module 'no_such_mod_xyz' \(not installed, not on PYTHONPATH, "
                              r"and no no_such_mod_xyz.py in the working directory\)"),
    ("broken:score", r"reward 'broken:score': .*failed: NameError"),
])
def test_reward_spec_errors(rewards, tmp_path, spec, match):
    write(tmp_path, "broken.py", "undefined_name\n")
    with pytest.raises(ValueError, match=match):
        load_reward(spec)


def test_reward_module_and_base_dir_lookup(tmp_path, monkeypatch):
    other = tmp_path / "cfg"
    other.mkdir()
    write(other, "judge_mod.py", "def score(task, messages):\n    return 0.25\n")
    write(other, "tasks.jsonl", jsonl({"prompt": "q", "split": "train"}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        make_env("tasks", path="tasks.jsonl", reward="judge_mod:score")
    # relative files are looked up in the working directory, then in base_dir
    env = make_env("tasks", path="tasks.jsonl", reward="judge_mod:score", base_dir=str(other))
    env.reset(env.sample_tasks(0, 1)[0])
    assert env.step("a").reward == 0.25
    # "module:function" finds module.py in the working directory (not on sys.path)
    monkeypatch.chdir(other)
    assert load_reward("judge_mod:score")({}, []) == 0.25
    # a module that is importable: dotted function names too
    assert load_reward("json:JSONDecoder.decode") is json.JSONDecoder.decode


# --- task files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text, match", [
    ('{"prompt": "a"}\n{"prompt": "b",}\n', r"t.jsonl:2: not valid JSON"),
    ('\n["prompt"]\n', r"t.jsonl:2: each line must be a JSON object \(a task\), got list"),
    ('{"id": 1, "answer": "x"}\n', r't.jsonl:1: a task needs exactly one of "prompt" \(a '
                                   r'string\) or "messages".*; it has neither'),
    ('{"prompt": "a", "messages": []}\n', r"t.jsonl:1: .*it has both"),
    ('{"prompt": ""}\n', r't.jsonl:1: "prompt" must be a non-empty string'),
    ('{"prompt": "a", "split": "dev"}\n', r't.jsonl:1: "split" must be "train" or "test", got '
                                          r"'dev'"),
    ('{"prompt": "a", "max_turns": 0}\n', r't.jsonl:1: "max_turns" must be an integer >= 1'),
    ('{"prompt": "a", "id": [1]}\n', r't.jsonl:1: "id" must be a string or an integer'),
    ('{"id": "q", "prompt": "a"}\n\n{"id": "q", "prompt": "b"}\n',
     r"t.jsonl:3: id 'q' repeats line 1"),
    ('{"prompt": "a"}\n{"prompt": "a"}\n', r"t.jsonl:2: the same task repeats line 1"),
    ('{"messages": [{"role": "bot", "content": "hi"}]}\n',
     r"t.jsonl:1: messages\[0\]: role must be one of system, user, assistant, tool; got 'bot'"),
    ('{"messages": [{"role": "user"}]}\n', r't.jsonl:1: messages\[0\] must be \{"role"'),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}, '
     '{"role": "user", "content": "b"}]}\n',
     r"t.jsonl:1: messages\[1\]: a system message may only come first"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
     r"t.jsonl:1: the last message must be the user's .*it is 'assistant'"),
    ('{"messages": [{"role": "user", "content": "a"}], "system": "s"}\n',
     r't.jsonl:1: "system" goes with "prompt"'),
    ('\n  \n', r"t.jsonl: no tasks"),
])
def test_task_file_errors_name_the_line(tmp_path, monkeypatch, text, match):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "r.py", "def score(task, messages):\n    return 0.0\n")
    write(tmp_path, "t.jsonl", text)
    with pytest.raises(TaskFileError, match=match):
        make_env("tasks", path="t.jsonl", reward="r.py:score")


def test_task_file_missing_and_binary(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "r.py", "def score(task, messages):\n    return 0.0\n")
    with pytest.raises(ValueError, match=r"tasks file 'nope.jsonl': no such file \(looked for "):
        make_env("tasks", path="nope.jsonl", reward="r.py:score")
    (tmp_path / "b.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(TaskFileError, match=r"b.jsonl: not UTF-8 text"):
        make_env("tasks", path="b.jsonl", reward="r.py:score")


def test_splits_sampling_and_answers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "r.py", "def score(task, messages):\n"
                            "    return {'reward': 1.0, 'observation': 'next'}\n")
    rows = [{"id": f"t{i}", "prompt": f"q{i}"} for i in range(40)]
    rows[0].update(answer=["a", 2], max_turns=3)
    rows[1].update(solution="s", split="test")
    write(tmp_path, "t.jsonl", jsonl(*rows))
    env = make_env("tasks", path="t.jsonl", reward="r.py:score")
    by_split = collections.Counter(t.split for t in env.tasks)
    assert by_split["test"] >= 2 and by_split["train"] >= 20  # the hash split, plus "split"
    assert task_of(env, "t1").split == "test"
    train = [t for t in env.tasks if t.split == "train"]
    # n <= pool: distinct and deterministic; n > pool: every task, as evenly as possible
    a = env.sample_tasks(7, 10, "train")
    assert len({t.key for t in a}) == 10 and a == env.sample_tasks(7, 10, "train")
    many = collections.Counter(t.key for t in env.sample_tasks(1, 3 * len(train) + 1, "train"))
    assert set(many) == {t.key for t in train} and set(many.values()) <= {3, 4}
    # answers: a list gives each turn's; a number becomes text; "solution" works too
    env.reset(task_of(env, "t0"))
    assert env.max_turns == 3 and env.solver() == "a"
    env.step(env.solver())
    assert env.solver() == "2"
    env.step("2")
    with pytest.raises(NotImplementedError, match="lists 2 turn"):
        env.solver()
    env.reset(task_of(env, "t1"))
    assert env.max_turns == 1 and env.solver() == "s"
    # a split without tasks: named when sampled
    write(tmp_path, "only.jsonl", jsonl({"prompt": "a", "split": "train"}))
    env = make_env("tasks", path="only.jsonl", reward="r.py:score")
    with pytest.raises(ValueError, match=r"only.jsonl: no 'test' tasks"):
        env.sample_tasks(0, 4, "test")
    with pytest.raises(ValueError, match="needs a Task of family 'tasks'"):
        env.reset(make_env("gridworld").sample_tasks(0, 1)[0])


def test_answer_reward_and_reward_functions_as_values(tmp_path, monkeypatch):
    def said(text):
        return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]

    assert answer_reward({"answer": 12}, said("The answer is 12.")) == 1.0
    assert answer_reward({"answer": 1234}, said("1,234 in all")) == 1.0
    assert answer_reward({"answer": 2.5}, said("2.50")) == 1.0
    assert answer_reward({"answer": 12}, said("<think>12?</think> 13")) == 0.0
    assert answer_reward({"answer": "Paris"}, said("  paris. ")) == 1.0
    assert answer_reward({"answer": "Paris"}, said("It is Paris")) == 0.0
    with pytest.raises(ValueError, match='no "answer"'):
        answer_reward({}, said("x"))
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "t.jsonl", jsonl({"id": 1, "prompt": "7+5?", "answer": 12, "split": "train"}))
    env = make_env("tasks", path="t.jsonl", reward="jaxrl_agent.envs.tasks:answer_reward")
    env.reset(env.sample_tasks(0, 1)[0])
    assert env.step("<think>7+5</think>12").info["success"]
    # a function itself is a reward too (checked the same way), named by its name in errors
    def judge(task, messages):
        raise KeyError("answer")

    env = make_env("tasks", path="t.jsonl", reward=judge)
    env.reset(env.sample_tasks(0, 1)[0])
    with pytest.raises(RewardError, match=r"reward function test_answer_reward_and_reward_"
                                          r"functions_as_values.<locals>.judge raised KeyError"):
        env.step("12")
    with pytest.raises(ValueError, match=r"must take two arguments \(task, messages\)"):
        load_reward(lambda answer: 0.0)


def test_task_rows_and_extra_checks(tmp_path):
    def check(row, where):
        if not isinstance(row.get("tool", ""), str):
            raise TaskFileError(f"{where}: \"tool\" must be a string")

    rows = [("t[0]", "t[0]", {"id": "a", "prompt": "x", "tool": "calc"}),
            ("t[1]", "t[1]", {"prompt": "y"})]
    tasks = make_tasks(rows, "fam", check)
    assert [(t.family, t.key) for t in tasks][0] == ("fam", "a")
    assert tasks[0].data == {"id": "a", "prompt": "x", "tool": "calc"}
    with pytest.raises(TaskFileError, match=r'^t\[1\]: "tool" must be a string'):
        make_tasks(rows[:1] + [("t[1]", "t[1]", {"prompt": "y", "tool": 3})], "fam", check)
    with pytest.raises(TaskFileError, match=r"^t\[1\]: id 'a' repeats t\[0\]"):
        make_tasks(rows[:1] + [("t[1]", "t[1]", {"id": "a", "prompt": "z"})], "fam", check)
    with pytest.raises(TaskFileError, match=r"^t\[0\]: a task must be a JSON object"):
        make_tasks([("t[0]", "t[0]", "prompt")])
    path = write(tmp_path, "f.jsonl", jsonl({"prompt": "x"}, {"prompt": "y", "tool": [1]}))
    with pytest.raises(TaskFileError, match=r'f.jsonl:2: "tool" must be a string'):
        load_tasks(path, check=check)
    assert [t.data["prompt"] for t in load_tasks(path)] == ["x", "y"]


# --- reasoning-gym ------------------------------------------------------------------------------


def test_reasoning_gym_tasks():
    pytest.importorskip("reasoning_gym")
    env = make_env("reasoning_gym:basic_arithmetic", size=200)
    assert env.family == "reasoning_gym:basic_arithmetic"
    tasks = env.sample_tasks(0, 5, "test")
    assert len({t.key for t in tasks}) == 5 and all(t.split == "test" for t in tasks)
    for task in tasks:
        ep = run_episode(env, solver_policy(env), task)
        assert ep.success and ep.rewards == [1.0]
    obs, _ = env.reset(tasks[0])
    assert obs == tasks[0].data["question"] and "<answer>" in env.system_prompt
    res = env.step("<answer>not a number</answer>")
    assert res.done and res.reward < 1.0 and not res.info["success"]
    env.reset(tasks[0])
    res = env.step(str(tasks[0].data["answer"]))  # no tags: invalid
    assert res.reward == 0.0 and res.info["invalid_action"]
    plain = make_env("reasoning_gym", dataset="chain_sum", config={"min_terms": 2,
                                                                   "max_terms": 2},
                     answer_tag=None, system_prompt=None)
    task = plain.sample_tasks(0, 1)[0]
    plain.reset(task)
    assert plain.system_prompt is None and plain.step(f" {task.data['answer']} ").reward == 1.0
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset 'nope'; known: ab, acre"):
        make_env("reasoning_gym:nope")
    with pytest.raises(ValueError, match="chain_sum.*TypeError.*bogus"):
        make_env("reasoning_gym:chain_sum", config={"bogus": 1})


# --- name forms of make_env and env.name ---------------------------------------------------------


class FakeTextEnv:
    """A gymnasium-style text env: say the seed back to win."""

    def __init__(self, bonus=1.0):
        self.bonus, self.seed = bonus, None

    def reset(self, seed=None):
        self.seed = seed
        return f"say {seed}", {}

    def step(self, action):
        won = action == str(self.seed)
        return "done" if won else "again", self.bonus * won, won, False, {}


@pytest.fixture
def fake_gymnasium(monkeypatch):
    made = []

    def make(env_id, **kwargs):
        if env_id != "Echo-v0":
            raise KeyError(f"Environment {env_id} doesn't exist")
        made.append(kwargs)
        return FakeTextEnv(**kwargs)

    mod = types.ModuleType("gymnasium")
    mod.make = make
    monkeypatch.setitem(sys.modules, "gymnasium", mod)
    return made


def test_gymnasium_name_form(fake_gymnasium):
    env = make_env("gymnasium:Echo-v0", max_turns=4, bonus=2.0)
    assert isinstance(env, GymnasiumTextAdapter) and env.max_turns == 4
    task = env.sample_tasks(0, 1)[0]
    assert task.family == "gymnasium:Echo-v0"
    obs, _ = env.reset(task)
    res = env.step(obs.split()[1])
    assert res.done and res.reward == 2.0 and res.info["success"]
    assert isinstance(env.clone(), GymnasiumTextAdapter) and fake_gymnasium == [{"bonus": 2.0}] * 2
    with pytest.raises(ValueError, match=r"gymnasium.make\('Nope-v0'\) failed: KeyError"):
        make_env("gymnasium:Nope-v0")
    cfg = run_checks.load(None, ["env.name=gymnasium:Echo-v0", "env.kwargs={max_turns: 3}"])
    assert cfg.env.name == "gymnasium:Echo-v0"


def test_gymnasium_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # import gymnasium -> ImportError
    with pytest.raises(ImportError, match=r"'gymnasium:Echo-v0' needs gymnasium .*pip install "
                                          r"gymnasium \(or pip install 'jaxrl-agent\[gymnasium\]'"):
        make_env("gymnasium:Echo-v0")
    with pytest.raises(C.ConfigError, match=r"env.name: environment 'gymnasium:Echo-v0' needs "
                                            r"gymnasium.*pip install gymnasium"):
        run_checks.load(None, ["env.name=gymnasium:Echo-v0", "env.kwargs={}"])


def test_http_and_mcp_name_forms():
    for name, url in [("http:http://127.0.0.1:9/", "http://127.0.0.1:9"),
                      ("http://127.0.0.1:9", "http://127.0.0.1:9"),
                      ("https://example.test/env", "https://example.test/env"),
                      ("http:127.0.0.1:9", "http://127.0.0.1:9")]:
        env = make_env(name, timeout=0.5)
        assert isinstance(env, HTTPEnv) and env.base_url == url and env.timeout == 0.5
    with pytest.raises(ValueError, match=r"the name already sets 'base_url'"):
        make_env("http:127.0.0.1:9", base_url="http://x")
    cmd = "python -m my_server --port 0"
    if registry.find("mcp", "env") is None:
        with pytest.raises(ValueError, match=r"'mcp:python -m my_server --port 0' needs the "
                                             r"environment registered as 'mcp'"):
            resolve_env(f"mcp:{cmd}")
        with pytest.raises(C.ConfigError, match=r"env.name: .*registered as 'mcp'"):
            run_checks.load(None, [f"env.name=mcp:{cmd}", "env.kwargs={}"])

        class FakeMCP:
            def __init__(self, command, max_turns=8):
                self.command = command

        registry.register("mcp", FakeMCP, kind="env")
        try:
            assert make_env(f"mcp:{cmd}").command == cmd
            assert resolve_env(f"mcp: {cmd}") == (FakeMCP, {"command": cmd})
        finally:
            registry.unregister("mcp", "env")
    else:  # the real MCP environment is registered: resolve only (no server started)
        factory, fixed = resolve_env(f"mcp:{cmd}")
        assert fixed == {"command": cmd} and factory is registry.find("mcp", "env").fn


def test_unknown_names_and_kwargs():
    for bad, match in [("nethack", r"unknown environment 'nethack'; known: .*gridworld.*tasks; "
                                   r"or one of the forms gymnasium:<id>, http:<base_url>, "
                                   r"mcp:<server command>, reasoning_gym:<dataset>.*--import"),
                       ("gym:CartPole-v1", r"unknown environment 'gym:CartPole-v1'"),
                       ("gymnasium:", r"nothing after 'gymnasium:'"),
                       ("", r"non-empty string")]:
        with pytest.raises(ValueError, match=match):
            make_env(bad)
    with pytest.raises(ValueError, match=r"environment 'tasks': missing a required argument: "
                                         r"'reward'"):
        make_env("tasks", path="x.jsonl")
    with pytest.raises(ValueError, match=r"environment 'gridworld': got an unexpected keyword "
                                         r"argument 'sise'"):
        make_env("gridworld", sise=5)


def test_config_accepts_the_name_forms(at_repo):
    cfg = run_checks.load(None, ["env.name=tasks", "env.kwargs={path: examples/tasks.jsonl, reward: "
                        "'examples/task_reward.py:score'}"])
    assert cfg.env.kwargs["path"] == "examples/tasks.jsonl"
    cfg = run_checks.load(None, ["env.name=http://127.0.0.1:9", "env.kwargs={timeout: 2.0}"])
    assert cfg.env.name == "http://127.0.0.1:9"
    for sets, match in [
        (["env.name=tasks", "env.kwargs={path: t.jsonl}"],
         r"env.kwargs.reward is required for environment 'tasks'"),
        (["env.name=tasks", "env.kwargs={path: t.jsonl, reward: 'r:s', sise: 1}"],
         r"unknown key 'env.kwargs.sise' for environment 'tasks'; valid keys: path, reward, "
         r"max_turns, base_dir"),
        (["env.name=http:127.0.0.1:9", "env.kwargs={base_url: 'http://x'}"],
         r"env.kwargs.base_url: the env name 'http:127.0.0.1:9' already sets it"),
        (["env.name=maze"], r"env.name: unknown environment 'maze'; known: calculator, chain, "
                            r"gridworld"),
    ]:
        with pytest.raises(C.ConfigError, match=match):
            run_checks.load(None, sets)
