"""Tests of the Sokoban environment (jaxrl_agent.envs.sokoban): the rules on hand-made rooms, the
generator (deterministic, solvable, within bounds, held-out rooms), the solver against a forward
BFS and a brute-force search, the potential, state keys, subgoals, action names and the
registry."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_agent import run_checks
from jaxrl_agent.envs import (GridWorld, SafeEnv, Sokoban, Task, make_env, reset_group,
                              run_episode, solver_policy, split_of)
from jaxrl_agent.envs.sokoban import (ACTIONS, bfs_plan, distance, distance_table, parse_level,
                                      plan, render, room_text, solved, start_state, transition)


def level_task(text: str) -> Task:
    room = parse_level(text)
    key = render(room, start_state(room)).replace("\n", "/")
    return Task("sokoban", key, split_of(room_text(room)), room)


def play(text: str, actions, **kwargs):
    """Resets a Sokoban env to the hand-made level and plays ``actions``; the env and results."""
    env = Sokoban(**kwargs)
    env.reset(level_task(text))
    return env, [env.step(a) for a in actions]


CORRIDOR = """
#######
#P_X_O#
#######
"""


# --- rules ----------------------------------------------------------------------------------


def test_push_walk_and_solve_in_a_corridor():
    env, res = play(CORRIDOR, ["right", "right", "right"])
    rows = [r.observation.split("\n")[1] for r in res]
    assert rows == ["#_PX_O#", "#__PXO#", "#___P*#"]
    assert [r.reward for r in res] == [0.0, 0.0, 1.0]
    assert res[-1].done and res[-1].info["success"] is True
    assert all(not r.info["invalid_action"] for r in res)


def test_walls_block_and_leave_the_state():
    env, res = play(CORRIDOR, ["left", "up", "down"])
    for r in res:
        assert r.observation == render(env.room, start_state(env.room))
        assert r.reward == 0.0 and not r.done and not r.info["invalid_action"]
    assert len({r.info["state_key"] for r in res}) == 1


def test_push_into_wall_or_box_is_no_move_and_boxes_are_never_pulled():
    against_wall = "######\n#_PX##\n#O___#\n######"
    env, res = play(against_wall, ["right"])
    assert res[0].observation == render(env.room, start_state(env.room))
    two_boxes = "########\n#PXX_OO#\n########"
    env, res = play(two_boxes, ["right"])
    assert env.state == start_state(env.room)
    # one box pushed alone (the far side free) moves; moving away never pulls it
    room = parse_level("#######\n#_PX_O#\n#_____#\n#######")
    s = transition(room, start_state(room), "left")
    assert s == ((1, 1), ((1, 3),))
    s = transition(room, start_state(room), "right")
    assert s == ((1, 3), ((1, 4),))
    assert transition(room, s, "left") == ((1, 2), ((1, 4),))


def test_render_symbols_and_parse_round_trip():
    text = "#######\n#S_X_*#\n#_O_X_#\n#######"
    room = parse_level(text)
    assert room["targets"] == ((1, 1), (1, 5), (2, 2))
    assert room["boxes"] == ((1, 3), (1, 5), (2, 4)) and room["start"] == (1, 1)
    assert render(room, start_state(room)) == text
    assert set(text) <= set("#_OX*PS\n")
    with pytest.raises(ValueError, match="player"):
        parse_level("####\n#XO#\n####")
    with pytest.raises(ValueError, match="symbol"):
        parse_level("####\n#P?#\n####")


def test_reward_options_and_subgoal_count_boxes_on_targets():
    text = "########\n#P_X_O_#\n#__X_O_#\n########"
    env, res = play(text, ["right", "right", "right"], step_penalty=-0.01, box_reward=0.5)
    assert [r.info["subgoal"] for r in res] == ["0", "0", "1"]
    assert [r.reward for r in res] == pytest.approx([-0.01, -0.01, 0.49])
    res = [env.step(a) for a in ("right",)]  # the box leaves its target: -box_reward
    assert res[0].info["subgoal"] == "0" and res[0].reward == pytest.approx(-0.51)
    env, res = play(CORRIDOR, ["right"] * 3, step_penalty=-0.01)
    assert res[-1].reward == pytest.approx(0.99) and res[-1].info["success"]


def test_actions_aliases_and_letters():
    for word, act in [("  UP ", "up"), ("u", "up"), ("n", "up"), ("North", "up"), ("d", "down"),
                      ("s", "down"), ("south", "down"), ("l", "left"), ("w", "left"),
                      ("west", "left"), ("r", "right"), ("e", "right"), ("east", "right")]:
        env, res = play(CORRIDOR, [word])
        ref, want = play(CORRIDOR, [act])
        assert not res[0].info["invalid_action"] and res[0].observation == want[0].observation
    env, res = play(CORRIDOR, ["jump", "push right", None])
    assert all(r.info["invalid_action"] and r.reward == pytest.approx(-0.1) for r in res)
    env = Sokoban(action_names="letters")
    for task in env.sample_tasks(3, 5):
        ep = run_episode(env, solver_policy(env), task)
        assert ep.success and set(ep.actions) <= set("udlr")
        env.reset(task)
        assert env.teacher_context() == "plan: " + " ".join(ep.actions)
        assert env.random_action(random.Random(0)) in "udlr"
    with pytest.raises(ValueError, match="action_names"):
        Sokoban(action_names="emoji")


# --- the generator ------------------------------------------------------------------------------

CONFIGS = [dict(size=6, boxes=1), dict(size=7, boxes=2, max_turns=30, min_moves=8)]


@pytest.mark.parametrize("kwargs", CONFIGS, ids=["6x6_1box", "7x7_2box_min8"])
def test_generator_deterministic_solvable_and_within_bounds(kwargs):
    env = Sokoban(**kwargs)
    tasks = env.sample_tasks(0, 40, "train")
    assert [t.key for t in env.sample_tasks(0, 40, "train")] == [t.key for t in tasks]
    assert env.make_task(7) == env.make_task(7) and env.make_task(7) != env.make_task(8)
    n, hi = env.size, env.max_turns - 2
    for t in tasks:
        room = t.data
        assert room["shape"] == (n, n) and len(room["boxes"]) == len(room["targets"]) == env.boxes
        ring = {(r, c) for r in range(n) for c in range(n) if r in (0, n - 1) or c in (0, n - 1)}
        assert ring <= room["walls"]
        assert not set(room["boxes"]) & set(room["targets"])  # no box starts on a target
        assert t.key == render(room, start_state(room)).replace("\n", "/")
        length = len(bfs_plan(room))
        assert env.min_moves <= length <= hi
        assert distance(room, start_state(room)) == length == len(plan(room))


def test_generator_errors_and_constructor_checks():
    with pytest.raises(ValueError, match="raise max_turns"):  # 2x2 inside: every box is stuck
        Sokoban(size=4, boxes=1).make_task(0)
    with pytest.raises(ValueError, match="min_moves"):
        Sokoban(max_turns=10, min_moves=9)
    with pytest.raises(ValueError, match="boxes"):
        Sokoban(size=5, boxes=5)
    with pytest.raises(ValueError, match="size"):
        Sokoban(size=3)


def test_held_out_rooms_never_appear_in_training():
    env = Sokoban()
    train = env.sample_tasks(1, 200, "train")
    test = env.sample_tasks(1, 50, "test")
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}
    assert not {t.key for t in train} & {t.key for t in test}
    rooms = lambda ts: {room_text(t.data) for t in ts}  # noqa: E731
    assert not rooms(train) & rooms(test)
    assert all(t.split == split_of(room_text(t.data)) for t in train + test)


def test_horizon_stats_keys_match_the_grid_world():
    stats = Sokoban(size=7, boxes=2, max_turns=30).horizon_stats(30)
    assert set(stats) == set(GridWorld().horizon_stats(5))
    assert 1 <= stats["min"] <= stats["mean"] <= stats["max"] <= 28 and stats["max_turns"] == 30


# --- the solver, the potential -------------------------------------------------------------------


def brute_force_length(room, state, depth: int):
    """The fewest moves of any action sequence of at most ``depth`` moves that solves the level
    (every sequence tried, no state merging), or None."""
    for k in range(depth + 1):
        for seq in itertools.product(ACTIONS, repeat=k):
            s = state
            for a in seq:
                s = transition(room, s, a)
            if solved(room, s):
                return k
    return None


@pytest.mark.parametrize("boxes", [1, 2])
def test_solver_is_optimal_against_brute_force_on_tiny_rooms(boxes):
    env = Sokoban(size=5, boxes=boxes, max_turns=8)
    for task in env.sample_tasks(0, 6):
        room = task.data
        n = len(plan(room))
        assert brute_force_length(room, start_state(room), n) == n
        assert n == 1 or brute_force_length(room, start_state(room), n - 1) is None
    # a dead lock: no sequence solves it, the solver has no plan
    room = parse_level("######\n#O___#\n#_P_X#\n#____#\n######")
    assert bfs_plan(room) is None and plan(room) is None
    assert distance(room, start_state(room)) is None
    assert brute_force_length(room, start_state(room), 6) is None


@pytest.mark.parametrize("kwargs", CONFIGS, ids=["6x6_1box", "7x7_2box_min8"])
def test_solver_episodes_succeed_and_potential_counts_down(kwargs):
    env = Sokoban(**kwargs)
    for task in env.sample_tasks(2, 8) + env.sample_tasks(2, 4, "test"):
        length = len(bfs_plan(task.data))
        _, info = env.reset(task)
        assert info["potential"] == -length and info["subgoal"] == "0"
        assert info["teacher_context"].split()[1:] == plan(task.data)
        ep = run_episode(env, solver_policy(env), task)
        assert ep.success and len(ep.actions) == length and ep.rewards[-1] == 1.0
        seen = [info["potential"]] + [i["potential"] for i in ep.infos]
        assert seen == [float(-d) for d in range(length, -1, -1)]
        assert str(seen[-1]) == "0.0" and ep.infos[-1]["subgoal"] == str(env.boxes)


def test_dead_lock_potential_and_solver():
    env, res = play("######\n#O___#\n#_PX_#\n#____#\n######", ["right"], max_turns=10)
    assert res[0].observation.split("\n")[2] == "#__PX#"
    table = distance_table(env.room)
    assert env.distance() is None and env.state not in table
    assert res[0].info["potential"] == env.dead_potential() == -max(10, max(table.values()) + 1)
    assert res[0].info["potential"] < min(-d for d in table.values())
    assert env.solver() == "up" and env.teacher_context() == "plan: "


@settings(max_examples=15)
@given(seed=st.integers(0, 10_000), moves=st.lists(st.sampled_from(ACTIONS), max_size=12))
def test_random_play_keeps_the_rules_and_the_potential(seed, moves):
    env = Sokoban(size=6, boxes=2, max_turns=20)
    task = env.make_task(seed)
    _, info = env.reset(task)
    keys = {info["state_key"]: env.state}
    for act in moves:
        if env.done:
            break
        before = env.state
        res = env.step(act)
        player, boxes = env.state
        assert len(set(boxes)) == len(boxes) == 2 and player not in boxes
        assert not ({player, *boxes} & env.room["walls"])
        assert env.state == transition(env.room, before, act)
        ref = bfs_plan(env.room, env.state)
        assert res.info["potential"] == (env.dead_potential() if ref is None else -len(ref))
        assert keys.setdefault(res.info["state_key"], env.state) == env.state  # key <-> state
    assert len(set(keys.values())) == len(keys)


# --- state keys, groups, registry ---------------------------------------------------------------


def test_state_keys_equal_for_equal_states():
    text = "#######\n#_____#\n#_PX_O#\n#_____#\n#######"
    a, ra = play(text, ["up", "down", "left", "right"])
    b, rb = play(text, ["left", "right"])
    assert ra[-1].info["state_key"] == rb[-1].info["state_key"] == a.state_key()
    assert ra[-1].observation == rb[-1].observation
    c, rc = play(text, ["right"])  # the box moved: another state
    assert rc[-1].info["state_key"] != rb[-1].info["state_key"]
    other = "#######\n#____O#\n#_PX__#\n#_____#\n#######"  # the same positions, another room
    d, _ = play(other, [])
    e, _ = play(text, [])
    assert d.state == e.state and d.state_key() != e.state_key()


def test_group_reset_fork_and_clone():
    env = Sokoban(size=7, boxes=2, max_turns=30, action_names="letters")
    task = env.sample_tasks(5, 1)[0]
    group = reset_group(env, task, 3)
    assert len({obs for _, obs, _ in group}) == 1
    e0 = group[0][0]
    e0.step(e0.solver())
    fork = e0.fork()
    assert fork.state_key() == e0.state_key() and fork.room == e0.room
    assert fork.step("l").observation == e0.step("l").observation
    assert group[1][0].observation() == group[1][1]
    assert env.clone()._config() == env._config()
    assert SafeEnv(env).reports == Sokoban.reports == {"potential": Sokoban.reports["potential"]}


def test_registered_as_sokoban():
    env = make_env("sokoban", size=7, boxes=2)
    assert isinstance(env, Sokoban) and (env.size, env.boxes) == (7, 2)
    cfg = run_checks.load(None, ["env.name=sokoban", "env.kwargs.size=7", "env.kwargs.boxes=2",
                                 "env.kwargs.max_turns=30", "rollout.max_turns=30"])
    assert cfg.env.name == "sokoban" and dict(cfg.env.kwargs) == {"size": 7, "boxes": 2,
                                                                  "max_turns": 30}
