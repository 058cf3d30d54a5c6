"""Flax NNX decoder-only transformer (Llama / Qwen2 / Qwen3), KV cache, value head, log-probs.

Architecture (pre-norm)::

    h = embed(tokens)
    for each layer (one lax.scan over the stacked layer parameters):
        h = h + o_proj(attention(rope(q_norm?(q_proj(rms(h)))), rope(k_norm?(k_proj(rms(h)))),
                                 v_proj(rms(h))))
        h = h + down_proj(silu(gate_proj(rms(h))) * up_proj(rms(h)))
    hidden = rms(h)                         # ModelOutput.hidden
    logits = hidden @ lm_head (f32)         # or @ embed.T when tied
    values = value_head(hidden)[..., 0]     # when config.value_head

Module tree (the NNX paths that ``hf.hf_param_map`` maps to HF tensor names). The decoder
layers are one ``DecoderLayer`` whose parameters are stacked along a leading ``[num_layers]``
axis (logical axis ``"layers"``): the forward pass is a ``lax.scan`` over that axis, so the
compiled program holds one layer's code whatever the depth (MaxText's "scanned layers")::

    embed_tokens.embedding                                [V, D]
    layers.input_layernorm.weight                         [n_layers, D]
    layers.self_attn.{q,k,v,o}_proj.kernel (.bias)        [n_layers, in, out] (HF weight^T)
    layers.self_attn.{q,k}_norm.weight                    [n_layers, head_dim] (qk_norm / Qwen3)
    layers.post_attention_layernorm.weight                [n_layers, D]
    layers.mlp.{gate,up,down}_proj.kernel (.bias)         [n_layers, in, out]
    norm.weight                                           [D]
    lm_head.kernel                                        [D, V]       (untied only)
    value_head.kernel / .bias                             [D, 1] / [1] (float32; value_head only)

Precision: parameters and activations are in ``config.dtype``; RMSNorm statistics, RoPE angles,
attention scores and softmax, logits (f32 accumulation) and log-softmax are float32. Matmuls
use JAX's default precision (full f32 on CPU; on TPU/GPU set
``jax.config.update("jax_default_matmul_precision", "highest")`` if trainer and sampler
log-probs must agree tightly in float32).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxrl_agent.models.attention import blocked_attention, splash_attention
from jaxrl_agent.models.config import ModelConfig

# Large negative used for masked attention scores (never -inf: fully masked rows stay finite).
MASK_VALUE = -1e30

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def param_dtype(config: ModelConfig):
    """The jnp dtype of the parameters of ``config``."""
    return _DTYPES[config.dtype]


# ----------------------------------------------------------------------------- containers


@struct.dataclass
class KVCache:
    """Functional key/value cache for incremental decoding (a pytree; static shapes).

    Attributes:
      k, v: ``[num_layers, B, num_kv_heads, max_len, head_dim]`` in the cache dtype, the layers
        stacked like the model's (the layer scan carries them and updates layer i in place);
        heads before slots, so a decode step's attention reads each head's keys as one
        ``[slots, head_dim]`` matrix, with no transposed copy.
        Keys are stored *after* q/k-norm and RoPE.
      index: ``[B]`` int32, per row the number of valid slots = the slot the next token is
        written to. Slots ``>= index[b]`` hold nothing valid (they may hold stale data, which
        is masked out and overwritten later).

    The cache is never mutated in place: ``Transformer.__call__`` returns an updated copy in
    ``ModelOutput.cache``, so it can be a ``jax.jit`` argument (donate it to let XLA reuse the
    buffers) or a ``lax.while_loop`` / ``lax.scan`` carry.
    """

    k: Any
    v: Any
    index: Any

    @property
    def batch_size(self) -> int:
        return self.index.shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]


@struct.dataclass
class ModelOutput:
    """What ``Transformer.__call__`` returns.

    Attributes:
      logits: ``[B, L, V]`` float32 (None when called with ``compute_logits=False``).
      hidden: ``[B, L, D]`` final-RMSNorm output, in the parameter dtype.
      values: ``[B, L]`` float32 value-head outputs, or None without a value head.
      cache: the updated ``KVCache`` when one was passed, else None.
    """

    logits: Any
    hidden: Any
    values: Any = None
    cache: Any = None


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """An empty ``KVCache``: k and v zeros ``[num_layers, batch_size, num_kv_heads, max_len,
    head_dim]`` (``dtype`` default: the parameter dtype) and ``index`` = zeros
    ``[batch_size]``."""
    dtype = param_dtype(config) if dtype is None else jnp.dtype(dtype)
    shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   index=jnp.zeros((batch_size,), jnp.int32))


# ----------------------------------------------------------------------------- RoPE


def rope_frequencies(config: ModelConfig, seq_len=None):
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin scale, as HF computes
    them for each ``rope_type``.

    * default: ``theta^(-2i/d)``;
    * ``linear``: divided by ``factor``;
    * ``llama3``: Llama 3.1 wavelength-dependent scaling (low/high frequency factors);
    * ``yarn``: NTK-by-parts interpolation, and cos/sin scaled by ``attention_factor``
      (default ``0.1 ln(factor) + 1``, or the mscale ratio);
    * ``dynamic`` (NTK): ``theta' = theta (f s / m - (f - 1))^(d / (d - 2))`` with
      ``s = max(seq_len, m)``, ``m = max_position_embeddings``; ``seq_len`` is
      ``max(positions) + 1`` of the current call (traced). Within ``m`` this is plain RoPE,
      exactly like HF. Beyond ``m`` it matches a fresh HF model's full forward; HF's
      rotary module additionally remembers the longest length seen across calls, which this
      stateless version does not (and with a KV cache each chunk's keys use the frequencies
      of their own call, as in HF).
    """
    d = config.head_dim
    theta = config.rope_theta
    expo = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
    inv = (1.0 / (np.float32(theta) ** expo)).astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return jnp.asarray(inv), 1.0
    kind = rs["rope_type"]
    if kind == "linear":
        return jnp.asarray(inv / np.float32(rs["factor"])), 1.0
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        out = np.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        return jnp.asarray(np.where(medium, smoothed, out).astype(np.float32)), 1.0
    if kind == "yarn":
        old = rs["original_max_position_embeddings"]
        factor = rs.get("factor") or config.max_position_embeddings / old
        att = rs.get("attention_factor")
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if att is None:
            att = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
                   if mscale and mscale_all else get_mscale(factor))
        beta_fast = rs.get("beta_fast") or 32
        beta_slow = rs.get("beta_slow") or 1
        truncate = rs.get("truncate", True)

        def corr_dim(rot):
            return (d * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extra = 1 - ramp
        pos_freqs = np.float32(theta) ** expo
        inv_extra = 1.0 / pos_freqs
        inv_inter = 1.0 / (np.float32(factor) * pos_freqs)
        out = inv_inter * (1 - extra) + inv_extra * extra
        return jnp.asarray(out.astype(np.float32)), float(att)
    if kind == "dynamic":
        factor = rs["factor"]
        m = config.max_position_embeddings
        s = jnp.maximum(jnp.asarray(m if seq_len is None else seq_len, jnp.float32), m)
        base = theta * ((factor * s / m) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (base ** jnp.asarray(expo)), 1.0
    raise ValueError(f"unsupported rope_type {kind!r}")


def apply_rope(x, positions, inv_freq, scale):
    """Rotates ``x`` [B, L, heads, hd] by ``positions`` [B, L] (HF "rotate_half" convention:
    the first and second halves of the head dimension form the pairs). Angles in float32."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, L, hd/2]
    ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(ang) * scale, jnp.sin(ang) * scale
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


# ----------------------------------------------------------------------------- layers


def _normal(rngs, shape, dtype, std=0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix (``Linear.lora_a`` / ``lora_b``): a parameter the trainer trains
    while the base weights stay frozen (``trainable_filter``)."""


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)``; ``kernel`` is [in, out] (the transpose of HF's weight).

    With a LoRA adapter (``add_lora``) it computes ``y = x @ kernel (+ bias) + scale (x @
    lora_a) @ lora_b``, ``lora_a [in, r]``, ``lora_b [r, out]``, ``scale = lora_alpha / r``.
    Adapters are float32 (the optimizer's updates to them are small); their product runs in
    the kernel's dtype."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype,
                 rngs: nnx.Rngs, axes: tuple = (None, None)):
        self.kernel = nnx.Param(_normal(rngs, (in_features, out_features), dtype),
                                logical_axes=tuple(axes))
        self.bias = (nnx.Param(jnp.zeros((out_features,), dtype), logical_axes=(axes[1],))
                     if use_bias else None)
        self.lora_a, self.lora_b = nnx.data(None), nnx.data(None)  # (add_lora)
        self.lora_scale = 0.0

    def add_lora(self, a, b, scale: float):
        """Attaches the adapter ``(a [..., in, r], b [..., r, out])`` (leading axes: a stacked
        layer's) with logical axes ``(..., in, None)`` / ``(..., None, out)`` of the kernel's."""
        axes = tuple(self.kernel.get_metadata().get("logical_axes") or
                     (None,) * self.kernel.ndim)
        self.lora_a = LoRAParam(a, logical_axes=axes[:-1] + (None,))
        self.lora_b = LoRAParam(b, logical_axes=axes[:-2] + (None, axes[-1]))
        self.lora_scale = float(scale)

    def __call__(self, x):
        kernel = self.kernel[...]
        x = x.astype(kernel.dtype)
        if self.lora_a is None:
            y = jnp.einsum("...i,io->...o", x, kernel)
        else:
            y = lora_matmul(x, kernel, self.lora_a[...], self.lora_b[...], self.lora_scale)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def lora_matmul(x, w, a, b, scale: float):
    """``x @ (w + scale a b)``: ``x [..., in]``, ``w [in, out]``, LoRA adapter ``a [in, r]``,
    ``b [r, out]``.

    The forward pass multiplies by the merged weight (one ``[in, out]`` matrix per call, in
    ``w``'s dtype): with ``b = 0`` it is ``w`` itself, bit for bit, so an adapted model
    starts with exactly the base model's outputs. The backward pass takes the low-rank path:
    ``da = scale x^T (dy b^T)``, ``db = scale (x a)^T dy`` (``tokens x r`` products, no
    ``[in, out]`` gradient); ``dw = x^T dy`` is returned as well and left out by XLA when
    nothing reads it (a frozen base)."""
    return jnp.einsum("...i,io->...o", x, merge_lora(w, a, b, scale))


def merge_lora(w, a, b, scale: float):
    """``w + scale a b`` in ``w``'s dtype (the product in float32): a LoRA-adapted kernel as
    one matrix (``w`` itself, bit for bit, while ``b`` is zero)."""
    return w + (scale * jnp.dot(a, b, preferred_element_type=jnp.float32)).astype(w.dtype)


def _lora_fwd(x, w, a, b, scale):
    return lora_matmul(x, w, a, b, scale), (x, w, a, b)


def _lora_bwd(scale, res, dy):
    x, w, a, b = res
    dx = jnp.einsum("...o,io->...i", dy, merge_lora(w, a, b, scale))
    xa = jnp.einsum("...i,ir->...r", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    dyb = jnp.einsum("...o,ro->...r", dy, b.astype(dy.dtype),
                     preferred_element_type=jnp.float32)
    lead = "".join("abcdefgh"[: x.ndim - 1])
    da = scale * jnp.einsum(f"{lead}i,{lead}r->ir", x, dyb.astype(x.dtype),
                            preferred_element_type=jnp.float32)
    db = scale * jnp.einsum(f"{lead}r,{lead}o->ro", xa.astype(dy.dtype), dy,
                            preferred_element_type=jnp.float32)
    dw = jnp.einsum(f"{lead}i,{lead}o->io", x, dy).astype(w.dtype)
    return dx.astype(x.dtype), dw, da.astype(a.dtype), db.astype(b.dtype)


lora_matmul.defvjp(_lora_fwd, _lora_bwd)


def lora_paths(config: ModelConfig) -> dict:
    """``{path of an adapted Linear: (in, out)}`` under ``config`` (empty without LoRA)."""
    if not config.lora_rank:
        return {}
    D, F, hd = config.hidden_size, config.intermediate_size, config.head_dim
    H, KV = config.num_heads * hd, config.num_kv_heads * hd
    dims = {"q_proj": ("self_attn", D, H), "k_proj": ("self_attn", D, KV),
            "v_proj": ("self_attn", D, KV), "o_proj": ("self_attn", H, D),
            "gate_proj": ("mlp", D, F), "up_proj": ("mlp", D, F), "down_proj": ("mlp", F, D)}
    return {("layers", dims[n][0], n): dims[n][1:] for n in config.lora_targets}


def lora_init(config: ModelConfig, key) -> dict:
    """Fresh adapters ``{path: (a, b)}`` for ``lora_paths(config)``, stacked over the layers:
    ``a [L, in, r]`` uniform in ``+-1 / sqrt(in)`` (PEFT's default), ``b [L, r, out]`` zero, so
    the adapted model starts equal to the base model bit for bit. Float32."""
    out = {}
    L, r = config.num_layers, config.lora_rank
    for i, (path, (din, dout)) in enumerate(sorted(lora_paths(config).items())):
        bound = 1.0 / math.sqrt(din)
        a = jax.random.uniform(jax.random.fold_in(key, i), (L, din, r), jnp.float32,
                               -bound, bound)
        out[path] = (a, jnp.zeros((L, r, dout), jnp.float32))
    return out


def trainable_filter(config: ModelConfig):
    """The ``nnx`` filter of the parameters the trainer trains: all of them without LoRA
    (``config.lora_rank == 0``); with LoRA the adapters (``LoRAParam``), the value head and,
    with ``lora_train_norms``, the RMSNorm weights. The others are frozen: no gradient, no
    optimizer state."""
    if not config.lora_rank:
        return nnx.Param
    keep = [LoRAParam, nnx.PathContains("value_head")]
    if config.lora_train_norms:
        keep.append(lambda path, _: len(path) > 1 and str(path[-2]).endswith("norm"))
    return nnx.Any(*keep)


class RMSNorm(nnx.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))``, statistics in float32, result cast back to the
    input dtype before the scale (as HF does)."""

    def __init__(self, dim: int, *, eps: float, dtype, axis: str = "norm"):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), logical_axes=(axis,))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = nnx.Param(_normal(rngs, (vocab, dim), dtype),
                                   logical_axes=("vocab", "embed"))

    def __call__(self, tokens, out_sharding=None):
        table = self.embedding[...]
        if out_sharding is None:
            # mode="clip": an out-of-range id never produces NaN (the default "fill" would).
            return jnp.take(table, tokens, axis=0, mode="clip")
        # FSDP without gathering the table: every device looks up the ids of all rows of its
        # data-parallel group in its own shard of the table (ids are a few KB; the result is
        # split along the embedding dimension like the table, summed over the vocabulary's
        # split), then the rows move to their devices (an all-to-all inside the group). The
        # gradient flows back the same way into the local shard.
        mesh = out_sharding.mesh
        P_ = jax.sharding.PartitionSpec
        data = "data" if mesh.shape.get("data", 1) > 1 else None
        tokens = jax.lax.with_sharding_constraint(
            tokens, jax.sharding.NamedSharding(mesh, P_(data)))
        x = jnp.take(table, tokens, axis=0, mode="clip")
        fsdp = "fsdp" if mesh.shape.get("fsdp", 1) > 1 else None
        x = jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(
            mesh, P_(data, None, fsdp)))
        return jax.lax.with_sharding_constraint(x, out_sharding)


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dt, b = param_dtype(config), config.mlp_bias
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(d, f, use_bias=b, dtype=dt, rngs=rngs, axes=("embed", "mlp"))
        self.up_proj = Linear(d, f, use_bias=b, dtype=dt, rngs=rngs, axes=("embed", "mlp"))
        self.down_proj = Linear(f, d, use_bias=b, dtype=dt, rngs=rngs, axes=("mlp", "embed"))

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def dense_attention(q, k, v, mask, heads_first: bool = False):
    """Grouped-query attention. q [B,L,H,hd], k/v [B,S,KV,hd] (``[B,KV,S,hd]`` with
    ``heads_first``: the KV cache's layout), mask [B,L,S] bool.

    Query head h uses key/value head ``h // (H // KV)`` (HF ``repeat_kv``). Scores and softmax
    in float32; masked scores are ``MASK_VALUE``; a query whose mask row is empty gets a zero
    output (finite, never NaN).
    """
    B, L, H, hd = q.shape
    kvh = k.shape[1 if heads_first else 2]
    q = q.reshape(B, L, kvh, H // kvh, hd)
    kv = "bksd" if heads_first else "bskd"
    scores = jnp.einsum(f"blkgd,{kv}->bkgls", q, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(hd))
    m = mask[:, None, None, :, :]
    scores = jnp.where(m, scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.any(m, axis=-1, keepdims=True), probs, 0.0)
    out = jnp.einsum(f"bkgls,{kv}->blkgd", probs.astype(v.dtype), v)
    return out.reshape(B, L, H * hd)


#: How training attention (no cache) is computed (``Transformer(..., attention=)``).
ATTENTION_IMPLS = {
    "dense": "the [B, L, L] mask and [B, heads, L, L] float32 scores materialised",
    "blocked": "flash-style tiles of 512 x 512 (models.attention.blocked_attention): the mask "
               "is recomputed per tile, no [L, L] array in the forward or the backward pass",
    "splash": "the Pallas TPU flash kernel (models.attention.splash_attention), TPU only; "
              "no prefix trees",
}


@struct.dataclass
class BlockedMask:
    """The mask of ``blocked_attention`` / ``splash_attention``, as the ``[B, L]`` vectors it
    is computed from, and which of the two computes it (``kernel``; with the mesh and the
    rows' mesh axes the splash kernel runs under)."""

    segment_ids: Any = None
    key_ends: Any = None
    kernel: str = struct.field(pytree_node=False, default="blocked")
    mesh: Any = struct.field(pytree_node=False, default=None)
    batch_axes: Any = struct.field(pytree_node=False, default=None)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dt, d, hd = param_dtype(config), config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_heads,
                                                           config.num_kv_heads, hd)
        self.q_proj = Linear(d, config.num_heads * hd, use_bias=config.qkv_bias, dtype=dt,
                             rngs=rngs, axes=("embed", "heads"))
        self.k_proj = Linear(d, config.num_kv_heads * hd, use_bias=config.qkv_bias, dtype=dt,
                             rngs=rngs, axes=("embed", "kv_heads"))
        self.v_proj = Linear(d, config.num_kv_heads * hd, use_bias=config.qkv_bias, dtype=dt,
                             rngs=rngs, axes=("embed", "kv_heads"))
        self.o_proj = Linear(config.num_heads * hd, d, use_bias=config.o_bias, dtype=dt, rngs=rngs,
                             axes=("heads", "embed"))
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps, dtype=dt, axis="head_dim")
            self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps, dtype=dt, axis="head_dim")
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, positions, rope, mask, kv_cache=None, slots=None):
        """x [B,L,D]. Without a cache, ``mask`` is [B,L,L]. With ``kv_cache = (k, v, layer)``
        (the model's stacked ``[layers, B, KV, max_len, hd]`` keys and values and this layer's
        index) the new keys/values are scattered to ``[layer, b, slots[b]]`` in place, the
        attention reads layer ``layer``'s slice, and ``mask`` is [B,L,max_len]. Returns
        (output [B,L,D], updated stacked (k, v) or None)."""
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, L, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, L, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq, scale = rope
        q, k = apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale)
        new_cache = None
        if kv_cache is not None:
            ck, cv, layer = kv_cache
            # one scatter of the new tokens into the stacked cache at [layer, row, slot], in
            # place: no layer slice is copied out and written back, the step moves only the
            # new keys/values (a cache split over rows stays where it lies: the decode step on
            # a data 4 x tensor 2 host mesh all-gathers 9.6 KB of indices, no keys or values)
            rows = jnp.arange(B, dtype=jnp.int32)[:, None]
            ck, cv = (c.at[layer, rows, :, slots].set(new.astype(c.dtype), mode="drop")
                      for c, new in ((ck, k), (cv, v)))
            new_cache = (ck, cv)
            k, v = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False).astype(q.dtype)
                    for c in (ck, cv))
        if isinstance(mask, BlockedMask) and mask.kernel == "splash":
            mesh = mask.mesh
            out = splash_attention(q, k, v, segment_ids=mask.segment_ids, mesh=mesh,
                                   batch_axes=mask.batch_axes, head_axis=(
                                       "tensor" if mesh is not None and
                                       mesh.shape.get("tensor", 1) > 1 else None))
        elif isinstance(mask, BlockedMask):
            out = blocked_attention(q, k, v, segment_ids=mask.segment_ids,
                                    key_ends=mask.key_ends)
        else:
            out = dense_attention(q, k, v, mask, heads_first=kv_cache is not None)
        return self.o_proj(out), new_cache


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dt = param_dtype(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dt)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                                dtype=dt)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, h, positions, rope, mask, kv_cache=None, slots=None, mlp_chunk=0,
                 rows_sharding=None, mlp_shardings=None):
        a, new_cache = self.self_attn(self.input_layernorm(h), positions, rope, mask, kv_cache,
                                      slots)
        h = h + a
        x = self.post_attention_layernorm(h)
        h = h + (tiled_over_tokens(self.mlp, x, mlp_chunk, rows_sharding, mlp_shardings)
                 if mlp_chunk else self.mlp(x))
        return h, new_cache


def tiled_over_tokens(fn, x, chunk: int, rows_sharding=None, weight_shardings=None):
    """``fn(x)`` for a position-wise ``fn`` (the MLP module), computed ``chunk`` positions at a
    time.

    ``x [B, L, D]`` is padded to a multiple of ``chunk`` along L, cut into ``[B, chunk, D]``
    tiles and mapped with ``jax.lax.map`` under ``jax.checkpoint``: the forward and the
    backward pass hold one tile's hidden activations (``[B, chunk, F]``) instead of the whole
    row's, and the backward recomputes them tile by tile (weight gradients are summed over
    the tiles). Same numbers as ``fn(x)`` (each position is computed alone either way); for
    long rows, where one layer's ``[B, L, F]`` MLP activations and their gradients outgrow
    the saved layer inputs. ``L <= chunk`` is one call of ``fn``.

    ``rows_sharding`` (the ``NamedSharding`` of ``x``'s rows: the train step's activation
    layout, rows over the batch axes) and ``weight_shardings`` (the layout ``fn``'s weights
    are used in, a tree like ``nnx.state(fn)``: ``sharding.layer_use_shardings``' part for the
    MLP): with both, and S > 1 row shards, every shard's rows read their own broadcast copy of
    the weights (``[S, ...]``: the leading axis over the batch axes, the rest laid out as
    used, tensor parallelism kept), so each tile's weight gradient is added to its shard's
    copy and the copies are summed across devices once, after the tiles. Without the copies
    a compiler that does not move the reduction out of the loop reduces the weights'
    gradient across devices in every tile (XLA on CPU does; ``train.logprobs`` does the same
    for the LM head).
    """
    B, L, D = x.shape
    if L <= chunk:
        return fn(x)
    n = -(-L // chunk)
    S, lead = _row_shards(rows_sharding, B) if weight_shardings is not None else (1, None)
    tiles = jnp.pad(x, ((0, 0), (0, n * chunk - L), (0, 0))).reshape(S, B // S, n, chunk, D)
    tiles = jnp.moveaxis(tiles, 2, 0)  # [n, S, B / S, chunk, D]
    graphdef, weights = nnx.split(fn)
    leaves, treedef = jax.tree.flatten(weights)
    uses = jax.tree.leaves(weight_shardings) if lead is not None else [None] * len(leaves)
    if len(uses) != len(leaves):
        raise ValueError(f"weight_shardings has {len(uses)} leaves, the MLP {len(leaves)}")

    def copy(w, use):  # one copy per row shard, on that shard's devices, laid out as used
        w = jnp.broadcast_to(w, (S,) + w.shape)
        if use is None:
            return w
        spec = tuple(use.spec) + (None,) * (w.ndim - 1 - len(use.spec))
        return jax.lax.with_sharding_constraint(w, jax.sharding.NamedSharding(
            use.mesh, jax.sharding.PartitionSpec(lead, *spec)))

    ws = jax.tree.unflatten(treedef, [copy(w, u) for w, u in zip(leaves, uses)])

    def tile(t):  # [S, B / S, chunk, D]: each shard's rows through its own copy
        return jax.vmap(lambda w, xs: nnx.merge(graphdef, w)(xs))(ws, t)

    out = jax.lax.map(jax.checkpoint(tile, prevent_cse=False), tiles)  # [n, S, B/S, chunk, D']
    return jnp.moveaxis(out, 0, 2).reshape(B, n * chunk, -1)[:, :L]


def _row_shards(rows_sharding, rows: int) -> tuple[int, Any]:
    """``(S, lead)``: the number of shards ``rows_sharding`` splits the rows into (the product
    of the mesh axes of its first dimension) and that dimension's spec entry; ``(1, None)``
    without a sharding, for unsplit rows, or when S does not divide ``rows``."""
    spec = getattr(rows_sharding, "spec", None)
    lead = spec[0] if spec is not None and len(spec) else None
    if lead is None:
        return 1, None
    axes = (lead,) if isinstance(lead, str) else tuple(lead)
    S = math.prod(rows_sharding.mesh.shape[a] for a in axes)
    return (S, lead) if S > 1 and rows % S == 0 else (1, None)


# Activation checkpointing of the decoder layers in the backward pass (``Transformer(...,
# remat=)``), one row per policy: what each layer keeps from its forward pass.
REMAT_POLICIES = {
    "none": "keep every activation (fastest, most memory)",
    "full": "keep only each layer's input; recompute the layer in the backward pass",
    "save_dots": "keep the outputs of the layer's matmuls (no batch dimensions); recompute "
                 "norms, RoPE, softmax and activations",
    "offload": "as save_dots, but the saved matmul outputs go to host memory (TPU/GPU only)",
}


def remat_policy_name(remat) -> str:
    """The ``REMAT_POLICIES`` key of a ``remat`` argument (``True`` = ``"full"``, ``False`` /
    None = ``"none"``); ValueError for anything else."""
    if remat is True:
        return "full"
    if remat is False or remat is None:
        return "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)} (or true / false), "
                         f"got {remat!r}")
    return remat


def _checkpoint(fn, policy: str):
    """``fn`` under ``jax.checkpoint`` with the named ``REMAT_POLICIES`` policy. ``"none"`` is
    ``everything_saveable`` rather than no checkpoint: the same residuals, but inside the layer
    scan JAX then keeps the blocked attention's custom backward as the only way back through
    the attention (without it, differentiating the scan kept every tile pair's forward
    intermediates, [n_q, n_k, ..., block, block] arrays: quadratic in the row length)."""
    cp = jax.checkpoint_policies
    kinds = {"none": cp.everything_saveable, "full": None,
             "save_dots": cp.dots_with_no_batch_dims_saveable,
             "offload": cp.offload_dot_with_no_batch_dims("device", "pinned_host")}
    return jax.checkpoint(fn, policy=kinds[policy], prevent_cse=False)


def stack_layers(layers) -> "DecoderLayer":
    """One ``DecoderLayer`` whose parameters are those of ``layers`` stacked along a new
    leading axis (logical axis ``"layers"``): the layout ``Transformer`` scans over."""
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[state for _, state in splits])
    for _, var in nnx.to_flat_state(stacked):
        axes = var.get_metadata().get("logical_axes")
        if axes is not None:
            var.set_metadata("logical_axes", ("layers",) + tuple(axes))
    return nnx.merge(graphdef, stacked)


def segment_positions(segment_ids):
    """Per-segment positions: for each row, the index of each token within its run of equal
    ``segment_ids`` (a new run starts wherever the id changes). [B, L] int32."""
    L = segment_ids.shape[1]
    t = jnp.arange(L, dtype=jnp.int32)[None, :]
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start_idx = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    return (t - start_idx).astype(jnp.int32)


# ----------------------------------------------------------------------------- the model


class Transformer(nnx.Module):
    """Decoder-only Llama/Qwen2/Qwen3 transformer with an optional value head.

    ``Transformer(config, rngs=nnx.Rngs(0))`` initialises weights as HF does (normal(0.02)
    for matrices, ones for norms, zeros for biases); use ``hf.load_hf`` to load a checkpoint.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dt = param_dtype(config)
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, dtype=dt, rngs=rngs)
        # built one by one (the same random draws as unstacked layers), then stacked for the scan
        self.layers = stack_layers([DecoderLayer(config, rngs=rngs)
                                    for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dt)
        self.lm_head = (None if config.tie_word_embeddings else
                        Linear(config.hidden_size, config.vocab_size, use_bias=False, dtype=dt,
                               rngs=rngs, axes=("embed", "vocab")))
        self.value_head = (Linear(config.hidden_size, 1, use_bias=True, dtype=jnp.float32,
                                  rngs=rngs, axes=("embed", None)) if config.value_head else None)
        if config.lora_rank:  # drawn after every base weight: the base equals a LoRA-less one
            self.attach_lora(lora_init(config, rngs.params()))

    def attach_lora(self, adapters: dict):
        """Sets the LoRA adapters ``{path: (a, b)}`` (``lora_init``'s layout) on their
        ``Linear`` s, with the scale ``lora_alpha / lora_rank``."""
        scale = self.config.lora_alpha / self.config.lora_rank
        for path, (a, b) in adapters.items():
            obj = self
            for key in path:
                obj = getattr(obj, key)
            obj.add_lora(a, b, scale)

    # -- pieces the sampler may call directly

    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
        """An empty ``KVCache`` for this model; see ``init_cache``."""
        return init_cache(self.config, batch_size, max_len, dtype)

    def logits_from_hidden(self, hidden):
        """float32 logits ``[..., V]`` from final hidden states ``[..., D]`` (the LM head only:
        lets a sampler compute logits at the last position of a prefill without the full
        ``[B, L, V]`` tensor)."""
        w, tied = self.head_weight()
        return jnp.einsum("...d,vd->...v" if tied else "...d,dv->...v", hidden.astype(w.dtype),
                          w, preferred_element_type=jnp.float32)

    def head_weight(self):
        """``(weight, tied)``: the LM head's weight, ``[D, V]`` (``tied`` False) or the embedding
        table ``[V, D]`` (``tied`` True), for code that computes logits itself in pieces
        (``train.logprobs.chunked_sampled_logprobs``)."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...], True
        return self.lm_head.kernel[...], False

    def values_from_hidden(self, hidden):
        """float32 values ``[...]`` from final hidden states ``[..., D]`` (None without a value
        head). Applies ``stop_gradient`` first when ``config.value_stop_gradient``."""
        if self.value_head is None:
            return None
        h = hidden.astype(jnp.float32)
        if self.config.value_stop_gradient:
            h = jax.lax.stop_gradient(h)
        return self.value_head(h)[..., 0]

    def __call__(self, tokens, positions=None, segment_ids=None, cache: KVCache | None = None,
                 *, key_ends=None, compute_logits: bool = True, remat: bool = False,
                 activation_sharding=None, residual_sharding=None, layer_shardings=None,
                 attention: str = "dense", mlp_chunk: int = 0,
                 layer_unroll: int | bool = 1) -> ModelOutput:
        """Runs the model.

        Args:
          tokens: ``[B, L]`` int32 token ids.
          positions: ``[B, L]`` int32 RoPE positions. Default: without a cache,
            ``arange(L)`` restarted at every segment boundary (``segment_positions``; plain
            ``arange(L)`` when ``segment_ids`` is None); with a cache,
            ``cache.index[:, None] + arange(L)``.
          segment_ids: ``[B, L]`` int32. Without a cache: token i attends to token j iff
            ``j <= i`` and ``segment_ids[i] == segment_ids[j] != 0``; id 0 is padding (attends
            to nothing, its attention output is 0, its outputs are finite and meaningless).
            Several sequences packed in one row with distinct ids and per-sequence positions
            give exactly the per-sequence results. Default: all ones. With a cache it only
            marks padding (0) vs real tokens (non-zero); see ``cache``.
          cache: a ``KVCache`` (``init_cache``) for prefill/decode. The L new tokens of row b
            are written to slots ``cache.index[b] + arange(L)`` (slots past ``max_len`` are
            dropped: keep ``index + L <= max_len``), and query i of row b attends to slots
            ``s <= cache.index[b] + i``. The returned cache has ``index + n_b``, where ``n_b``
            is the number of tokens of row b with ``segment_ids != 0`` (L when segment_ids is
            None): give each row's real tokens first and its padding last, so a padded prompt
            batch prefills in one call and every row continues at its own length. A padding
            query attends to nothing. One sequence per row (no packing) in cache mode.
          key_ends: ``[B, L]`` int32, packed prefix trees (``rollout.tree``; no cache): key j
            is visible to queries ``j <= i < key_ends[j]``, which in a tree laid out in
            preorder are exactly the nodes of j's subtree (so every token attends to its
            ancestors and itself); give the node depths as ``positions``. Combined with
            ``segment_ids`` when both are given. The mask is computed from these ``[B, L]``
            ends inside the attention, never passed as an ``[L, L]`` array. Plain causal
            attention is ``key_ends = L``.
          compute_logits: False skips the LM head (``logits`` is None); use
            ``logits_from_hidden`` on the positions you need.
          remat: what each decoder layer keeps for the backward pass: a ``REMAT_POLICIES``
            name (``"full"``: only the layer's input, the rest recomputed; ``"save_dots"``;
            ``"offload"``; ``"none"``), or True (= ``"full"``) / False (= ``"none"``).
            Training memory; ignored with a cache.
          attention: ``"dense"``, ``"blocked"`` or ``"splash"`` (``ATTENTION_IMPLS``): how
            attention without a cache is computed; the same numbers (up to float32
            rounding), ``"blocked"`` and ``"splash"`` without the ``[L, L]`` mask and
            scores. ``"splash"`` is the TPU kernel (under ``jax.shard_map`` on
            ``activation_sharding``'s mesh, rows over its batch axes and heads over
            ``tensor``; emulated off a TPU) and takes no ``key_ends``. Ignored with a cache
            (the sampler's prefill is chunked instead).
          mlp_chunk: > 0 computes each layer's MLP this many positions at a time
            (``tiled_over_tokens``: one tile's ``[B, chunk, intermediate]`` activations
            alive, recomputed tile by tile backward); 0 = the whole row at once. The same
            numbers. Ignored with a cache.
          activation_sharding: a ``Sharding`` the residual stream ``[B, L, D]`` is constrained
            to before every layer (the trainer passes batch rows over the mesh's data axes,
            replicated over ``tensor``: the Megatron layout), so XLA never picks a layout that
            needs a full rematerialisation to switch. Ignored with a cache.
          residual_sharding: the layout of the residual stream between layers, when it differs
            from ``activation_sharding`` (the trainer splits its embedding dimension over
            ``tensor``: ``sharding.residual_spec``); the final hidden states are returned in
            ``activation_sharding``'s layout. Default: ``activation_sharding``.
          layer_shardings: the layout one layer's weights are used in (a tree like one
            layer's ``nnx.State`` without the ``layers`` axis; the trainer passes
            ``sharding.layer_use_shardings``: FSDP's split gathered, tensor parallelism kept),
            so each weight is gathered once per layer per pass, not once per use. Ignored
            with a cache.
          layer_unroll: how many layers one iteration of the layer scan runs (``lax.scan``'s
            ``unroll``); True runs every layer with no loop. The same numbers. ``jaxrl-agent
            plan`` compiles one decode step unrolled, because XLA's cost analysis counts a
            loop's body once.

        Returns:
          ``ModelOutput(logits [B,L,V] f32, hidden [B,L,D], values [B,L] f32 or None,
          cache)``.
        """
        cfg = self.config
        tokens = jnp.asarray(tokens, jnp.int32)
        B, L = tokens.shape
        if segment_ids is not None:
            segment_ids = jnp.asarray(segment_ids, jnp.int32)
        t = jnp.arange(L, dtype=jnp.int32)

        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {sorted(ATTENTION_IMPLS)}, got "
                             f"{attention!r}")
        if cache is None and attention == "splash" and key_ends is not None:
            raise ValueError("attention='splash' cannot mask packed prefix trees (key_ends); "
                             "use attention='blocked'")
        if cache is None and attention in ("blocked", "splash"):
            if positions is None:
                positions = (jnp.broadcast_to(t, (B, L)) if segment_ids is None
                             else segment_positions(segment_ids))
            mesh = getattr(activation_sharding, "mesh", None)
            mask = BlockedMask(
                segment_ids=segment_ids,
                key_ends=None if key_ends is None else jnp.asarray(key_ends, jnp.int32),
                kernel=attention, mesh=mesh,
                batch_axes=None if mesh is None else (tuple(activation_sharding.spec) + (None,))[0])
            slots = None
        elif cache is None:
            if positions is None:
                positions = (jnp.broadcast_to(t, (B, L)) if segment_ids is None
                             else segment_positions(segment_ids))
            mask = (t[:, None] >= t[None, :])[None]
            if segment_ids is not None or key_ends is None:
                seg = jnp.ones((B, L), jnp.int32) if segment_ids is None else segment_ids
                mask = mask & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
            if key_ends is not None:  # ancestor ranges of a preorder-packed prefix tree
                ends = jnp.asarray(key_ends, jnp.int32)
                mask = mask & (t[None, :, None] < ends[:, None, :])
            slots = None
        else:
            if key_ends is not None:
                raise ValueError("key_ends (packed prefix trees) cannot be used with a cache")
            if cache.num_layers != cfg.num_layers:
                raise ValueError(f"cache has {cache.num_layers} layers, model has "
                                 f"{cfg.num_layers}")
            idx = jnp.asarray(cache.index, jnp.int32)
            slots = idx[:, None] + t[None, :]                      # [B, L]
            if positions is None:
                positions = slots
            s = jnp.arange(cache.max_len, dtype=jnp.int32)
            mask = s[None, None, :] <= slots[:, :, None]           # [B, L, S]
            if segment_ids is not None:
                mask = mask & (segment_ids != 0)[:, :, None]
        positions = jnp.asarray(positions, jnp.int32)

        seq_len = jnp.max(positions) + 1 if (cfg.rope_scaling is not None and
                                             cfg.rope_scaling["rope_type"] == "dynamic") else None
        rope = rope_frequencies(cfg, seq_len)

        pin = activation_sharding if cache is None else None
        carry_pin = pin if residual_sharding is None or pin is None else residual_sharding
        h = self.embed_tokens(tokens, pin)
        graphdef, stacked = nnx.split(self.layers)

        gather = layer_shardings if cache is None else None

        tile = int(mlp_chunk or 0) if cache is None else 0
        mlp_use = gather["mlp"] if gather is not None and tile else None

        def layer_fn(h, layer_params, kv):
            if gather is not None:
                layer_params = jax.lax.with_sharding_constraint(layer_params, gather)
            if carry_pin is not None:
                h = jax.lax.with_sharding_constraint(h, carry_pin)
            return nnx.merge(graphdef, layer_params)(h, positions, rope, mask, kv, slots, tile,
                                                     pin, mlp_use)

        new_cache = None
        if cache is None:  # one scan over the stacked layers; remat keeps what the policy says
            body = _checkpoint(lambda h, p: (layer_fn(h, p, None)[0], None),
                               remat_policy_name(remat))
            h, _ = jax.lax.scan(body, h, stacked, unroll=layer_unroll)
        else:  # the cache rides in the carry: layer i writes its new keys into it in place
            def body(carry, xs):
                h, ck, cv = carry
                p, i = xs
                h, (ck, cv) = layer_fn(h, p, (ck, cv, i))
                return (h, ck, cv), None

            (h, ck, cv), _ = jax.lax.scan(body, (h, cache.k, cache.v),
                                          (stacked, jnp.arange(cfg.num_layers)),
                                          unroll=layer_unroll)
            n = L if segment_ids is None else jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32)
            new_cache = KVCache(k=ck, v=cv, index=cache.index + n)
        hidden = self.norm(h)  # on the residual's layout, then gathered to the rows' layout
        if carry_pin is not pin:
            hidden = jax.lax.with_sharding_constraint(hidden, pin)

        logits = self.logits_from_hidden(hidden) if compute_logits else None
        return ModelOutput(logits=logits, hidden=hidden, values=self.values_from_hidden(hidden),
                           cache=new_cache)


# ----------------------------------------------------------------------------- helpers


def token_logprobs(logits, tokens, temperature: float = 1.0):
    """Log-probability of each token given the tokens before it, ``[B, L]`` float32.

    ``out[:, t] = log_softmax(logits[:, t-1] / temperature)[tokens[:, t]]`` for t >= 1, i.e.
    ``log p(tokens[:, t] | tokens[:, :t])``, and ``out[:, 0] = 0`` (nothing predicts the
    first token). Computed in float32 as ``z[tok] - logsumexp(z)``.

    Args:
      logits: ``[B, L, V]`` (``ModelOutput.logits``; logits[:, t] predicts tokens[:, t+1]).
      tokens: ``[B, L]`` int ids.
      temperature: the sampling temperature the log-probs should refer to (may be traced).
    """
    z = jnp.asarray(logits, jnp.float32)[:, :-1] / temperature  # exact for temperature 1
    nxt = jnp.asarray(tokens, jnp.int32)[:, 1:]
    picked = jnp.take_along_axis(z, nxt[..., None], axis=-1, mode="clip")[..., 0]
    lp = picked - jax.nn.logsumexp(z, axis=-1)
    return jnp.concatenate([jnp.zeros_like(lp[:, :1]), lp], axis=1)


def values_at(values, positions):
    """Gathers ``values`` [B, L] at ``positions`` [B, M] (int) -> [B, M].

    Positions are clipped into ``[0, L - 1]`` (so e.g. -1 for "no such turn" reads position 0;
    mask such entries yourself).
    """
    positions = jnp.clip(jnp.asarray(positions, jnp.int32), 0, values.shape[1] - 1)
    return jnp.take_along_axis(values, positions, axis=1)


VALUE_ALIGNMENTS = ("before_token", "at_token")


def policy_forward(model: Transformer, batch, *, temperature: float = 1.0,
                   value_alignment: str = "before_token"):
    """Log-probs and values of a ``TrajectoryBatch``'s tokens under ``model``.

    Runs ``model(batch.tokens, positions, segment_ids)`` where ``positions`` /
    ``segment_ids`` come from ``batch.extras`` when present (packed rows) and default to
    ``arange(T)`` / all ones. Trailing padding needs no mask: attention is causal and the
    rows are left-aligned, so padding never changes the real tokens' outputs.

    Returns:
      ``(logprobs, values)``:

      * ``logprobs`` [R, T] float32, aligned to ``batch.tokens``:
        ``logprobs[r, t] = log p(tokens[r, t] | tokens[r, :t])``, 0 at t = 0
        (``token_logprobs``); mask with ``batch.action_mask``.
      * ``values`` [R, T] float32, or None without a value head.

        ``value_alignment="before_token"`` (default): ``values[r, t]`` is the value head read
        at position **t - 1**, i.e. the value of the causal state just *before* token t was
        generated (it has seen ``tokens[r, :t]``); ``values[r, 0] = 0``. The value "before
        action k" of a turn is then ``values[r, t0]`` with ``t0`` the turn's first action token
        (the head read at the last observation token ``t0 - 1``). With packed rows, an action
        token must never be the first token of its segment (it never is: a prompt precedes
        it).

        ``value_alignment="at_token"``: ``values[r, t]`` is the head read at position t
        itself (the state after ``tokens[r, :t + 1]``), the layout
        ``segments.turn_values_from_tokens`` expects (it reads "before_action" at
        ``t0 - 1`` and SAPO's "last_action" Q at the turn's last action token).
        ``before_token[:, t] == at_token[:, t - 1]``.
    """
    if value_alignment not in VALUE_ALIGNMENTS:
        raise ValueError(f"value_alignment must be one of {VALUE_ALIGNMENTS}, "
                         f"got {value_alignment!r}")
    tokens = jnp.asarray(batch.tokens, jnp.int32)
    extras = getattr(batch, "extras", None) or {}
    out = model(tokens, positions=extras.get("positions"), segment_ids=extras.get("segment_ids"))
    logprobs = token_logprobs(out.logits, tokens, temperature)
    values = out.values
    if values is not None and value_alignment == "before_token":
        values = jnp.concatenate([jnp.zeros_like(values[:, :1]), values[:, :-1]], axis=1)
    return logprobs, values
