"""Flax NNX decoder (Llama / Qwen2 / Qwen3) with an optional value head and LoRA adapters, KV
cache, HF checkpoint import/export and tokenizer loading. See docs/models.md."""

from jaxrl_agent.models.config import (ARCHITECTURES, FAMILIES, LORA_TARGETS, ROPE_TYPES,
                                       ModelConfig)
from jaxrl_agent.models.hf import (ParamSpec, from_hf_tensors, hf_param_map, hf_tensors, load_hf,
                                   load_model_folder, load_peft_adapter, save_hf,
                                   save_peft_adapter, spec_array, to_hf_tensors)
from jaxrl_agent.models.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer
from jaxrl_agent.models.transformer import (REMAT_POLICIES, KVCache, LoRAParam, ModelOutput,
                                            Transformer, init_cache, lora_init, lora_paths,
                                            merge_lora, policy_forward, remat_policy_name,
                                            rope_frequencies, segment_positions,
                                            token_logprobs, trainable_filter, values_at)

__all__ = [
    "ARCHITECTURES", "FAMILIES", "LORA_TARGETS", "ROPE_TYPES", "ModelConfig",
    "ParamSpec", "from_hf_tensors", "hf_param_map", "hf_tensors", "load_hf",
    "load_model_folder", "load_peft_adapter", "save_hf", "save_peft_adapter", "spec_array", "to_hf_tensors",
    "ChatTemplateError", "Tokenizer", "load_tokenizer",
    "REMAT_POLICIES", "KVCache", "LoRAParam", "ModelOutput", "Transformer", "init_cache",
    "lora_init", "lora_paths", "merge_lora", "policy_forward", "remat_policy_name",
    "rope_frequencies", "segment_positions", "token_logprobs", "trainable_filter", "values_at",
]
