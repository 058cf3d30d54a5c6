"""Tokenizer loading for a local HF folder: ``transformers.AutoTokenizer`` when installed,
else ``tokenizers.Tokenizer.from_file("tokenizer.json")`` with the chat template rendered by
jinja2 the way transformers renders it.

Token ids are the currency of the library: the sampler produces ids, environments' text is
encoded once, and nothing re-tokenises text between sampler and trainer.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any, Sequence


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template (or the template failed to render)."""


def _token_str(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


class Tokenizer:
    """A thin, backend-independent tokenizer.

    Attributes:
      backend: ``"transformers"`` or ``"tokenizers"``.
      eos_token_id, pad_token_id, bos_token_id: ids or None (``pad_token_id`` falls back to
        ``eos_token_id`` when the tokenizer has no pad token).
      chat_template: the Jinja template string or None.
      vocab_size: number of ids including added tokens.
    """

    def __init__(self, backend: str, impl: Any, *, chat_template: str | None,
                 special_tokens: dict):
        self.backend = backend
        self._impl = impl
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.eos_token_id = self.token_to_id(self.special_tokens.get("eos_token"))
        self.bos_token_id = self.token_to_id(self.special_tokens.get("bos_token"))
        pad = self.token_to_id(self.special_tokens.get("pad_token"))
        self.pad_token_id = pad if pad is not None else self.eos_token_id

    def token_to_id(self, token: str | None) -> int | None:
        """The id of a token string (None if ``token`` is None or unknown)."""
        if token is None:
            return None
        if self.backend == "transformers":
            vocab = self._impl.get_vocab()
            return int(vocab[token]) if token in vocab else None
        return self._impl.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        if self.backend == "transformers":
            return len(self._impl)
        return self._impl.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` False by default (no BOS/EOS added):
        text appended to a conversation must not gain special tokens."""
        if self.backend == "transformers":
            return list(self._impl.encode(text, add_special_tokens=add_special_tokens))
        return list(self._impl.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (both backends take the same call)."""
        return self._impl.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    **template_kwargs) -> str:
        """The chat template rendered to text (jinja2, sandboxed, ``trim_blocks`` and
        ``lstrip_blocks``, with ``raise_exception``, ``strftime_now`` and a non-escaping
        ``tojson`` as in transformers; the special tokens are available as ``bos_token``,
        ``eos_token``, ...)."""
        if not self.chat_template:
            raise ChatTemplateError(
                "this tokenizer has no chat template (no 'chat_template' in tokenizer_config.json "
                "and no chat_template.jinja): encode the prompt yourself with encode()")
        if self.backend == "transformers":
            return self._impl.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tokenize=False,
                **template_kwargs)
        return _render(self.chat_template, messages=list(messages),
                       add_generation_prompt=add_generation_prompt,
                       **{**self.special_tokens, **template_kwargs})

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        """Token ids of the conversation ``messages`` (``[{"role", "content"}, ...]``) under the
        tokenizer's chat template, ending with the assistant prompt when
        ``add_generation_prompt``. The rendered text is encoded without adding special tokens
        (the template writes them), exactly as ``transformers`` does.

        Raises:
          ChatTemplateError (a ValueError): the tokenizer has no chat template.
        """
        if not self.chat_template:
            self.render_chat(messages)  # raises the explanatory error
        if self.backend == "transformers":
            out = self._impl.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False, **template_kwargs)
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return [int(i) for i in out]
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """The template compiled once (compiling takes ~20 ms; chat rollouts render every turn)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def _render(template: str, **kwargs) -> str:
    import jinja2

    compiled = _compiled(template)
    try:
        return compiled.render(**kwargs)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e


def _read_chat_template(folder: str, tok_config: dict) -> str | None:
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    path = os.path.join(folder, "chat_template.json")
    if os.path.exists(path):
        with open(path) as f:
            t = json.load(f).get("chat_template")
            if t:
                return t
    t = tok_config.get("chat_template")
    if isinstance(t, list):  # [{"name": ..., "template": ...}]
        named = {d.get("name"): d.get("template") for d in t}
        t = named.get("default") or next(iter(named.values()), None)
    return t or None


_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")

#: the files of an HF folder that make up its tokenizer (copied beside converted or trained
#: weights)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
                   "generation_config.json")


def load_tokenizer(folder: str, backend: str | None = None) -> Tokenizer:
    """Loads the tokenizer of a local HF folder.

    Args:
      folder: holds ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``).
      backend: ``"transformers"`` (``AutoTokenizer.from_pretrained``), ``"tokenizers"``
        (``tokenizers.Tokenizer.from_file``; special tokens and chat template read from
        ``tokenizer_config.json`` / ``chat_template.jinja``) or None: transformers when
        importable, else tokenizers.
    """
    # We use only transformers' tokenizers: its "PyTorch was not found" advice is noise here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if backend is None:
        try:
            import transformers  # noqa: F401
            backend = "transformers"
        except ImportError:
            backend = "tokenizers"
    tok_config = {}
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            tok_config = json.load(f)
    if backend == "transformers":
        from transformers import AutoTokenizer

        impl = AutoTokenizer.from_pretrained(folder)
        template = getattr(impl, "chat_template", None) or _read_chat_template(folder, tok_config)
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        special = {k: getattr(impl, k, None) for k in _SPECIAL_KEYS}
        special = {k: (str(v) if v is not None else None) for k, v in special.items()}
        return Tokenizer("transformers", impl, chat_template=template, special_tokens=special)
    if backend != "tokenizers":
        raise ValueError(f"backend must be 'transformers', 'tokenizers' or None, got {backend!r}")
    from tokenizers import Tokenizer as _HFTokenizer

    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{folder}: no tokenizer.json")
    impl = _HFTokenizer.from_file(path)
    special = {k: _token_str(tok_config.get(k)) for k in _SPECIAL_KEYS}
    return Tokenizer("tokenizers", impl, chat_template=_read_chat_template(folder, tok_config),
                     special_tokens=special)
