"""Training metrics: a crash-safe JSONL log, TensorBoard scalars and a live progress line.

``MetricsLogger(directory, total_steps=...)`` writes, for every ``log(step, metrics)``:

- one JSON line ``{"step": step, "time": unix_time, **metrics}`` appended to
  ``directory/metrics.jsonl``, flushed and ``os.fsync``-ed, so a crash loses nothing already
  logged. Non-finite floats are written as ``null`` and their names listed under
  ``"nonfinite"`` (the file stays strict JSON);
- every finite numeric metric as a TensorBoard scalar (tag = key) under ``directory/tb``;
- a progress line on ``stream`` (default ``sys.stderr``): a ``\\r``-redrawn bar on a terminal,
  a plain line every ``print_every_s`` seconds (and on the first and last step) otherwise.

Resuming: ``resume_from_step=k`` keeps only the lines with ``step <= k`` (and drops a corrupt,
half-written last line), and tells TensorBoard to purge events after ``k``, so that the logs of
a resumed run equal those of an uninterrupted one (up to the ``time`` field). Without
``resume_from_step`` an existing ``metrics.jsonl`` is overwritten and old TensorBoard event
files under ``directory/tb`` are removed: the directory holds one run.

Pure Python + numpy; JAX scalars are accepted (converted through ``numpy.asarray``).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Mapping

import numpy as np

__all__ = ["MetricsLogger", "read_metrics", "DEFAULT_PROGRESS_KEYS"]

#: display name -> metric key of the fields on the progress line (shown only once logged).
#: A display name ending in "/s" is a rate, shown after its value ("2.1e3 tok/s").
DEFAULT_PROGRESS_KEYS = {
    "reward": "train/reward",
    "success": "train/success",
    "eval": "eval/success",
    "entropy": "train/entropy",         # of the sampling policy, nats per action token
    "zero-adv": "train/group_zero_frac",  # groups that teach nothing (all rollouts alike)
    "clip": "train/clip_fraction",      # 0 unless the ratio moves (ppo_epochs, mini_batches)
    "moved": "train/kl_after_update",   # KL(rollout policy || after the step): metrics.policy_drift
    "tok/s": "train/tokens_per_s",
    # shown only while non-zero: what a run should not be doing, and the schedule
    "env-errors": "train/env_errors",   # trajectories ended by an env / reward exception
    "invalid": "train/invalid",         # invalid actions per trajectory
    "truncated": "train/response_truncated_frac",  # replies cut at rollout.max_new_tokens
    "kl": "train/loss_kl",
    "lag": "async/lag_mean",
    "lr": "train/lr",
}
#: progress fields left out while their value is 0
_ONLY_NONZERO = ("env-errors", "invalid", "truncated", "kl", "lag", "clip")

_RESERVED = ("step", "time", "nonfinite")
_BAR_WIDTH = 20
_TTY_REDRAW_S = 0.1  # at most ~10 redraws a second on a terminal (first and last always)


# ----------------------------------------------------------------------------- reading


def _parse_lines(text: str, path) -> list[tuple[str, dict]]:
    """(raw line, parsed row) for every non-empty line; a corrupt *last* line is dropped."""
    lines = text.split("\n")
    # only the last non-empty line may be a half-written crash leftover
    nonempty = [i for i, ln in enumerate(lines) if ln.strip()]
    out = []
    for i in nonempty:
        try:
            row = json.loads(lines[i])
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not a metrics row")
        except ValueError as err:
            if i == nonempty[-1]:
                break  # crash mid-write: drop it
            raise ValueError(f"{path}: line {i + 1} is not a metrics row: {err}") from None
        out.append((lines[i], row))
    return out


def read_metrics(path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` file (a directory means ``directory/metrics.jsonl``).

    A corrupt last line (a crash in the middle of a write) is skipped; a corrupt line anywhere
    else raises ``ValueError`` naming its line number. Non-finite values read back as ``None``
    (their names are in the row's ``"nonfinite"`` list).
    """
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return [row for _, row in _parse_lines(path.read_text(encoding="utf-8"), path)]


# ----------------------------------------------------------------------------- values


def _scalar(key: str, value):
    """A JSON-ready python scalar (int, float, bool or str) from ``value``, or TypeError."""
    if isinstance(value, (bool, int, float, str)):
        return value
    try:
        arr = np.asarray(value)
    except Exception as err:  # noqa: BLE001 -- any failure means "not a scalar"
        raise TypeError(f"metric {key!r}: cannot convert {type(value).__name__} to a scalar: "
                        f"{err}") from None
    if arr.ndim != 0:
        raise TypeError(f"metric {key!r} must be a scalar, got an array of shape {arr.shape}; "
                        "reduce it (mean, sum, ...) before logging")
    kind = arr.dtype.kind
    if kind == "b":
        return bool(arr)
    if kind in "iu":
        return int(arr)
    if kind == "f" or (kind == "V" and "float" in arr.dtype.name):  # incl. bfloat16
        # a float32 0.41 is written "0.41", not 0.4099999964237213
        return float(str(arr[()])) if arr.dtype.itemsize < 8 else float(arr)
    raise TypeError(f"metric {key!r} must be a number (or a string), got {type(value).__name__} "
                    f"of dtype {arr.dtype}")


# ----------------------------------------------------------------------------- formatting


def _clock_str(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _value_str(name: str, v) -> str:
    if isinstance(v, str):
        return f"{name} {v}"
    if name.endswith("/s"):  # a rate: compact, unit after the value
        text = f"{v:.1e}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")
        return f"{text} {name}"
    if isinstance(v, int) or (abs(v) >= 100 and float(v).is_integer()):
        return f"{name} {int(v)}"
    if 0 < abs(v) < 5e-3:  # a learning rate, a tiny KL: keep its digits
        return f"{name} {v:.1e}".replace("e-0", "e-")
    return f"{name} {v:.2f}" if abs(v) < 100 else f"{name} {v:.4g}"


# ----------------------------------------------------------------------------- the logger


class MetricsLogger:
    """JSONL + TensorBoard + progress-line logger of one training run (see the module doc).

    Args:
      directory: the run's metrics directory (created).
      total_steps: the last step of the run (for the bar, percentage and ETA).
      tensorboard: write TensorBoard event files under ``directory/tb``.
      wandb: keyword arguments of ``wandb.init`` (project, name, config, ...) to log every row
        to Weights & Biases as well (the ``[wandb]`` extra); None (default) = no W&B. The run's
        id is derived from ``directory``, so a resumed run continues the same W&B run.
      progress: print the progress line; ``False`` prints nothing at all (``event`` included).
      stream: where the progress goes (default ``sys.stderr``).
      resume_from_step: continue a run whose last checkpoint is at this step.
      print_every_s: on a non-terminal stream, print a plain line at most this often (plus the
        first and the last step).
      progress_keys: display name -> metric key of the progress fields (default
        ``DEFAULT_PROGRESS_KEYS``). A field keeps its last logged value (e.g. "eval" between
        evaluations).

    Usable as a context manager; ``close()`` is idempotent.
    """

    def __init__(self, directory, *, total_steps: int, tensorboard: bool = True,
                 wandb: Mapping | None = None,
                 progress: bool = True, stream=None, resume_from_step: int | None = None,
                 print_every_s: float = 10.0, progress_keys: Mapping[str, str] | None = None):
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "metrics.jsonl"
        self.total_steps = int(total_steps)
        self.resume_from_step = resume_from_step
        self.print_every_s = float(print_every_s)
        self.progress_keys = dict(DEFAULT_PROGRESS_KEYS if progress_keys is None
                                  else progress_keys)
        self._stream = (sys.stderr if stream is None else stream) if progress else None
        self._tty = bool(self._stream is not None and getattr(self._stream, "isatty", None)
                         and self._stream.isatty())
        self._clock = time.monotonic

        if resume_from_step is not None:
            self._truncate(int(resume_from_step))
        self._file = open(self.path, "a" if resume_from_step is not None else "w",
                          encoding="utf-8")

        self._tb = None
        if tensorboard:
            self._tb = self._open_tensorboard()
        self._wandb = None if wandb is None else self._open_wandb(dict(wandb))

        self._start_time = self._clock()
        self._start_step = 0 if resume_from_step is None else int(resume_from_step)
        self._shown: dict[str, object] = {}  # display name -> last value
        self._last_step: int | None = None
        self._last_print: float | None = None  # clock of the last drawn/printed line
        self._printed_last = False  # the last logged step is on screen (non-TTY)
        self._bar_len = 0  # length of the bar currently on the terminal line (0: none)
        self._closed = False

    # -- files

    def _truncate(self, step: int) -> None:
        """Keep the lines with ``step <= step`` (and no corrupt tail), atomically."""
        if not self.path.exists():
            return
        rows = _parse_lines(self.path.read_text(encoding="utf-8"), self.path)
        kept = "".join(line + "\n" for line, row in rows if row["step"] <= step)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def _open_tensorboard(self):
        from tensorboardX import SummaryWriter  # imported lazily: it is slow to import

        tb_dir = self.directory / "tb"
        if self.resume_from_step is None and tb_dir.is_dir():
            for old in tb_dir.glob("events.out.tfevents.*"):
                old.unlink()  # a fresh run: the directory holds one run
        purge = None if self.resume_from_step is None else int(self.resume_from_step) + 1
        # tensorboardX names files by the second: a nanosecond suffix keeps a resume started
        # in the same second from overwriting the earlier file, and keeps the names in order
        return SummaryWriter(logdir=str(tb_dir), purge_step=purge,
                             filename_suffix=f".{time.time_ns()}")

    def _open_wandb(self, kwargs: dict):
        import hashlib

        import wandb  # the [wandb] extra; config validation says so when it is missing

        run_id = hashlib.sha1(str(self.directory.resolve()).encode()).hexdigest()[:16]
        return wandb.init(**{"id": run_id, "resume": "allow", "dir": str(self.directory),
                             **kwargs})

    # -- logging

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` at ``step``: JSONL line (fsync-ed), TensorBoard, progress."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log after close()")
        step = int(step)
        row: dict[str, object] = {"step": step, "time": time.time()}
        nonfinite = []
        for key, value in metrics.items():
            if key in _RESERVED:
                raise ValueError(f"metric name {key!r} is reserved (reserved: {_RESERVED})")
            v = _scalar(key, value)
            if isinstance(v, float) and not math.isfinite(v):
                nonfinite.append(key)
                v = None
            row[key] = v
        if nonfinite:
            row["nonfinite"] = nonfinite

        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

        if self._tb is not None:
            for key, v in row.items():
                if key in _RESERVED or v is None or isinstance(v, str):
                    continue
                self._tb.add_scalar(key, float(v), step)

        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items()
                             if k not in _RESERVED and v is not None and not isinstance(v, str)},
                            step=step)

        if self._stream is not None:
            self._progress(step, row)

    def text(self, step: int, tag: str, text: str) -> None:
        """A text (markdown) entry for TensorBoard's Text tab at ``step`` (nothing without
        TensorBoard; the console and metrics.jsonl do not get it)."""
        if self._tb is not None:
            self._tb.add_text(tag, text, step)

    def event(self, text: str) -> None:
        """Print a message line without breaking the progress bar (which is redrawn below)."""
        if self._stream is None:
            return
        if self._tty and self._bar_len:
            self._stream.write("\r" + " " * self._bar_len + "\r" + text + "\n")
            self._bar_len = 0
            self._draw(self._line(bar=True))
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def close(self) -> None:
        """Flush and close the files; end the progress line."""
        if self._closed:
            return
        self._closed = True
        self._file.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._stream is not None and self._last_step is not None:
            if self._tty:
                self._draw(self._line(bar=True))  # the final state, even if throttled
                self._stream.write("\n")
                self._bar_len = 0
            elif not self._printed_last:
                self._stream.write(self._line(bar=False) + "\n")
            self._stream.flush()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- progress

    def _progress(self, step: int, row: Mapping[str, object]) -> None:
        first = self._last_step is None
        self._last_step = step
        for name, key in self.progress_keys.items():
            if row.get(key) is not None:
                self._shown[name] = row[key]
        now = self._clock()
        last = step >= self.total_steps
        due = (self._last_print is None
               or now - self._last_print >= (_TTY_REDRAW_S if self._tty else self.print_every_s))
        if not (first or last or due):
            self._printed_last = False
            return
        self._last_print = now
        if self._tty:
            self._draw(self._line(bar=True))
        else:
            self._stream.write(self._line(bar=False) + "\n")
            self._printed_last = True
        self._stream.flush()

    def _draw(self, line: str) -> None:
        pad = max(0, self._bar_len - len(line))
        self._stream.write("\r" + line + " " * pad)
        self._bar_len = len(line)

    def _line(self, *, bar: bool) -> str:
        step, total = self._last_step, self.total_steps
        frac = min(1.0, max(0.0, step / total)) if total > 0 else 1.0
        head = f"step {step}/{total}"
        if bar:
            filled = int(frac * _BAR_WIDTH)
            arrow = ">" if filled < _BAR_WIDTH else ""
            body = ("=" * filled + arrow).ljust(_BAR_WIDTH)[:_BAR_WIDTH]
            head += f" [{body}]"
        parts = [f"{head} {frac * 100:3.0f}%"]
        parts += [_value_str(name, self._shown[name]) for name in self.progress_keys
                  if name in self._shown and not (name in _ONLY_NONZERO
                                                  and not self._shown[name])]
        elapsed = self._clock() - self._start_time
        done = step - self._start_step
        eta = elapsed / done * max(0, total - step) if done > 0 else None
        parts.append(f"{_clock_str(elapsed)}<{_clock_str(eta) if eta is not None else '?'}")
        return " | ".join(parts)
