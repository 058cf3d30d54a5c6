"""Builders of tiny local HF checkpoints and tokenizers for the model tests (no hub access).

Importing this module needs torch and transformers; tests import it after
``pytest.importorskip``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

VOCAB = 256

# name -> (family, config kwargs). Small but covering every option the loader maps.
VARIANTS = {
    # Llama, untied, head_dim != hidden/heads, Llama 3.1 rope
    "llama_llama3": ("llama", dict(
        hidden_size=64, intermediate_size=128, head_dim=32, tie_word_embeddings=False,
        max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # Llama, tied, q/k/v/o and MLP biases, yarn rope
    "llama_yarn_bias_tied": ("llama", dict(
        hidden_size=128, intermediate_size=192, tie_word_embeddings=True, attention_bias=True,
        mlp_bias=True, max_position_embeddings=64, rope_theta=500.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
    # Llama, linear rope
    "llama_linear": ("llama", dict(
        hidden_size=128, intermediate_size=256, tie_word_embeddings=False,
        max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # Llama, dynamic NTK rope; the tests run past max_position_embeddings (16)
    "llama_dynamic": ("llama", dict(
        hidden_size=128, intermediate_size=256, tie_word_embeddings=False,
        max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    # Qwen2: q/k/v bias, tied
    "qwen2_tied": ("qwen2", dict(
        hidden_size=128, intermediate_size=256, tie_word_embeddings=True,
        max_position_embeddings=64, rope_theta=1e6)),
    # Qwen3: q/k norm, untied, head_dim 32 on hidden 64
    "qwen3": ("qwen3", dict(
        hidden_size=64, intermediate_size=128, head_dim=32, tie_word_embeddings=False,
        max_position_embeddings=64)),
}

_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


def make_hf_model(family: str, folder, seed: int = 0, **overrides):
    """Builds a random tiny ``*ForCausalLM`` in float32 eval mode, saves it to ``folder`` and
    returns it. Weights have std 0.1 (not HF's 0.02) and norm weights and biases are perturbed,
    so logits are O(1) and a wrong RoPE, mask or bias shows up far above the 1e-4 tolerance."""
    cfg_cls, model_cls = _CLASSES[family]
    kw = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=1,
              initializer_range=0.1)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    return model


def make_tokenizer(folder, chat_template: str | None):
    """Trains a tiny byte-level BPE (vocab 300) locally, saves it with
    ``PreTrainedTokenizerFast.save_pretrained`` and writes ``chat_template`` into
    ``tokenizer_config.json`` (the older place for it; transformers 5 writes
    ``chat_template.jinja``, which is removed so the config is the only source)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [f"the agent moves {d} and sees {o} at step {i}" for i in range(50)
              for d, o in (("north", "a wall"), ("east", "a key"), ("south", "the door"))]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
        bos_token="<|endoftext|>")
    hf_tok.save_pretrained(str(folder))
    jinja = os.path.join(str(folder), "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    cfg_path = os.path.join(str(folder), "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return folder


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
