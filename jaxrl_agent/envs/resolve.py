"""Environment names: a registered name (``gridworld``, ``tasks``, plug-ins) or one of the name
forms (``gymnasium:<id>``, ``http:<base_url>``, ``mcp:<server command>``,
``reasoning_gym:<dataset>``), resolved to what builds it (``resolve_env``) and built
(``make_env``). Above ``base`` and ``adapters``, which know nothing of names.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from jaxrl_agent import registry as _registry
from jaxrl_agent.envs.adapters import GymnasiumTextAdapter, HTTPEnv
from jaxrl_agent.envs.base import names

#: the name forms ``make_env`` / ``env.name`` accept besides registered names
ENV_NAME_FORMS = ("gymnasium:<id>", "http:<base_url>", "mcp:<server command>",
                  "reasoning_gym:<dataset>")
GYMNASIUM_HINT = "pip install gymnasium (or pip install 'jaxrl-agent[gymnasium]')"


def resolve_env(name: str) -> tuple[Callable[..., Any], dict]:
    """``(factory, fixed)``: what builds the environment ``name`` and the keyword arguments
    the name itself sets (``make_env(name, **kw)`` calls ``factory(**fixed, **kw)``).

    Names, tried in this order:

    - a registered name (built-in or plug-in): its class or factory, nothing fixed;
    - ``gymnasium:<id>``: a text environment registered with gymnasium (``gymnasium.make(id,
      **kw)``, ``<id>`` may be gymnasium's ``module:EnvName-v0``) in a
      ``GymnasiumTextAdapter`` (:func:`gymnasium_env`);
    - ``http:<base_url>`` (or a bare ``http://...`` / ``https://...`` URL): an ``HTTPEnv``
      server; a base URL without a scheme gets ``http://``;
    - ``mcp:<server command>``: the environment registered as ``mcp`` with
      ``command=<server command>`` (a tool environment over a local MCP server);
    - ``reasoning_gym:<dataset>``: the environment registered as ``reasoning_gym`` with
      ``dataset=<dataset>``.

    Raises ValueError naming the known names and the forms for anything else, and ImportError
    (with the install command) for ``gymnasium:`` when gymnasium is not installed.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"an environment name must be a non-empty string, got {name!r}")
    entry = _registry.find(name, "env")
    if entry is not None and entry.kind == "env":
        return entry.fn, {}
    prefix, sep, rest = name.partition(":")
    if sep and prefix in ("http", "https") and rest.startswith("//"):
        return HTTPEnv, {"base_url": name}
    if sep and prefix in _NAME_FORMS:
        if not rest.strip():
            raise ValueError(f"environment {name!r}: nothing after '{prefix}:'; the forms are "
                             f"{', '.join(ENV_NAME_FORMS)}")
        return _NAME_FORMS[prefix](name, rest.strip())
    known = ", ".join(names())
    raise ValueError(f"unknown environment {name!r}; known: {known}; or one of the forms "
                     f"{', '.join(ENV_NAME_FORMS)}" + _registry.IMPORT_HINT)


def _http_form(name: str, rest: str):
    url = rest if "://" in rest else "http://" + rest
    return HTTPEnv, {"base_url": url}


def _registered_form(env: str, arg: str, what: str):
    def form(name: str, rest: str):
        entry = _registry.find(env, "env")
        if entry is None or entry.kind != "env":
            raise ValueError(f"environment {name!r} needs the environment registered as "
                             f"{env!r} ({what}), and none is; known: {', '.join(names())}")
        return entry.fn, {arg: rest}
    return form


def _gymnasium_form(name: str, rest: str):
    try:
        import gymnasium  # noqa: F401
    except ImportError as e:
        raise ImportError(f"environment {name!r} needs gymnasium ({e}): {GYMNASIUM_HINT}") \
            from None
    return gymnasium_env, {"env_id": rest}


_NAME_FORMS = {
    "gymnasium": _gymnasium_form,
    "http": _http_form,
    "mcp": _registered_form("mcp", "command", "the MCP tool environment"),
    "reasoning_gym": _registered_form("reasoning_gym", "dataset",
                                      "reasoning-gym tasks, jaxrl_agent.envs.tasks"),
}


def gymnasium_env(env_id: str, max_turns: int = 32, **make_kwargs):
    """A ``GymnasiumTextAdapter`` over ``gymnasium.make(env_id, **make_kwargs)`` (a text
    environment: string observations and actions), family ``gymnasium:<env_id>``. Each
    ``clone()`` makes a new gymnasium env. ValueError naming the id when gymnasium cannot make
    it; ImportError when gymnasium is not installed."""
    try:
        import gymnasium
    except ImportError as e:
        raise ImportError(f"environment 'gymnasium:{env_id}' needs gymnasium ({e}): "
                          f"{GYMNASIUM_HINT}") from None

    def factory():
        try:
            return gymnasium.make(env_id, **make_kwargs)
        except Exception as e:  # noqa: BLE001 - gymnasium's own errors: unknown id, bad kwargs
            raise ValueError(f"gymnasium.make({env_id!r}"
                             + "".join(f", {k}={v!r}" for k, v in make_kwargs.items())
                             + f") failed: {type(e).__name__}: {e}") from None

    return GymnasiumTextAdapter(factory, max_turns=max_turns, family=f"gymnasium:{env_id}")


def make_env(name: str, **kwargs):
    """``make_env("gridworld", size=5)``, ``make_env("tasks", path=..., reward=...)``,
    ``make_env("gymnasium:MyText-v0")``: the environment ``name`` (a registered name or one of
    the forms of :func:`resolve_env`) built with ``kwargs``. ValueError listing the names and
    forms for an unknown name, naming the argument for a keyword the environment does not take
    or one the name already sets, and for a required one that is missing."""
    factory, fixed = resolve_env(name)
    both = sorted(set(fixed) & set(kwargs))
    if both:
        raise ValueError(f"environment {name!r}: the name already sets {both[0]!r}; leave it "
                         f"out of the keyword arguments")
    kwargs = {**fixed, **kwargs}
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to check
        sig = None
    if sig is not None:
        try:
            sig.bind(**kwargs)
        except TypeError as e:
            raise ValueError(f"environment {name!r}: {e}") from None
    return factory(**kwargs)


# --- fault handling ---------------------------------------------------------------------------


