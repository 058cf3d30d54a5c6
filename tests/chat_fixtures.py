"""Tiny local tokenizers that carry the special tokens of real instruct-model families, with
those families' real chat templates (``examples/chat_templates``; no hub access).

Each tokenizer is a byte-level BPE trained in memory on a few strings, with the family's
pre-tokenizer split pattern (the one Qwen2 / Llama 3 tokenizers use), its special tokens as
added special tokens and its markup tokens (``<think>``, ``<tool_call>``, ...) as added
ordinary tokens, saved as an HF folder (``tokenizer.json`` + ``tokenizer_config.json`` with
the chat template) and loaded with ``jaxrl_agent.models.load_tokenizer`` (either backend).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "examples" / "chat_templates"

# The pre-tokenizer split patterns of the Qwen2 and Llama 3 tokenizers.
_QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]

#: family -> template file, split pattern, special tokens, added ordinary tokens, the special
#: tokens' roles, whether encoding with special tokens adds BOS (as Llama 3's does), and the
#: text the template writes after an assistant message's content (its "close")
FAMILIES = {
    "qwen2.5": dict(template="qwen2.5-instruct", split=_QWEN_SPLIT, special=_QWEN_SPECIAL,
                    added=["<tool_call>", "</tool_call>"],
                    tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                    add_bos=False, close="<|im_end|>\n"),
    "qwen3": dict(template="qwen3", split=_QWEN_SPLIT, special=_QWEN_SPECIAL,
                  added=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                         "<think>", "</think>"],
                  tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                  add_bos=False, close="<|im_end|>\n"),
    "llama3.1": dict(template="llama3.1-instruct", split=_LLAMA_SPLIT, special=_LLAMA_SPECIAL,
                     added=[], tokens={"bos_token": "<|begin_of_text|>",
                                       "eos_token": "<|eot_id|>"},
                     add_bos=True, close="<|eot_id|>"),
    "llama3.2": dict(template="llama3.2-instruct", split=_LLAMA_SPLIT, special=_LLAMA_SPECIAL,
                     added=[], tokens={"bos_token": "<|begin_of_text|>",
                                       "eos_token": "<|eot_id|>"},
                     add_bos=True, close="<|eot_id|>"),
}

_CORPUS = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
    "system\nuser\nassistant\ntool\nipython\n\n",
    '{"name": "add", "arguments": {"a": 2, "b": 3}}',
    '{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}',
    "You may call one or more functions to assist with the user query.",
    "The agent moves north and sees a wall. The sum is 5, then 9.",
    "What is 2 + 2? It is 4. Thanks! You are welcome.",
    "Grüße, 世界! naïve café — ünïcödé ✓",
]


def load_template(name: str) -> str:
    """The chat template text of fixture ``name`` (its first line, the source note, dropped)."""
    text = (TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")
    first, rest = text.split("\n", 1)
    assert first.startswith("{#-") and "source:" in first, first
    return rest


def build_tokenizer_folder(family: str, folder) -> str:
    """Writes the tiny tokenizer of ``family`` (``FAMILIES``) with its chat template to
    ``folder`` and returns the folder."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, \
        processors, trainers

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS * 4, trainers.BpeTrainer(
        vocab_size=500, special_tokens=spec["special"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    if spec["add_bos"]:  # as Llama 3's tokenizer: BOS only when special tokens are asked for
        bos = spec["tokens"]["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
              "clean_up_tokenization_spaces": False, **spec["tokens"],
              "chat_template": load_template(spec["template"])}
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
    return folder


def make_chat_tokenizer(family: str, folder, backend: str = "tokenizers"):
    """``jaxrl_agent.models.Tokenizer`` of ``family`` through ``backend`` ("tokenizers" or
    "transformers"), built in ``folder``."""
    from jaxrl_agent.models.tokenizer import load_tokenizer

    if not os.path.exists(os.path.join(str(folder), "tokenizer.json")):
        build_tokenizer_folder(family, folder)
    return load_tokenizer(str(folder), backend=backend)
