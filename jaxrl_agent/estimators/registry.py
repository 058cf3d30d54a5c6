"""Estimators by name, for configs and the CLI. The names are a public contract."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

import jax

from jaxrl_agent.batch import TrajectoryBatch


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: Callable
    stateful: bool = False  # takes state= and returns (Advantages, new_state)
    init_state: Callable | None = None  # init_state(num_tasks) for stateful estimators
    check_state: Callable | None = None  # host-side check_state(batch, state)

    @property
    def hyper_params(self) -> dict:
        """Keyword hyper-parameters with their defaults (``state`` and ``axis_name`` left out)."""
        sig = inspect.signature(self.fn)
        return {k: p.default for k, p in sig.parameters.items()
                if p.kind is p.KEYWORD_ONLY and k not in ("state", "axis_name")}


_REGISTRY: dict[str, EstimatorSpec] = {}


def register(name: str, fn: Callable, *, stateful: bool = False, init_state=None,
             check_state=None) -> None:
    if name in _REGISTRY:
        raise ValueError(f"estimator {name!r} is already registered")
    _REGISTRY[name] = EstimatorSpec(name, fn, stateful, init_state, check_state)


def names() -> list[str]:
    return sorted(_REGISTRY)


def spec(name: str) -> EstimatorSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown estimator {name!r}; known: {', '.join(names())}")
    return _REGISTRY[name]


def get(name: str) -> Callable:
    """The estimator function ``f(batch, *, hyper-params, axis_name=None) -> Advantages``."""
    return spec(name).fn


def check_hyper_params(name: str, params: dict) -> None:
    """Raises ValueError for keyword arguments the estimator does not take."""
    allowed = spec(name).hyper_params
    bad = sorted(set(params) - set(allowed))
    if bad:
        raise ValueError(f"estimator {name!r} has no hyper-parameter(s) {bad}; it takes: "
                         f"{', '.join(f'{k}={v!r}' for k, v in allowed.items())}")


@functools.lru_cache(maxsize=None)
def _jitted(name: str, params: tuple):
    return jax.jit(functools.partial(spec(name).fn, **dict(params)))


def compute(name: str, batch: TrajectoryBatch, *, state=None, validate: bool = True, **params):
    """Validates ``batch`` on the host, then runs the named estimator jitted.

    Hyper-parameters are static (one compile per distinct setting and batch shape). Returns
    ``Advantages``, or ``(Advantages, new_state)`` for stateful estimators.
    """
    check_hyper_params(name, params)
    if validate:
        batch.validate()
    fn = _jitted(name, tuple(sorted(params.items())))
    if spec(name).stateful:
        if state is None:
            raise ValueError(f"estimator {name!r} is stateful: pass state= (see "
                             f"estimators.spec({name!r}).init_state)")
        if spec(name).check_state is not None:
            spec(name).check_state(batch, state)
        return fn(batch, state=state)
    if state is not None:
        raise ValueError(f"estimator {name!r} takes no state")
    return fn(batch)
