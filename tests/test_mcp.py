"""Tests of the MCP tool environment with real MCP server processes (the ``mcp`` package):
start, list tools, call, a server that crashes or hangs mid-episode, shutdown, no leaked
processes."""

import gc
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("mcp")

from hypothesis import given, settings, strategies as st  # noqa: E402

from jaxrl_agent.envs import make_env  # noqa: E402
from jaxrl_agent.envs.base import SafeEnv, run_episode, solver_policy, split_of  # noqa: E402
from jaxrl_agent.envs.mcp import (MCPConnection, MCPEnv, MCPServerError,  # noqa: E402
                                  close_idle_servers, live_servers, parse_command)
from jaxrl_agent.envs.mcp_servers import toolbox_command  # noqa: E402
from jaxrl_agent.envs.mcp_servers.toolbox import ToolboxError, calculate_value  # noqa: E402
from jaxrl_agent.envs.tasks import TaskFileError, answer_reward  # noqa: E402
from jaxrl_agent.envs.tools import ToolCall, ToolError, format_tool_calls  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="counts processes in /proc")

# A test server: echo, crash (the process exits mid-call), hang (sleeps past any timeout);
# "exit" as its argument makes it fail at start, "slow" makes it never answer the handshake.
BAD_SERVER = textwrap.dedent('''
    import os, sys, time
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "exit":
        print("cannot start: no config", file=sys.stderr)
        sys.exit(2)
    if mode == "slow":
        time.sleep(60)
    try:
        from mcp.server.mcpserver import MCPServer as Server
    except ImportError:
        from mcp.server.fastmcp import FastMCP as Server
    app = Server("bad")

    @app.tool()
    def echo(text: str) -> str:
        """Echo the text."""
        return text

    @app.tool()
    def crash() -> str:
        """Exit the server process."""
        print("crashing on purpose", file=sys.stderr, flush=True)
        os._exit(3)

    @app.tool()
    def exit_soon() -> str:
        """Exit the server process a moment after answering."""
        import threading
        threading.Timer(0.2, os._exit, (0,)).start()
        return "bye"

    @app.tool()
    def hang(seconds: float = 3600.0) -> str:
        """Sleep."""
        time.sleep(seconds)
        return "woke up"

    app.run()
''')

TASKS = [{"prompt": "Say hi through echo.", "answer": "hi", "id": "hi",
          "solution": [[{"name": "echo", "arguments": {"text": "hi"}}]]}]
TASKS_SPLIT = split_of("mcp:hi")  # the one task's split


def children() -> list[int]:
    """Running (not zombie) child processes of this process."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(int(pid))
    return sorted(out)


def wait_for(cond, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture(scope="module")
def bad_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp") / "bad_server.py"
    path.write_text(BAD_SERVER)
    yield [sys.executable, str(path)]


@pytest.fixture(scope="module", autouse=True)
def _no_servers_left():
    before = set(children())
    yield
    close_idle_servers()
    assert wait_for(lambda: live_servers() == 0)
    assert wait_for(lambda: not set(children()) - before), (before, children())


# --- the shipped server, the built-in tasks -----------------------------------------------------


def test_toolbox_evaluator():
    assert calculate_value("12*(3+4)-  -2") == 86
    for bad in ["2**80", "1/2", "__import__('os')", "1e3", "", "9" * 199 + "*" + "9" * 199]:
        with pytest.raises(ToolboxError):
            calculate_value(bad)


def test_builtin_tasks_solved_with_the_toolbox_server():
    env = make_env("mcp", tasks="mixed")
    names = [t["function"]["name"] for t in env.tools]
    assert names == ["calculate", "notebook_write", "notebook_read", "notebook_clear"]
    params = env.tools[0]["function"]["parameters"]
    assert params["required"] == ["expression"]
    assert params["properties"]["expression"]["type"] == "string"
    train, test = env.sample_tasks(0, 6, "train"), env.sample_tasks(0, 4, "test")
    assert not {t.key for t in train} & {t.key for t in test}
    assert [t.key for t in env.sample_tasks(0, 6, "train")] == [t.key for t in train]
    kinds = set()
    for task in train + test:
        ep = run_episode(env, solver_policy(env), task)
        kinds.add(task.key.split(":")[0])
        assert ep.success and ep.rewards[-1] == 1.0, (task, ep.actions, ep.observations)
        assert ep.infos[0]["observation_role"] == "tool"
        assert not any(i["invalid_action"] or i.get("tool_error") for i in ep.infos)
        assert ep.observations[-1].lstrip("-").isdigit()  # the calculator's result
        assert len(ep.observations[0]) < 100
    assert kinds == {"arithmetic", "notebook"}
    # a notebook episode after others on the same (reused) server starts clean
    task = next(t for t in train if t.key.startswith("notebook"))
    env.reset(task)
    res = env.step(format_tool_calls([ToolCall("notebook_read", {"key": "zzz-not-there"})]))
    assert res.info["tool_error"] and res.observation == "error: no key 'zzz-not-there' in " \
                                                         "the notebook"
    res = env.step("0")
    assert res.done and res.reward == 0.0 and res.info["success"] is False
    env.close()


def test_tool_errors_and_invalid_calls_with_a_real_server():
    env = MCPEnv(tasks="arithmetic")
    task = env.sample_tasks(1, 1)[0]
    env.reset(task)
    res = env.step(format_tool_calls([ToolCall("calculate", {"expression": "7/0"})]))
    assert res.info["tool_error"] and not res.info["invalid_action"] and not res.done
    assert res.observation == "error: only integers, + - * and parentheses are allowed"
    res = env.step(format_tool_calls([ToolCall("calculate", {"expression": 7})]))
    assert res.info["invalid_action"] and "expression must be string" in res.observation
    res = env.step('<tool_call>{"name": "rm", "arguments": {}}</tool_call>')
    assert res.info["invalid_action"] and "unknown tool 'rm'" in res.observation
    res = env.step(env.solver())
    assert res.observation == str(task.data["answer"])
    assert env.step(env.solver()).info["success"]
    env.close()


@settings(max_examples=12)
@given(st.lists(st.one_of(
    st.builds(lambda n, a: format_tool_calls([ToolCall(n, a)]),
              st.sampled_from(["calculate", "notebook_read", "notebook_write", "other"]),
              st.dictionaries(st.sampled_from(["expression", "key", "value", "x"]),
                              st.one_of(st.text(max_size=12), st.integers(), st.none()),
                              max_size=3)),
    st.text(max_size=30)), min_size=1, max_size=4))
def test_mcp_env_never_raises(actions):
    env = MCPEnv(tasks="notebook", max_turns=4)
    env.reset(env.sample_tasks(0, 1)[0])
    for action in actions:
        res = env.step(action)
        assert "env_error" not in res.info and isinstance(res.observation, str)
        if res.done:
            break
    env.close()


def test_fork_replays_the_episode_on_another_server():
    env = MCPEnv(tasks="notebook")
    task = env.sample_tasks(2, 1)[0]
    env.reset(task)
    env.step(env.solver())  # read both keys
    fork = env.fork()
    assert fork._conn is not env._conn and fork.state_key() == env.state_key()
    assert fork.turn == env.turn == 1
    assert env.step(env.solver()).observation == fork.step(fork.solver()).observation
    assert fork.step(fork.solver()).info["success"]
    env.close()
    fork.close()


# --- processes: pool, shutdown, crash, hang -----------------------------------------------------


def test_pool_reuses_servers_and_shutdown_leaves_no_process(bad_server):
    close_idle_servers()
    assert wait_for(lambda: live_servers() == 0)
    before = set(children())
    new = lambda: set(children()) - before  # noqa: E731
    env = MCPEnv(bad_server, tasks=TASKS, pool_size=2)
    assert [t["function"]["name"] for t in env.tools] == ["echo", "crash", "exit_soon", "hang"]
    assert live_servers() == 1  # listing started one, and gave it back to the pool
    copies = [env.clone() for _ in range(3)]
    task = env.sample_tasks(0, 1, TASKS_SPLIT)[0]
    for copy in copies:
        assert run_episode(copy, solver_policy(copy), task).success
    assert live_servers() == 3 and len(new()) == 3
    del copy
    copies.pop().close()
    del copies[:]  # garbage collected: back to the pool (which keeps 2)
    gc.collect()
    assert wait_for(lambda: live_servers() == 2)
    assert close_idle_servers() == 2
    assert live_servers() == 0 and wait_for(lambda: not new())
    env = MCPEnv(bad_server, tasks=TASKS, pool_size=0)
    env.reset(env.sample_tasks(0, 1, TASKS_SPLIT)[0])
    assert live_servers() == 1
    env.close()  # pool_size=0: close stops the process
    assert wait_for(lambda: live_servers() == 0 and not new())


def test_crash_mid_episode_fails_the_trajectory_and_the_run_goes_on(bad_server):
    env = MCPEnv(bad_server, tasks=TASKS)
    task = env.sample_tasks(0, 1, TASKS_SPLIT)[0]
    env.reset(task)
    assert env.step(format_tool_calls([ToolCall("echo", {"text": "x"})])).observation == "x"
    res = env.step(format_tool_calls([ToolCall("crash", {})]))
    assert res.done and res.reward == 0.0 and res.info["success"] is False
    assert "closed the connection" in res.info["env_error"]
    assert "crashing on purpose" in res.info["env_error"]  # the server's stderr is quoted
    # the next episode gets a fresh server
    assert run_episode(env, solver_policy(env), task).success
    env.close()
    # through SafeEnv (as the collector uses it) the same
    safe = SafeEnv(MCPEnv(bad_server, tasks=TASKS))
    safe.reset(task)
    res = safe.step('<tool_call>{"name": "crash"}</tool_call>')
    assert res.done and "env_error" in res.info
    safe.env.close()


def test_a_server_that_dies_between_episodes_is_replaced(bad_server):
    env = MCPEnv(bad_server, tasks=TASKS)
    task = env.sample_tasks(0, 1, TASKS_SPLIT)[0]
    bye = format_tool_calls([ToolCall("exit_soon", {})])
    env.reset(task)
    assert env.step(bye).observation == "bye"
    time.sleep(1.0)  # the process exits while the env holds it
    assert run_episode(env, solver_policy(env), task).success  # reset pings, and replaces it
    env.reset(task)
    assert env.step(bye).observation == "bye"
    env.close()  # back to the pool, dying
    time.sleep(1.0)
    other = MCPEnv(bad_server, tasks=TASKS)
    assert run_episode(other, solver_policy(other), task).success
    other.close()


def test_hang_past_the_call_timeout(bad_server):
    env = MCPEnv(bad_server, tasks=TASKS, call_timeout=1.0, episode_timeout=1.5)
    task = env.sample_tasks(0, 1, TASKS_SPLIT)[0]
    env.reset(task)
    res = env.step(format_tool_calls([ToolCall("hang", {})]))  # sleeps an hour
    assert res.done and res.info["success"] is False
    assert "took more than 1s" in res.info["env_error"]
    # the per-episode budget: 0.6 s + 0.6 s of calls pass 1.5 s on the third
    env.reset(task)
    for _ in range(2):
        assert env.step(format_tool_calls([ToolCall("hang", {"seconds": 0.6})])
                        ).observation == "woke up"
    res = env.step(format_tool_calls([ToolCall("hang", {"seconds": 0.6})]))
    assert res.done and "env_error" in res.info
    env.reset(task)
    assert env.step(env.solver()).observation == "hi"
    env.close()


def test_servers_that_fail_to_start(bad_server):
    env = MCPEnv(bad_server + ["exit"], tasks=TASKS)
    with pytest.raises(MCPServerError, match="failed to start.*cannot start: no config"):
        env.reset(env.sample_tasks(0, 1, TASKS_SPLIT)[0])
    safe = SafeEnv(MCPEnv(bad_server + ["exit"], tasks=TASKS))
    obs, info = safe.reset(env.sample_tasks(0, 1, TASKS_SPLIT)[0])
    assert info["done"] and "MCPServerError" in info["env_error"]
    env = MCPEnv(bad_server + ["slow"], tasks=TASKS, start_timeout=1.0)
    with pytest.raises(MCPServerError, match="handshake within start_timeout=1s"):
        env.tool_schemas()  # the server sleeps a minute before it reads stdin
    env = MCPEnv(bad_server)  # the built-in arithmetic tasks need a calculate tool
    with pytest.raises(ValueError, match="need the tools calculate, which the server"):
        env.tool_schemas()
    env = MCPEnv(["/no/such/server-binary"], tasks=TASKS)
    with pytest.raises(MCPServerError, match="server-binary"):
        env.tool_schemas()


def test_interpreter_exit_stops_servers(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent('''
        import os
        from jaxrl_agent.envs.mcp import MCPEnv
        env = MCPEnv(tasks="arithmetic", pool_size=0)
        env.reset(env.sample_tasks(0, 1)[0])
        kids = [p for p in os.listdir("/proc") if p.isdigit() and
                open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
        print(" ".join(kids), flush=True)
        # exits without close(): the atexit hook stops the server
    '''))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    pids = [int(p) for p in out.stdout.split()]
    assert pids
    assert wait_for(lambda: not any(os.path.exists(f"/proc/{p}") and
                                    open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0]
                                    != "Z" for p in pids), 5)


# --- configuration ------------------------------------------------------------------------------


def test_commands_tasks_and_reward_plugins(tmp_path):
    assert parse_command("python -m my.server --x 'a b'") == [sys.executable, "-m", "my.server",
                                                              "--x", "a b"]
    assert parse_command(["node", "s.js"]) == ["node", "s.js"]
    assert toolbox_command()[0] == sys.executable
    for bad in ["", [], [1], "'unclosed"]:
        with pytest.raises(ValueError, match="mcp command"):
            parse_command(bad)
    with pytest.raises(ValueError, match="tasks must be one of"):
        MCPEnv(tasks="arithmetics")
    with pytest.raises(ValueError, match="call_timeout"):
        MCPEnv(call_timeout=0)
    path = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t{i}", "prompt": f"What is stored under k{i}?", "answer": f"V{i}",
             "setup": [{"name": "notebook_clear"},
                       {"name": "notebook_write", "arguments": {"key": f"k{i}", "value": f"V{i}"}}],
             "solution": [[{"name": "notebook_read", "arguments": {"key": f"k{i}"}}]],
             "extra": i}
            for i in range(20)]
    rows[0].update(system="Be brief.", max_turns=2)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # the one reward contract: fn(task, messages) -> number | dict
    (tmp_path / "my_reward.py").write_text(
        "def score(task, messages):\n"
        "    ok = messages[-1]['content'].strip().lower() == task['answer'].lower()\n"
        "    tools = [m['content'] for m in messages if m['role'] == 'tool']\n"
        "    return {'reward': float(ok), 'info': {'seen': tools, 'extra': task['extra'],\n"
        "                                          'roles': [m['role'] for m in messages]}}\n")
    env = MCPEnv(tasks=str(path), reward=f"{tmp_path / 'my_reward.py'}:score")
    tasks = env.sample_tasks(0, 3, "train")
    assert len({t.key for t in tasks}) == 3 and all(t.family == "mcp" for t in tasks)
    for task in tasks:
        ep = run_episode(env, solver_policy(env), task)
        assert ep.success and ep.observations[1] == task.data["answer"], ep
        assert ep.infos[-1]["seen"] == [task.data["answer"]]
        assert ep.infos[-1]["extra"] == int(task.key[1:])  # the line's own fields reach it
        assert ep.infos[-1]["roles"][-4:] == ["user", "assistant", "tool", "assistant"]
    env.reset(tasks[0])
    assert env.step("v" + tasks[0].key[1:]).info["success"]  # the plug-in's lower-casing
    clone = env.clone()
    assert clone._reward is env._reward and clone._task_list is env._task_list
    # per-task system message and turn limit (the task-file format's fields)
    (first,) = [t for t in env._task_list if t.key == "t0"]
    env.reset(first)
    assert env.system_prompt == "Be brief." and env.max_turns == 2
    assert env.messages[0] == {"role": "system", "content": "Be brief."}
    env.reset(tasks[0])
    assert env.system_prompt is None and env.max_turns == MCPEnv.default_max_turns
    env.close()
    # a split smaller than the request repeats (as in the tasks env)
    many = env.sample_tasks(0, 50, "train")
    assert len(many) == 50 and {t.key for t in many} == {t.key for t in env._task_list
                                                          if t.split == "train"}
    # the default reward compares with "answer" (a number: the last number of the answer)
    env = MCPEnv(tasks=[{"prompt": "Say 1,234.", "answer": 1234, "id": "n"}])
    assert env._reward is answer_reward and env._score_name.startswith("the default reward")
    said = [{"role": "assistant", "content": "<think>12</think>It is 1,234."}]
    assert answer_reward(env._task_list[0].data, said) == 1.0


@pytest.mark.parametrize("rows, match", [
    ('{"prompt": "x", "answer": 1}\n{"prompt": 3}\n',
     r'tasks.jsonl:2: "prompt" must be a non-empty string'),
    ('{"prompt": "x", "answer": 1}\n{"prompt": "x", "answer": 1}\n',
     r"tasks.jsonl:2: the same task repeats line 1"),
    ('{"prompt": "x"}\n', r'tasks.jsonl:1: no "answer", which the default reward compares'),
    ('{"prompt": "x", "answer": 1, "setup": {"name": "a"}}\n',
     r"tasks.jsonl:1: setup must be a list of calls, got dict"),
    ('{"prompt": "x", "answer": 1, "setup": [{"name": "a", "args": {}}]}\n',
     r'tasks.jsonl:1: setup\[0\] must be \{"name": str, "arguments"'),
    ('{"prompt": "x", "answer": 1, "solution": [{"name": "a"}]}\n',
     r"tasks.jsonl:1: solution\[0\] must be a list of calls"),
    ('{"prompt": "x", "answer": 1, "solution": "a"}\n',
     r'tasks.jsonl:1: "solution" must be a list of turns'),
    ('{"messages": [{"role": "user", "content": "x"}], "answer": 1}\n',
     r'tasks.jsonl:1: the mcp env reads "prompt" \(and "system"\), not "messages"'),
])
def test_task_file_errors_name_the_line(tmp_path, rows, match):
    (tmp_path / "tasks.jsonl").write_text(rows)
    with pytest.raises(TaskFileError, match=match):
        MCPEnv(tasks=str(tmp_path / "tasks.jsonl"))


def test_task_lists_reward_specs_and_base_dir(tmp_path, monkeypatch):
    with pytest.raises(TaskFileError, match=r'tasks\[1\]: "prompt" must be a non-empty string'):
        MCPEnv(tasks=[{"prompt": "a", "answer": 1}, {"prompt": ""}])
    with pytest.raises(ValueError, match="tasks: an empty list"):
        MCPEnv(tasks=[])
    with pytest.raises(ValueError, match=r"'no.jsonl' is none of these \(tasks file 'no.jsonl': "
                                         r"no such file"):
        MCPEnv(tasks="no.jsonl")
    (tmp_path / "r.py").write_text("def score(task, messages):\n    return 0.5\n"
                                   "def answer_only(answer):\n    return 1.0\n")
    (tmp_path / "t.jsonl").write_text('{"prompt": "no answer needed"}\n')
    with pytest.raises(ValueError, match=r"has no 'nope' \(its functions: answer_only, score\)"):
        MCPEnv(tasks=[{"prompt": "a"}], reward=f"{tmp_path / 'r.py'}:nope")
    with pytest.raises(ValueError, match=r"must take two arguments \(task, messages\)"):
        MCPEnv(tasks=[{"prompt": "a"}], reward=f"{tmp_path / 'r.py'}:answer_only")
    with pytest.raises(ValueError, match=r"must take two arguments \(task, messages\)"):
        MCPEnv(tasks=[{"prompt": "a"}], reward=lambda answer: 1.0)
    # relative task and reward files: the working directory, then base_dir (a config's folder)
    monkeypatch.chdir(os.path.dirname(tmp_path))
    env = MCPEnv(tasks="t.jsonl", reward="r.py:score", base_dir=str(tmp_path))
    assert env._task_list[0].data == {"prompt": "no answer needed"}
    assert env.clone().base_dir == str(tmp_path)
    env = MCPEnv(tasks=[{"prompt": "a", "id": "a"}], reward=lambda task, messages: 0.5)
    assert env._score_name.startswith("reward function test_task_lists_reward_specs")


def test_connection_call_errors(bad_server):
    conn = MCPConnection(bad_server).start()
    assert conn.call("echo", {"text": "é✓"}, 5.0) == "é✓"
    with pytest.raises(ToolError):
        conn.call("no_such_tool", {}, 5.0)
    assert conn.alive
    assert conn.close(wait=True) and not conn.alive
    with pytest.raises(MCPServerError, match="not running"):
        conn.call("echo", {"text": "x"}, 5.0)
