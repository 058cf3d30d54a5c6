"""Helpers the tests that start processes share: a free localhost port, the environment of a
child process on host CPU devices, and waiting for several children."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on localhost that is free now."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def child_env(devices: int | None, **extra) -> dict:
    """This process's environment without its JAXRL_ settings, for a child on ``devices`` host
    CPU devices (None: one) that imports this checkout, plus ``extra``. The child keeps the
    suite's quick-compile XLA flags (``conftest.py``): the same numbers, compiled sooner."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXRL_")}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               **extra)
    return env


def wait_all(procs, timeout: float) -> list:
    """The exit codes of ``procs`` within ``timeout`` seconds in all (a last "timeout" when time
    runs out); the processes still running then are killed."""
    start, codes = time.monotonic(), []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, timeout - (time.monotonic() - start))))
    except subprocess.TimeoutExpired:
        codes.append("timeout")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes
