"""The JAX sampler's calls sized to fit (``train.call_size``, ``JaxSampler.limit_call_rows``)
and one decode step compiled alone (``JaxSampler.lower_step``)."""

import io

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from jaxrl_agent import config as config_lib
from jaxrl_agent import run_checks
from jaxrl_agent.models import ModelConfig, Transformer
from jaxrl_agent.sampling import JaxSampler, SamplingParams
from jaxrl_agent.train import call_size, loop
from tests.runs import tiny_config

V = 128
CONFIG = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model():
    m = Transformer(CONFIG, rngs=nnx.Rngs(0))
    m.lm_head.kernel[...] = m.lm_head.kernel[...] * 20.0  # sharper than the init's uniform
    return m


def _sampler(model, **kw):
    return JaxSampler(model, **{"batch_buckets": (8, 32), "len_buckets": (16, 32),
                                "new_token_buckets": (16,), "seed": 0, **kw})


# ----------------------------------------------------------------------------- the search


def test_call_candidates():
    assert call_size.call_candidates(128) == [128, 64, 32, 16, 8, 4, 2, 1]
    # multiples of the data axis, down to it, distinct
    assert call_size.call_candidates(100, 4) == [100, 52, 28, 16, 8, 4]
    assert call_size.call_candidates(6, 4) == [8, 4]
    assert call_size.call_candidates(1, 1) == [1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(0, 200),
       st.sets(st.integers(0, 8)))
def test_fit_call_rows_is_the_largest_that_fits(steps, budget, refused):
    """Against a scan of every candidate: peaks growing with the rows (None = refused, only
    above some size), the largest within the budget, or None; the largest is tried first and
    the bisection tries at most 1 + ceil(log2(n)) sizes."""
    n = len(steps)
    candidates = list(range(10 * n, 0, -10))           # descending rows
    peaks = list(np.cumsum(steps[::-1]))[::-1]         # non-increasing down the list
    cut = min(refused, default=n)                      # refused from the largest down to here
    peak = {c: (None if i < cut and refused else int(p))
            for i, (c, p) in enumerate(zip(candidates, peaks))}
    rows, tried = call_size.fit_call_rows(peak.__getitem__, candidates, budget)
    fitting = [c for c in candidates if peak[c] is not None and peak[c] <= budget]
    assert rows == (fitting[0] if fitting else None)
    assert tried[0][0] == candidates[0]
    assert len(tried) <= 1 + int(np.ceil(np.log2(n))) + 1
    assert all(peak[r] == b for r, b in tried)


# ----------------------------------------------------------------------------- chunked calls


def test_limited_calls_give_the_same_samples(model):
    """20 requests in chunks of at most 8 rows (8, 8, 4) sample what one call of 20 (padded to
    32) samples: the same tokens, finish reasons and log-probs, over two turns (the second
    continues the first's conversations: kept caches); the buckets above the limit go."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, n).tolist() for n in rng.integers(1, 14, 20)]
    params = [SamplingParams(temperature=t, top_k=k, max_new_tokens=16, stop_token_ids=(5,))
              for t, k in [(1.0, 0), (0.7, 5), (0.0, 0), (1.0, 3)] * 5]
    whole, chunked = _sampler(model), _sampler(model)
    chunked.limit_call_rows(8)
    assert chunked.batch_buckets == (8,) and chunked.call_rows == 8
    for turn in range(2):
        want, got = whole.generate(prompts, params), chunked.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], turn
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        np.testing.assert_allclose(np.concatenate([o.logprobs for o in got]),
                                   np.concatenate([o.logprobs for o in want]), atol=1e-5)
        prompts = [p + o.token_ids[:3] + [7] for p, o in zip(prompts, want)]
    assert chunked.prefill_stats["tokens_reused"] > 0
    grown = _sampler(model)
    grown.limit_call_rows(12)
    assert grown.batch_buckets == (8, 12)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="call rows must be an int >= 1"):
            grown.limit_call_rows(bad)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 host devices (XLA_FLAGS)")
def test_limited_rows_are_a_multiple_of_the_data_axis(model):
    from jaxrl_agent import sharding
    s = _sampler(model, mesh=sharding.sampler_mesh(4, 1))
    s.limit_call_rows(6)
    assert s.batch_buckets == (8,)
    assert call_size.call_candidates(32, 4)[-1] == 4


# ----------------------------------------------------------------------------- sized to fit


def _cfg(*sets):
    return run_checks.load(None, ["rollout.tasks_per_step=8", "rollout.group_size=4",
                                  "rollout.max_context_tokens=48", "rollout.max_new_tokens=8",
                                  "trainer.eval_every=0", *sets], validate=False)


def test_sizing_picks_the_largest_call_that_fits(model):
    """The budget is 85% of the limit minus the train state; each size tried is its compiled
    prefill's or decode loop's peak (the larger) plus the kept caches beside its last chunk;
    the sampler is limited to the largest that fits; when only a call without kept caches
    fits they are turned off; a budget nothing fits is a one-line error naming the keys."""
    cfg = _cfg()
    probe = _sampler(model)
    dims = call_size.sampler_dims(cfg, probe)
    assert (dims["prompts"], dims["batch"], dims["cache_len"]) == (32, 32, 64)
    peaks = {r: call_size.compiled_call_bytes(probe, dims, r) for r in (32, 16, 8, 4, 2, 1)}
    assert peaks[32] > peaks[16] > peaks[8] > 0
    # one chunk's cache: 2 x layers x rows x slots x heads x dim x 4 bytes + the indices
    kv = 2 * CONFIG.num_layers * 16 * 64 * CONFIG.num_kv_heads * CONFIG.head_dim * 4 + 4 * 16
    assert call_size.kv_cache_bytes(probe, 16, 64) == kv
    # 2 chunks of 16: 2 earlier calls x 2 chunks + the call's first chunk beside the second
    assert call_size.kept_bytes(probe, dims, 16, 2) == 5 * kv
    assert call_size.kept_bytes(probe, dims, 16, 0) == 0
    state = 1000

    def limit_for(need):
        return int((need + state + 10) / call_size.CALL_MEMORY_FRACTION) + 1

    s = _sampler(model)
    size = call_size.size_sampler_calls(s, cfg, limit=limit_for(peaks[16] + 5 * kv),
                                        state=state)
    assert (size.rows, size.reuse_calls) == (16, 2) and s.call_rows == 16
    assert size.tried[0] == (32, 2, peaks[32] + call_size.kept_bytes(probe, dims, 32, 2))
    assert (16, 2, peaks[16] + 5 * kv) in size.tried and size.budget >= peaks[16] + 5 * kv
    assert "16 rows at once (2 chunks for 32 prompts)" in size.summary()
    roomy = _sampler(model)
    assert call_size.size_sampler_calls(roomy, cfg, limit=10 * limit_for(peaks[32] * 4),
                                        state=state).rows == 32
    # room for no size with its kept caches (about 3 whole calls' caches at every size), but
    # for a size without them: they go, and the largest size that fits without is chosen
    least = min(p + call_size.kept_bytes(probe, dims, r, 2) for r, p in peaks.items())
    rows = max(r for r, p in peaks.items() if p < least)
    tight = _sampler(model)
    size = call_size.size_sampler_calls(tight, cfg, limit=limit_for(peaks[rows]), state=state)
    assert (size.rows, size.reuse_calls, tight.reuse_calls) == (rows, 0, 0)
    assert "sampler.reuse_calls 0 for this run" in size.summary()
    with pytest.raises(config_lib.ConfigError, match="not even 1 rows per call fit.*"
                       "sampler.tensor_parallel.*rollout.max_context_tokens"):
        call_size.size_sampler_calls(_sampler(model), cfg, limit=peaks[1] // 4, state=state)


def test_the_trainer_sizes_its_sampler(tmp_path, monkeypatch):
    """``sampler.call_rows: N`` limits the run's sampler; 0 sizes it where the device reports a
    memory limit (none on CPU: the whole call) and says so at start-up."""
    fixed = loop.Trainer(tiny_config(tmp_path / "a", "sampler.call_rows=2"), progress=False)
    assert fixed.sampler.call_rows == 2 and fixed.call_size is None
    cpu = loop.Trainer(tiny_config(tmp_path / "b"), progress=False)
    assert cpu.call_size is None and cpu.sampler.call_rows == 8   # 4 eval tasks, 4 rollouts: bucket 8
    monkeypatch.setattr(call_size, "device_memory_limit", lambda device: 2 ** 40)
    out = io.StringIO()
    sized = loop.Trainer(tiny_config(tmp_path / "c", "trainer.steps=1"), stream=out)
    assert sized.call_size.rows == 8 and len(sized.call_size.tried) == 1
    sized.run()
    assert "sampler calls: 8 rows at once (1 chunk for 4 prompts), sized to fit" in \
        out.getvalue()
    with pytest.raises(config_lib.ConfigError, match="sampler.call_rows must be >= 0"):
        run_checks.validate(tiny_config(tmp_path / "d", "sampler.call_rows=-1"))


# ----------------------------------------------------------------------------- one decode step


def test_decode_step_reads_at_least_the_weights_and_the_cache(model):
    """One decode step compiled alone, its layers unrolled: XLA's bytes accessed are at least
    every weight and the KV cache once, and grow with the cache; the unrolled layers compute
    the scanned layers' numbers."""
    s = _sampler(model)
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s.state))

    def step_bytes(rows, slots):
        cost = s.lower_step(rows, slots).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return cost["bytes accessed"]

    small, big = step_bytes(8, 32), step_bytes(8, 64)
    assert small >= params + call_size.kv_cache_bytes(s, 8, 32)
    assert big - small >= call_size.kv_cache_bytes(s, 8, 32) - 8 * 4
    # rows that never truncate: the vocabulary sort (a lax.cond) is not counted; two steps
    # are counted twice (the layers of both, unrolled)
    plain = s.lower_step(8, 32, top_k=0, top_p=1.0).compile().cost_analysis()
    plain = (plain[0] if isinstance(plain, (list, tuple)) else plain)["bytes accessed"]
    truncating = s.lower_step(8, 32, top_k=5, top_p=0.9).compile().cost_analysis()
    truncating = (truncating[0] if isinstance(truncating, (list, tuple))
                  else truncating)["bytes accessed"]
    assert params <= plain < truncating
    two = s.lower_step(8, 32, steps=2).compile().cost_analysis()
    two = (two[0] if isinstance(two, (list, tuple)) else two)["bytes accessed"]
    assert two - small >= params + call_size.kv_cache_bytes(s, 8, 32)
    cache = model.init_cache(2, 16)
    tok = np.array([[3, 4, 5], [6, 7, 8]], np.int32)
    scanned = model(tok, cache=cache)
    unrolled = model(tok, cache=cache, layer_unroll=True)
    np.testing.assert_allclose(unrolled.logits, scanned.logits, atol=1e-5)
    np.testing.assert_allclose(unrolled.cache.k, scanned.cache.k, atol=1e-6)
