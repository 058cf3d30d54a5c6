"""``train.logprobs.chunked_sampled_logprobs`` against the train step's dense path: the same
log-probs, outside-truncation flags, entropies and gradients (w.r.t. the hidden states and the
LM head), without the [R, T, V] logits; ``chunked_token_outputs``' other ids and top-n against
the dense log-softmax."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_agent.losses.kl import entropy_from_logits
from jaxrl_agent.train.logprobs import chunked_sampled_logprobs, chunked_token_outputs
from jaxrl_agent.train.step import sampled_logprobs


def dense(hidden, weight, tokens, *, tied, temperature=1.0, top_k=0, top_p=1.0,
          want_entropy=True):
    """The train step's path: full logits (``Transformer.logits_from_hidden``), then
    ``step.sampled_logprobs`` and the entropy one position later."""
    spec = "rtd,vd->rtv" if tied else "rtd,dv->rtv"
    logits = jnp.einsum(spec, hidden.astype(weight.dtype), weight,
                        preferred_element_type=jnp.float32)
    lp, outside, zp = sampled_logprobs(logits, tokens, temperature=temperature, top_k=top_k,
                                       top_p=top_p)
    if not want_entropy:
        return lp, outside, None
    h = entropy_from_logits(zp)
    return lp, outside, jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)


def chunked(hidden, weight, tokens, **kw):
    return chunked_sampled_logprobs(hidden, weight, tokens, **kw)


def value_and_grads(fn, hidden, weight, tokens, a, b, **kw):
    """Jitted ``((lp, outside, ent), (d/dhidden, d/dweight))`` of ``sum(a lp + b ent)``."""
    def loss(h, w):
        lp, outside, ent = fn(h, w, tokens, **kw)
        total = jnp.sum(a * lp) + (0.0 if ent is None else jnp.sum(b * ent))
        return total, (lp, outside, ent)

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(hidden, weight)
    return out, grads


def make_inputs(R, T, D, V, *, tied, seed=0, dtype=jnp.float32):
    """Hidden states, LM head, and tokens that are half the previous position's argmax (kept
    by any truncation) and half uniform (mostly outside a top-k set)."""
    k = jax.random.split(jax.random.key(seed), 6)
    hidden = jax.random.normal(k[0], (R, T, D), jnp.float32)
    weight = jax.random.normal(k[1], (V, D) if tied else (D, V), jnp.float32) / np.sqrt(D) * 3
    logits = jnp.einsum("rtd,vd->rtv" if tied else "rtd,dv->rtv", hidden, weight)
    best = jnp.concatenate([jnp.zeros((R, 1), jnp.int32),
                            jnp.argmax(logits, -1)[:, :-1].astype(jnp.int32)], axis=1)
    uniform = jax.random.randint(k[2], (R, T), 0, V, jnp.int32)
    tokens = jnp.where(jax.random.bernoulli(k[3], 0.5, (R, T)), best, uniform)
    a = jax.random.normal(k[4], (R, T))
    b = jax.random.normal(k[5], (R, T))
    return hidden.astype(dtype), weight.astype(dtype), tokens, a, b


def assert_close(x, y, tol):
    """Elementwise within ``tol`` of the larger of 1 and the reference's max magnitude."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert x.shape == y.shape
    scale = max(1.0, float(np.abs(y).max()))
    np.testing.assert_allclose(x, y, rtol=0, atol=tol * scale)


R, T, D, V = 2, 13, 8, 48  # T - 1 = 12 scored positions

CASES = [  # tied, temperature, top_k, top_p, chunk, want_entropy
    (True, 1.0, 0, 1.0, 4, True),     # chunk divides T - 1
    (False, 1.0, 0, 1.0, 5, True),    # it does not: a padded last chunk
    (True, 0.7, 0, 1.0, 5, True),
    (False, 0.7, 0, 1.0, 64, True),   # chunk > T: one chunk
    (True, 0.0, 5, 0.9, 5, True),     # greedy: untempered, truncation ignored
    (False, 0.7, 5, 1.0, 4, True),    # top-k
    (True, 1.0, 0, 0.8, 5, True),     # top-p
    (False, 0.7, 10, 0.9, 5, True),   # both
    (True, 0.7, 5, 1.0, 3, False),    # no entropy
]


@pytest.mark.parametrize("tied,temperature,top_k,top_p,chunk,want_entropy", CASES)
def test_matches_dense_values_and_grads(tied, temperature, top_k, top_p, chunk, want_entropy):
    hidden, weight, tokens, a, b = make_inputs(R, T, D, V, tied=tied)
    kw = dict(tied=tied, temperature=temperature, top_k=top_k, top_p=top_p,
              want_entropy=want_entropy)
    (lp, out, ent), (gh, gw) = value_and_grads(chunked, hidden, weight, tokens, a, b,
                                               chunk=chunk, **kw)
    (lp0, out0, ent0), (gh0, gw0) = value_and_grads(dense, hidden, weight, tokens, a, b, **kw)
    assert lp.dtype == jnp.float32 and out.dtype == bool and lp.shape == (R, T)
    assert_close(lp, lp0, 1e-5)
    np.testing.assert_array_equal(out, out0)
    if want_entropy:
        assert ent.dtype == jnp.float32
        assert_close(ent, ent0, 1e-5)
    else:
        assert ent is None and ent0 is None
    assert_close(gh, gh0, 1e-5)
    assert_close(gw, gw0, 1e-5)
    assert np.all(np.asarray(lp[:, 0]) == 0) and not np.asarray(out[:, 0]).any()
    if temperature > 0 and (top_k > 0 or top_p < 1.0):  # both branches of the pick exercised
        assert 0 < int(out.sum()) < R * (T - 1)
    else:
        assert not np.asarray(out).any()


@pytest.mark.parametrize("tied,temperature,top_k,chunk,shards", [
    (True, 1.0, 0, 5, 1),    # a padded last chunk
    (False, 0.7, 5, 4, 2),   # truncated sampling (the other ids read before it), 2 shards
    (True, 0.0, 5, 64, 1),   # greedy: untempered; one chunk
])
def test_other_ids_and_top_n_match_the_dense_log_softmax(tied, temperature, top_k, chunk,
                                                         shards):
    """``at_lp[r, t] = log softmax(z[r, t-1])[at[r, t]]`` and the top-n ids / log-probs of the
    tempered, untruncated distribution, shifted one position later (0 at t = 0), with the
    gradient of the ``at`` log-probs equal to the dense path's; the sampled tokens' outputs
    unchanged by asking for them."""
    hidden, weight, tokens, a, _ = make_inputs(R, T, D, V, tied=tied)
    at = jax.random.randint(jax.random.key(7), (R, T, 3), 0, V, jnp.int32)
    kw = dict(tied=tied, temperature=temperature, top_k=top_k)
    spec = "rtd,vd->rtv" if tied else "rtd,dv->rtv"

    def dense_lsm(h, w):
        z = jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)
        z = z / temperature if temperature > 0 else z
        return jax.nn.log_softmax(z, axis=-1)[:, :-1]

    def loss(h, w, f):
        return jnp.sum(a[:, 1:, None] * f(h, w))

    lsm = dense_lsm(hidden, weight)
    out = chunked_token_outputs(hidden, weight, tokens, chunk=chunk, shards=shards, at=at,
                                top_n=4, **kw)
    assert out["at_lp"].shape == (R, T, 3) and out["top_ids"].dtype == jnp.int32
    assert_close(out["at_lp"][:, 1:], jnp.take_along_axis(lsm, at[:, 1:], -1), 1e-5)
    top_lp, top_ids = jax.lax.top_k(lsm, 4)
    assert_close(out["top_lp"][:, 1:], top_lp, 1e-5)
    np.testing.assert_array_equal(out["top_ids"][:, 1:], top_ids)
    for k in ("at_lp", "top_lp", "top_ids"):
        assert not np.asarray(out[k][:, 0]).any()
    base = chunked_sampled_logprobs(hidden, weight, tokens, chunk=chunk, **kw)
    np.testing.assert_array_equal(out["lp"], base[0])
    np.testing.assert_array_equal(out["ent"], base[2])
    g = jax.grad(loss, argnums=(0, 1))(hidden, weight, lambda h, w: chunked_token_outputs(
        h, w, tokens, chunk=chunk, at=at, **kw)["at_lp"][:, 1:])
    g0 = jax.grad(loss, argnums=(0, 1))(hidden, weight, lambda h, w: jnp.take_along_axis(
        dense_lsm(h, w), at[:, 1:], -1))
    for x, y in zip(g, g0):
        assert_close(x, y, 1e-5)


def test_other_ids_and_top_n_degenerate_and_errors():
    hidden, weight, tokens, _, _ = make_inputs(2, 1, 4, 10, tied=True)
    out = chunked_token_outputs(hidden, weight, tokens, tied=True,
                                at=jnp.zeros((2, 1, 3), jnp.int32), top_n=2)
    assert out["at_lp"].shape == (2, 1, 3) and out["top_ids"].shape == (2, 1, 2)
    assert not np.asarray(out["at_lp"]).any() and not np.asarray(out["top_ids"]).any()
    hidden, weight, tokens, _, _ = make_inputs(1, 4, 4, 10, tied=True)
    with pytest.raises(ValueError, match=r"top_n must lie in \[0, V = 10\], got 11"):
        chunked_token_outputs(hidden, weight, tokens, tied=True, top_n=11)
    with pytest.raises(ValueError, match=r"at must be \[R, T, K\]"):
        chunked_token_outputs(hidden, weight, tokens, tied=True, at=tokens)
    out = chunked_token_outputs(hidden, weight, tokens, tied=True, top_n=10)  # K = V
    np.testing.assert_allclose(np.exp(np.asarray(out["top_lp"][:, 1:])).sum(-1), 1.0,
                               rtol=1e-5)


def test_bf16_weights():
    hidden, weight, tokens, a, b = make_inputs(2, 21, 16, 64, tied=False, seed=1,
                                               dtype=jnp.bfloat16)
    kw = dict(tied=False, temperature=0.7, top_k=8, top_p=0.95)
    (lp, out, ent), (gh, gw) = value_and_grads(chunked, hidden, weight, tokens, a, b, chunk=6,
                                               **kw)
    (lp0, out0, ent0), (gh0, gw0) = value_and_grads(dense, hidden, weight, tokens, a, b, **kw)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    assert_close(lp, lp0, 1e-4)
    np.testing.assert_array_equal(out, out0)
    assert_close(ent, ent0, 1e-4)
    # bfloat16 cotangents, and the weight's accumulated over 4 chunks in bfloat16
    assert_close(gh, gh0, 2e-2)
    assert_close(gw, gw0, 2e-2)


def test_vocabulary_150k():
    hidden, weight, tokens, a, b = make_inputs(2, 8, 16, 150_000, tied=True, seed=2)
    kw = dict(tied=True, temperature=0.7, top_k=0, top_p=0.9)
    (lp, out, ent), (gh, gw) = value_and_grads(chunked, hidden, weight, tokens, a, b, chunk=4,
                                               **kw)
    (lp0, out0, ent0), (gh0, gw0) = value_and_grads(dense, hidden, weight, tokens, a, b, **kw)
    assert_close(lp, lp0, 1e-5)
    np.testing.assert_array_equal(out, out0)
    assert_close(ent, ent0, 1e-5)
    assert_close(gh, gh0, 1e-5)
    assert_close(gw, gw0, 1e-5)


@pytest.mark.parametrize("model", [1, 2])
def test_sharded_rows_same_numbers(model):
    """Rows over the mesh's "data" axis (all 8 devices, or 4 with the LM head's vocabulary
    split over a "model" axis of 2): the same numbers as one device, and the rows stay
    sharded."""
    devices = np.array(jax.devices())
    mesh = Mesh(devices.reshape(len(devices) // model, model), ("data", "model"))
    rows = len(devices)
    hidden, weight, tokens, a, b = make_inputs(rows, 11, 8, 40, tied=False, seed=3)
    kw = dict(tied=False, temperature=0.7, top_k=6, top_p=1.0, chunk=4)
    (lp0, out0, ent0), (gh0, gw0) = value_and_grads(chunked, hidden, weight, tokens, a, b, **kw)
    by_row = NamedSharding(mesh, P("data"))
    put = lambda x: jax.device_put(x, by_row)  # noqa: E731
    head = NamedSharding(mesh, P(None, "model") if model > 1 else P())
    (lp, out, ent), (gh, gw) = value_and_grads(
        chunked, put(hidden), jax.device_put(weight, head), put(tokens), put(a), put(b), **kw)
    assert_close(lp, lp0, 1e-6)
    np.testing.assert_array_equal(out, out0)
    assert_close(ent, ent0, 1e-6)
    assert_close(gh, gh0, 1e-6)
    assert_close(gw, gw0, 1e-6)
    # the rows stayed on their devices: per-row outputs and the hidden gradient are row-sharded
    for x in (lp, out, ent, gh):
        assert x.sharding.is_equivalent_to(by_row, x.ndim), x.sharding
    assert gw.sharding.is_equivalent_to(head, 2), gw.sharding


def test_per_shard_weight_copies_same_numbers_and_one_reduction():
    """``shards``: every row block reads its own copy of the head, so the weight gradient is
    summed across devices once after the chunk loop (no all-reduce inside it); the numbers are
    those of ``shards=1``."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    hidden, weight, tokens, a, b = make_inputs(8, 11, 8, 40, tied=True, seed=4)
    kw = dict(tied=True, temperature=1.0, chunk=4)
    (lp0, _, ent0), (gh0, gw0) = value_and_grads(chunked, hidden, weight, tokens, a, b, **kw)
    by_row = NamedSharding(mesh, P("data"))
    put = lambda x: jax.device_put(x, by_row)  # noqa: E731
    copies = NamedSharding(mesh, P("data", None, None))
    args = (put(hidden), jax.device_put(weight, NamedSharding(mesh, P())), put(tokens), put(a),
            put(b))
    (lp, _, ent), (gh, gw) = value_and_grads(chunked, *args, shards=8, shard_sharding=copies,
                                             **kw)
    for x, y in ((lp, lp0), (ent, ent0), (gh, gh0), (gw, gw0)):
        assert_close(x, y, 1e-6)

    def loss(h, w, shards, sh):
        lp, _, ent = chunked_sampled_logprobs(h, w, args[2], shards=shards, shard_sharding=sh,
                                              **kw)
        return jnp.sum(lp) + jnp.sum(ent)

    def reduces_in_loop(shards, sh):  # all-reduces inside while-loop bodies, and in all
        text = jax.jit(jax.grad(loss, argnums=1), static_argnums=(2, 3)).lower(
            args[0], args[1], shards, sh).compile().as_text()
        bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
        comps = re.split(r"\n(?=\S)", text)
        inside = [c for c in comps if "all-reduce(" in c
                  and any(c.startswith((f"%{n} ", f"{n} ")) for n in bodies)]
        return len(inside), text.count("all-reduce(")

    assert reduces_in_loop(1, None) == (1, 1)  # the head's gradient reduced in every chunk
    assert reduces_in_loop(8, copies) == (0, 1)  # once, after the loop
    with pytest.raises(ValueError, match="shards"):
        chunked_sampled_logprobs(hidden, weight, tokens, tied=True, shards=3)


def test_degenerate_shapes():
    hidden, weight, tokens, _, _ = make_inputs(2, 1, 4, 10, tied=True)
    lp, out, ent = chunked_sampled_logprobs(hidden, weight, tokens, tied=True, top_k=3)
    assert lp.shape == out.shape == ent.shape == (2, 1)
    assert not np.asarray(lp).any() and not np.asarray(out).any() and not np.asarray(ent).any()
    # padded positions (zero hidden states) stay finite and out of the results
    hidden, weight, tokens, _, _ = make_inputs(1, 4, 4, 10, tied=True)
    lp, out, ent = chunked_sampled_logprobs(hidden, weight, tokens, tied=True, chunk=2)
    assert lp.shape == (1, 4) and np.isfinite(np.asarray(lp)).all()
    with pytest.raises(ValueError, match="weight"):
        chunked_sampled_logprobs(hidden, weight, tokens, tied=False)
    with pytest.raises(ValueError, match="tokens"):
        chunked_sampled_logprobs(hidden, weight, tokens[:, :3], tied=True)
    with pytest.raises(ValueError, match="chunk"):
        chunked_sampled_logprobs(hidden, weight, tokens, tied=True, chunk=0)


def test_memory_one_chunk_of_logits():
    """The compiled forward + backward's temporaries: the dense path holds [R, T, V] float32
    logits (and their cotangent); the chunked one a few [R, chunk, V] blocks."""
    R_, T_, V_, D_ = 1, 256, 32768, 64
    hidden = jax.ShapeDtypeStruct((R_, T_, D_), jnp.float32)
    weight = jax.ShapeDtypeStruct((V_, D_), jnp.float32)
    tokens = jax.ShapeDtypeStruct((R_, T_), jnp.int32)

    def temp_bytes(fn, **kw):
        def loss(h, w, x):
            lp, _, ent = fn(h, w, x, tied=True, temperature=0.7, **kw)
            return jnp.sum(lp) + jnp.sum(ent)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, weight, tokens).compile()
        stats = compiled.memory_analysis()
        return None if stats is None else stats.temp_size_in_bytes

    dense_bytes = temp_bytes(dense)
    chunk_bytes = temp_bytes(chunked, chunk=32)
    if dense_bytes is None or chunk_bytes is None:
        pytest.skip("memory_analysis() unavailable on this backend")
    assert dense_bytes >= R_ * T_ * V_ * 4  # at least the logits themselves
    assert chunk_bytes < dense_bytes / 4, (chunk_bytes, dense_bytes)
