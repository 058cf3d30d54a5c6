"""Multi-turn text environments: the protocol, built-in envs, fault handling and adapters.

See docs/envs.md. ``make_env(name, **kwargs)`` builds a registered environment (``gridworld``,
``sokoban``, ``calculator``, ``chain``, ``tasks``, ``reasoning_gym``, ``mcp``, plug-ins) or one
of the name forms ``gymnasium:<id>``, ``http:<base_url>``, ``mcp:<server command>``, ``reasoning_gym:<dataset>``
(``resolve_env``).
"""

from jaxrl_agent.envs.base import (Env, Episode, FirstErrors, SafeEnv, StepResult, Task,
                                   env_class, first_errors, names, normalize_action, register,
                                   reset_group, run_episode, solver_policy, split_of,
                                   stable_hash)
from jaxrl_agent.envs.gridworld import GridWorld
from jaxrl_agent.envs.sokoban import Sokoban
from jaxrl_agent.envs.calculator import Calculator, ParseError, evaluate
from jaxrl_agent.envs.chain import Chain
from jaxrl_agent.envs.adapters import GymnasiumTextAdapter, HTTPEnv
from jaxrl_agent.envs.resolve import ENV_NAME_FORMS, gymnasium_env, make_env, resolve_env
from jaxrl_agent.envs.tasks import (ConversationEnv, ReasoningGymEnv, RewardError, TaskEnv,
                                    TaskFileError, answer_reward, load_reward, load_tasks,
                                    make_tasks, run_reward)
from jaxrl_agent.envs.tools import (FunctionTool, Tool, ToolCall, ToolCallError, ToolEnv,
                                    ToolEnvironmentError, ToolError, check_arguments,
                                    format_tool_calls, parse_tool_calls, tool_schema)
from jaxrl_agent.envs.mcp import MCPEnv, MCPServerError, close_idle_servers

__all__ = ["Env", "Episode", "FirstErrors", "SafeEnv", "first_errors", "StepResult", "Task", "env_class", "make_env", "names",
           "normalize_action", "register", "reset_group", "run_episode", "solver_policy",
           "split_of", "stable_hash", "GridWorld", "Sokoban", "Calculator", "ParseError", "evaluate",
           "Chain", "GymnasiumTextAdapter", "HTTPEnv", "ENV_NAME_FORMS", "gymnasium_env",
           "resolve_env", "ConversationEnv", "ReasoningGymEnv", "RewardError", "TaskEnv",
           "TaskFileError", "answer_reward", "load_reward", "load_tasks", "make_tasks", "run_reward", "FunctionTool", "Tool", "ToolCall",
           "ToolCallError", "ToolEnv", "ToolEnvironmentError", "ToolError", "check_arguments",
           "format_tool_calls", "parse_tool_calls", "tool_schema", "MCPEnv", "MCPServerError",
           "close_idle_servers"]
