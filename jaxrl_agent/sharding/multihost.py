"""Multi-host (multi-process) helpers: start-up, object exchange, global arrays, barriers.

A multi-host run is one Python process per host (or per accelerator group), all running the same
program. JAX joins them into one global device list after :func:`initialize`; a ``jax.Array``
laid out on a mesh over all devices then spans hosts, and each process holds only its
*addressable* shards. This module keeps the rest of the trainer oblivious to that:

* :func:`initialize` starts ``jax.distributed`` from the ``distributed:`` config section, the
  ``JAXRL_*`` environment variables, or JAX's own cluster detection; a plain run is a no-op.
* :func:`allgather_objects` exchanges small Python objects (rollout records) between processes.
* :func:`global_array` / :func:`global_tree` turn the identical host-side global batch into a
  global ``jax.Array`` (each process places only its own shards).
* :func:`host_gather` brings the full value of (possibly cross-host sharded) arrays to every host.
* :func:`process_share`, :func:`is_main_process`, :func:`sync_hosts`: work split, logging guard,
  barrier.

Every function works unchanged in a single process, without touching cross-process collectives,
so the same trainer code runs on a laptop and on a pod slice. Functions that communicate
(:func:`allgather_objects`, :func:`host_gather` on cross-host arrays, :func:`sync_hosts`) are
collective: every process must call them, in the same order, or the job hangs.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P, Sharding

ENV_COORDINATOR = "JAXRL_COORDINATOR"
ENV_NUM_PROCESSES = "JAXRL_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRL_PROCESS_ID"


@dataclass(frozen=True)
class DistributedSettings:
    """Resolved arguments for ``jax.distributed.initialize`` (``None``: let JAX detect it)."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None = None
    auto: bool = False

    def kwargs(self) -> dict:
        """The keyword arguments to pass on; unset fields are left out so JAX can detect them."""
        out = {"coordinator_address": self.coordinator_address,
               "num_processes": self.num_processes, "process_id": self.process_id,
               "local_device_ids": (list(self.local_device_ids)
                                    if self.local_device_ids is not None else None)}
        return {k: v for k, v in out.items() if v is not None}


# ---------------------------------------------------------------------------------------------
# start-up


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    """An integer environment variable, or ``None`` when unset/empty (errors name the variable)."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer; got {raw!r}") from None


def _check_int(value: Any, field: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; bools and floats are rejected (YAML ``1.0`` or ``true``
    in the wrong field is a typo, not a process count)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{field} must be an int >= {minimum}; got {value!r}")
    return int(value)


def _check_address(address: Any) -> str:
    """``host:port`` with a numeric port: a malformed address would otherwise only surface as a
    connection timeout minutes later."""
    field = f"distributed.coordinator_address (or ${ENV_COORDINATOR})"
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"{field} must be 'host:port'; got {address!r}")
    host, port = address.rsplit(":", 1)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field} must be 'host:port' with a port in 1..65535; got {address!r}")
    return address


def resolve_settings(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, local_device_ids: Any = None,
                     auto: bool = False,
                     env: Mapping[str, str] | None = None) -> DistributedSettings | None:
    """Merge explicit arguments (the ``distributed:`` config section) over the ``JAXRL_*``
    environment variables and validate them; ``None`` means a plain single-process run.

    Pure apart from reading ``env`` (default ``os.environ``), so it is testable without JAX.

    * Nothing set and ``auto`` false: ``None``.
    * ``auto``: JAX detects whatever is unset (TPU pod slices, SLURM, Open MPI); any given field
      is still validated and passed on.
    * Otherwise all three of coordinator, process count and process id are required: a
      partial set is almost always a launcher bug, and JAX would fail with a less direct error.
    * ``num_processes == 1`` (with ``process_id == 0``) is a single-process run: ``None``.

    Raises:
      ValueError: a missing, malformed or out-of-range field, naming ``distributed.<field>``
        and its environment variable.
    """
    env = os.environ if env is None else env
    if coordinator_address is None:
        coordinator_address = env.get(ENV_COORDINATOR, "").strip() or None
    if num_processes is None:
        num_processes = _env_int(env, ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(env, ENV_PROCESS_ID)
    fields = {"coordinator_address": (coordinator_address, ENV_COORDINATOR),
              "num_processes": (num_processes, ENV_NUM_PROCESSES),
              "process_id": (process_id, ENV_PROCESS_ID)}
    given = [k for k, (v, _) in fields.items() if v is not None]
    if not given and not auto:
        if local_device_ids is not None:
            raise ValueError("distributed.local_device_ids is set but no multi-process run is "
                             "configured (set distributed.coordinator_address, num_processes and "
                             "process_id, or distributed.auto)")
        return None
    if not auto:
        for k, (v, var) in fields.items():
            if v is None:
                raise ValueError(f"distributed.{k} (or ${var}) is required when "
                                 f"distributed.{given[0]} is set (or set distributed.auto to let "
                                 "JAX detect the cluster)")
    if coordinator_address is not None:
        _check_address(coordinator_address)
    if num_processes is not None:
        num_processes = _check_int(num_processes,
                                   f"distributed.num_processes (or ${ENV_NUM_PROCESSES})", 1)
    if process_id is not None:
        process_id = _check_int(process_id, f"distributed.process_id (or ${ENV_PROCESS_ID})", 0)
        if num_processes is not None and process_id >= num_processes:
            raise ValueError(f"distributed.process_id (or ${ENV_PROCESS_ID}) must be in "
                             f"0..{num_processes - 1} (distributed.num_processes = "
                             f"{num_processes}); got {process_id}")
    if local_device_ids is not None:
        ids = [local_device_ids] if isinstance(local_device_ids, int) else list(local_device_ids)
        local_device_ids = tuple(_check_int(i, "distributed.local_device_ids[]", 0) for i in ids)
    if num_processes == 1 and not auto:
        return None
    return DistributedSettings(coordinator_address, num_processes, process_id,
                               local_device_ids, bool(auto))


def _backends_initialized() -> bool:
    """Whether XLA backends already exist (then ``jax.distributed`` can no longer join them).

    JAX exposes this only privately (``jax._src.xla_bridge.backends_are_initialized`` in 0.10);
    if that moves, assume not and let ``jax.distributed.initialize`` raise its own error.
    """
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover - private API moved
        return False


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids: Any = None,
               auto: bool = False, initialization_timeout: int | None = None,
               env: Mapping[str, str] | None = None) -> bool:
    """Join this process to a multi-process JAX job; ``True`` if it is one, ``False`` otherwise.

    Must run before anything touches a JAX backend (``jax.devices()``, creating an array,
    initialising a model): the device list of a multi-process job is assembled when the backend
    starts, so joining later is impossible. The keyword names match the YAML ``distributed:``
    section (``initialize(**cfg.distributed)``); unset fields come from ``$JAXRL_COORDINATOR``,
    ``$JAXRL_NUM_PROCESSES`` and ``$JAXRL_PROCESS_ID``; ``auto=True`` lets JAX detect the
    cluster (TPU pod slices, SLURM, Open MPI). See :func:`resolve_settings` for the rules.

    Cross-process collectives on CPU need a CPU collectives implementation; if none is
    configured, ``gloo`` is selected (it is JAX 0.10's default, older versions had none). It only
    affects the CPU client, so it is harmless on accelerator hosts.

    Idempotent: once ``jax.distributed`` is up, later calls return ``True`` without doing
    anything (after checking that any explicit process count / id agrees with the running job).

    Raises:
      ValueError: invalid settings (see :func:`resolve_settings`), or settings that disagree
        with an already-initialised job.
      RuntimeError: JAX backends were initialised before this call.
    """
    settings = resolve_settings(coordinator_address, num_processes, process_id,
                                local_device_ids=local_device_ids, auto=auto, env=env)
    if jax.distributed.is_initialized():
        if settings is not None:
            for field, want, have in (("num_processes", settings.num_processes,
                                       jax.process_count()),
                                      ("process_id", settings.process_id, jax.process_index())):
                if want is not None and want != have:
                    raise ValueError(f"distributed.{field} = {want}, but this process already "
                                     f"joined a job with {field} = {have}")
        return True
    if settings is None:
        return False
    if _backends_initialized():
        raise RuntimeError(
            "jaxrl_agent.sharding.multihost.initialize() must be called before any JAX "
            "computation (jax.devices(), creating arrays, model init): the JAX backend is "
            "already running, so this process can no longer join a multi-process job. Call it "
            "first thing in the entry point.")
    if not jax.config.jax_cpu_collectives_implementation:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = settings.kwargs()
    if initialization_timeout is not None:
        kwargs["initialization_timeout"] = int(initialization_timeout)
    jax.distributed.initialize(**kwargs)
    return True


# ---------------------------------------------------------------------------------------------
# who am I, what is mine


def is_main_process() -> bool:
    """Process 0: the one that logs, prints and writes single-writer files."""
    return jax.process_index() == 0


def process_share(items: Sequence, index: int | None = None, count: int | None = None) -> list:
    """This process's contiguous share of ``items`` (e.g. the tasks of a step).

    Contiguous blocks (the first ``len % count`` blocks get one extra item, like
    ``np.array_split``) rather than a strided split: concatenating the per-process results in
    process order -- exactly what :func:`allgather_objects` returns -- restores the original
    order, even when an item yields a variable number of results (a task -> several rollouts).
    Shares differ by at most one item; some are empty when there are fewer items than processes.

    ``index`` / ``count`` default to this process's index and the process count.
    """
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"process_share: need 0 <= index < count; got index={index}, "
                         f"count={count}")
    base, extra = divmod(len(items), count)
    start = index * base + min(index, extra)
    stop = start + base + (1 if index < extra else 0)
    return list(items[start:stop])


def sync_hosts(name: str) -> None:
    """Barrier: return once every process reached ``sync_hosts(name)`` (same name everywhere;
    a mismatch raises). A no-op in a single process."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ---------------------------------------------------------------------------------------------
# exchanging data


def allgather_objects(obj: Any) -> list:
    """Every process's ``obj``, in process order, on every process (collective).

    For small host-side data such as rollout records (dicts of ints, floats, strings, lists).
    Objects travel as pickles: unlike JSON they keep tuples, int dict keys, numpy arrays and
    exact floats, and every process runs the same trusted program, so unpickling is safe here.
    Two device all-gathers: the byte lengths, then the bytes padded to the longest.
    A single process gets ``[obj]`` (the object itself, not a copy) without any collective.
    """
    if jax.process_count() == 1:
        return [obj]
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    if payload.size >= 2 ** 31:
        raise ValueError(f"allgather_objects: object pickles to {payload.size} bytes; the limit "
                         "is 2 GiB (send large arrays as jax.Arrays instead)")
    sizes = multihost_utils.process_allgather(np.array([payload.size], np.int32), tiled=True)
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    padded = np.zeros(max(int(sizes.max()), 1), np.uint8)
    padded[:payload.size] = payload
    rows = np.asarray(multihost_utils.process_allgather(padded, tiled=False))
    return [pickle.loads(rows[i, :n].tobytes()) for i, n in enumerate(sizes)]


def global_array(value: Any, sharding: Sharding) -> jax.Array:
    """A ``jax.Array`` with ``sharding`` whose value is ``value``, the same full (global) host
    array on every process.

    Each process places only the shards its own devices hold, sliced from ``value``: every host
    packs the identical global batch (same records after :func:`allgather_objects`, same
    deterministic packing), so no data crosses hosts. Passing different values on different
    hosts silently gives an array whose shards disagree -- keep the packing deterministic.
    64-bit inputs are narrowed as JAX would (unless ``jax_enable_x64``). A ``jax.Array`` that
    already spans hosts is resharded with ``jax.device_put``.
    """
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return jax.device_put(value, sharding)
    arr = np.asarray(value)
    arr = arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype), copy=False)
    return jax.make_array_from_callback(arr.shape, sharding, lambda index: arr[index])


def global_tree(tree: Any, shardings: Sharding | Any) -> Any:
    """:func:`global_array` over a pytree; ``shardings`` is one ``Sharding`` for every leaf or
    a tree of them whose structure is a prefix of ``tree`` (one sharding per subtree)."""
    if isinstance(shardings, Sharding):
        return jax.tree.map(lambda x: global_array(x, shardings), tree)
    is_sharding = lambda s: isinstance(s, Sharding)  # noqa: E731
    return jax.tree.map(lambda s, sub: jax.tree.map(lambda x: global_array(x, s), sub),
                        shardings, tree, is_leaf=is_sharding)


def _identity(x):
    return x


def _full_value(x: Any) -> np.ndarray:
    """The global value of one leaf as numpy, on this host.

    * host values and arrays this process fully holds: copied to host as they are;
    * cross-host arrays replicated everywhere: the local copy, no communication;
    * cross-host sharded arrays: resharded to replicated on the array's own devices by a jitted
      identity (collective), then the local copy is read. One leaf at a time, so the extra
      device memory peaks at one full leaf, not a full model (``process_allgather`` does the
      same per leaf; it is not used directly because it needs a ``NamedSharding`` or treats
      fully-addressable arrays as per-host pieces to concatenate).
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    if isinstance(x.sharding, NamedSharding):
        out = jax.jit(_identity, out_shardings=x.sharding.update(spec=P()))(x)
        return np.asarray(out.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def broadcast_from_main(tree: Any) -> Any:
    """Process 0's value of a pytree of host arrays, on every process (collective); the tree
    itself in a single process. For state every process computed on its own (the supervised
    warm-up), so "replicated" copies can never silently disagree."""
    if jax.process_count() == 1:
        return tree
    return multihost_utils.broadcast_one_to_all(tree)


def agree(value: Any) -> Any:
    """Process 0's value of a small Python object on every process (collective; the value
    itself in a single process). Decisions taken from a shared file system (which checkpoint
    to resume, whether one exists) are agreed on before anyone acts on them."""
    if jax.process_count() == 1:
        return value
    return allgather_objects(value)[0]


def host_gather(tree: Any) -> Any:
    """The full value of every leaf of ``tree`` as numpy, on every process.

    For the sampler's weight sync and for logging metrics computed on sharded arrays. Collective
    when some leaf is sharded across hosts (every process must call it with the same tree
    structure); in a single process it is ``jax.device_get``.
    """
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.asarray(x), jax.device_get(tree))
    return jax.tree.map(_full_value, tree)
