"""Regenerates examples/gridworld_steps.jsonl (deterministic): python examples/make_step_rollouts.py

Grid-world rollouts for the step-level estimators (GiGPO and family (b), HiPER's HAE): 3
tasks x 8 rollouts of an epsilon-greedy solver (30% random actions, at most 10 turns), so
rollouts of a task revisit the same states. Tokens are the UTF-8 bytes of the texts.

Per turn, besides observation/action/reward/state_key (the env's exact state key):
  logprobs          synthetic behaviour log-probs;
  value             a synthetic critic, 0.9^(shortest remaining plan length) (HAE's low level);
  turn_extras       high_values (the same critic at subgoal level), switch (1.0 where a subgoal
                    starts: the first turn, and the turns after the key is picked up and after
                    the door opens), hidden and state_features (4 numbers describing the
                    state: row, column, has key, door open; stand-ins for the actor's hidden
                    state and an observation embedding);
  token_extras      subgoal_mask (the first action token of a turn that starts a subgoal) and
                    switch_mask (none here).
"""

import json
import os
import random

from jaxrl_agent.envs.gridworld import ACTIONS, GridWorld, bfs_plan


def toks(text):
    return list(text.encode("utf-8"))


def rollout(env, task, rng, max_turns=10, eps=0.3):
    obs, info = env.reset(task)
    turns, done, subgoal = [], False, (False, False)
    while not done and len(turns) < max_turns:
        state = (env.pos, env.has_key, env.door_open)
        plan = bfs_plan(env.size, env.layout, state) or ["up"]
        act = rng.choice(ACTIONS) if rng.random() < eps else plan[0]
        key = env.state_key()
        value = round(0.9 ** len(plan), 4)
        starts = len(turns) == 0 or (state[1], state[2]) != subgoal
        subgoal = (state[1], state[2])
        res = env.step(act)
        a = toks(act)
        turns.append({
            "observation": toks(obs), "action": a, "reward": res.reward, "state_key": key,
            "logprobs": [round(-rng.uniform(0.05, 1.5), 4) for _ in a], "value": value,
            "turn_extras": {"high_values": value, "switch": 1.0 if starts else 0.0,
                            "hidden": [state[0][0] / 4, state[0][1] / 4, float(state[1]),
                                       float(state[2])],
                            "state_features": [state[0][0] / 4, state[0][1] / 4,
                                               float(state[1]), float(state[2])]},
            "token_extras": {"subgoal_mask": [starts and j == 0 for j in range(len(a))],
                             "switch_mask": [False] * len(a)}})
        obs, done = res.observation, res.done
    success = bool(done and turns[-1]["reward"] > 0)
    return {"group": task.id, "task": task.id, "outcome": 1.0 if success else 0.0,
            "turns": turns}


def main():
    rng = random.Random(0)
    env = GridWorld(size=5, extra_walls=2, max_turns=10)
    tasks = env.sample_tasks(rng, 3)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gridworld_steps.jsonl")
    with open(path, "w") as f:
        for task in tasks:
            for _ in range(8):
                f.write(json.dumps(rollout(env, task, rng)) + "\n")


if __name__ == "__main__":
    main()
