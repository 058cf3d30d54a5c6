"""Log-probs and entropies of the sampling distribution from final hidden states, chunked over
the tokens, so the ``[R, T, V]`` float32 logits never exist.

The train step's dense path builds ``logits = hidden @ W`` for every position and then reads
one log-prob (and an entropy) per position. At V = 152k, T = 4096 those logits (and the
processed copies and their cotangents) dominate the step's memory. ``chunked_sampled_logprobs``
computes the same numbers ``chunk`` positions at a time inside a ``lax.scan`` whose body is
rematerialised (``jax.checkpoint``): one chunk's ``[R, chunk, V]`` logits are alive at a time,
in the forward pass and again in the backward pass, which recomputes them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_agent.losses.kl import entropy_from_logits
from jaxrl_agent.sampling.jax_sampler import process_logits


def chunked_sampled_logprobs(hidden, weight, tokens, *, tied: bool, temperature: float = 1.0,
                             top_k: int = 0, top_p: float = 1.0, chunk: int = 512,
                             want_entropy: bool = True, shards: int = 1, shard_sharding=None):
    """``(lp, outside, ent)`` of ``chunked_token_outputs`` (see there): the log-probs of the
    sampled tokens, whether each lies outside the sampler's truncation, and the entropies."""
    out = chunked_token_outputs(hidden, weight, tokens, tied=tied, temperature=temperature,
                                top_k=top_k, top_p=top_p, chunk=chunk, want_entropy=want_entropy,
                                shards=shards, shard_sharding=shard_sharding)
    return out["lp"], out["outside"], out["ent"]


def chunked_token_outputs(hidden, weight, tokens, *, tied: bool, temperature: float = 1.0,
                          top_k: int = 0, top_p: float = 1.0, chunk: int = 512,
                          want_entropy: bool = True, shards: int = 1, shard_sharding=None,
                          at=None, top_n: int = 0) -> dict:
    """Log-probs (and entropies) of ``tokens`` under the distribution a sampler with these
    parameters draws from, read from the final hidden states one chunk of positions at a time;
    optionally also the log-probs of other token ids (``at``) and the ``top_n`` most likely
    ids with their log-probs, for a distillation over more than the sampled token.

    With ``logits[r, s] = hidden[r, s] @ W`` (float32 accumulation; ``W = weight.T`` when
    ``tied``), ``z = logits / temperature`` and ``zt = process_logits(z, top_k, top_p)`` (the
    sampler's own truncation, ``-inf`` outside the kept set)::

        lp[r, t]      = log softmax(zt[r, t-1])[x]   if x = tokens[r, t] is kept by zt[r, t-1]
                      = log softmax(z[r, t-1])[x]    otherwise (a finite stand-in; outside = True)
        outside[r, t] = zt[r, t-1, x] == -inf
        ent[r, t]     = -sum_v p_v log p_v,  p = softmax(zt[r, t-1])   (0 log 0 = 0)

    for ``t >= 1``; ``lp[:, 0] = 0``, ``outside[:, 0] = False``, ``ent[:, 0] = 0`` (token 0 was
    not drawn from the model). The other ids read the distribution before truncation (top-k /
    top-p are a device of the sampler; a distillation compares the tempered distributions,
    whose ratios over the kept ids the truncation does not change)::

        at_lp[r, t, j]  = log softmax(z[r, t-1])[at[r, t, j]]
        top_lp[r, t, :], top_ids[r, t, :] = the top_n largest of log softmax(z[r, t-1]) and
                          their ids, largest first (ties: the lower id first)

    for ``t >= 1``, and 0 (ids 0) at ``t = 0``. Without truncation (``top_k == 0`` and
    ``top_p >= 1``) ``zt = z``. These are exactly the numbers of the train step's dense path,
    ``lp, outside, zp = step.sampled_logprobs(logits, tokens, ...)`` and
    ``entropy_from_logits(zp)`` shifted one position later, up to float32 rounding of the
    matmul.

    Degenerate cases: ``temperature <= 0`` (greedy) means the untempered, untruncated
    distribution (``top_k`` / ``top_p`` are ignored, ``outside`` is all False), as the sampler
    reports for greedy rows. ``T = 1``: all outputs are 0 / False (no position has a
    predecessor). ``chunk >= T - 1``: one chunk, the dense computation. ``T - 1`` not a multiple
    of ``chunk``: the last chunk is padded with zero hidden states and token 0; their outputs
    are finite and dropped, so they add nothing to the values or the gradients. Token ids
    outside ``[0, V)`` are clipped (as the dense path's gather does).

    Memory: the scan body is ``jax.checkpoint``-ed, so the forward pass keeps no per-chunk
    residuals and the backward pass recomputes each chunk's logits: at any time one chunk's
    ``[R, chunk, V]`` float32 logits (and the few same-sized temporaries of the softmax, the
    top-k/top-p sort and their cotangents) are alive instead of ``[R, T, V]``. The price is one
    extra LM-head matmul in the backward pass. Gradients flow to ``hidden`` and ``weight``; the
    weight's gradient is accumulated over the chunks in ``weight.dtype`` (for bfloat16
    weights that is ``ceil((T - 1) / chunk)`` bfloat16 additions, a little more rounding than
    the dense path's single matmul).

    Sharding: the row axis R is kept whole through the scan (the scan runs over chunks of the
    token axis), so rows sharded over devices stay on their devices; a vocabulary-sharded
    ``weight`` is handled by GSPMD like in the dense path. With ``shards = S > 1`` (the rows
    split into S equal blocks, one per data shard, as the train step lays them out) every block
    reads its own broadcast copy of the weight (``[S, ...]``, its leading axis placed by
    ``shard_sharding``), so the weight's gradient is accumulated over the chunks on each shard
    and summed across shards once after the loop: without it GSPMD reduces the replicated
    accumulator across devices in every chunk (one all-reduce of the whole LM head per chunk,
    and on a multi-device CPU backend a deadlock when that loop and another collective run
    concurrently).

    Args:
      hidden: ``[R, T, D]`` final hidden states (any float dtype; cast to ``weight.dtype``
        before the matmul, like ``Transformer.logits_from_hidden``).
      weight: the LM head, ``[V, D]`` if ``tied`` (the embedding table) else ``[D, V]`` (the
        ``lm_head`` kernel).
      tokens: ``[R, T]`` int token ids.
      tied: layout of ``weight`` (static).
      temperature, top_k, top_p: the rollouts' sampling parameters (static Python numbers).
      chunk: positions per scan step (static); ``min(chunk, T - 1)`` is used.
      want_entropy: also compute the entropies (else ``ent`` is ``None``).
      shards: the number of equal row blocks (data shards) the rows are split into; must
        divide R (static).
      shard_sharding: optional ``NamedSharding`` of the per-shard weight copies ``[S, ...]``
        (leading axis over the batch axes).

      at: optional ``[R, T, K]`` int token ids whose log-probs to read at each position (ids
        outside ``[0, V)`` are clipped).
      top_n: also return the ``top_n`` most likely ids at each position (static; 0: no).

    Returns:
      a dict: ``lp`` [R, T] float32, ``outside`` [R, T] bool, ``ent`` [R, T] float32 or
      None; ``at_lp`` [R, T, K] float32 (with ``at``); ``top_lp`` [R, T, top_n] float32 and
      ``top_ids`` [R, T, top_n] int32 (with ``top_n``).
    """
    R, T, D = _check(hidden, weight, tokens, tied=tied, chunk=chunk)
    top_n = int(top_n)
    V = weight.shape[0 if tied else 1]
    if not 0 <= top_n <= V:
        raise ValueError(f"top_n must lie in [0, V = {V}], got {top_n}")
    if at is not None and (at.ndim != 3 or at.shape[:2] != (R, T)):
        raise ValueError(f"at must be [R, T, K] = {(R, T)} + (K,), got shape {at.shape}")
    n = T - 1  # positions whose next token is scored
    if n == 0:
        zeros = jnp.zeros((R, T), jnp.float32)
        out = {"lp": zeros, "outside": jnp.zeros((R, T), bool),
               "ent": zeros if want_entropy else None}
        if at is not None:
            out["at_lp"] = jnp.zeros(at.shape, jnp.float32)
        if top_n:
            out["top_lp"] = jnp.zeros((R, T, top_n), jnp.float32)
            out["top_ids"] = jnp.zeros((R, T, top_n), jnp.int32)
        return out
    c = min(int(chunk), n)
    k = -(-n // c)
    pad = k * c - n
    S = int(shards)
    if S < 1 or R % S:
        raise ValueError(f"shards ({shards}) must divide the rows ({R})")

    def chunked(x):  # [R, T, ...] -> [k, S, R / S, c, ...], positions 1.. (scored by t - 1)
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) if pad else x
        return jnp.moveaxis(x.reshape((S, R // S, k, c) + x.shape[2:]), 2, 0)

    # [k, S, R / S, c, ...]: scan over chunks; the rows (and their shards) stay intact
    xs = {"h": chunked(hidden[:, :n]), "nxt": chunked(jnp.asarray(tokens, jnp.int32)[:, 1:])}
    if at is not None:
        xs["at"] = chunked(jnp.asarray(at, jnp.int32)[:, 1:])
    ws = jnp.broadcast_to(weight, (S,) + weight.shape)  # one copy per shard (see Sharding)
    if shard_sharding is not None:
        ws = jax.lax.with_sharding_constraint(ws, shard_sharding)

    def chunk_fn(w, x):
        return jax.vmap(functools.partial(
            _chunk, tied=tied, temperature=temperature, top_k=top_k, top_p=top_p,
            want_entropy=want_entropy, top_n=top_n))(x, w)

    body = jax.checkpoint(chunk_fn, prevent_cse=False)
    _, outs = jax.lax.scan(lambda carry, x: (carry, body(ws, x)), None, xs)

    def unchunk(x):  # [k, S, R / S, c, ...] -> [R, T, ...]: drop the padding, shift one later
        x = jnp.moveaxis(x, 0, 2).reshape((R, k * c) + x.shape[4:])[:, :n]
        return jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)

    out = {name: unchunk(x) for name, x in outs.items()}
    out.setdefault("ent", None)
    return out


def _check(hidden, weight, tokens, *, tied: bool, chunk: int):
    """Shapes (static, so also under jit): ``(R, T, D)`` or a ``ValueError`` naming the
    field."""
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [R, T, D], got shape {hidden.shape}")
    R, T, D = hidden.shape
    if weight.ndim != 2 or weight.shape[1 if tied else 0] != D:
        want = "[V, D] (tied)" if tied else "[D, V] (untied)"
        raise ValueError(f"weight must be {want} with D = {D}, got shape {weight.shape}")
    if tokens.shape != (R, T):
        raise ValueError(f"tokens must be [R, T] = {(R, T)}, got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    if T < 1:
        raise ValueError(f"hidden must have at least one position, got T = {T}")
    if int(chunk) < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return R, T, D


def _chunk(x, w, *, tied: bool, temperature: float, top_k: int, top_p: float,
           want_entropy: bool, top_n: int = 0):
    """One chunk: ``x["h"]`` hidden [R, c, D], ``x["nxt"]`` next tokens [R, c] (and ``x["at"]``
    [R, c, K] other ids) -> ``lp``, ``outside``, ``ent`` [R, c] (``at_lp`` [R, c, K],
    ``top_lp`` / ``top_ids`` [R, c, top_n]) at the same positions (the distribution at s
    scores token s + 1)."""
    h, nxt = x["h"], x["nxt"]
    spec = "rcd,vd->rcv" if tied else "rcd,dv->rcv"
    z = jnp.einsum(spec, h.astype(w.dtype), w, preferred_element_type=jnp.float32)
    if temperature > 0 and temperature != 1.0:
        z = z / temperature
    lp = _pick(z, nxt)
    outside = jnp.zeros(lp.shape, bool)
    zp = z
    if temperature > 0 and (top_k > 0 or top_p < 1.0):
        flat = z.reshape(-1, z.shape[-1])
        m = flat.shape[0]
        zp = process_logits(flat, jnp.ones((m,), jnp.float32), jnp.full((m,), top_k, jnp.int32),
                            jnp.full((m,), top_p, jnp.float32)).reshape(z.shape)
        picked_t = jnp.take_along_axis(zp, nxt[..., None], axis=-1, mode="clip")[..., 0]
        outside = jnp.isneginf(picked_t)
        lp_t = jnp.where(outside, 0.0, picked_t) - jax.nn.logsumexp(zp, axis=-1)
        lp = jnp.where(outside, lp, lp_t)
    out = {"lp": lp, "outside": outside}
    if want_entropy:
        out["ent"] = entropy_from_logits(zp)
    if "at" in x or top_n:
        logp = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)
        if "at" in x:
            out["at_lp"] = jnp.take_along_axis(logp, x["at"], axis=-1, mode="clip")
        if top_n:
            out["top_lp"], ids = jax.lax.top_k(logp, top_n)
            out["top_ids"] = ids.astype(jnp.int32)
    return out


def _pick(z, nxt):
    """``log softmax(z)[nxt]`` along the last axis (ids clipped to ``[0, V)``)."""
    picked = jnp.take_along_axis(z, nxt[..., None], axis=-1, mode="clip")[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1)
