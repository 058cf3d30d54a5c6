"""JaxSampler: log-prob semantics (teacher-forced), greedy = step-by-step argmax, stop tokens,
per-request seeds, top-k/top-p, weight sync without recompilation, bounded compilation and
host-side validation.

Every sampling test shares one sampler whose buckets hold all requests in one shape
(batch 8, prompt length 16, 16 new tokens, <= 4 stop ids), so the file compiles the prefill
and the decode loop once each, plus one full-forward reference.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl_agent.models import ModelConfig, Transformer
from jaxrl_agent.sampling import JaxSampler, SamplingParams
from jaxrl_agent.sampling.jax_sampler import common_prefix
from tests.samplers import assert_sampler_protocol

V = 128
REF_LEN = 32      # the reference forward pass runs on rows padded to this length
LM_SCALE = 20.0   # sharpens the tiny model's near-uniform init (logit std ~3)

CONFIG = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=REF_LEN)


@pytest.fixture(scope="module")
def model():
    m = Transformer(CONFIG, rngs=nnx.Rngs(0))
    m.lm_head.kernel[...] = m.lm_head.kernel[...] * LM_SCALE
    return m


@pytest.fixture(scope="module")
def sampler(model):
    return JaxSampler(model, batch_buckets=(8,), len_buckets=(16,), new_token_buckets=(16,),
                      seed=0)


@pytest.fixture(scope="module")
def ref_logits(model):
    """Full forward pass without a cache: ``f(tokens [B, REF_LEN]) -> logits [B, REF_LEN, V]``
    (rows right-padded; causal attention makes the padding irrelevant)."""
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens).logits)

    def run(rows):
        rows = [list(r) for r in rows]
        assert all(len(r) <= REF_LEN for r in rows)
        toks = np.zeros((8 * -(-len(rows) // 8), REF_LEN), np.int32)
        for i, r in enumerate(rows):
            toks[i, :len(r)] = r
        return np.asarray(fwd(state, toks), np.float64)[:len(rows)]

    return run


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, n).tolist() for n in lengths]


def reference_logprobs(logits, tok, temperature, top_k, top_p):
    """Straight from the definition, in float64: log q(tok) with q = softmax(logits / T) over
    the top-k set (ties kept) intersected with the top-p nucleus of the top-k distribution;
    greedy (T=0): log_softmax(logits)[tok]."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        z = logits
        return z[tok] - np.log(np.sum(np.exp(z - z.max()))) - z.max()
    z = logits / temperature
    keep = np.ones(V, bool)
    if top_k > 0:
        kth = np.sort(z)[::-1][min(top_k, V) - 1]
        keep &= z >= kth
    if top_p < 1:
        q = np.where(keep, np.exp(z - z.max()), 0.0)
        q /= q.sum()
        more_likely_mass = np.array([q[q > q[v]].sum() for v in range(V)])
        keep &= more_likely_mass < top_p
    assert keep[tok], "sampled a token outside the kept set"
    zk = z[keep]
    return z[tok] - (np.log(np.sum(np.exp(zk - zk.max()))) + zk.max())


def greedy_reference(ref_logits, prompts, n_new):
    """Step-by-step argmax of full forward passes (no cache), all rows in one batch."""
    seqs = [list(p) for p in prompts]
    for _ in range(n_new):
        logits = ref_logits(seqs)
        for s, lg in zip(seqs, logits):
            s.append(int(np.argmax(lg[len(s) - 1])))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


# ----------------------------------------------------------------------------- semantics


def test_protocol_and_output_types(sampler):
    assert_sampler_protocol(sampler, V, sampler.policy_version)


def test_teacher_forced_logprobs(sampler, ref_logits):
    """For T > 0 (with and without top-k / top-p) and for greedy rows, the reported log-probs
    equal the same processing applied to a teacher-forced forward pass."""
    settings = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.3, top_k=5),
                dict(temperature=1.0, top_p=0.8), dict(temperature=0.9, top_k=10, top_p=0.7),
                dict(temperature=2.0, top_k=3), dict(temperature=0.0),
                dict(temperature=0.0, top_k=2, top_p=0.5)]
    prompts = prompts_of([3, 16, 7, 1, 12, 5, 9, 2], seed=1)
    params = [SamplingParams(max_new_tokens=12, seed=100 + i, **s) for i, s in enumerate(settings)]
    outs = sampler.generate(prompts, params)
    logits = ref_logits([o.prompt_token_ids + o.token_ids for o in outs])
    for o, p, lg in zip(outs, params, logits):
        assert len(o.token_ids) == 12
        n = len(o.prompt_token_ids)
        want = [reference_logprobs(lg[n - 1 + j], t, p.temperature, p.top_k, p.top_p)
                for j, t in enumerate(o.token_ids)]
        np.testing.assert_allclose(o.logprobs, want, atol=1e-5, rtol=0, err_msg=str(p))
        assert all(x <= 1e-6 for x in o.logprobs)


def test_greedy_equals_stepwise_argmax(sampler, ref_logits):
    prompts = prompts_of([1, 4, 16, 9, 2], seed=2)
    outs = sampler.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
    want = greedy_reference(ref_logits, prompts, 10)
    assert [o.token_ids for o in outs] == want


def test_stop_tokens_and_max_new_tokens(sampler, ref_logits):
    prompts = prompts_of([5, 11, 3], seed=3)
    greedy = greedy_reference(ref_logits, prompts, 12)
    # stop at the first occurrence of the 4th greedy token (and a never-hit extra stop id)
    stops = [g[3] for g in greedy]
    params = [SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(s, V - 1))
              if s != V - 1 else SamplingParams(temperature=0.0, max_new_tokens=12,
                                                 stop_token_ids=(s,))
              for s in stops]
    outs = sampler.generate(prompts, params)
    for o, g, s in zip(outs, greedy, stops):
        cut = g.index(s) + 1
        assert o.token_ids == g[:cut] and o.finish_reason == "stop"
        assert len(o.logprobs) == cut
    # per-request max_new_tokens in one batch ("length"); a stop token hit exactly at the
    # last allowed step reports "stop"
    lens = [1, 5, 12]
    outs = sampler.generate(prompts, [SamplingParams(temperature=0.0, max_new_tokens=m)
                                      for m in lens])
    for o, g, m in zip(outs, greedy, lens):
        assert o.token_ids == g[:m] and o.finish_reason == "length"
    o = sampler.generate([prompts[0]], SamplingParams(
        temperature=0.0, max_new_tokens=greedy[0].index(stops[0]) + 1,
        stop_token_ids=(stops[0],)))[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == stops[0]
    # sampled rows stop too: every row stops at the first stop id it samples
    params = SamplingParams(temperature=1.5, max_new_tokens=16, stop_token_ids=(1, 2, 3, 4))
    for o in sampler.generate(prompts_of([4] * 8, seed=4), params):
        hits = [j for j, t in enumerate(o.token_ids) if t in (1, 2, 3, 4)]
        if hits:
            assert hits == [len(o.token_ids) - 1] and o.finish_reason == "stop"
        else:
            assert len(o.token_ids) == 16 and o.finish_reason == "length"


def test_per_request_seeds(sampler):
    prompt = prompts_of([6], seed=5)[0]
    p = SamplingParams(temperature=1.0, max_new_tokens=16, seed=1234)
    alone = sampler.generate([prompt], p)[0]
    others = prompts_of([3, 9, 14, 1, 7], seed=6)
    batched = sampler.generate(others[:3] + [prompt] + others[3:],
                               [SamplingParams(temperature=0.8, top_k=7, seed=9)] * 3 + [p]
                               + [SamplingParams(temperature=1.0)] * 2)[3]
    assert alone.token_ids == batched.token_ids
    np.testing.assert_array_equal(alone.logprobs, batched.logprobs)
    assert sampler.generate([prompt], p)[0].token_ids == alone.token_ids       # repeatable
    big = sampler.generate([prompt], dataclasses.replace(p, seed=2 ** 63 + 7))[0]
    different = [sampler.generate([prompt], dataclasses.replace(p, seed=s))[0].token_ids
                 for s in (1, 2, 3)]
    for d in different + [big.token_ids]:
        assert d != alone.token_ids
    # without a seed: different requests and different calls draw different streams
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=16)
    a = sampler.generate([prompt, prompt], unseeded)
    b = sampler.generate([prompt], unseeded)[0]
    assert a[0].token_ids != a[1].token_ids and b.token_ids not in (a[0].token_ids,
                                                                     a[1].token_ids)


def test_top_k_one_and_tiny_top_p_are_greedy(sampler, ref_logits):
    prompts = prompts_of([2, 8, 15, 4], seed=7)
    greedy = [o.token_ids for o in
              sampler.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))]
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.3)):
        outs = sampler.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10,
                                                        **kw))
        assert [o.token_ids for o in outs] == greedy, kw
        np.testing.assert_allclose([x for o in outs for x in o.logprobs], 0.0, atol=1e-6)


def test_sampled_tokens_lie_in_top_k(sampler, ref_logits):
    prompts = prompts_of([3, 10, 6, 13, 1, 8, 5, 16], seed=8)
    for k in (2, 5):
        outs = sampler.generate(prompts, [SamplingParams(temperature=2.0, top_k=k,
                                                         max_new_tokens=16)] * 8)
        logits = ref_logits([o.prompt_token_ids + o.token_ids for o in outs])
        seen = set()
        for o, lg in zip(outs, logits):
            n = len(o.prompt_token_ids)
            for j, t in enumerate(o.token_ids):
                row = lg[n - 1 + j]
                assert np.sum(row > row[t]) < k
                seen.add(int(np.sum(row > row[t])))
        assert seen == set(range(k))   # at T=2 every rank below k gets sampled somewhere


def test_sync_weights_changes_outputs_without_recompiling(sampler, model):
    prompts = prompts_of([4, 9, 13], seed=9)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = sampler.generate(prompts, greedy)
    counts = dict(sampler.compile_counts)
    original = nnx.to_pure_dict(nnx.state(model))
    rng = np.random.default_rng(0)
    perturbed = jax.tree.map(lambda x: np.asarray(x) + rng.normal(0, 0.3, x.shape)
                             .astype(np.float32), original)
    try:
        sampler.sync_weights(perturbed, 7)
        assert sampler.policy_version == 7
        after = sampler.generate(prompts, greedy)
        assert all(o.policy_version == 7 for o in after)
        assert [o.token_ids for o in after] != [o.token_ids for o in before]
        # an nnx.State and a Transformer work too, and in-place edits of the source model do
        # not leak into the sampler until the next sync
        sampler.sync_weights(nnx.state(model), 8)
        assert [o.token_ids for o in sampler.generate(prompts, greedy)] == \
            [o.token_ids for o in before]
        saved = model.norm.weight[...]
        model.norm.weight[...] = saved * 0.0 + 3.0
        try:
            assert [o.token_ids for o in sampler.generate(prompts, greedy)] == \
                [o.token_ids for o in before]
        finally:
            model.norm.weight[...] = saved
        with pytest.raises(ValueError, match="norm.weight"):
            bad = dict(original, norm={"weight": np.zeros(3, np.float32)})
            sampler.sync_weights(bad, 9)
        with pytest.raises(ValueError, match="missing"):
            sampler.sync_weights({k: v for k, v in original.items() if k != "norm"}, 9)
        assert sampler.policy_version == 8
        assert dict(sampler.compile_counts) == counts
        assert sampler._prefill_jit._cache_size() == counts["prefill"]
        assert sampler._decode_jit._cache_size() == counts["decode"]
    finally:
        sampler.sync_weights(model, 0)
    assert [o.token_ids for o in sampler.generate(prompts, greedy)] == \
        [o.token_ids for o in before]


def test_released_weights_refuse_sampling_until_the_next_sync(sampler, model):
    """The trainer frees the sampler's weights for the train step: generate refuses until the
    next sync; the synced weights are the sampler's own buffers even from a source replicated
    over several devices (device_put would reuse the source's shard on a one-device target),
    so freeing them never deletes the trainer's arrays."""
    from jaxrl_agent import sharding

    prompts, greedy = prompts_of([5], seed=2), SamplingParams(temperature=0.0, max_new_tokens=4)
    before = sampler.generate(prompts, greedy)
    replicated = jax.device_put(nnx.state(model, nnx.Param),
                                sharding.replicated(sharding.make_mesh(data=8)))
    try:
        sampler.sync_weights(replicated, 3)
        sampler.release_weights()
        assert sampler.weights_released
        with pytest.raises(RuntimeError, match="sync_weights before generate"):
            sampler.generate(prompts, greedy)
        assert not any(x.is_deleted() for x in jax.tree.leaves(replicated))
        sampler.sync_weights(replicated, 4)
        assert not sampler.weights_released
        assert [o.token_ids for o in sampler.generate(prompts, greedy)] == \
            [o.token_ids for o in before]
    finally:
        sampler.sync_weights(model, 0)


def test_bounded_compilation(sampler):
    sampler.generate([[1]], SamplingParams(max_new_tokens=2))            # warm
    counts = dict(sampler.compile_counts)  # (a shared-prefill fork of an earlier test too)
    assert counts["prefill"] == 1 and counts["decode"] == 1
    rng = np.random.default_rng(10)
    for n in (1, 3, 8, 5, 11, 2):          # 11 > the largest batch bucket: two chunks of 8
        lengths = rng.integers(1, 17, n)
        params = [SamplingParams(temperature=float(rng.choice([0.0, 0.5, 1.0])),
                                 top_k=int(rng.integers(0, 5)), top_p=float(rng.uniform(0.3, 1)),
                                 max_new_tokens=int(rng.integers(1, 17)),
                                 stop_token_ids=tuple(rng.integers(0, V, rng.integers(0, 5))))
                  for _ in range(n)]
        outs = sampler.generate(prompts_of(lengths, seed=n), params)
        assert len(outs) == n
        for o, p in zip(outs, params):
            assert 1 <= len(o.token_ids) <= p.max_new_tokens
    assert dict(sampler.compile_counts) == counts
    assert sampler._decode_jit._cache_size() == 1 and sampler._prefill_jit._cache_size() == 1


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), r"request 1: prompt is empty"),
    ([1, V], SamplingParams(), r"request 1: prompt token id 128 at position 1"),
    ([-1], SamplingParams(), r"request 1: prompt token id -1"),
    ([1.5], SamplingParams(), r"request 1: prompt token ids must be ints"),
    ("abc", SamplingParams(), r"request 1: prompt must be a sequence of token ids"),
    ([1], SamplingParams(max_new_tokens=0), r"request 1: SamplingParams.max_new_tokens"),
    ([1] * 20, SamplingParams(max_new_tokens=13), r"request 1: prompt length 20 \+ "
                                                  r"SamplingParams.max_new_tokens 13"),
    ([1], SamplingParams(temperature=-0.1), r"request 1: SamplingParams.temperature"),
    ([1], SamplingParams(top_p=0.0), r"request 1: SamplingParams.top_p"),
    ([1], SamplingParams(top_p=1.5), r"request 1: SamplingParams.top_p"),
    ([1], SamplingParams(top_k=-1), r"request 1: SamplingParams.top_k"),
    ([1], SamplingParams(stop_token_ids=(V,)), r"request 1: SamplingParams.stop_token_ids"),
    ([1], SamplingParams(seed=-3), r"request 1: SamplingParams.seed"),
])
def test_validation_errors(sampler, prompt, params, match):
    counts = dict(sampler.compile_counts)
    with pytest.raises(ValueError, match=match):
        sampler.generate([[1, 2], prompt], [SamplingParams(), params])
    assert dict(sampler.compile_counts) == counts      # nothing ran


def test_validation_of_the_call(sampler, model):
    with pytest.raises(ValueError, match="params has 1 entries for 2 prompts"):
        sampler.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(ValueError, match="version must be an int"):
        sampler.sync_weights(sampler.state, 1.5)
    with pytest.raises(ValueError, match="max_len"):
        JaxSampler(model, max_len=1)
    # the longest valid request: prompt + max_new_tokens == max_len
    o = sampler.generate([[1] * 16], SamplingParams(temperature=0.0,
                                                    max_new_tokens=REF_LEN - 16))[0]
    assert len(o.token_ids) == REF_LEN - 16


def test_chunked_prefill_equals_one_pass(sampler, model):
    """Prompts written to the cache 5 tokens at a time (16-token bucket: 4 chunks, the last one
    partly padding; rows ending inside, at the edge of and before a chunk) give the one-pass
    prefill's tokens and log-probs."""
    chunked = JaxSampler(model, batch_buckets=(8,), len_buckets=(16,), new_token_buckets=(16,),
                         seed=0, prefill_chunk=5)
    prompts = prompts_of([1, 4, 5, 6, 10, 11, 15, 16], seed=4)
    params = [SamplingParams(temperature=t, max_new_tokens=16, seed=i)
              for i, t in enumerate([0.0, 1.0] * 4)]
    want, got = sampler.generate(prompts, params), chunked.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    np.testing.assert_allclose(np.concatenate([o.logprobs for o in got]),
                               np.concatenate([o.logprobs for o in want]), atol=1e-5)
    with pytest.raises(ValueError, match="prefill_chunk"):
        JaxSampler(model, prefill_chunk=0)


def on_data4_tensor2(model, on_mesh, **kw):
    """``kw``, plus a data 4 x tensor 2 sampler mesh and the default partition rules' weight
    layout when ``on_mesh`` (skips without 8 host devices)."""
    if on_mesh:
        from jaxrl_agent import sharding
        if len(jax.devices()) < 8:
            pytest.skip("needs 8 host devices (XLA_FLAGS)")
        mesh = sharding.sampler_mesh(4, 2)
        kw.update(mesh=mesh, param_shardings=sharding.param_shardings(
            nnx.state(model), mesh, sharding.DEFAULT_RULES))
    return kw


@pytest.mark.parametrize("on_mesh", [False, True])
def test_shared_prefill_gives_the_unshared_samples(model, on_mesh):
    """Prompts repeated within a call (a group's samples; recurring states) are prefilled once
    and forked: the same token ids, log-probs and finish reasons as prefilling every row, row
    for row (per-row seeds: repeats sample differently), with the rows and tokens prefilled
    counted; on a data 4 x tensor 2 mesh as on one device."""
    kw = on_data4_tensor2(model, on_mesh, batch_buckets=(8,), len_buckets=(16,),
                          new_token_buckets=(16,), seed=0)
    a, b, c = prompts_of([3, 7, 12], seed=6)
    prompts = [a, b, a, a, c, b, a, b]
    params = [SamplingParams(temperature=t, top_k=k, max_new_tokens=16, seed=i, stop_token_ids=(5,))
              for i, (t, k) in enumerate([(1.0, 0), (0.7, 5), (0.0, 0), (1.0, 3)] * 2)]
    plain = JaxSampler(model, share_prefill=False, **kw)
    shared = JaxSampler(model, **kw)
    want, got = plain.generate(prompts, params), shared.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    np.testing.assert_array_equal(np.concatenate([o.logprobs for o in got]),
                                  np.concatenate([o.logprobs for o in want]))
    assert len({tuple(o.token_ids) for o, p in zip(got, prompts) if p == a}) > 1  # seeds differ
    assert dict(shared.prefill_stats) == {"rows_asked": 8, "rows_prefilled": 3,
                                          "tokens_asked": 4 * 3 + 3 * 7 + 12,
                                          "tokens_prefilled": 3 + 7 + 12,
                                          "slots_prefilled": 8 * 16}
    assert plain.prefill_stats["rows_prefilled"] == 8 and "fork" not in plain.compile_counts
    assert shared.compile_counts["fork"] == 1
    shared.generate(prompts[:3], params[:3])  # a, b, a: two prefilled
    assert shared.prefill_stats["rows_prefilled"] == 3 + 2


# ----------------------------------------------------------------------------- kept caches


def test_common_prefix():
    held = np.array([[1, 2, 3, -1], [1, 2, 4, 5], [7, -1, -1, -1], [1, 2, 3, 4]], np.int32)
    np.testing.assert_array_equal(common_prefix(held, np.array([1, 2, 3, 4, 5])), [3, 2, 0, 4])
    np.testing.assert_array_equal(common_prefix(held, np.array([1, 2])), [2, 2, 0, 2])
    assert common_prefix(held[:0], np.array([1])).shape == (0,)


def conversation_turns(sampler, convs, turns, rng, obs_len=2, start_seed=0):
    """``turns`` calls of a multi-turn script: each conversation's next prompt is its prompt,
    the sampled tokens and ``obs_len`` random observation tokens; one seeded request per row."""
    outs = []
    for turn in range(turns):
        params = [SamplingParams(temperature=t, max_new_tokens=4, seed=start_seed + 100 * turn + i,
                                 stop_token_ids=(5,))
                  for i, t in zip(range(len(convs)), [1.0, 0.7, 0.0] * len(convs))]
        got = sampler.generate(convs, params)
        outs.append(got)
        convs = [c + o.token_ids + rng.integers(1, V, obs_len).tolist() for c, o in zip(convs, got)]
    return outs


@pytest.mark.parametrize("on_mesh", [False, True])
def test_kept_caches_give_the_fresh_samples(model, on_mesh):
    """Multi-turn scripts (random observations, a group's samples sharing their first prompt):
    with the caches of earlier calls kept, each turn prefills only the tokens its conversation
    added, and the token ids and finish reasons are those of a fresh cache per call, log-probs
    to 1e-5 (keys written by the decode loop round differently); on a data 4 x tensor 2 mesh
    as on one device."""
    kw = on_data4_tensor2(model, on_mesh, batch_buckets=(8,), len_buckets=(4, 8, 16),
                          new_token_buckets=(4,), seed=0)
    a, b = prompts_of([5, 3], seed=11)
    convs = [a, a, a, b, b, b, a]  # two groups: the first turn shares, later turns reuse
    fresh, kept = JaxSampler(model, reuse_calls=0, **kw), JaxSampler(model, **kw)
    want = conversation_turns(fresh, convs, 4, np.random.default_rng(3))
    got = conversation_turns(kept, convs, 4, np.random.default_rng(3))
    for w, g in zip(want, got):
        assert [o.token_ids for o in g] == [o.token_ids for o in w]
        assert [o.finish_reason for o in g] == [o.finish_reason for o in w]
        np.testing.assert_allclose(np.concatenate([o.logprobs for o in g]),
                                   np.concatenate([o.logprobs for o in w]), atol=1e-5)
    st = kept.prefill_stats
    # turns 1..3 reuse every row: what is prefilled is the last sampled token + 2 observation
    # tokens of each conversation (the decode loop never writes the last sampled token)
    shared = 3 * 5 + 2 * 3   # turn 0: a's 3 repeats and b's 2 forked, not prefilled
    assert st["tokens_reused"] == st["tokens_asked"] - st["tokens_prefilled"] - shared
    assert st["tokens_prefilled"] == 5 + 3 + 3 * len(convs) * 3
    assert kept.compile_counts["extend"] >= 1 and fresh.compile_counts["extend"] == 0


def test_kept_caches_partial_prefixes_and_weight_syncs(model):
    """A prompt that leaves a kept row inside its tokens (an edited history), one that equals a
    kept row, and one that shares nothing get the fresh samples; a weight sync drops the kept
    caches (nothing of the old weights is reused), and ``reuse_calls`` is validated."""
    kw = dict(batch_buckets=(8,), len_buckets=(4, 8, 16), new_token_buckets=(4,), seed=0)
    fresh, kept = JaxSampler(model, reuse_calls=0, **kw), JaxSampler(model, **kw)
    p = prompts_of([9, 9, 9], seed=12)
    params = [SamplingParams(temperature=1.0, max_new_tokens=4, seed=i) for i in range(3)]
    first = kept.generate(p, params)
    held = [q + o.token_ids[:-1] for q, o in zip(p, first)]
    other_first = min(set(range(V)) - {h[0] for h in held})
    nxt = [held[0][:7] + [(held[0][7] + 1) % V] * 7,     # leaves row 0 after 7 tokens
           held[1],                                      # row 1 exactly: its last token redone
           [other_first] + prompts_of([5], seed=99)[0]]  # shares nothing
    for s in (fresh, kept):
        s.prefill_stats.clear()
    want, got = fresh.generate(nxt, params), kept.generate(nxt, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    np.testing.assert_allclose(np.concatenate([o.logprobs for o in got]),
                               np.concatenate([o.logprobs for o in want]), atol=1e-5)
    assert kept.prefill_stats["tokens_reused"] == 7 + len(held[1]) - 1
    other = Transformer(CONFIG, rngs=nnx.Rngs(5))
    for s in (fresh, kept):
        s.sync_weights(other, version=1)
    kept.prefill_stats.clear()
    want, got = fresh.generate(nxt, params), kept.generate(nxt, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    np.testing.assert_array_equal(np.concatenate([o.logprobs for o in got]),
                                  np.concatenate([o.logprobs for o in want]))
    assert kept.prefill_stats["tokens_reused"] == 0
    with pytest.raises(ValueError, match="reuse_calls"):
        JaxSampler(model, reuse_calls=-1)


# ----------------------------------------------------------------------------- a mesh


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 host devices (XLA_FLAGS)")
@pytest.mark.parametrize("data, tensor", [(4, 2), (8, 1)])
def test_sharded_sampler_matches_one_device(sampler, model, data, tensor):
    """Split over data x tensor host devices (weights by the default partition rules, KV cache
    rows over data and heads over tensor) the sampler returns the one-device sampler's tokens
    and log-probs (seeded, mixed temperatures, top-k, a chunk of 11 > the batch bucket), places
    its weights and cache as asked, keeps that layout across weight syncs, and compiles once."""
    from jaxrl_agent import sharding

    mesh = sharding.sampler_mesh(data, tensor)
    shardings = sharding.param_shardings(nnx.state(model), mesh, sharding.DEFAULT_RULES)
    sharded = JaxSampler(model, batch_buckets=(8,), len_buckets=(16,), new_token_buckets=(16,),
                         seed=0, mesh=mesh, param_shardings=shardings)
    assert sharded.batch_buckets == (8,)
    q = sharded.state["layers"]["self_attn"]["q_proj"]["kernel"][...]
    # (layers, embed, heads): embed's fsdp axis has size 1 in a sampler mesh; heads over tensor
    assert q.sharding.spec == (P(None, None, "tensor") if tensor > 1 else P())
    assert q.addressable_shards[0].data.shape == (CONFIG.num_layers, CONFIG.hidden_size,
                                                  CONFIG.num_heads * CONFIG.head_dim // tensor)
    prompts = prompts_of(np.random.default_rng(3).integers(1, 17, 11), seed=5)
    params = [SamplingParams(temperature=t, top_k=k, max_new_tokens=16, seed=i)
              for i, (t, k) in enumerate([(0.0, 0), (1.0, 0), (0.7, 5)] * 3 + [(1.0, 3),
                                                                               (0.0, 0)])]
    want = sampler.generate(prompts, params)
    got = sharded.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    np.testing.assert_allclose(np.concatenate([o.logprobs for o in got]),
                               np.concatenate([o.logprobs for o in want]), atol=1e-5)
    sharded.sync_weights(nnx.state(model), 3)  # from the model's one-device arrays
    q2 = sharded.state["layers"]["self_attn"]["q_proj"]["kernel"][...]
    assert q2.sharding == q.sharding
    assert [o.token_ids for o in sharded.generate(prompts, params)] == \
        [o.token_ids for o in want]
    assert dict(sharded.compile_counts) == {"prefill": 1, "decode": 1}
    # the prefill's cache: rows over data, KV heads over tensor
    prefill, _ = sharded.lower(8, 16, 16)
    cache = prefill.out_info[0].k
    placed = prefill.compile().output_shardings[0].k
    assert placed.shard_shape(cache.shape) == (CONFIG.num_layers, 8 // data, 2 // tensor, 32, 16)


def test_sampler_mesh_mistakes(model):
    from jaxrl_agent import sharding

    with pytest.raises(ValueError, match="data' axis"):
        JaxSampler(model, mesh="data")
    with pytest.raises(ValueError, match="param_shardings needs a mesh"):
        JaxSampler(model, param_shardings={})
    with pytest.raises(ValueError, match="sampler.data_parallel"):
        sharding.sampler_mesh(data=len(jax.local_devices()) + 1)
    if len(jax.devices()) >= 4:
        with pytest.raises(ValueError, match=r"tensor axis \(4\) must divide"):
            JaxSampler(model, mesh=sharding.sampler_mesh(1, 4))  # 2 KV heads
        # batch buckets become multiples of the data axis
        assert JaxSampler(model, batch_buckets=(2, 8, 10),
                          mesh=sharding.sampler_mesh(4, 1)).batch_buckets == (4, 8, 12)
