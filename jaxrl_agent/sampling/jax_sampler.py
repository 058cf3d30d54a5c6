"""``JaxSampler``: batched KV-cache sampling with the project's Flax NNX ``Transformer``.

The model is kept as ``(graphdef, state)`` (``nnx.split``); the jitted functions take the
state as an argument, so ``sync_weights`` only swaps arrays and never recompiles.

One ``generate`` call, per chunk of at most ``max(batch_buckets)`` requests:

1. host: validate every request (``base.validate_requests``), pad the batch to a batch
   bucket (the extra rows are dummies whose outputs are dropped) and right-pad the prompts
   to a length bucket;
2. ``prefill`` (one jitted call): write all prompts to a fresh ``KVCache`` (the padding of
   each row is marked with ``segment_ids == 0``, so every row's cache index ends at its own
   prompt length) and compute the logits at each row's last prompt token. Prompts longer
   than ``prefill_chunk`` tokens are written ``prefill_chunk`` tokens at a time (a
   ``lax.scan`` over chunks, each attending to the cache so far), so the attention scores
   held at once are ``[B, heads, prefill_chunk, cache_len]`` rather than ``[B, heads,
   prompt_len, cache_len]``;
3. ``decode`` (one jitted call, the cache donated so the loop updates it in place): sample
   the first token from those logits, then a
   ``lax.while_loop`` feeds the last token of every unfinished row, samples the next one with
   the row's own temperature / top-k / top-p (per-row arrays, so mixed parameters share one
   compilation) and PRNG stream, and stops a row at a stop token or at its own
   ``max_new_tokens``. The loop ends as soon as every row is done (at the latest after the
   new-token bucket).

Keys and values kept across calls (``reuse_calls``, default the last 2 calls): the final
cache of each chunk of a call stays alive with the tokens each row holds (its prompt and all
but the last sampled token), for the rest of the call and the next ``reuse_calls`` calls. A
later chunk whose prompt starts with such a row's tokens (the next turn of
the same conversation: the prompt so far, the action, the new observation) takes that row's
cache (``_reuse``: a gather of rows, cut or padded to the new cache length, the index set to
the common prefix) and prefills only the rest (``_extend``: the same chunked prefill, starting
at each row's index). A call reuses only when that shortens its prefill's padded length (the
rest's length bucket below the prompts'). A weight sync or release drops the kept caches: keys
and values of older weights are never reused. The samples are those of a fresh cache: the same
tokens, log-probs equal up to float rounding (the kept keys and values were written one token
at a time by the decode loop, a fresh prefill writes them all at once; tested).

Shapes are static: batch size, prompt length, new-token budget and the number of stop ids
are rounded up to buckets, so repeated calls compile once per bucket combination
(``compile_counts`` counts the traces).

Devices: without a ``mesh`` the sampler runs on the device that holds the model's weights.
With a ``mesh`` (a ``jax.sharding.Mesh`` with a ``data`` axis and optionally a ``tensor``
axis, e.g. ``sharding.sampler_mesh``) one call is split over its devices: the rows of the
batch (prompts, KV cache, sampled tokens) over ``data`` (batch buckets are rounded up to
multiples of its size), the KV cache's key/value heads over ``tensor``, and the weights as
``param_shardings`` say (the caller's partition rules; default: replicated). XLA inserts the
collectives; the tokens and log-probs equal the one-device sampler's up to float rounding
(tested on 8 host devices). ``lower`` compiles both programs from shapes alone (for
``jaxrl-agent plan``).

Log-prob semantics (see docs/sampling.md): for ``temperature > 0`` each reported log-prob is
``log q(token)`` where ``q = softmax(z)`` restricted to the kept set and renormalised,
``z = logits / temperature``, and the kept set is the top-k set of ``z`` (ties at the k-th
value kept) intersected with the top-p nucleus of the top-k distribution (``process_logits``).
For ``temperature == 0`` (greedy) the token is ``argmax(logits)`` and its log-prob is
``log_softmax(logits)[token]`` (temperature 1, no truncation), whatever top-k/top-p say.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_agent.models.transformer import KVCache, Transformer, param_dtype
from jaxrl_agent.sampling.base import (SampleOutput, SamplingParams, synced_params,
                                       validate_requests)

# Root of the streams of requests that carry an explicit seed (a fixed constant, so a seeded
# request does not depend on the sampler's own seed either).
_SEEDED_ROOT = 0x5EED5EED


# ----------------------------------------------------------------------------- pure functions


def process_logits(logits, temperature, top_k, top_p):
    """Temperature, top-k and top-p applied to logits: the logits of the distribution a row
    samples from (``-inf`` outside the kept set).

    ``z = logits / temperature`` (rows with ``temperature <= 0`` use 1: greedy rows ignore the
    result). The kept set is:

    * top-k (``top_k > 0``): tokens with ``z >= `` the k-th largest ``z`` (ties at the boundary
      are all kept, so more than k tokens survive only on exact ties);
    * top-p (``top_p < 1``), applied to ``q = softmax(z over the top-k set)``: tokens ``v``
      whose strictly-more-likely mass ``sum(q_u for q_u > q_v)`` is ``< top_p`` (the smallest
      prefix of the sorted distribution whose mass reaches ``top_p``, plus ties with its last
      token). The most likely token is always kept.

    ``log_softmax`` of the result is the renormalised log-distribution over the kept set.

    Args:
      logits: ``[B, V]`` float.
      temperature, top_p: ``[B]`` float; top_k: ``[B]`` int (0 = off; values above V act as V).

    Returns:
      ``[B, V]`` float32.
    """
    logits = jnp.asarray(logits, jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    V = logits.shape[-1]
    z = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]

    def truncate(z):
        zs = -jnp.sort(-z, axis=-1)                                   # descending
        k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
        kth = jnp.take_along_axis(zs, (k - 1)[:, None], axis=-1)      # [B, 1]
        keep = z >= kth
        zs_k = jnp.where(zs >= kth, zs, -jnp.inf)                     # top-k set, sorted
        ps = jax.nn.softmax(zs_k, axis=-1)
        cum = jnp.cumsum(ps, axis=-1)
        excl = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)
        in_nucleus = excl < top_p[:, None]                            # a prefix; rank 0 in it
        thr = jnp.min(jnp.where(in_nucleus, zs_k, jnp.inf), axis=-1, keepdims=True)
        keep = keep & ((z >= thr) | (top_p >= 1.0)[:, None])
        return jnp.where(keep, z, -jnp.inf)

    need = jnp.any((top_k > 0) | (top_p < 1.0))
    return jax.lax.cond(need, truncate, lambda z: z, z)


def sample_tokens(logits, keys, temperature, top_k, top_p):
    """Samples one token per row and returns ``(tokens [B] int32, logprobs [B] float32)``.

    Rows with ``temperature > 0`` sample ``categorical(process_logits(...))`` with their own
    key and report the log-prob under that (truncated, renormalised) distribution; rows with
    ``temperature == 0`` take ``argmax(logits)`` and report ``log_softmax(logits)`` of it.
    ``keys``: ``[B]`` typed PRNG keys.
    """
    logits = jnp.asarray(logits, jnp.float32)
    z = process_logits(logits, temperature, top_k, top_p)
    sampled = jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)
    lp_sampled = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), sampled[:, None],
                                     axis=-1)[:, 0]
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lp_greedy = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), greedy_tok[:, None],
                                    axis=-1)[:, 0]
    greedy = jnp.asarray(temperature) <= 0
    return (jnp.where(greedy, greedy_tok, sampled),
            jnp.where(greedy, lp_greedy, lp_sampled).astype(jnp.float32))


def request_keys(root, call_id, request_index, has_seed, seed_hi, seed_lo):
    """Per-request PRNG keys ``[B]``.

    A request with a seed gets ``fold_in(fold_in(key(_SEEDED_ROOT), seed >> 32),
    seed & 0xffffffff)``: a function of its seed alone. Otherwise
    ``fold_in(fold_in(root, call_id), request_index)``: distinct per sampler seed, per call
    and per request. The key of generation step j is ``fold_in(request_key, j)``.
    """
    seeded_root = jax.random.key(_SEEDED_ROOT)
    seeded = jax.vmap(lambda hi, lo: jax.random.fold_in(
        jax.random.fold_in(seeded_root, hi), lo))(seed_hi, seed_lo)
    call_root = jax.random.fold_in(root, call_id)
    derived = jax.vmap(lambda i: jax.random.fold_in(call_root, i))(request_index)
    data = jnp.where(has_seed[:, None], jax.random.key_data(seeded),
                     jax.random.key_data(derived))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(root))


def _sample(logits, keys, rows, j):
    """Generation step ``j``'s tokens and log-probs from ``logits [B, V]``, each row with its
    own parameters (``rows``) and the key ``fold_in(keys[b], j)``."""
    step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, j)
    return sample_tokens(logits, step_keys, rows["temperature"], rows["top_k"], rows["top_p"])


def _is_stop(tok, rows):
    """Rows whose token ``tok [B]`` is one of their ``stop_ids``."""
    return jnp.any(rows["stop_ids"] == tok[:, None], axis=-1)


# ----------------------------------------------------------------------------- buckets


def _doubling_buckets(start: int, limit: int) -> tuple[int, ...]:
    """``start, 2 start, 4 start, ...`` below ``limit``, then ``limit``."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(out)


def _check_buckets(name: str, buckets, limit: int | None = None) -> tuple[int, ...]:
    try:
        bs = sorted({int(b) for b in buckets})
    except TypeError:
        raise ValueError(f"{name} must be a sequence of positive ints, got {buckets!r}") from None
    if not bs or bs[0] < 1:
        raise ValueError(f"{name} must be a non-empty sequence of positive ints, got {buckets!r}")
    if limit is not None:
        bs = [b for b in bs if b < limit] + [limit]
    return tuple(bs)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise AssertionError(f"{n} exceeds the largest bucket {buckets[-1]}")  # validated before


def _stop_bucket(n: int) -> int:
    b = 4
    while b < n:
        b *= 2
    return b


# ----------------------------------------------------------------------------- kept caches


@dataclasses.dataclass(frozen=True)
class _KeptCall:
    """The final KV cache of one ``generate`` chunk, kept for later calls: ``held[r, :n_r]``
    are the tokens whose keys/values row ``r`` of ``cache`` holds (``-1`` after them),
    written by the weights of sync ``sync``."""

    cache: KVCache
    held: np.ndarray       # [R, M] int32, -1 padded
    sync: int              # which weights wrote it (JaxSampler._weights[2])


def common_prefix(held: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """Per row of ``held`` (``[R, M]`` token ids, ``-1`` padded), the length of the longest
    common prefix with ``prompt`` (``[n]``): ``max k`` with ``held[r, :k] == prompt[:k]``.

    Degenerate cases: an empty ``held`` gives ``[]``; a row that equals ``prompt`` (or extends
    it) gives ``n``; padding never matches (token ids are >= 0)."""
    m = min(held.shape[1], prompt.size)
    eq = held[:, :m] == prompt[None, :m]
    return np.where(eq.all(axis=1), m, eq.argmin(axis=1)).astype(np.int64)


def _check_mesh(mesh, config) -> Mesh | None:
    """``mesh`` when it has a ``data`` axis (and a ``tensor`` axis, if any, that divides the
    query and key/value heads); ``ValueError`` otherwise."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh) or "data" not in mesh.shape:
        raise ValueError(f"mesh must be a jax.sharding.Mesh with a 'data' axis (batch rows), "
                         f"got {mesh!r}")
    tp = mesh.shape.get("tensor", 1)
    if config.num_heads % tp or config.num_kv_heads % tp:
        raise ValueError(f"the mesh's tensor axis ({tp}) must divide the model's attention "
                         f"heads ({config.num_heads}) and key/value heads "
                         f"({config.num_kv_heads})")
    return mesh


# ----------------------------------------------------------------------------- the sampler


def _placed(x, sharding, copy: bool):
    """``x`` on ``sharding``; with ``copy`` in buffers of its own (``device_put`` reuses a
    replicated source's shard for a one-device target even with ``may_alias=False``, and the
    trainer donates or frees the source)."""
    y = jax.device_put(x, sharding, may_alias=not copy)
    if copy and isinstance(x, jax.Array):
        mine = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        if any(s.data.unsafe_buffer_pointer() in mine for s in y.addressable_shards):
            y = jnp.array(y, copy=True)
    return y


class JaxSampler:
    """KV-cache sampler for a ``jaxrl_agent.models.Transformer`` (implements ``Sampler``).

    Args:
      model: the policy (its current weights are copied; later in-place changes to ``model``
        do not reach the sampler until ``sync_weights``).
      max_len: the longest prompt + generation (default ``config.max_position_embeddings``);
        it also caps the KV cache length.
      batch_buckets: batch sizes compiled for; a call is padded to the smallest bucket that
        holds it, and calls larger than the largest bucket are split into chunks of it.
      len_buckets: prompt-length buckets (default ``64, 128, 256, ...``); ``max_len`` is
        always appended as the last bucket.
      new_token_buckets: buckets of the largest ``max_new_tokens`` in a chunk (default
        ``16, 32, 64, ...``, capped by ``max_len``). They size the output buffers; the decode
        loop still stops as soon as every row is done.
      seed: the sampler's PRNG seed (requests without their own seed draw from it).
      policy_version: version stamped on outputs until the first ``sync_weights``.
      mesh: devices to split each call over (see the module docstring); None = the device of
        the model's weights.
      param_shardings: with ``mesh``, a ``Sharding`` per leaf of ``nnx.state(model)`` (same
        tree, e.g. ``sharding.param_shardings(state, mesh, rules)``); default replicated.
      prefill_chunk: prompt tokens written to the cache per prefill chunk (see the module
        docstring); None = the whole prompt at once. Results do not depend on it beyond
        float rounding.
      share_prefill: prompts that occur several times in one call (a group's samples of one
        task; states that recur across a group) are prefilled once and their cache rows and
        last logits copied to every row that asks for them (``_fork``). The samples are those
        of the unshared path (tested token for token); ``prefill_stats`` counts the prompt
        rows and tokens prefilled and asked for.
      reuse_calls: the final KV caches of the last ``reuse_calls`` calls are kept, and a
        later prompt that starts with tokens one of their rows holds prefills only the rest
        (see the module docstring; ``prefill_stats["tokens_reused"]``). 0 = off. Each kept
        call holds the caches of its chunks (``[layers, rows, kv heads, slots, head dim]``
        keys and values) until a later call pushes it out or a weight sync / release drops
        it: beside a call, up to ``reuse_calls`` whole calls' caches and its own finished
        chunks'.
    """

    def __init__(self, model: Transformer, *, max_len: int | None = None,
                 batch_buckets: Sequence[int] = (8, 32, 128),
                 len_buckets: Sequence[int] | None = None,
                 new_token_buckets: Sequence[int] | None = None, seed: int = 0,
                 policy_version: int = 0, mesh: Mesh | None = None,
                 param_shardings: Any = None, prefill_chunk: int | None = 512,
                 share_prefill: bool = True, reuse_calls: int = 2):
        if not isinstance(model, Transformer):
            raise ValueError(f"model must be a jaxrl_agent.models.Transformer, got "
                             f"{type(model).__name__}")
        self.config = model.config
        self.mesh = _check_mesh(mesh, model.config)
        if param_shardings is not None and mesh is None:
            raise ValueError("param_shardings needs a mesh")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(
                prefill_chunk, int) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        max_len = self.config.max_position_embeddings if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
        self.max_len = max_len
        self.batch_buckets = _check_buckets("batch_buckets", batch_buckets)
        if self.mesh is not None:  # every shard of a batch gets the same number of rows
            d = self.mesh.shape["data"]
            self.batch_buckets = tuple(sorted({-(-b // d) * d for b in self.batch_buckets}))
        self.len_buckets = _check_buckets(
            "len_buckets", _doubling_buckets(64, max_len) if len_buckets is None else len_buckets,
            max_len)
        self.new_token_buckets = _check_buckets(
            "new_token_buckets",
            _doubling_buckets(16, max_len) if new_token_buckets is None else new_token_buckets,
            max_len)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self._root = jax.random.key(int(seed) % (2 ** 32))
        graphdef, state = nnx.split(model)
        self._graphdef = graphdef
        if self.mesh is not None and param_shardings is None:
            param_shardings = jax.tree.map(lambda _: NamedSharding(self.mesh, P()), state)
        self._syncs = itertools.count()   # the third entry of _weights: which sync made them
        self._weights = (self._place(state, param_shardings),
                         self._check_version(policy_version), next(self._syncs))
        self._calls = 0
        self._lock = threading.Lock()
        #: number of traces (= compilations) of each jitted function.
        self.compile_counts: collections.Counter = collections.Counter()
        self.share_prefill = bool(share_prefill)
        self.reuse_calls = reuse_calls
        #: prompt rows and tokens asked for and prefilled (fewer with ``share_prefill``)
        self.prefill_stats: collections.Counter = collections.Counter()
        self._fork_jit = jax.jit(self._fork)
        self._reuse_jit = jax.jit(self._reuse, static_argnames=("cache_len",))
        self._extend_jit = jax.jit(self._extend)
        self._prefill_jit = jax.jit(self._prefill, static_argnames=("cache_len",))
        self._decode_jit = jax.jit(self._decode, donate_argnames=("cache",))
        self._steps_jit = jax.jit(self._decode_steps, donate_argnames=("carry",),
                                  static_argnames=("steps", "truncation"))

    # ------------------------------------------------------------------------- weights

    @staticmethod
    def _check_version(version) -> int:
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
            raise ValueError(f"version must be an int, got {version!r}")
        return int(version)

    def _place(self, state, shardings):
        """The sampler's own copy of ``state``: new Variables holding committed copies, so
        in-place updates of the source module never reach the sampler; on ``shardings`` (a
        tree like ``state``) when given, else where the arrays are."""
        if shardings is None:
            return jax.tree.map(lambda x: jax.device_put(jnp.array(x, copy=True), x.sharding),
                                state)
        return jax.tree.map(lambda x, s: jax.device_put(jnp.array(x, copy=True), s), state,
                            shardings)

    @property
    def batch_sharding(self) -> NamedSharding | None:
        """Where the per-row arrays of a call go (rows over ``data``); None without a mesh."""
        return None if self.mesh is None else NamedSharding(self.mesh, P("data"))

    @property
    def cache_sharding(self) -> NamedSharding | None:
        """The KV cache's ``[layers, B, kv_heads, S, head_dim]`` arrays: rows over ``data``,
        heads over ``tensor``; None without a mesh."""
        if self.mesh is None:
            return None
        tp = self.mesh.shape.get("tensor", 1)
        return NamedSharding(self.mesh, P(None, "data", "tensor" if tp > 1 else None))

    def _constrain_cache(self, cache):
        if self.mesh is None:
            return cache
        k, v = jax.lax.with_sharding_constraint((cache.k, cache.v), self.cache_sharding)
        index = jax.lax.with_sharding_constraint(cache.index, self.batch_sharding)
        return type(cache)(k=k, v=v, index=index)

    @property
    def reuse_calls(self) -> int:
        """How many earlier calls' final KV caches (every chunk of them) are kept for later
        prompts that continue their rows; setting it drops the caches kept so far."""
        return self._reuse_calls

    @reuse_calls.setter
    def reuse_calls(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"reuse_calls must be an int >= 0, got {n!r}")
        self._reuse_calls = n
        # one list of chunk caches per call: the calls before the running one, and its own
        self._kept: collections.deque = collections.deque(maxlen=n + 1)

    @property
    def policy_version(self) -> int:
        """The version of the weights the next ``generate`` call uses."""
        return self._weights[1]

    @property
    def state(self):
        """The sampler's current weights (an ``nnx.State``)."""
        return self._weights[0]

    @property
    def num_compilations(self) -> int:
        """Total traces of the prefill and decode functions so far."""
        return sum(self.compile_counts.values())

    def release_weights(self) -> None:
        """Frees the sampler's copy of the weights until the next ``sync_weights`` (the trainer
        calls it before a train step when no rollout runs during the step, so the device does
        not hold the sampler's weights beside the step's); ``generate`` refuses meanwhile.
        The kept caches (``reuse_calls``) are dropped too."""
        self.drop_kept_caches()
        for x in jax.tree.leaves(self._weights[0]):
            if not x.is_deleted():
                x.delete()

    def drop_kept_caches(self) -> None:
        """Forgets the kept KV caches of earlier calls (``reuse_calls``): the next call
        prefills every prompt from scratch. Weight syncs and releases call it."""
        with self._lock:
            self._kept.clear()

    @property
    def weights_released(self) -> bool:
        """``release_weights`` was called and no ``sync_weights`` since."""
        return any(x.is_deleted() for x in jax.tree.leaves(self._weights[0]))

    def sync_weights(self, model_or_state: Any, version: int, *, copy: bool = True) -> None:
        """Replaces the weights and the policy version; no recompilation. The kept caches of
        earlier calls (``reuse_calls``) are dropped: no later call reuses keys/values of the
        old weights.

        Args:
          model_or_state: a ``Transformer``, an ``nnx.State`` of its parameters (e.g. the
            trainer's ``nnx.split(model, nnx.Param)[1]``) or the nested pure dict of arrays
            (``nnx.to_pure_dict(state)``). It must hold every parameter the sampler's model has,
            with the same shapes; extra entries (a trainer's value head) are ignored. Arrays
            are cast to the sampler's dtypes (e.g. float32 trainer -> bfloat16 sampler) and
            placed like the sampler's current arrays.
          version: the policy version stamped on the outputs of later ``generate`` calls.
          copy: copy the arrays (default), so the trainer may donate or reuse its buffers.

        Raises:
          ValueError: a missing parameter or a shape mismatch (naming the path), a non-int
            version.
        """
        version = self._check_version(version)
        cur_state = self._weights[0]
        cur = nnx.to_pure_dict(cur_state)
        flat_cur = nnx.traversals.flatten_mapping(cur)
        new_flat = {path: _placed(x, flat_cur[path].sharding, copy)
                    for path, x in synced_params(model_or_state, cur).items()}
        new_state = jax.tree.map(lambda x: x, cur_state)    # fresh Variables, same structure
        nnx.replace_by_pure_dict(new_state, nnx.traversals.unflatten_mapping(new_flat))
        self._weights = (new_state, version, next(self._syncs))
        self.drop_kept_caches()   # keys and values of the old weights are never reused

    # ------------------------------------------------------------------------- jitted parts

    def _prefill(self, state, tokens, lengths, *, cache_len: int):
        """Prompts ``[B, L]`` (right-padded; ``lengths`` [B]) -> (KV cache, logits at each row's
        last prompt token ``[B, V]``)."""
        self.compile_counts["prefill"] += 1
        model = nnx.merge(self._graphdef, state)
        cache = self._constrain_cache(model.init_cache(tokens.shape[0], cache_len))
        return self._write(model, cache, tokens, lengths)

    def _extend(self, state, cache, tokens, lengths):
        """``_prefill`` into a cache that already holds each row's first ``cache.index``
        tokens: the rest of the prompts ``[B, L]`` (right-padded; ``lengths`` [B] >= 1) are
        written from each row's index on. Returns the cache and the logits at each row's last
        token."""
        self.compile_counts["extend"] += 1
        return self._write(nnx.merge(self._graphdef, state), cache, tokens, lengths)

    def _write(self, model, cache, tokens, lengths):
        """The prefill proper: ``tokens`` written ``prefill_chunk`` at a time (a ``lax.scan``
        over chunks), each row from its own ``cache.index`` on, keeping the hidden state at
        each row's last real token."""
        B, L = tokens.shape
        Q = L if self.prefill_chunk is None else min(self.prefill_chunk, L)
        n = -(-L // Q)
        tokens = jnp.pad(tokens, ((0, 0), (0, n * Q - L)))     # padding: segment id 0
        seg = (jnp.arange(n * Q, dtype=jnp.int32)[None, :] < lengths[:, None]).astype(jnp.int32)

        def chunk(carry, xs):
            cache, last = carry
            tok, sg, c = xs
            out = model(tok, segment_ids=sg, cache=cache, compute_logits=False)
            pos = lengths - 1 - c * Q              # each row's last prompt token, if in here
            h = jnp.take_along_axis(out.hidden, jnp.clip(pos, 0, Q - 1)[:, None, None],
                                    axis=1)[:, 0].astype(jnp.float32)
            last = jnp.where(((pos >= 0) & (pos < Q))[:, None], h, last)
            return (self._constrain_cache(out.cache), last), None

        split = lambda x: x.reshape(B, n, Q).swapaxes(0, 1)   # noqa: E731  [n, B, Q]
        last = jnp.zeros((B, self.config.hidden_size), jnp.float32)
        if n == 1:
            (cache, last), _ = chunk((cache, last), (tokens, seg, 0))
        else:
            (cache, last), _ = jax.lax.scan(chunk, (cache, last),
                                            (split(tokens), split(seg), jnp.arange(n)))
        logits = model.logits_from_hidden(last)
        if self.mesh is not None:
            logits = jax.lax.with_sharding_constraint(logits, self.batch_sharding)
        return cache, logits

    def _reuse(self, cache, source, keep, *, cache_len: int):
        """A cache of ``cache_len`` slots whose row ``i`` holds the first ``keep[i]`` slots of
        the kept cache's row ``source[i]`` (rows gathered, slots cut or zero-padded; slots
        from ``keep[i]`` on are stale and masked until overwritten)."""
        self.compile_counts["reuse"] += 1
        C = cache.max_len

        def take(x):  # [layers, R, kv, C, hd] -> [layers, B, kv, cache_len, hd]
            x = jnp.take(x, source, axis=1)[:, :, :, :min(C, cache_len)]
            pad = [(0, 0)] * x.ndim
            pad[3] = (0, cache_len - x.shape[3])
            return jnp.pad(x, pad)

        return self._constrain_cache(KVCache(k=take(cache.k), v=take(cache.v),
                                             index=keep.astype(jnp.int32)))

    def _fork(self, cache, logits, source):
        """The cache rows and last logits of each row's prompt: row ``i`` gets those of the
        prefilled row ``source[i]`` (a gather along the batch axis; ``[B]`` from ``[U]``)."""
        self.compile_counts["fork"] += 1
        take = lambda x: jnp.take(x, source, axis=1)  # noqa: E731 - [layers, rows, ...]
        cache = KVCache(k=take(cache.k), v=take(cache.v), index=cache.index[source])
        logits = logits[source]
        if self.mesh is not None:
            logits = jax.lax.with_sharding_constraint(logits, self.batch_sharding)
        return self._constrain_cache(cache), logits

    def _decode(self, state, cache, logits, rows, root, call_id, out_like):
        """The decode loop. ``rows``: dict of per-row arrays (``temperature, top_k, top_p,
        max_new, stop_ids [B, S], done, request_index, has_seed, seed_hi, seed_lo``);
        ``out_like``: ``[B, N]`` zeros fixing the new-token bucket N. Returns ``(tokens [B, N],
        logprobs [B, N], num_generated [B], the final cache)``."""
        self.compile_counts["decode"] += 1
        model = nnx.merge(self._graphdef, state)
        B, N = out_like.shape
        keys = request_keys(root, call_id, rows["request_index"], rows["has_seed"],
                            rows["seed_hi"], rows["seed_lo"])
        tok, lp = _sample(logits, keys, rows, 0)
        out_tok = jnp.zeros((B, N), jnp.int32).at[:, 0].set(tok)
        out_lp = jnp.zeros((B, N), jnp.float32).at[:, 0].set(lp)
        n_gen = jnp.ones((B,), jnp.int32)
        done = rows["done"] | _is_stop(tok, rows) | (n_gen >= rows["max_new"])

        def cond(carry):
            j, _, _, _, _, _, done = carry
            return (j < N) & ~jnp.all(done)

        carry = (jnp.int32(1), cache, tok, out_tok, out_lp, n_gen, done)
        _, cache, _, out_tok, out_lp, n_gen, _ = jax.lax.while_loop(
            cond, functools.partial(self._decode_body, model, keys, rows), carry)
        # the cache is returned so that its donated input buffer is the output's: the loop then
        # updates it in place (no second copy); callers drop it
        return out_tok, out_lp, n_gen, cache

    def _decode_body(self, model, keys, rows, carry, layer_unroll=1):
        """One iteration of the decode loop: the last token of every unfinished row through
        the model (its keys and values written to the cache), the next one sampled."""
        j, cache, tok, out_tok, out_lp, n_gen, done = carry
        active = ~done
        out = model(tok[:, None], segment_ids=active[:, None].astype(jnp.int32), cache=cache,
                    layer_unroll=layer_unroll)
        new_tok, lp = _sample(out.logits[:, 0], keys, rows, j)
        tok = jnp.where(active, new_tok, tok)
        out_tok = out_tok.at[:, j].set(jnp.where(active, new_tok, 0))
        out_lp = out_lp.at[:, j].set(jnp.where(active, lp, 0.0))
        n_gen = n_gen + active.astype(jnp.int32)
        done = done | (active & (_is_stop(new_tok, rows) | (n_gen >= rows["max_new"])))
        return j + 1, self._constrain_cache(out.cache), tok, out_tok, out_lp, n_gen, done

    def _decode_steps(self, state, carry, rows, root, call_id, steps: int, truncation=None):
        """``steps`` iterations of ``_decode_body``, unrolled, every layer unrolled
        (``lower_step``); ``truncation = (top_k, top_p)``: every row's, as constants."""
        self.compile_counts["decode_step"] += 1
        if truncation is not None:
            B = rows["top_k"].shape[0]
            rows = dict(rows, top_k=np.full((B,), truncation[0], np.int32),
                        top_p=np.full((B,), truncation[1], np.float32))
        keys = request_keys(root, call_id, rows["request_index"], rows["has_seed"],
                            rows["seed_hi"], rows["seed_lo"])
        model = nnx.merge(self._graphdef, state)
        for _ in range(steps):
            carry = self._decode_body(model, keys, rows, carry, layer_unroll=True)
        return carry

    def lower(self, batch: int, prompt_len: int, new_tokens: int, *, stop_ids: int = 4,
              cache_len: int | None = None):
        """Lowers the sampler's jitted prefill and decode loop for one call's padded shapes,
        from shapes alone (nothing runs; the weights may be ``ShapeDtypeStruct``s with
        shardings): ``batch`` rows (a batch bucket), prompts padded to ``prompt_len``,
        ``new_tokens`` output slots, ``stop_ids`` stop-id slots and a KV cache of
        ``cache_len`` slots (default ``min(prompt_len + new_tokens, max_len)``, as
        ``generate`` sizes it). Arguments are placed as ``generate`` places them.

        Returns:
          ``(prefill, decode)``: ``jax.stages.Lowered``; ``.compile().memory_analysis()``
          gives a program's bytes per device.
        """
        B, L, N, S = int(batch), int(prompt_len), int(new_tokens), int(stop_ids)
        C = min(L + N, self.max_len) if cache_len is None else int(cache_len)
        state, sds, cache, rows, root, call_id = self._abstract_call(B, C, S)
        prefill = self._prefill_jit.lower(state, sds((B, L), "int32"), sds((B,), "int32"),
                                          cache_len=C)
        logits = sds((B, self.config.vocab_size), "float32")
        decode = self._decode_jit.lower(state, cache, logits, rows, root, call_id,
                                        sds((B, N), "int32"))
        return prefill, decode

    def lower_step(self, batch: int, cache_len: int, new_tokens: int = 16, *,
                   stop_ids: int = 4, steps: int = 1, top_k: int | None = None,
                   top_p: float | None = None):
        """Lowers ``steps`` iterations of the decode loop (``_decode_body``: every row's last
        token through the model, its keys and values written to a ``cache_len``-slot cache,
        the next token sampled), unrolled and with every layer unrolled, from shapes alone,
        placed as ``lower`` places a call. XLA's cost analysis of the compiled program
        (``bytes accessed``) then counts every step and layer (it counts a loop's body once).
        The difference between 2 steps and 1 is one more step's memory traffic, without the
        layout copies XLA puts at a program's entry and exit (the decode loop makes those once
        per call). The arithmetic is the loop's own. With ``top_k`` and ``top_p`` every row
        samples with them, as constants: without truncation (0 and 1.0) the vocabulary sort
        the loop skips at run time (``process_logits``' ``lax.cond``) is not counted either.

        Returns:
          a ``jax.stages.Lowered``.
        """
        B, C, N = int(batch), int(cache_len), int(new_tokens)
        state, sds, cache, rows, root, call_id = self._abstract_call(B, C, int(stop_ids))
        one = root.sharding
        carry = (sds((), "int32", one), cache, sds((B,), "int32"), sds((B, N), "int32"),
                 sds((B, N), "float32"), sds((B,), "int32"), sds((B,), "bool"))
        truncation = None if top_k is None else (int(top_k), float(top_p))
        return self._steps_jit.lower(state, carry, rows, root, call_id, steps=int(steps),
                                     truncation=truncation)

    def _abstract_call(self, B: int, C: int, S: int):
        """Shapes of one call's arguments placed as ``generate`` places them: ``(state, sds,
        cache, rows, root, call_id)``, ``sds(shape, dtype, sharding=rows')`` making more."""
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                            sharding=x.sharding), self.state)
        rows_sh = self.batch_sharding or jax.tree.leaves(state)[0].sharding
        cache_sh = self.cache_sharding or rows_sh
        one = NamedSharding(self.mesh, P()) if self.mesh is not None else rows_sh

        def sds(shape, dtype, sh=rows_sh):
            return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sh)

        kv = sds((self.config.num_layers, B, self.config.num_kv_heads, C, self.config.head_dim),
                 param_dtype(self.config), cache_sh)
        cache = KVCache(k=kv, v=kv, index=sds((B,), "int32"))
        rows = dict(temperature=sds((B,), "float32"), top_k=sds((B,), "int32"),
                    top_p=sds((B,), "float32"), max_new=sds((B,), "int32"),
                    stop_ids=sds((B, S), "int32"), done=sds((B,), "bool"),
                    request_index=sds((B,), "uint32"), has_seed=sds((B,), "bool"),
                    seed_hi=sds((B,), "uint32"), seed_lo=sds((B,), "uint32"))
        root = jax.ShapeDtypeStruct((), self._root.dtype, sharding=one)
        return state, sds, cache, rows, root, sds((), "uint32", one)

    def limit_call_rows(self, rows: int) -> None:
        """At most ``rows`` requests per chunk of a ``generate`` call (a larger call runs as
        several chunks, one after the other; the samples do not change: each request's PRNG
        stream depends on its index in the call, not in the chunk). The batch buckets above
        ``rows`` are dropped and ``rows`` becomes the largest (rounded up to a multiple of the
        mesh's ``data`` axis). ``train.call_size`` chooses it to fit the chip's memory."""
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
            raise ValueError(f"call rows must be an int >= 1, got {rows!r}")
        d = 1 if self.mesh is None else self.mesh.shape["data"]
        rows = -(-int(rows) // d) * d
        self.batch_buckets = tuple(sorted({b for b in self.batch_buckets if b < rows}
                                          | {rows}))

    @property
    def call_rows(self) -> int:
        """The most requests one chunk of a ``generate`` call prefills and decodes at once."""
        return self.batch_buckets[-1]

    # ------------------------------------------------------------------------- generate

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[SampleOutput]:
        """Samples one continuation per prompt (see the module docstring).

        Args:
          prompts: token-id sequences (non-empty, ids in ``[0, vocab_size)``).
          params: one ``SamplingParams`` for all prompts, or one per prompt.

        Returns:
          ``SampleOutput``s in prompt order, each stamped with the policy version of the
          weights used (captured once at the start of the call).

        Raises:
          ValueError: an invalid request (naming its index and the field), before any work.
        """
        arrays, plist = validate_requests(prompts, params, vocab_size=self.config.vocab_size,
                                          max_len=self.max_len)
        state, version, sync = self._weights
        if self.weights_released:
            raise RuntimeError("the sampler's weights were released (release_weights): "
                               "sync_weights before generate")
        with self._lock:
            call_id = self._calls
            self._calls += 1
        kept_here: list = []   # this call's chunk caches, kept for later calls
        if self.reuse_calls:
            with self._lock:
                self._kept.append(kept_here)  # (drops the oldest call's)
        results: list[SampleOutput] = []
        chunk = self.call_rows
        for start in range(0, len(arrays), chunk):
            results.extend(self._generate_chunk(state, version, sync, call_id, start,
                                                arrays[start:start + chunk],
                                                plist[start:start + chunk], kept_here))
        return results

    def _generate_chunk(self, state, version, sync, call_id, start, arrays, plist, kept_here):
        n = len(arrays)
        B = _bucket(n, self.batch_buckets)
        L = _bucket(max(a.size for a in arrays), self.len_buckets)
        N = _bucket(max(p.max_new_tokens for p in plist), self.new_token_buckets)
        S = _stop_bucket(max(len(p.stop_token_ids) for p in plist))
        cache_len = min(L + N, self.max_len)

        stop_ids = np.full((B, S), -1, np.int32)
        temperature = np.zeros((B,), np.float32)
        top_k = np.zeros((B,), np.int32)
        top_p = np.ones((B,), np.float32)
        max_new = np.ones((B,), np.int32)
        has_seed = np.zeros((B,), bool)
        seed_hi = np.zeros((B,), np.uint32)
        seed_lo = np.zeros((B,), np.uint32)
        for i, (a, p) in enumerate(zip(arrays, plist)):
            stop_ids[i, :len(p.stop_token_ids)] = p.stop_token_ids
            temperature[i] = p.temperature
            top_k[i] = p.top_k
            top_p[i] = p.top_p
            max_new[i] = p.max_new_tokens
            if p.seed is not None:
                has_seed[i] = True
                seed_hi[i] = (int(p.seed) >> 32) & 0xFFFFFFFF
                seed_lo[i] = int(p.seed) & 0xFFFFFFFF
        rows = dict(temperature=temperature, top_k=top_k, top_p=top_p, max_new=max_new,
                    stop_ids=stop_ids, done=np.arange(B) >= n,
                    request_index=(start + np.arange(B)).astype(np.uint32), has_seed=has_seed,
                    seed_hi=seed_hi, seed_lo=seed_lo)

        out_like = np.zeros((B, N), np.int32)
        source, reps = None, list(range(n))   # the rows prefilled; row i copies source[i]'s
        if self.share_prefill:  # one prefill per distinct prompt, then copied to its rows
            index: dict = {}
            src = [index.setdefault(a.tobytes(), len(index)) for a in arrays]
            if len(index) < n:
                reps = [src.index(u) for u in range(len(index))]  # each prompt's first row
                source = np.array(src + [0] * (B - n), np.int32)
        U = B if source is None else _bucket(len(reps), self.batch_buckets)
        firsts = [arrays[i] for i in reps]
        found = self._find_kept(firsts, sync, L) if self.reuse_calls else None
        kept, rows_kept, reused = found if found else (None, [0] * len(reps), [0] * len(reps))
        rest = [a[k:] for a, k in zip(firsts, reused)]
        R = L if kept is None else _bucket(max(r.size for r in rest), self.len_buckets)
        tokens = np.zeros((U, R), np.int32)
        lengths = np.ones((U,), np.int32)
        for i, r in enumerate(rest):
            tokens[i, :r.size] = r
            lengths[i] = r.size
        self.prefill_stats["rows_asked"] += n
        self.prefill_stats["tokens_asked"] += int(sum(a.size for a in arrays))
        self.prefill_stats["rows_prefilled"] += len(reps)
        self.prefill_stats["tokens_prefilled"] += int(sum(r.size for r in rest))
        self.prefill_stats["slots_prefilled"] += U * R   # the padded work
        if kept is not None:
            self.prefill_stats["tokens_reused"] += int(sum(reused))
        put = ((lambda x: jax.device_put(x, self.batch_sharding)) if self.mesh is not None
               else (lambda x: x))   # rows over the mesh's data axis
        tokens, lengths, rows, out_like = put((tokens, lengths, rows, out_like))
        if kept is None:
            cache, logits = self._prefill_jit(state, tokens, lengths, cache_len=cache_len)
        else:
            pad = [0] * (U - len(reps))
            held = put((np.array(rows_kept + pad, np.int32), np.array(reused + pad, np.int32)))
            cache = self._reuse_jit(kept.cache, *held, cache_len=cache_len)
            cache, logits = self._extend_jit(state, cache, tokens, lengths)
        if source is not None:
            cache, logits = self._fork_jit(cache, logits, put(source))
        out_tok, out_lp, n_gen, cache = self._decode_jit(
            state, cache, logits, rows, self._root, np.uint32(call_id % (2 ** 32)), out_like)
        out_tok, out_lp, n_gen = jax.device_get((out_tok, out_lp, n_gen))

        results = []
        for i, (a, p) in enumerate(zip(arrays, plist)):
            k = int(n_gen[i])
            toks = out_tok[i, :k].tolist()
            reason = "stop" if toks[-1] in p.stop_token_ids else "length"
            results.append(SampleOutput(prompt_token_ids=a.tolist(), token_ids=toks,
                                        logprobs=out_lp[i, :k].tolist(), finish_reason=reason,
                                        policy_version=version))
        if self.reuse_calls:  # row i holds its prompt and all but its last sampled token
            held = [np.concatenate([a, out_tok[i, :int(n_gen[i]) - 1]])
                    for i, a in enumerate(arrays)]
            mat = np.full((B, max(h.size for h in held)), -1, np.int32)
            for i, h in enumerate(held):
                mat[i, :h.size] = h
            with self._lock:
                if self._weights[2] == sync:   # not after a sync
                    kept_here.append(_KeptCall(cache=cache, held=mat, sync=sync))
        return results

    def _find_kept(self, prompts, sync: int, prompt_bucket: int):
        """Which kept call's rows to start ``prompts`` from: ``(kept call, row per prompt,
        tokens reused per prompt)``, the call that saves the most tokens, or None when no
        kept call (of the current weights) shares a prefix or the rest would not fit a
        shorter length bucket than ``prompt_bucket``. At least each prompt's last token is
        left to prefill (its logits start the decode)."""
        with self._lock:
            kept = [k for call in self._kept for k in call if k.sync == sync]
        best = None
        for k in kept:
            rows, reused = [], []
            for a in prompts:
                lcp = common_prefix(k.held, a)
                r = int(lcp.argmax())
                rows.append(r)
                reused.append(min(int(lcp[r]), a.size - 1))
            if sum(reused) and (best is None or sum(reused) > sum(best[2])):
                best = (k, rows, reused)
        if best is None:
            return None
        rest = max(a.size - m for a, m in zip(prompts, best[2]))
        return best if _bucket(rest, self.len_buckets) < prompt_bucket else None
