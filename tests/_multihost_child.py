"""One process of the two-process test in test_multihost.py (not collected by pytest).

Run as ``python _multihost_child.py`` with ``$JAXRL_COORDINATOR``, ``$JAXRL_NUM_PROCESSES=2``,
``$JAXRL_PROCESS_ID``, ``JAX_PLATFORMS=cpu`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=4``. Every check is collective-safe: both
processes run the same statements in the same order. Prints ``OK`` and exits 0 on success.
"""

import numpy as np

from jaxrl_agent.sharding import multihost as mh


def main() -> None:
    from jax._src import xla_bridge
    assert not xla_bridge.backends_are_initialized(), "importing the package started JAX"
    assert mh.initialize(initialization_timeout=60) is True
    assert mh.initialize() is True  # idempotent

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    pid = jax.process_index()
    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
    assert mh.is_main_process() == (pid == 0)

    # Objects of different sizes per process come back in process order.
    records = [{"process": pid, "reward": 0.25 * pid, "tokens": list(range(3 + 5 * pid)),
                "text": "é" * (pid + 1)} for _ in range(pid + 1)]
    gathered = mh.allgather_objects(records)
    expected = [[{"process": p, "reward": 0.25 * p, "tokens": list(range(3 + 5 * p)),
                  "text": "é" * (p + 1)} for _ in range(p + 1)] for p in range(2)]
    assert gathered == expected, gathered

    # Per-process shares of the tasks, gathered and concatenated, restore the task order.
    tasks = [f"task{i}" for i in range(7)]
    mine = mh.process_share(tasks)
    assert sum(mh.allgather_objects(mine), []) == tasks

    # A global batch over data=8 (4 devices per host): each host holds its half only.
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("data",))
    rng = np.random.default_rng(0)  # the same global batch on every host
    x = rng.normal(size=(16, 12)).astype(np.float32)
    xs = mh.global_array(x, NamedSharding(mesh, P("data")))
    assert xs.shape == x.shape and not xs.is_fully_addressable
    assert len(xs.addressable_shards) == 4
    for shard in xs.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(xs)
    np.testing.assert_allclose(mh.host_gather(total), x.sum(), rtol=1e-5)
    np.testing.assert_array_equal(mh.host_gather(xs), x)  # cross-host sharded -> full value

    # x @ W with W split over an ``fsdp`` axis that spans both hosts (devices transposed, so
    # each fsdp group has one device per process): XLA gathers W across processes.
    mesh2 = Mesh(devices.reshape(2, 4).T, ("data", "fsdp"))
    w = rng.normal(size=(12, 6)).astype(np.float32)
    tree = mh.global_tree({"x": x, "w": w}, {"x": NamedSharding(mesh2, P(("data", "fsdp"))),
                                             "w": NamedSharding(mesh2, P("fsdp"))})
    y = jax.jit(lambda t: t["x"] @ t["w"])(tree)
    out = mh.host_gather({"y": y, "w": tree["w"], "local": jnp.arange(3) + pid})
    np.testing.assert_allclose(out["y"], x @ w, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out["w"], w)
    np.testing.assert_array_equal(out["local"], np.arange(3) + pid)  # host-local stays local

    mh.sync_hosts("multihost-test-done")
    print("OK", flush=True)


if __name__ == "__main__":
    main()
