"""The multi-turn text environment protocol, task sampling, the registry and fault handling.

Pure Python, no JAX. Every environment is deterministic given its task, so ``G`` copies made with
:func:`reset_group` (or ``env.clone()`` then ``reset(task)``) start from the same state.

Protocol (``Env``)::

    obs, info = env.reset(task)           # info["state_key"]: canonical text of the true state
    res = env.step("up")                  # StepResult(observation, reward, done, info)
    env.solver()                          # optimal/scripted action text for the current state
    env.random_action(rng)                # a uniformly random valid action (optional; noisy demos)
    env.sample_tasks(rng, n, split)       # disjoint "train" / "test" task sets
    env.clone()                           # a fresh, un-reset copy with the same configuration
    env.fork()                            # a copy in the same mid-episode state (tree rollouts)
    env.reports                           # {field: one-line description} (class attribute; {})

``info`` keys (all optional except ``state_key``, which every built-in env sets on every step):
``state_key`` (str), ``success`` (bool, on the terminal step), ``invalid_action`` (bool),
``truncated`` (bool: ended by ``max_turns``), ``env_error`` (str, set by :class:`SafeEnv`),
``turn`` (int, turns taken so far), ``subgoal`` (str: the stage the state belongs to, from
``Env.subgoal()``, where the env has stages; the grid world: key, door, goal), and one float
per field named in ``env.reports`` (``info[name]``, from ``Env.report_values()``), in the info
of every state the env returns: from ``reset`` and from every ``step``, the terminal one
included (the grid world: ``potential``). The rollout collector records them with every turn
(``turn_extras``, the state the agent acted in) and once per trajectory (``traj_extras``,
``final_<name>``: the state after the last action); a declared field missing from an info, or
not a finite number, is an environment error of that trajectory
(``jaxrl_agent.rollout.collect``). ``teacher_context`` (str, in the info of ``reset`` only,
from ``Env.teacher_context()``): privileged text about the task that only a teacher sees
(``teacher.context: true``: on-policy self-distillation; the grid world: the solver's plan).
"""

from __future__ import annotations

import abc
import collections
import copy
import dataclasses
import hashlib
import threading
import time
import traceback
from typing import Any, Callable

from jaxrl_agent import registry as _registry

TEST_FRACTION_MOD = 5  # a task is held out ("test") when stable_hash(task_key) % 5 == 0


def stable_hash(text: str) -> int:
    """A process-independent hash (Python's ``hash`` of str is salted per process)."""
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")


def split_of(task_key: str) -> str:
    """``"test"`` for about 1/5 of task keys, ``"train"`` otherwise; a pure function of the key,
    so the two splits are disjoint by construction."""
    return "test" if stable_hash(task_key) % TEST_FRACTION_MOD == 0 else "train"


def check_split(split: str) -> None:
    """ValueError unless ``split`` is ``"train"`` or ``"test"``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


def normalize_action(action: Any) -> str | None:
    """Lower-cased, whitespace-collapsed text, or None when the action is not text."""
    if isinstance(action, bytes):
        try:
            action = action.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(action, str):
        return None
    return " ".join(action.strip().lower().split())


@dataclasses.dataclass(frozen=True)
class Task:
    """One task. ``key`` is its canonical text (identity and split); ``data`` the env-specific
    content (a layout, an expression, a chain)."""

    family: str
    key: str
    split: str
    data: Any = None

    @property
    def id(self) -> str:
        return f"{self.family}:{self.key}"


@dataclasses.dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict = dataclasses.field(default_factory=dict)


class Env(abc.ABC):
    """Base class of the built-in environments.

    Subclasses implement ``_reset(task) -> None``, ``_parse(text) -> parsed | None``,
    ``_apply(parsed) -> (reward, done, info)``, ``observation()``, ``state_key()``,
    ``solver()``, ``_make_task(rng)`` and ``_config()`` (the kwargs for ``clone``).

    The base class owns turn counting, ``max_turns`` truncation and invalid actions: an
    unparsable action consumes a turn, leaves the state unchanged, sets
    ``info["invalid_action"] = True`` and gives ``invalid_penalty`` (default -0.1) as the step
    reward, or ends the episode (reward ``invalid_penalty``, ``success=False``) when
    ``invalid_ends=True``.

    ``step_latency_s > 0`` makes every ``step`` wait that long first (a stand-in for a tool
    call or a remote environment: the rollout benchmarks use it to measure how well the loop
    hides environment latency; ``rollout.env_threads`` steps a turn's envs concurrently).
    """

    family: str = "env"
    default_max_turns: int = 16
    #: the per-turn fields this env reports: name -> one-line description of the float it puts
    #: in ``info[name]`` of every state it returns (module docstring); filled by
    #: ``report_values()``. Subclasses assign their own dict; never mutate this one.
    reports: dict = {}

    def __init__(self, max_turns: int | None = None, invalid_penalty: float = -0.1,
                 invalid_ends: bool = False, step_latency_s: float = 0.0):
        self.max_turns = int(max_turns if max_turns is not None else self.default_max_turns)
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.invalid_penalty = float(invalid_penalty)
        self.invalid_ends = bool(invalid_ends)
        self.step_latency_s = float(step_latency_s)
        if not self.step_latency_s >= 0.0:
            raise ValueError(f"step_latency_s must be >= 0, got {step_latency_s}")
        self.task: Task | None = None
        self.turn = 0
        self.done = True

    # --- to implement -------------------------------------------------------------------
    @abc.abstractmethod
    def _reset(self, task: Task) -> None: ...

    @abc.abstractmethod
    def _parse(self, text: str) -> Any: ...

    @abc.abstractmethod
    def _apply(self, parsed: Any) -> tuple[float, bool, dict]: ...

    @abc.abstractmethod
    def observation(self) -> str: ...

    @abc.abstractmethod
    def state_key(self) -> str: ...

    @abc.abstractmethod
    def solver(self) -> str:
        """The optimal (or scripted) action text for the current state."""

    @abc.abstractmethod
    def _make_task(self, rng) -> Task: ...

    def _config(self) -> dict:
        return dict(max_turns=self.max_turns, invalid_penalty=self.invalid_penalty,
                    invalid_ends=self.invalid_ends, step_latency_s=self.step_latency_s)

    def random_action(self, rng) -> str:
        """A valid action drawn uniformly from the env's action set (``rng``: ``random.Random``).
        Used by the supervised warm-up's noisy demonstrator (``trainer.sft_noise``). Envs
        without a small finite action set need not implement it; the default raises
        ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} has no random_action(); a noisy "
                                  f"demonstrator (trainer.sft_noise > 0) needs one")

    def subgoal(self) -> str | None:
        """The subgoal the current state belongs to (e.g. "get the key"), or None when the
        environment has no subgoal structure. Reported as ``info["subgoal"]``; the rollout
        collector records it with each turn, and the training loop marks a turn where it
        changes as a subgoal boundary for the methods that read one
        (``jaxrl_agent.train.inputs``)."""
        return None

    def teacher_context(self) -> str | None:
        """Privileged text about the task just reset (the solution, a plan, a hint) that the
        policy never sees: reported as ``info["teacher_context"]`` by ``reset``, recorded with
        the trajectory, and placed in the teacher's prompt only with ``teacher.context: true``
        (``jaxrl_agent.train.teacher``). None (the default): the env has none."""
        return None

    def report_values(self) -> dict:
        """``{name: float}`` for every field in ``reports``, of the current state (called for
        every info the env returns: after ``reset`` and after every ``step``, terminal steps
        included). The default reports nothing."""
        return {}

    def _info(self, info: dict) -> dict:
        info["state_key"] = self.state_key()
        info["turn"] = self.turn
        goal = self.subgoal()
        if goal is not None:
            info["subgoal"] = goal
        info.update(self.report_values())
        return info

    # --- protocol -----------------------------------------------------------------------
    def clone(self) -> "Env":
        """A fresh copy with the same configuration (not reset)."""
        return type(self)(**self._config())

    def fork(self) -> "Env":
        """A copy in the current (mid-episode) state: stepping either with the same action gives
        the same result, and stepping one never changes the other. The rollout collector forks
        trajectories with it (tree rollouts, ``RolloutConfig.branch_turns``).

        The default is ``copy.deepcopy`` with the task shared (tasks are immutable by
        contract). Override it in envs that hold resources a deep copy cannot duplicate
        (sockets, processes, server sessions, device handles), or raise
        ``NotImplementedError`` there when the state cannot be forked."""
        return copy.deepcopy(self, {id(self.task): self.task})

    def reset(self, task: Task) -> tuple[str, dict]:
        if not isinstance(task, Task) or task.family != self.family:
            raise ValueError(f"{type(self).__name__} needs a Task of family {self.family!r}, "
                             f"got {task!r}")
        self.task, self.turn, self.done = task, 0, False
        self._reset(task)
        info = self._info({})
        context = self.teacher_context()
        if context is not None:
            info["teacher_context"] = str(context)
        return self.observation(), info

    def step(self, action: Any) -> StepResult:
        if self.task is None:
            raise RuntimeError("call reset(task) before step")
        if self.done:
            raise RuntimeError("the episode is done; call reset(task)")
        if self.step_latency_s:
            time.sleep(self.step_latency_s)
        self.turn += 1
        text = normalize_action(action)
        parsed = None if text is None else self._parse(text)
        if parsed is None:
            reward, done = self.invalid_penalty, self.invalid_ends
            info = {"invalid_action": True}
            if done:
                info["success"] = False
        else:
            reward, done, info = self._apply(parsed)
            info = {"invalid_action": False, **info}
        if not done and self.turn >= self.max_turns:
            done = True
            info["truncated"] = True
            info.setdefault("success", False)
        self.done = done
        return StepResult(self.observation(), float(reward), bool(done), self._info(info))

    def make_task(self, rng) -> Task:
        """One random task of either split (``rng`` as in ``sample_tasks``, which draws
        distinct tasks of one split)."""
        return self._make_task(as_random(rng))

    def sample_tasks(self, rng, n: int, split: str = "train", max_tries: int = 100_000) -> list[Task]:
        """``n`` distinct tasks of ``split`` (``rng``: a ``random.Random``, ``numpy`` Generator
        or an int seed). Deterministic given the rng state."""
        check_split(split)
        rng = as_random(rng)
        out, seen = [], set()
        for _ in range(max_tries):
            t = self._make_task(rng)
            if t.split == split and t.key not in seen:
                seen.add(t.key)
                out.append(t)
                if len(out) == n:
                    return out
        raise ValueError(f"could only find {len(out)} distinct {split!r} tasks of "
                         f"{type(self).__name__} (asked for {n}); widen the configuration")


def as_random(rng):
    """A ``random.Random``: ``rng`` itself, or one seeded from an int or a numpy Generator."""
    import random
    if isinstance(rng, random.Random):
        return rng
    if isinstance(rng, int):
        return random.Random(rng)
    if hasattr(rng, "integers"):  # numpy Generator
        return random.Random(int(rng.integers(0, 2**63 - 1)))
    raise TypeError(f"rng must be an int, random.Random or numpy Generator, got {type(rng).__name__}")


# --- groups and episodes -------------------------------------------------------------------


def reset_group(env, task: Task, group_size: int) -> list[tuple[Any, str, dict]]:
    """``group_size`` independent copies of ``env`` reset to ``task``: ``[(env_i, obs, info)]``.
    The first copy is ``env`` itself."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    envs = [env] + [env.clone() for _ in range(group_size - 1)]
    return [(e, *e.reset(task)) for e in envs]


@dataclasses.dataclass
class Episode:
    task: Task
    observations: list  # observation before each action (len = turns)
    actions: list
    rewards: list
    infos: list  # the StepResult.info of each turn
    state_keys: list  # state_key of the state before each action
    final_observation: str
    success: bool

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    def to_record(self, group=None) -> dict:
        """A text rollout record shaped like ``pack_records``' input (texts still to tokenize)."""
        turns = [{"observation": o, "action": a, "reward": r, "state_key": k}
                 for o, a, r, k in zip(self.observations, self.actions, self.rewards,
                                       self.state_keys)]
        return {"group": group if group is not None else self.task.id, "task": self.task.id,
                "outcome": self.total_reward, "success": self.success, "turns": turns}


def run_episode(env, policy_fn: Callable[[str], str], task: Task,
                max_turns: int | None = None) -> Episode:
    """Runs one episode. ``policy_fn(observation) -> action text``; ``max_turns`` (optional)
    caps the turns below the env's own limit."""
    obs, info = env.reset(task)
    key = info.get("state_key", "")
    limit = env.max_turns if max_turns is None else min(max_turns, env.max_turns)
    observations, actions, rewards, infos, keys = [], [], [], [], []
    success, done = False, bool(info.get("done", False))
    if done:  # a SafeEnv whose reset failed: one step collects the terminal result
        res = env.step("")
        return Episode(task, [obs], [""], [res.reward], [res.info], [key], res.observation, False)
    while not done and len(actions) < limit:
        act = policy_fn(obs)
        res = env.step(act)
        observations.append(obs)
        actions.append(act)
        rewards.append(res.reward)
        infos.append(res.info)
        keys.append(key)
        obs, done, key = res.observation, res.done, res.info.get("state_key", "")
        success = bool(res.info.get("success", False))
    return Episode(task, observations, actions, rewards, infos, keys, obs, success)


def solver_policy(env) -> Callable[[str], str]:
    """A ``policy_fn`` that plays ``env.solver()``."""
    return lambda _obs: env.solver()


# --- registry --------------------------------------------------------------------------------

def register(name: str, factory: Callable[..., Any] | None = None):
    """Registers an environment class or factory under ``name`` (``factory(**env.kwargs)``
    builds it); without ``factory``, a class decorator. The same registry as every other
    method (``jaxrl_agent.registry.register(name, kind="env")``)."""
    return _registry.register(name, factory, kind="env")


def names() -> list[str]:
    return _registry.names("env")


def env_class(name: str) -> Callable[..., Any]:
    """The class or factory registered as ``name``; ValueError listing the names."""
    return _registry.lookup(name, "env").fn


def shortest_plan(start, actions, step: Callable, is_goal: Callable) -> list | None:
    """The shortest action list from ``start`` to a state where ``is_goal`` holds, by
    breadth-first search over ``step(state, action) -> state`` (states hashable; ``actions``
    tried in order, so ties go to the earlier action): ``[]`` when ``start`` is a goal, None
    when no goal is reachable. The built-in envs' solvers (``gridworld.bfs_plan``,
    ``sokoban.bfs_plan``)."""
    if is_goal(start):
        return []
    prev = {start: None}
    q = collections.deque([start])
    while q:
        s = q.popleft()
        for act in actions:
            t = step(s, act)
            if t in prev:
                continue
            prev[t] = (s, act)
            if is_goal(t):
                plan = []
                while prev[t] is not None:
                    t, a = prev[t]
                    plan.append(a)
                return plan[::-1]
            q.append(t)
    return None


class FirstErrors:
    """The first traceback of each kind of exception raised inside an environment (a kind: the
    exception type and the file and line it was raised at), process-wide and thread-safe:
    ``SafeEnv`` turns every exception into a terminal step, and this is where the trainer
    finds the user's traceback to show once (``take_new``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seen: set = set()
        self._new: list = []

    def note(self, exc: BaseException) -> None:
        root = exc  # where it started: the innermost cause (a reward function's own line)
        while root.__cause__ is not None:
            root = root.__cause__
        frames = traceback.extract_tb(root.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        key = (type(root).__name__, where)
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
            # an error whose message says everything (``traceback_helps = False`` on its
            # class: a server command that does not exist) is shown without our frames
            tb = ("".join(traceback.format_exception(exc))
                  if getattr(exc, "traceback_helps", True) else "")
            self._new.append((f"{type(exc).__name__}: {exc}"
                              + (f" (at {where})" if tb else ""), tb))

    def reset(self) -> None:
        """Forgets every kind seen (a new run shows its own first errors again)."""
        with self._lock:
            self._seen.clear()
            self._new = []

    def take_new(self) -> list[tuple[str, str]]:
        """``[(one-line summary, traceback text or "")]`` of the kinds first seen since the
        last call."""
        with self._lock:
            out, self._new = self._new, []
        return out


#: the process's ``FirstErrors`` (every ``SafeEnv`` reports to it)
first_errors = FirstErrors()


class SafeEnv:
    """Wraps an env so that faults end the episode instead of the run.

    - An exception in ``reset``/``step`` becomes a terminal ``StepResult`` with
      ``info["env_error"] = "<Type>: <message>"``, ``success=False`` and reward ``error_reward``.
      (A failing ``reset`` returns ``(error_observation, info)`` with ``info["env_error"]`` and
      ``info["done"] = True``; the next ``step`` returns the terminal result.)
    - A step slower than ``step_timeout`` seconds becomes the same kind of terminal result with
      ``env_error = "timeout: ..."``. Two modes:
        * ``timeout_mode="check"`` (default): no threads, no signals. The step runs to
          completion and its wall time is checked afterwards; a slow step is discarded and the
          episode ends. It cannot interrupt a step that never returns.
        * ``timeout_mode="thread"``: the step runs in a daemon thread joined with the timeout.
          A step that overruns is abandoned: the thread keeps running until the inner call
          returns (it cannot be killed in Python) and the wrapped env is never used again by this
          wrapper (``self.broken``). Use it for envs that may hang (network); the leak is bounded
          by one thread per hung episode.
    - Invalid (unparsable) actions are the inner env's business (``invalid_penalty``,
      ``invalid_ends``); they are counted here in ``stats["invalid"]``.

    - ``fork()`` forks the wrapped env (``Env.fork``) into a new wrapper with the same
      settings. A fork that raises (or times out, or an env without ``fork``) gives a wrapper
      whose ``fork_error`` holds the message and whose next ``step`` returns the terminal error
      result; the original wrapper and env are unaffected.

    ``stats`` counts ``errors``, ``timeouts``, ``invalid`` and ``steps`` over the wrapper's life
    (a fork starts with its own, zero counts).

    Other attributes (``max_turns``, ``solver``, ``family``, ``reports``, ...) are the wrapped
    env's. The error results above carry none of the fields the env ``reports``: they end the
    trajectory with ``env_error``, which is what the rollout collector records instead.
    """

    def __init__(self, env, error_reward: float = 0.0, step_timeout: float | None = None,
                 timeout_mode: str = "check", error_observation: str = "environment error"):
        if timeout_mode not in ("check", "thread"):
            raise ValueError(f"timeout_mode must be 'check' or 'thread', got {timeout_mode!r}")
        self.env = env
        self.error_reward = float(error_reward)
        self.step_timeout = step_timeout
        self.timeout_mode = timeout_mode
        self.error_observation = error_observation
        self.stats = {"errors": 0, "timeouts": 0, "invalid": 0, "steps": 0}
        self.broken = False
        self.fork_error: str | None = None
        self._done = True

    def __getattr__(self, name):  # max_turns, solver, sample_tasks, family, reports, ...
        if name.startswith("__") or name == "env":  # copy/pickle before __init__
            raise AttributeError(name)
        return getattr(self.env, name)

    def clone(self) -> "SafeEnv":
        return SafeEnv(self.env.clone(), self.error_reward, self.step_timeout, self.timeout_mode,
                       self.error_observation)

    def fork(self) -> "SafeEnv":
        """A wrapper with the same settings around ``env.fork()``, in the same episode state;
        on failure one whose ``fork_error`` is set (class docstring)."""
        if self.broken:
            kind, value = "error", "RuntimeError: env abandoned after a timeout"
        elif getattr(self, "_pending", None) is not None or self._done:
            kind, value = "error", "RuntimeError: fork after the episode ended"
        else:
            kind, value = self._call(_fork_env, self.env)
            self.broken = False  # an abandoned slow fork leaves this env usable
        if kind == "ok":
            out = SafeEnv(value, self.error_reward, self.step_timeout, self.timeout_mode,
                          self.error_observation)
            out._done = False
            return out
        out = SafeEnv(self.env, self.error_reward, self.step_timeout, self.timeout_mode,
                      self.error_observation)
        out.broken = True  # never calls the shared env
        out._pending = out._fail(kind, value)
        out.fork_error = value
        return out

    def _call(self, fn, *args):
        """Returns ("ok", value) | ("error", msg) | ("timeout", msg)."""
        t0 = time.monotonic()
        if self.step_timeout is not None and self.timeout_mode == "thread":
            box: dict = {}

            def target():
                try:
                    box["value"] = fn(*args)
                except BaseException as e:  # noqa: BLE001 - reported, not swallowed
                    box["error"] = e

            th = threading.Thread(target=target, daemon=True, name="SafeEnv-step")
            th.start()
            th.join(self.step_timeout)
            if th.is_alive():
                self.broken = True
                return "timeout", f"timeout: step exceeded {self.step_timeout}s (abandoned)"
            if "error" in box:
                e = box["error"]
                first_errors.note(e)
                return "error", f"{type(e).__name__}: {e}"
            return "ok", box["value"]
        try:
            value = fn(*args)
        except Exception as e:  # noqa: BLE001
            first_errors.note(e)
            return "error", f"{type(e).__name__}: {e}"
        dt = time.monotonic() - t0
        if self.step_timeout is not None and dt > self.step_timeout:
            return "timeout", f"timeout: step took {dt:.3f}s > {self.step_timeout}s"
        return "ok", value

    def _fail(self, kind: str, msg: str) -> StepResult:
        self.stats["timeouts" if kind == "timeout" else "errors"] += 1
        self._done = True
        return StepResult(self.error_observation, self.error_reward, True,
                          {"env_error": msg, "success": False, "state_key": "env_error"})

    def reset(self, task):
        self._pending = None
        if self.broken:
            self._pending = self._fail("error", "RuntimeError: env abandoned after a timeout")
            return self.error_observation, {**self._pending.info, "done": True}
        kind, value = self._call(self.env.reset, task)
        if kind != "ok":
            self._pending = self._fail(kind, value)
            return self.error_observation, {**self._pending.info, "done": True}
        self._done = False
        return value

    def step(self, action) -> StepResult:
        if getattr(self, "_pending", None) is not None:
            res, self._pending = self._pending, None
            return res
        if self._done:
            return self._fail("error", "RuntimeError: step after the episode ended")
        self.stats["steps"] += 1
        kind, value = self._call(self.env.step, action)
        if kind != "ok":
            return self._fail(kind, value)
        if value.info.get("invalid_action"):
            self.stats["invalid"] += 1
        self._done = value.done
        return value


def _fork_env(env):
    fork = getattr(env, "fork", None)
    if fork is None:
        raise TypeError(f"{type(env).__name__} has no fork(); tree rollouts need Env.fork")
    return fork()
