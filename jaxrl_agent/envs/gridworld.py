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
``max_turns`` (default 16). ``state_key = "grid:<layout>|<row>,<col>|k<0/1>|d<doors open>"``.

Reports (``Env.reports``): ``info["potential"]`` in every info (reset and every step, the
terminal one too) is minus the number of actions the solver's shortest plan (``bfs_plan``, the
one ``solver()`` follows) still needs from that state: 0 at the goal, ``-len(plan)`` at the
start, and minus the remaining distance after a time-out.

Difficulty: ``size`` and ``extra_walls`` lengthen the walk; ``doors=2`` splits the grid in three
rooms by two parallel wall lines, each with a locked door (agent and key in one outer room, the
goal in the other): the one key opens both doors, the first (nearer the key) before the second,
so a plan is key -> door 1 -> door 2 -> goal. ``horizon_stats`` reports the optimal plan length
of a configuration (the levels of the credit study in docs/training.md).
"""

from __future__ import annotations

from jaxrl_agent.envs.base import Env, Task, register, shortest_plan, split_of

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
    reports = {"potential": "minus the number of moves the solver still needs from this state "
                            "(0 at the goal)"}

    def __init__(self, size: int = 5, extra_walls: int = 2, max_turns: int | None = None,
                 invalid_penalty: float = -0.1, invalid_ends: bool = False,
                 action_names: str = "words", step_latency_s: float = 0.0, doors: int = 1):
        super().__init__(max_turns, invalid_penalty, invalid_ends, step_latency_s)
        if size < 4:
            raise ValueError(f"size must be >= 4, got {size}")
        if action_names not in ACTION_NAMES:
            raise ValueError(f"action_names must be one of {ACTION_NAMES}, got {action_names!r}")
        if doors not in (1, 2):
            raise ValueError(f"doors must be 1 or 2, got {doors!r}")
        if doors == 2 and size < 6:
            raise ValueError(f"doors=2 needs size >= 6 (three rooms), got size={size}")
        self.size, self.extra_walls = int(size), int(extra_walls)
        self.action_names = action_names
        self.doors = int(doors)

    def _config(self):
        return dict(super()._config(), size=self.size, extra_walls=self.extra_walls,
                    action_names=self.action_names, doors=self.doors)

    # --- layouts ---------------------------------------------------------------------------
    def _make_task(self, rng) -> Task:
        if self.doors == 2:
            return self._make_two_door_task(rng)
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
            layout = {"walls": frozenset(walls), "door": door, "doors": (door,), "key": key,
                      "goal": goal, "start": agent}
            task = self._task_if_solvable(layout)
            if task is not None:
                return task
        raise self._no_layout()

    def _make_two_door_task(self, rng) -> Task:
        n = self.size
        for _ in range(1000):
            vertical = rng.random() < 0.5
            first = rng.randint(1, n - 4)
            second = rng.randint(first + 2, n - 2)
            at = lambda i, line: (i, line) if vertical else (line, i)  # noqa: E731
            doors = [at(rng.randrange(n), first), at(rng.randrange(n), second)]
            walls = {at(i, line) for line in (first, second) for i in range(n)} - set(doors)
            coord = (lambda p: p[1]) if vertical else (lambda p: p[0])
            cells = [(r, c) for r in range(n) for c in range(n)]
            near = [p for p in cells if coord(p) < first]
            far = [p for p in cells if coord(p) > second]
            if rng.random() < 0.5:  # start on the other side: the doors are met in reverse
                near, far, doors = far, near, doors[::-1]
            free = [p for p in cells if p not in walls and p not in doors]
            walls |= set(rng.sample(free, min(self.extra_walls, len(free))))
            a_cells = [p for p in near if p not in walls]
            b_cells = [p for p in far if p not in walls]
            if len(a_cells) < 2 or not b_cells:
                continue
            agent, key = rng.sample(a_cells, 2)
            layout = {"walls": frozenset(walls), "door": doors[0], "doors": tuple(doors),
                      "key": key, "goal": rng.choice(b_cells), "start": agent}
            task = self._task_if_solvable(layout)
            if task is not None:
                return task
        raise self._no_layout()

    def _task_if_solvable(self, layout) -> Task | None:
        plan = bfs_plan(self.size, layout)
        if plan is None or len(plan) > max(1, self.max_turns - 2):
            return None
        key_text = render(self.size, layout, layout["start"], False, 0).replace("\n", "/")
        return Task(self.family, key_text, split_of(key_text), layout)

    def _no_layout(self) -> ValueError:
        n = self.size
        return ValueError(f"no solvable {n}x{n} layout ({self.doors} door(s), {self.extra_walls} "
                          f"extra walls) with a plan of at most max_turns - 2 = "
                          f"{self.max_turns - 2} actions; raise max_turns")

    def horizon_stats(self, num_tasks: int = 500, seed: int = 0) -> dict:
        """Optimal plan lengths (turns to success) of ``num_tasks`` random layouts."""
        lengths = [len(bfs_plan(self.size, self.make_task(seed * 1_000_003 + i).data))
                   for i in range(num_tasks)]
        return {"mean": sum(lengths) / len(lengths), "min": min(lengths), "max": max(lengths),
                "max_turns": self.max_turns}

    # --- dynamics --------------------------------------------------------------------------
    def _reset(self, task):
        lay = task.data
        self.layout = lay
        self.pos, self.has_key, self.door_open = lay["start"], False, 0

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
        """The stage of the task: get the key, open the door(s), reach the goal."""
        if not self.has_key:
            return "key"
        doors = len(self.layout["doors"])
        if self.door_open >= doors:
            return "goal"
        return "door" if doors == 1 else f"door{int(self.door_open) + 1}"

    def distance(self) -> int:
        """The number of actions of the shortest plan from the current state to the goal (0 at
        the goal). Every reachable state has one (moves can be undone, and holding the key or
        opening a door never blocks a path); RuntimeError otherwise."""
        plan = bfs_plan(self.size, self.layout, (self.pos, self.has_key, self.door_open))
        if plan is None:
            raise RuntimeError(f"no plan to the goal from state {self.state_key()}")
        return len(plan)

    def teacher_context(self) -> str:
        """The solver's whole plan from the start, in the env's action names: ``"plan: r r d
        ..."`` (privileged: the policy sees only the grid)."""
        plan = bfs_plan(self.size, self.layout, (self.pos, self.has_key, self.door_open)) or []
        names = [LETTERS[a] if self.action_names == "letters" else a for a in plan]
        return "plan: " + " ".join(names)

    def report_values(self) -> dict:
        """``{"potential": -distance()}`` (``reports``)."""
        return {"potential": float(-self.distance())}  # 0.0 at the goal, not -0.0

    def random_action(self, rng) -> str:
        act = rng.choice(ACTIONS)
        return LETTERS[act] if self.action_names == "letters" else act

    def solver(self) -> str:
        plan = bfs_plan(self.size, self.layout, (self.pos, self.has_key, self.door_open))
        act = plan[0] if plan else "up"  # goal reached or unsolvable: any legal action
        return LETTERS[act] if self.action_names == "letters" else act


def transition(n, lay, state, act):
    """One step of the dynamics. ``state = (pos, has_key, door_open)`` with ``door_open`` the
    number of doors opened so far (doors open in order; with one door 0/1, or False/True)."""
    pos, has_key, door_open = state
    doors = lay["doors"]
    if act in MOVES:
        dr, dc = MOVES[act]
        nxt = (pos[0] + dr, pos[1] + dc)
        inside = 0 <= nxt[0] < n and 0 <= nxt[1] < n
        blocked = (not inside or nxt in lay["walls"]
                   or (nxt in doors and doors.index(nxt) >= door_open))
        if not blocked:
            pos = nxt
    elif act == "pick":
        if pos == lay["key"] and not has_key:
            has_key = True
    elif act == "open" and has_key and door_open < len(doors):
        door = doors[door_open]
        if abs(pos[0] - door[0]) + abs(pos[1] - door[1]) == 1:
            door_open = int(door_open) + 1
    return pos, has_key, door_open


def bfs_plan(n, lay, state=None):
    """Shortest action list from ``state`` (default: the start) to the goal, or None."""
    start = state if state is not None else (lay["start"], False, 0)
    return shortest_plan(start, ACTIONS, lambda s, a: transition(n, lay, s, a),
                         lambda s: s[0] == lay["goal"])


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
            elif p in lay["doors"]:
                ch = "/" if lay["doors"].index(p) < door_open else "D"
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
