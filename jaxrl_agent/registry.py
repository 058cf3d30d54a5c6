"""One registry of named methods: estimators, shaping and transform stages, losses and
environments, each registered once at its definition.

    from jaxrl_agent import register

    @register("my_baseline", kind="estimator")
    def my_baseline(batch, *, scale: float = 1.0, axis_name=None) -> Advantages: ...

    @register("my_critic", kind="estimator", reads=("turn_values",))
    def my_critic(batch, *, gamma: float = 1.0, axis_name=None) -> Advantages: ...

An entry records the function, its kind (``KINDS``; ``signal``: judges and other plug-ins
that write fields into finished trajectories' records), the inputs it reads beyond the core batch
(``reads``: names of ``batch.extras`` fields, or a function of the hyper-parameters returning
them), other names it answers to (``aliases``) and, for stateful estimators, how to make and
check the state. The keyword-only parameters of the function with their defaults are its
hyper-parameters (``Entry.hyper_params``).

Everything else asks the registry instead of naming methods: the training loop supplies the
inputs a pipeline reads from its one table of them (``jaxrl_agent.train.inputs.LOOP_INPUTS``:
each input with its source and provider), config validation checks that a run provides them, the CLI lists the entries, and the conformance
tests iterate over them. User modules register the same way and are loaded with ``--import``
or a config's ``imports:`` (``load_imports``).

Estimators, shaping and transform stages share one namespace (a pipeline names them); losses
and environments have their own.

This module imports nothing from the package, so every layer can register into it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Callable

KINDS = ("estimator", "shaping", "transform", "loss", "env", "signal")
_NAMESPACE = {"estimator": "credit", "shaping": "credit", "transform": "credit",
              "loss": "loss", "env": "env", "signal": "signal"}
#: the levels a signal plug-in's field may have (``provides``): per token, turn or trajectory,
#: a vector of W numbers per token, turn or trajectory (``"token[W]"``, ``"turn[W]"``,
#: ``"traj[W]"``), or ``"edges"`` (the record's turn-to-turn edges ``[[src, dst, type], ...]``)
SIGNAL_LEVELS = ("token", "turn", "traj", "token[W]", "turn[W]", "traj[W]", "edges")


def parse_level(level) -> tuple[str, int | None] | None:
    """``("turn", 3)`` for ``"turn[3]"``, ``("traj", None)`` for ``"traj"``; None when
    ``level`` is not one of ``SIGNAL_LEVELS``."""
    if not isinstance(level, str):
        return None
    if level in ("token", "turn", "traj", "edges"):
        return level, None
    for base in ("token", "turn", "traj"):
        if level.startswith(base + "[") and level.endswith("]"):
            w = level[len(base) + 1:-1]
            if w.isdigit() and int(w) >= 1:
                return base, int(w)
    return None

class MissingInput(ValueError):
    """A method needs an extras field the batch does not carry (``field`` names it)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered method.

    Attributes:
      name: the registered name (what configs and the CLI use).
      fn: the function (for ``kind="env"``: the environment class or factory).
      kind: one of ``KINDS``.
      reads: extras fields read beyond the core batch: a tuple, or a function of the
        hyper-parameters (a dict) returning one.
      aliases: other names that resolve to this entry.
      stateful: an estimator that takes ``state=`` and returns ``(Advantages, new_state)``.
      init_state: ``init_state(num_tasks)`` for stateful estimators.
      check_state: host-side ``check_state(batch, state)``.
      renamed: ``((former_name, name), ...)``: hyper-parameters that were renamed; configs
        and pipelines that still use the former name keep working (``canonical``).
      provides: (``kind="signal"`` only) the fields the plug-in writes into the records, a
        dict name -> level (``SIGNAL_LEVELS``) or a function of the hyper-parameters
        returning one (``outputs``).
    """

    name: str
    fn: Callable
    kind: str = "estimator"
    reads: tuple | Callable = ()
    aliases: tuple = ()
    stateful: bool = False
    init_state: Callable | None = None
    check_state: Callable | None = None
    renamed: tuple = ()
    provides: dict | Callable = dataclasses.field(default_factory=dict)

    @property
    def hyper_params(self) -> dict:
        """Keyword hyper-parameters with their defaults (``state`` and ``axis_name`` left out;
        for an environment, its constructor's named parameters)."""
        sig = inspect.signature(self.fn)
        if self.kind == "env":
            return {k: p.default for k, p in sig.parameters.items()
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        return {k: p.default for k, p in sig.parameters.items()
                if p.kind is p.KEYWORD_ONLY and k not in ("state", "axis_name")}

    def inputs(self, params: dict | None = None) -> tuple:
        """The extras fields this method reads with these hyper-parameters."""
        if callable(self.reads):
            merged = {**self.hyper_params, **dict(params or {})}
            return tuple(self.reads(merged))
        return tuple(self.reads)

    def outputs(self, params: dict | None = None) -> dict:
        """The fields a signal plug-in provides with these hyper-parameters (name -> level)."""
        if callable(self.provides):
            return dict(self.provides({**self.hyper_params, **dict(params or {})}))
        return dict(self.provides)

    def canonical(self, params: dict | None) -> dict:
        """``params`` with former hyper-parameter names (``renamed``) replaced by the current
        ones. Raises ValueError when both the former and the current name are given."""
        out = dict(params or {})
        for old, new in self.renamed:
            if old in out:
                if new in out:
                    raise ValueError(f"{self.kind} {self.name!r}: give {new!r} only "
                                     f"({old!r} is its former name)")
                out[new] = out.pop(old)
        return out

    @property
    def origin(self) -> str:
        """The module that defines the function (a plug-in's module for user methods)."""
        return getattr(self.fn, "__module__", None) or "?"


_ENTRIES: dict[tuple[str, str], Entry] = {}


def _same_definition(a: Callable, b: Callable) -> bool:
    """The same function defined again (a module imported twice, e.g. by path and by name)."""
    key = lambda f: (getattr(f, "__module__", None), getattr(f, "__qualname__", None))  # noqa: E731
    return a is b or (key(a)[1] is not None and key(a) == key(b))


def register(name: str, fn: Callable | None = None, *, kind: str = "estimator",
             reads: tuple | Callable = (), aliases: tuple = (), stateful: bool = False,
             init_state: Callable | None = None, check_state: Callable | None = None,
             renamed: dict | None = None, provides: dict | Callable | None = None):
    """Registers ``fn`` under ``name`` (and ``aliases``); without ``fn``, a decorator.

    A credit method (estimator, shaping or transform) also answers to its function's name when
    that differs from ``name`` and no other entry holds it: the descriptive name beside the
    paper's acronym (``grpo`` is ``group_normalized_outcome``).

    ``renamed`` maps former hyper-parameter names to current ones, so configs written before a
    rename keep working (``Entry.canonical``).

    ``kind="signal"``: a judge, process reward model or rubric run on the host after
    collection, ``fn(records, *, hyper-params) -> list`` with one dict per record of the
    fields it adds, in the records' own form (``{"turn_extras": {name: [one value per turn]},
    "token_extras": {name: [one list per turn, a value per action token]}, "traj_extras":
    {name: value}}``); ``provides`` declares them (name -> ``"token"``, ``"turn"`` or
    ``"traj"``).

    Raises ValueError for an unknown kind, a name already taken by another function of the
    same namespace, state options on a stateless kind, or a ``renamed`` target that is not a
    hyper-parameter of ``fn``. Registering the same definition
    again (a module imported twice) replaces the entry quietly.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if stateful and kind != "estimator":
        raise ValueError("only estimators may be stateful")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a registered name must be a non-empty string, got {name!r}")
    if not (isinstance(reads, tuple) or callable(reads)):
        raise ValueError(f"reads must be a tuple of extras names or a function of the "
                         f"hyper-parameters, got {reads!r}")
    if (provides is not None) != (kind == "signal"):
        raise ValueError(f"{kind} {name!r}: provides= declares the fields of a signal plug-in "
                         f"(kind='signal'), and a signal must declare them")
    if isinstance(provides, dict):
        bad = {k: v for k, v in provides.items()
               if not (isinstance(k, str) and k) or parse_level(v) is None}
        if bad:
            raise ValueError(f"signal {name!r}: provides maps field names to a level "
                             f"{SIGNAL_LEVELS}, got {bad}")
    elif provides is not None and not callable(provides):
        raise ValueError(f"signal {name!r}: provides must be a dict or a function of the "
                         f"hyper-parameters, got {provides!r}")

    def add(f: Callable) -> Callable:
        space = _NAMESPACE[kind]
        names_ = list(aliases)
        own = getattr(f, "__name__", "")
        held = _ENTRIES.get((space, own))
        if (space == "credit" and own.isidentifier() and not own.startswith("_")
                and own not in (name, *names_) and (held is None or _same_definition(held.fn, f))):
            names_.append(own)
        entry = Entry(name, f, kind, reads, tuple(names_), stateful, init_state, check_state,
                      tuple(sorted((renamed or {}).items())), provides or {})
        for old, new in entry.renamed:
            if new not in entry.hyper_params or old in entry.hyper_params:
                raise ValueError(f"{kind} {name!r}: renamed {old!r} -> {new!r} must name a "
                                 f"former parameter and a current one of the function")
        for n in (name, *entry.aliases):
            old = _ENTRIES.get((space, n))
            if old is not None and not _same_definition(old.fn, f):
                raise ValueError(f"{kind} {n!r} is already registered (by {old.origin}); "
                                 f"choose another name")
        for n in (name, *entry.aliases):
            _ENTRIES[(space, n)] = entry
        return f

    return add if fn is None else add(fn)


def unregister(name: str, kind: str) -> None:
    """Removes ``name`` (and its aliases) from ``kind``'s namespace; nothing if absent."""
    e = find(name, kind)
    if e is not None:
        for n in (e.name, *e.aliases):
            _ENTRIES.pop((_NAMESPACE[kind], n), None)


def names(kind: str) -> list[str]:
    """Registered names (aliases left out) of one kind, or of every kind with ``"all"``."""
    if kind != "all" and kind not in KINDS:
        raise ValueError(f"kind must be 'all' or one of {KINDS}, got {kind!r}")
    return sorted({e.name for e in _ENTRIES.values() if kind == "all" or e.kind == kind})


def entries(kind: str = "all") -> list[Entry]:
    """The registered entries of one kind (or all), by name."""
    return sorted({(e.kind, e.name): e for e in _ENTRIES.values()
                   if kind == "all" or e.kind == kind}.values(), key=lambda e: (e.kind, e.name))


def find(name: str, kind: str) -> Entry | None:
    """The entry ``name`` resolves to in ``kind``'s namespace, or None."""
    return _ENTRIES.get((_NAMESPACE[kind], name))


def lookup(name: str, kind: str) -> Entry:
    """The entry of ``name`` of this kind; a ValueError listing the known names otherwise."""
    e = find(name, kind)
    if e is None:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(names(kind))}"
                         + IMPORT_HINT)
    if e.kind != kind:
        article = lambda k: ("an " if k[0] in "aeiou" else "a ") + k  # noqa: E731
        raise ValueError(f"{name!r} is {article(e.kind)}, not {article(kind)}; {kind}s: "
                         f"{', '.join(names(kind))}")
    return e


IMPORT_HINT = (" (a method of your own is registered by its module: load it with --import "
                "MODULE or the config's imports: [...])")


# ----------------------------------------------------------------------------- plug-ins


def is_path(item: str) -> bool:
    """A plug-in given as a file (``./my_env.py``), not a dotted module name."""
    return item.endswith(".py") or os.sep in item or "/" in item


def load_imports(specs, *, base_dir: str | None = None) -> list[str]:
    """Imports user modules that register methods: each item a dotted module name
    (``my_pkg.credit``) or a path to a ``.py`` file (``./my_env.py``, relative to
    ``base_dir``, default the working directory). Returns the modules' names. Raises
    ``ImportError`` naming the item when it cannot be found or fails to import."""
    loaded = []
    for item in specs or ():
        if not isinstance(item, str) or not item.strip():
            raise ImportError(f"each item must be a module name or a .py path, "
                              f"got {item!r}")
        item = item.strip()
        if is_path(item):
            path = item if os.path.isabs(item) else os.path.join(base_dir or os.getcwd(), item)
            path = os.path.normpath(path)
            if not os.path.isfile(path):
                raise ImportError(f"{item!r}: no such file ({path})")
            mod_name = "jaxrl_user_" + "".join(
                c if c.isalnum() else "_" for c in os.path.splitext(path)[0].lstrip(os.sep))
            if mod_name not in sys.modules:
                spec = importlib.util.spec_from_file_location(mod_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module
                try:
                    spec.loader.exec_module(module)
                except Exception as e:
                    del sys.modules[mod_name]
                    raise ImportError(f"{item!r} failed: {type(e).__name__}: "
                                      f"{e}") from e
            loaded.append(mod_name)
        else:
            try:
                importlib.import_module(item)
            except ModuleNotFoundError as e:
                raise ImportError(f"no module {item!r} ({e}); is it installed or on "
                                  f"PYTHONPATH, or did you mean a path like ./{item}.py?") from e
            except Exception as e:
                raise ImportError(f"{item!r} failed: {type(e).__name__}: {e}") from e
            loaded.append(item)
    return loaded
