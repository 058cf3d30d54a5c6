"""Flax NNX decoder (Llama / Qwen2 / Qwen3) with an optional value head, KV cache, HF
checkpoint import/export and tokenizer loading. See docs/models.md."""

from jaxrl_agent.models.config import ARCHITECTURES, FAMILIES, ROPE_TYPES, ModelConfig
from jaxrl_agent.models.hf import (ParamSpec, from_hf_tensors, hf_param_map, load_hf, save_hf,
                                   spec_array, to_hf_tensors)
from jaxrl_agent.models.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer
from jaxrl_agent.models.transformer import (REMAT_POLICIES, KVCache, ModelOutput, Transformer,
                                            init_cache, remat_policy_name,
                                            policy_forward, rope_frequencies, segment_positions,
                                            token_logprobs, values_at)

__all__ = [
    "ARCHITECTURES", "FAMILIES", "ROPE_TYPES", "ModelConfig",
    "ParamSpec", "from_hf_tensors", "hf_param_map", "load_hf", "save_hf", "spec_array",
    "to_hf_tensors",
    "ChatTemplateError", "Tokenizer", "load_tokenizer",
    "REMAT_POLICIES", "KVCache", "ModelOutput", "Transformer", "init_cache", "remat_policy_name",
    "policy_forward", "rope_frequencies",
    "segment_positions", "token_logprobs", "values_at",
]
