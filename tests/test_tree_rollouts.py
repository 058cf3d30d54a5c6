"""Tree rollouts: ``RolloutConfig.branch_turns`` / ``branch_factor`` fork every live trajectory
at the start of the branch turns (``Env.fork``, ``SafeEnv.fork``); forks share the turns before
the branch token for token and continue with their own seeds. Also the config keys."""

from __future__ import annotations

import copy
import random
import time

import pytest

from jaxrl_agent import config as C
from jaxrl_agent import run_checks
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.envs import Calculator, Chain, GridWorld, GymnasiumTextAdapter, SafeEnv, Task
from jaxrl_agent.envs.chain import WORDS
from jaxrl_agent.rollout import ByteCodec, RolloutConfig, collect_groups
from jaxrl_agent.rollout.collect import _request_seed
from jaxrl_agent.sampling import SampleOutput

CODEC = ByteCodec()
EOS = CODEC.eos_token_id
SEED = 0


class SeededSampler:
    """Picks a chain word with ``random.Random(request seed)``: stochastic across requests,
    reproducible per request. Requests whose seed is in ``bad_seeds`` get the invalid "jump".
    ``calls`` holds ``(prompts, seeds)`` of every ``generate`` call."""

    def __init__(self, bad_seeds=()):
        self.bad_seeds = set(bad_seeds)
        self.calls = []

    def generate(self, prompts, params):
        seeds = [p.seed for p in params]
        self.calls.append(([list(p) for p in prompts], seeds))
        outs = []
        for prompt, seed in zip(prompts, seeds):
            word = "jump" if seed in self.bad_seeds else random.Random(seed).choice(WORDS[:4])
            ids = CODEC.encode(word) + [EOS]
            outs.append(SampleOutput(list(prompt), ids, [-0.5] * len(ids), "stop", 1))
        return outs


def chain_task(clues: str) -> Task:
    return Task("chain", f"{clues}|{'0' * len(clues)}", "train",
                {"clues": clues, "revealed": frozenset()})


TASKS = [chain_task("abcd"), chain_task("dcba")]


def collect(cfg, env=None, tasks=TASKS, sampler=None):
    sampler = sampler or SeededSampler()
    records, stats = collect_groups(env or Chain(length=4), tasks, sampler, CODEC, cfg, seed=SEED)
    return records, stats, sampler


def tree_cfg(**kw):
    base = dict(group_size=2, max_turns=6, max_new_tokens=8, branch_turns=(1, 2),
                branch_factor=2, history="full")
    return RolloutConfig(**{**base, **kw})


def prompts_of(sampler, n_records, branch_turns, factor):
    """``prompts[i][k]``: record ``i``'s prompt at turn ``k`` when nobody ends early. Calls are in
    depth-first tree order, so before the later branch turns one live trajectory stands for
    ``factor ** (branch turns still to come)`` consecutive records."""
    out = [[] for _ in range(n_records)]
    for k, (prompts, _) in enumerate(sampler.calls):
        stride = factor ** sum(b > k for b in branch_turns)
        assert len(prompts) * stride == n_records
        for i in range(n_records):
            out[i].append(prompts[i // stride])
    return out


def history_prompt(turns, k):
    return [t for turn in turns[:k] for t in turn["observation"] + turn["action"]] + \
        turns[k]["observation"]


# --- counts, order, shared prefixes ---------------------------------------------------------------


def test_tree_counts_labels_and_depth_first_order():
    records, stats, sampler = collect(tree_cfg())
    per_task = 2 * 2 ** 2
    assert len(records) == stats["trajectories"] == 2 * per_task
    assert stats["forks"] == 2 * (2 + 4) and stats["env_errors"] == 0
    for ti, task in enumerate(TASKS):
        block = records[ti * per_task:(ti + 1) * per_task]
        assert {r["group"] for r in block} == {r["task"] for r in block} == {task.id}
        assert all(r["num_turns"] == 4 for r in block)
    # depth-first: record 4g + 2a + b of a task = root g, copy a at turn 1, copy b at turn 2
    for ti in range(2):
        block = records[ti * per_task:(ti + 1) * per_task]
        for i, r in enumerate(block):
            g, a = i // 4, (i // 2) % 2
            assert r["turns"][:1] == block[4 * g]["turns"][:1]
            assert r["turns"][:2] == block[4 * g + 2 * a]["turns"][:2]
            for k in (1, 2):  # the branch turn itself starts from the same state
                parent = block[4 * g] if k == 1 else block[4 * g + 2 * a]
                assert r["turns"][k]["observation"] == parent["turns"][k]["observation"]
                assert r["turns"][k]["state_key"] == parent["turns"][k]["state_key"]
    # different seeds -> different continuations after the branch, and every request seed is new
    for prompts, seeds in sampler.calls:
        assert len(set(seeds)) == len(seeds)
    actions = [tuple(CODEC.decode(t["action"]) for t in r["turns"]) for r in records]
    assert len(set(actions)) > len(records) // 2
    pairs = [(records[i], records[i + 1]) for i in range(0, len(records), 2)]
    assert any(p["turns"][2]["action"] != f["turns"][2]["action"] for p, f in pairs)
    for layout in ("concatenated", "per_step"):
        pack_records(records, layout=layout)


def test_full_history_prompts_of_forks_extend_the_parents_prompt():
    records, _, sampler = collect(tree_cfg())
    prompts = prompts_of(sampler, len(records), (1, 2), 2)
    for i, r in enumerate(records):
        for k in range(r["num_turns"]):
            assert prompts[i][k] == history_prompt(r["turns"], k)
    for start in range(0, len(records), 8):
        for i in range(start, start + 8):
            g, a = (i - start) // 4, ((i - start) // 2) % 2
            for parent, k in ((start + 4 * g, 1), (start + 4 * g + 2 * a, 2)):
                assert prompts[i][:k + 1] == prompts[parent][:k + 1]
                for j in range(k + 1, 4):
                    assert prompts[i][j][:len(prompts[parent][k])] == prompts[parent][k]


def test_branch_at_turn_zero_shares_only_the_first_observation():
    records, stats, sampler = collect(tree_cfg(group_size=2, branch_turns=(0,), branch_factor=3))
    assert len(records) == 2 * 2 * 3 and stats["forks"] == 2 * 2 * 2
    for block in (records[:6], records[6:]):
        first = block[0]["turns"][0]
        for r in block:
            assert r["turns"][0]["observation"] == first["observation"]
            assert r["turns"][0]["state_key"] == first["state_key"]
        assert len({tuple(r["turns"][0]["action"]) for r in block}) > 1
    assert len(set(sampler.calls[0][1])) == 12


def test_ended_trajectories_are_not_forked():
    bad = {_request_seed(SEED, i, 0) for i in (0, 2, 3)}  # task 0 root 0, both roots of task 1
    cfg = tree_cfg(on_invalid="fail")
    records, stats, _ = collect(cfg, sampler=SeededSampler(bad))
    assert stats["forks"] == 1 + 2 and stats["trajectories"] == 1 + 4 + 2 == len(records)
    assert [r["task"] for r in records] == [TASKS[0].id] * 5 + [TASKS[1].id] * 2
    assert records[0]["num_turns"] == 1 and records[0]["invalid"] == 1
    assert all(r["num_turns"] == 4 for r in records[1:5])
    assert all(r["num_turns"] == 1 for r in records[5:])
    assert stats["invalid_actions"] == 3


def test_fork_turns_are_independent_copies():
    records, _, _ = collect(tree_cfg(branch_turns=(2,)))
    parent, fork = records[0], records[1]
    assert parent["turns"][:2] == fork["turns"][:2]
    for pt, ft in zip(parent["turns"][:2], fork["turns"][:2]):
        assert pt is not ft
        for key in ("observation", "action", "logprobs"):
            assert pt[key] is not ft[key]
    fork["turns"][0]["observation"].append(999)
    fork["turns"][1]["logprobs"][0] = 7.0
    assert parent["turns"][0]["observation"][-1] != 999 and parent["turns"][1]["logprobs"][0] != 7.0


@pytest.mark.parametrize("history", ["full", "last"])
def test_no_branching_is_exactly_the_plain_collection(history):
    plain = RolloutConfig(group_size=2, max_turns=6, max_new_tokens=8, history=history)
    want, want_stats, want_sampler = collect(plain)
    assert len({str([t["action"] for t in r["turns"]]) for r in want}) == len(want)
    for kw in ({"branch_factor": 1}, {"branch_turns": ()},
               {"branch_turns": (0, 3), "branch_factor": 1}):
        got, stats, sampler = collect(tree_cfg(history=history, **kw))
        assert got == want and sampler.calls == want_sampler.calls
        assert stats["forks"] == 0
        assert {k: v for k, v in stats.items() if "time" not in k and "per_s" not in k} == \
            {k: v for k, v in want_stats.items() if "time" not in k and "per_s" not in k}


# --- env forks -----------------------------------------------------------------------------------


def _play(env, n):
    for _ in range(n):
        if env.done:
            break
        env.step(env.solver())


@pytest.mark.parametrize("make", [lambda: GridWorld(), lambda: Chain(length=4),
                                  lambda: Calculator()], ids=["gridworld", "chain", "calculator"])
def test_built_in_env_forks_are_independent_mid_episode_copies(make):
    env = make()
    env.reset(env.sample_tasks(0, 1)[0])
    _play(env, 1)
    fork = env.fork()
    assert fork is not env and fork.task is env.task and type(fork) is type(env)
    before = (env.observation(), env.state_key(), env.turn, env.done)
    assert (fork.observation(), fork.state_key(), fork.turn, fork.done) == before
    action = env.solver()
    a, b = env.step(action), fork.step(action)
    assert (a.observation, a.reward, a.done, a.info) == (b.observation, b.reward, b.done, b.info)
    after = (env.observation(), env.state_key(), env.turn, env.done)
    twin = fork.fork()
    _play(twin, 20)
    assert twin.done
    assert (env.observation(), env.state_key(), env.turn, env.done) == after
    assert (fork.observation(), fork.state_key(), fork.turn, fork.done) == after


class NoFork:
    """A gymnasium-style env over strings: a counter, done at 3."""

    def reset(self, seed=None):
        self.n = 0
        return "n=0", {}

    def step(self, action):
        self.n += 1
        return f"n={self.n}", 0.0, self.n >= 3, False, {}


def test_safe_env_fork_keeps_settings_and_reports_failures():
    inner = Chain(length=4)
    safe = SafeEnv(inner, error_reward=-1.0, step_timeout=5.0, error_observation="oops")
    safe.reset(TASKS[0])
    safe.step("red")
    fork = safe.fork()
    assert fork.fork_error is None and fork.env is not inner
    assert (fork.error_reward, fork.step_timeout, fork.timeout_mode, fork.error_observation) == \
        (-1.0, 5.0, "check", "oops")
    assert fork.stats["steps"] == 0 and fork.step("blue").info["state_key"] == \
        safe.step("blue").info["state_key"]

    class Broken(Chain):
        def fork(self):
            raise OSError("no fork here")

    bad = SafeEnv(Broken(length=4), error_reward=-1.0)
    bad.reset(TASKS[0])
    failed = bad.fork()
    assert failed.fork_error == "OSError: no fork here"
    res = failed.step("red")
    assert res.done and res.reward == -1.0 and res.info["env_error"] == failed.fork_error
    assert not bad.step("red").info.get("env_error")  # the original goes on

    # the adapters are not Env subclasses: a deep copy forks a pure-Python gym env, but they
    # have no fork(), so SafeEnv reports it instead of guessing (HTTPEnv holds a server session)
    adapter = GymnasiumTextAdapter(NoFork)
    adapter.reset(Task("gym", "1", "train", {"seed": 1}))
    adapter.step("x")
    twin = copy.deepcopy(adapter)
    assert twin.step("x").observation == adapter.step("x").observation == "n=2"
    guarded = SafeEnv(GymnasiumTextAdapter(NoFork))
    guarded.reset(Task("gym", "1", "train", {"seed": 1}))
    assert "has no fork()" in guarded.fork().fork_error

    class Slow(Chain):
        def fork(self):
            time.sleep(0.05)
            return super().fork()

    for mode in ("check", "thread"):
        slow = SafeEnv(Slow(length=4), step_timeout=0.01, timeout_mode=mode)
        slow.reset(TASKS[0])
        assert slow.fork().fork_error.startswith("timeout") and not slow.broken
        assert not slow.step("red").info.get("env_error")

    done = SafeEnv(Chain(length=1))
    done.reset(chain_task("a"))
    done.step("red")
    assert "after the episode ended" in done.fork().fork_error


class BrokenFork(Chain):
    def fork(self):
        raise RuntimeError("fork refused")


@pytest.mark.parametrize("turn", [0, 1])
def test_a_failed_fork_is_an_env_error_of_that_fork_only(turn):
    records, stats, _ = collect(tree_cfg(branch_turns=(turn,)), env=BrokenFork(length=4))
    n_forks = 2 * len(TASKS)
    assert stats["forks"] == stats["env_errors"] == stats["fork_errors"] == n_forks
    # a failed fork is dropped at any turn: its shared turns are its parent's, and recording
    # them with a made-up ending would bias the group baseline
    assert all(not r["env_error"] for r in records) and stats["dropped"] == n_forks
    assert len(records) == n_forks and all(r["num_turns"] == 4 for r in records)
    assert stats["turns"] == 4 * n_forks
    pack_records(records, layout="per_step")


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    ({"branch_turns": (-1,)}, r"branch_turns must be distinct ints in \[0, max_turns = 6\)"),
    ({"branch_turns": (6,)}, "branch_turns must be distinct ints"),
    ({"branch_turns": (1, 1)}, "branch_turns must be distinct ints"),
    ({"branch_turns": (1.0,)}, "branch_turns must be distinct ints"),
    ({"branch_turns": (True,)}, "branch_turns must be distinct ints"),
    ({"branch_turns": 3}, "branch_turns must be a sequence of ints"),
    ({"branch_factor": 0}, "branch_factor must be an int >= 1"),
    ({"branch_factor": 2.0}, "branch_factor must be an int >= 1"),
    ({"branch_factor": True}, "branch_factor must be an int >= 1"),
])
def test_rollout_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        tree_cfg(**kw)


def test_rollout_config_stores_sorted_turns():
    assert tree_cfg(branch_turns=[3, 0]).branch_turns == (0, 3)


def test_config_keys():
    cfg = run_checks.load(None, ["rollout.branch_turns=[0, 2]", "rollout.branch_factor=2",
                        "trainer.prefix_sharing=true", "trainer.prefix_tree_len=256"])
    assert cfg.rollout.branch_turns == [0, 2] and cfg.trainer.prefix_tree_len == 256
    assert "branch x2 at turns [0, 2]" in C.describe(cfg) and "prefix sharing" in C.describe(cfg)
    r = cfg.rollout
    assert RolloutConfig(max_turns=r.max_turns, branch_turns=tuple(r.branch_turns),
                         branch_factor=r.branch_factor).branch_turns == (0, 2)
    assert C.RunConfig().rollout.branch_turns == [] and not C.RunConfig().trainer.prefix_sharing
    for bad, match in [("rollout.branch_turns=2", "'rollout.branch_turns' must be list"),
                       ("rollout.branch_factor=1.5", "'rollout.branch_factor' must be int"),
                       ("trainer.prefix_sharing=1", "'trainer.prefix_sharing' must be bool"),
                       ("trainer.prefix_tree_len=null", "'trainer.prefix_tree_len' must be int")]:
        with pytest.raises(C.ConfigError, match=match):
            run_checks.load(None, [bad])
