"""Samplers: the ``Sampler`` protocol, its dataclasses, the JAX KV-cache sampler and the vLLM
sampler (``VllmSampler``; importing it does not import vLLM). See docs/sampling.md."""

from jaxrl_agent.sampling.base import (FinishReason, SampleOutput, Sampler, SamplingParams,
                                       validate_requests)
from jaxrl_agent.sampling.jax_sampler import (JaxSampler, process_logits, request_keys,
                                              sample_tokens)
from jaxrl_agent.sampling.vllm import VllmSampler, WeightSyncError

__all__ = [
    "FinishReason", "SampleOutput", "Sampler", "SamplingParams", "validate_requests",
    "JaxSampler", "process_logits", "request_keys", "sample_tokens", "VllmSampler",
    "WeightSyncError",
]
