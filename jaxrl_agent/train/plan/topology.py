"""The device topologies ``jaxrl-agent plan`` compiles for, with no device present.

``topology_devices("v5e:2x4")`` gives abstract TPU devices through libtpu (the ``tpu-aot``
extra; JAX compiles for the topology on a CPU-only host through
``jax.experimental.topologies.get_topology_desc``), ``"cpu:N"`` N host devices; ``chip_kind``
reads the chip of a topology name, ``HBM_GIB`` its memory and ``HBM_BANDWIDTH`` its
memory bandwidth. A mistake the user can fix is a
``PlanError`` (one message, no traceback)."""

from __future__ import annotations

import contextlib
import math
import os
import tempfile

import jax


#: HBM per chip in GiB (Google Cloud TPU system architecture pages).
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}

#: HBM bandwidth per chip in bytes/s (the same pages: 1,200 / 819 / 2,765 / 1,640 GB/s)
HBM_BANDWIDTH = {"v4": 1200e9, "v5e": 819e9, "v5p": 2765e9, "v6e": 1640e9}


_KIND_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v5": "v5p"}


#: cores per chip in the accelerator-type names (v4-32 is 16 chips; v5e/v6e count chips)
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}


_ACCEL_PREFIX = {"v4": "v4", "v5p": "v5p", "v5e": "v5litepod", "v6e": "v6e"}


class PlanError(ValueError):
    """A mistake the user can fix (unknown topology, a mesh that does not fit the devices,
    libtpu missing, no model shapes): one clear message, no traceback."""


def chip_kind(topology: str) -> str | None:
    """``"v5e"`` for ``"v5e:2x4"`` (also ``v5litepod``), ``"cpu"`` for ``cpu:N``; None when the
    prefix is not a known chip."""
    head = topology.split(":", 1)[0].strip().lower()
    if head == "cpu":
        return "cpu"
    head = _KIND_ALIASES.get(head, head)
    return head if head in HBM_GIB else None


def _cpu_devices(n: int) -> list:
    """``n`` host CPU devices: asks JAX for them when its CPU backend has not started yet."""
    if n < 1:
        raise PlanError(f"--topology cpu:{n}: need at least one device")
    try:
        if jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend is already up: use what it has
        pass
    have = jax.devices("cpu")
    if len(have) < n:
        raise PlanError(f"--topology cpu:{n}: this process has {len(have)} CPU devices (JAX "
                        "started before the plan could ask for more); set XLA_FLAGS="
                        f"--xla_force_host_platform_device_count={n}")
    return list(have[:n])


def _chips(topology: str) -> int:
    dims = topology.split(":", 1)[1] if ":" in topology else ""
    try:
        return math.prod(int(x) for x in dims.lower().split("x"))
    except ValueError:
        return 0


@contextlib.contextmanager
def _quiet_stderr():
    """libtpu writes warnings to file descriptor 2 while it starts; keep them, and hand them
    back only when something fails (``buf[0]``)."""
    buf = [""]
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield buf
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            buf[0] = tmp.read().decode("utf-8", "replace")


def _tpu_env(topology: str, kind: str) -> None:
    """The TPU_* variables libtpu looks for on a TPU VM (unset on a CPU host): set quietly so it
    does not warn or try the metadata server. Values already set are kept."""
    chips = _chips(topology)
    if chips:
        os.environ.setdefault("TPU_ACCELERATOR_TYPE",
                              f"{_ACCEL_PREFIX[kind]}-{chips * _CORES_PER_CHIP[kind]}")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # compiling only: no chip is opened, so several processes may load libtpu at once (without
    # this the second one fails on libtpu's lock file)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def libtpu_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


INSTALL_HINT = ('compiling for TPU needs libtpu: pip install -e ".[tpu-aot]" (or pip install '
                f'"jax[tpu]=={jax.__version__}"); no TPU is needed')


def topology_devices(topology: str) -> list:
    """The devices of ``topology``: ``cpu:N`` host devices, or the abstract devices of a TPU
    slice that libtpu knows (``v5e:2x2``, ``v5p:2x2x1``, ``v4:2x2x4``, ``v6e:2x4``, ...).

    Raises:
      PlanError: an unknown name, or libtpu not installed (with how to install it).
    """
    name = topology.strip()
    kind = chip_kind(name)
    if kind == "cpu":
        try:
            n = int(name.split(":", 1)[1]) if ":" in name else 1
        except ValueError:
            raise PlanError(f"--topology {name!r}: expected cpu:N, e.g. cpu:8") from None
        return _cpu_devices(n)
    if kind is None or not _chips(name):
        raise PlanError(f"unknown topology {name!r}: use cpu:N or a TPU slice such as "
                        "v5e:2x2, v5e:2x4, v5p:2x2x1, v4:2x2x4, v6e:2x4 "
                        f"(chips: {', '.join(HBM_GIB)})")
    if not libtpu_available():
        raise PlanError(f"--topology {name}: {INSTALL_HINT}")
    _tpu_env(name, kind)
    from jax.experimental import topologies

    with _quiet_stderr() as log:
        try:
            # v4 / v5p chips have two TensorCores; JAX meshes want one device per chip
            chip_config = "megacore" if kind in ("v4", "v5p") else "default"
            desc = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                                chip_config_name=chip_config)
            err = None
        except Exception as e:  # libtpu's errors are JaxRuntimeError / ValueError
            err = e
    if err is not None:
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "INVALID_ARGUMENT" in detail or "Invalid" in detail or "topology" in detail.lower():
            raise PlanError(f"libtpu does not know the topology {name!r} ({detail}); examples: "
                            "v5e:2x2, v5e:2x4, v5p:2x2x1, v4:2x2x4, v6e:2x4")
        raise PlanError(f"libtpu could not describe the topology {name!r}: {detail}")
    del log
    return list(desc.devices)
