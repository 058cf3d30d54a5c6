"""Per-turn fields environments report (``Env.reports``): the grid world's ``potential`` (minus
the solver's distance to the goal), and the collector recording them as ``turn_extras`` (the
state acted in) and ``traj_extras["final_<name>"]`` (the state after the last action) in plain,
tree and chat rollouts, how a field an env leaves out ends that trajectory, and that envs
declaring nothing give the records they gave before."""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest

from jaxrl_agent import config as config_lib
from jaxrl_agent import estimators
from jaxrl_agent.envs import Chain, GridWorld, SafeEnv, first_errors, run_episode, solver_policy
from jaxrl_agent.envs.gridworld import ACTIONS, bfs_plan
from jaxrl_agent.rollout import ByteCodec, RolloutConfig, collect_groups
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.sampling import SampleOutput
from tests.test_rollout import LP, HintGrid, ScriptedSampler

CODEC = ByteCodec()
BATCH_FIELDS = ("tokens", "action_mask", "turn_ids", "row_traj", "old_logprobs", "turn_mask",
                "turn_rewards", "state_keys", "action_keys", "group_ids", "task_ids",
                "traj_mask", "outcome")
RECORD_KEYS = {"group", "task", "outcome", "success", "turns", "policy_version", "env_error",
               "invalid", "truncated", "context_truncated", "num_turns"}


def distance(env: GridWorld) -> int:
    """The solver's (BFS) plan length from ``env``'s current state."""
    return len(bfs_plan(env.size, env.layout, (env.pos, env.has_key, env.door_open)))


class HintSampler:
    """Plays the latest ``hint: <action>`` of each prompt (the solver's action), or with
    probability ``explore`` a random action drawn from the request's seed; every action ends
    with ``stop``. Works with any codec."""

    def __init__(self, codec, stop: int, explore: float = 0.0):
        self.codec, self.stop, self.explore = codec, stop, explore

    def generate(self, prompts, params):
        outs = []
        for prompt, p in zip(prompts, params):
            hint = re.findall(r"hint: (\w+)", self.codec.decode(prompt))[-1]
            rng = random.Random(p.seed)
            act = rng.choice(ACTIONS) if rng.random() < self.explore else hint
            ids = list(self.codec.encode(act)) + [self.stop]
            outs.append(SampleOutput(list(prompt), ids, [LP] * len(ids), "stop", 1))
        return outs

    def sync_weights(self, model_or_state, version):
        pass


def grid_tasks(n: int = 3):
    return GridWorld().sample_tasks(0, n)


def collect(env, cfg: RolloutConfig, *, explore: float = 0.3, codec=CODEC, stop=None,
            tasks=None):
    sampler = HintSampler(codec, CODEC.eos_token_id if stop is None else stop, explore)
    return collect_groups(env, tasks or grid_tasks(), sampler, codec, cfg, seed=0)


def check_recorded_potentials(records, tasks):
    """Replays every record's actions on a fresh grid world: each turn's ``turn_extras`` is the
    potential of the state before its action, ``traj_extras`` that of the state after the
    last one."""
    by_id = {t.id: t for t in tasks}
    for r in records:
        env = GridWorld()
        _, info = env.reset(by_id[r["task"]])
        for t in r["turns"]:
            assert t["state_key"] == info["state_key"]
            assert t["turn_extras"] == {"potential": info["potential"]}
            info = env.step(t["action_text"]).info
        assert r["traj_extras"] == {"final_potential": info["potential"]}
        assert info["potential"] == -distance(env)
        if r["success"]:
            assert info["potential"] == 0.0


# --- the grid world's potential ---------------------------------------------------------------


def test_grid_world_declares_potential_and_wrappers_forward_it():
    assert set(GridWorld.reports) == {"potential"} and GridWorld.reports["potential"]
    assert SafeEnv(GridWorld()).reports == GridWorld.reports
    assert Chain().reports == {} and SafeEnv(Chain()).reports == {}


@pytest.mark.parametrize("kwargs", [{}, {"size": 6, "doors": 2, "max_turns": 30}],
                         ids=["one_door", "two_doors"])
def test_potential_is_minus_the_solvers_distance(kwargs):
    env = GridWorld(**kwargs)
    tasks = env.sample_tasks(1, 3)
    for task in tasks:  # the demonstrator: one step closer per action, 0 at the goal
        plan = bfs_plan(env.size, task.data)
        ep = run_episode(env, solver_policy(env), task)
        _, first = env.reset(task)
        seen = [first["potential"]] + [i["potential"] for i in ep.infos]
        assert ep.success and seen == [float(-d) for d in range(len(plan), -1, -1)]
        assert math.copysign(1.0, seen[-1]) == 1.0  # 0.0, not -0.0
    timed_out = 0
    for seed, task in enumerate(tasks * 2):  # random (and invalid) actions
        rng = random.Random(seed)
        _, info = env.reset(task)
        assert info["potential"] == -distance(env)
        done = False
        while not done:
            res = env.step("jump" if rng.random() < 0.1 else env.random_action(rng))
            assert res.info["potential"] == -distance(env)
            assert (res.info["potential"] == 0.0) == (env.pos == task.data["goal"])
            done = res.done
        timed_out += bool(res.info.get("truncated"))
        if res.info.get("truncated"):  # a failed episode ends at minus the distance left
            assert res.info["potential"] < 0
    assert timed_out


# --- recording ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [
    RolloutConfig(group_size=2, max_new_tokens=8),
    RolloutConfig(group_size=2, max_turns=6, max_new_tokens=8, history="last"),
    RolloutConfig(group_size=1, max_turns=12, max_new_tokens=8, branch_turns=(1, 3),
                  branch_factor=2),
], ids=["full", "last_truncated", "tree"])
def test_collected_records_carry_the_potentials_and_pack(cfg):
    tasks = grid_tasks()
    records, stats = collect(HintGrid(), cfg, explore=0.4, tasks=tasks)
    assert stats["env_errors"] == stats["dropped"] == 0 and records
    assert any(not r["success"] for r in records)  # time-outs: minus the distance left
    assert any(r["success"] for r in records) or cfg.max_turns < 8  # at the goal: 0
    check_recorded_potentials(records, tasks)
    for layout in ("concatenated", "per_step"):
        batch, index = pack_records(records, layout=layout)
        pot, final = np.asarray(batch.extras["potential"]), np.asarray(
            batch.extras["final_potential"])
        assert pot.shape == (batch.num_traj, batch.num_turns) and final.shape == (batch.num_traj,)
        for i, r in enumerate(records):
            n, k = index.traj[i], len(r["turns"])
            assert pot[n, :k].tolist() == [t["turn_extras"]["potential"] for t in r["turns"]]
            assert final[n] == r["traj_extras"]["final_potential"]


def test_tree_forks_record_their_own_potentials():
    """The copies of a tree share the turns before a branch turn and record what their own env
    reported after it (the forks' report state is copied, not shared)."""
    tasks = grid_tasks(2)
    cfg = RolloutConfig(group_size=1, max_turns=10, max_new_tokens=8, branch_turns=(2,),
                        branch_factor=3)
    records, stats = collect(HintGrid(), cfg, explore=0.6, tasks=tasks)
    assert stats["forks"] == 2 * 2 and len(records) == 6
    check_recorded_potentials(records, tasks)
    a, b, c = records[:3]
    assert a["turns"][:2] == b["turns"][:2] == c["turns"][:2]
    finals = {r["traj_extras"]["final_potential"] for r in records}
    assert len(finals) > 1  # the copies went different ways


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from tests.chat_fixtures import make_chat_tokenizer

    return make_chat_tokenizer("qwen2.5", tmp_path_factory.mktemp("qwen"))


@pytest.mark.parametrize("history", ["full", "last"])
def test_chat_rollouts_record_the_potentials(chat_tokenizer, history):
    import warnings

    from jaxrl_agent.rollout.chat import ChatTemplate, ChatTemplateWarning

    tok = chat_tokenizer
    tasks = grid_tasks(2)
    cfg = RolloutConfig(group_size=2, max_turns=8, max_new_tokens=16, chat=True,
                        history=history, branch_turns=(1,), branch_factor=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ChatTemplateWarning)
        records, stats = collect(HintGrid(), cfg, explore=0.3, codec=tok,
                                 stop=ChatTemplate(tok).end_of_turn_id, tasks=tasks)
    assert stats["env_errors"] == 0 and len(records) == 8
    check_recorded_potentials(records, tasks)
    batch, _ = pack_records(records, layout="per_step")
    assert {"potential", "final_potential"} <= set(batch.extras)


# --- faults --------------------------------------------------------------------------------------


class Forgetful(HintGrid):
    """Reports ``depth`` (the turns taken) besides the potential, but at turn ``at`` (``"end"``:
    the terminal state) of task ``bad_task`` leaves it out (``bad=None``) or gives ``bad``."""

    reports = {**GridWorld.reports, "depth": "the turns taken so far"}

    def __init__(self, *a, bad_task=None, at=2, bad=None, **k):
        super().__init__(*a, **k)
        self.bad_task, self.at, self.bad = bad_task, at, bad

    def _config(self):
        return dict(super()._config(), bad_task=self.bad_task, at=self.at, bad=self.bad)

    def report_values(self):
        out = dict(super().report_values(), depth=float(self.turn))
        hit = (self.done and self.turn > 0) if self.at == "end" else self.turn == self.at
        if hit and self.task.key == self.bad_task:
            if self.bad is None:
                del out["depth"]
            else:
                out["depth"] = self.bad
        return out


@pytest.mark.parametrize("at,bad,problem", [
    (0, None, "has no 'depth'"), (2, None, "has no 'depth'"), ("end", None, "has no 'depth'"),
    (2, float("nan"), "has depth=nan (not a finite float32 number)"),
    (3, 1e39, "has depth=1e+39 (not a finite float32 number)"),
    (2, "high", "has depth='high' (a str, not a number)"),
    (2, True, "has depth=True (a bool, not a number)"),
])
def test_a_declared_field_left_out_drops_that_trajectory(at, bad, problem):
    tasks = grid_tasks(2)
    plan = len(bfs_plan(5, tasks[0].data))
    assert plan > 3
    turn = plan if at == "end" else at
    env = Forgetful(bad_task=tasks[0].key, at=at, bad=bad)
    first_errors.reset()
    records, stats = collect(env, RolloutConfig(group_size=2, max_new_tokens=8), explore=0.0,
                             tasks=tasks)
    assert [r["task"] for r in records] == [tasks[1].id] * 2  # the other task's are kept
    assert stats["env_errors"] == stats["dropped"] == 2 and stats["trajectories"] == 2
    want = f"Forgetful declares reports['depth'] but info at turn {turn} {problem}"
    (head, trace), = first_errors.take_new()
    assert want in head and head.startswith("ReportError: ") and want in trace
    for r in records:
        assert r["env_error"] is None and r["success"] == 1.0
        assert [t["turn_extras"]["depth"] for t in r["turns"]] == [
            float(k) for k in range(len(r["turns"]))]
        assert r["traj_extras"] == {"final_potential": 0.0, "final_depth": len(r["turns"])}
    pack_records(records, layout="per_step")


class Crashy(HintGrid):
    """Raises in its second step (an env fault: ``SafeEnv`` ends the trajectory)."""

    def step(self, action):
        if self.turn == 1:
            raise RuntimeError("boom")
        return super().step(action)


def test_an_env_error_keeps_the_last_reported_value_as_final():
    """A trajectory ended by an env fault is recorded (as before); its final potential is that
    of the state the failing action was taken in, the last one that reported one."""
    records, stats = collect(Crashy(), RolloutConfig(group_size=2, max_new_tokens=8))
    assert stats["env_errors"] == len(records) == 6 and stats["dropped"] == 0
    for r in records:
        assert "boom" in r["env_error"] and len(r["turns"]) == 2
        assert r["traj_extras"]["final_potential"] == r["turns"][1]["turn_extras"]["potential"]
    pack_records(records)


@pytest.mark.parametrize("reports,match", [
    (["potential"], r"Bad.reports must be a dict \{field name: description\}"),
    ({"": "x"}, "Bad.reports must be a dict"),
    ({"x": "a", "final_x": "b"}, "declares both 'x' and 'final_x'"),
])
def test_malformed_reports_are_refused_before_collecting(reports, match):
    Bad = type("Bad", (HintGrid,), {"reports": reports})
    with pytest.raises(ValueError, match=match):
        collect(Bad(), RolloutConfig(group_size=1, max_new_tokens=8))


# --- envs that declare nothing ------------------------------------------------------------------


class Silent(HintGrid):
    reports = {}


def test_envs_without_reports_give_the_records_they_gave_before():
    cfg = RolloutConfig(group_size=2, max_turns=8, max_new_tokens=8, branch_turns=(2,),
                        branch_factor=2)
    tasks = grid_tasks(2)
    plain, plain_stats = collect(Silent(), cfg, explore=0.4, tasks=tasks)
    reported, _ = collect(HintGrid(), cfg, explore=0.4, tasks=tasks)
    for r in plain:  # (the grid world also gives a teacher-only context: Env.teacher_context)
        assert set(r) == RECORD_KEYS | {"teacher_context"}
        assert not any("turn_extras" in t for t in r["turns"])
    stripped = [{k: v for k, v in r.items() if k != "traj_extras"} for r in reported]
    for r in stripped:
        r["turns"] = [{k: v for k, v in t.items() if k != "turn_extras"} for t in r["turns"]]
    assert stripped == plain
    chain = Chain()
    records, _ = collect_groups(chain, chain.sample_tasks(0, 2), ScriptedSampler(lambda _: "red"),
                                CODEC, RolloutConfig(group_size=2, max_turns=3, max_new_tokens=8))
    for r in records:
        assert set(r) == RECORD_KEYS and not any("turn_extras" in t for t in r["turns"])


def test_the_extras_change_nothing_for_the_default_estimator():
    """Packing the reported fields adds ``extras['potential']`` and ``['final_potential']`` and
    nothing else: every other batch field and the default estimator's advantages are the same
    as without them."""
    cfg = RolloutConfig(group_size=4, max_turns=8, max_new_tokens=8, history="last")
    reported, _ = collect(HintGrid(), cfg, explore=0.5)
    plain, _ = collect(Silent(), cfg, explore=0.5)
    name = config_lib.EstimatorSection().name
    for layout in ("concatenated", "per_step"):
        a, _ = pack_records(reported, layout=layout)
        b, _ = pack_records(plain, layout=layout)
        for field in BATCH_FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(a, field)),
                                          np.asarray(getattr(b, field)), err_msg=field)
        assert set(a.extras) - set(b.extras) == {"potential", "final_potential"}
        for f in b.extras:
            np.testing.assert_array_equal(np.asarray(a.extras[f]), np.asarray(b.extras[f]))
        if layout != config_lib.TrainerSection().layout:
            continue  # the estimator sees the same turn-level fields in both layouts
        adv_a, adv_b = estimators.compute(name, a), estimators.compute(name, b)
        np.testing.assert_array_equal(np.asarray(adv_a.token), np.asarray(adv_b.token))
        if adv_b.turn is not None:
            np.testing.assert_array_equal(np.asarray(adv_a.turn), np.asarray(adv_b.turn))
