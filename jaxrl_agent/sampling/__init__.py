"""Samplers: the ``Sampler`` protocol, its dataclasses and the JAX KV-cache sampler.
See docs/sampling.md."""

from jaxrl_agent.sampling.base import (FinishReason, SampleOutput, Sampler, SamplingParams,
                                       validate_requests)
from jaxrl_agent.sampling.jax_sampler import (JaxSampler, process_logits, request_keys,
                                              sample_tokens)

__all__ = [
    "FinishReason", "SampleOutput", "Sampler", "SamplingParams", "validate_requests",
    "JaxSampler", "process_logits", "request_keys", "sample_tokens",
]
