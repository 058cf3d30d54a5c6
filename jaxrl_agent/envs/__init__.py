"""Multi-turn text environments: the protocol, built-in envs, fault handling and adapters.

See docs/envs.md. ``make_env(name, **kwargs)`` builds ``gridworld``, ``calculator`` or ``chain``.
"""

from jaxrl_agent.envs.base import (Env, Episode, SafeEnv, StepResult, Task, env_class, make_env, names,
                                   normalize_action, register, reset_group, run_episode,
                                   solver_policy, split_of, stable_hash)
from jaxrl_agent.envs.gridworld import GridWorld
from jaxrl_agent.envs.calculator import Calculator, ParseError, evaluate
from jaxrl_agent.envs.chain import Chain
from jaxrl_agent.envs.adapters import GymnasiumTextAdapter, HTTPEnv

__all__ = ["Env", "Episode", "SafeEnv", "StepResult", "Task", "env_class", "make_env", "names",
           "normalize_action", "register", "reset_group", "run_episode", "solver_policy",
           "split_of", "stable_hash", "GridWorld", "Calculator", "ParseError", "evaluate",
           "Chain", "GymnasiumTextAdapter", "HTTPEnv"]
