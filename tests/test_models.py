"""The NNX transformer on its own (no torch): masking/packing, KV cache, dtypes, value head,
log-prob alignment, ``policy_forward`` on a ``TrajectoryBatch``, config validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_agent import segments
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.models import (KVCache, ModelConfig, Transformer, from_hf_tensors,
                                hf_param_map, init_cache, policy_forward, rope_frequencies,
                                segment_positions, spec_array, to_hf_tensors, token_logprobs,
                                values_at)

V = 128
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=32, max_position_embeddings=64)
QWEN3 = ModelConfig(**BASE, family="qwen3", qk_norm=True, value_head=True)


def _model(config=QWEN3, seed=0, scale=0.1):
    """A model with numpy-random weights of std ``scale`` (norm weights 1 + noise): O(1)
    logits and sharp attention, so masking bugs show. Built through ``from_hf_tensors`` (no
    JAX random init to compile: fast on CI)."""
    rng = np.random.RandomState(seed)
    tensors = {}
    for spec in hf_param_map(config):
        x = scale * rng.randn(*spec.hf_shape)
        tensors[spec.hf_name] = (x + 1.0 if "norm" in spec.hf_name else x).astype(np.float32)
    if config.value_head:
        tensors["value_head.kernel"] = rng.randn(config.hidden_size, 1).astype(np.float32) * 0.1
        tensors["value_head.bias"] = np.full((1,), 0.3, np.float32)
    return from_hf_tensors(config, tensors)


# Test programs are compiled with LLVM optimisation off: half the CPU compile time, which
# dominates these tests (numerics are compared with tolerances anyway).
FAST = {"xla_backend_optimization_level": 0}


def jit(fun, **kw):
    return jax.jit(fun, compiler_options=FAST, **kw)


@functools.partial(jit, static_argnums=(0, 6))
def _fwd(graphdef, state, tokens, positions, segment_ids, cache, compute_logits):
    return nnx.merge(graphdef, state)(tokens, positions, segment_ids, cache,
                                      compute_logits=compute_logits)


def fwd(model, tokens, positions=None, segment_ids=None, cache=None, compute_logits=True):
    """The jitted forward (eager dispatch of a new shape costs seconds on 2 CPU cores)."""
    graphdef, state = nnx.split(model)
    return _fwd(graphdef, state, tokens, positions, segment_ids, cache, compute_logits)


@pytest.fixture(scope="module")
def model():
    return _model()


def _tokens(seed, shape):
    return jnp.asarray(np.random.RandomState(seed).randint(0, V, shape), jnp.int32)


# ----------------------------------------------------------------------------- masking
# Shapes are kept to a few: [3, T] with and without segment ids, so only a handful of compiles.

T = 20


def test_packed_segments_equal_unpacked(model):
    lens = [5, 7, 4]
    seqs = [np.asarray(_tokens(10 + i, (n,))) for i, n in enumerate(lens)]
    filler = np.asarray(_tokens(20, (T,)))
    # reference: each sequence alone at the start of its own row (causal attention, so the
    # filler after it cannot change it)
    alone = np.stack([np.concatenate([q, filler[:T - len(q)]]) for q in seqs])
    singles = fwd(model, jnp.asarray(alone))
    # row 0: the three sequences + padding (id 0); row 1: another order, unsorted ids and a
    # trailing fourth sequence; row 2: all padding
    order = [2, 0, 1]
    rest = T - sum(lens)
    row0 = np.concatenate(seqs + [filler[:rest]])
    row1 = np.concatenate([seqs[i] for i in order] + [filler[:rest]])
    seg = np.stack([np.repeat([1, 2, 3, 0], lens + [rest]),
                    np.repeat([7, 5, 9, 4], [lens[i] for i in order] + [rest]),
                    np.zeros(T, int)]).astype(np.int32)
    pos = segment_positions(jnp.asarray(seg))
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0, 1, 2, 3]
    packed = fwd(model, jnp.asarray(np.stack([row0, row1, filler])), None, jnp.asarray(seg))
    for r, ordering in ((0, [0, 1, 2]), (1, order)):
        start = 0
        for i in ordering:
            n = lens[i]
            for field in ("logits", "hidden", "values"):
                got = np.asarray(getattr(packed, field)[r, start:start + n])
                want = np.asarray(getattr(singles, field)[i, :n])
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"{field} {r} {i}")
            start += n
    # padding (segment 0) attends to nothing; everything stays finite, even an all-pad row
    for field in ("logits", "hidden", "values"):
        assert np.all(np.isfinite(np.asarray(getattr(packed, field))))


def test_trailing_padding_does_not_change_real_tokens(model):
    tokens = _tokens(1, (3, T))
    valid = np.arange(T)[None] < np.array([[T], [7], [1]])
    seg = jnp.asarray(valid.astype(np.int32))
    a = fwd(model, tokens, None, seg).logits
    b = fwd(model, jnp.where(seg > 0, tokens, 3), None, seg).logits
    c = fwd(model, tokens).logits
    np.testing.assert_allclose(np.asarray(a)[valid], np.asarray(b)[valid], atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(a)[valid], np.asarray(c)[valid], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- KV cache


def test_prefill_then_decode_equals_full_forward(model):
    """Padded prompts of different lengths prefill in one call; then teacher-forced single-token
    decode steps inside a jitted lax.scan; every step's logits equal the full forward's."""
    graphdef, state = nnx.split(model)
    lens = np.array([6, 3, 9])
    P, N, S = 9, 5, 16
    prompts = _tokens(2, (3, P))
    cont = _tokens(3, (3, N))
    seg = jnp.asarray((np.arange(P)[None] < lens[:, None]).astype(np.int32))

    @jit
    def run(state, prompts, seg, cont):
        m = nnx.merge(graphdef, state)
        cache = m.init_cache(3, S)
        out = m(prompts, segment_ids=seg, cache=cache, compute_logits=False)
        # a sampler needs only the logits at each row's last prompt token
        h_last = jnp.take_along_axis(out.hidden, (jnp.asarray(lens) - 1)[:, None, None], axis=1)
        last = m.logits_from_hidden(h_last)
        out = out.replace(logits=m.logits_from_hidden(out.hidden))  # all, to compare below

        def step(cache, tok):
            o = nnx.merge(graphdef, state)(tok[:, None], cache=cache)
            return o.cache, (o.logits[:, 0], o.values[:, 0])

        cache, (logits, values) = jax.lax.scan(step, out.cache, cont.T)
        return out, last[:, 0], cache, jnp.swapaxes(logits, 0, 1), jnp.swapaxes(values, 0, 1)

    pre, last, cache, step_logits, step_values = run(state, prompts, seg, cont)
    assert isinstance(cache, KVCache) and cache.max_len == S and cache.batch_size == 3
    np.testing.assert_array_equal(np.asarray(pre.cache.index), lens)
    np.testing.assert_array_equal(np.asarray(cache.index), lens + N)
    full_rows = np.zeros((3, T), np.int32)
    for b in range(3):
        full_rows[b, :lens[b] + N] = np.concatenate([prompts[b, :lens[b]], cont[b]])
    full = fwd(model, jnp.asarray(full_rows))
    for b in range(3):
        fl, n = np.asarray(full.logits[b]), lens[b]
        np.testing.assert_allclose(np.asarray(pre.logits[b, :n]), fl[:n], atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(last[b]), fl[n - 1], atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(step_logits[b]), fl[n:n + N], atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(step_values[b]),
                                   np.asarray(full.values[b, n:n + N]), atol=1e-5, rtol=0)

    # a finished row passes segment id 0: it writes a masked slot and does not advance
    out2 = fwd(model, cont[:, :1], None, jnp.asarray([[1], [0], [1]]), cache)
    np.testing.assert_array_equal(np.asarray(out2.cache.index), lens + N + np.array([1, 0, 1]))
    assert np.all(np.isfinite(np.asarray(out2.logits)))
    np.testing.assert_array_equal(np.asarray(cache.index), lens + N)  # input cache untouched


def test_init_cache():
    cache = init_cache(QWEN3, 2, 8)
    assert cache.num_layers == 2 and cache.k.shape == cache.v.shape == (2, 2, 2, 8, 32)
    assert cache.k.dtype == jnp.float32 and cache.index.dtype == jnp.int32
    assert np.all(np.asarray(cache.index) == 0)
    assert init_cache(QWEN3, 1, 4, jnp.bfloat16).v.dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- dtypes


def test_bfloat16_params_run_and_stay_close(model):
    cfg16 = model.config.replace(dtype="bfloat16")
    m16 = from_hf_tensors(cfg16, dict(to_hf_tensors(model), **{
        "value_head.kernel": np.asarray(model.value_head.kernel[...]),
        "value_head.bias": np.asarray(model.value_head.bias[...])}))
    assert m16.layers.mlp.up_proj.kernel[...].dtype == jnp.bfloat16
    assert m16.value_head.kernel[...].dtype == jnp.float32
    tokens = _tokens(6, (3, T))
    cache = m16.init_cache(3, T)
    assert cache.k.dtype == jnp.bfloat16
    o32, o16 = fwd(model, tokens), fwd(m16, tokens, None, None, cache)  # bf16 via the cache path
    assert o16.cache.k.dtype == jnp.bfloat16
    assert o16.logits.dtype == jnp.float32 and o16.values.dtype == jnp.float32
    assert o16.hidden.dtype == jnp.bfloat16
    for f in ("logits", "values"):
        a, b = np.asarray(getattr(o32, f)), np.asarray(getattr(o16, f))
        assert np.all(np.isfinite(b))
        assert np.abs(a - b).max() < 0.1 * max(1.0, np.abs(a).max()), f


# ----------------------------------------------------------------------------- value head


@pytest.mark.parametrize("stop", [False, True])
def test_value_head_gradient_reaches_backbone_unless_stopped(stop):
    cfg = QWEN3.replace(value_stop_gradient=stop)
    m = _model(cfg, seed=1)
    tokens = _tokens(7, (3, T))

    def loss(m):
        return jnp.sum(jnp.square(m(tokens).values - 1.0))

    graphdef, state = nnx.split(m)
    grads = jit(jax.grad(lambda st: loss(nnx.merge(graphdef, st))))(state)
    backbone = [g for path, g in nnx.to_flat_state(grads) if path[0] != "value_head"]
    head = [g for path, g in nnx.to_flat_state(grads) if path[0] == "value_head"]
    assert backbone and head
    bb = max(float(jnp.abs(g[...]).max()) for g in backbone)
    assert float(jnp.abs(head[0][...]).max()) > 0
    if stop:
        assert bb == 0.0
    else:
        assert bb > 0.0


def test_fresh_init(model):
    fresh = Transformer(QWEN3, rngs=nnx.Rngs(0))  # HF-style init: normal(0.02), ones, zeros
    assert fresh.value_head.kernel[...].shape == (64, 1)
    assert float(jnp.std(fresh.layers.mlp.up_proj.kernel[...][0])) == pytest.approx(0.02, rel=0.1)
    assert np.all(np.asarray(fresh.norm.weight[...]) == 1)
    assert np.all(np.isfinite(np.asarray(fwd(fresh, _tokens(8, (3, T))).values)))


# ----------------------------------------------------------------------------- helpers


def test_token_logprobs_alignment():
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.randn(2, 6, 11) * 3, jnp.float32)
    tokens = jnp.asarray(rng.randint(0, 11, (2, 6)), jnp.int32)
    jitted = jit(token_logprobs)
    for temp in (1.0, 0.7):
        got = np.asarray(jitted(logits, tokens, temp))
        z = np.asarray(logits, np.float64) / temp
        ls = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - z.max(-1, keepdims=True)
        want = np.zeros((2, 6), np.float32)
        for b in range(2):
            for t in range(1, 6):
                want[b, t] = ls[b, t - 1, int(tokens[b, t])]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        assert np.all(got[:, 0] == 0)
    # bf16 logits are upcast (float32 log-softmax)
    assert token_logprobs(logits.astype(jnp.bfloat16), tokens).dtype == jnp.float32


def test_values_at():
    v = jnp.arange(12, dtype=jnp.float32).reshape(2, 6)
    got = values_at(v, jnp.asarray([[0, 5, 2], [3, -1, 9]]))
    np.testing.assert_array_equal(np.asarray(got), [[0, 5, 2], [9, 6, 11]])


def test_policy_forward_on_a_trajectory_batch(model):
    rng = np.random.RandomState(3)
    tok = lambda n: rng.randint(2, V, n).tolist()  # noqa: E731
    records = [
        {"group": 0, "outcome": 1.0, "turns": [{"observation": tok(4), "action": tok(3)},
                                               {"observation": tok(2), "action": tok(2)}]},
        {"group": 0, "outcome": 0.0, "turns": [{"observation": tok(5), "action": tok(4)}]},
    ]
    batch, _ = pack_records(records)

    def both(model, batch):
        return (policy_forward(model, batch), model(batch.tokens),
                policy_forward(model, batch, value_alignment="at_token")[1])

    graphdef, state = nnx.split(model)
    (logprobs, values), out, raw = jit(lambda st, b: both(nnx.merge(graphdef, st), b))(state,
                                                                                         batch)
    R, T_ = batch.tokens.shape
    assert logprobs.shape == (R, T_) and values.shape == (R, T_)
    np.testing.assert_allclose(np.asarray(logprobs),
                               np.asarray(token_logprobs(out.logits, batch.tokens)), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(values[:, 1:]), np.asarray(out.values[:, :-1]))
    assert np.all(np.asarray(values[:, 0]) == 0)
    # the value "before" a turn's action = the head read at the token just before it
    am = np.asarray(batch.action_mask)
    rows = np.flatnonzero(am.any(axis=1))
    first = am.argmax(axis=1)                                     # first action token per row
    v_before = np.asarray(values_at(values, jnp.asarray(first)[:, None])[:, 0])
    np.testing.assert_array_equal(v_before[rows], np.asarray(out.values)[rows, first[rows] - 1])
    assert first[0] == 4  # after the 4 observation tokens of record 0's first turn
    # "at_token" is the raw per-position layout that segments.turn_values_from_tokens reads;
    # both layouts give the same per-turn values before each action
    np.testing.assert_array_equal(np.asarray(raw), np.asarray(out.values))
    per_turn = np.asarray(segments.turn_values_from_tokens(raw, batch, "before_action"))
    turn_ids, rows_of = np.asarray(batch.turn_ids), np.asarray(batch.row_traj)
    for r in rows:
        for k in np.unique(turn_ids[r][turn_ids[r] >= 0]):
            t0 = np.flatnonzero(turn_ids[r] == k)[0]
            assert per_turn[rows_of[r], k] == np.asarray(values)[r, t0]
    with pytest.raises(ValueError, match="value_alignment"):
        policy_forward(model, batch, value_alignment="after")
    # no value head -> values None, same log-probs
    m2 = from_hf_tensors(model.config.replace(value_head=False), to_hf_tensors(model))
    assert m2.value_head is None
    (lp2, v2), out2, _ = nnx.eval_shape(both, m2, batch)  # traced only: no compile needed
    assert v2 is None and out2.values is None and out2.cache is None
    assert lp2.shape == (R, T_) and out2.logits.shape == (R, T_, V)


# ----------------------------------------------------------------------------- config


def test_config_validation_and_hf_map():
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(**BASE, dtype="float16")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(**{**BASE, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="family"):
        ModelConfig(**BASE, family="gpt2")
    with pytest.raises(ValueError, match="needs the key 'factor'"):
        ModelConfig(**BASE, rope_scaling={"rope_type": "linear"})
    with pytest.raises(ValueError, match="Qwen2"):
        ModelConfig(**BASE, family="qwen2").to_hf()
    with pytest.raises(ValueError, match="qk_norm"):
        ModelConfig(**BASE, family="llama", qk_norm=True).to_hf()
    cfg = ModelConfig(**{**BASE, "head_dim": None})
    assert cfg.head_dim == 16
    hash(QWEN3.replace(rope_scaling={"rope_type": "yarn", "factor": 2.0}))  # static under jit
    # every NNX parameter of the backbone appears exactly once in the HF map
    m = Transformer(QWEN3, rngs=nnx.Rngs(0))
    paths = {p for p, _ in nnx.to_flat_state(nnx.state(m, nnx.Param)) if p[0] != "value_head"}
    specs = hf_param_map(QWEN3)
    assert {s.path for s in specs} == paths
    assert len(specs) == len({(s.path, s.layer) for s in specs})
    for s in specs:
        v = m
        for k in s.path:
            v = getattr(v, k)
        assert spec_array(s, v[...]).shape == s.shape, s.hf_name
        # decoder-layer tensors: one spec per layer of the stacked [num_layers, ...] array
        assert (s.layer is None) == (s.path[0] != "layers")
        if s.layer is not None:
            assert v[...].shape == (QWEN3.num_layers,) + s.shape


def test_rope_frequencies():
    plain, s = rope_frequencies(QWEN3)
    assert s == 1.0 and plain.shape == (16,)
    dyn = QWEN3.replace(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    np.testing.assert_allclose(np.asarray(rope_frequencies(dyn, 10)[0]), np.asarray(plain),
                               rtol=1e-6)
    assert float(rope_frequencies(dyn, 200)[0][-1]) < float(plain[-1])  # stretched beyond max
    lin = QWEN3.replace(rope_scaling={"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(np.asarray(rope_frequencies(lin)[0]), np.asarray(plain) / 4,
                               rtol=1e-6)
    yarn = QWEN3.replace(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert rope_frequencies(yarn)[1] == pytest.approx(0.1 * np.log(4.0) + 1)


# ---------------------------------------------------------------- scan, remat, attention


@functools.partial(jit, static_argnums=(0, 6, 7, 8))
def _loss_and_grad(graphdef, state, tokens, positions, segment_ids, key_ends, remat, attention,
                   mlp_chunk=0):
    def loss(st):
        out = nnx.merge(graphdef, st)(tokens, positions, segment_ids, key_ends=key_ends,
                                      remat=remat, attention=attention, mlp_chunk=mlp_chunk)
        return jnp.sum(out.logits * jnp.cos(out.logits)) + jnp.sum(out.values), out

    return jax.grad(loss, has_aux=True)(state)


@pytest.mark.parametrize("masking", ["segments", "tree"])
def test_blocked_attention_and_remat_policies_change_nothing(model, masking):
    """The model with flash-style blocked attention (or the splash kernel), the MLP in tiles
    of positions and every remat policy gives the dense, remat-free outputs and parameter
    gradients (packed segments with padding; a preorder prefix tree through key_ends)."""
    tokens = _tokens(30, (2, T))
    if masking == "segments":
        seg = jnp.asarray(np.stack([np.repeat([1, 2, 0], [7, 9, 4]), np.repeat([3, 3, 0],
                                                                         [10, 6, 4])]),
                          jnp.int32)
        pos, ends = segment_positions(seg), None
    else:  # root 0..5, branch A 6..12 (ends at 13), branch B 13..19: B never sees A
        seg = None
        depth = np.r_[np.arange(6), 6 + np.arange(7), 6 + np.arange(7)]
        end = np.r_[np.full(6, T), np.full(7, 13), np.full(7, T)]
        pos, ends = (jnp.asarray(np.stack([depth] * 2), jnp.int32),
                     jnp.asarray(np.stack([end] * 2), jnp.int32))
    graphdef, state = nnx.split(model)
    want_g, want = _loss_and_grad(graphdef, state, tokens, pos, seg, ends, "none", "dense")
    # (remat, attention, MLP tile: 7 does not divide the 20 positions, the last tile is padded)
    variants = (("none", "blocked", 0), ("full", "blocked", 7), ("save_dots", "dense", 0))
    if masking == "segments":  # the Pallas TPU kernel, emulated on this host
        variants += (("full", "splash", 0),)
    else:
        with pytest.raises(ValueError, match="prefix trees"):
            _loss_and_grad(graphdef, state, tokens, pos, seg, ends, "none", "splash")
    for remat, attention, tile in variants:
        got_g, got = _loss_and_grad(graphdef, state, tokens, pos, seg, ends, remat, attention,
                                    tile)
        for field in ("logits", "hidden", "values"):
            np.testing.assert_allclose(np.asarray(getattr(got, field)),
                                       np.asarray(getattr(want, field)), atol=2e-5, rtol=0,
                                       err_msg=f"{remat} {attention} {field}")
        for (path, a), (_, b) in zip(nnx.to_flat_state(got_g), nnx.to_flat_state(want_g)):
            np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]),
                                       atol=1e-4 if attention == "splash" else 2e-5,
                                       rtol=1e-4, err_msg=f"{remat} {attention} {path}")
    if masking == "tree":  # branch B's outputs are those of the root + B alone
        alone = fwd(model, jnp.concatenate([tokens[:, :6], tokens[:, 13:]], axis=1))
        np.testing.assert_allclose(np.asarray(want.logits[:, 13:]),
                                   np.asarray(alone.logits[:, 6:]), atol=2e-5, rtol=0)


def test_mlp_tiles_reduce_the_weight_gradient_once_across_row_shards():
    """``tiled_over_tokens`` with the rows' sharding and the weights' layout: each row shard
    reads its own copy of the MLP's weights, so the weight gradient is summed across the batch
    axes once after the tiles (XLA on CPU sums it in every tile without the copies: the bytes
    executed, loop trip counts applied, by the axes they span); the tensor axis' reductions
    are unchanged and the numbers are the untiled MLP's. On a data 2 x fsdp 2 x tensor 2 mesh
    of host devices, the weights split over tensor."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxrl_agent.models.transformer import MLP, tiled_over_tokens
    from jaxrl_agent.train.plan import executed_collectives
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    mlp = MLP(QWEN3, rngs=nnx.Rngs(3))
    graphdef, weights = nnx.split(mlp)
    x = jax.random.normal(jax.random.key(0), (8, 20, QWEN3.hidden_size))
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    xs = jax.device_put(x, rows)

    # the layout the weights are used in: the MLP's columns (rows of down_proj) over tensor
    use = jax.tree.map(lambda w: NamedSharding(mesh, P(None, "tensor") if w.shape[0] ==
                                               QWEN3.hidden_size else P("tensor", None)),
                       weights)
    weights = jax.device_put(weights, use)

    def loss(w, x, chunk, sharding):
        y = tiled_over_tokens(nnx.merge(graphdef, w), x, chunk, sharding,
                              use if sharding else None) if chunk else nnx.merge(graphdef, w)(x)
        return jnp.sum(y * jnp.cos(y))

    grad = jax.jit(jax.grad(loss), static_argnums=(2, 3))
    want = grad(weights, x, 0, None)
    for sharding in (None, rows):
        got = grad(weights, xs, 7, sharding)  # 7 does not divide the 20 positions
        for (path, a), (_, b) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
            np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), atol=2e-5,
                                       rtol=1e-5, err_msg=str(path))

    def reduced(sharding):  # all-reduce bytes executed per step, by the mesh axes spanned
        text = grad.lower(weights, xs, 7, sharding).compile().as_text()
        return executed_collectives(text, dict(mesh.shape), "all-reduce")

    mlp_bytes = sum(w.size * w.dtype.itemsize for w in jax.tree.leaves(weights)) / 2  # per device
    before, after = reduced(None), reduced(rows)
    over_batch = lambda r: r.get("data+fsdp", 0)  # noqa: E731 - the weight gradient's sum
    # per tile (3 tiles of 7 positions): the tensor-split weight gradient reduced 3 times
    assert over_batch(before) >= 3 * mlp_bytes, before
    assert over_batch(after) == mlp_bytes, after   # once, after the tiles
    # the tensor axis' reductions (the down projection's partial sums) are the same
    assert after.get("tensor", 0) == before.get("tensor", 0)


def test_layers_are_one_scan_and_mistakes_are_named(model):
    """The compiled forward holds one decoder layer's code whatever the depth (a while loop
    over the stacked layers), and a bad remat / attention name is a ValueError naming it."""
    def program(layers):
        m = Transformer(QWEN3.replace(num_layers=layers), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(m)
        return jax.jit(lambda st, t: nnx.merge(graphdef, st)(t).logits).lower(
            state, _tokens(1, (1, 8))).as_text()

    two, six = program(2), program(6)
    assert six.count("stablehlo.while") == 1
    assert six.count("stablehlo.dot_general") == two.count("stablehlo.dot_general")
    with pytest.raises(ValueError, match="remat"):
        model(_tokens(1, (1, 8)), remat="sometimes")
    with pytest.raises(ValueError, match="attention"):
        model(_tokens(1, (1, 8)), attention="sparse")


@pytest.mark.parametrize("remat", ["none", "full"])
def test_blocked_attention_keeps_the_model_gradient_linear_in_length(remat):
    """Differentiated through the layer scan, blocked attention keeps no [L, L] (or per-tile
    [n_q, n_k, ...]) residuals: the model gradient's temporaries at L = 2048 are a fraction of
    the dense path's (the dense scores alone are B x heads x L^2 x 4 bytes = 64 MiB here)."""
    cfg = QWEN3.replace(num_layers=1, value_head=False)
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((1, 2048), jnp.int32)

    def temp(attention):
        def loss(st):
            out = nnx.merge(graphdef, st)(tokens, attention=attention, remat=remat,
                                          compute_logits=False)
            return jnp.sum(out.hidden)
        mem = jax.jit(jax.grad(loss)).lower(state).compile().memory_analysis()
        if mem is None:
            pytest.skip("no memory analysis on this backend")
        return mem.temp_size_in_bytes

    dense, blocked = temp("dense"), temp("blocked")
    assert dense >= 4 * 2048 ** 2 * 4
    assert blocked < dense / 4, (blocked, dense)
