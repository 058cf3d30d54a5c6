"""The sampler contract: ``SamplingParams``, ``SampleOutput``, the ``Sampler`` protocol and the
host-side request validation every sampler shares.

Token in, token out: prompts are lists of token ids and outputs are lists of token ids. No
sampler detokenises and re-tokenises, so the tokens the trainer sees are exactly the tokens
that were sampled, and their log-probs refer to those tokens.

Policy versions: the trainer calls ``sampler.sync_weights(params, version)`` after each
update; every ``SampleOutput`` carries the ``policy_version`` of the weights that produced
all of its tokens (a sampler never switches weights in the middle of a ``generate`` call).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import jax.numpy as jnp
import numpy as np
from flax import nnx

FinishReason = Literal["stop", "length"]

_SEED_LIMIT = 2 ** 64


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (the names and defaults follow vLLM's ``SamplingParams``).

    Attributes:
      temperature: softmax temperature; ``0`` means greedy (argmax, ``top_k``/``top_p`` and
        ``seed`` are then irrelevant).
      top_k: keep only the ``top_k`` most likely tokens (ties at the boundary are all kept);
        ``0`` turns it off.
      top_p: nucleus sampling: keep the most likely tokens whose cumulative probability
        (after temperature and top-k) first reaches ``top_p``; ``1.0`` turns it off.
      max_new_tokens: the most tokens to generate (>= 1).
      stop_token_ids: generation of a row ends right after it samples one of these ids (the
        stop token is part of the output). Nothing is added implicitly: pass the tokenizer's
        EOS id here if it should stop generation.
      seed: ``None`` derives the request's random stream from the sampler's own key, a
        per-call counter and the request's index in the call (so repeated calls differ);
        an int in ``[0, 2**64)`` fixes the stream: the same seed, prompt, parameters and
        weights give the same tokens whatever else is in the batch.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, numbers.Integral):
            ids = (ids,)
        object.__setattr__(self, "stop_token_ids",
                           tuple(int(i) if isinstance(i, numbers.Integral) else i for i in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """One generated continuation.

    Attributes:
      prompt_token_ids: the prompt, as given.
      token_ids: the generated tokens, including the stop token when one was hit.
      logprobs: one float per generated token: its log-probability under the distribution it
        was actually sampled from (see ``docs/sampling.md``, "Log-prob semantics").
      finish_reason: ``"stop"`` (the last token is a stop token) or ``"length"`` (the
        request's ``max_new_tokens`` was reached).
      policy_version: the version of the weights that produced every token of this output
        (the ``version`` of the last ``sync_weights`` before the ``generate`` call).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int


@runtime_checkable
class Sampler(Protocol):
    """What the rollout code needs from a sampler (the JAX sampler here, vLLM on GPUs)."""

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[SampleOutput]:
        """Samples one continuation per prompt; ``params`` is one ``SamplingParams`` for all
        prompts or one per prompt. Returns the outputs in prompt order. Raises ``ValueError``
        (naming the request index and the field) for invalid requests, before any work."""
        ...

    def sync_weights(self, model_or_state: Any, version: int) -> None:
        """Replaces the sampler's weights by the trainer's and records their policy version."""
        ...


def synced_params(model_or_state: Any, like: Mapping, *filters) -> dict:
    """The weights a ``sync_weights`` call was given, checked against the sampler's own.

    Args:
      model_or_state: a ``Transformer`` (its ``nnx.state(model, *filters)``), an ``nnx.State``
        or a nested pure dict of arrays.
      like: the sampler's parameters as a nested pure dict (arrays or ``ShapeDtypeStruct``s).

    Returns:
      ``{path: array}`` for every leaf path of ``like``, cast to its dtype; entries of
      ``model_or_state`` that ``like`` lacks (a trainer's value head) are ignored.

    Raises:
      ValueError: the input type, a missing parameter or a shape mismatch, naming the path.
    """
    src = model_or_state
    if isinstance(src, nnx.Module):
        src = nnx.state(src, *filters)
    if isinstance(src, nnx.State):
        src = nnx.to_pure_dict(src)
    if not isinstance(src, Mapping):
        raise ValueError("sync_weights takes a Transformer, an nnx.State or a pure dict of "
                         f"arrays, got {type(model_or_state).__name__}")
    flat = nnx.traversals.flatten_mapping(src)
    out = {}
    for path, want in nnx.traversals.flatten_mapping(like).items():
        name = ".".join(str(p) for p in path)
        if path not in flat:
            raise ValueError(f"sync_weights: parameter {name} is missing")
        x = flat[path]
        if isinstance(x, nnx.Variable):
            x = x[...]
        if tuple(np.shape(x)) != tuple(want.shape):
            raise ValueError(f"sync_weights: parameter {name} has shape {tuple(np.shape(x))}, "
                             f"the sampler's model has {tuple(want.shape)}")
        out[path] = jnp.asarray(x, dtype=want.dtype)
    return out


def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (numbers.Real, np.floating, np.integer)) and not isinstance(
        x, (bool, np.bool_))


def check_params(i: int, p: SamplingParams, *, vocab_size: int) -> None:
    """Validates one request's ``SamplingParams``; ``ValueError`` names request ``i`` and the
    field."""
    if not isinstance(p, SamplingParams):
        raise ValueError(f"request {i}: params must be a SamplingParams, got {type(p).__name__}")
    where = f"request {i}: SamplingParams"
    if not _is_real(p.temperature) or not np.isfinite(p.temperature) or p.temperature < 0:
        raise ValueError(f"{where}.temperature must be a finite number >= 0 (0 = greedy), "
                         f"got {p.temperature!r}")
    if not _is_int(p.top_k) or p.top_k < 0:
        raise ValueError(f"{where}.top_k must be an int >= 0 (0 = off), got {p.top_k!r}")
    if not _is_real(p.top_p) or not (0 < p.top_p <= 1):
        raise ValueError(f"{where}.top_p must be in (0, 1] (1 = off), got {p.top_p!r}")
    if not _is_int(p.max_new_tokens) or p.max_new_tokens < 1:
        raise ValueError(f"{where}.max_new_tokens must be an int >= 1, got "
                         f"{p.max_new_tokens!r}")
    for t in p.stop_token_ids:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise ValueError(f"{where}.stop_token_ids: {t!r} is not a token id in "
                             f"[0, {vocab_size})")
    if p.seed is not None and (not _is_int(p.seed) or not 0 <= p.seed < _SEED_LIMIT):
        raise ValueError(f"{where}.seed must be None or an int in [0, 2**64), got {p.seed!r}")


def check_prompt(i: int, prompt, *, vocab_size: int) -> np.ndarray:
    """Validates one prompt and returns it as an int64 numpy array; ``ValueError`` names
    request ``i``."""
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"request {i}: prompt must be a sequence of token ids, got a "
                         f"{type(prompt).__name__} (the sampler is token-in/token-out)")
    try:
        arr = np.asarray(prompt)
    except Exception as e:  # ragged nested lists and the like
        raise ValueError(f"request {i}: prompt is not a flat sequence of token ids ({e})") \
            from None
    if arr.ndim != 1:
        raise ValueError(f"request {i}: prompt must be a flat sequence of token ids, got shape "
                         f"{arr.shape}")
    if arr.size == 0:
        raise ValueError(f"request {i}: prompt is empty (at least one token is needed)")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"request {i}: prompt token ids must be ints, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        j = int(bad[0])
        raise ValueError(f"request {i}: prompt token id {int(arr[j])} at position {j} is outside "
                         f"the vocabulary [0, {vocab_size})")
    return arr


def validate_requests(prompts: Sequence[Sequence[int]],
                      params: SamplingParams | Sequence[SamplingParams], *, vocab_size: int,
                      max_len: int) -> tuple[list[np.ndarray], list[SamplingParams]]:
    """Host-side validation shared by all samplers.

    Checks every request before any work is done and raises ``ValueError`` naming the request
    index and the field: an empty prompt, a token id outside ``[0, vocab_size)``,
    ``max_new_tokens < 1``, ``len(prompt) + max_new_tokens > max_len``, ``temperature < 0``,
    ``top_p`` outside ``(0, 1]``, ``top_k < 0``, a stop token outside the vocabulary, a bad
    seed; and a ``params`` list whose length differs from the number of prompts.

    Returns:
      ``(prompts as int64 numpy arrays, one SamplingParams per prompt)``.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError(f"prompts must be a sequence of token-id sequences, got "
                         f"{type(prompts).__name__}")
    n = len(prompts)
    if isinstance(params, SamplingParams):
        plist = [params] * n
    else:
        if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
            raise ValueError("params must be a SamplingParams or a sequence of them, got "
                             f"{type(params).__name__}")
        plist = list(params)
        if len(plist) != n:
            raise ValueError(f"params has {len(plist)} entries for {n} prompts (give one "
                             "SamplingParams for all, or one per prompt)")
    arrays = []
    for i, (prompt, p) in enumerate(zip(prompts, plist)):
        check_params(i, p, vocab_size=vocab_size)
        arr = check_prompt(i, prompt, vocab_size=vocab_size)
        if arr.size + p.max_new_tokens > max_len:
            raise ValueError(f"request {i}: prompt length {arr.size} + "
                             f"SamplingParams.max_new_tokens {p.max_new_tokens} = "
                             f"{arr.size + p.max_new_tokens} exceeds the model's max length "
                             f"{max_len}")
        arrays.append(arr)
    return arrays, plist
