"""Memory-efficient ("flash") causal attention in pure JAX, with a hand-written backward pass.

``blocked_attention`` computes the same numbers as the transformer's dense training attention
(``transformer.dense_attention`` with the ``[B, L, L]`` mask ``Transformer.__call__`` builds
without a cache) without ever materialising an ``[L, L]`` array: the mask is recomputed per
block from ``[B, L]`` vectors, the softmax is the online (running max / running sum) softmax of
FlashAttention (Dao et al., 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention
with IO-Awareness"; backward as in Dao, 2023, "FlashAttention-2"), and the backward pass
recomputes the probabilities block by block from the saved per-query logsumexp.

Plain XLA only (``lax.map`` / ``lax.scan`` / ``lax.cond``; no Pallas, nothing
device-specific), so it lowers for CPU, GPU and TPU alike.

``splash_attention`` is the TPU kernel for the same mask: JAX's Pallas "splash attention"
(``jax.experimental.pallas.ops.tpu.splash_attention``, block-sparse flash attention with
segment ids). It runs the kernel per row and per (tensor-parallel) head shard under
``jax.shard_map``, since XLA cannot partition a Pallas call; off a TPU it runs in Pallas's
interpreter (the same kernel, emulated: for tests, slow).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

# Masked scores (never -inf: an empty query row stays finite). Same value as the dense path.
_MASK_VALUE = -1e30


def blocked_attention(q, k, v, *, segment_ids=None, key_ends=None, block_q=512, block_k=512):
    r"""Causal grouped-query attention, computed in ``[block_q, block_k]`` tiles.

    Formula (per row b, query head h with key/value head ``c = h // (H // KV)``)::

        s_ij   = (q_i . k_j) / sqrt(hd)                      (float32)
        p_ij   = exp(s_ij - lse_i) if allowed(i, j) else 0,   lse_i = log sum_{j allowed} exp(s_ij)
        out_i  = sum_j p_ij v_j                               (p cast to v.dtype, f32 accumulation)

    computed with the online softmax: for each query block, a scan over key blocks keeps the
    running max ``m``, running sum ``l`` and unnormalised output ``acc`` (all float32) and
    rescales them by ``exp(m_old - m_new)`` when the max grows; ``out = acc / l``. The
    backward pass (``jax.custom_vjp``) recomputes ``p`` per tile from the saved ``lse`` and
    uses ``D_i = sum_d dout_id out_id``, ``dp = dout v^T``, ``ds = p (dp - D) / sqrt(hd)``,
    ``dq = ds k``, ``dk = ds^T q``, ``dv = p^T dout``.

    Mask (identical to the dense training path of ``Transformer.__call__``): query i may see
    key j iff ``j <= i`` and

    * when ``segment_ids`` is given: ``segment_ids[i] == segment_ids[j] != 0`` (id 0 is
      padding and sees nothing);
    * when ``key_ends`` is given (preorder-packed prefix trees): ``i < key_ends[j]`` (and the
      segment condition too when both are given; with ``key_ends`` alone there is none);
    * when neither is given: plain causal attention, every token real.

    Args:
      q: ``[B, L, H, hd]``.
      k, v: ``[B, L, KV, hd]``, ``H % KV == 0``; query head h uses key/value head
        ``h // (H // KV)`` (HF ``repeat_kv``).
      segment_ids: optional ``[B, L]`` integer ids (no gradient).
      key_ends: optional ``[B, L]`` integer ends of each key's visibility range (no gradient).
      block_q, block_k: tile sizes (static Python ints); each is clipped to ``L``.

    Returns:
      ``[B, L, H * hd]`` in ``v.dtype``; equals ``dense_attention(q, k, v, mask)`` up to float
      rounding (the probabilities are cast to ``v.dtype`` before the ``p v`` product
      *unnormalised*, relative to the running max, so bfloat16 outputs differ from the dense
      path by bfloat16 rounding; float32 agrees to ~1e-6).

    Memory: ``O(B·H·L·hd)`` (inputs, output, float32 gradient accumulators) plus ``O(B·H·L)``
    for the saved logsumexp and the running statistics, plus one tile of scores
    ``[B, H, block_q, block_k]`` float32 at a time, in the forward and in the backward pass.
    Residuals kept for the backward pass: ``q, k, v``, ``segment_ids`` / ``key_ends``, the
    output and the logsumexp.

    Degenerate cases: a query whose allowed set is empty (a padding token, id 0) gets output 0
    and zero gradients, never NaN. ``L`` smaller than a block size uses one tile of ``L``;
    ``L`` not a multiple of the block sizes is padded internally (padding keys are never
    visible, padding queries are dropped). Tiles lying wholly above the causal diagonal are
    skipped with ``lax.cond`` (a predicate on loop indices only, so no data-dependent
    control flow and nothing to communicate when the batch is sharded).

    Raises:
      ValueError: shapes that do not fit (naming the argument), non-positive block sizes.
    """
    q_shape, k_shape, v_shape = jnp.shape(q), jnp.shape(k), jnp.shape(v)
    if len(q_shape) != 4:
        raise ValueError(f"q must be [B, L, H, hd], got shape {q_shape}")
    B, L, H, hd = q_shape
    if len(k_shape) != 4 or k_shape[:2] != (B, L) or k_shape[3] != hd:
        raise ValueError(f"k must be [B, L, KV, hd] = [{B}, {L}, KV, {hd}], got shape {k_shape}")
    if v_shape != k_shape:
        raise ValueError(f"v must have k's shape {k_shape}, got shape {v_shape}")
    if H % k_shape[2]:
        raise ValueError(f"q's {H} heads are not a multiple of k's {k_shape[2]} kv heads")
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    vectors = []
    for name, x in (("segment_ids", segment_ids), ("key_ends", key_ends)):
        if x is not None:
            if jnp.shape(x) != (B, L):
                raise ValueError(f"{name} must be [B, L] = [{B}, {L}], got shape {jnp.shape(x)}")
            x = jnp.asarray(x, jnp.int32)
        vectors.append(x)
    # Under jax.checkpoint: differentiated inside a lax.scan (the model's layer scan) with
    # respect to the scan's inputs, JAX otherwise keeps the forward's per-tile intermediates of
    # every tile pair ([nq, nk, B, KV, G, bq, bk] arrays: quadratic again). With it the only
    # residuals are the inputs, and the custom backward recomputes what it needs.
    return jax.checkpoint(_attention, static_argnums=(5, 6))(
        q, k, v, *vectors, min(block_q, L), min(block_k, L))


# ----------------------------------------------------------------------------- helpers


def _pad_to(x, n):
    """Pads axis 1 of ``x`` with zeros up to length ``n``."""
    extra = n - x.shape[1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))


def _blocks(x, size):
    """``[B, n * size, ...]`` -> ``[n, B, size, ...]`` (the scanned block axis first)."""
    if x is None:
        return None
    B, n = x.shape[0], x.shape[1] // size
    return jnp.moveaxis(x.reshape(B, n, size, *x.shape[2:]), 1, 0)


def _unblock(x):
    """``[n, B, size, ...]`` -> ``[B, n * size, ...]``."""
    n, B, size = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(B, n * size, *x.shape[3:])


def _tile_mask(qpos, kpos, length, seg_q, seg_k, ends_k):
    """Visibility of a tile, ``[B or 1, 1, 1, bq, bk]`` bool, from positions ``qpos [bq]``,
    ``kpos [bk]`` and the rows' ``[B, bq]`` / ``[B, bk]`` slices of the mask vectors."""
    mask = ((kpos[None, :] <= qpos[:, None]) & (qpos[:, None] < length))[None]
    if seg_q is not None:
        mask = mask & (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q[:, :, None] != 0)
    if ends_k is not None:
        mask = mask & (qpos[None, :, None] < ends_k[:, None, :])
    return mask[:, None, None]


def _tile_visible(i, j, bq, bk):
    """Whether tile (query block i, key block j) has any causally visible pair."""
    return j * bk <= i * bq + (bq - 1)


def _scores(qi, kj, scale):
    """``qi [B, bq, KV, G, hd]``, ``kj [B, bk, KV, hd]`` -> float32 ``[B, KV, G, bq, bk]``."""
    return jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale


# ----------------------------------------------------------------------------- forward


def _forward(q, k, v, seg, ends, bq, bk):
    """Returns (output ``[B, L, H * hd]`` in v.dtype, logsumexp ``[nq, B, KV, G, bq]`` f32)."""
    B, L, H, hd = q.shape
    KV = k.shape[2]
    G = H // KV
    nq, nk = -(-L // bq), -(-L // bk)
    scale = 1.0 / math.sqrt(hd)
    qb = _blocks(_pad_to(q.reshape(B, L, KV, G, hd), nq * bq), bq)     # [nq, B, bq, KV, G, hd]
    kb = _blocks(_pad_to(k, nk * bk), bk)                              # [nk, B, bk, KV, hd]
    vb = _blocks(_pad_to(v, nk * bk), bk)
    seg_q = _blocks(None if seg is None else _pad_to(seg, nq * bq), bq)  # [nq, B, bq]
    seg_k = _blocks(None if seg is None else _pad_to(seg, nk * bk), bk)  # [nk, B, bk]
    ends_k = _blocks(None if ends is None else _pad_to(ends, nk * bk), bk)
    q_offsets = jnp.arange(bq, dtype=jnp.int32)
    k_offsets = jnp.arange(bk, dtype=jnp.int32)

    def query_block(xs):
        i, qi, sq = xs
        qpos = i * bq + q_offsets

        def key_step(carry, ys):
            j, kj, vj, sk, ek = ys

            def tile(carry):
                m, l, acc = carry
                mask = _tile_mask(qpos, j * bk + k_offsets, L, sq, sk, ek)
                s = jnp.where(mask, _scores(qi, kj, scale), _MASK_VALUE)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                # where, not just exp: a row with nothing visible yet has m_new = _MASK_VALUE
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                alpha = jnp.exp(m - m_new)
                l = alpha * l + jnp.sum(p, axis=-1)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vj,
                                preferred_element_type=jnp.float32)
                return m_new, l, alpha[..., None] * acc + pv

            return lax.cond(_tile_visible(i, j, bq, bk), tile, lambda c: c, carry), None

        init = (jnp.full((B, KV, G, bq), _MASK_VALUE, jnp.float32),
                jnp.zeros((B, KV, G, bq), jnp.float32),
                jnp.zeros((B, KV, G, bq, hd), jnp.float32))
        (m, l, acc), _ = lax.scan(key_step, init,
                                  (jnp.arange(nk, dtype=jnp.int32), kb, vb, seg_k, ends_k))
        seen = l > 0.0
        safe_l = jnp.where(seen, l, 1.0)
        out = jnp.where(seen[..., None], acc / safe_l[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(safe_l), 0.0)
        return jnp.einsum("bkgqd->bqkgd", out).astype(v.dtype), lse

    out, lse = lax.map(query_block, (jnp.arange(nq, dtype=jnp.int32), qb, seg_q))
    return _unblock(out)[:, :L].reshape(B, L, H * hd), lse


# ----------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, seg, ends, bq, bk):
    return _forward(q, k, v, seg, ends, bq, bk)[0]


def _attention_fwd(q, k, v, seg, ends, bq, bk):
    out, lse = _forward(q, k, v, seg, ends, bq, bk)
    return out, (q, k, v, seg, ends, out, lse)


def _attention_bwd(bq, bk, residuals, dout):
    q, k, v, seg, ends, out, lse = residuals
    B, L, H, hd = q.shape
    KV = k.shape[2]
    G = H // KV
    nq, nk = -(-L // bq), -(-L // bk)
    scale = 1.0 / math.sqrt(hd)
    do = dout.reshape(B, L, KV, G, hd)
    # D_i = sum_j p_ij dp_ij = dout_i . out_i, per query and head
    delta = jnp.sum(do.astype(jnp.float32) * out.reshape(B, L, KV, G, hd).astype(jnp.float32),
                    axis=-1)
    qb = _blocks(_pad_to(q.reshape(B, L, KV, G, hd), nq * bq), bq)     # [nq, B, bq, KV, G, hd]
    dob = _blocks(_pad_to(do, nq * bq), bq)
    deltab = jnp.einsum("nbqkg->nbkgq", _blocks(_pad_to(delta, nq * bq), bq))  # lse's layout
    kb = _blocks(_pad_to(k, nk * bk), bk)                              # [nk, B, bk, KV, hd]
    vb = _blocks(_pad_to(v, nk * bk), bk)
    seg_q = _blocks(None if seg is None else _pad_to(seg, nq * bq), bq)
    seg_k = _blocks(None if seg is None else _pad_to(seg, nk * bk), bk)
    ends_k = _blocks(None if ends is None else _pad_to(ends, nk * bk), bk)
    q_offsets = jnp.arange(bq, dtype=jnp.int32)
    k_offsets = jnp.arange(bk, dtype=jnp.int32)

    def key_block(dq_acc, xs):
        j, kj, vj, sk, ek = xs
        kpos = j * bk + k_offsets

        def query_step(carry, ys):
            i, qi, doi, lsei, di, sq = ys

            def tile(carry):
                dk, dv = carry
                mask = _tile_mask(i * bq + q_offsets, kpos, L, sq, sk, ek)
                s = jnp.where(mask, _scores(qi, kj, scale), _MASK_VALUE)
                p = jnp.where(mask, jnp.exp(s - lsei[..., None]), 0.0)    # [B, KV, G, bq, bk]
                dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(v.dtype), doi,
                                     preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
                ds = (p * (dp - di[..., None]) * scale).astype(q.dtype)
                dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=jnp.float32)
                dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qi,
                                     preferred_element_type=jnp.float32)
                return (dk, dv), dq

            def skip(carry):
                return carry, jnp.zeros((B, bq, KV, G, hd), jnp.float32)

            return lax.cond(_tile_visible(i, j, bq, bk), tile, skip, carry)

        init = (jnp.zeros((B, bk, KV, hd), jnp.float32), jnp.zeros((B, bk, KV, hd), jnp.float32))
        (dk, dv), dq = lax.scan(query_step, init,
                                (jnp.arange(nq, dtype=jnp.int32), qb, dob, lse, deltab, seg_q))
        return dq_acc + dq, (dk, dv)

    dq, (dk, dv) = lax.scan(key_block, jnp.zeros((nq, B, bq, KV, G, hd), jnp.float32),
                            (jnp.arange(nk, dtype=jnp.int32), kb, vb, seg_k, ends_k))
    dq = _unblock(dq)[:, :L].reshape(B, L, H, hd).astype(q.dtype)
    dk = _unblock(dk)[:, :L].astype(k.dtype)
    dv = _unblock(dv)[:, :L].astype(v.dtype)
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- TPU kernel

#: The splash kernel's tile (query and key block); rows are padded to a multiple of it.
SPLASH_BLOCK = 512
_LANES = 128  # the kernel's blocks are multiples of the TPU's 128 lanes


def splash_attention(q, k, v, *, segment_ids=None, mesh=None, batch_axes=None,
                     head_axis=None, block=SPLASH_BLOCK, interpret=None):
    r"""``blocked_attention``'s causal grouped-query attention with the Pallas TPU kernel.

    Same mask and outputs as ``blocked_attention`` without ``key_ends``: query i sees key j
    iff ``j <= i`` and ``segment_ids[i] == segment_ids[j] != 0``; a padding query (id 0)
    gets output 0. The kernel (``make_splash_mha`` with a causal mask and ``SegmentIds``)
    computes ``softmax(q k^T) v`` on unscaled inputs, so q is multiplied by ``1/sqrt(hd)``
    first; its backward pass is the kernel's own (dq and dk/dv kernels).

    Args:
      q: ``[B, L, H, hd]``; k, v: ``[B, L, KV, hd]`` with ``H % KV == 0`` (query head h uses
        key/value head ``h // (H // KV)``).
      segment_ids: optional ``[B, L]`` integer ids (0 = padding). Default: all ones.
      mesh, batch_axes, head_axis: when ``mesh`` is given, the kernel runs under
        ``jax.shard_map`` with rows split over ``batch_axes`` (a mesh axis name, a tuple of
        them or None) and query and key/value heads over ``head_axis`` (None: replicated;
        it must divide both head counts: whole query groups stay with their key/value head).
      block: the kernel's query and key tile (a multiple of 128); ``L`` is padded to a
        multiple of ``min(block, L rounded up to 128)`` with padding tokens (id 0, never
        visible to a real query) and the padding is cut off again.
      interpret: run the kernel in Pallas's interpreter. Default: when the devices (the
        mesh's, else JAX's default backend) are not TPUs.

    Returns:
      ``[B, L, H * hd]`` in ``v.dtype``.

    Raises:
      ValueError: shapes that do not fit, a block that is not a positive multiple of 128, a
        head axis that does not divide the head counts.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib, splash_attention_mask as mask_lib)

    q_shape, k_shape = jnp.shape(q), jnp.shape(k)
    if len(q_shape) != 4:
        raise ValueError(f"q must be [B, L, H, hd], got shape {q_shape}")
    B, L, H, hd = q_shape
    if len(k_shape) != 4 or k_shape[:2] != (B, L) or k_shape[3] != hd:
        raise ValueError(f"k must be [B, L, KV, hd] = [{B}, {L}, KV, {hd}], got shape {k_shape}")
    if jnp.shape(v) != k_shape:
        raise ValueError(f"v must have k's shape {k_shape}, got shape {jnp.shape(v)}")
    KV = k_shape[2]
    if H % KV:
        raise ValueError(f"q's {H} heads are not a multiple of k's {KV} kv heads")
    if not isinstance(block, int) or block <= 0 or block % _LANES:
        raise ValueError(f"block must be a positive multiple of {_LANES}, got {block!r}")
    if segment_ids is None:
        segment_ids = jnp.ones((B, L), jnp.int32)
    elif jnp.shape(segment_ids) != (B, L):
        raise ValueError(f"segment_ids must be [B, L] = [{B}, {L}], got shape "
                         f"{jnp.shape(segment_ids)}")
    shards = 1 if mesh is None or head_axis is None else mesh.shape[head_axis]
    if H % shards or KV % shards:
        raise ValueError(f"mesh axis {head_axis!r} ({shards}) must divide the {H} query and "
                         f"{KV} key/value heads")
    if interpret is None:
        platform = (mesh.devices.flat[0].platform if mesh is not None
                    else jax.default_backend())
        interpret = platform != "tpu"
    tile = min(block, -(-L // _LANES) * _LANES)
    padded = -(-L // tile) * tile
    sizes = kernel_lib.BlockSizes(
        block_q=tile, block_kv=tile, block_kv_compute=tile, block_q_dkv=tile,
        block_kv_dkv=tile, block_kv_dkv_compute=tile, block_q_dq=tile, block_kv_dq=tile)
    causal = mask_lib.MultiHeadMask(
        [mask_lib.CausalMask((padded, padded)) for _ in range(H // shards)])
    splash = kernel_lib.make_splash_mha(causal, block_sizes=sizes, head_shards=1,
                                        q_seq_shards=1, interpret=interpret)

    def local(q, k, v, seg):
        seg = _pad_to(jnp.asarray(seg, jnp.int32), padded)
        # [b, L, heads, hd] -> [b, heads, L', hd], q scaled as the dense path scales scores
        q = jnp.moveaxis(_pad_to(q * jnp.asarray(1.0 / math.sqrt(hd), q.dtype), padded), 2, 1)
        k, v = (jnp.moveaxis(_pad_to(x, padded), 2, 1) for x in (k, v))
        out = jax.vmap(lambda q, k, v, s: splash(q, k, v, segment_ids=kernel_lib.SegmentIds(s, s))
                       )(q, k, v, seg)                                   # [b, heads, L', hd]
        out = jnp.moveaxis(out, 1, 2)[:, :L]
        out = jnp.where((seg[:, :L] != 0)[:, :, None, None], out, 0).astype(v.dtype)
        return out.reshape(out.shape[0], L, -1)

    if mesh is None:
        return local(q, k, v, segment_ids)
    P = jax.sharding.PartitionSpec
    heads = P(batch_axes, None, head_axis, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, P(batch_axes, None)),
                         out_specs=P(batch_axes, None, head_axis), check_vma=False)(
        q, k, v, segment_ids)
