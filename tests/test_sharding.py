"""Shard invariance (P16): every registered estimator, and the batch-wide statistics of
segments.py, give the same numbers under jax.shard_map on 8 host CPU devices as unsharded.

Batches are packed with num_shards=8 (groups whole per block) and fixed pad_to, so there is
one shape per layout. conftest.py sets XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_agent import estimators, segments
from jaxrl_agent.rollout.records import pack_records

LAYOUTS = ("concatenated", "per_step")
PAD = {"concatenated": {"num_traj": 32, "num_turns": 4, "row_len": 32},
       "per_step": {"num_traj": 32, "num_turns": 4, "num_rows": 128, "row_len": 8}}
NUM_TASKS = 8
ATOL = 1e-5

# Non-default hyper-parameters, so discounts and lambdas are exercised.
HP = {"reinforce_pp": {"gamma": 0.9, "kl_coef": 0.05}, "returns": {"gamma": 0.9},
      "gae": {"gamma": 0.95, "lam": 0.9}, "turn_gae": {"gamma": 0.9, "lam": 0.8},
      "lambda_returns": {"gamma": 0.9, "lam": 0.7}, "spo": {"rho": 0.9},
      "spo_pp": {"rho": 0.9}}
VARIANTS = [("rollout_level", {"row_weighted": True}), ("turn_gae", {"normalization": "turn"}),
            ("lambda_returns", {"level": "token", "gamma": 0.9, "lam": 0.7})]


def _records():
    """22 trajectories in 10 groups of 1-4 (one singleton, one zero-variance group), 1-4
    turns each; the greedy block assignment puts at most 4 trajectories in each block."""
    rng = np.random.default_rng(2024)
    recs = []
    for g, size in enumerate([4, 3, 2, 1, 4, 1, 2, 3, 1, 1]):
        for _ in range(size):
            turns = []
            for _ in range(int(rng.integers(1, 5))):
                a = int(rng.integers(1, 4))
                turns.append({"observation": [int(x) for x in rng.integers(0, 50,
                                                                          rng.integers(0, 4))],
                              "action": [int(x) for x in rng.integers(0, 50, a)],
                              "reward": float(np.round(rng.normal(), 3)),
                              "logprobs": [float(-abs(x)) for x in rng.normal(size=a)],
                              "ref_logprobs": [float(-abs(x)) for x in rng.normal(size=a)],
                              "values": [float(x) for x in rng.normal(size=a)],
                              "value": float(rng.normal())})
            outcome = 1.0 if g == 1 else float(rng.choice([0.0, 0.5, 1.0]))  # group 1: all 1
            recs.append({"group": f"g{g}", "task": int(g % 6), "outcome": outcome,
                         "turns": turns})
    return recs


@pytest.fixture(scope="module")
def batches():
    recs = _records()
    out = {}
    for layout in LAYOUTS:
        b = pack_records(recs, layout=layout, pad_to=PAD[layout], num_shards=8)[0]
        out[layout] = b.validate(num_shards=8)
    return out


@pytest.fixture(scope="module")
def meshes():
    devs = jax.devices()
    assert len(devs) >= 8, "needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return {"1d": (Mesh(np.array(devs[:8]), ("data",)), "data"),
            "2d": (Mesh(np.array(devs[:8]).reshape(4, 2), ("data", "fsdp")), ("data", "fsdp"))}


def _sharded(fn, mesh, axis, stateful, hp, check_vma=True):
    spec = P(axis)
    sm = partial(jax.shard_map, mesh=mesh, check_vma=check_vma)
    if stateful:
        f = lambda b, s: fn(b, state=s, axis_name=axis, **hp)  # noqa: E731
        return jax.jit(sm(f, in_specs=(spec, P()), out_specs=(spec, P())))
    f = lambda b: fn(b, axis_name=axis, **hp)  # noqa: E731
    return jax.jit(sm(f, in_specs=(spec,), out_specs=spec))


def _args(name, batch):
    sp = estimators.spec(name)
    if not sp.stateful:
        return (batch,)
    s = sp.init_state(NUM_TASKS)  # a non-uniform prior, so p_hat differs per task
    return batch, s.replace(alpha=s.alpha + jnp.arange(NUM_TASKS) * 0.3)


def _run_sharded(name, hp, batch, mesh, axis, check_vma=True):
    sp = estimators.spec(name)
    out = _sharded(sp.fn, mesh, axis, sp.stateful, hp, check_vma)(*_args(name, batch))
    return out if sp.stateful else (out, None)


_UNSHARDED = {}  # (name, hp, layout) -> result: each reference compiles once per module


def _run_unsharded(name, hp, layout, batch):
    key = (name, tuple(sorted(hp.items())), layout)
    if key not in _UNSHARDED:
        sp = estimators.spec(name)
        if sp.stateful:
            f = jax.jit(lambda b, s: sp.fn(b, state=s, **hp))
        else:
            f = jax.jit(partial(sp.fn, **hp))
        out = f(*_args(name, batch))
        _UNSHARDED[key] = out if sp.stateful else (out, None)
    return _UNSHARDED[key]


def _compare(ref, got):
    (adv_r, st_r), (adv_g, st_g) = ref, got
    fields = [f for f in ("token", "turn", "token_returns", "turn_returns")
              if getattr(adv_r, f) is not None]
    assert fields and "token" in fields
    assert np.any(np.asarray(adv_r.token) != 0)  # not a trivially-zero comparison
    for f in fields:
        assert getattr(adv_g, f) is not None, f
        np.testing.assert_allclose(np.asarray(getattr(adv_g, f)), np.asarray(getattr(adv_r, f)),
                                   atol=ATOL, rtol=0, err_msg=f)
    if st_r is not None:
        np.testing.assert_allclose(st_g.alpha, st_r.alpha, atol=ATOL, rtol=0)
        np.testing.assert_allclose(st_g.beta, st_r.beta, atol=ATOL, rtol=0)
        assert not np.allclose(st_r.alpha, _args("spo", None)[1].alpha)  # the batch updated it


# Estimators built on segments.reverse_scan run a lax.scan on CPU; its carry must be typed as
# varying over the mesh axis (shard_map's check_vma) -- these cases guard that.


def _generic_names():
    """Estimators whose shard invariance is tested here; the step-level family has its own
    shard tests next to its references (tests/reference/all_refs.py: OWN_MODULE)."""
    from tests.reference.all_refs import OWN_MODULE
    return [n for n in estimators.names() if n not in OWN_MODULE]


def _cases(variants_only=False):
    items = [] if variants_only else [(n, HP.get(n, {})) for n in _generic_names()]
    if variants_only:
        items = VARIANTS
    for name, hp in items:
        hp_id = "-".join(f"{k}={v}" for k, v in hp.items()) if variants_only else ""
        yield pytest.param(name, hp, id="-".join(x for x in (name, hp_id) if x))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,hp", list(_cases()))
def test_estimator_shard_invariance_1d(batches, meshes, name, hp, layout):
    mesh, axis = meshes["1d"]
    b = batches[layout]
    got = _run_sharded(name, hp, b, mesh, axis)  # first: a tracing failure costs no compile
    _compare(_run_unsharded(name, hp, layout, b), got)


@pytest.mark.parametrize("name,hp", list(_cases(variants_only=True)))
def test_estimator_variants_shard_invariance_1d(batches, meshes, name, hp):
    mesh, axis = meshes["1d"]
    b = batches["per_step"]
    got = _run_sharded(name, hp, b, mesh, axis)
    _compare(_run_unsharded(name, hp, "per_step", b), got)


@pytest.mark.parametrize("name,hp", list(_cases()))
def test_estimator_shard_invariance_2d(batches, meshes, name, hp):
    """Batch sharded over both axes of a (4, 2) mesh, axis_name=("data", "fsdp")."""
    mesh, axis = meshes["2d"]
    b = batches["per_step"]
    got = _run_sharded(name, hp, b, mesh, axis)
    _compare(_run_unsharded(name, hp, "per_step", b), got)


def test_layouts_agree_on_turn_advantages(batches):
    """Same trajectories, both layouts: the per-turn advantages agree (trajectory order and
    the turn level are layout-free), which ties the two parametrisations above together."""
    for name in _generic_names():
        hp = HP.get(name, {})
        a, _ = _run_unsharded(name, hp, "concatenated", batches["concatenated"])
        c, _ = _run_unsharded(name, hp, "per_step", batches["per_step"])
        if a.turn is not None:
            np.testing.assert_allclose(a.turn, c.turn, atol=ATOL, err_msg=name)


# ----------------------------------------------------------------------------- segments


def _stat_data(seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(64, 8)) * 2 + 3).astype(np.float32)
    m = rng.random((64, 8)) < 0.5
    m[8:16] = False  # one device's whole block is masked out
    w = rng.integers(0, 4, 64).astype(np.float32)
    w[:8] = 0.0
    return x, m, x[:, 0], w


def _stats(x, m, xv, w, axis_name=None):
    return (segments.masked_whiten(x, m, axis_name=axis_name),
            segments.masked_whiten(x, m, axis_name=axis_name, ddof=1, shift_mean=False),
            *segments.masked_mean_var(x, m, axis_name=axis_name),
            *segments.masked_mean_var(x, m, axis_name=axis_name, ddof=1),
            *segments.weighted_mean_var(xv, w, axis_name=axis_name))


@pytest.mark.parametrize("mesh_kind,seed", [("1d", 0), ("2d", 1)])
def test_segment_statistics_shard_invariance(meshes, mesh_kind, seed):
    mesh, axis = meshes[mesh_kind]
    args = _stat_data(seed)
    ref = jax.jit(_stats)(*args)
    spec = P(axis)
    f = jax.jit(jax.shard_map(partial(_stats, axis_name=axis), mesh=mesh,
                              in_specs=(spec, spec, spec, spec),
                              out_specs=(spec, spec) + (P(),) * 6))
    got = f(*args)
    for i, (r, g) in enumerate(zip(ref, got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=ATOL, rtol=1e-6,
                                   err_msg=str(i))
    # independent numpy check of the global statistics
    x, m, xv, w = (np.asarray(a, np.float64) for a in args)
    v = x[m.astype(bool)]
    np.testing.assert_allclose(got[2], v.mean(), rtol=1e-5)
    np.testing.assert_allclose(got[3], v.var(), rtol=1e-5)
    np.testing.assert_allclose(got[5], v.var(ddof=1), rtol=1e-5)
    np.testing.assert_allclose(got[6], (w * xv).sum() / w.sum(), rtol=1e-5)


# ----------------------------------------------------------------------------- block rule


def test_block_rule_violation_is_rejected_and_would_change_results(batches, meshes):
    recs = _records()
    bad = pack_records(recs, pad_to=PAD["concatenated"])[0]  # packed for one device
    bad.validate()
    with pytest.raises(ValueError, match="shard block"):
        bad.validate(num_shards=8)
    # what the check prevents: with groups cut by the block boundaries, GRPO under
    # shard_map no longer matches the unsharded result
    mesh, axis = meshes["1d"]
    ref = _run_unsharded("grpo", {}, "bad", bad)
    got = _run_sharded("grpo", {}, bad, mesh, axis)
    assert not np.allclose(np.asarray(ref[0].token), np.asarray(got[0].token), atol=ATOL)
