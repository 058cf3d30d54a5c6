"""Estimators by name, for configs and the CLI. The names are a public contract.

Three kinds of registered functions compose into one credit pipeline:

* ``estimator``: ``f(batch, *, hp, axis_name=None) -> Advantages`` (GRPO, GiGPO, GAE, ...).
* ``shaping``: ``f(batch, *, hp, axis_name=None) -> TrajectoryBatch`` with shaped
  ``turn_rewards`` / ``extras['token_rewards']`` (PBRS, uniform redistribution, ...): applied
  before the estimator.
* ``transform``: ``f(adv, batch, *, hp, axis_name=None) -> Advantages`` (re-allocation and
  dense add-ons: TRIAL, CoRT, TRACE, ...): applied to the estimator's output, in order.

``Pipeline`` runs shaping* -> estimator -> transform*; ``names()`` lists estimators,
``names(kind)`` the other kinds.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from jaxrl_agent import registry as _registry
from jaxrl_agent.batch import TrajectoryBatch
from jaxrl_agent.registry import MissingInput, register  # noqa: F401  (re-exported)

KINDS = ("estimator", "shaping", "transform")

# One entry of the registry (``jaxrl_agent.registry.Entry``): name, function, kind, what it
# reads, hyper-parameters, state.
EstimatorSpec = _registry.Entry


def names(kind: str = "estimator") -> list[str]:
    """Registered names of one kind (``"estimator"``, ``"shaping"``, ``"transform"``) or of
    every kind (``"all"``)."""
    if kind == "all":
        return sorted(n for k in KINDS for n in _registry.names(k))
    if kind not in KINDS:
        raise ValueError(f"kind must be 'all' or one of {KINDS}, got {kind!r}")
    return _registry.names(kind)


def spec(name: str, kind: str | None = None) -> EstimatorSpec:
    """The entry of ``name`` (an estimator, shaping or transform stage); with ``kind``, a
    ValueError unless it is of that kind."""
    if kind is not None:
        return _registry.lookup(name, kind)
    e = _registry.find(name, "estimator")
    if e is None:
        raise ValueError(f"unknown estimator {name!r}; known: {', '.join(names())} (shaping: "
                         f"{', '.join(names('shaping'))}; transforms: "
                         f"{', '.join(names('transform'))}){_registry.IMPORT_HINT}")
    return e


def reads(pipe: "Pipeline") -> tuple:
    """The extras fields every stage of ``pipe`` reads, in stage order, without repeats."""
    out = []
    for name, params in (*pipe.shaping, pipe.estimator, *pipe.then):
        out += [f for f in spec(name).inputs(dict(params)) if f not in out]
    return tuple(out)


def get(name: str) -> Callable:
    """The estimator function ``f(batch, *, hyper-params, axis_name=None) -> Advantages``."""
    return spec(name).fn


def type_error(default, value) -> str | None:
    """What ``value`` should be, judged by the type of the parameter's ``default`` (a bool for a
    bool, an int for an int, a finite number for a float, a string for a string; anything for
    a ``None`` default), or None when it fits. ``None`` always passes here (some parameters
    take it as "off"; the function's own check decides)."""
    import math
    import numbers

    if default is None or value is None or isinstance(default, (tuple, list, dict)):
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, numbers.Integral):
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return None if ok else "an integer"
    if isinstance(default, numbers.Real):
        ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
              and math.isfinite(float(value)))
        return None if ok else "a finite number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string"
    return None


def check_hyper_params(name: str, params: dict) -> None:
    """Raises ValueError for keyword arguments the function does not take, and for values
    whose type does not fit the parameter's default (``type_error``); ranges and choices are
    checked by the function itself when it is traced."""
    s = spec(name)
    allowed = s.hyper_params
    bad = sorted(set(params) - set(allowed))
    if bad:
        raise ValueError(f"{s.kind} {name!r} has no hyper-parameter(s) {bad}; it takes: "
                         f"{', '.join(f'{k}={v!r}' for k, v in allowed.items())}")
    for k, v in params.items():
        want = type_error(allowed[k], v)
        if want:
            raise ValueError(f"{s.kind} {name!r}: {k} must be {want} (default "
                             f"{allowed[k]!r}), got {v!r}")


@functools.lru_cache(maxsize=None)
def _jitted_pipeline(pipe: "Pipeline"):
    return jax.jit(pipe)


@functools.lru_cache(maxsize=None)
def _jitted(name: str, params: tuple):
    return jax.jit(functools.partial(spec(name).fn, **dict(params)))


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """shaping* -> estimator -> transform*, as one pure, jittable function of the batch.

    Each stage is ``(name, ((param, value), ...))`` (hashable: use it as a static argument).
    ``Pipeline.build("grpo", then=[("trial", {"weight": 0.5})])`` accepts dicts.

    One interface for every pipeline, as optax's transformations: ``state = pipe.init(num_tasks)``
    (``()`` unless the estimator keeps state across steps, e.g. SPO's per-task trackers), then
    ``adv, state = pipe.apply(batch, state)``; callers never ask whether a pipeline is
    stateful. ``pipe(batch)`` (``pipe(batch, state=...)`` for a stateful one) is the same
    function with the estimator's own return convention.
    """

    estimator: tuple
    shaping: tuple = ()
    then: tuple = ()

    @staticmethod
    def _stage(item, kind):
        name, params = (item, {}) if isinstance(item, str) else item
        params = spec(name, kind).canonical(params)
        check_hyper_params(name, params)
        return name, tuple(sorted(params.items()))

    @classmethod
    def build(cls, estimator, params=None, *, shaping=(), then=()) -> "Pipeline":
        return cls(cls._stage((estimator, params), "estimator"),
                   tuple(cls._stage(s, "shaping") for s in shaping),
                   tuple(cls._stage(t, "transform") for t in then))

    @property
    def stateful(self) -> bool:
        return spec(self.estimator[0]).stateful

    def init(self, num_tasks: int):
        """The estimator's state for ``num_tasks`` task ids: ``()`` for a stateless one."""
        e = spec(self.estimator[0])
        return e.init_state(num_tasks) if e.stateful else ()

    def check(self, batch: TrajectoryBatch, state) -> None:
        """Host-side check of ``state`` against ``batch`` (task ids within the tables)."""
        e = spec(self.estimator[0])
        if e.stateful and e.check_state is not None:
            e.check_state(batch, state)

    def apply(self, batch: TrajectoryBatch, state=(), *, axis_name=None):
        """``(Advantages, new_state)`` for every pipeline (a stateless one returns ``state``)."""
        if self.stateful:
            return self(batch, state=state, axis_name=axis_name)
        return self(batch, axis_name=axis_name), state

    @property
    def names(self) -> tuple:
        return (tuple(n for n, _ in self.shaping) + (self.estimator[0],)
                + tuple(n for n, _ in self.then))

    def __call__(self, batch: TrajectoryBatch, *, state=None, axis_name=None):
        """Advantages, or (Advantages, new_state) for a stateful estimator."""
        ax = {} if axis_name is None else {"axis_name": axis_name}
        for name, params in self.shaping:
            batch = get(name)(batch, **dict(params), **ax)
        name, params = self.estimator
        est = get(name)
        if self.stateful:
            adv, state = est(batch, state=state, **dict(params), **ax)
        else:
            adv = est(batch, **dict(params), **ax)
        for name, params in self.then:
            adv = get(name)(adv, batch, **dict(params), **ax)
        return (adv, state) if self.stateful else adv


def compute(name: str, batch: TrajectoryBatch, *, state=None, validate: bool = True,
            shaping=(), then=(), **params):
    """Validates ``batch`` on the host, then runs the named estimator jitted.

    ``shaping`` and ``then`` list shaping and transform stages (names or ``(name, params)``)
    around it (see ``Pipeline``). Hyper-parameters are static (one compile per distinct
    setting and batch shape). Returns ``Advantages``, or ``(Advantages, new_state)`` for
    stateful estimators.
    """
    if shaping or then:
        pipe = Pipeline.build(name, params, shaping=shaping, then=then)
        if validate:
            batch.validate()
        if pipe.stateful:
            if state is None:
                raise ValueError(f"estimator {name!r} is stateful: pass state=")
            if spec(name).check_state is not None:
                spec(name).check_state(batch, state)
            return _jitted_pipeline(pipe)(batch, state=state)
        if state is not None:
            raise ValueError(f"estimator {name!r} takes no state")
        return _jitted_pipeline(pipe)(batch)
    params = spec(name, "estimator").canonical(params)
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
