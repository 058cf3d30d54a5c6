"""Multi-host helpers: single-process behaviour (8 host CPU devices from conftest.py) and one
real two-process ``jax.distributed`` job on localhost (gloo CPU collectives), which runs
``tests/_multihost_child.py`` in two subprocesses with 4 CPU devices each.
"""

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_agent.sharding import multihost as mh
from tests.processes import child_env, free_port, wait_all

CHILD = Path(__file__).with_name("_multihost_child.py")
FULL = {"JAXRL_COORDINATOR": "localhost:1234", "JAXRL_NUM_PROCESSES": "2",
        "JAXRL_PROCESS_ID": "1"}


# ---------------------------------------------------------------------------------------------
# settings


def test_plain_run_is_a_no_op():
    assert mh.resolve_settings(env={}) is None
    assert mh.initialize(env={}) is False
    assert not jax.distributed.is_initialized()


def test_env_settings_and_explicit_override():
    s = mh.resolve_settings(env=FULL)
    assert s.kwargs() == {"coordinator_address": "localhost:1234", "num_processes": 2,
                          "process_id": 1}
    s = mh.resolve_settings("10.0.0.1:99", 4, 3, env=FULL)  # the config section wins
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("10.0.0.1:99", 4, 3)


def test_one_process_and_auto():
    assert mh.resolve_settings("localhost:1", 1, 0, env={}) is None
    s = mh.resolve_settings(auto=True, env={})
    assert s.auto and s.kwargs() == {}  # JAX detects everything
    s = mh.resolve_settings(auto=True, local_device_ids=[0, 1], env={"JAXRL_PROCESS_ID": "0"})
    assert s.kwargs() == {"process_id": 0, "local_device_ids": [0, 1]}


@pytest.mark.parametrize("args, env, field", [
    ((), {"JAXRL_COORDINATOR": "localhost:1234"}, "distributed.num_processes"),
    ((), {"JAXRL_COORDINATOR": "h:1", "JAXRL_NUM_PROCESSES": "2"}, "distributed.process_id"),
    ((None, 2, 0), {}, "distributed.coordinator_address"),
    ((), {**FULL, "JAXRL_NUM_PROCESSES": "two"}, "JAXRL_NUM_PROCESSES"),
    ((), {**FULL, "JAXRL_PROCESS_ID": "2"}, "distributed.process_id"),
    ((), {**FULL, "JAXRL_PROCESS_ID": "-1"}, "distributed.process_id"),
    ((), {**FULL, "JAXRL_NUM_PROCESSES": "0"}, "distributed.num_processes"),
    (("localhost", 2, 0), {}, "distributed.coordinator_address"),
    (("localhost:http", 2, 0), {}, "distributed.coordinator_address"),
    (("h:1", True, 0), {}, "distributed.num_processes"),
    (("h:1", 2.0, 0), {}, "distributed.num_processes"),
])
def test_invalid_settings_name_the_field(args, env, field):
    with pytest.raises(ValueError, match=field):
        mh.resolve_settings(*args, env=env)
    with pytest.raises(ValueError, match=field):
        mh.initialize(*args, env=env)


def test_local_device_ids_without_a_job():
    with pytest.raises(ValueError, match="distributed.local_device_ids"):
        mh.resolve_settings(local_device_ids=[0], env={})


def test_initialize_after_jax_started_says_call_it_first():
    jax.devices()  # the backend is running from here on
    with pytest.raises(RuntimeError, match="before any JAX computation"):
        mh.initialize(env=FULL)
    assert not jax.distributed.is_initialized()


# ---------------------------------------------------------------------------------------------
# single-process behaviour


def test_single_process_identity():
    obj = [{"reward": 1.5, "tokens": [1, 2], "text": "a"}]
    got = mh.allgather_objects(obj)
    assert got == [obj] and got[0] is obj
    assert mh.is_main_process()
    mh.sync_hosts("noop")


@pytest.mark.parametrize("n, count", [(0, 3), (2, 3), (7, 2), (10, 4), (8, 8), (5, 1)])
def test_process_share_is_a_contiguous_partition(n, count):
    items = list(range(n))
    shares = [mh.process_share(items, i, count) for i in range(count)]
    assert sum(shares, []) == items  # concatenation in process order restores the order
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1
    assert mh.process_share(items) == items  # one process: everything


def test_process_share_rejects_bad_index():
    with pytest.raises(ValueError, match="index"):
        mh.process_share([1, 2], 2, 2)


def _mesh2():
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))


@pytest.mark.parametrize("spec", [P("data"), P(("data", "fsdp")), P(None, "fsdp"), P()])
def test_global_array_value_and_sharding(spec):
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    sharding = NamedSharding(_mesh2(), spec)
    a = mh.global_array(x, sharding)
    assert a.sharding == sharding
    np.testing.assert_array_equal(np.asarray(a), x)
    for shard in a.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])
    np.testing.assert_array_equal(mh.host_gather(a), x)


def test_global_array_narrows_64_bit_like_jax():
    a = mh.global_array(np.ones((8,), np.float64), NamedSharding(_mesh2(), P("data")))
    assert a.dtype == jax.dtypes.canonicalize_dtype(np.float64)


def test_global_tree_one_sharding_or_a_prefix_tree():
    mesh = _mesh2()
    tree = {"a": np.ones((8, 2), np.int32), "b": {"c": np.zeros((4,), np.float32),
                                                  "d": np.arange(8, dtype=np.float32)}}
    rows = NamedSharding(mesh, P("data"))
    out = mh.global_tree(tree, rows)
    assert all(leaf.sharding == rows for leaf in jax.tree.leaves(out))
    prefix = {"a": rows, "b": NamedSharding(mesh, P())}
    out = mh.global_tree(tree, prefix)
    assert out["a"].sharding == rows and out["b"]["d"].sharding == prefix["b"]
    back = mh.host_gather(out)
    jax.tree.map(np.testing.assert_array_equal, back, tree)
    assert all(isinstance(v, np.ndarray) for v in jax.tree.leaves(back))


# ---------------------------------------------------------------------------------------------
# two real processes


@pytest.mark.slow
def test_two_processes_on_localhost(tmp_path):
    """Two processes x 4 CPU devices = one 8-device job: object all-gather, global arrays,
    a jitted matmul with the weight split across hosts, host_gather, barrier (see the child)."""
    port = free_port()
    procs, logs = [], []
    for pid in range(2):
        env = child_env(4, JAXRL_COORDINATOR=f"localhost:{port}", JAXRL_NUM_PROCESSES="2",
                        JAXRL_PROCESS_ID=str(pid))
        out = open(tmp_path / f"p{pid}.log", "w+")
        logs.append(out)
        procs.append(subprocess.Popen([sys.executable, str(CHILD)], env=env, stdout=out,
                                      stderr=subprocess.STDOUT, cwd=tmp_path))
    codes = wait_all(procs, timeout=120)
    texts = []
    for pid, f in enumerate(logs):
        f.seek(0)
        texts.append(f.read())
        f.close()
    report = "\n".join(f"--- process {i} (exit {p.returncode}) ---\n{t[-4000:]}"
                       for i, (p, t) in enumerate(zip(procs, texts)))
    assert codes == [0, 0], report
    assert all("OK" in t.splitlines() for t in texts), report
