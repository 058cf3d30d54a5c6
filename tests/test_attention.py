"""blocked_attention (memory-efficient attention with a custom VJP) and splash_attention (the
Pallas TPU kernel, in Pallas's interpreter here) against the dense training attention of the
transformer: outputs, gradients, bfloat16, sharding, and compiled memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agent.models.attention import blocked_attention, splash_attention
from jaxrl_agent.models.transformer import dense_attention


def dense_mask(B, L, segment_ids=None, key_ends=None):
    """The [B, L, L] mask exactly as ``Transformer.__call__`` builds it without a cache."""
    t = jnp.arange(L, dtype=jnp.int32)
    mask = (t[:, None] >= t[None, :])[None]
    if segment_ids is not None or key_ends is None:
        seg = jnp.ones((B, L), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
        mask = mask & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
    if key_ends is not None:
        ends = jnp.asarray(key_ends, jnp.int32)
        mask = mask & (t[None, :, None] < ends[:, None, :])
    return jnp.broadcast_to(mask, (B, L, L))


def _inputs(B, L, H, KV, hd, dtype=jnp.float32, seed=0):
    kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, L, H, hd), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, L, KV, hd), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, L, KV, hd), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (B, L, H * hd), jnp.float32)
    return q, k, v, w


def _packed_segments():
    """Three rows of 40: two packed segments and trailing padding; all padding; padding
    between two segments."""
    seg = np.zeros((3, 40), np.int32)
    seg[0, :10], seg[0, 10:25] = 1, 2
    seg[2, :7], seg[2, 10:] = 3, 5
    return seg


def _tree_key_ends():
    """Two preorder-packed prefix trees per row of 40 (each: root prefix, branch A, branch B):
    keys of branch A are invisible to branch B, and tree 2 sees nothing of tree 1. Row 1 is a
    single tree followed by 7 tokens that each see only themselves."""
    ends = np.zeros((2, 40), np.int32)
    # row 0: tree 1 = root [0, 6), A [6, 14), B [14, 24); tree 2 = root [24, 30), A [30, 35),
    # B [35, 40)
    ends[0, 0:6], ends[0, 6:14], ends[0, 14:24] = 24, 14, 24
    ends[0, 24:30], ends[0, 30:35], ends[0, 35:40] = 40, 35, 40
    # row 1: root [0, 12), A [12, 20), B [20, 33), then 7 trailing tokens with key_ends = j + 1
    # (the tree's keys end at 33, so each trailing query sees only itself)
    ends[1, 0:12], ends[1, 12:20], ends[1, 20:33] = 33, 20, 33
    ends[1, 33:] = np.arange(34, 41)
    return ends


def _with_segments_for_trees():
    seg = np.zeros((2, 40), np.int32)
    seg[0, :24], seg[0, 24:] = 1, 2
    seg[1, :33] = 4                         # trailing 7 tokens: padding
    return seg


CASES = {
    # name: (B, H, KV, segment_ids, key_ends, block_q, block_k)
    "causal_gqa_uneven_blocks": (2, 4, 2, None, None, 16, 8),
    "causal_one_block": (1, 4, 4, None, None, 512, 512),
    "segments_padding": (3, 4, 2, _packed_segments(), None, 16, 16),
    "tree_key_ends": (2, 4, 2, None, _tree_key_ends(), 8, 16),
    "tree_key_ends_and_segments": (2, 2, 1, _with_segments_for_trees(), _tree_key_ends(), 16, 16),
}


def _out_and_grads(attend):
    """jit(q, k, v, w -> (out, d sum(w * out) / d(q, k, v)))."""
    def f(q, k, v, w):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(w.astype(out.dtype))
    return jax.jit(f)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense_outputs_and_gradients(name):
    B, H, KV, seg, ends, bq, bk = CASES[name]
    L, hd = 40, 8
    q, k, v, w = _inputs(B, L, H, KV, hd)
    mask = dense_mask(B, L, seg, ends)
    blocked = _out_and_grads(lambda q, k, v: blocked_attention(
        q, k, v, segment_ids=seg, key_ends=ends, block_q=bq, block_k=bk))
    dense = _out_and_grads(lambda q, k, v: dense_attention(q, k, v, mask))
    out, grads = blocked(q, k, v, w)
    ref_out, ref_grads = dense(q, k, v, w)
    assert out.shape == (B, L, H * hd) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for g, r, n in zip(grads, ref_grads, "qkv"):
        assert g.shape == r.shape and g.dtype == r.dtype, n
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5, err_msg=f"d{n}")
    # queries that see nothing (padding, the all-padding row) give exactly 0, and no NaN
    empty = ~np.asarray(mask).any(axis=-1)
    assert np.all(np.asarray(out)[empty] == 0.0)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    if name == "segments_padding":
        assert empty[1].all()                  # the all-padding row is exercised


def test_bfloat16_close_to_dense():
    B, L, H, KV, hd = 2, 40, 4, 2, 16
    q, k, v, w = _inputs(B, L, H, KV, hd, dtype=jnp.bfloat16, seed=1)
    seg = _packed_segments()[:2]
    mask = dense_mask(B, L, seg)
    out, grads = _out_and_grads(lambda q, k, v: blocked_attention(
        q, k, v, segment_ids=seg, block_q=16, block_k=16))(q, k, v, w)
    ref_out, ref_grads = _out_and_grads(lambda q, k, v: dense_attention(q, k, v, mask))(q, k, v, w)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(ref_out), atol=3e-2, rtol=3e-2)
    for g, r, n in zip(grads, ref_grads, "qkv"):
        np.testing.assert_allclose(f32(g), f32(r), atol=3e-2, rtol=3e-2, err_msg=f"d{n}")


def test_validation_names_the_field():
    q, k, v, _ = _inputs(1, 8, 4, 2, 4)
    with pytest.raises(ValueError, match="segment_ids"):
        blocked_attention(q, k, v, segment_ids=np.ones((1, 7), np.int32))
    with pytest.raises(ValueError, match="key_ends"):
        blocked_attention(q, k, v, key_ends=np.ones((2, 8), np.int32))
    with pytest.raises(ValueError, match="kv heads"):
        blocked_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    with pytest.raises(ValueError, match="block_k"):
        blocked_attention(q, k, v, block_k=0)


def test_compiled_memory_well_under_dense():
    """Training-step memory: jit(grad) of a weighted sum at L = 2048. The dense path holds
    [B, KV, G, L, L] float32 scores / probabilities (64 MiB each here); the blocked path one
    512 x 512 tile at a time (4 MiB)."""
    B, L, H, KV, hd = 1, 2048, 4, 2, 32
    q = jax.ShapeDtypeStruct((B, L, H, hd), jnp.float32)
    k = v = jax.ShapeDtypeStruct((B, L, KV, hd), jnp.float32)
    w = jax.ShapeDtypeStruct((B, L, H * hd), jnp.float32)
    # the dense mask is an argument (not a closure constant, which XLA would constant-fold
    # for seconds); it counts as an argument, not as temporary memory
    mask = jax.ShapeDtypeStruct((B, L, L), jnp.bool_)

    def temp_bytes(attend):
        loss = lambda q, k, v, w, mask: jnp.sum(w * attend(q, k, v, mask))  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, w, mask).compile()
        stats = compiled.memory_analysis()
        return None if stats is None else stats.temp_size_in_bytes

    blocked = temp_bytes(lambda q, k, v, mask: blocked_attention(q, k, v))
    dense = temp_bytes(dense_attention)
    if blocked is None or dense is None:
        pytest.skip("memory_analysis() not available on this backend")
    assert dense > 2 * H * L * L * 4, dense      # sanity: the dense path holds [H, L, L] f32
    assert blocked < dense / 4, (blocked, dense)


# ----------------------------------------------------------------------------- splash (TPU)

SPLASH_CASES = {
    # name: (B, H, KV, segment_ids)
    "causal_gqa": (2, 4, 2, None),
    "segments_padding": (3, 4, 2, _packed_segments()),   # incl. an all-padding row
}


@pytest.mark.parametrize("name", list(SPLASH_CASES))
def test_splash_matches_dense_outputs_and_gradients(name):
    """The TPU kernel (run by Pallas's interpreter on this host) gives the dense path's
    outputs and gradients; rows of 40 are padded to the kernel's 128-token tile inside."""
    B, H, KV, seg = SPLASH_CASES[name]
    L, hd = 40, 8
    q, k, v, w = _inputs(B, L, H, KV, hd, seed=2)
    mask = dense_mask(B, L, seg)
    out, grads = _out_and_grads(lambda q, k, v: splash_attention(q, k, v, segment_ids=seg))(
        q, k, v, w)
    ref_out, ref_grads = _out_and_grads(lambda q, k, v: dense_attention(q, k, v, mask))(q, k, v, w)
    assert out.shape == (B, L, H * hd) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for g, r, n in zip(grads, ref_grads, "qkv"):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4, err_msg=f"d{n}")
    empty = ~np.asarray(mask).any(axis=-1)
    assert np.all(np.asarray(out)[empty] == 0.0)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_splash_under_shard_map_on_eight_devices():
    """On a data 2 x fsdp 2 x tensor 2 mesh the kernel runs per row block and per head shard
    (``jax.shard_map``) and still gives the dense outputs and gradients."""
    if len(jax.devices()) < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    B, H, KV, L, hd = 4, 4, 2, 40, 8
    q, k, v, w = _inputs(B, L, H, KV, hd, seed=3)
    seg = np.concatenate([_packed_segments(), np.ones((1, L), np.int32)])
    out, grads = _out_and_grads(lambda q, k, v: splash_attention(
        q, k, v, segment_ids=seg, mesh=mesh, batch_axes=("data", "fsdp"),
        head_axis="tensor"))(q, k, v, w)
    ref_out, ref_grads = _out_and_grads(
        lambda q, k, v: dense_attention(q, k, v, dense_mask(B, L, seg)))(q, k, v, w)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for g, r, n in zip(grads, ref_grads, "qkv"):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4, err_msg=f"d{n}")
    with pytest.raises(ValueError, match="divide"):
        splash_attention(q[:, :, :3], k[:, :, :1], v[:, :, :1], mesh=mesh, head_axis="tensor")
    with pytest.raises(ValueError, match="block"):
        splash_attention(q, k, v, block=100)
