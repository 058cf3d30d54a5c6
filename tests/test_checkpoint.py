"""Checkpointer: bit-exact round trips of trainer-shaped state, keep/every, interrupted saves, errors."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_agent.train import checkpoint as C
from tests.processes import child_env

REPO = Path(__file__).resolve().parents[1]


def _np_init(seed):
    """Initializer from NumPy values (keeps the test free of XLA compiles of random initializers)."""
    return lambda key, shape, dtype=jnp.float32: jnp.asarray(
        np.random.default_rng(seed).standard_normal(shape), dtype)


def make_state(seed=0):
    lin = nnx.Linear(3, 4, kernel_init=_np_init(seed), bias_init=_np_init(seed + 1), rngs=nnx.Rngs(seed))
    params = nnx.state(lin, nnx.Param)
    opt_state = optax.adamw(1e-3).init(params)
    rng = np.random.default_rng(seed)
    return {
        "params": params,
        "opt_state": opt_state,
        "step": jnp.asarray(3 + seed, jnp.int32),
        "rng": jax.random.key_data(jax.random.key(seed + 7)),  # uint32 [2]
        "extra": (
            jnp.asarray(rng.standard_normal(5), jnp.bfloat16),
            jnp.asarray(np.arange(6, dtype=np.int32).reshape(2, 3) - 2 * seed),
            jnp.asarray(np.array([0, 1, 2**32 - 1 - seed], np.uint32)),
            jnp.stack([jax.random.key_data(jax.random.key(seed + i)) for i in range(3)]),
            jnp.asarray(rng.standard_normal((2, 2)), jnp.float32),
        ),
    }


def perturb(state):
    """Same structure and dtypes, different values (a restore target that must be overwritten)."""
    return jax.tree.map(lambda x: jax.device_put(np.full(x.shape, 1, x.dtype)), state)


def assert_bit_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def test_round_trip_is_bit_identical_with_structure_and_meta(tmp_path):
    state = make_state()
    meta = {"config": {"lr": 1e-3, "layers": [1, 2]}, "metrics": {"loss": 0.5}, "py_rng": [3, [1, 2], None]}
    with C.Checkpointer(tmp_path / "ck", every=10, keep=3) as ck:
        assert ck.save(10, state, meta) is True
        assert ck.latest_step() == 10 and ck.all_steps() == [10]
        restored, rmeta = ck.restore(perturb(state))
    assert_bit_identical(restored, state)
    assert isinstance(restored["params"], nnx.State)
    assert type(restored["opt_state"][0]).__name__ == "ScaleByAdamState"
    assert isinstance(restored["opt_state"][1], optax.EmptyState)
    assert restored["extra"][0].dtype == jnp.bfloat16
    assert rmeta == meta
    assert C.read_meta(tmp_path / "ck") == meta
    assert C.latest_step(tmp_path / "ck") == 10


def test_restore_into_abstract_target_and_struct_dataclass(tmp_path):
    @struct.dataclass
    class TrainState:
        params: dict
        step: jax.Array
        host: np.ndarray

    state = TrainState(params={"w": jnp.arange(4.0), "b": (jnp.ones(2, jnp.bfloat16),)},
                       step=jnp.int32(7), host=np.arange(3, dtype=np.int64))
    with C.Checkpointer(tmp_path, every=1, keep=1) as ck:
        ck.save(1, state, {})
        target = jax.eval_shape(lambda: state)  # ShapeDtypeStruct leaves, no sharding
        target = target.replace(host=np.zeros(3, np.int64))  # a numpy leaf comes back as numpy
        restored, meta = ck.restore(target)
    assert isinstance(restored, TrainState) and meta == {}
    assert_bit_identical(restored, state)
    assert isinstance(restored.params["w"], jax.Array)
    assert isinstance(restored.host, np.ndarray)


def test_sharded_save_restores_onto_another_sharding(tmp_path):
    devs = np.array(jax.devices()[:8])
    mesh8 = Mesh(devs.reshape(8), ("d",))
    mesh42 = Mesh(devs.reshape(4, 2), ("a", "b"))
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh8, P("d")))
    with C.Checkpointer(tmp_path, every=1, keep=1) as ck:
        ck.save(1, {"x": x}, {})
        want = NamedSharding(mesh42, P("b", "a"))
        restored, _ = ck.restore({"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=want)})
    assert restored["x"].sharding == want
    np.testing.assert_array_equal(np.asarray(restored["x"]), np.asarray(x))


def test_every_force_duplicates_and_keep(tmp_path):
    ck = C.Checkpointer(str(tmp_path), every=2, keep=2)
    assert [ck.should_save(s) for s in range(5)] == [True, False, True, False, True]
    s = {"a": jnp.zeros(2)}
    assert ck.save(1, s, {}) is False  # not a multiple of every
    assert ck.all_steps() == []
    assert ck.save(1, s, {}, force=True) is True  # e.g. at exit
    assert ck.save(1, s, {}, force=True) is False  # exists: skipped quietly
    for step in (2, 4, 6):
        assert ck.save(step, {"a": jnp.full(2, step)}, {"step": step}) is True
    assert ck.all_steps() == [4, 6]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["4", "6"]
    restored, meta = ck.restore(s, step=4)
    assert meta == {"step": 4} and restored["a"].tolist() == [4.0, 4.0]
    ck.close()
    # a new session on the same directory sees the old steps and keeps applying `keep`
    with C.Checkpointer(tmp_path, every=2, keep=2) as ck2:
        assert ck2.latest_step() == 6
        assert ck2.save(8, s, {}) is True
        assert ck2.all_steps() == [6, 8]
    never = C.Checkpointer(tmp_path / "never", every=0, keep=1)
    assert not any(never.should_save(s) for s in range(4))
    never.close()
    with pytest.raises(ValueError, match="keep"):
        C.Checkpointer(tmp_path / "bad", every=1, keep=0)


def test_relative_directory_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with C.Checkpointer("rel/ck", every=1, keep=1) as ck:
        assert ck.directory == tmp_path / "rel" / "ck" and ck.directory.is_absolute()
        ck.save(5, {"a": jnp.ones(1)}, {"x": 1})
    assert (tmp_path / "rel" / "ck" / "5").is_dir()
    assert C.latest_step("rel/ck") == 5 and C.read_meta(Path("rel/ck"), 5) == {"x": 1}


def test_missing_checkpoint_errors_name_the_directory(tmp_path):
    d = tmp_path / "empty"
    assert C.latest_step(tmp_path / "does-not-exist") is None
    with C.Checkpointer(d, every=1, keep=1) as ck:
        assert ck.latest_step() is None and ck.all_steps() == []
        with pytest.raises(FileNotFoundError, match=str(d)):
            ck.restore({"a": jnp.ones(1)})
        ck.save(1, {"a": jnp.ones(1)}, {})
        with pytest.raises(FileNotFoundError, match="step 2"):
            ck.restore({"a": jnp.ones(1)}, step=2)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        C.read_meta(tmp_path / "nope")


def test_structure_mismatch_is_a_clear_value_error(tmp_path):
    state = make_state()
    with C.Checkpointer(tmp_path, every=1, keep=1) as ck:
        ck.save(1, state, {})
        bad = dict(state)
        del bad["rng"]
        bad["new_thing"] = jnp.zeros(3)
        with pytest.raises(ValueError) as e:
            ck.restore(bad)
        msg = str(e.value)
        assert "in target but not in checkpoint: new_thing" in msg
        assert "in checkpoint but not in target: rng" in msg
        assert "Traceback" not in msg
        wrong_shape = dict(state, step=jnp.zeros((2,), jnp.int32))
        with pytest.raises(ValueError, match=r"shape differs.*step \(\) vs \(2,\)"):
            ck.restore(wrong_shape)
        # a differing dtype is not a mismatch: orbax casts to the target's dtype
        cast, _ = ck.restore(dict(state, rng=state["rng"].astype(jnp.int32)))
        assert cast["rng"].dtype == jnp.int32


def test_typed_prng_keys_are_rejected_with_a_hint(tmp_path):
    with C.Checkpointer(tmp_path, every=1, keep=1) as ck:
        with pytest.raises(TypeError, match="key_data"):
            ck.save(1, {"key": jax.random.key(0)}, {})
        assert ck.all_steps() == []


def test_meta_is_normalised_through_json(tmp_path):
    with C.Checkpointer(tmp_path, every=1, keep=1) as ck:
        meta = {"t": (1, 2), "f": np.float32(0.5), "i": np.int64(3), "a": jnp.asarray(2.0), 4: "int key"}
        ck.save(1, {"a": jnp.ones(1)}, meta)
        assert ck.restore({"a": jnp.ones(1)})[1] == {"t": [1, 2], "f": 0.5, "i": 3, "a": 2.0, "4": "int key"}
        with pytest.raises(TypeError, match="JSON"):
            ck.save(2, {"a": jnp.ones(1)}, {"obj": object()})
        assert ck.all_steps() == [1]


def test_orbax_info_logs_are_filtered_but_root_logging_is_untouched(tmp_path, caplog):
    root_level = logging.getLogger().level
    with caplog.at_level(logging.INFO):
        with C.Checkpointer(tmp_path, every=1, keep=1) as ck:
            ck.save(1, {"a": jnp.ones(1)}, {})
            ck.restore({"a": jnp.ones(1)})
        logging.getLogger("absl").info("someone else's absl info")
    orbax_info = [r for r in caplog.records if "/orbax/" in r.pathname and r.levelno < logging.WARNING]
    assert orbax_info == []
    assert any(r.getMessage() == "someone else's absl info" for r in caplog.records)
    assert logging.getLogger().level == root_level


def test_closed_checkpointer_refuses_work(tmp_path):
    ck = C.Checkpointer(tmp_path, every=1, keep=1)
    ck.close()
    ck.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ck.save(1, {"a": jnp.ones(1)}, {})


# ------------------------------------------------------------------------------ interrupted saves
_KILLED_SAVE = textwrap.dedent("""
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {repo!r})
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import async_path
    from jaxrl_agent.train import checkpoint as C

    real_rename = async_path.rename

    async def hanging_rename(src, dst):
        if os.path.basename(str(dst)) == "2":  # the step directory's commit: all data + marker written
            open({ready!r}, "w").close()
            time.sleep(120)  # parent SIGKILLs us here
        return await real_rename(src, dst)

    async_path.rename = hanging_rename
    ck = C.Checkpointer({directory!r}, every=1, keep=5)
    ck.save(2, {{"w": jnp.full((4,), 2.0), "n": jnp.int32(2)}}, {{"step": 2}})
    print("save returned; the kill did not happen", flush=True)
""")


def test_save_killed_before_commit_is_never_taken_as_valid(tmp_path):
    d = tmp_path / "ck"
    target = {"w": jnp.zeros(4), "n": jnp.int32(0)}
    with C.Checkpointer(d, every=1, keep=5) as ck:
        ck.save(1, {"w": jnp.full((4,), 1.0), "n": jnp.int32(1)}, {"step": 1})

    ready = tmp_path / "ready"
    script = tmp_path / "killed_save.py"
    script.write_text(_KILLED_SAVE.format(repo=str(REPO), ready=str(ready), directory=str(d)))
    env = child_env(None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # it is killed: no half-written cache entries
    proc = subprocess.Popen([sys.executable, str(script)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"child never reached the commit:\n{proc.stdout.read().decode()}")
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # what orbax left: the fully written step in its tmp directory, commit marker included, not renamed
    leftovers = [p for p in d.iterdir() if p.name.startswith("2.")]
    assert [p.name for p in leftovers] == ["2.orbax-checkpoint-tmp"]
    assert (leftovers[0] / C.COMMIT_MARKER).exists() and (leftovers[0] / "state").is_dir()
    assert not (d / "2").exists()
    # also what commit-file mode (GCS) would leave: a step directory without the marker
    (d / "3" / "state").mkdir(parents=True)
    (d / "3" / "state" / "garbage").write_bytes(b"\0" * 10)

    assert C.latest_step(d) == 1
    assert C.read_meta(d) == {"step": 1}
    with C.Checkpointer(d, every=1, keep=5) as ck:
        assert ck.latest_step() == 1 and ck.all_steps() == [1]
        restored, meta = ck.restore(target)
        assert meta == {"step": 1} and restored["w"].tolist() == [1.0] * 4 and int(restored["n"]) == 1
        # later saves work, including the step whose save was killed
        assert ck.save(2, {"w": jnp.full((4,), 2.0), "n": jnp.int32(2)}, {"step": 2})
        assert not leftovers[0].exists()  # orbax removed the tmp dir (cleanup_tmp_directories)
        assert ck.save(3, {"w": jnp.full((4,), 3.0), "n": jnp.int32(3)}, {"step": 3}) is True
        assert ck.save(4, {"w": jnp.full((4,), 4.0), "n": jnp.int32(4)}, {"step": 4})
        assert ck.all_steps() == [1, 2, 3, 4]
        restored, meta = ck.restore(target)
        assert meta == {"step": 4} and int(restored["n"]) == 4
        assert ck.restore(target, step=2)[0]["w"].tolist() == [2.0] * 4


def test_checkpoint_with_one_leaf_per_layer_restores_into_stacked_layers(tmp_path):
    """Checkpoints written before the decoder layers were stacked (``layers/0/...``,
    ``layers/1/...``; parameters and optimizer moments alike) restore into the stacked target
    (``layers/...`` with a leading [num_layers] axis), on the target's sharding."""
    rng = np.random.default_rng(0)
    per = [{"mlp": {"kernel": jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)},
            "norm": {"weight": jnp.asarray(rng.standard_normal(4), jnp.bfloat16)}}
           for _ in range(3)]
    mu = [jax.tree.map(lambda x: x * 2, p) for p in per]
    old = {"params": {"layers": dict(enumerate(per)), "head": jnp.ones(5)},
           "opt_state": {"mu": {"layers": dict(enumerate(mu))}}, "step": jnp.int32(4)}
    stack = lambda layers: jax.tree.map(lambda *xs: jnp.stack(xs), *layers)  # noqa: E731
    want = {"params": {"layers": stack(per), "head": jnp.ones(5)},
            "opt_state": {"mu": {"layers": stack(mu)}}, "step": jnp.int32(4)}
    mesh = Mesh(np.array(jax.devices()[:2]), ("f",))
    split = NamedSharding(mesh, P(None, "f"))  # [layers, 4 / 2, 6]: the embed axis split
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), want)
    target["params"]["layers"]["mlp"]["kernel"] = jax.ShapeDtypeStruct(
        (3, 4, 6), jnp.float32, sharding=split)
    with C.Checkpointer(tmp_path, every=1, keep=1) as ck:
        ck.save(1, old, {})
        restored, _ = ck.restore(target)
    assert_bit_identical(restored, want)
    kernel = restored["params"]["layers"]["mlp"]["kernel"]
    assert kernel.sharding.is_equivalent_to(split, 3)
    assert restored["params"]["layers"]["norm"]["weight"].dtype == jnp.bfloat16
    # a layer missing from the checkpoint is still a mismatch, named
    del old["params"]["layers"][2]
    with C.Checkpointer(tmp_path / "short", every=1, keep=1) as ck:
        ck.save(1, old, {})
        with pytest.raises(ValueError, match="layers"):
            ck.restore(target)
