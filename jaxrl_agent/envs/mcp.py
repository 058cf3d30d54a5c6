"""A tool environment over MCP: the agent's tool calls go to a local MCP server process (stdio).

``MCPEnv(command)`` (registered as ``mcp``) starts the server given by ``command`` (a list of
strings, or one string split like a shell command line; a leading ``python``/``python3`` means
this interpreter), lists its tools (their schemas become ``env.tools``) and routes the agent's
calls to it (:class:`~jaxrl_agent.envs.tools.ToolEnv` parses and checks them first). Without a
command it runs the shipped ``toolbox`` server (a calculator and a key-value notebook,
:mod:`jaxrl_agent.envs.mcp_servers.toolbox`). Needs the optional ``mcp`` package (``pip install
'jaxrl-agent[mcp]'``).

**Tasks** (``tasks=``):

- ``"arithmetic"``: "Compute 482*37+915 with the calculate tool, then reply with the number."
  The solver calls ``calculate`` and answers (2 turns).
- ``"notebook"``: the notebook holds two numbers under two words (written by the task's
  set-up calls at reset); "Reply with apple times river." The solver reads both keys in one
  message (two calls), multiplies with ``calculate`` and answers (3 turns).
- ``"mixed"``: either, half and half.

  These need the toolbox's tools; a server without them gets a ValueError naming the missing
  tools (at the first ``env.tools`` or ``reset``).
- a list of task dicts, or the path of a JSONL file with one per line, in the task-file
  format of the ``tasks`` env (:mod:`jaxrl_agent.envs.tasks`, read by its
  :func:`~jaxrl_agent.envs.tasks.load_tasks`, so errors name ``path:LINE`` or ``tasks[i]``):
  ``prompt`` (required), optional ``id``, ``split``, ``system`` (this task's system message;
  default the env's ``system_prompt``), ``max_turns``, plus the mcp env's own fields
  ``answer`` (what the default reward compares with; required when there is no ``reward=``),
  ``setup`` (calls run at reset, ``[{"name": str, "arguments": {...}}, ...]``) and
  ``solution`` (what ``solver()`` plays: ``[[calls of turn 1], [calls of turn 2], ...]``,
  then ``answer``). A task with ``messages`` is an error here (the ``tasks`` env takes
  them). Any other field is the reward function's. Keys and splits as in the ``tasks`` env (``id``, else a
  hash of the line; ``split``, else the hash split); a split with fewer tasks than asked for
  is repeated.

**Reward** (the package's one reward contract, :mod:`jaxrl_agent.envs.tasks`). A message without
tool calls is the agent's final answer; the env then calls ``fn(task, messages)``: ``task`` a
copy of the task's dict (a built-in task's is ``{"prompt", "answer", "setup", "solution"}``),
``messages`` the conversation so far (system message if any, the prompt, the agent's messages
with their tool-call text, one ``{"role": "tool", "name", "content"}`` message per tool result,
user messages for errors; the final answer last). It returns a number (success when > 0) or a
dict ``{reward, observation, done, success, info}``; a dict with an ``observation`` continues
the episode with it as the next user message (class :class:`~jaxrl_agent.envs.tools.ToolEnv`).
The default, :func:`~jaxrl_agent.envs.tasks.answer_reward`, compares the final answer (without
reasoning) with the task's ``answer``: numerically when the answer is a number (the last number
in the message counts), else as case- and whitespace-insensitive text; 1.0 when equal, else
0.0. ``reward=`` replaces it: ``"module:function"``, ``"path/to/file.py:function"`` or a
function (:func:`~jaxrl_agent.envs.tasks.load_reward`). A reward function that raises, or
returns something outside the contract, raises ``RewardError`` from ``step`` (``SafeEnv`` fails
that trajectory).

**Server processes.** An env takes a server at its first ``reset`` (or at the first use of
``env.tools``, when no other env has listed that command's tools yet) and keeps it across
episodes; ``clone()`` shares nothing and takes its own. ``close()`` (also run when the env is
garbage collected) hands the server to a pool of idle servers of the same command (at most
``pool_size``; beyond that, or with ``pool_size=0``, it stops the process), so the many short-
lived copies that rollout collection makes reuse processes instead of starting one each. Every
``reset`` runs the task's ``setup`` calls first (the built-in tasks clear the notebook), so a
reused server starts each episode in the task's state; a server that keeps other state keeps
it across episodes. A server is pinged before it is reused from the pool and at every ``reset``;
one that does not answer (its process died while idle) is stopped and replaced.
:func:`close_idle_servers` stops the pooled ones; at interpreter exit every server this process
started is stopped. ``hidden_tools`` names tools the agent neither sees nor may call (``setup``
calls may).

**Timeouts and faults.** The MCP SDK is asynchronous: one background thread runs an event loop
for all servers of the process, and the env's methods wait for it with timeouts, so they are
synchronous. A server that does not start (or list its tools) within ``start_timeout`` makes
``reset`` raise :class:`MCPServerError` (the rollout collector's ``SafeEnv`` drops that
trajectory). A call that takes more than ``call_timeout`` seconds, a server that dies, or an
episode whose calls take more than ``episode_timeout`` seconds in total ends the episode with
``info["env_error"]`` (reward 0, ``success=False``) and discards that server; the next
``reset`` takes another. A tool's own error (``is_error`` results: a bad expression, an unknown
key) is returned to the agent as ``"error: ..."`` and the episode goes on.

``fork()`` takes another server, resets it to the task and replays this episode's calls; it is
exact for servers whose tools are deterministic functions of their calls.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import copy
import json
import os
import random
import re
import shlex
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

from jaxrl_agent.envs.base import Task, check_split, register, split_of
from jaxrl_agent.envs.tasks import (TaskFileError, answer_reward, load_reward, load_tasks,
                                    make_tasks, resolve_file, reward_name, sample_task_list)
from jaxrl_agent.envs.tools import (ToolCall, ToolEnv, ToolEnvironmentError, ToolError,
                                    format_tool_calls, tool_schema)

__all__ = ["MCPEnv", "MCPConnection", "MCPServerError", "close_idle_servers", "live_servers",
           "parse_command"]

TASK_FAMILIES = ("arithmetic", "notebook", "mixed")
_FAMILY_TOOLS = {"arithmetic": {"calculate"},
                 "notebook": {"calculate", "notebook_read", "notebook_write", "notebook_clear"}}
_FAMILY_TOOLS["mixed"] = _FAMILY_TOOLS["arithmetic"] | _FAMILY_TOOLS["notebook"]
_WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "ember", "lemon",
          "north", "piano", "comet", "delta", "frost", "grape", "haven")


class MCPServerError(ToolEnvironmentError):
    """An MCP server could not start, died, hung past a timeout, or broke the protocol. The
    message names the server command and what went wrong (its stderr, the OS error): shown
    without a traceback (``FirstErrors``)."""

    traceback_helps = False


def parse_command(command: Any) -> list[str]:
    """The server command as an argument list: a list/tuple of strings, or a string split like
    a shell command line (``shlex``). A leading ``python`` / ``python3`` becomes this
    interpreter (``sys.executable``), so a server runs in the same environment as the trainer.
    ValueError for an empty or non-text command."""
    if isinstance(command, str):
        try:
            parts = shlex.split(command)
        except ValueError as e:
            raise ValueError(f"mcp command {command!r}: {e}") from None
    elif isinstance(command, (list, tuple)) and all(isinstance(c, str) for c in command):
        parts = list(command)
    else:
        raise ValueError(f"mcp command must be a string or a list of strings, got {command!r}")
    if not parts or not parts[0].strip():
        raise ValueError("mcp command is empty: give the server's command line, e.g. "
                         "'python my_server.py'")
    if parts[0] in ("python", "python3"):
        parts[0] = sys.executable
    return parts


def _require_sdk() -> None:
    try:
        import mcp  # noqa: F401
        from mcp.client.stdio import stdio_client  # noqa: F401
    except ImportError as e:
        raise ImportError("the mcp environment needs the optional 'mcp' package: pip install "
                          f"'jaxrl-agent[mcp]' ({e})") from None


# --- the event loop thread ----------------------------------------------------------------------

_LOOP_LOCK = threading.Lock()
_LOOP: dict = {"loop": None, "thread": None, "pid": None}


def _loop() -> asyncio.AbstractEventLoop:
    """The process's MCP event loop, running in a daemon thread (started on first use, and
    again in a forked child process)."""
    with _LOOP_LOCK:
        th = _LOOP["thread"]
        if _LOOP["loop"] is None or _LOOP["pid"] != os.getpid() or not th.is_alive():
            loop = asyncio.new_event_loop()
            th = threading.Thread(target=loop.run_forever, name="jaxrl-mcp-loop", daemon=True)
            th.start()
            _LOOP.update(loop=loop, thread=th, pid=os.getpid())
        return _LOOP["loop"]


# --- one server process -------------------------------------------------------------------------


class MCPConnection:
    """One MCP server process and its client session.

    ``start()`` launches the process, initialises the session and lists the tools
    (``self.tools``, in :func:`~jaxrl_agent.envs.tools.tool_schema` format), waiting at most
    ``start_timeout`` seconds; ``call(name, arguments, timeout)`` returns the result text
    (:class:`ToolError` for an ``is_error`` result, without the SDK's ``"Error executing tool
    <name>: "`` prefix); ``ping()`` checks that the server answers; ``close()`` stops the
    process (stdin closed, then terminate and kill as the SDK does, every wait bounded). Any
    failure of the process or the protocol, and any call past its timeout, marks the connection
    ``broken`` (a message), stops it in the background and raises :class:`MCPServerError`. The
    server's stderr goes to a temporary file whose end is quoted in these errors.
    """

    def __init__(self, command: Sequence[str], *, env: dict | None = None,
                 cwd: str | None = None, start_timeout: float = 60.0):
        self.command = list(command)
        self.env = dict(env or {})
        self.cwd = cwd
        self.start_timeout = float(start_timeout)
        self.tools: list[dict] = []
        self.broken: str | None = None
        self.closing = False
        self._session = None
        self._stop: asyncio.Event | None = None
        self._finished = threading.Event()
        self._errlog = None
        self._loop = None

    @property
    def alive(self) -> bool:
        return self._session is not None and not self.broken and not self.closing \
            and not self._finished.is_set()

    def stderr_tail(self, n: int = 300) -> str:
        """The last ``n`` characters the server wrote to stderr (read without moving the
        shared file offset), one line."""
        f = self._errlog
        if f is None:
            return ""
        try:
            size = os.fstat(f.fileno()).st_size
            data = os.pread(f.fileno(), n, max(0, size - n))
        except (OSError, ValueError):
            return ""
        return " ".join(data.decode("utf-8", "replace").split())

    def _describe(self) -> str:
        tail = self.stderr_tail()
        return f" (server stderr: ...{tail})" if tail else ""

    def start(self) -> "MCPConnection":
        """Starts the server and lists its tools; MCPServerError (with the server's stderr)
        when it cannot. Returns ``self``."""
        _require_sdk()
        self._errlog = tempfile.TemporaryFile()
        self._loop = _loop()
        ready: concurrent.futures.Future = concurrent.futures.Future()
        _track(self)
        asyncio.run_coroutine_threadsafe(self._serve(ready), self._loop)
        try:
            self.tools = ready.result(timeout=self.start_timeout + 10.0)
        except concurrent.futures.TimeoutError:
            self.broken = f"no answer within {self.start_timeout:g}s"
            self.close(wait=False)
            raise MCPServerError(f"MCP server {shlex.join(self.command)!r} did not start within "
                                 f"start_timeout={self.start_timeout:g}s{self._describe()}") \
                from None
        except Exception as e:  # noqa: BLE001 - reported with the server's own words
            self.broken = f"{type(e).__name__}: {e}"
            self.close(wait=False)
            why = f"it did not complete the MCP handshake within start_timeout=" \
                  f"{self.start_timeout:g}s" if isinstance(_innermost(e), TimeoutError) \
                else _reason(e)
            raise MCPServerError(f"MCP server {shlex.join(self.command)!r} failed to start: "
                                 f"{why}{self._describe()}") from None
        return self

    async def _serve(self, ready: concurrent.futures.Future) -> None:
        """Owns the process and the session for their whole life (the SDK's context managers
        must be entered and left in one task)."""
        import anyio
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        self._stop = asyncio.Event()
        if self.closing:
            self._stop.set()
        params = StdioServerParameters(command=self.command[0], args=self.command[1:],
                                       env=self.env or None, cwd=self.cwd)
        try:
            async with stdio_client(params, errlog=self._errlog) as (read, write):
                async with ClientSession(read, write) as session:
                    with anyio.fail_after(self.start_timeout):
                        await session.initialize()
                        tools = await _list_tools(session)
                    self._session = session
                    if not ready.done():
                        ready.set_result(tools)
                    await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            elif not self.closing:
                self.broken = self.broken or f"{type(e).__name__}: {e}"
            if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
        finally:
            self._session = None
            self._finished.set()
            _untrack(self)

    def call(self, name: str, arguments: dict, timeout: float) -> str:
        """The result text of one tool call (content texts joined by newlines; structured
        content as JSON when there is no text). ToolError for an ``is_error`` result or a
        protocol error answer; MCPServerError when the server is gone or ``timeout`` passes."""
        if not self.alive:
            raise MCPServerError(f"MCP server is not running ({self.broken or 'closed'})")
        fut = asyncio.run_coroutine_threadsafe(self._call(name, arguments, timeout), self._loop)
        try:
            kind, value = fut.result(timeout=timeout + 5.0)
        except (concurrent.futures.TimeoutError, TimeoutError):
            fut.cancel()
            self.broken = f"tool {name!r} took more than {timeout:g}s"
        except Exception as e:  # noqa: BLE001 - the connection itself failed
            self.broken = f"tool {name!r}: {_reason(e)}"
        else:
            if kind == "ok":
                return value
            if kind == "error":
                raise ToolError(value)
            self.broken = f"tool {name!r}: {value}"
        message = self.broken + self._describe()
        self.close()
        raise MCPServerError(message)

    def ping(self, timeout: float = 5.0) -> bool:
        """Whether the server answers an MCP ping within ``timeout`` seconds; a server that does
        not is marked broken and stopped."""
        if not self.alive:
            return False
        fut = asyncio.run_coroutine_threadsafe(self._ping(timeout), self._loop)
        try:
            fut.result(timeout=timeout + 5.0)
            return True
        except Exception as e:  # noqa: BLE001 - any failure: the server is not usable
            fut.cancel()
            self.broken = f"no answer to a ping ({_reason(e)})"
            self.close()
            return False

    async def _ping(self, timeout: float) -> None:
        import anyio
        session = self._session
        if session is None:
            raise MCPServerError("the session is closed")
        with anyio.fail_after(timeout):
            await session.send_ping()

    async def _call(self, name: str, arguments: dict, timeout: float) -> tuple[str, str]:
        import anyio
        session = self._session
        if session is None:
            return "broken", "the session is closed"
        try:
            with anyio.fail_after(timeout):
                result = await session.call_tool(name, arguments)
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001
            if _is_protocol_error(e) and self._session is not None and not _closed_error(e):
                return "error", _reason(e)  # the server answered with a JSON-RPC error
            return "broken", _reason(e)
        if getattr(result, "is_error", getattr(result, "isError", False)):
            text = _SDK_PREFIX.sub("", _result_text(result), count=1)
            return "error", text or "the tool failed"
        return "ok", _result_text(result)

    def close(self, wait: bool | float = False) -> bool:
        """Stops the server (idempotent). ``wait``: False returns at once (the process is
        stopped in the background), True waits up to 10 s, a number waits that long. Returns
        whether the process has been stopped."""
        self.closing = True
        loop = self._loop
        if loop is not None and not self._finished.is_set():
            try:
                loop.call_soon_threadsafe(self._request_stop)
            except RuntimeError:  # the loop is closed (interpreter exit)
                return True
        if self._loop is None:
            return True
        if wait is not False:
            return self._finished.wait(10.0 if wait is True else float(wait))
        return self._finished.is_set()

    def _request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def __repr__(self) -> str:
        state = "alive" if self.alive else (self.broken or "closed")
        return f"MCPConnection({shlex.join(self.command)!r}, {state})"


_SDK_PREFIX = re.compile(r"^Error executing tool \S+: ")  # the SDK's wrapper of a tool's message


async def _list_tools(session) -> list[dict]:
    tools, cursor = [], None
    for _ in range(100):  # pages
        result = await _tools_page(session, cursor)
        for t in result.tools:
            schema = getattr(t, "input_schema", None) or getattr(t, "inputSchema", None)
            tools.append(tool_schema({"name": t.name, "description": t.description or "",
                                      "parameters": schema or {"type": "object"}}))
        cursor = getattr(result, "next_cursor", None) or getattr(result, "nextCursor", None)
        if not cursor:
            break
    return tools


async def _tools_page(session, cursor):
    if not cursor:
        return await session.list_tools()
    try:  # mcp 2.x
        from mcp.types import PaginatedRequestParams
        return await session.list_tools(params=PaginatedRequestParams(cursor=cursor))
    except (ImportError, TypeError):  # mcp 1.x
        return await session.list_tools(cursor=cursor)


def _result_text(result) -> str:
    parts = []
    for block in getattr(result, "content", None) or ():
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')}]")
    if not parts:
        structured = getattr(result, "structured_content", None) or \
            getattr(result, "structuredContent", None)
        if structured is not None:
            return json.dumps(structured, ensure_ascii=False, default=str)
    return "\n".join(parts)


def _is_protocol_error(e: BaseException) -> bool:
    return type(e).__name__ in ("MCPError", "McpError") or any(
        c.__name__ in ("MCPError", "McpError") for c in type(e).__mro__)


def _closed_error(e: BaseException) -> bool:
    err = getattr(e, "error", None)
    code = getattr(err, "code", getattr(e, "code", None))
    return code == -32000 and "closed" in str(e).lower()  # the SDK's CONNECTION_CLOSED


def _innermost(e: BaseException) -> BaseException:
    """The first leaf of nested exception groups (the SDK's task groups raise them)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _reason(e: BaseException) -> str:
    """A one-line reason, looking inside exception groups."""
    e = _innermost(e)
    if _is_protocol_error(e) and _closed_error(e):
        return "the server closed the connection (did its process exit?)"
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# --- all connections, and the pool of idle ones -------------------------------------------------

_POOL_LOCK = threading.RLock()
_IDLE: dict[tuple, list[MCPConnection]] = {}
_LIVE: set = set()
_TOOLS: dict[tuple, list[dict]] = {}
_EXITING = [False]


def _track(conn: MCPConnection) -> None:
    with _POOL_LOCK:
        _LIVE.add(conn)


def _untrack(conn: MCPConnection) -> None:
    with _POOL_LOCK:
        _LIVE.discard(conn)


def _key(command: Sequence[str], env: dict | None, cwd: str | None) -> tuple:
    return tuple(command), tuple(sorted((env or {}).items())), cwd


def _acquire(command, env, cwd, start_timeout) -> MCPConnection:
    """An idle server of this command that answers a ping (the most recently returned first;
    dead ones are stopped), else a new one."""
    key = _key(command, env, cwd)
    while True:
        with _POOL_LOCK:
            idle = _IDLE.get(key)
            conn = idle.pop() if idle else None
        if conn is None:
            break
        if conn.ping():
            return conn
    conn = MCPConnection(command, env=env, cwd=cwd, start_timeout=start_timeout).start()
    with _POOL_LOCK:
        _TOOLS.setdefault(key, conn.tools)
    return conn


def _release(conn: MCPConnection | None, pool_size: int) -> None:
    if conn is None:
        return
    with _POOL_LOCK:
        idle = _IDLE.setdefault(_key(conn.command, conn.env, conn.cwd), [])
        if conn.alive and not _EXITING[0] and len(idle) < pool_size and conn not in idle:
            idle.append(conn)
            return
    conn.close()


def close_idle_servers(wait: float = 10.0) -> int:
    """Stops every pooled (idle) server of this process; waits up to ``wait`` seconds in all.
    Returns how many it stopped."""
    with _POOL_LOCK:
        conns = [c for idle in _IDLE.values() for c in idle]
        _IDLE.clear()
    for c in conns:
        c.close()
    deadline = time.monotonic() + wait
    for c in conns:
        c._finished.wait(max(0.0, deadline - time.monotonic()))
    return len(conns)


def live_servers() -> int:
    """The number of server processes this process runs now (in use or idle)."""
    with _POOL_LOCK:
        return len(_LIVE)


@atexit.register
def _stop_all_servers(wait: float = 8.0) -> None:
    _EXITING[0] = True
    with _POOL_LOCK:
        _IDLE.clear()
        conns = list(_LIVE)
    for c in conns:
        c.close()
    deadline = time.monotonic() + wait
    for c in conns:
        c._finished.wait(max(0.0, deadline - time.monotonic()))


# --- tasks and reward ---------------------------------------------------------------------------


def _arithmetic_task(rng: random.Random) -> tuple[str, dict]:
    a, b, c = rng.randint(100, 999), rng.randint(11, 99), rng.randint(100, 999)
    op = rng.choice("+-")
    expr = f"{a}*{b}{op}{c}"
    value = a * b + c if op == "+" else a * b - c
    return f"arithmetic:{expr}", {
        "prompt": f"Compute {expr} with the calculate tool, then reply with the number.",
        "answer": value, "setup": [],
        "solution": [[{"name": "calculate", "arguments": {"expression": expr}}]]}


def _notebook_task(rng: random.Random) -> tuple[str, dict]:
    k1, k2 = rng.sample(_WORDS, 2)
    v1, v2 = rng.randint(12, 99), rng.randint(12, 99)
    setup = [{"name": "notebook_clear", "arguments": {}},
             {"name": "notebook_write", "arguments": {"key": k1, "value": str(v1)}},
             {"name": "notebook_write", "arguments": {"key": k2, "value": str(v2)}}]
    return f"notebook:{k1}={v1},{k2}={v2}", {
        "prompt": f"The notebook holds numbers under '{k1}' and '{k2}'. Reply with {k1} "
                  f"times {k2}.",
        "answer": v1 * v2, "setup": setup,
        "solution": [[{"name": "notebook_read", "arguments": {"key": k1}},
                      {"name": "notebook_read", "arguments": {"key": k2}}],
                     [{"name": "calculate", "arguments": {"expression": f"{v1}*{v2}"}}]]}


def _check_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise TaskFileError(f"{where} must be a list of calls, got {type(calls).__name__}")
    for i, c in enumerate(calls):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or \
                not isinstance(c.get("arguments") or {}, dict) or set(c) - {"name", "arguments"}:
            raise TaskFileError(f'{where}[{i}] must be {{"name": str, "arguments": {{...}}}}, '
                                f"got {c!r:.100}")


def _task_checker(need_answer: bool) -> Callable[[dict, str], None]:
    """The mcp env's own checks of a task line (after the task-file format's): ``setup`` a list
    of calls, ``solution`` a list of turns (lists of calls), no ``messages``, and an
    ``answer`` when the default reward needs one."""

    def check(row: dict, where: str) -> None:
        if "messages" in row:
            raise TaskFileError(f'{where}: the mcp env reads "prompt" (and "system"), not '
                                f'"messages"')
        if "setup" in row:
            _check_calls(row["setup"], f"{where}: setup")
        if row.get("solution") is not None:
            if not isinstance(row["solution"], list):
                raise TaskFileError(f'{where}: "solution" must be a list of turns, each a list '
                                    f"of calls, got {type(row['solution']).__name__}")
            for k, turn in enumerate(row["solution"]):
                _check_calls(turn, f"{where}: solution[{k}]")
        if need_answer and row.get("answer") is None:
            raise TaskFileError(f'{where}: no "answer", which the default reward compares the '
                                f"final answer with; add one, or give the env a reward "
                                f"function (reward=)")

    return check


def _calls(calls: Sequence[dict] | None) -> list[ToolCall]:
    return [ToolCall(c["name"], dict(c.get("arguments") or {})) for c in calls or ()]


_TASK_FILES: dict[tuple, list] = {}  # (path, mtime, size, check) -> tasks: clones do not re-read


def _task_list(tasks: Any, base_dir: str | None, need_answer: bool) -> list[Task] | None:
    """``None`` for a built-in family; else the given tasks (a JSONL file read with
    :func:`~jaxrl_agent.envs.tasks.load_tasks`, or a list of task dicts), checked."""
    if isinstance(tasks, str) and tasks in TASK_FAMILIES:
        return None
    check = _task_checker(need_answer)
    if isinstance(tasks, str):
        try:
            path = resolve_file(tasks, base_dir, "tasks file")
        except ValueError as e:
            raise ValueError(f"tasks must be one of {', '.join(TASK_FAMILIES)}, a list of task "
                             f"dicts or the path of a JSONL task file; {tasks!r} is none of "
                             f"these ({e})") from None
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size, need_answer)
        if key not in _TASK_FILES:
            _TASK_FILES.clear()
            _TASK_FILES[key] = load_tasks(path, MCPEnv.family, check)
        return _TASK_FILES[key]
    if isinstance(tasks, (list, tuple)):
        out = make_tasks(((f"tasks[{i}]", f"tasks[{i}]", copy.deepcopy(t))
                          for i, t in enumerate(tasks)), MCPEnv.family, check)
        if not out:
            raise ValueError("tasks: an empty list")
        return out
    raise ValueError(f"tasks must be one of {', '.join(TASK_FAMILIES)}, a list of task dicts "
                     f"or a JSONL path, got {type(tasks).__name__}")


# --- the environment ----------------------------------------------------------------------------


class MCPEnv(ToolEnv):
    """``MCPEnv(command=None, tasks="arithmetic", ...)``: the module docstring.

    Args:
      command: the server's command line (list or string); None: the shipped toolbox server.
      tasks: a built-in family (``"arithmetic"``, ``"notebook"``, ``"mixed"``), a list of task
        dicts or the path of a JSONL task file (relative: the working directory, then
        ``base_dir``).
      reward: None (:func:`~jaxrl_agent.envs.tasks.answer_reward`: compare with the task's
        ``answer``), ``"module:function"`` / ``"path/to/file.py:function"`` or a function
        (:func:`~jaxrl_agent.envs.tasks.load_reward`), called as ``fn(task, messages)``.
      base_dir: a second directory for a relative ``tasks`` file and ``reward`` file (a run
        config's directory: the config loader passes it).
      server_env: extra environment variables for the server (the MCP SDK passes only a few,
        like ``PATH`` and ``HOME``, through; this env adds ``PYTHONPATH`` when it is set);
        cwd: its working directory.
      call_timeout / start_timeout / episode_timeout: seconds (module docstring).
      pool_size: idle servers kept per command for reuse (0: ``close()`` stops the server).
      hidden_tools: tool names the agent neither sees nor may call (``setup`` calls may).
      Others: :class:`~jaxrl_agent.envs.tools.ToolEnv`.
    """

    family = "mcp"
    default_max_turns = 6

    def __init__(self, command: Sequence[str] | str | None = None, *, tasks: Any = "arithmetic",
                 reward: Any = None, server_env: dict | None = None, cwd: str | None = None,
                 call_timeout: float = 10.0, start_timeout: float = 60.0,
                 episode_timeout: float = 120.0, pool_size: int = 64,
                 hidden_tools: Sequence[str] = (), system_prompt: str | None = None,
                 max_calls_per_turn: int = 4, max_calls: int = 16, max_result_chars: int = 500,
                 max_turns: int | None = None, invalid_penalty: float = -0.1,
                 invalid_ends: bool = False, base_dir: str | None = None,
                 step_latency_s: float = 0.0):
        super().__init__((), system_prompt=system_prompt, max_calls_per_turn=max_calls_per_turn,
                         max_calls=max_calls, max_result_chars=max_result_chars,
                         max_turns=max_turns, invalid_penalty=invalid_penalty,
                         invalid_ends=invalid_ends, step_latency_s=step_latency_s)
        _require_sdk()
        self._command_arg = command
        if command is None:
            from jaxrl_agent.envs.mcp_servers import toolbox_command
            self.command = toolbox_command()
        else:
            self.command = parse_command(command)
        if server_env is not None and not (isinstance(server_env, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in server_env.items())):
            raise ValueError(f"server_env must map strings to strings, got {server_env!r}")
        self.server_env = dict(server_env or {})
        self.cwd = cwd
        for name, v in (("call_timeout", call_timeout), ("start_timeout", start_timeout),
                        ("episode_timeout", episode_timeout)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        self.call_timeout, self.start_timeout = float(call_timeout), float(start_timeout)
        self.episode_timeout = float(episode_timeout)
        if not isinstance(pool_size, int) or pool_size < 0:
            raise ValueError(f"pool_size must be an int >= 0, got {pool_size!r}")
        self.pool_size = pool_size
        if isinstance(hidden_tools, str) or not all(isinstance(h, str) for h in hidden_tools):
            raise ValueError(f"hidden_tools must be a list of tool names, got {hidden_tools!r}")
        self.hidden_tools = tuple(hidden_tools)
        if base_dir is not None and not isinstance(base_dir, str):
            raise ValueError(f"base_dir must be a directory path, got {base_dir!r}")
        self.base_dir = base_dir
        self._tasks_arg, self._reward_arg = tasks, reward
        self._system_arg, self._max_turns_arg = system_prompt, max_turns
        self._default_max_turns = self.max_turns
        self._task_list = _task_list(tasks, base_dir, need_answer=reward is None)
        if reward is None:
            self._reward = answer_reward
            self._score_name = "the default reward (answer_reward: compare with the task's " \
                               "\"answer\")"
        else:
            self._reward = load_reward(reward, base_dir)
            self._score_name = f"reward function {reward_name(reward)}"
        self._conn: MCPConnection | None = None
        self._tool_time = 0.0

    def _config(self) -> dict:
        cfg = super()._config()
        cfg.pop("tools")
        return dict(cfg, command=self._command_arg, tasks=self._tasks_arg,
                    reward=self._reward_arg, base_dir=self.base_dir,
                    system_prompt=self._system_arg, max_turns=self._max_turns_arg,
                    server_env=self.server_env or None, cwd=self.cwd,
                    call_timeout=self.call_timeout, start_timeout=self.start_timeout,
                    episode_timeout=self.episode_timeout, pool_size=self.pool_size,
                    hidden_tools=self.hidden_tools)

    # --- the server -------------------------------------------------------------------------
    def _server_env(self) -> dict:
        env = dict(self.server_env)
        if os.environ.get("PYTHONPATH"):  # the SDK passes only a few variables on
            env.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])
        return env

    def _key(self) -> tuple:
        return _key(self.command, self._server_env(), self.cwd)

    def _connection(self, check: bool = False) -> MCPConnection:
        """The env's server, taken (or started) if it has none; ``check`` pings a held one
        first and replaces it when it does not answer."""
        if self._conn is not None and not (self._conn.ping() if check else self._conn.alive):
            self._conn.close()
            self._conn = None
        if self._conn is None:
            self._conn = _acquire(self.command, self._server_env(), self.cwd, self.start_timeout)
        return self._conn

    def tool_schemas(self) -> list[dict]:
        with _POOL_LOCK:
            tools = _TOOLS.get(self._key())
        if tools is None:
            held = self._conn is not None
            conn = self._connection()
            tools = conn.tools
            if not held and self.task is None:  # only listing: give the server back
                _release(conn, self.pool_size)
                self._conn = None
        self._check_tools(tools)
        return [t for t in tools if t["function"]["name"] not in self.hidden_tools]

    def _check_tools(self, tools: list[dict]) -> None:
        """ValueError when the built-in tasks need tools this server lacks."""
        if self._task_list is not None:
            return
        have = {t["function"]["name"] for t in tools}
        missing = sorted(_FAMILY_TOOLS[self._tasks_arg] - have)
        if missing:
            raise ValueError(f"the built-in {self._tasks_arg!r} tasks of the mcp env need the "
                             f"tools {', '.join(missing)}, which the server "
                             f"{shlex.join(self.command)!r} lacks (it has: "
                             f"{', '.join(sorted(have)) or 'none'}); give the env tasks= (a "
                             f"JSONL file or a list of tasks) for this server")

    def call_tool(self, call: ToolCall) -> str:
        left = self.episode_timeout - self._tool_time
        if left <= 0:
            raise MCPServerError(f"the episode's tool calls took more than episode_timeout="
                                 f"{self.episode_timeout:g}s")
        conn = self._conn
        if conn is None:
            raise MCPServerError("no MCP server (reset first)")
        t0 = time.monotonic()
        try:
            return conn.call(call.name, call.arguments, min(self.call_timeout, left))
        except MCPServerError:
            self._discard()
            raise
        finally:
            self._tool_time += time.monotonic() - t0

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Gives the server back to the pool (or stops it: the module docstring)."""
        conn, self._conn = getattr(self, "_conn", None), None
        _release(conn, getattr(self, "pool_size", 0))

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter exit: the atexit hook stops servers
            pass

    # --- tasks ------------------------------------------------------------------------------
    def _make_task(self, rng) -> Task:
        if self._task_list is not None:
            return rng.choice(self._task_list)
        kind = self._tasks_arg
        if kind == "mixed":
            kind = rng.choice(("arithmetic", "notebook"))
        key, data = (_arithmetic_task if kind == "arithmetic" else _notebook_task)(rng)
        return Task(self.family, key, split_of(f"{self.family}:{key}"), data)

    def sample_tasks(self, rng, n: int, split: str = "train", max_tries: int = 100_000) -> list:
        """Built-in families: ``n`` distinct generated tasks. A task list or file: as the
        ``tasks`` env (:func:`~jaxrl_agent.envs.tasks.sample_task_list`: distinct while the
        split has enough, then repeated)."""
        if self._task_list is None:
            return super().sample_tasks(rng, n, split, max_tries)
        check_split(split)
        where = self._tasks_arg if isinstance(self._tasks_arg, str) else "the mcp env's tasks"
        return sample_task_list(self._task_list, rng, n, split, where)

    def _reset(self, task: Task) -> None:
        self._tool_time = 0.0
        self.system_prompt = task.data.get("system", self._system_arg)
        self.max_turns = task.data.get("max_turns", self._default_max_turns)
        conn = self._connection(check=True)
        self._check_tools(conn.tools)
        for c in _calls(task.data.get("setup")):
            try:
                conn.call(c.name, c.arguments, self.call_timeout)
            except ToolError as e:
                raise MCPServerError(f"task set-up call {c.name!r} failed: {e}") from None
            except MCPServerError:
                self._discard()
                raise

    def prompt(self) -> str:
        return self.task.data["prompt"]

    def score(self, messages: list[dict]) -> Any:
        """The reward function (``reward=``; default :func:`~jaxrl_agent.envs.tasks.
        answer_reward`) of a copy of the task's dict and the conversation."""
        return self._reward(copy.deepcopy(self.task.data), messages)

    def solver(self) -> str:
        """The next turn of the task's solution that has not run yet (its calls in the Hermes
        format), then the answer. NotImplementedError for a task without a solution."""
        data = self.task.data
        plan = data.get("solution")
        if plan is None:
            raise NotImplementedError(f"task {self.task.key!r} has no 'solution' to demonstrate")
        done = [(c.name, json.dumps(c.arguments, sort_keys=True)) for c, r in self.calls
                if not r.startswith("error:")]
        for turn in plan:
            calls = _calls(turn)
            if not all((c.name, json.dumps(c.arguments, sort_keys=True)) in done
                       for c in calls):
                return format_tool_calls(calls)
        if data.get("answer") is None:
            raise NotImplementedError(f"task {self.task.key!r} has no 'answer' to give")
        return str(data["answer"])

    def fork(self) -> "MCPEnv":
        """A copy in the same episode state on another server: reset to the task, then this
        episode's calls replayed (exact for deterministic tools)."""
        if self.task is None or self.done:
            raise RuntimeError("fork() needs an episode in progress")
        other = self.clone()
        other.reset(self.task)
        for call, _ in self.calls:
            try:
                other.call_tool(call)
            except ToolError:
                pass
        other.calls, other.answers = list(self.calls), list(self.answers)
        other.messages = copy.deepcopy(self.messages)
        other.turn, other.done, other.last_observation = self.turn, self.done, \
            self.last_observation
        other._tool_time = self._tool_time
        return other


register("mcp", MCPEnv)
