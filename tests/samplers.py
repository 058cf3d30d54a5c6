"""Checks the sampler test modules share (test_sampler.py: the JAX sampler; test_vllm_sampler.py:
vLLM)."""

from __future__ import annotations

from jaxrl_agent.sampling import SampleOutput, Sampler, SamplingParams


def assert_sampler_protocol(sampler, vocab: int, version: int) -> SampleOutput:
    """``sampler`` is a Sampler: one 3-token prompt and 4 new tokens give one SampleOutput (the
    prompt, 4 tokens of the vocabulary with a log-prob each, finished by length, stamped with
    ``version``), and no prompts give no outputs. Returns the output."""
    assert isinstance(sampler, Sampler)
    out = sampler.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    assert len(out) == 1 and isinstance(out[0], SampleOutput)
    o = out[0]
    assert o.prompt_token_ids == [1, 2, 3]
    assert len(o.token_ids) == len(o.logprobs) == 4
    assert all(isinstance(t, int) and 0 <= t < vocab for t in o.token_ids)
    assert o.finish_reason == "length" and o.policy_version == version
    assert sampler.generate([], SamplingParams()) == []
    return o
