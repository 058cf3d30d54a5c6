"""Sokoban: push every box onto a target in a procedurally generated room (as RAGEN and
verl-agent train it: a random room, the grid as text, named moves).

Rules (the published game): the player moves one cell ``up down left right``; moving into a
box pushes it one cell the same way when the cell beyond it is free; a push into a wall or into
another box leaves everything in place (the turn is spent), as does a move into a wall. Boxes
are never pulled. The level is solved when every box stands on a target.

Observation: the room, one line per row (``size`` lines of ``size`` characters; the outer ring
is wall)::

    ######
    #_O__#
    #_X__#
    #_P__#
    #____#
    ######

Legend (RAGEN's symbols, with ``*`` for its check mark to keep the text ASCII): ``#`` wall,
``_`` floor, ``O`` target, ``X`` box, ``*`` box on a target, ``P`` player, ``S`` player on a
target.

Actions (one word, case/whitespace tolerant): ``up down left right``, aliases ``u d l r``,
``n s e w``, ``north south east west``. ``action_names="letters"`` makes ``solver()`` (and so
the warm-up's demonstrations) answer with ``u d l r`` (one token for a byte-level policy);
both forms are always accepted.

Reward: 1.0 when the last box reaches a target (done, success), 0 otherwise (a sparse success
reward like the grid world's). Optional shaping, both 0 by default: ``step_penalty`` is added
to the reward of every valid action (e.g. -0.01; gym-sokoban uses -0.1), and ``box_reward`` is
added when a push puts a box on a target and subtracted when a push takes one off. Episodes end
at ``max_turns`` (default 20). ``state_key = "soko:<room>|<row>,<col>|<box>;<box>..."`` (the
room: walls and targets; then the player; then the sorted boxes): equal states, equal keys.

Generator (``_make_task``, deterministic given the rng): a random walk carves the floor of the
``(size-2) x (size-2)`` interior (each step stamps one of a few small shapes, so the floor is
connected); ``boxes`` targets are drawn on the floor; then the game is played *in reverse*
from the solved position (boxes on their targets, the player anywhere): a breadth-first search
over pulls and moves (``DistanceTable``) reaches exactly the states from which the level can
be solved, with their optimal number of moves. The start is drawn uniformly from those with no
box on a target and an optimal solution of ``min_moves`` to ``max_turns - 2`` moves (a room
without one is redrawn). This is the reverse-play idea of Taylor and Parberry (2011) as
gym-sokoban (Schrader, 2018) implements it, whose code RAGEN and verl-agent adapt, done
exhaustively: every level is solvable and its optimal length is known. The ``gym-sokoban``
package (0.0.6) is not a dependency: it needs the unmaintained ``gym`` 0.26, which ships only as
a source archive that did not build offline here (``invalid command 'bdist_wheel'``) and, put on
the path by hand, warns that it does not support NumPy 2 and fails in ``env.step`` (``numpy``
has no ``bool8``); its room generator does run, but draws from the process-wide ``random`` and
``numpy.random`` state and keeps its search in module globals (not per-task seedable without
resetting those, nor thread-safe).

Splits: a task is held out (``"test"``) by ``split_of`` of its *room* (walls and targets), not
of its start, so a held-out room is never seen in training, with any start.

Solver: ``DistanceTable`` (cached per room) gives every solvable state's optimal distance;
``solver()`` takes the first move (in the order up, down, left, right) that lowers it by one,
and ``plan`` follows it to the goal; ``bfs_plan`` is an independent forward breadth-first
search of the same optimal length (the tests compare them).

Reports (``Env.reports``): ``info["potential"]`` is minus the number of moves the solver still
needs: 0 when solved, ``-len(plan)`` at the start. A dead-locked state (no move sequence solves
the level any more, e.g. a box pushed into a corner off its target) reports
``dead_potential()`` = ``-max(max_turns, D + 1)``, ``D`` the longest optimal solution of any
solvable state of the room, so a dead lock is below every solvable state. ``subgoal()`` is the
number of boxes on targets (``"0"``, ``"1"``, ...); ``teacher_context()`` is the solver's plan,
``"plan: up up left ..."``.

Difficulty: ``size`` (the room's side, walls included: 6, 7, 8), ``boxes`` (1, 2, ...),
``max_turns`` and ``min_moves`` (the shortest optimal solution drawn; raise it for long
levels). ``horizon_stats`` reports the optimal solution lengths of a configuration.
"""

from __future__ import annotations

import functools

from jaxrl_agent.envs.base import Env, Task, register, shortest_plan, split_of

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
ACTIONS = ("up", "down", "left", "right")
ALIASES = {"u": "up", "n": "up", "north": "up", "d": "down", "s": "down", "south": "down",
           "l": "left", "w": "left", "west": "left", "r": "right", "e": "right", "east": "right"}
LETTERS = {"up": "u", "down": "d", "left": "l", "right": "r"}
ACTION_NAMES = ("words", "letters")

WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "#_OX*PS"

#: the floor stamps of the room generator's random walk (offsets from the walker)
STAMPS = (((0, 0),), ((0, 0), (0, 1)), ((0, 0), (1, 0)), ((0, 0), (0, 1), (1, 0), (1, 1)),
          ((0, 0), (0, -1), (1, 0)), ((0, 0), (-1, 0), (0, 1)))


# --- rooms and states ----------------------------------------------------------------------
# A room (``task.data``) is a dict: ``shape`` (rows, cols), ``walls`` (frozenset of (row, col);
# cells outside the shape count as wall too), ``targets`` (sorted tuple), ``start`` (the
# player's cell) and ``boxes`` (sorted tuple: the start's boxes). A state is ``(player, boxes)``.


def is_free(room, cell) -> bool:
    """True when ``cell`` is floor (inside the room and not a wall)."""
    r, c = cell
    return 0 <= r < room["shape"][0] and 0 <= c < room["shape"][1] and cell not in room["walls"]


def start_state(room):
    return room["start"], tuple(room["boxes"])


def solved(room, state) -> bool:
    return set(state[1]) == set(room["targets"])


def transition(room, state, act):
    """One move. ``state = (player, boxes)``; returns the next state (the same one when the move
    is blocked: a wall, or a box whose far side is a wall or another box)."""
    (r, c), boxes = state
    dr, dc = MOVES[act]
    nxt = (r + dr, c + dc)
    if not is_free(room, nxt):
        return state
    if nxt in boxes:
        beyond = (nxt[0] + dr, nxt[1] + dc)
        if not is_free(room, beyond) or beyond in boxes:
            return state
        boxes = tuple(sorted(beyond if b == nxt else b for b in boxes))
    return nxt, boxes


def bfs_plan(room, state=None):
    """Shortest move list from ``state`` (default: the start) to a solved state, or None when
    there is none (a dead lock); a forward breadth-first search over (player, boxes)."""
    start = state if state is not None else start_state(room)
    return shortest_plan(start, ACTIONS, lambda s, a: transition(room, s, a),
                         lambda s: solved(room, s))


class DistanceTable:
    """The optimal distance to a solved state of every solvable state of one room (its walls and
    targets; the start plays no part), built by playing in reverse: a breadth-first search from
    every solved state (boxes on the targets, the player on any free cell) over the inverse
    moves, a plain step or a step that pulls the box behind the player. A state missing from the
    table is a dead lock.

    States are stored as integers (cells numbered row-major over the room padded by a ring of
    wall; ``code = player + N * (box_1 + N * (box_2 + ...))`` with the boxes in ascending order,
    ``N`` the number of padded cells), which keeps the search free of per-state tuples.
    ``longest`` is the largest distance in the table."""

    def __init__(self, shape, walls, targets):
        rows, cols = shape
        self.width, self.k = cols + 2, len(targets)
        self.cells = (rows + 2) * self.width
        free = bytearray(self.cells)
        for r in range(rows):
            for c in range(cols):
                if (r, c) not in walls:
                    free[self._flat((r, c))] = 1
        self.targets = frozenset(self._flat(t) for t in targets)
        self.dist = self._search(free, sorted(self.targets))
        self.longest = max(self.dist.values(), default=0)

    def _flat(self, cell) -> int:
        return (cell[0] + 1) * self.width + cell[1] + 1

    def _cell(self, p: int):
        return p // self.width - 1, p % self.width - 1

    def _boxes(self, rest: int) -> list:
        out = []
        for _ in range(self.k):
            rest, b = divmod(rest, self.cells)
            out.append(b)
        return out

    def _pack(self, boxes) -> int:
        rest = 0
        for b in sorted(boxes, reverse=True):
            rest = rest * self.cells + b
        return rest

    def _search(self, free, goal) -> dict:
        n = self.cells
        goal_rest = self._pack(goal)
        dist = {p + n * goal_rest: 0 for p in range(n) if free[p] and p not in goal}
        frontier = list(dist)
        steps = (-self.width, self.width, -1, 1)
        d = 0
        while frontier:
            d += 1
            nxt = []
            for code in frontier:
                rest, p = divmod(code, n)
                boxes = self._boxes(rest)
                for m in steps:
                    q = p + m
                    if not free[q] or q in boxes:
                        continue
                    s = q + n * rest  # a plain step back
                    if s not in dist:
                        dist[s] = d
                        nxt.append(s)
                    b = p - m  # the box behind the player follows it: a pull
                    if b in boxes:
                        s = q + n * self._pack([p if x == b else x for x in boxes])
                        if s not in dist:
                            dist[s] = d
                            nxt.append(s)
            frontier = nxt
        return dist

    def code(self, state) -> int:
        player, boxes = state
        return self._flat(player) + self.cells * self._pack([self._flat(b) for b in boxes])

    def state(self, code: int):
        """The ``(player, boxes)`` state of an integer code."""
        rest, p = divmod(code, self.cells)
        return self._cell(p), tuple(self._cell(b) for b in sorted(self._boxes(rest)))

    def get(self, state) -> int | None:
        """The optimal distance of ``state``, None for a dead lock."""
        if len(state[1]) != self.k:
            return None
        return self.dist.get(self.code(state))

    def starts(self, lo: int, hi: int) -> list:
        """The codes of the states at distance ``lo`` to ``hi`` with no box on a target, in the
        search's (deterministic) order."""
        out = []
        for code, d in self.dist.items():
            if lo <= d <= hi and not self.targets.intersection(self._boxes(code // self.cells)):
                out.append(code)
        return out


def table(room) -> DistanceTable:
    """The room's ``DistanceTable``; cached per room (walls and targets; the last 256)."""
    return _table(room["shape"], room["walls"], tuple(room["targets"]))


@functools.lru_cache(maxsize=256)
def _table(shape, walls, targets) -> DistanceTable:
    return DistanceTable(shape, walls, targets)


def distance_table(room) -> dict:
    """``{(player, boxes): optimal number of moves to solve}`` for every solvable state of the
    room (``DistanceTable``, as a dict of states; built anew on each call)."""
    t = table(room)
    return {t.state(code): d for code, d in t.dist.items()}


def distance(room, state) -> int | None:
    """The optimal number of moves from ``state`` to a solved state; None for a dead lock."""
    return table(room).get(state)


def best_move(room, state) -> str | None:
    """The first action (order up, down, left, right) that lowers the optimal distance by one;
    None when ``state`` is solved or dead-locked."""
    t = table(room)
    d = t.get(state)
    if not d:
        return None
    for act in ACTIONS:
        if t.get(transition(room, state, act)) == d - 1:
            return act
    raise AssertionError(f"no move lowers the distance from {state}")  # the table is exact


def plan(room, state=None):
    """The solver's optimal move list from ``state`` (default: the start); None for a dead
    lock."""
    state = state if state is not None else start_state(room)
    if distance(room, state) is None:
        return None
    out = []
    while (act := best_move(room, state)) is not None:
        out.append(act)
        state = transition(room, state, act)
    return out


def render(room, state) -> str:
    """The room as text, one line per row (legend: module docstring)."""
    player, boxes = state
    targets = set(room["targets"])
    rows = []
    for r in range(room["shape"][0]):
        row = []
        for c in range(room["shape"][1]):
            p = (r, c)
            if p in room["walls"]:
                ch = WALL
            elif p == player:
                ch = PLAYER_ON_TARGET if p in targets else PLAYER
            elif p in boxes:
                ch = BOX_ON_TARGET if p in targets else BOX
            else:
                ch = TARGET if p in targets else FLOOR
            row.append(ch)
        rows.append("".join(row))
    return "\n".join(rows)


def room_text(room) -> str:
    """The room without player and boxes (walls, floor, targets), rows joined by ``/``: the
    identity of the room (split and state keys)."""
    return render(room, ((-1, -1), ())).replace("\n", "/")


def parse_level(text: str) -> dict:
    """A room from its text (the observation's symbols; rows of equal length; blank lines and
    surrounding spaces ignored): ``parse_level("#####\\n#PXO#\\n#####")``. The inverse of
    ``render`` for a room and its start."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines or len({len(line) for line in lines}) != 1:
        raise ValueError(f"a level needs rows of equal length, got {lines!r}")
    walls, targets, boxes, players = set(), [], [], []
    for r, line in enumerate(lines):
        for c, ch in enumerate(line):
            p = (r, c)
            if ch == WALL:
                walls.add(p)
            elif ch in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET):
                targets.append(p)
            elif ch not in (FLOOR, BOX, PLAYER):
                raise ValueError(f"unknown symbol {ch!r} at row {r}, column {c}")
            if ch in (BOX, BOX_ON_TARGET):
                boxes.append(p)
            if ch in (PLAYER, PLAYER_ON_TARGET):
                players.append(p)
    if len(players) != 1 or len(boxes) != len(targets) or not boxes:
        raise ValueError(f"a level needs one player and as many boxes as targets (at least "
                         f"one), got {len(players)} player(s), {len(boxes)} box(es), "
                         f"{len(targets)} target(s)")
    return {"shape": (len(lines), len(lines[0])), "walls": frozenset(walls),
            "targets": tuple(sorted(targets)), "start": players[0], "boxes": tuple(sorted(boxes))}


def carve_floor(rng, size: int, walk_steps: int, turn_prob: float = 0.35) -> set:
    """The floor of a ``size x size`` room (the outer ring stays wall): a random walk over the
    interior that changes direction with probability ``turn_prob`` per step and stamps one of
    ``STAMPS`` at each cell it visits (``rng``: ``random.Random``). Connected: consecutive
    cells of the walk are neighbours or equal, and every stamp covers its cell."""
    lo, hi = 1, size - 2
    r, c = rng.randint(lo, hi), rng.randint(lo, hi)
    dr, dc = rng.choice(tuple(MOVES.values()))
    floor = {(r, c)}
    for _ in range(walk_steps):
        if rng.random() < turn_prob:
            dr, dc = rng.choice(tuple(MOVES.values()))
        r, c = min(max(r + dr, lo), hi), min(max(c + dc, lo), hi)
        for a, b in rng.choice(STAMPS):
            if lo <= r + a <= hi and lo <= c + b <= hi:
                floor.add((r + a, c + b))
    return floor


class Sokoban(Env):
    family = "sokoban"
    default_max_turns = 20
    reports = {"potential": "minus the number of moves the solver still needs from this state "
                            "(0 when solved; -max(max_turns, longest solution + 1) in a dead "
                            "lock)"}

    def __init__(self, size: int = 6, boxes: int = 1, max_turns: int | None = None,
                 min_moves: int = 1, walk_steps: int | None = None,
                 invalid_penalty: float = -0.1, invalid_ends: bool = False,
                 action_names: str = "words", step_penalty: float = 0.0,
                 box_reward: float = 0.0, step_latency_s: float = 0.0):
        super().__init__(max_turns, invalid_penalty, invalid_ends, step_latency_s)
        if size < 4:
            raise ValueError(f"size must be >= 4 (a room of at least 2x2 inside its walls), "
                             f"got {size}")
        if boxes < 1 or 2 * boxes + 1 > (size - 2) ** 2:
            raise ValueError(f"boxes must be in [1, {((size - 2) ** 2 - 1) // 2}] for size "
                             f"{size}, got {boxes}")
        if action_names not in ACTION_NAMES:
            raise ValueError(f"action_names must be one of {ACTION_NAMES}, got {action_names!r}")
        if min_moves < 1:
            raise ValueError(f"min_moves must be >= 1, got {min_moves}")
        if min_moves > max(1, self.max_turns - 2):
            raise ValueError(f"min_moves={min_moves} exceeds max_turns - 2 = "
                             f"{self.max_turns - 2}; raise max_turns")
        self.size, self.boxes, self.min_moves = int(size), int(boxes), int(min_moves)
        self.walk_steps = int(walk_steps) if walk_steps is not None else int(3.4 * size)
        if self.walk_steps < 1:
            raise ValueError(f"walk_steps must be >= 1, got {walk_steps}")
        self.action_names = action_names
        self.step_penalty, self.box_reward = float(step_penalty), float(box_reward)

    def _config(self):
        return dict(super()._config(), size=self.size, boxes=self.boxes,
                    min_moves=self.min_moves, walk_steps=self.walk_steps,
                    action_names=self.action_names, step_penalty=self.step_penalty,
                    box_reward=self.box_reward)

    # --- rooms -----------------------------------------------------------------------------
    def _make_task(self, rng) -> Task:
        n, hi = self.size, max(1, self.max_turns - 2)
        inside = {(r, c) for r in range(n) for c in range(n)}
        for _ in range(1000):
            floor = carve_floor(rng, n, self.walk_steps)
            if len(floor) < 2 * self.boxes + 1:
                continue
            targets = tuple(sorted(rng.sample(sorted(floor), self.boxes)))
            room = {"shape": (n, n), "walls": frozenset(inside - floor), "targets": targets}
            tab = table(room)
            starts = tab.starts(self.min_moves, hi)
            if not starts:
                continue
            player, boxes = tab.state(rng.choice(starts))
            room.update(start=player, boxes=boxes)
            key = render(room, (player, boxes)).replace("\n", "/")
            return Task(self.family, key, split_of(room_text(room)), room)
        raise ValueError(f"no {n}x{n} room with {self.boxes} box(es) and an optimal solution of "
                         f"{self.min_moves} to max_turns - 2 = {hi} moves in 1000 tries; raise "
                         f"max_turns or lower min_moves")

    def horizon_stats(self, num_tasks: int = 500, seed: int = 0) -> dict:
        """Optimal solution lengths (moves to success) of ``num_tasks`` random rooms."""
        lengths = [distance(t.data, start_state(t.data))
                   for t in (self.make_task(seed * 1_000_003 + i) for i in range(num_tasks))]
        return {"mean": sum(lengths) / len(lengths), "min": min(lengths), "max": max(lengths),
                "max_turns": self.max_turns}

    # --- dynamics --------------------------------------------------------------------------
    def _reset(self, task):
        self.room = task.data
        self.state = start_state(self.room)

    def _parse(self, text):
        word = ALIASES.get(text, text)
        return word if word in MOVES else None

    def _apply(self, act):
        before = self.on_target()
        self.state = transition(self.room, self.state, act)
        reward = self.step_penalty + self.box_reward * (self.on_target() - before)
        if solved(self.room, self.state):
            return reward + 1.0, True, {"success": True}
        return reward, False, {}

    def on_target(self) -> int:
        """The number of boxes on targets now."""
        return len(set(self.state[1]) & set(self.room["targets"]))

    def observation(self) -> str:
        return render(self.room, self.state)

    def state_key(self) -> str:
        (r, c), boxes = self.state
        return (f"soko:{room_text(self.room)}|{r},{c}|"
                + ";".join(f"{br},{bc}" for br, bc in boxes))

    def subgoal(self) -> str:
        """The number of boxes on targets, as text (``"0"``, ``"1"``, ...): it changes when a
        push puts a box on a target or takes one off."""
        return str(self.on_target())

    def distance(self) -> int | None:
        """The optimal number of moves from the current state to success (0 when solved);
        None in a dead lock."""
        return distance(self.room, self.state)

    def dead_potential(self) -> float:
        """The potential of a dead-locked state: ``-max(max_turns, D + 1)``, ``D`` the longest
        optimal solution of any solvable state of the room."""
        return -float(max(self.max_turns, table(self.room).longest + 1))

    def report_values(self) -> dict:
        """``{"potential": -distance()}``, or ``dead_potential()`` in a dead lock."""
        d = self.distance()
        return {"potential": self.dead_potential() if d is None else float(-d)}  # 0.0, not -0.0

    def _name(self, act: str) -> str:
        return LETTERS[act] if self.action_names == "letters" else act

    def teacher_context(self) -> str:
        """The solver's whole plan from the current state in the env's action names:
        ``"plan: r r d ..."`` (privileged: the policy sees only the room)."""
        return "plan: " + " ".join(self._name(a) for a in plan(self.room, self.state) or [])

    def random_action(self, rng) -> str:
        return self._name(rng.choice(ACTIONS))

    def solver(self) -> str:
        act = best_move(self.room, self.state)
        return self._name(act or "up")  # solved or dead-locked: any legal move


register("sokoban", Sokoban)
