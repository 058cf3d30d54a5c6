"""Judges, process reward models and rubrics as plug-ins: the ``signal`` source of
``train.inputs``.

A signal plug-in is registered with ``kind="signal"`` and the fields it provides::

    from jaxrl_agent import register

    @register("step_judge", kind="signal", provides={"verified": "turn"})
    def step_judge(records, *, threshold: float = 0.5):
        return [{"turn_extras": {"verified": [judge(t) > threshold for t in r["turns"]]}}
                for r in records]

It runs on the host after collection (in the rollout worker with ``trainer.async_rollouts``),
over the finished trajectories' records (their turns, tokens, texts and conversations, as the
collector wrote them), and returns one dict per record with the fields it adds in the records'
own form: ``turn_extras`` (a value per turn; a list of W per turn for ``"turn[W]"``),
``token_extras`` (per turn, a value per action token; a list of W for ``"token[W]"``),
``traj_extras`` (a value per
trajectory; a list of W for ``"traj[W]"``: rubric items, agents, coalitions) and ``edges``
(``[[src_turn, dst_turn, type], ...]``). The records are then packed as usual, so the fields
reach every method under their names, and ``metrics.save_records`` saves them for
``jaxrl-agent credit``. An LLM judge calls a sampler or an HTTP endpoint from inside the
function. Signals never carry gradients (they are data).

Failures: an exception raised by a plug-in is a ``SignalError`` carrying the plug-in's own
traceback; the trainer shows it once, counts it (``train/signal_errors``), trains nothing on
that step's records and stops after ``trainer.max_failed_steps`` such steps in a row. A result
of the wrong form (not one dict per record, a field it did not declare, a list of the wrong
length, a value that is not a finite number) is a ``SignalShapeError`` naming the plug-in, the
record, the field and both lengths: a bug, so the run stops at once.
"""

from __future__ import annotations

import math
import numbers
import traceback

from jaxrl_agent import registry

__all__ = ["SignalError", "SignalShapeError", "run_signals"]

_LEVEL_KEY = {"turn": "turn_extras", "token": "token_extras", "traj": "traj_extras",
              "edges": "edges"}


class SignalError(RuntimeError):
    """A signal plug-in raised; ``head`` is one line, ``tb`` the plug-in's traceback."""

    def __init__(self, head: str, tb: str):
        super().__init__(head)
        self.head, self.tb = head, tb


class SignalShapeError(ValueError):
    """A signal plug-in returned something other than what it declared."""


def _check_value(x, where: str, name: str) -> float:
    """``x`` as a float (a bool is 0 / 1); ``SignalShapeError`` unless a finite number."""
    if not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise SignalShapeError(f"{where}: {name} must be a finite number, got {x!r}")
    return float(x)


def _checked(x, width, where: str, label: str):
    """A number (``width`` None) or a list of ``width`` numbers, checked."""
    if width is None:
        return _check_value(x, where, label)
    if not isinstance(x, (list, tuple)) or len(x) != width:
        n = len(x) if isinstance(x, (list, tuple)) else type(x).__name__
        raise SignalShapeError(f"{where}: {label} must be a list of {width} numbers, got {n}")
    return [_check_value(v, where, label) for v in x]


def _merge(rec: dict, patch, name: str, fields: dict, i: int) -> dict:
    """``rec`` with the fields of ``patch`` (one plug-in's result for it) written in, checked
    against the plug-in's declaration ``fields`` (name -> level)."""
    where = f"signal {name!r}, record {i}"
    if not isinstance(patch, dict):
        raise SignalShapeError(f"{where}: expected a dict of turn_extras / token_extras / "
                               f"traj_extras, got {type(patch).__name__}")
    unknown = sorted(set(patch) - set(_LEVEL_KEY.values()))
    if unknown:
        raise SignalShapeError(f"{where}: unknown key(s) {unknown}; a result has turn_extras, "
                               f"token_extras, traj_extras and edges")
    turns = [dict(t) for t in rec.get("turns") or []]
    out = dict(rec, turns=turns)
    got = {f: lvl for lvl, key in _LEVEL_KEY.items() if lvl != "edges"
           for f in (patch.get(key) or {})}
    if "edges" in patch:
        got["edges"] = "edges"
    levels = {f: registry.parse_level(v) for f, v in fields.items()}
    for field, (level, _) in levels.items():
        if got.get(field) != level:
            raise SignalShapeError(f"{where}: declares {field!r} per {level} "
                                   f"({_LEVEL_KEY[level]}) but returned "
                                   + (f"it per {got[field]}" if field in got else "none"))
    for field, level in got.items():
        if field not in fields:
            raise SignalShapeError(f"{where}: returned {field!r}, which it does not declare in "
                                   f"provides= ({sorted(fields)})")
        width = levels[field][1]
        if level == "edges":
            out["edges"] = patch["edges"]  # checked by the packer (parse_records)
            continue
        value = patch[_LEVEL_KEY[level]][field]
        label = f"{_LEVEL_KEY[level]}['{field}']"
        if level == "traj":
            value = _checked(value, width, where, label)
            out["traj_extras"] = {**(out.get("traj_extras") or {}), field: value}
            continue
        if not isinstance(value, (list, tuple)) or len(value) != len(turns):
            n = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise SignalShapeError(f"{where}: {label} must hold one entry per turn "
                                   f"({len(turns)}), got {n}")
        for k, (t, x) in enumerate(zip(turns, value)):
            if level == "turn":
                t["turn_extras"] = {**(t.get("turn_extras") or {}),
                                    field: _checked(x, width, where, f"{label}[{k}]")}
                continue
            n_act = len(t.get("action") or [])
            if not isinstance(x, (list, tuple)) or len(x) != n_act:
                n = len(x) if isinstance(x, (list, tuple)) else type(x).__name__
                raise SignalShapeError(f"{where}: {label}[{k}] must hold one value per action "
                                       f"token of turn {k} ({n_act}), got {n}")
            t["token_extras"] = {**(t.get("token_extras") or {}),
                                 field: [_checked(v, width, where, f"{label}[{k}]") for v in x]}
    return out


def run_signals(records: list, stages) -> list:
    """``records`` with the fields of every signal plug-in of ``stages`` (``((name, params),
    ...)``, ``config.signal_stages``) written in, in order (a later plug-in sees the fields of
    the earlier ones). The input records are not changed. Raises ``SignalError`` when a
    plug-in raises, ``SignalShapeError`` when its result is not what it declared."""
    for name, params in stages:
        entry = registry.lookup(name, "signal")
        fields = entry.outputs(dict(params))
        try:
            result = entry.fn(records, **dict(params))
        except Exception as e:  # noqa: BLE001 - the user's plug-in: shown with its traceback
            raise SignalError(f"signal {name!r} raised {type(e).__name__}: {e}",
                              traceback.format_exc()) from e
        if not isinstance(result, (list, tuple)) or len(result) != len(records):
            n = len(result) if isinstance(result, (list, tuple)) else type(result).__name__
            raise SignalShapeError(f"signal {name!r}: expected a list of one dict per record "
                                   f"({len(records)}), got {n}")
        records = [_merge(r, p, name, fields, i) for i, (r, p) in enumerate(zip(records,
                                                                                 result))]
    return records
