"""Chat-template rollouts (``RolloutConfig.chat``): the held ids are the sampled ids verbatim
plus the template's own tokens, through the real chat templates of Qwen2.5-Instruct, Qwen3 and
Llama 3.1 / 3.2 Instruct (``examples/chat_templates``) on tiny local tokenizers that
carry those families' special tokens, rendered by both tokenizer backends.

The oracle is the codec's own ``apply_chat_template`` of the whole conversation (transformers'
renderer with the "transformers" backend), never the collector's bookkeeping."""

from __future__ import annotations

import copy
import json
import re
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_agent.envs.base import StepResult, Task
from jaxrl_agent.models.tokenizer import load_tokenizer
from jaxrl_agent.rollout import ByteCodec, RolloutConfig, collect_groups
from jaxrl_agent.rollout.chat import ChatTemplate, ChatTemplateWarning, observation_messages
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.sampling import SampleOutput
from tests.chat_fixtures import FAMILIES, build_tokenizer_folder, make_chat_tokenizer

LP = -0.5
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                     "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
STABLE = ("qwen2.5", "llama3.1", "llama3.2")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """``tokenizer(family, backend)``: the family's tiny tokenizer, built once per module."""
    root = tmp_path_factory.mktemp("chat_tokenizers")
    made = {}

    def get(family, backend="tokenizers"):
        if (family, backend) not in made:
            if backend == "transformers":
                pytest.importorskip("transformers")
            made[family, backend] = make_chat_tokenizer(family, root / family, backend)
        return made[family, backend]
    return get


def close_ids(tok, family, stopped):
    """The template's tokens after an assistant's content, less the sampled end-of-turn."""
    ids = tok.encode(FAMILIES[family]["close"])
    return ids[1:] if stopped else ids


# ----------------------------------------------------------------------------- scripted parts

class ScriptEnv:
    """Plays ``task.data``: a list of observation-message lists. ``reset`` gives the first,
    step ``k`` the ``(k+1)``-th, and the step after the last ends the episode (success). One
    user/tool message travels as ``observation_role``, several as ``observation_messages``."""

    def __init__(self, tools=None, system_prompt=None):
        self.tools = tools or []
        if system_prompt is not None:
            self.system_prompt = system_prompt
        self.actions = []

    def clone(self):
        return ScriptEnv(self.tools, getattr(self, "system_prompt", None))

    def fork(self):
        return copy.deepcopy(self)

    def sample_tasks(self, rng, n, split="train"):
        raise NotImplementedError

    def _observe(self, k):
        msgs = self.script[k]
        info = {"state_key": f"s{k}"}
        if len(msgs) == 1:
            info["observation_role"] = msgs[0]["role"]
            return msgs[0]["content"], info
        info["observation_messages"] = [dict(m) for m in msgs]
        return "\n".join(m["content"] for m in msgs), info

    def reset(self, task):
        self.script, self.k, self.actions = task.data, 0, []
        return self._observe(0)

    def step(self, action):
        self.actions.append(action)
        self.k += 1
        if self.k >= len(self.script):
            return StepResult("", 1.0, True, {"success": True, "state_key": "end"})
        text, info = self._observe(self.k)
        return StepResult(text, 0.0, False, info)


class ScriptSampler:
    """Returns the scripted ids of each turn (every trajectory plays the same script)."""

    def __init__(self, replies):
        self.replies = replies  # [(ids, stopped)]
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        ids, stopped = self.replies[len(self.calls) - 1]
        return [SampleOutput(list(p), list(ids), [LP] * len(ids), "stop" if stopped else "length",
                             1) for p in prompts]


def run_script(tok, obs, replies, *, tools=None, system=None, group_size=1, **cfg):
    """Collects the scripted conversation; replies: [(text, stopped)]. Returns (records,
    stats, sampler, sampled ids per turn)."""
    eot = ChatTemplate(tok).end_of_turn_id
    sampled = [(tok.encode(text) + ([eot] if stopped else []), stopped)
               for text, stopped in replies]
    sampler = ScriptSampler(sampled)
    config = RolloutConfig(group_size=group_size, max_turns=len(replies), max_new_tokens=64,
                           max_context_tokens=1 << 16, chat=True, **cfg)
    task = Task("script", "t0", "train", obs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ChatTemplateWarning)
        records, stats = collect_groups(ScriptEnv(tools, system), [task], sampler, tok, config,
                                        seed=0)
    return records, stats, sampler, [ids for ids, _ in sampled]


def conversation(obs, replies, upto, *, verbatim=False):
    """Messages of the script up to (and including) observation ``upto``; assistant messages
    carry ``reasoning_content: ""`` when ``verbatim`` (Qwen3 then renders them as given)."""
    out = []
    for k in range(upto + 1):
        if k:
            msg = {"role": "assistant", "content": replies[k - 1][0]}
            if verbatim:
                msg["reasoning_content"] = ""
            out.append(msg)
        out.extend(dict(m) for m in obs[k])
    return out


def template_ids(tok, messages, system=None, tools=None, gen=True):
    head = [{"role": "system", "content": system}] if system is not None else []
    kw = {"tools": tools} if tools else {}
    return tok.apply_chat_template(head + messages, add_generation_prompt=gen, **kw)


def held_and_mask(records):
    batch, index = pack_records(records, layout="concatenated")
    row = index.traj[0]
    n = sum(len(t["observation"]) + len(t["action"]) for t in records[0]["turns"])
    tokens, mask = np.asarray(batch.tokens)[row], np.asarray(batch.action_mask)[row]
    assert not mask[n:].any()
    return tokens[:n].tolist(), mask[:n].tolist()


# ------------------------------------------------------------------------ property test

_TEXT = st.text(alphabet=st.sampled_from(list("abcXYZ019 .,!?{}\":\n\t-_<>/") +
                                         ["é", "ß", "世", "界", "✓", "🙂", "\u00a0"]),
                max_size=14)
_OBS_TEXT = st.one_of(_TEXT, st.sampled_from(["", " ", "\n", "  padded  ", "Grüße, 世界",
                                              '{"result": 5}', "<tool_call>x</tool_call>"]))
_MESSAGE = st.builds(lambda role, content: {"role": role, "content": content},
                     st.sampled_from(["user", "tool"]), _OBS_TEXT)
_REPLY = st.one_of(
    _TEXT.map(str.strip),
    st.builds(lambda r, c: f"<think>\n{r}\n</think>\n\n{c}".strip(),
              _TEXT.map(str.strip).filter(bool), _TEXT.map(str.strip)))


@st.composite
def scripts(draw):
    n = draw(st.integers(1, 4))
    obs = [draw(st.lists(_MESSAGE, min_size=1, max_size=2)) for _ in range(n)]
    replies = []
    for _ in range(n):
        text = draw(_REPLY)
        stopped = draw(st.booleans()) if text else True  # an action has >= 1 token
        replies.append((text, stopped))
    tools = [ADD_TOOL] if draw(st.booleans()) else None
    system = draw(st.sampled_from([None, "Be brief.", "Système: réponds ✓"]))
    return obs, replies, tools, system


@pytest.mark.parametrize("family,backend", [
    ("qwen2.5", "tokenizers"), ("qwen2.5", "transformers"), ("llama3.1", "tokenizers"),
    ("llama3.2", "transformers"), ("qwen3", "tokenizers"), ("qwen3", "transformers")])
@settings(max_examples=15, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(script=scripts())
def test_held_ids_are_the_templates_render(tokenizer, family, backend, script):
    """Every prompt is the template's render of the conversation so far (Qwen3: with each
    assistant message rendered as sampled), the held ids are the prompts plus the sampled ids,
    and the action mask covers exactly the sampled assistant spans; for prefix-stable
    templates the held ids are the render of the whole conversation."""
    tok = tokenizer(family, backend)
    obs, replies, tools, system = script
    records, stats, sampler, sampled = run_script(tok, obs, replies, tools=tools, system=system)
    assert len(records) == 1 and len(records[0]["turns"]) == len(replies)
    turns = records[0]["turns"]
    verbatim = family not in STABLE
    held, mask = held_and_mask(records)
    want_mask = [False] * len(held)
    for k, (prompts, _) in enumerate(sampler.calls):
        oracle = template_ids(tok, conversation(obs, replies, k, verbatim=verbatim), system,
                              tools)
        assert prompts[0] == oracle  # what the sampler saw is the template's render
        assert held[:len(oracle)] == oracle  # ... and a prefix of the held ids
        assert turns[k]["action"] == sampled[k]  # sampled ids verbatim
        want_mask[len(oracle):len(oracle) + len(sampled[k])] = [True] * len(sampled[k])
    assert held == sampler.calls[-1][0][0] + sampled[-1]
    assert mask == want_mask  # exactly the sampled assistant tokens
    assert [t["action_text"] for t in turns] == [text for text, _ in replies]
    pack_records(records, layout="per_step")
    last = conversation(obs, replies, len(replies) - 1)
    if family in STABLE:
        assert stats["chat_template_prefix_stable"] == 1 and stats["chat_rerender_differs"] == 0
        whole = last + [{"role": "assistant", "content": replies[-1][0]}]
        assert held + close_ids(tok, family, replies[-1][1]) == \
            template_ids(tok, whole, system, tools, gen=False)
    else:  # the documented policy: held as sampled; the plain re-render may differ
        assert stats["chat_template_prefix_stable"] == 0
        plain = template_ids(tok, last, system, tools)
        differs = len(replies) > 1 and plain != sampler.calls[-1][0][0]
        assert stats["chat_rerender_differs"] == int(differs)


def test_qwen3_rewrites_history_and_is_flagged(tokenizer):
    """Qwen3 drops the <think> block of assistant turns before the last user message: the
    probe flags it (one warning), the held ids keep the sampled reasoning, and the count of
    trajectories whose re-render differs says so."""
    tok = tokenizer("qwen3")
    template = ChatTemplate(tok)
    assert not template.prefix_stable and template.probe["reasoning"] == "differs"
    assert template.probe["plain"] == template.probe["tool"] == "ok"
    obs = [[{"role": "user", "content": "What is 2 + 2?"}],
           [{"role": "user", "content": "And 3 + 3?"}]]
    replies = [("<think>\nfour\n</think>\n\nIt is 4.", True), ("It is 6.", True)]
    records, stats, sampler, sampled = run_script(tok, obs, replies)
    held, _ = held_and_mask(records)
    assert "<think>\nfour\n</think>" in tok.decode(held)
    plain = template_ids(tok, conversation(obs, replies, 1))
    assert "<think>" not in tok.decode(plain) and plain != sampler.calls[-1][0][0]
    assert stats["chat_template_prefix_stable"] == 0 and stats["chat_rerender_differs"] == 1
    # the warning comes once per template and process
    from jaxrl_agent.rollout import chat as chat_module
    chat_module._WARNED.discard(tok.chat_template)
    config = RolloutConfig(group_size=1, max_turns=2, max_new_tokens=64, chat=True)
    task = Task("script", "t0", "train", obs)
    for expect in (1, 0):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            collect_groups(ScriptEnv(), [task], ScriptSampler([(s, True) for s in sampled]),
                           tok, config)
        hits = [w for w in caught if issubclass(w.category, ChatTemplateWarning)]
        assert len(hits) == expect
        if expect:
            assert "rollout.chat" in str(hits[0].message) and "as held" in str(hits[0].message)


# --------------------------------------------------------------------------- end to end

class AddEnv:
    """Adds two numbers with an ``add`` tool: the question is a user message, an action with a
    ``<tool_call>`` gets the tool's result as a ``tool`` message (a malformed call is an
    invalid action), any other action is the answer (done; success when it is the sum)."""

    tools = [ADD_TOOL]
    system_prompt = "You add numbers."

    def clone(self):
        return AddEnv()

    def fork(self):
        return copy.deepcopy(self)

    def sample_tasks(self, rng, n, split="train"):
        return [Task("add", f"{a}+{b}", split, (a, b)) for a, b in [(2, 3), (40, 2)][:n]]

    def reset(self, task):
        self.a, self.b = task.data
        return f"What is {self.a} + {self.b}?", {"state_key": task.key}

    def step(self, action):
        if "<tool_call>" in action:
            try:
                call = json.loads(action.split("<tool_call>")[1].split("</tool_call>")[0])
                result = str(sum(call["arguments"].values()))
            except (ValueError, KeyError, IndexError, AttributeError):
                return StepResult("malformed tool call", -0.1, False, {
                    "invalid_action": True, "observation_role": "tool", "state_key": "bad"})
            return StepResult(result, 0.0, False, {"observation_role": "tool",
                                                   "tool_name": "add", "state_key": "tool"})
        ok = action.strip() == str(self.a + self.b)
        return StepResult("", float(ok), True, {"success": ok, "state_key": "end"})


class ToolPolicySampler:
    """Turn 0: calls ``add`` with the last two numbers of the prompt; turn 1: answers with the
    last number of the prompt (the tool's result). Ends every action with ``eot``."""

    def __init__(self, tok, eot):
        self.tok, self.eot, self.calls = tok, eot, []

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params))
        outs = []
        for p in prompts:
            nums = re.findall(r"\d+", self.tok.decode(p))
            if len(self.calls) == 1:
                text = ('<tool_call>\n{"name": "add", "arguments": {"a": %s, "b": %s}}\n'
                        '</tool_call>' % (nums[-2], nums[-1]))
            else:
                text = nums[-1]
            ids = self.tok.encode(text) + [self.eot]
            outs.append(SampleOutput(list(p), ids, [LP] * len(ids), "stop", 2))
        return outs


@pytest.mark.parametrize("family,backend", [
    ("qwen2.5", "tokenizers"), ("qwen2.5", "transformers"), ("qwen3", "transformers"),
    ("llama3.1", "transformers"), ("llama3.2", "tokenizers")])
def test_tool_env_end_to_end(tokenizer, family, backend):
    """``collect_groups`` on a tool env with a scripted policy: tools and the env's system
    prompt reach the template, tool results come back as tool messages, every prompt is a
    prefix of the held ids, records pack in both layouts with masks on the sampled tokens."""
    tok = tokenizer(family, backend)
    eot = ChatTemplate(tok).end_of_turn_id
    assert eot == tok.token_to_id(FAMILIES[family]["close"].rstrip("\n"))
    env = AddEnv()
    tasks = env.sample_tasks(0, 2)
    sampler = ToolPolicySampler(tok, eot)
    config = RolloutConfig(group_size=2, max_turns=4, max_new_tokens=64, chat=True)
    records, stats = collect_groups(env, tasks, sampler, tok, config, seed=0)
    assert len(records) == 4 and stats["success_rate"] == 1.0 and stats["generate_calls"] == 2
    assert all(eot in p.stop_token_ids for p in sampler.calls[0][1])
    first = tok.decode(records[0]["turns"][0]["observation"])
    assert "You add numbers." in first and '"name": "add"' in first
    for i, rec in enumerate(records):
        a, b = tasks[i // 2].data
        t0, t1 = rec["turns"]
        assert sampler.calls[0][0][i] == t0["observation"]
        assert sampler.calls[1][0][i] == t0["observation"] + t0["action"] + t1["observation"]
        assert t1["action_text"] == str(a + b) and t0["action"][-1] == eot
        # the tool result came back as a tool message, after the rest of the assistant's close
        new = tok.decode(t1["observation"])
        assert str(a + b) in new and new.startswith(tok.decode(close_ids(tok, family, True)))
        messages = [{"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": t0["action_text"]},
                    {"role": "tool", "content": str(a + b), "name": "add"},
                    {"role": "assistant", "content": t1["action_text"]}]
        whole = template_ids(tok, messages, "You add numbers.", [ADD_TOOL], gen=False)
        held = t0["observation"] + t0["action"] + t1["observation"] + t1["action"]
        if family in STABLE:
            assert held + close_ids(tok, family, True) == whole
    for layout in ("concatenated", "per_step"):
        batch, index = pack_records(records, layout=layout)
        tokens, mask = np.asarray(batch.tokens), np.asarray(batch.action_mask)
        lps = np.asarray(batch.old_logprobs)
        for i, rec in enumerate(records):
            for k, turn in enumerate(rec["turns"]):
                row, start, stop = index.spans[i][k]
                assert tokens[row, start:stop].tolist() == turn["action"]
                assert mask[row, start:stop].all()
                np.testing.assert_allclose(lps[row, start:stop], LP)
        assert int(mask.sum()) == sum(len(t["action"]) for r in records for t in r["turns"])
    # the config's system prompt wins over the env's
    cfg = RolloutConfig(group_size=1, max_turns=4, max_new_tokens=64, chat=True,
                        system_prompt="Config says hi.")
    records, _ = collect_groups(env, tasks[:1], ToolPolicySampler(tok, eot), tok, cfg)
    first = tok.decode(records[0]["turns"][0]["observation"])
    assert "Config says hi." in first and "You add numbers." not in first


def test_history_last_and_tree_rollouts(tokenizer):
    """``history="last"``: every prompt is the render of [system?, newest observation]; tree
    rollouts copy the conversation into every fork."""
    tok = tokenizer("qwen2.5")
    eot = ChatTemplate(tok).end_of_turn_id
    env = AddEnv()
    tasks = env.sample_tasks(0, 1)
    cfg = RolloutConfig(group_size=1, max_turns=4, max_new_tokens=64, chat=True, history="last")
    sampler = ToolPolicySampler(tok, eot)
    records, stats = collect_groups(env, tasks, sampler, tok, cfg)
    t0, t1 = records[0]["turns"]
    system = "You add numbers."
    assert t0["observation"] == template_ids(
        tok, [{"role": "user", "content": "What is 2 + 3?"}], system, [ADD_TOOL])
    assert t1["observation"] == template_ids(
        tok, [{"role": "tool", "content": "5", "name": "add"}], system, [ADD_TOOL])
    assert sampler.calls[1][0][0] == t1["observation"] and "chat_rerender_differs" in stats
    pack_records(records, layout="per_step")
    cfg = RolloutConfig(group_size=1, max_turns=4, max_new_tokens=64, chat=True,
                        branch_turns=(1,), branch_factor=2)
    sampler = ToolPolicySampler(tok, eot)
    records, stats = collect_groups(env, tasks, sampler, tok, cfg)
    assert len(records) == 2 and stats["forks"] == 1 and stats["success_rate"] == 1.0
    assert records[0]["turns"] == records[1]["turns"]
    assert stats["chat_rerender_differs"] == 0


def test_default_stop_tokens_add_the_end_of_turn_token(tmp_path):
    """A codec whose EOS is not the template's end-of-turn token (a base model's tokenizer)
    stops on both by default; explicit stop_token_ids are kept as given."""
    folder = build_tokenizer_folder("qwen2.5", tmp_path / "base")
    cfg_path = folder + "/tokenizer_config.json"
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["eos_token"] = "<|endoftext|>"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    tok = load_tokenizer(folder, backend="tokenizers")
    im_end, eos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.eos_token_id == eos != im_end
    sampler = ToolPolicySampler(tok, im_end)
    config = RolloutConfig(group_size=1, max_turns=4, max_new_tokens=64, chat=True)
    records, _ = collect_groups(AddEnv(), AddEnv().sample_tasks(0, 1), sampler, tok, config)
    assert sampler.calls[0][1][0].stop_token_ids == (eos, im_end)
    assert records[0]["turns"][0]["action_text"].endswith("</tool_call>")  # stop removed
    sampler = ToolPolicySampler(tok, im_end)
    config = RolloutConfig(group_size=1, max_turns=4, max_new_tokens=64, chat=True,
                           stop_token_ids=(im_end,))
    collect_groups(AddEnv(), AddEnv().sample_tasks(0, 1), sampler, tok, config)
    assert sampler.calls[0][1][0].stop_token_ids == (im_end,)


# -------------------------------------------------------------------------------- errors

def test_codec_without_chat_template_is_a_clear_error(tmp_path):
    env = AddEnv()
    config = RolloutConfig(group_size=1, max_turns=2, chat=True)
    with pytest.raises(ValueError, match=r"rollout\.chat.*\(ByteCodec\) has no chat template"):
        collect_groups(env, env.sample_tasks(0, 1), ToolPolicySampler(None, 2), ByteCodec(),
                       config)
    folder = build_tokenizer_folder("qwen2.5", tmp_path / "plain")
    with open(folder + "/tokenizer_config.json") as f:
        cfg = json.load(f)
    del cfg["chat_template"]
    with open(folder + "/tokenizer_config.json", "w") as f:
        json.dump(cfg, f)
    tok = load_tokenizer(folder, backend="tokenizers")
    with pytest.raises(ValueError, match=r"rollout\.chat.*Tokenizer\) has no chat template"):
        collect_groups(env, env.sample_tasks(0, 1), ToolPolicySampler(tok, tok.token_to_id("<|im_end|>")), tok, config)


def test_bad_observation_messages_and_config():
    assert observation_messages("hi", None) == [{"role": "user", "content": "hi"}]
    assert observation_messages("5", {"observation_role": "tool", "tool_name": "add"}) == \
        [{"role": "tool", "content": "5", "name": "add"}]
    with pytest.raises(ValueError, match=r"observation_role.*one of \('user', 'tool'\)"):
        observation_messages("x", {"observation_role": "assistant"})
    with pytest.raises(ValueError, match=r"observation_messages.*non-empty list"):
        observation_messages("x", {"observation_messages": []})
    with pytest.raises(ValueError, match=r"observation_messages'\]\[0\].*content must be a str"):
        observation_messages("x", {"observation_messages": [{"role": "tool", "content": 5}]})
    with pytest.raises(ValueError, match="RolloutConfig.chat must be a bool"):
        RolloutConfig(chat="yes")
    with pytest.raises(ValueError, match="RolloutConfig.system_prompt must be a str or None"):
        RolloutConfig(system_prompt=3)


def test_env_with_a_bad_role_names_the_env(tokenizer):
    tok = tokenizer("qwen2.5")

    class BadRole(AddEnv):
        def clone(self):
            return BadRole()

        def reset(self, task):
            obs, info = super().reset(task)
            return obs, {**info, "observation_role": "system"}

    config = RolloutConfig(group_size=1, max_turns=2, chat=True)
    with pytest.raises(ValueError, match=r"rollout\.chat: env BadRole, task add:2\+3: "
                                         r"info\['observation_role'\]"):
        collect_groups(BadRole(), AddEnv().sample_tasks(0, 1), ToolPolicySampler(tok, tok.token_to_id("<|im_end|>")), tok,
                       config)
    with pytest.raises(ValueError, match=r"tools must be a list"):
        ChatTemplate(tok, tools="add")


def test_env_whose_tools_raise_loses_only_that_trajectory(tokenizer):
    """Reading ``env.tools`` that raises (a tool server gone) ends that trajectory like a
    failed reset; the others go on."""
    tok = tokenizer("qwen2.5")

    class Flaky(AddEnv):
        count = 0

        def clone(self):
            return Flaky()

        @property
        def tools(self):
            Flaky.count += 1
            if Flaky.count == 2:
                raise ConnectionError("tool server gone")
            return [ADD_TOOL]

    config = RolloutConfig(group_size=2, max_turns=4, max_new_tokens=64, chat=True)
    records, stats = collect_groups(Flaky(), AddEnv().sample_tasks(0, 1),
                                    ToolPolicySampler(tok, tok.token_to_id("<|im_end|>")), tok, config)
    assert len(records) == 1 and stats["dropped"] == 1 and stats["env_errors"] == 1
    assert records[0]["success"] == 1.0


def test_task_file_few_shot_history_comes_before_the_first_observation(tokenizer, tmp_path):
    """A task given as messages: its system message and earlier turns (``TaskEnv``'s
    ``system_prompt`` and ``context_messages``) open the conversation the sampler sees."""
    from jaxrl_agent.envs import TaskEnv

    tok = tokenizer("qwen2.5")
    msgs = [{"role": "system", "content": "Answer with one word."},
            {"role": "user", "content": "The opposite of up?"},
            {"role": "assistant", "content": "down"},
            {"role": "user", "content": "The opposite of hot?"}]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "o", "messages": msgs, "answer": "cold",
                                "split": "train"}) + "\n")
    reward = tmp_path / "r.py"
    reward.write_text("def score(task, messages):\n    return 1.0\n")
    env = TaskEnv(str(path), f"{reward}:score")
    eot = ChatTemplate(tok).end_of_turn_id
    sampler = ScriptSampler([(tok.encode("cold") + [eot], True)])
    config = RolloutConfig(group_size=1, max_turns=1, max_new_tokens=8,
                           max_context_tokens=1 << 12, chat=True)
    [task] = env.sample_tasks(0, 1, "train")
    records, _ = collect_groups(env, [task], sampler, tok, config, seed=0)
    assert sampler.calls[0][0][0] == template_ids(tok, msgs)
    assert records[0]["turns"][0]["observation"] == template_ids(tok, msgs)


PHI3_STYLE = ("{% for m in messages %}{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}"
              "<|end|>{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
              "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>"
              "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_a_template_that_drops_tool_messages_is_refused(tmp_path):
    """A Phi-3-style template with no branch for the tool role renders tool results as nothing:
    an agent with tools would be blind to them, so collection refuses, naming the role and the
    ways out."""
    folder = build_tokenizer_folder("qwen2.5", tmp_path / "phi")
    with open(folder + "/tokenizer_config.json") as f:
        cfg = json.load(f)
    cfg["chat_template"] = PHI3_STYLE
    with open(folder + "/tokenizer_config.json", "w") as f:
        json.dump(cfg, f)
    tok = load_tokenizer(folder, backend="tokenizers")
    assert ChatTemplate(tok, tools=[ADD_TOOL]).silent_roles == ("tool",)
    env = AddEnv()
    config = RolloutConfig(group_size=1, max_turns=2, chat=True)
    with pytest.raises(ValueError, match=r"renders 'tool' messages as nothing.*observation_role"):
        collect_groups(env, env.sample_tasks(0, 1), ToolPolicySampler(tok, tok.token_to_id(
            "<|im_end|>")), tok, config)

    class NoSchemas(AddEnv):  # sends tool-role observations without declaring its tools
        tools = None

        def clone(self):
            return NoSchemas()

    env = NoSchemas()
    with pytest.raises(ValueError, match=r"env NoSchemas, task .*renders 'tool' messages as "
                                         r"nothing.*observation_role"):
        collect_groups(env, env.sample_tasks(0, 1), ToolPolicySampler(tok, tok.token_to_id(
            "<|im_end|>")), tok, config)
