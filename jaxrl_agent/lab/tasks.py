"""Task families of the credit lab: small tabular MDPs whose advantages are known exactly.

* ``tree``: a random layered tree with *shared states*: ``depth`` layers of ``width`` states;
  each action leads to a fixed random state of the next layer (with probability ``slip`` to a
  uniformly random one instead). Rollouts of a group meet the same states again, so
  step-level grouping (GiGPO's anchor states) has something to find. Reward 1 on arriving at
  one of the ``num_goals`` success leaves of the last layer.
* ``gridworld``: the key-door grid world of the training loop (``envs.gridworld``) as an
  exact MDP: state (position, key held, door open) of ``num_layouts`` layouts (one task each);
  reward 1 on reaching the goal; ``horizon`` actions at most.
* ``chain``: a prerequisite chain. Success needs C correct steps in order (one correct action
  of ``num_actions`` per step; a wrong step breaks the chain for good). The verifier exposes
  the correctness of ``exposed`` = k of the C steps (a random subset): verifier information
  density V_d = k / C (the credit-targeting paper). State (step i, chain still intact); the
  policy observes the step i only.
  Reward 1 on finishing an intact chain.
* ``distractor``: the chain with ``distractors`` extra turns placed at random where every
  action is equally good (redundant actions that neither help nor hurt: exact advantage 0).

Every builder takes a ``seed`` and returns a ``Task``: the MDP plus a description.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from jaxrl_agent.lab.mdp import TabularMDP, make_mdp


@dataclasses.dataclass(frozen=True)
class Task:
    """A named MDP instance; ``info`` holds its settings and derived facts (V_d, sizes)."""

    name: str
    mdp: TabularMDP
    info: dict

    def describe(self) -> str:
        keys = ", ".join(f"{k}={v}" for k, v in self.info.items())
        return (f"{self.name} (S={self.mdp.num_states}, A={self.mdp.num_actions}, "
                f"H={self.mdp.horizon}; {keys})")


def random_tree(*, depth: int = 6, width: int = 4, num_actions: int = 3, num_goals: int = 1,
                slip: float = 0.1, seed: int = 0) -> Task:
    """Layers t = 0..depth of ``width`` states each (state id t * width + j); the last layer is
    terminal. Action a in state s of layer t < depth leads to next[s, a] of layer t + 1 with
    probability 1 - slip + slip / width, else to another state of layer t + 1 uniformly.
    Start: uniform over layer 0 (each start state is a task). Arrival reward 1 at the
    ``num_goals`` goal leaves."""
    if not (depth >= 1 and width >= 1 and num_actions >= 2 and 1 <= num_goals <= width):
        raise ValueError("tree needs depth >= 1, width >= 1, num_actions >= 2 and "
                         "1 <= num_goals <= width")
    if not 0.0 <= slip <= 1.0:
        raise ValueError(f"slip must be in [0, 1], got {slip}")
    rng = np.random.default_rng(seed)
    S, A = (depth + 1) * width, num_actions
    P = np.zeros((S, A, S), np.float32)
    for t in range(depth):
        for j in range(width):
            s = t * width + j
            nxt = rng.integers(0, width, size=A)
            nxt[:2] = rng.choice(width, size=2, replace=width < 2)  # two distinct children
            for a in range(A):
                layer = slice((t + 1) * width, (t + 2) * width)
                P[s, a, layer] = slip / width
                P[s, a, (t + 1) * width + nxt[a]] += 1.0 - slip
    for s in range(depth * width, S):  # terminal leaves: self-loops (never acted in)
        P[s, :, s] = 1.0
    terminal = np.zeros(S, bool)
    terminal[depth * width:] = True
    arrival = np.zeros(S, np.float32)
    arrival[depth * width + rng.choice(width, size=num_goals, replace=False)] = 1.0
    start = np.zeros(S, np.float32)
    start[:width] = 1.0 / width
    mdp = make_mdp(P, np.zeros((S, A)), terminal, start, depth, arrival=arrival)
    return Task("tree", mdp, dict(depth=depth, width=width, num_actions=A, num_goals=num_goals,
                                  slip=slip, seed=seed))


def gridworld(*, size: int = 5, extra_walls: int = 2, horizon: int = 12, num_layouts: int = 2,
              seed: int = 0) -> Task:
    """The key-door grid world (``envs.gridworld``) as an exact MDP over the reachable states
    (position, has_key, door_open) of ``num_layouts`` random layouts, one task each.
    Actions: up, down, left, right, pick, open (deterministic). Arrival reward 1 at the goal
    (terminal)."""
    from jaxrl_agent.envs import gridworld as gw

    env = gw.GridWorld(size=size, extra_walls=extra_walls, max_turns=horizon)
    rng = random.Random(seed)
    index, edges, goals, starts = {}, [], set(), []
    for layout_id in range(num_layouts):
        lay = env.make_task(rng).data
        s0 = (layout_id, lay["start"], False, False)
        index.setdefault(s0, len(index))
        starts.append(index[s0])
        frontier = [s0]
        while frontier:
            st = frontier.pop()
            if st[1] == lay["goal"]:
                goals.add(index[st])
                continue
            for a, act in enumerate(gw.ACTIONS):
                pos, key, door = gw.transition(size, lay, st[1:], act)
                nxt = (layout_id, pos, key, door)
                if nxt not in index:
                    index[nxt] = len(index)
                    frontier.append(nxt)
                edges.append((index[st], a, index[nxt]))
    S, A = len(index), len(gw.ACTIONS)
    P = np.zeros((S, A, S), np.float32)
    for s, a, t in edges:
        P[s, a, t] = 1.0
    terminal = np.zeros(S, bool)
    terminal[list(goals)] = True
    for s in goals:
        P[s, :, s] = 1.0
    arrival = terminal.astype(np.float32)
    start = np.zeros(S, np.float32)
    start[starts] = 1.0 / len(starts)
    mdp = make_mdp(P, np.zeros((S, A)), terminal, start, horizon, arrival=arrival)
    return Task("gridworld", mdp, dict(size=size, extra_walls=extra_walls,
                                       num_layouts=num_layouts, seed=seed))


def chain(*, length: int = 6, num_actions: int = 3, exposed: int = 1, distractors: int = 0,
          seed: int = 0) -> Task:
    """A prerequisite chain of C = ``length`` steps (plus ``distractors`` free turns).

    Turn i of L = C + D turns is a real step (one correct action; a wrong one breaks the
    chain) or a distractor (every action keeps the chain as it is). State id 2 i + broken for
    i = 0..L (i = L terminal); the policy observes i only (an agent does not know that an
    earlier step broke the chain). Reward 1 on arriving at (L, intact). The verifier checks
    ``exposed`` = k of the C real steps: check[s, a] = 1 when step i is checked and a is its
    correct action (whether or not the chain is already broken). V_d = k / C.
    """
    C, D, k = length, distractors, exposed
    if not (C >= 1 and num_actions >= 2 and 0 <= k <= C and D >= 0):
        raise ValueError("chain needs length >= 1, num_actions >= 2, 0 <= exposed <= length "
                         "and distractors >= 0")
    rng = np.random.default_rng(seed)
    L = C + D
    correct = rng.integers(0, num_actions, size=L)
    real = np.zeros(L, bool)
    real[np.sort(rng.choice(L, size=C, replace=False))] = True
    # the checked steps: the first k of one random order, so that tasks differing only in k
    # are the same chain (same correct actions) with nested checked sets
    order = rng.permutation(np.flatnonzero(real))
    checked = np.zeros(L, bool)
    checked[order[:k]] = True
    S, A = 2 * (L + 1), num_actions
    P = np.zeros((S, A, S), np.float32)
    check = np.zeros((S, A), np.float32)
    for i in range(L):
        for broken in (0, 1):
            s = 2 * i + broken
            for a in range(A):
                ok = (not real[i]) or a == correct[i]
                P[s, a, 2 * (i + 1) + (broken if ok else 1)] = 1.0
                check[s, a] = float(checked[i] and a == correct[i])
    for s in (2 * L, 2 * L + 1):
        P[s, :, s] = 1.0
    terminal = np.zeros(S, bool)
    terminal[2 * L:] = True
    arrival = np.zeros(S, np.float32)
    arrival[2 * L] = 1.0
    start = np.zeros(S, np.float32)
    start[0] = 1.0
    mdp = make_mdp(P, np.zeros((S, A)), terminal, start, L, arrival=arrival, check=check,
                   num_checks=float(k), obs=np.arange(S) // 2)
    name = "distractor" if D else "chain"
    return Task(name, mdp, dict(length=C, num_actions=A, exposed=k, distractors=D,
                                v_d=round(k / C, 4), seed=seed,
                                checked_turns=[int(i) for i in np.flatnonzero(checked)],
                                distractor_turns=[int(i) for i in np.flatnonzero(~real)]))


def distractor(*, length: int = 4, num_actions: int = 3, exposed: int = 1,
               distractors: int = 4, seed: int = 0) -> Task:
    """``chain`` with ``distractors`` free turns (default: as many as real steps)."""
    return chain(length=length, num_actions=num_actions, exposed=exposed,
                 distractors=distractors, seed=seed)


TASKS = {"tree": random_tree, "gridworld": gridworld, "chain": chain, "distractor": distractor}


def make_task(name: str, **kwargs) -> Task:
    """The task family ``name`` (one of ``TASKS``) built with ``kwargs``; ValueError listing
    the families, or the builder's parameters, on a bad name."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    import inspect
    allowed = [p for p in inspect.signature(TASKS[name]).parameters]
    bad = sorted(set(kwargs) - set(allowed))
    if bad:
        raise ValueError(f"task {name!r} has no parameter(s) {bad}; it takes: "
                         f"{', '.join(allowed)}")
    return TASKS[name](**kwargs)
