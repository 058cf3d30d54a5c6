"""Tests of jaxrl_agent.envs.tools: the tool-call parser, argument checks, tools and ToolEnv."""

import json

import pytest
from hypothesis import given, strategies as st

from jaxrl_agent.envs.base import SafeEnv, Task, run_episode, solver_policy, split_of
from jaxrl_agent.envs.tasks import RewardError
from jaxrl_agent.envs.tools import (FunctionTool, Tool, ToolCall, ToolCallError, ToolEnv,
                                    ToolEnvironmentError, ToolError, check_arguments,
                                    final_answer_text, format_tool_calls, parse_tool_calls,
                                    tool_schema)

# --- the parser -----------------------------------------------------------------------------


def test_hermes_blocks_with_text_around():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call>\nand also <tool_call>{"name": "echo", "arguments": {"text": "hé ✓"}}'
            '</tool_call> done')
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2}),
                                      ToolCall("echo", {"text": "hé ✓"})]


@pytest.mark.parametrize("text, calls", [
    ('{"name": "add", "arguments": {"a": 1}}', [ToolCall("add", {"a": 1})]),
    ('  [{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"x": [1]}}]\n',
     [ToolCall("a"), ToolCall("b", {"x": [1]})]),
    ('```json\n{"name": "add", "arguments": "{\\"a\\": 3}"}\n```', [ToolCall("add", {"a": 3})]),
    ('{"type": "function", "function": {"name": "f", "arguments": "{}"}}', [ToolCall("f")]),
    ('<tool_call>{"name": "f", "arguments": null}</tool_call>', [ToolCall("f")]),
    ('<tool_call>{"name": "f"}</tool_call>', [ToolCall("f")]),
    ('<tool_call>[{"name": "f"}, {"name": "g", "arguments": ""}]</tool_call>',
     [ToolCall("f"), ToolCall("g")]),
    ("The answer is 42.", []),
    ("", []),
    ('{"answer": 42}', []),  # JSON, but not a call: a final answer
    ("[1, 2, 3]", []),
    ("{not json and no name}", []),
])
def test_formats(text, calls):
    assert parse_tool_calls(text) == calls


@pytest.mark.parametrize("text, words", [
    ("<tool_call>{\"name\": \"f\", \"arguments\": {}}", "never closed"),
    ("<tool_call><tool_call>{\"name\": \"f\"}</tool_call></tool_call>", "nested"),
    ("</tool_call> x", "closes no"),
    ("<tool_call>{\"name\": \"f\", \"argum</tool_call>", "not valid JSON"),
    ("<tool_call>{\"arguments\": {}}</tool_call>", 'no "name"'),
    ("<tool_call>{\"name\": 3}</tool_call>", "non-empty string"),
    ("<tool_call>{\"name\": \"  \"}</tool_call>", "non-empty string"),
    ("<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>", "must be a JSON object"),
    ("<tool_call>{\"name\": \"f\", \"arguments\": \"[1]\"}</tool_call>", "must be a JSON object"),
    ("<tool_call>{\"name\": \"f\", \"arguments\": \"{oops\"}</tool_call>", "arguments string"),
    ("<tool_call>  </tool_call>", "empty"),
    ("<tool_call>[]</tool_call>", "empty JSON list"),
    ("<tool_call>\"f\"</tool_call>", "got a string"),
    ('{"name": "f", "arguments": {"a": ', "not valid JSON"),
    ('[{"name": "f"}, 3]', "tool call 2"),
    ("<tool_call>" + "[" * 100000 + "</tool_call>", "not valid JSON"),
])
def test_malformed_calls_say_what_is_wrong(text, words):
    with pytest.raises(ToolCallError, match=words.replace("(", r"\(")):
        parse_tool_calls(text)


def test_non_text_messages():
    assert parse_tool_calls(b'{"name": "f"}') == [ToolCall("f")]
    with pytest.raises(ToolCallError, match="UTF-8"):
        parse_tool_calls(b"\xff\xfe<tool_call>")
    with pytest.raises(ToolCallError, match="must be text"):
        parse_tool_calls(None)
    assert issubclass(ToolCallError, ValueError)


def test_final_answer_text_drops_reasoning():
    assert final_answer_text("<think>maybe 3</think>\n 42 ") == "42"
    assert final_answer_text(" 7 ") == "7"


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids,
                                                              max_size=3),
    max_leaves=8)
_names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12).filter(
    lambda s: s.strip() == s and s)
_calls = st.builds(ToolCall, _names, st.dictionaries(st.text(max_size=6), _json_values,
                                                     max_size=3))


@given(st.lists(_calls, min_size=1, max_size=3), st.text(max_size=20), st.text(max_size=20))
def test_formatted_calls_parse_back(calls, before, after):
    text = format_tool_calls(calls)
    assert parse_tool_calls(text) == calls
    if "<tool_call>" not in before + after and "</tool_call>" not in before + after:
        assert parse_tool_calls(before + text + after) == calls


_pieces = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', ":",
                           '"arguments"', ",", '"f"', '"{\\"a\\": 1}"', "null", "3", "é✓",
                           "\x00", "\\u", '"', "```json\n", "\n```", " "])


@st.composite
def _malformed(draw):
    """Truncated, spliced or mutated calls, random tag soups and unicode."""
    kind = draw(st.sampled_from(["truncate", "splice", "soup", "text", "types", "nameless",
                                 "nested"]))
    base = format_tool_calls(draw(st.lists(_calls, min_size=1, max_size=2)))
    if kind == "truncate":
        return base[:draw(st.integers(0, len(base)))]
    if kind == "splice":
        i = draw(st.integers(0, len(base)))
        return base[:i] + draw(st.text(max_size=6)) + base[i + draw(st.integers(0, 4)):]
    if kind == "soup":
        return "".join(draw(st.lists(_pieces, max_size=14)))
    if kind == "text":
        return draw(st.text(max_size=40))
    if kind == "types":
        name, args = draw(_json_values), draw(_json_values)
        body = json.dumps({"name": name, "arguments": args})
        return draw(st.sampled_from([body, f"<tool_call>{body}</tool_call>"]))
    if kind == "nameless":
        body = json.dumps({"arguments": draw(_json_values)}, ensure_ascii=False)
        return draw(st.sampled_from([body, f"<tool_call>{body}</tool_call>"]))
    inner = draw(st.sampled_from(["<tool_call>", "</tool_call>"]))
    return base.replace("\n{", "\n" + inner + "{", 1)


@given(_malformed())
def test_parser_raises_only_tool_call_error(text):
    try:
        calls = parse_tool_calls(text)
    except ToolCallError as e:
        assert str(e)
        return
    assert all(isinstance(c, ToolCall) and isinstance(c.name, str) and c.name.strip()
               and isinstance(c.arguments, dict) for c in calls)


# --- argument checks, schemas, tools -----------------------------------------------------------

SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer"}, "b": {"type": ["number", "null"]},
                         "mode": {"enum": ["x", "y"]},
                         "opt": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "sub": {"type": "object", "properties": {"k": {"type": "boolean"}},
                                 "required": ["k"]}},
          "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize("args, problem", [
    ({"a": 1}, None),
    ({"a": 2.0, "b": None, "mode": "x", "opt": None, "tags": ["t"], "sub": {"k": True}}, None),
    ({}, "missing required argument 'a'"),
    ({"a": True}, "a must be integer, got boolean"),
    ({"a": "1"}, "a must be integer, got string"),
    ({"a": 1.5}, "a must be integer, got number"),
    ({"a": 1, "b": "2"}, "b must be number or null"),
    ({"a": 1, "mode": "z"}, "mode must be one of"),
    ({"a": 1, "opt": 3}, "opt matches none"),
    ({"a": 1, "tags": ["t", 3]}, r"tags\[1\] must be string"),
    ({"a": 1, "sub": {}}, "sub needs 'k'"),
    ({"a": 1, "sub": {"k": 1}}, "sub.k must be boolean"),
    ({"a": 1, "zzz": 1}, "unknown argument 'zzz'"),
])
def test_check_arguments(args, problem):
    if problem is None:
        check_arguments(SCHEMA, args, tool="t")
    else:
        with pytest.raises(ToolCallError, match="t: " + problem):
            check_arguments(SCHEMA, args, tool="t")


def test_function_tool_and_schema():
    def add(a: int, b: int = 0, note: str | None = None) -> int:
        """Adds two integers.

        More text."""
        return a + b

    tool = FunctionTool(add)
    assert isinstance(tool, Tool)
    assert tool(a=2, b=3) == "5"
    s = tool_schema(tool)
    assert s == {"type": "function", "function": {
        "name": "add", "description": "Adds two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"},
            "note": {"type": ["string", "null"]}},
            "required": ["a"], "additionalProperties": False}}}
    assert tool_schema(s) == s
    assert tool_schema({"name": "m", "inputSchema": {"type": "object"}})["function"] == {
        "name": "m", "description": "", "parameters": {"type": "object"}}
    with pytest.raises(ValueError, match="name"):
        tool_schema({"description": "no name"})
    with pytest.raises(ValueError, match="JSON schema"):
        FunctionTool(add, parameters=[1])


# --- ToolEnv ------------------------------------------------------------------------------------


def _add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


def _lookup(key: str) -> str:
    """Looks a word up."""
    table = {"x": "17", "y": "25"}
    if key not in table:
        raise ToolError(f"no entry {key!r}")
    return table[key]


def _broken(text: str) -> str:
    """Always fails."""
    raise RuntimeError("bug inside the tool")


class SumEnv(ToolEnv):
    """Toy task: add the looked-up values of two keys (x and y) plus a number."""

    family = "sum"

    def __init__(self, fail_env: bool = False, **kw):
        kw.setdefault("tools", [FunctionTool(_add), FunctionTool(_lookup), FunctionTool(_broken)])
        super().__init__(**kw)
        self.fail_env = fail_env

    def _config(self):
        return dict(super()._config(), fail_env=self.fail_env)

    def call_tool(self, call):
        if self.fail_env and call.name == "_add":
            raise ToolEnvironmentError("the add server is gone")
        return super().call_tool(call)

    def _make_task(self, rng):
        n = rng.randint(1, 50)
        return Task(self.family, str(n), split_of(f"sum:{n}"), {"n": n, "answer": 42 + n})

    def prompt(self):
        return f"x + y + {self.task.data['n']}?"

    def score(self, messages):
        return float(final_answer_text(messages[-1]["content"]) == str(self.task.data["answer"]))

    def solver(self):
        made = [c.name for c, _ in self.calls]
        if "_lookup" not in made:
            return format_tool_calls([ToolCall("_lookup", {"key": "x"}),
                                      ToolCall("_lookup", {"key": "y"})])
        if "_add" not in made:
            return format_tool_calls([ToolCall("_add", {"a": 42, "b": self.task.data["n"]})])
        return f"<think>done</think>{self.task.data['answer']}"


def test_tool_env_solver_episode():
    env = SumEnv()
    assert [t["function"]["name"] for t in env.tools] == ["_add", "_lookup", "_broken"]
    for task in env.sample_tasks(0, 5, "train") + env.sample_tasks(0, 3, "test"):
        ep = run_episode(env, solver_policy(env), task)
        assert ep.success and ep.rewards == [0.0, 0.0, 1.0], ep
        assert [i["observation_role"] for i in ep.infos] == ["tool", "tool", "user"]
        assert ep.observations[1] == "_lookup: 17\n_lookup: 25"
        assert ep.infos[0]["observation_messages"] == [
            {"role": "tool", "name": "_lookup", "content": "17"},
            {"role": "tool", "name": "_lookup", "content": "25"}]
        assert ep.infos[1]["tool_name"] == "_add"
        assert ep.observations[2] == str(42 + task.data["n"])
        assert not any(i["invalid_action"] for i in ep.infos)
    obs, info = env.reset(task)
    assert obs == env.prompt() and info["observation_role"] == "user" and info["turn"] == 0


def test_tool_env_invalid_actions_and_tool_errors():
    env = SumEnv(invalid_penalty=-0.5)
    task = env.sample_tasks(1, 1)[0]
    _, info0 = env.reset(task)
    cases = [
        ('<tool_call>{"name": "nope"}</tool_call>', "unknown tool 'nope'"),
        ('<tool_call>{"name": "_add", "arguments": {"a": "1", "b": 2}}</tool_call>',
         "_add: a must be integer"),
        ('<tool_call>{"name": "_add", "arguments": {"a": 1}}</tool_call>', "missing required"),
        ('<tool_call>{"name": "_add", "arguments": {"a": 1, "b": 2, "c": 3}}</tool_call>',
         "unknown argument 'c'"),
        ('<tool_call>{"name": "_add", "argu', "never closed"),
        (12345, "must be text"),
    ]
    for action, words in cases:
        res = env.step(action)
        assert res.info["invalid_action"] and not res.done and res.reward == -0.5
        assert res.observation.startswith("error: ") and words in res.observation, res
        assert res.info["observation_role"] == "user"
        assert res.info["state_key"] == info0["state_key"]  # nothing ran
    res = env.step('<tool_call>{"name": "_lookup", "arguments": {"key": "zz"}}</tool_call>')
    assert not res.info["invalid_action"] and res.info["tool_error"]
    assert res.observation == "error: no entry 'zz'" and res.reward == 0.0
    res = env.step('<tool_call>{"name": "_broken", "arguments": {"text": "A"}}</tool_call>')
    assert res.observation == "error: RuntimeError: bug inside the tool"
    assert res.info["state_key"] != info0["state_key"]
    assert env.turn == 8 and res.done and res.info["truncated"]  # max_turns = 8


def test_tool_env_limits_and_env_failure():
    env = SumEnv(max_calls_per_turn=2, max_calls=3, max_result_chars=5)
    env.reset(env.sample_tasks(2, 1)[0])
    three = format_tool_calls([ToolCall("_lookup", {"key": "x"})] * 3)
    res = env.step(three)
    assert res.info["invalid_action"] and "3 calls in one message (at most 2)" in res.observation
    res = env.step(format_tool_calls([ToolCall("_add", {"a": 10**9, "b": 1})] * 2))
    assert res.observation == "_add: 10000 ...[truncated]\n_add: 10000 ...[truncated]"
    res = env.step(format_tool_calls([ToolCall("_add", {"a": 1, "b": 1})] * 2))
    assert res.done and res.info["call_limit"] and res.info["success"] is False
    env = SumEnv(invalid_ends=True)
    env.reset(env.sample_tasks(2, 1)[0])
    res = env.step("<tool_call>")
    assert res.done and res.info["success"] is False and res.info["invalid_action"]
    env = SumEnv(fail_env=True)
    env.reset(env.sample_tasks(2, 1)[0])
    res = env.step(format_tool_calls([ToolCall("_add", {"a": 1, "b": 1})]))
    assert res.done and res.reward == 0.0 and res.info["success"] is False
    assert "the add server is gone" in res.info["env_error"]
    with pytest.raises(RuntimeError, match="done"):
        env.step("x")


def test_tool_env_final_answer_and_wrong_answer():
    env = SumEnv()
    task = env.sample_tasks(3, 1)[0]
    env.reset(task)
    res = env.step("I think it is 7")
    assert res.done and res.reward == 0.0 and res.info["success"] is False
    assert res.info["observation_role"] == "user" and not res.info["invalid_action"]


def test_tool_env_keeps_the_conversation_the_reward_function_reads():
    env = SumEnv(system_prompt="Use the tools.")
    task = env.sample_tasks(5, 1)[0]
    seen = []
    env.score = lambda messages: seen.append(messages) or 1.0
    env.reset(task)
    assert env.messages == [{"role": "system", "content": "Use the tools."},
                            {"role": "user", "content": env.prompt()}]
    first = env.solver()
    env.step(first)
    env.step(b'<tool_call>{"name": "nope"}</tool_call>')  # invalid: an error as a user message
    second = env.solver()
    env.step(second)
    res = env.step("<think>sum</think> 99")
    assert res.done and res.reward == 1.0 and res.info["success"]
    (messages,) = seen
    assert messages == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": env.prompt()},
        {"role": "assistant", "content": first},
        {"role": "tool", "name": "_lookup", "content": "17"},
        {"role": "tool", "name": "_lookup", "content": "25"},
        {"role": "assistant", "content": '<tool_call>{"name": "nope"}</tool_call>'},
        {"role": "user", "content": "error: unknown tool 'nope' (tools: _add, _broken, _lookup)"},
        {"role": "assistant", "content": second},
        {"role": "tool", "name": "_add", "content": str(42 + task.data["n"])},
        {"role": "assistant", "content": "<think>sum</think> 99"}]
    assert env.messages == messages  # the reward function got a copy
    messages.clear()
    assert len(env.messages) == 10
    env.reset(task)
    assert env.step(12345).info["invalid_action"] and env.messages[-2]["content"] == "12345"


class HintEnv(SumEnv):
    """A wrong final answer gets a hint and the episode goes on; results name other keys."""

    def score(self, messages):
        answer = final_answer_text(messages[-1]["content"])
        if answer == str(self.task.data["answer"]):
            return {"reward": 1.0, "info": {"judged": True}}
        if answer == "give up":
            return {"reward": -1.0, "observation": "bye", "done": True, "success": False}
        if answer == "typo":
            return {"reward": 0.0, "rewards": 1.0}
        return {"reward": 0.0, "observation": "Not quite: use the tools."}


def test_tool_env_reward_dicts_continue_or_end_the_episode():
    env = HintEnv(max_turns=6)
    task = env.sample_tasks(6, 1)[0]
    _, info0 = env.reset(task)
    res = env.step("7")
    assert (res.observation, res.reward, res.done) == ("Not quite: use the tools.", 0.0, False)
    assert res.info["observation_role"] == "user" and "success" not in res.info
    assert env.messages[-1] == {"role": "user", "content": "Not quite: use the tools."}
    assert res.info["state_key"] != info0["state_key"]  # an answered answer changes the state
    fork = env.fork()
    while not env.done:
        res = env.step(env.solver())
    assert res.reward == 1.0 and res.info["success"] and res.info["judged"]
    assert fork.messages[-1]["content"] == "Not quite: use the tools." and not fork.done
    res = fork.step("give up")  # the fork goes its own way from the hint
    assert (res.observation, res.reward, res.done, res.info["success"]) == ("bye", -1.0, True,
                                                                            False)
    env = HintEnv(max_turns=2)  # the turn limit ends a hinted episode unsuccessfully
    env.reset(task)
    env.step("1")
    res = env.step("2")
    assert res.done and res.info["truncated"] and res.info["success"] is False
    env.reset(task)
    with pytest.raises(RewardError, match=r"HintEnv.score \(task sum:\d+, turn 1\) returned a "
                                          r"dict with unknown key 'rewards'"):
        env.step("typo")
    safe = SafeEnv(HintEnv())
    safe.reset(task)
    res = safe.step("typo")
    assert res.done and res.info["env_error"].startswith("RewardError: HintEnv.score")


def test_tool_env_clone_and_fork_are_independent():
    env = SumEnv(max_turns=5)
    task = env.sample_tasks(4, 1)[0]
    env.reset(task)
    env.step(env.solver())
    fork = env.fork()
    clone = env.clone()
    assert clone.max_turns == 5 and clone.task is None
    assert fork.state_key() == env.state_key() and fork.turn == env.turn
    a, b = env.step(env.solver()), fork.step(fork.solver())
    assert a.observation == b.observation and a.info["state_key"] == b.info["state_key"]
    env.step("wrong")
    assert not fork.done and fork.step(fork.solver()).info["success"]


_actions = st.one_of(
    _malformed(),
    st.builds(lambda calls: format_tool_calls(calls), st.lists(st.builds(
        ToolCall, st.sampled_from(["_add", "_lookup", "_broken", "nope"]),
        st.dictionaries(st.sampled_from(["a", "b", "key", "text", "zz"]), _json_values,
                        max_size=3)), min_size=1, max_size=3)),
    st.sampled_from(["42", "", "<think>hmm</think>", "43"]),
    st.binary(max_size=10),
)


@given(st.lists(_actions, min_size=1, max_size=6), st.integers(0, 50))
def test_tool_env_never_raises(actions, seed):
    env = SafeEnv(SumEnv(max_turns=4))
    task = env.sample_tasks(seed, 1)[0]
    env.reset(task)
    for action in actions:
        res = env.step(action)
        assert "env_error" not in res.info, res.info
        assert isinstance(res.observation, str) and isinstance(res.reward, float)
        assert res.info["observation_role"] in ("user", "tool")
        if res.done:
            break


def test_tool_env_needs_distinct_tool_names():
    with pytest.raises(ValueError, match="two tools are named"):
        SumEnv(tools=[FunctionTool(_add), FunctionTool(_add)])
    with pytest.raises(ValueError, match="max_calls"):
        SumEnv(max_calls=0)
