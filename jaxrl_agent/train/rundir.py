"""A run's directory: the lock that keeps it to one process, what of a run it holds, the
resolved config written into it, and finding a run (and its config) from a path or a name.

The ``Trainer`` (``train.loop``) takes the directory before anything in it is opened; ``eval``,
``show`` and ``--resume`` find runs here.
"""

from __future__ import annotations

import os

from jaxrl_agent import config as config_lib
from jaxrl_agent import run_checks

__all__ = ["LORA_BASE", "RunLockedError", "existing_outputs", "find_run", "lock_run_dir",
           "never_trained", "run_config", "write_config"]


class RunLockedError(ValueError):
    """Another live process is training in the same run directory."""


def lock_run_dir(directory):
    """An exclusive advisory lock on ``directory/.lock`` held for the trainer's lifetime (the OS
    drops it when the process dies), so two processes never write one run directory. Taken
    before anything in the directory is opened, created or cleaned."""
    import fcntl

    try:
        os.makedirs(directory, exist_ok=True)
        f = open(os.path.join(directory, ".lock"), "a+")
    except OSError as e:
        raise config_lib.ConfigError(f"cannot write the run directory {directory!r}: "
                                     f"{e.strerror or e}; choose another run.dir or name") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RunLockedError(f"another process is training in {directory!r}; wait for it, stop "
                             "it, or start another run (--set name=NEW)") from None
    return f


def existing_outputs(root: str) -> list[str]:
    """What of a run lives in ``root`` (config, checkpoints, metrics, exported models)."""
    return [n for n in config_lib.RunPaths.OUTPUTS if os.path.exists(os.path.join(root, n))]


def never_trained(root: str) -> bool:
    """The run in ``root`` stopped before it saved anything but its config and metrics: no
    checkpoint, no exported model (a start that failed; nothing in it is work to keep)."""
    ck = os.path.join(root, "checkpoints")
    return (not (os.path.isdir(ck) and os.listdir(ck))
            and not any(os.path.exists(os.path.join(root, n))
                        for n in ("final_model", "warmup_model")))


def write_config(cfg, path: str) -> None:
    """The resolved config as YAML, written atomically (a temporary file, then a rename)."""
    tmp = f"{path}.tmp"
    config_lib.dump_yaml(cfg, tmp)
    os.replace(tmp, path)


#: a LoRA run's base after its warm-up (checkpoints hold the adapters, not the base)
LORA_BASE = "lora_base"


def find_run(run) -> str:
    """The run directory that ``run`` names: a path to a run directory (one holding
    ``config.yaml``), the ``checkpoints`` folder inside one, or a run name (``runs/<name>``).
    ``ConfigError`` saying what was looked for otherwise."""
    run = os.fspath(run)
    candidates = [run]
    if os.path.basename(os.path.normpath(run)) == "checkpoints":
        candidates.append(os.path.dirname(os.path.normpath(run)))
    if os.sep not in run and not os.path.exists(run):
        candidates.append(os.path.join("runs", run))
    for c in candidates:
        if os.path.isfile(os.path.join(c, "config.yaml")):
            return c
    raise config_lib.ConfigError(
        f"{run!r} is not a run: no config.yaml in {' or '.join(map(repr, candidates))} (give a "
        f"run directory, e.g. runs/cpu_default, or a run name)")


def run_config(run, overrides=()) -> config_lib.RunConfig:
    """The config a run was started with (``<run>/config.yaml``), ``overrides`` applied, with
    ``run.dir`` pointing at where the run is now."""
    root = find_run(run)
    d = config_lib.read_yaml(os.path.join(root, "config.yaml"))
    d = config_lib.apply_overrides(d, overrides)
    d["run"] = dict(d.get("run") or {}, dir=root)
    return run_checks.from_dict(d)

