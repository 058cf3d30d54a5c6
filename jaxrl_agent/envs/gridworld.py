"""A text grid world with a key, a locked door and a goal behind the door.

Layout: a ``size x size`` grid (outside the grid counts as wall) split in two rooms by a wall
line (a column or a row) with one locked door ``D`` in it. The agent ``A`` and the key ``K`` are
in one room, the goal ``G`` in the other, plus a few random wall cells (only layouts whose
shortest plan is at most ``max_turns - 2`` are kept). Observation (one line per grid row, then the
inventory)::

    A.#..
    .K#..
    ..D.G
    ..#..
    ..#..
    key: no

``/`` is an open door. Actions (one word, case/whitespace tolerant): ``up down left right`` move
(into a wall or a locked door: no move), ``pick`` takes the key when standing on it, ``open``
opens the door when holding the key and standing next to it (4-neighbourhood). Aliases:
``u d l r n s e w north south east west``, ``p``/``pickup``/``take``/``get``, ``o``/``unlock``.
``action_names="letters"`` makes ``solver()`` answer with the one-letter names ``u d l r p o``
(a byte-level policy then decides an action in one token instead of spelling a word, which
keeps trajectory-level credit off the spelling tokens); both forms are always accepted.
Reward 1.0 when the agent steps on the goal (done, success), 0 otherwise; episodes end at
``max_turns`` (default 16). ``state_key = "grid:<layout>|<row>,<col>|k<0/1>|d<0/1>"``.
"""

from __future__ import annotations

import collections

from jaxrl_agent.envs.base import Env, Task, register, split_of

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
ALIASES = {"u": "up", "n": "up", "north": "up", "d": "down", "s": "down", "south": "down",
           "l": "left", "w": "left", "west": "left", "r": "right", "e": "right", "east": "right",
           "p": "pick", "pickup": "pick", "take": "pick", "get": "pick", "grab": "pick",
           "o": "open", "unlock": "open"}
LETTERS = {"up": "u", "down": "d", "left": "l", "right": "r", "pick": "p", "open": "o"}
ACTION_NAMES = ("words", "letters")
ACTIONS = ("up", "down", "left", "right", "pick", "open")


class GridWorld(Env):
    family = "gridworld"
    default_max_turns = 16

    def __init__(self, size: int = 5, extra_walls: int = 2, max_turns: int | None = None,
                 invalid_penalty: float = -0.1, invalid_ends: bool = False,
                 action_names: str = "words", step_latency_s: float = 0.0):
        super().__init__(max_turns, invalid_penalty, invalid_ends, step_latency_s)
        if size < 4:
            raise ValueError(f"size must be >= 4, got {size}")
        if action_names not in ACTION_NAMES:
            raise ValueError(f"action_names must be one of {ACTION_NAMES}, got {action_names!r}")
        self.size, self.extra_walls = int(size), int(extra_walls)
        self.action_names = action_names

    def _config(self):
        return dict(super()._config(), size=self.size, extra_walls=self.extra_walls,
                    action_names=self.action_names)

    # --- layouts ---------------------------------------------------------------------------
    def _make_task(self, rng) -> Task:
        n = self.size
        for _ in range(1000):
            vertical = rng.random() < 0.5
            line = rng.randint(1, n - 2)
            door_at = rng.randrange(n)
            walls = set()
            for i in range(n):
                walls.add((i, line) if vertical else (line, i))
            door = (door_at, line) if vertical else (line, door_at)
            walls.discard(door)
            side_a = [(r, c) for r in range(n) for c in range(n)
                      if (c < line if vertical else r < line)]
            side_b = [(r, c) for r in range(n) for c in range(n)
                      if (c > line if vertical else r > line)]
            if rng.random() < 0.5:
                side_a, side_b = side_b, side_a
            free = [p for p in side_a + side_b]
            extra = rng.sample(free, min(self.extra_walls, len(free)))
            walls |= set(extra)
            a_cells = [p for p in side_a if p not in walls]
            b_cells = [p for p in side_b if p not in walls]
            if len(a_cells) < 2 or not b_cells:
                continue
            agent, key = rng.sample(a_cells, 2)
            goal = rng.choice(b_cells)
            layout = {"walls": frozenset(walls), "door": door, "key": key, "goal": goal,
                      "start": agent}
            plan = bfs_plan(n, layout)
            if plan is None or len(plan) > max(1, self.max_turns - 2):
                continue
            text = render(n, layout, agent, False, False)
            key_text = text.replace("\n", "/")
            return Task(self.family, key_text, split_of(key_text), layout)
        raise ValueError(f"no solvable {n}x{n} layout with a plan of at most max_turns - 2 = "
                         f"{self.max_turns - 2} actions; raise max_turns")

    # --- dynamics --------------------------------------------------------------------------
    def _reset(self, task):
        lay = task.data
        self.layout = lay
        self.pos, self.has_key, self.door_open = lay["start"], False, False

    def _parse(self, text):
        word = ALIASES.get(text, text)
        return word if word in ACTIONS else None

    def _apply(self, act):
        self.pos, self.has_key, self.door_open = transition(
            self.size, self.layout, (self.pos, self.has_key, self.door_open), act)
        if self.pos == self.layout["goal"]:
            return 1.0, True, {"success": True}
        return 0.0, False, {}

    def observation(self) -> str:
        return render(self.size, self.layout, self.pos, self.has_key, self.door_open) + \
            ("\nkey: yes" if self.has_key else "\nkey: no")

    def state_key(self) -> str:
        return (f"grid:{self.task.key}|{self.pos[0]},{self.pos[1]}"
                f"|k{int(self.has_key)}|d{int(self.door_open)}")

    def subgoal(self) -> str:
        """The stage of the task: get the key, open the door, reach the goal."""
        if not self.has_key:
            return "key"
        return "goal" if self.door_open else "door"

    def random_action(self, rng) -> str:
        act = rng.choice(ACTIONS)
        return LETTERS[act] if self.action_names == "letters" else act

    def solver(self) -> str:
        plan = bfs_plan(self.size, self.layout, (self.pos, self.has_key, self.door_open))
        act = plan[0] if plan else "up"  # goal reached or unsolvable: any legal action
        return LETTERS[act] if self.action_names == "letters" else act


def transition(n, lay, state, act):
    pos, has_key, door_open = state
    if act in MOVES:
        dr, dc = MOVES[act]
        nxt = (pos[0] + dr, pos[1] + dc)
        inside = 0 <= nxt[0] < n and 0 <= nxt[1] < n
        blocked = (not inside or nxt in lay["walls"] or (nxt == lay["door"] and not door_open))
        if not blocked:
            pos = nxt
    elif act == "pick":
        if pos == lay["key"] and not has_key:
            has_key = True
    elif act == "open":
        dr, dc = abs(pos[0] - lay["door"][0]), abs(pos[1] - lay["door"][1])
        if has_key and dr + dc == 1:
            door_open = True
    return pos, has_key, door_open


def bfs_plan(n, lay, state=None):
    """Shortest action list from ``state`` (default: the start) to the goal, or None."""
    start = state if state is not None else (lay["start"], False, False)
    if start[0] == lay["goal"]:
        return []
    prev = {start: None}
    q = collections.deque([start])
    while q:
        s = q.popleft()
        for act in ACTIONS:
            t = transition(n, lay, s, act)
            if t in prev:
                continue
            prev[t] = (s, act)
            if t[0] == lay["goal"]:
                plan = []
                while prev[t] is not None:
                    t, a = prev[t]
                    plan.append(a)
                return plan[::-1]
            q.append(t)
    return None


def render(n, lay, pos, has_key, door_open) -> str:
    rows = []
    for r in range(n):
        row = []
        for c in range(n):
            p = (r, c)
            if p == pos:
                ch = "A"
            elif p in lay["walls"]:
                ch = "#"
            elif p == lay["door"]:
                ch = "/" if door_open else "D"
            elif p == lay["key"] and not has_key:
                ch = "K"
            elif p == lay["goal"]:
                ch = "G"
            else:
                ch = "."
            row.append(ch)
        rows.append("".join(row))
    return "\n".join(rows)


register("gridworld", GridWorld)
