"""Rollout workers that run ahead of the trainer under a staleness bound.

``RolloutWorkers(collect, workers=W, max_lag=L, first_step=s0, last_step=S)`` starts ``W``
threads. Each takes the next step index ``s`` in order, waits until the trainer's policy
version is at least ``s - L`` (``advance(version)``), then calls ``collect(s)`` and keeps its
result for ``get(s)``. The trainer trains step ``s`` at version ``s``, so every token it trains
on was sampled by a policy at most ``L`` versions old: the gate bounds staleness by
construction, and the trainer's own check (``refuse_stale``) only guards against a clock that
went wrong. ``L = 1`` overlaps the next step's rollouts with the current update; ``L = 2`` lets
two steps' rollouts run at once (useful when the environment, not the model, is slow).

The sampler's weights change under a running collection when the trainer syncs: a turn
sampled after the sync is sampled (and stamped, ``policy_version``) by the new weights, the
turns before it by the old ones - a partial rollout, each turn tagged with its own version.
Samplers snapshot their weights once per ``generate`` call, so the tokens of one turn always
come from one version.

Results are delivered in step order whatever order the threads finish in; a worker's exception
is raised by the ``get`` of its step. ``close()`` stops the threads (a collection in progress
finishes first; threads are daemons, so a hung environment cannot keep the process alive).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["RolloutWorkers"]


class RolloutWorkers:
    """Background rollouts for steps ``first_step .. last_step - 1`` (module docstring).

    Args:
      collect: ``collect(step) -> result`` (e.g. ``(records, stats)``), called from a worker
        thread; it must be safe to call from several threads at once.
      workers: number of threads (>= 1); at most ``max_lag`` of them can be ahead of the
        trainer at a time, so more than ``max_lag`` only helps while steps wait in the queue.
      max_lag: ``L >= 1``: step ``s`` starts once the policy version is ``>= s - L``.
      first_step, last_step: the steps to collect (``range(first_step, last_step)``).
      version: the policy version at start (the trainer's ``state.step``).
    """

    def __init__(self, collect: Callable[[int], Any], *, workers: int, max_lag: int,
                 first_step: int, last_step: int, version: int):
        if workers < 1 or max_lag < 1:
            raise ValueError(f"RolloutWorkers needs workers >= 1 and max_lag >= 1, got "
                             f"workers={workers}, max_lag={max_lag}")
        self._collect = collect
        self.max_lag = int(max_lag)
        self._next = int(first_step)
        self._last = int(last_step)
        self._version = int(version)
        self._results: dict[int, tuple[bool, Any, float]] = {}
        self._cond = threading.Condition()
        self._stop = False
        #: seconds ``get`` waited for a result (the trainer idle, waiting on rollouts)
        self.wait_s = 0.0
        self._threads = [threading.Thread(target=self._work, name=f"rollout-{i}", daemon=True)
                         for i in range(int(workers))]
        for t in self._threads:
            t.start()

    # --------------------------------------------------------------------- trainer side

    def advance(self, version: int) -> None:
        """The trainer's policy version is now ``version`` (call after each weight sync)."""
        with self._cond:
            self._version = max(self._version, int(version))
            self._cond.notify_all()

    def get(self, step: int, timeout: float | None = None):
        """The result of ``collect(step)``, waiting for it; re-raises the worker's exception.
        ``step`` must be the next undelivered one (results come in step order)."""
        t0 = time.perf_counter()
        with self._cond:
            while step not in self._results:
                if self._stop:
                    raise RuntimeError("rollout workers are closed")
                if not any(t.is_alive() for t in self._threads):
                    raise RuntimeError(f"rollout workers stopped before step {step}")
                if not self._cond.wait(timeout=1.0 if timeout is None else timeout) and \
                        timeout is not None:
                    raise TimeoutError(f"no rollouts for step {step} after {timeout} s")
            ok, value, _ = self._results.pop(step)
        self.wait_s += time.perf_counter() - t0
        if not ok:
            raise value
        return value

    def close(self, timeout: float = 5.0) -> None:
        """Stops the threads: no new collection starts; each running one finishes (joined for
        at most ``timeout`` seconds in all)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        end = time.perf_counter() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.perf_counter()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --------------------------------------------------------------------- worker side

    def _take(self) -> int | None:
        """The next step to collect once the staleness gate lets it start, or None (done or
        stopped)."""
        with self._cond:
            if self._stop or self._next >= self._last:
                return None
            s = self._next
            self._next += 1
            while not self._stop and self._version < s - self.max_lag:
                self._cond.wait()
            return None if self._stop else s

    def _work(self) -> None:
        while True:
            s = self._take()
            if s is None:
                return
            try:
                result = (True, self._collect(s), time.perf_counter())
            except BaseException as e:  # delivered to the trainer by get(s)
                result = (False, e, time.perf_counter())
            with self._cond:
                self._results[s] = result
                self._cond.notify_all()
            if not result[0]:
                return
