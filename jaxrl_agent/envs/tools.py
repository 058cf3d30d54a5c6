"""Tool calls for chat agents: the parser, the ``Tool`` protocol, argument checks and ``ToolEnv``.

Pure Python, no JAX.

**Tool-call formats** read by :func:`parse_tool_calls` (a message may hold several calls):

- Hermes / Qwen tags, any text around them::

      Let me compute it.
      <tool_call>
      {"name": "calculate", "arguments": {"expression": "12*7"}}
      </tool_call>

- a plain JSON function call (or a JSON list of them) as the whole message, optionally in one
  Markdown code fence: ``{"name": "calculate", "arguments": {...}}``. ``"parameters"`` is read
  as ``"arguments"`` (Llama 3's spelling), and the OpenAI wrapper ``{"type": "function",
  "function": {...}}`` is unwrapped.

``arguments`` may be a JSON object or a string holding one (some models emit the string form);
missing or ``null`` arguments mean ``{}``. A message without tool-call tags whose text is not a
JSON object or list naming a ``"name"`` holds no calls: it is the agent's final answer.
Anything that starts to be a call and is not a valid one (an unclosed or nested tag, a stray
``</tool_call>``, broken JSON, a missing or non-string name, arguments that are not an object)
raises :class:`ToolCallError` (a ``ValueError``) with a message that says what is wrong; the
parser raises nothing else.

**Tools.** A :class:`Tool` has a ``name``, a ``description``, ``parameters`` (a JSON schema of
its arguments object) and ``__call__(**arguments) -> str``. :func:`tool_schema` renders one in
the OpenAI function format ``{"type": "function", "function": {"name", "description",
"parameters"}}``, the form chat templates take as ``tools=``. :class:`FunctionTool` wraps a
Python function (schema given, or derived from its annotations). :func:`check_arguments`
checks arguments against a schema: required keys, JSON types (``string``, ``integer``,
``number``, ``boolean``, ``array``, ``object``, ``null``, and lists of them), ``enum``,
``additionalProperties: false``, nested ``properties``/``items``, and ``anyOf``/``oneOf``
(valid when one branch is); other keywords are not checked.

**ToolEnv** (an :class:`~jaxrl_agent.envs.base.Env`): each action text is parsed; calls are
checked and run, and their results come back as the next observation with
``info["observation_role"] = "tool"``; a message without calls is the final answer, scored by
``score(messages)`` under the package's one reward contract (that of
:mod:`jaxrl_agent.envs.tasks`: the conversation in, a number or a ``{reward, observation,
done, success, info}`` dict out). The env keeps the conversation (``env.messages``). Details
in the class docstring. (:func:`final_answer_text`, the answer without reasoning, is defined
in :mod:`jaxrl_agent.envs.tasks` and re-exported here.)
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import inspect
import json
import re
import typing
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from jaxrl_agent.envs.base import Env, StepResult, Task, stable_hash
from jaxrl_agent.envs.tasks import end_of_turn, final_answer_text, run_reward

__all__ = ["ToolCall", "ToolCallError", "ToolError", "ToolEnvironmentError", "Tool",
           "FunctionTool", "ToolEnv", "parse_tool_calls", "format_tool_calls", "tool_schema",
           "check_arguments", "final_answer_text"]

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


class ToolCallError(ValueError):
    """A malformed tool call (the message says what is wrong and where)."""


class ToolError(Exception):
    """Raised by a tool for a failure the agent should read (a bad expression, a missing key):
    the env returns ``"error: <message>"`` as that call's result and sets
    ``info["tool_error"]``; the episode goes on."""


class ToolEnvironmentError(RuntimeError):
    """The tool environment itself failed (a tool server crashed, hung or could not start).
    Raised from ``ToolEnv.call_tool``, it ends the episode with ``info["env_error"]``."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments`` object."""

    name: str
    arguments: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}

    def to_text(self) -> str:
        """The call in the Hermes / Qwen format (what :func:`parse_tool_calls` reads back)."""
        return format_tool_calls([self])


def format_tool_calls(calls: Sequence[ToolCall | dict]) -> str:
    """``<tool_call>\\n{json}\\n</tool_call>`` blocks, one per call, joined by newlines; the
    layout Qwen's chat template renders assistant tool calls in."""
    out = []
    for c in calls:
        c = c if isinstance(c, ToolCall) else ToolCall(c["name"], dict(c.get("arguments") or {}))
        out.append(f"{OPEN_TAG}\n{json.dumps(c.to_dict(), ensure_ascii=False)}\n{CLOSE_TAG}")
    return "\n".join(out)


# --- parsing -----------------------------------------------------------------------------------

_FENCE = re.compile(r"^```[A-Za-z0-9_-]*[ \t]*\n(.*)\n[ \t]*```$", re.S)


def parse_tool_calls(text: Any) -> list[ToolCall]:
    """The tool calls in a message, in order; ``[]`` when it holds none (a final answer).

    Formats: the module docstring. Raises :class:`ToolCallError` (and nothing else) for a
    malformed call, and for a message that is not text (``str``, or UTF-8 ``bytes``).
    """
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ToolCallError(f"the message is not valid UTF-8 ({e.reason} at byte "
                                f"{e.start})") from None
    if not isinstance(text, str):
        raise ToolCallError(f"a message must be text, got {type(text).__name__}")
    if OPEN_TAG in text or CLOSE_TAG in text:
        calls = []
        for i, block in enumerate(_tagged_blocks(text)):
            where = f"tool call {i + 1}"
            if not block:
                raise ToolCallError(f"{where}: empty {OPEN_TAG} block")
            value = _load_json(_unfence(block), where)
            items = value if isinstance(value, list) else [value]
            if not items:
                raise ToolCallError(f"{where}: an empty JSON list")
            calls.extend(_call_from_value(v, where) for v in items)
        return calls
    body = _unfence(text.strip())
    if not body.startswith(("{", "[")):
        return []
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:
        if '"name"' in body:  # meant as a JSON call, but broken (truncated, most often)
            raise ToolCallError(f"the message looks like a JSON tool call but is not valid "
                                f"JSON: {_json_problem(e)}") from None
        return []
    if isinstance(value, dict):
        return [_call_from_value(value, "the tool call")] if _looks_like_call(value) else []
    if isinstance(value, list) and any(isinstance(v, dict) and _looks_like_call(v)
                                       for v in value):
        return [_call_from_value(v, f"tool call {i + 1}") for i, v in enumerate(value)]
    return []


def _tagged_blocks(text: str) -> list[str]:
    """The stripped contents of the ``<tool_call>...</tool_call>`` blocks; ToolCallError for an
    unclosed, nested or stray tag."""
    blocks, pos = [], 0
    while True:
        start, close = text.find(OPEN_TAG, pos), text.find(CLOSE_TAG, pos)
        if start < 0 or 0 <= close < start:
            if close >= 0:
                raise ToolCallError(f"{CLOSE_TAG} at character {close} closes no {OPEN_TAG}")
            return blocks
        end = text.find(CLOSE_TAG, start + len(OPEN_TAG))
        if end < 0:
            raise ToolCallError(f"{OPEN_TAG} at character {start} is never closed by "
                                f"{CLOSE_TAG} (truncated output?)")
        inner = text[start + len(OPEN_TAG):end]
        if OPEN_TAG in inner:
            raise ToolCallError(f"{OPEN_TAG} at character {start} holds another {OPEN_TAG} "
                                f"before its {CLOSE_TAG} (nested tags)")
        blocks.append(inner.strip())
        pos = end + len(CLOSE_TAG)


def _unfence(text: str) -> str:
    m = _FENCE.match(text)
    return m.group(1).strip() if m else text


def _json_problem(e: BaseException) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} (character {e.pos})"
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return str(e)


def _load_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ToolCallError(f"{where}: not valid JSON: {_json_problem(e)}") from None


def _looks_like_call(value: dict) -> bool:
    return "name" in value or isinstance(value.get("function"), dict)


def _call_from_value(value: Any, where: str) -> ToolCall:
    if not isinstance(value, dict):
        raise ToolCallError(f'{where}: must be a JSON object with "name" and "arguments", got '
                            f"a {_json_type(value)}")
    if "name" not in value and isinstance(value.get("function"), dict):  # OpenAI wrapper
        value = value["function"]
    name = value.get("name")
    if name is None:
        raise ToolCallError(f'{where}: no "name"')
    if not isinstance(name, str) or not name.strip():
        raise ToolCallError(f'{where}: "name" must be a non-empty string, got '
                            f"{json.dumps(name, ensure_ascii=False)[:40]}")
    key = "arguments" if "arguments" in value else "parameters"
    args = value.get(key)
    if isinstance(args, str):  # arguments serialised as a JSON string
        args = _load_json(args, f"{where} ({name}): arguments string") if args.strip() else {}
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ToolCallError(f'{where} ({name}): "{key}" must be a JSON object, got a '
                            f"{_json_type(args)}")
    return ToolCall(name.strip(), args)


#: Python type -> JSON Schema type name, most specific first (a bool is an int in Python).
_JSON_TYPES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"),
               (str, "string"), (list, "array"), (dict, "object"))


def _json_type(value: Any) -> str:
    return next((name for t, name in _JSON_TYPES if isinstance(value, t)), type(value).__name__)


# --- tools and schemas -------------------------------------------------------------------------


@runtime_checkable
class Tool(Protocol):
    """A tool: ``name``, ``description``, ``parameters`` (JSON schema of the arguments object)
    and ``__call__(**arguments) -> str``. Raise :class:`ToolError` for a failure the agent
    should read."""

    name: str
    description: str
    parameters: dict

    def __call__(self, **arguments: Any) -> str: ...


def tool_schema(tool: Any) -> dict:
    """The tool in the OpenAI function format ``{"type": "function", "function": {"name",
    "description", "parameters"}}``. Takes a :class:`Tool`, a schema already in that format,
    or a flat ``{"name", "description", "parameters"}`` dict (MCP's ``inputSchema`` is read as
    ``parameters``). ValueError naming the problem otherwise."""
    if isinstance(tool, dict):
        spec = tool.get("function") if tool.get("type") == "function" else tool
        if not isinstance(spec, dict):
            raise ValueError(f"a tool schema needs a 'function' object, got {tool!r:.120}")
        name, desc = spec.get("name"), spec.get("description") or ""
        params = spec.get("parameters", spec.get("inputSchema", spec.get("input_schema")))
    else:
        name = getattr(tool, "name", None)
        desc, params = getattr(tool, "description", "") or "", getattr(tool, "parameters", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool needs a non-empty string name, got {name!r}")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ValueError(f"tool {name!r}: parameters must be a JSON schema object, got "
                         f"{type(params).__name__}")
    return {"type": "function",
            "function": {"name": name, "description": str(desc), "parameters": params}}


_PY_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
             dict: "object", type(None): "null"}


def _annotation_schema(ann: Any) -> dict:
    origin = typing.get_origin(ann)
    if ann in _PY_TYPES:
        return {"type": _PY_TYPES[ann]}
    if origin in (list, tuple, Sequence):
        return {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    if origin is typing.Union or type(ann).__name__ == "UnionType":
        parts = [_annotation_schema(a) for a in typing.get_args(ann)]
        types = [p["type"] for p in parts if "type" in p]
        return {"type": types} if len(types) == len(parts) else {}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(ann))}
    return {}


class FunctionTool:
    """A :class:`Tool` around a Python function ``fn(**arguments)``.

    ``name`` defaults to the function's name, ``description`` to the first paragraph of its
    docstring, ``parameters`` to a schema derived from its signature (annotated ``str``,
    ``int``, ``float``, ``bool``, ``list``, ``dict``, unions and ``Literal``; parameters
    without a default are required, ``additionalProperties: false``). The result is
    ``str(fn(...))``.
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None,
                 description: str | None = None, parameters: dict | None = None):
        if not callable(fn):
            raise TypeError(f"FunctionTool needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", None) or "tool"
        doc = inspect.getdoc(fn) or ""
        self.description = description if description is not None else doc.split("\n\n")[0]
        self.parameters = parameters if parameters is not None else self._derive(fn)
        tool_schema(self)  # validates the name and the parameters

    @staticmethod
    def _derive(fn) -> dict:
        props, required = {}, []
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # noqa: BLE001 - unresolvable annotations: untyped parameters
            hints = {}
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            props[p.name] = _annotation_schema(hints.get(p.name, Any))
            if p.default is p.empty:
                required.append(p.name)
        return {"type": "object", "properties": props, "required": required,
                "additionalProperties": False}

    def __call__(self, **arguments: Any) -> str:
        return str(self.fn(**arguments))

    def __repr__(self) -> str:
        return f"FunctionTool({self.name!r})"


def check_arguments(parameters: dict, arguments: Any, *, tool: str = "tool") -> None:
    """ToolCallError naming the first argument that does not fit ``parameters`` (the checks
    listed in the module docstring); None when the arguments fit."""
    problem = _check(arguments, parameters or {}, "arguments")
    if problem:
        raise ToolCallError(f"{tool}: {problem}")


def _type_ok(value: Any, t: str) -> bool:
    if t == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            (isinstance(value, float) and value.is_integer())
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    py = {"string": str, "boolean": bool, "array": list, "object": dict,
          "null": type(None)}.get(t)
    return True if py is None else isinstance(value, py)


def _check(value: Any, schema: Any, path: str) -> str | None:
    if not isinstance(schema, dict):
        return None
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches and \
                all(_check(value, b, path) for b in branches):
            return f"{path} matches none of the allowed forms"
    types = schema.get("type")
    if isinstance(types, str):
        types = [types]
    if isinstance(types, list) and types and not any(_type_ok(value, t) for t in types):
        want = " or ".join(str(t) for t in types)
        return f"{path} must be {want}, got {_json_type(value)}"
    if isinstance(schema.get("enum"), list) and value not in schema["enum"]:
        return f"{path} must be one of {json.dumps(schema['enum'], ensure_ascii=False)[:80]}"
    if isinstance(value, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        for key in schema.get("required") or ():
            if key not in value:
                return f"missing required argument {key!r}" if path == "arguments" \
                    else f"{path} needs {key!r}"
        if schema.get("additionalProperties") is False:
            extra = sorted(k for k in value if k not in props)
            if extra:
                return f"unknown argument {extra[0]!r}" if path == "arguments" \
                    else f"{path} has unknown key {extra[0]!r}"
        for key, sub in props.items():
            if key in value:
                where = key if path == "arguments" else f"{path}.{key}"
                problem = _check(value[key], sub, where)
                if problem:
                    return problem
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problem = _check(item, schema["items"], f"{path}[{i}]")
            if problem:
                return problem
    return None


# --- the environment ---------------------------------------------------------------------------


class ToolEnv(Env):
    """An :class:`~jaxrl_agent.envs.base.Env` whose actions are chat messages with tool calls.

    Each ``step(message)`` adds the message to the conversation (``env.messages``) as an
    ``assistant`` message, then:

    - parses it (:func:`parse_tool_calls`). A malformed call, more than
      ``max_calls_per_turn`` calls, an unknown tool or arguments that do not fit the tool's
      schema (:func:`check_arguments`) make the turn an **invalid action**: nothing runs,
      ``info["invalid_action"] = True``, the observation is ``"error: <what is wrong>"`` (in the
      ``"user"`` role: no call ran, so no tool answers), the reward ``invalid_penalty`` (the
      episode ends when ``invalid_ends``). The action text is never lower-cased or otherwise
      normalised (JSON arguments are case-sensitive).
    - runs valid calls in order (:meth:`call_tool`). The observation holds their results
      (``"<name>: <result>"`` lines when there are several), each cut to
      ``max_result_chars``; ``info["observation_role"] = "tool"``, ``info["tool_name"]`` (the
      last call's tool), ``info["observation_messages"]`` (one ``{"role": "tool", "name",
      "content"}`` message per call: the chat collector renders each result as its own
      message), ``info["tool_calls"]`` (the calls as dicts). A tool that raises gives
      ``"error: <Type>: <message>"`` as its result (``info["tool_error"] = True``); the turn
      stays valid. A :class:`ToolEnvironmentError` ends the episode: ``info["env_error"]``,
      ``success=False``, reward 0.
    - a message without calls is the **final answer**: ``score(messages)`` gets a copy of the
      conversation (the final answer last) and returns what a reward function returns under
      the reward contract of :mod:`jaxrl_agent.envs.tasks` (read by
      :func:`~jaxrl_agent.envs.tasks.run_reward`): a number (``bool``: 0/1) ends the episode
      with that reward, ``success`` when it is > 0; a dict ``{reward, observation, done,
      success, info}`` sets them, its ``info`` merged into the step's. A dict with an
      ``observation`` and no ``done: true`` continues the episode: the observation is the next
      ``user`` message (a hint, say), and the agent may call tools again before its next final
      answer, which is scored again (a task's outcome is the sum of its rewards). An exception
      raised by ``score``, or a result outside the contract, is raised as
      :class:`~jaxrl_agent.envs.tasks.RewardError` (``SafeEnv`` turns it into a failed
      trajectory). Tool-call turns pay 0; the final answer's observation is ``"done"`` unless
      the dict gives one.
    - calls beyond ``max_calls`` in an episode end it (``info["call_limit"] = True``,
      ``success=False``, reward ``invalid_penalty``); ``max_turns`` truncates as in ``Env``.

    ``reset(task)`` returns ``prompt()`` with ``info["observation_role"] = "user"``.
    ``env.tools`` lists the tools' schemas (:func:`tool_schema` format) for the chat template;
    ``env.system_prompt`` is the system message (None: none).

    ``env.messages``, the conversation: the system message (when ``system_prompt`` is set), the
    ``user`` prompt, then each turn's ``assistant`` message (the action text as sent:
    reasoning and tool-call tags included; bytes decoded, anything else ``str()``) followed,
    while the episode goes on, by what the agent is shown next: the turn's tool messages, or
    one ``user`` message (an error, or the reward function's observation). These are the
    messages a chat collector renders.

    State: the task, the valid calls with their results, and the final answers that the reward
    function answered with an observation; ``state_key`` is ``"<family>:<task key>|<number of
    calls>:<hash of the calls, results and answered answers>"`` (an invalid action leaves it
    unchanged).

    Subclasses implement ``_make_task(rng)``, ``prompt()``, ``score(messages)`` and
    ``solver()``, and ``_reset(task)`` where they hold per-episode state; they give their
    tools to ``__init__`` or override :meth:`tool_schemas` and :meth:`call_tool` (a remote
    tool server does). ``self._score_name`` names ``score`` in errors.
    """

    family = "tools"
    default_max_turns = 8

    def __init__(self, tools: Sequence[Tool] = (), *, system_prompt: str | None = None,
                 max_calls_per_turn: int = 8, max_calls: int = 32, max_result_chars: int = 1000,
                 max_turns: int | None = None, invalid_penalty: float = -0.1,
                 invalid_ends: bool = False, step_latency_s: float = 0.0):
        super().__init__(max_turns, invalid_penalty, invalid_ends, step_latency_s)
        for key, v in (("max_calls_per_turn", max_calls_per_turn), ("max_calls", max_calls),
                       ("max_result_chars", max_result_chars)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{key} must be an int >= 1, got {v!r}")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt must be a string or None, got "
                             f"{type(system_prompt).__name__}")
        self._toolbox: dict[str, Tool] = {}
        for t in tools:
            name = tool_schema(t)["function"]["name"]
            if name in self._toolbox:
                raise ValueError(f"two tools are named {name!r}")
            self._toolbox[name] = t
        self.system_prompt = system_prompt
        self.max_calls_per_turn, self.max_calls = max_calls_per_turn, max_calls
        self.max_result_chars = max_result_chars
        self.calls: list[tuple[ToolCall, str]] = []
        self.answers: list[tuple[int, str, str]] = []  # (calls before it, answer, observation)
        self.messages: list[dict] = []
        self.last_observation = ""
        self._score_name = f"{type(self).__name__}.score"

    def _config(self) -> dict:
        return dict(super()._config(), tools=tuple(self._toolbox.values()),
                    system_prompt=self.system_prompt, max_calls_per_turn=self.max_calls_per_turn,
                    max_calls=self.max_calls, max_result_chars=self.max_result_chars)

    # --- to implement / override -----------------------------------------------------------
    @abc.abstractmethod
    def prompt(self) -> str:
        """The first observation of the current task (``self.task``)."""

    @abc.abstractmethod
    def score(self, messages: list[dict]) -> Any:
        """The reward of the final answer ``messages[-1]["content"]`` to the current task,
        under the reward contract (class docstring): a number or a ``{reward, observation,
        done, success, info}`` dict. ``messages`` is a copy of the conversation."""

    def _reset(self, task: Task) -> None:  # noqa: B027 - optional hook
        """Per-episode set-up (called by ``reset`` after the base state is reset)."""

    def tool_schemas(self) -> list[dict]:
        """The tools' schemas (:func:`tool_schema` format), in a fixed order."""
        return [tool_schema(t) for t in self._toolbox.values()]

    def call_tool(self, call: ToolCall) -> str:
        """Runs one checked call and returns its result text. Raise :class:`ToolError` (or any
        exception) for a failed call the agent should read, :class:`ToolEnvironmentError` when
        the tools themselves are gone."""
        return str(self._toolbox[call.name](**call.arguments))

    # --- protocol ---------------------------------------------------------------------------
    @property
    def tools(self) -> list[dict]:
        return self.tool_schemas()

    def reset(self, task: Task) -> tuple[str, dict]:
        self.calls, self.answers, self.last_observation = [], [], ""
        obs, info = super().reset(task)
        head = [] if self.system_prompt is None else \
            [{"role": "system", "content": self.system_prompt}]
        self.messages = head + [{"role": "user", "content": obs}]
        info["observation_role"] = "user"
        return obs, info

    def observation(self) -> str:
        return self.last_observation if self.turn else self.prompt()

    def state_key(self) -> str:
        trace: list = [[c.name, c.arguments, r] for c, r in self.calls]
        if self.answers:
            trace.append(["answers", [list(a) for a in self.answers]])
        text = json.dumps(trace, sort_keys=True, ensure_ascii=False, default=str)
        return f"{self.family}:{self.task.key}|{len(self.calls)}:{stable_hash(text):016x}"

    def _parse(self, text: str) -> Any:  # ToolEnv.step parses (raw, not normalised) text
        return parse_tool_calls(text)

    def _apply(self, parsed: Any) -> tuple[float, bool, dict]:
        raise NotImplementedError("ToolEnv.step runs the calls itself")

    def step(self, action: Any) -> StepResult:
        if self.task is None:
            raise RuntimeError("call reset(task) before step")
        if self.done:
            raise RuntimeError("the episode is done; call reset(task)")
        self.turn += 1
        self.messages.append({"role": "assistant", "content": _message_text(action)})
        reward, done, obs, success, shown = 0.0, False, "", None, None
        info: dict = {"invalid_action": False, "observation_role": "tool"}
        try:
            calls = self._parse(action)
            names = self.tool_schemas_by_name()
            if len(calls) > self.max_calls_per_turn:
                raise ToolCallError(f"{len(calls)} calls in one message (at most "
                                    f"{self.max_calls_per_turn})")
            for c in calls:
                if c.name not in names:
                    raise ToolCallError(f"unknown tool {c.name!r} (tools: "
                                        f"{', '.join(sorted(names)) or 'none'})")
                check_arguments(names[c.name]["function"]["parameters"], c.arguments,
                                tool=c.name)
        except ToolCallError as e:
            reward, done, obs = self.invalid_penalty, self.invalid_ends, f"error: {e}"
            info.update(invalid_action=True, observation_role="user")
            if done:
                success = False
        else:
            if not calls:
                reward, done, obs, success = self._final_answer(info)
            elif len(self.calls) + len(calls) > self.max_calls:
                reward, done, obs, success = self.invalid_penalty, True, \
                    f"error: tool call limit ({self.max_calls} per episode) reached", False
                info.update(call_limit=True, invalid_action=True, observation_role="user")
            else:
                obs, done = self._run(calls, info)
                if done:  # the tool environment failed
                    reward, success = 0.0, False
                else:
                    shown = info["observation_messages"]
        done = end_of_turn(reward, done, success, self.turn, self.max_turns, info)
        if not done:
            self.messages.extend(copy.deepcopy(shown) if shown is not None else
                                 [{"role": "user", "content": obs}])
        self.done = done
        self.last_observation = obs
        return StepResult(obs, float(reward), bool(done), self._info(info))

    def _final_answer(self, info: dict) -> tuple[float, bool, str, bool | None]:
        """Scores the final answer (the last message); ``(reward, done, observation,
        success)``, and the reward function's ``info`` merged into ``info``."""
        r = run_reward(self.score, copy.deepcopy(self.messages), name=self._score_name,
                       context=f"task {self.task.id}, turn {self.turn}")
        info.update(r.info)
        info["observation_role"] = "user"
        if r.done:
            return r.reward, True, "done" if r.observation is None else r.observation, r.success
        self.answers.append((len(self.calls), self.messages[-1]["content"], r.observation))
        return r.reward, False, r.observation, r.success

    def tool_schemas_by_name(self) -> dict[str, dict]:
        return {s["function"]["name"]: s for s in self.tool_schemas()}

    def _run(self, calls: list[ToolCall], info: dict) -> tuple[str, bool]:
        """Runs the calls; returns ``(observation, ended)`` and fills ``info``."""
        messages = []
        for c in calls:
            try:
                result = self.call_tool(c)
            except ToolEnvironmentError as e:
                info.update(env_error=f"{type(e).__name__}: {e}")
                return f"error: the tool environment failed ({str(e)[:200]})", True
            except Exception as e:  # noqa: BLE001 - the tool's failure is the agent's news
                info["tool_error"] = True
                msg = str(e)
                result = f"error: {msg}" if isinstance(e, ToolError) \
                    else f"error: {type(e).__name__}: {msg}"
            if not isinstance(result, str):
                result = str(result)
            if len(result) > self.max_result_chars:
                result = result[:self.max_result_chars] + " ...[truncated]"
            self.calls.append((c, result))
            messages.append({"role": "tool", "name": c.name, "content": result})
        info.update(tool_name=calls[-1].name, observation_messages=messages,
                    tool_calls=[c.to_dict() for c in calls])
        if len(messages) == 1:
            return messages[0]["content"], False
        return "\n".join(f"{m['name']}: {m['content']}" for m in messages), False


def _message_text(action: Any) -> str:
    """An action as the text of its assistant message."""
    if isinstance(action, (bytes, bytearray)):
        return bytes(action).decode("utf-8", errors="replace")
    return action if isinstance(action, str) else str(action)
