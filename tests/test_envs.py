"""Tests of jaxrl_agent.envs: protocol, built-in envs, fault handling, adapters."""

import collections
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jaxrl_agent.envs import (Chain, GymnasiumTextAdapter, HTTPEnv, ParseError, SafeEnv,
                              StepResult, Task, evaluate, make_env, names, reset_group,
                              run_episode, solver_policy)

ENV_NAMES = ["gridworld", "calculator", "chain"]


# --- solvers, splits, groups ----------------------------------------------------------------


@pytest.mark.parametrize("name", ENV_NAMES)
@pytest.mark.parametrize("split", ["train", "test"])
def test_solver_solves_every_task(name, split):
    env = make_env(name)
    for task in env.sample_tasks(0, 40, split):
        assert task.split == split
        ep = run_episode(env, solver_policy(env), task)
        assert ep.success, (task, ep.actions, ep.final_observation)
        assert len(ep.actions) <= env.max_turns
        assert ep.infos[-1]["success"] is True
        assert ep.rewards[-1] >= 1.0  # the terminal outcome (chain adds revealed step rewards)
        assert all(not i["invalid_action"] for i in ep.infos)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_train_test_disjoint_and_deterministic(name):
    env = make_env(name)
    train = env.sample_tasks(1, 60, "train")
    test = env.sample_tasks(1, 30, "test")
    assert not {t.key for t in train} & {t.key for t in test}
    if name == "chain":  # the split is on the clue sequence
        assert not ({t.data["clues"] for t in train} & {t.data["clues"] for t in test})
    assert [t.key for t in env.sample_tasks(1, 60, "train")] == [t.key for t in train]
    assert len({t.key for t in train}) == 60
    with pytest.raises(ValueError):
        env.sample_tasks(1, 3, "valid")


@pytest.mark.parametrize("name", ENV_NAMES)
def test_group_reset_identical(name):
    env = make_env(name)
    task = env.sample_tasks(2, 1)[0]
    group = reset_group(env, task, 4)
    assert len({obs for _, obs, _ in group}) == 1
    assert len({info["state_key"] for _, _, info in group}) == 1
    assert len({id(e) for e, _, _ in group}) == 4
    # the copies are independent: stepping one leaves the others at the start
    e0 = group[0][0]
    e0.step(e0.solver())
    assert group[1][0].observation() == group[1][1]
    # identical action sequences give identical trajectories
    rs = [[e.step(a).observation for a in ("up", "left", "red", "calc 1+1")
           if not e.done] for e, _, _ in group[1:]]
    assert rs[0] == rs[1] == rs[2]


def test_random_policy_mostly_fails_gridworld():
    env = make_env("gridworld")
    rng = random.Random(0)
    acts = ["up", "down", "left", "right", "pick", "open"]
    eps = [run_episode(env, lambda o: rng.choice(acts), t) for t in env.sample_tasks(3, 150)]
    rate = sum(e.success for e in eps) / len(eps)
    assert rate < 0.2
    assert all(e.total_reward == (1.0 if e.success else 0.0) for e in eps)  # sparse terminal


def test_gridworld_state_keys_recur():
    env = make_env("gridworld")
    task = env.sample_tasks(4, 1)[0]
    rng = random.Random(1)
    acts = ["up", "down", "left", "right", "pick", "open"]
    where = collections.defaultdict(set)
    for traj in range(8):
        ep = run_episode(env, lambda o: rng.choice(acts), task)
        for turn, key in enumerate(ep.state_keys):
            where[key].add((traj, turn))
    across = [k for k, v in where.items() if len({t for t, _ in v}) > 1]
    within = [k for k, v in where.items()
              if any(sum(1 for t2, _ in v if t2 == t) > 1 for t, _ in v)]
    assert across and within
    # equal state keys come with equal observations (the key is the true state)
    ep = run_episode(env, lambda o: rng.choice(acts), task)
    seen = {}
    for o, k in zip(ep.observations, ep.state_keys):
        assert seen.setdefault(k, o) == o


def test_gridworld_grammar_and_mechanics():
    env = make_env("gridworld")
    task = env.sample_tasks(5, 1)[0]
    obs, _ = env.reset(task)
    lines = obs.split("\n")
    assert len(lines) == 6 and lines[-1] == "key: no"
    assert all(len(line) == 5 and set(line) <= set("#.AKDG") for line in lines[:5])
    for variant in ["  UP ", "Up", "u"]:
        env.reset(task)
        assert not env.step(variant).info["invalid_action"]
    # the door cannot be passed without the key: a BFS plan must contain pick and open in order
    env.reset(task)
    plan = []
    while not env.done:
        a = env.solver()
        plan.append(a)
        env.step(a)
    assert plan.index("pick") < plan.index("open")


# --- invalid actions and faults ---------------------------------------------------------------


@pytest.mark.parametrize("name", ENV_NAMES)
def test_invalid_action_penalised(name):
    env = make_env(name)
    task = env.sample_tasks(6, 1)[0]
    obs, info = env.reset(task)
    for bad in ["jump!!", "", None, 42, b"\xff\xfe"]:
        res = env.step(bad)
        assert res.info["invalid_action"] is True
        assert res.reward == pytest.approx(-0.1)
        assert res.observation == obs and res.info["state_key"] == info["state_key"]
        if res.done:
            break
    env2 = make_env(name, invalid_penalty=-1.0, invalid_ends=True)
    env2.reset(task)
    res = env2.step("???")
    assert res.done and res.reward == -1.0 and res.info["success"] is False


def test_max_turns_truncates():
    task = make_env("gridworld").sample_tasks(0, 1)[0]
    env = make_env("gridworld", max_turns=3)
    with pytest.raises(ValueError, match="max_turns"):
        env.sample_tasks(0, 1)
    env.reset(task)
    results = [env.step("pick") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["truncated"] and results[-1].info["success"] is False
    with pytest.raises(RuntimeError):
        env.step("up")


class _Faulty:
    family = "faulty"
    max_turns = 5

    def __init__(self, mode):
        self.mode = mode

    def clone(self):
        return _Faulty(self.mode)

    def reset(self, task):
        if self.mode == "reset":
            raise OSError("cannot start")
        return "start", {"state_key": "s0"}

    def step(self, action):
        if self.mode == "raise":
            raise ValueError("boom")
        if self.mode == "slow":
            time.sleep(0.2)
        return StepResult("ok", 1.0, False, {"state_key": "s1"})


def test_safe_env_exception_and_reset_failure():
    task = Task("faulty", "t", "train")
    env = SafeEnv(_Faulty("raise"), error_reward=-0.5)
    env.reset(task)
    res = env.step("x")
    assert res.done and res.reward == -0.5 and "boom" in res.info["env_error"]
    assert res.info["success"] is False and env.stats["errors"] == 1
    assert env.step("x").done  # stepping a dead episode stays terminal, no exception
    env = SafeEnv(_Faulty("reset"))
    ep = run_episode(env, lambda o: "x", task)
    assert not ep.success and "cannot start" in ep.infos[-1]["env_error"]


@pytest.mark.parametrize("mode", ["check", "thread"])
def test_safe_env_timeout(mode):
    task = Task("faulty", "t", "train")
    env = SafeEnv(_Faulty("slow"), step_timeout=0.05, timeout_mode=mode)
    env.reset(task)
    t0 = time.monotonic()
    res = env.step("x")
    assert res.done and res.info["env_error"].startswith("timeout")
    assert env.stats["timeouts"] == 1
    if mode == "thread":
        assert time.monotonic() - t0 < 0.15 and env.broken
    ok = SafeEnv(_Faulty("ok"), step_timeout=5.0, timeout_mode=mode)
    ok.reset(task)
    assert ok.step("x").reward == 1.0


def test_safe_env_wraps_builtin_and_counts_invalid():
    env = SafeEnv(make_env("calculator"))
    task = env.sample_tasks(0, 1)[0]
    group = reset_group(env, task, 2)
    assert isinstance(group[1][0], SafeEnv)
    env.step("hello")
    assert env.stats["invalid"] == 1
    ep = run_episode(env, solver_policy(env), task)
    assert ep.success


# --- env specifics ----------------------------------------------------------------------------


@pytest.mark.parametrize("length,density", [(4, 0.0), (4, 0.5), (5, 0.3), (6, 1.0), (8, 0.25)])
def test_chain_density(length, density):
    env = Chain(length=length, density=density)
    k = round(density * length)
    rng = random.Random(0)
    for task in env.sample_tasks(7, 20):
        assert len(task.data["revealed"]) == k
        env.reset(task)
        total_revealed, infos, rewards = 0, [], []
        while not env.done:
            # right or wrong at random
            act = env.solver() if rng.random() < 0.6 else rng.choice(["red", "green", "blue", "gold"])
            res = env.step(act)
            infos.append(res.info)
            rewards.append(res.reward)
        assert len(infos) == length  # the chain always runs C steps
        success = all(i["step_correct"] for i in infos)
        assert infos[-1]["success"] == success
        for i, r in zip(infos, rewards):
            step_r = r - (1.0 if (i is infos[-1] and success) else 0.0)
            expect = 1.0 / length if (i["revealed"] and i["step_correct"]) else 0.0
            assert step_r == pytest.approx(expect)
            total_revealed += i["revealed"]
        assert total_revealed == k


def test_chain_state_key_tracks_prefix():
    env = Chain(length=3)
    task = env.sample_tasks(0, 1)[0]
    env.reset(task)
    wrong = next(w for w in ("red", "green", "blue", "gold") if w != env.solver())
    k_wrong = env.step(wrong).info["state_key"]
    env.reset(task)
    k_right = env.step(env.solver()).info["state_key"]
    assert k_wrong != k_right and k_right.endswith("|1|1") and k_wrong.endswith("|1|0")


def test_calculator_parser():
    assert evaluate("2+3*4") == 14
    assert evaluate("(2+3)*4") == 20
    assert evaluate("10-4-3") == 3
    assert evaluate(" 2 * -3 + 1 ") == -5
    assert evaluate("((7))") == 7
    for bad in ["", "2+", "2**3", "__import__('os')", "1/2", "(1+2", "1 2", "a+1", "9" * 70,
                "99999*99999*99999"]:
        with pytest.raises(ParseError):
            evaluate(bad)


def test_calculator_episode_and_tool_errors():
    env = make_env("calculator")
    task = env.sample_tasks(0, 1)[0]
    obs, info = env.reset(task)
    assert obs == f"compute {task.key}"
    res = env.step("calc 2+")
    assert res.observation.endswith("error: bad expression") and not res.done
    assert not res.info["invalid_action"] and res.info["state_key"] == info["state_key"]
    res = env.step("CALC   " + task.data["plan"][0])
    assert res.info["tool_value"] == evaluate(task.data["plan"][0])
    assert res.info["state_key"] != info["state_key"]
    res = env.step(f"answer {task.data['value'] + 1}")
    assert res.done and res.reward == 0.0 and res.info["success"] is False
    env.reset(task)
    res = env.step(f"Answer: {task.data['value']}")
    assert res.done and res.reward == 1.0
    # the solver needs at least two tool calls
    ep = run_episode(env, solver_policy(env), task)
    assert sum(a.startswith("calc") for a in ep.actions) >= 2


# --- adapters and registry --------------------------------------------------------------------


class _TextGym:
    """A gymnasium-style env over strings: say 'go' three times."""

    def reset(self, seed=None):
        self.n, self.seed = 0, seed
        return f"count 0 seed {seed}", {}

    def step(self, action):
        self.n += action.strip() == "go"
        done = self.n >= 3
        return f"count {self.n} seed {self.seed}", float(done), done, False, {}


def test_gymnasium_adapter():
    env = GymnasiumTextAdapter(_TextGym, max_turns=10, solver=lambda obs: "go")
    task = env.sample_tasks(0, 1, "test")[0]
    group = reset_group(env, task, 3)
    assert len({obs for _, obs, _ in group}) == 1
    ep = run_episode(env, solver_policy(env), task)
    assert ep.success and ep.total_reward == 1.0 and len(ep.actions) == 3
    assert ep.state_keys[0].startswith("count 0")
    ep = run_episode(GymnasiumTextAdapter(_TextGym(), max_turns=4), lambda o: "stay", task)
    assert not ep.success and ep.infos[-1]["truncated"]


class _Handler(BaseHTTPRequestHandler):
    sessions: dict = {}

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/reset":
            sid = str(len(self.sessions))
            self.sessions[sid] = 0
            out = {"session": sid, "observation": f"at 0 of {body['task']['seed'] % 3 + 2}",
                   "info": {}}
            self.sessions[sid + "goal"] = body["task"]["seed"] % 3 + 2
        elif self.path == "/step":
            sid = body["session"]
            self.sessions[sid] += body["action"] == "next"
            done = self.sessions[sid] >= self.sessions[sid + "goal"]
            out = {"observation": f"at {self.sessions[sid]}", "reward": float(done),
                   "done": done, "info": {"success": done} if done else {}}
        else:
            self.send_response(404)
            self.end_headers()
            return
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_http_env_local_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    th = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    th.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        env = HTTPEnv(base, timeout=5.0, max_turns=8, solver=lambda obs: "next")
        task = env.sample_tasks(0, 1)[0]
        ep = run_episode(env, solver_policy(env), task)
        assert ep.success and ep.total_reward == 1.0
        assert len(ep.actions) == task.data["seed"] % 3 + 2
        # a dead endpoint becomes a failed trajectory under SafeEnv
        bad = SafeEnv(HTTPEnv(base + "/nope", timeout=2.0))
        ep = run_episode(bad, lambda o: "next", task)
        assert not ep.success and "env_error" in ep.infos[-1]
    finally:
        server.shutdown()
        server.server_close()
        th.join(timeout=5)
    assert not th.is_alive()


def test_registry():
    assert set(ENV_NAMES) <= set(names())
    with pytest.raises(ValueError, match="gridworld"):
        make_env("nethack")
    assert make_env("gridworld", size=6).size == 6
    with pytest.raises(ValueError):
        make_env("gridworld").reset(make_env("chain").sample_tasks(0, 1)[0])


def test_gridworld_letter_actions_solve_and_parse():
    from jaxrl_agent.envs.base import run_episode, solver_policy
    env = make_env("gridworld", action_names="letters")
    for task in env.sample_tasks(3, 5, "train"):
        ep = run_episode(env, solver_policy(env), task)
        assert ep.success and set(ep.actions) <= set("udlrpo")
    with pytest.raises(ValueError, match="action_names"):
        make_env("gridworld", action_names="emoji")


def test_gridworld_two_doors_open_in_order_and_lengthen_the_horizon():
    """doors=2: three rooms; the solver opens door 1 then door 2 with the one key; a door cannot be
    passed (or the second opened) before its turn; plans are longer than with one door."""
    from jaxrl_agent.envs.base import run_episode, solver_policy
    from jaxrl_agent.envs.gridworld import GridWorld, transition
    env = GridWorld(size=7, doors=2, extra_walls=0, max_turns=24)
    for task in env.sample_tasks(0, 20, "train"):
        lay = task.data
        assert len(lay["doors"]) == 2 and task.key.count("D") == 2
        ep = run_episode(env, solver_policy(env), task)
        assert ep.success and ep.actions.count("open") == 2
        stages = []
        env.reset(task)
        while not env.done:
            stages.append(env.subgoal())
            env.step(env.solver())
        assert [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s] == \
            ["key", "door1", "door2", "goal"]
        # standing next to the second door with the key but the first still shut: open fails
        d2 = lay["doors"][1]
        for dr, dc in ((0, 1), (0, -1), (1, 0), (-1, 0)):
            p = (d2[0] + dr, d2[1] + dc)
            d1 = lay["doors"][0]
            if abs(p[0] - d1[0]) + abs(p[1] - d1[1]) == 1:
                continue  # beside both doors: opens the first
            assert transition(7, lay, (p, True, 0), "open")[2] == 0
            assert transition(7, lay, (p, True, 1), "open")[2] == 2
    one = GridWorld(size=7, extra_walls=0, max_turns=24).horizon_stats(200)
    two = env.horizon_stats(200)
    assert two["mean"] > one["mean"] + 2 and two["max"] <= 22
    with pytest.raises(ValueError, match="doors"):
        GridWorld(doors=3)
    with pytest.raises(ValueError, match="size >= 6"):
        GridWorld(size=5, doors=2)


def test_gridworld_one_door_state_keys_unchanged():
    """The default env's state keys and observations keep their form (d0/d1, one D)."""
    env = make_env("gridworld", max_turns=12, action_names="letters", extra_walls=0)
    task = env.sample_tasks(0, 1)[0]
    env.reset(task)
    keys = []
    while not env.done:
        keys.append(env.state_key())
        env.step(env.solver())
    assert keys[0].endswith("|k0|d0") and keys[-1].endswith("|k1|d1")
    assert env.observation().count("/") == 1
