"""Rollout collector: token-exact records, group resets, one generate call per turn, fault and
invalid-action handling, context truncation, and one run with the real JaxSampler."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.envs import Chain, GridWorld
from jaxrl_agent.rollout import ByteCodec, RolloutConfig, TextCodec, collect_groups
from jaxrl_agent.sampling import SampleOutput, Sampler
from jaxrl_agent.train.inputs import attach_env_inputs

CODEC = ByteCodec()
EOS = CODEC.eos_token_id
LP = -0.25


class HintGrid(GridWorld):
    """A grid world whose observation ends with the solver's action, so a scripted sampler can
    play it from the prompt tokens alone."""

    def observation(self) -> str:
        return super().observation() + "\nhint: " + self.solver()


class FlakyGrid(HintGrid):
    """Every other instance raises on its second step."""

    _count = itertools.count()

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.flaky = next(FlakyGrid._count) % 2 == 0

    def step(self, action):
        if self.flaky and self.turn == 1:
            raise RuntimeError("boom")
        return super().step(action)


class ScriptedSampler:
    """Returns ``policy(prompt_text)`` + EOS, logprobs ``LP``; counts calls and batch sizes."""

    def __init__(self, policy, version=3, eos=True):
        self.policy, self.version, self.eos = policy, version, eos
        self.calls, self.outputs = [], []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        outs = []
        for p in prompts:
            ids = CODEC.encode(self.policy(CODEC.decode(p))) + ([EOS] if self.eos else [])
            outs.append(SampleOutput(list(p), ids, [LP] * len(ids),
                                     "stop" if self.eos else "length", self.version))
        self.outputs.append(outs)
        return outs

    def sync_weights(self, model_or_state, version):
        self.version = version


def hint_policy(text):
    return text.rsplit("hint: ", 1)[1].split("\n", 1)[0]


def grid_tasks(n=3):
    return GridWorld().sample_tasks(0, n)


def check_tokens(records, layout):
    batch, index = pack_records(records, layout=layout)
    tokens = np.asarray(batch.tokens)
    mask = np.asarray(batch.action_mask)
    lps = np.asarray(batch.old_logprobs)
    for i, rec in enumerate(records):
        if layout == "concatenated":
            row = index.traj[i]
            want = [t for turn in rec["turns"] for t in turn["observation"] + turn["action"]]
            assert tokens[row, :len(want)].tolist() == want
            assert mask[row].sum() == sum(len(t["action"]) for t in rec["turns"])
        for k, turn in enumerate(rec["turns"]):
            row, start, stop = index.spans[i][k]
            assert tokens[row, start:stop].tolist() == turn["action"]
            assert mask[row, start:stop].all()
            np.testing.assert_allclose(lps[row, start:stop], turn["logprobs"], rtol=1e-6)
            if layout == "per_step":
                want = turn["observation"] + turn["action"]
                assert tokens[row, :len(want)].tolist() == want
                assert mask[row].sum() == len(turn["action"])
    return batch


def test_bytecodec_is_textcodec():
    assert isinstance(CODEC, TextCodec)
    assert CODEC.vocab_size == 260
    ids = CODEC.encode("héllo")
    assert min(ids) >= CODEC.offset and CODEC.decode(ids + [EOS]) == "héllo"


def test_solver_sampler_succeeds_and_records_are_token_exact():
    sampler = ScriptedSampler(hint_policy)
    assert isinstance(sampler, Sampler)
    cfg = RolloutConfig(group_size=2, max_turns=16, max_new_tokens=8)
    records, stats = collect_groups(HintGrid(), grid_tasks(3), sampler, CODEC, cfg, seed=0)
    assert len(records) == 6 and stats["trajectories"] == 6
    assert all(r["success"] == 1.0 and r["outcome"] == 1.0 for r in records)
    assert stats["successes"] == 6 and stats["success_rate"] == 1.0
    assert stats["env_errors"] == stats["invalid_actions"] == stats["truncated"] == 0
    # one generate call per turn, covering every live trajectory
    assert stats["generate_calls"] == len(sampler.calls) == max(len(r["turns"]) for r in records)
    assert sampler.calls[0] == 6
    for k, n in enumerate(sampler.calls):
        assert n == sum(len(r["turns"]) > k for r in records)
    # actions are exactly the sampled tokens (stop kept), the text had it stripped
    for r in records:
        assert r["policy_version"] == 3 and r["env_error"] is None and not r["truncated"]
        for t in r["turns"]:
            assert t["action"][-1] == EOS and EOS not in t["action"][:-1]
            assert len(t["logprobs"]) == len(t["action"])
            assert CODEC.encode(t["action_text"]) + [EOS] == t["action"]
    # the sampler's tokens are the recorded actions, in the sampler's order
    sampled = sorted(o.token_ids for outs in sampler.outputs for o in outs)
    assert sampled == sorted(t["action"] for r in records for t in r["turns"])
    assert stats["tokens_generated"] == sum(len(t["action"]) for r in records for t in r["turns"])
    # group resets: G rollouts of a task share the first observation and state key
    for a, b in zip(records[::2], records[1::2]):
        assert a["group"] == b["group"] == a["task"]
        assert a["turns"][0]["observation"] == b["turns"][0]["observation"]
        assert a["turns"][0]["state_key"] == b["turns"][0]["state_key"]
        assert a["turns"][0]["state_key"].startswith("grid:")
    assert records[0]["group"] != records[2]["group"]
    for layout in ("concatenated", "per_step"):
        check_tokens(records, layout)
    # the grid world's stages (key, door, goal) are recorded with each turn as the env
    # reported them; the loop turns them into subgoal boundaries for the methods that read
    # `switch` (train.inputs): a solved episode starts three subgoals, the first turn of each
    # has switch 1. The collected records are not changed.
    # (the grid world also reports its potential: recorded per turn as it reported it)
    assert all(set(t["turn_extras"]) == {"potential"} for r in records for t in r["turns"])
    marked = attach_env_inputs(records, ("switch", "turn_values"))
    assert all(set(t["turn_extras"]) == {"potential"} for r in records for t in r["turns"])
    for r in marked:
        goals = [t["subgoal"] for t in r["turns"]]
        assert goals[0] == "key" and goals[-1] == "goal"
        switch = [t["turn_extras"]["switch"] for t in r["turns"]]
        assert switch == [1.0] + [float(a != b) for a, b in zip(goals, goals[1:])]
        assert sum(switch) == 3
    batch = pack_records(marked, layout="per_step")[0]
    assert float(np.asarray(batch.extras["switch"]).sum()) == 3 * len(records)
    assert attach_env_inputs(records, ("turn_values",)) is records  # nothing to attach


def test_prompts_are_history_plus_new_observation():
    sampler = ScriptedSampler(hint_policy)
    records, _ = collect_groups(HintGrid(), grid_tasks(1), sampler, CODEC,
                                RolloutConfig(group_size=1, max_new_tokens=8), seed=0)
    turns = records[0]["turns"]
    for k, outs in enumerate(sampler.outputs):
        want = [t for turn in turns[:k] for t in turn["observation"] + turn["action"]]
        assert outs[0].prompt_token_ids == want + turns[k]["observation"]
    # the state key is the one before the action: turn k+1's key differs after a move
    assert turns[0]["state_key"] != turns[-1]["state_key"]


def test_env_error_flags_record_and_run_continues():
    sampler = ScriptedSampler(hint_policy)
    cfg = RolloutConfig(group_size=2, max_new_tokens=8)
    records, stats = collect_groups(FlakyGrid, grid_tasks(2), sampler, CODEC, cfg, seed=0)
    assert len(records) == 4
    bad = [r for r in records if r["env_error"]]
    good = [r for r in records if not r["env_error"]]
    assert bad and good and stats["env_errors"] == len(bad)
    for r in bad:
        assert "boom" in r["env_error"] and r["success"] == 0.0 and len(r["turns"]) == 2
    assert all(r["success"] == 1.0 for r in good)
    check_tokens(records, "per_step")


@pytest.mark.parametrize("on_invalid", ["penalise", "fail"])
def test_invalid_actions(on_invalid):
    sampler = ScriptedSampler(lambda text: "jump")
    cfg = RolloutConfig(group_size=2, max_turns=3, max_new_tokens=8, on_invalid=on_invalid)
    records, stats = collect_groups(GridWorld(), grid_tasks(1), sampler, CODEC, cfg, seed=0)
    k = 3 if on_invalid == "penalise" else 1
    assert stats["invalid_actions"] == 2 * k
    for r in records:
        assert r["invalid"] == k and len(r["turns"]) == k and r["success"] == 0.0
        assert r["outcome"] == pytest.approx(-0.1 * k)
        assert r["truncated"] == (on_invalid == "penalise")  # config max_turns reached
    check_tokens(records, "concatenated")


def test_max_context_tokens_truncates():
    env = HintGrid()
    task = grid_tasks(1)[0]
    obs0, _ = env.reset(task)
    first = len(CODEC.encode(obs0 + "\n"))
    cfg = RolloutConfig(group_size=2, max_new_tokens=8, max_context_tokens=first + 8 + 10)
    sampler = ScriptedSampler(hint_policy)
    records, stats = collect_groups(env, [task], sampler, CODEC, cfg, seed=0)
    assert len(sampler.calls) == 1
    for r in records:
        assert len(r["turns"]) == 1 and r["truncated"] and r["context_truncated"]
    assert stats["context_truncated"] == 2 and stats["truncated"] == 2
    # too small for even the first turn: dropped
    cfg = RolloutConfig(group_size=2, max_new_tokens=8, max_context_tokens=first)
    records, stats = collect_groups(env, [task], ScriptedSampler(hint_policy), CODEC, cfg)
    assert records == [] and stats["dropped"] == 2


def test_unstopped_actions_keep_all_tokens():
    sampler = ScriptedSampler(lambda text: "up", eos=False)
    cfg = RolloutConfig(group_size=1, max_turns=2, max_new_tokens=8)
    records, _ = collect_groups(GridWorld(), grid_tasks(1), sampler, CODEC, cfg)
    for t in records[0]["turns"]:
        assert t["action"] == CODEC.encode("up") and t["finish_reason"] == "length"


def test_config_validation():
    with pytest.raises(ValueError, match="on_invalid"):
        RolloutConfig(on_invalid="ignore")
    with pytest.raises(ValueError, match="group_size"):
        RolloutConfig(group_size=0)


def test_real_jax_sampler_on_chain():
    from flax import nnx

    from jaxrl_agent.models import ModelConfig, Transformer
    from jaxrl_agent.sampling import JaxSampler

    config = ModelConfig(vocab_size=CODEC.vocab_size, hidden_size=64, intermediate_size=128,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32,
                         max_position_embeddings=512)
    model = Transformer(config, rngs=nnx.Rngs(0))
    inner = JaxSampler(model, batch_buckets=(4,), len_buckets=(64,), new_token_buckets=(8,),
                       seed=0, policy_version=7)

    class Recording:
        def __init__(self):
            self.outputs = []

        def generate(self, prompts, params):
            out = inner.generate(prompts, params)
            self.outputs.extend(out)
            return out

        def sync_weights(self, m, v):
            inner.sync_weights(m, v)

    sampler = Recording()
    env = Chain()
    cfg = RolloutConfig(group_size=2, max_turns=2, max_new_tokens=8, max_context_tokens=64)
    records, stats = collect_groups(env, env.sample_tasks(0, 2), sampler, CODEC, cfg, seed=1)
    assert len(records) == 4 and stats["generate_calls"] == 2
    turns = [t for r in records for t in r["turns"]]
    assert len(turns) == len(sampler.outputs) == 8
    for t in turns:
        out = next(o for o in sampler.outputs
                   if o.token_ids == t["action"] and o.logprobs == t["logprobs"])
        assert len(out.logprobs) == len(t["action"]) >= 1
        assert np.all(np.isfinite(t["logprobs"]))
    assert all(r["policy_version"] == 7 for r in records)
    # concatenated prompts: turn 1's prompt is turn 0's observation + action + new observation
    for r in records:
        if len(r["turns"]) == 2:
            t0, t1 = r["turns"]
            assert any(o.prompt_token_ids == t0["observation"] + t0["action"] + t1["observation"]
                       for o in sampler.outputs)
    # per-request seeds: the same seed reproduces the run
    again, _ = collect_groups(env, env.sample_tasks(0, 2), sampler, CODEC, cfg, seed=1)
    assert [r["turns"] for r in again] == [r["turns"] for r in records]
    for layout in ("concatenated", "per_step"):
        check_tokens(records, layout)


def test_project_tokenizer_is_a_textcodec(tmp_path):
    pytest.importorskip("transformers")
    from jaxrl_agent.models.tokenizer import load_tokenizer
    from tests.hf_fixtures import make_tokenizer

    make_tokenizer(tmp_path, None)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, TextCodec) and tok.eos_token_id is not None
    assert tok.decode(tok.encode("up")) == "up"
