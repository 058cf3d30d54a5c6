"""Writes a tiny random Qwen2 checkpoint folder in Hugging Face format, with a tokenizer that
carries Qwen2.5-Instruct's real chat template (tool calls included).

    python examples/make_tiny_checkpoint.py /tmp/tiny-qwen2

No hub access and no torch: the weights come from the NNX model (``save_hf``) and the
byte-level BPE tokenizer is trained on a small built-in corpus with ``tokenizers`` (install
the ``hf`` extra). The folder loads with ``jaxrl_agent.models.load_hf`` and with
``transformers.AutoModelForCausalLM.from_pretrained``; use it to try conversion and sampling.
"""

import json
import os
import sys

#: the chat template of Qwen2.5-Instruct (its tool-call format included), as vendored in
#: examples/chat_templates/ (the first line there is a note on where it comes from)
TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates",
                        "qwen2.5-instruct.jinja")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
CORPUS = [f"the agent adds {a} and {b} to get {a + b} then answers" for a in range(40)
          for b in range(0, 40, 7)] + ["user assistant system tool call result error"] * 20 + [
    '{"name": "calculate", "arguments": {"expression": "3 + 4"}}',
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "# Tools\n\nYou may call one or more functions to assist with the user query."] * 10


def chat_template() -> str:
    with open(TEMPLATE, encoding="utf-8") as f:
        first, rest = f.read().split("\n", 1)
    return rest if first.startswith("{#-") else first + "\n" + rest


def write_tokenizer(folder: str) -> int:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        sys.exit("make_tiny_checkpoint.py needs the tokenizers package: pip install -e '.[hf]' "
                 "(the test extra has it too)")

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(TOOL_TOKENS)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "bos_token": None,
                   "chat_template": chat_template()}, f, indent=2)
    return tok.get_vocab_size()


def main(folder: str) -> None:
    from flax import nnx

    from jaxrl_agent.models import ModelConfig, Transformer, save_hf

    os.makedirs(folder, exist_ok=True)
    vocab = write_tokenizer(folder)
    config = ModelConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                         max_position_embeddings=512, family="qwen2", qkv_bias=True,
                         eos_token_id=SPECIALS.index("<|im_end|>"),
                         pad_token_id=SPECIALS.index("<|endoftext|>"))
    save_hf(Transformer(config, rngs=nnx.Rngs(0)), config, folder)
    print(f"wrote a tiny random Qwen2 checkpoint ({vocab} tokens) and its tokenizer to {folder}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    main(sys.argv[1])
