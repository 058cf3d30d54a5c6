"""Adapters that bring external environments into the ``Env`` protocol.

- :class:`GymnasiumTextAdapter` wraps any object with the gymnasium API over strings
  (``reset(seed=...) -> (obs, info)``, ``step(action) -> (obs, reward, terminated, truncated,
  info)``). Duck-typed: gymnasium is not imported.
- :class:`HTTPEnv` talks to an environment server over a tiny JSON protocol (stdlib ``urllib``)::

      POST <base_url>/reset   {"task": <task.data>}
                          ->  {"observation": str, "info": {...}, "session": str (optional)}
      POST <base_url>/step    {"session": str|null, "action": str}
                          ->  {"observation": str, "reward": float, "done": bool, "info": {...}}

  ``info`` may carry ``state_key``, ``success`` and ``invalid_action`` like the built-in envs.
  Network errors and timeouts raise; wrap the env in :class:`~jaxrl_agent.envs.base.SafeEnv` to
  turn them into failed trajectories.

For both, tasks are seeds: ``sample_tasks(rng, n, split)`` returns ``Task(family, str(seed),
split, {"seed": seed})`` with the same hash-based disjoint split as the built-in envs. When the
external env gives no ``state_key`` the observation text is used (right for fully observed
envs). ``success`` defaults to ``terminated and reward > 0``. ``solver()`` calls the ``solver``
callable given to the constructor (``solver(observation) -> action``) or raises
NotImplementedError.
"""

from __future__ import annotations

import json
import urllib.request

from jaxrl_agent.envs.base import StepResult, Task, as_random, check_split, split_of


class _SeedTasks:
    family = "external"
    seed_range = 10**6

    def sample_tasks(self, rng, n: int, split: str = "train") -> list[Task]:
        check_split(split)
        rng = as_random(rng)
        out, seen = [], set()
        while len(out) < n:
            seed = rng.randrange(self.seed_range)
            key = str(seed)
            if split_of(f"{self.family}:{key}") == split and key not in seen:
                seen.add(key)
                out.append(Task(self.family, key, split, {"seed": seed}))
        return out

    def _finish(self, obs, reward, done, info, terminated=None) -> StepResult:
        self.turn += 1
        info = dict(info or {})
        info.setdefault("state_key", str(obs))
        info["turn"] = self.turn
        if not done and self.turn >= self.max_turns:
            done = True
            info["truncated"] = True
        if done:
            term = done if terminated is None else terminated
            info.setdefault("success", bool(term and reward > 0))
        self.last_obs = str(obs)
        return StepResult(str(obs), float(reward), bool(done), info)

    def solver(self) -> str:
        if self._solver is None:
            raise NotImplementedError(f"{type(self).__name__} was built without a solver")
        return self._solver(self.last_obs)


class GymnasiumTextAdapter(_SeedTasks):
    """``GymnasiumTextAdapter(make_env_fn, max_turns=32, family="gym")``.

    ``env`` is a gymnasium-style env over strings or a zero-argument factory of one; ``clone()``
    needs the factory (an instance cannot be copied safely).
    """

    def __init__(self, env, max_turns: int = 32, family: str = "gym", solver=None):
        is_factory = isinstance(env, type) or (callable(env) and not hasattr(env, "step"))
        self._factory = env if is_factory else None
        self.env = self._factory() if self._factory is not None else env
        self.max_turns, self.family, self._solver = int(max_turns), family, solver
        self.turn, self.last_obs = 0, ""

    def clone(self):
        if self._factory is None:
            raise TypeError("clone() needs GymnasiumTextAdapter(factory), not an env instance")
        return GymnasiumTextAdapter(self._factory, self.max_turns, self.family, self._solver)

    def reset(self, task: Task):
        seed = task.data.get("seed") if isinstance(task.data, dict) else None
        obs, info = self.env.reset(seed=seed)
        self.turn, self.last_obs = 0, str(obs)
        info = dict(info or {})
        info.setdefault("state_key", str(obs))
        info["turn"] = 0
        return str(obs), info

    def step(self, action) -> StepResult:
        obs, reward, terminated, truncated, info = self.env.step(action)
        res = self._finish(obs, reward, bool(terminated or truncated), info, bool(terminated))
        if truncated and not terminated:
            res.info["truncated"] = True
        return res


class HTTPEnv(_SeedTasks):
    """``HTTPEnv("http://127.0.0.1:8000", timeout=10.0)``: the JSON protocol in the module doc."""

    def __init__(self, base_url: str, timeout: float = 10.0, max_turns: int = 32,
                 family: str = "http", solver=None):
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.max_turns, self.family, self._solver = int(max_turns), family, solver
        self.session, self.turn, self.last_obs = None, 0, ""

    def clone(self):
        return HTTPEnv(self.base_url, self.timeout, self.max_turns, self.family, self._solver)

    def _post(self, path: str, payload: dict) -> dict:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            out = json.loads(resp.read().decode("utf-8"))
        if not isinstance(out, dict) or "observation" not in out:
            raise ValueError(f"bad reply from {path}: {out!r:.200}")
        return out

    def reset(self, task: Task):
        out = self._post("/reset", {"task": task.data})
        self.session, self.turn = out.get("session"), 0
        self.last_obs = str(out["observation"])
        info = dict(out.get("info") or {})
        info.setdefault("state_key", self.last_obs)
        info["turn"] = 0
        return self.last_obs, info

    def step(self, action) -> StepResult:
        out = self._post("/step", {"session": self.session, "action": str(action)})
        return self._finish(out["observation"], out.get("reward", 0.0), bool(out.get("done")),
                            out.get("info"))
