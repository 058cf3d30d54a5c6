"""The inputs the training loop supplies to the credit methods that read them, declared once.

A method names the extras fields it reads (``Entry.reads``, ``estimators.reads(pipeline)``).
Every field the loop can supply has one row in ``LOOP_INPUTS``, which says where it comes
from and how it is made:

============  ================================================================================
source        how the loop provides it
============  ================================================================================
value_head    in the train step, from one forward pass of the value head (a critic:
              ``model.value_head: true``), detached
hidden_state  in the train step, the policy's final hidden state at each decision point,
              detached
env           on the host, before packing, from what the environment reported at each turn
              (the ``info`` fields the rollout collector records unchanged, e.g. a turn's
              ``subgoal``); a stand-in of zeros in the step when the environment reported
              nothing
============  ================================================================================

The config checks (``jaxrl_agent.config``), the train step (``provide``) and the trainer's
packing (``attach_env_inputs``) all read this table; nothing else names these fields. Any
other extras field a method reads must come with the records (``jaxrl-agent credit``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxrl_agent import segments
from jaxrl_agent.batch import TrajectoryBatch

__all__ = ["LOOP_INPUTS", "LoopInput", "SOURCES", "attach_env_inputs", "provide", "sources"]

SOURCES = {"value_head": "the value head (model.value_head: true)",
           "hidden_state": "the policy's hidden states",
           "env": "the environment's reports"}


@dataclasses.dataclass(frozen=True)
class LoopInput:
    """One loop-supplied input.

    ``source``: a ``SOURCES`` key; ``level``: ``token`` ([R, T]), ``turn`` ([N, K]) or
    ``vector`` ([N, K, D]); ``what``: one line for users. ``step(batch, values, hidden)``
    makes it inside the train step (``values`` [R, T]: the value before each token;
    ``hidden`` [N, K, D]); for an ``env`` input it is the stand-in used when the records
    carry none. ``from_turns(turns)`` (``env`` inputs only): one value per turn of a record
    from the turns' recorded fields, or None when the environment reported nothing.
    """

    source: str
    level: str
    what: str
    step: Callable[[TrajectoryBatch, Any, Any], Any]
    from_turns: Callable[[list], list | None] | None = None


def _turn_values(batch: TrajectoryBatch, values):
    """V(s_k) [N, K]: the value before each turn's first action token (``values`` [R, T] is
    the value before each token, so it is read one position later)."""
    at_token = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    return segments.turn_values_from_tokens(at_token, batch, "before_action")


def _stage_starts(turns: list) -> list | None:
    """1.0 at each turn whose recorded ``subgoal`` (the environment's ``info["subgoal"]`` of
    the state it acted in) differs from the previous turn's, and at the first turn; None when
    no turn carries one."""
    goals = [t.get("subgoal") for t in turns]
    if all(g is None for g in goals):
        return None
    return [float(i == 0 or g != goals[i - 1]) for i, g in enumerate(goals)]


LOOP_INPUTS = {
    "token_values": LoopInput(
        "value_head", "token", "the value head's estimate before each action token",
        lambda b, v, h: jnp.where(b.action_mask, v, 0.0)),
    "turn_values": LoopInput(
        "value_head", "turn", "the value head's estimate before each turn, V(s_k)",
        lambda b, v, h: _turn_values(b, v)),
    # one value head serves both levels of a hierarchical critic (as HiPER does)
    "high_values": LoopInput(
        "value_head", "turn", "the high-level (subgoal) values; the same value head as "
        "turn_values", lambda b, v, h: _turn_values(b, v)),
    "switch": LoopInput(
        "env", "turn", "1 where the environment reported a new subgoal (info['subgoal']); "
        "zeros (one segment per episode) when it reports none",
        lambda b, v, h: jnp.zeros(b.turn_mask.shape, jnp.float32), _stage_starts),
    "hidden": LoopInput(
        "hidden_state", "vector", "the policy's last hidden state at each decision point, "
        "detached", lambda b, v, h: h),
    "state_features": LoopInput(
        "hidden_state", "vector", "the same hidden state, read as state features",
        lambda b, v, h: h),
}


def sources(reads) -> set:
    """The ``SOURCES`` the fields ``reads`` need from the loop."""
    return {LOOP_INPUTS[f].source for f in reads if f in LOOP_INPUTS}


def provide(batch: TrajectoryBatch, reads, values, hidden) -> TrajectoryBatch:
    """The batch with the loop-supplied inputs the pipeline reads. Model outputs (value head,
    hidden states) replace a field the batch already has; an ``env`` field is only filled in
    (with its stand-in) when the records did not carry it. ``values`` [R, T] and ``hidden``
    [N, K, D] are None when not needed."""
    extras = dict(batch.extras)
    values = None if values is None else jax.lax.stop_gradient(values)
    for name in reads:
        spec = LOOP_INPUTS.get(name)
        if spec is None or (spec.source == "env" and name in extras):
            continue
        extras[name] = spec.step(batch, values, hidden)
    return batch.replace(extras=extras)


def attach_env_inputs(records: list, reads) -> list:
    """``records`` with the ``env`` inputs of ``reads`` written into each turn's
    ``turn_extras`` (from ``LoopInput.from_turns``), where the environment reported them and
    the record does not carry the field already. Records are copied, never changed in place
    (the originals may be saved as they were collected)."""
    wanted = [(n, LOOP_INPUTS[n]) for n in reads
              if n in LOOP_INPUTS and LOOP_INPUTS[n].source == "env"]
    if not wanted:
        return records
    out = []
    for rec in records:
        turns = rec.get("turns") or []
        new_turns = [dict(t, turn_extras=dict(t.get("turn_extras") or {})) for t in turns]
        for name, spec in wanted:
            if any(name in t.get("turn_extras", {}) for t in turns):
                continue
            values = spec.from_turns(turns)
            if values is not None:
                for t, x in zip(new_turns, values):
                    t["turn_extras"][name] = x
        for t in new_turns:
            if not t["turn_extras"]:
                del t["turn_extras"]
        out.append(dict(rec, turns=new_turns))
    return out
