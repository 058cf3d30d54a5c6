"""Every input the training loop supplies to the credit methods and losses that read it, with
its source, declared once.

A method reads extras fields of the batch: declared (``Entry.reads``) or named by a
hyper-parameter (``teacher="teacher_logprobs"``, ``potential="potential"``), found by tracing
it (``run_checks``). Every field a run can supply has one row in the run's table
(``run_inputs``): the fixed rows of ``LOOP_INPUTS`` (made in the train step from the models it
runs) plus the fields this run's environment reports and its signal plug-ins provide:

============  ================================================================================
source        how the loop provides it (the config key that switches it on)
============  ================================================================================
value_head    in the train step, from one forward pass of the value head (a critic:
              ``model.value_head: true``), detached
hidden_state  in the train step, the policy's final hidden state at each decision point,
              detached
teacher       in the train step, the teacher's log-probs of the sampled tokens (``teacher.source``:
              the policy's start weights, the live policy, an EMA of it, or another checkpoint of
              the same tokenizer), at the rollouts' temperature, in chunks, under stop_gradient
teacher_topk  in the train step, in the same teacher pass: the teacher's ``teacher.top_k`` most
              likely next tokens at each position and their log-probs (for losses that compare
              whole distributions, ``topk_kl``; the step passes the student's log-probs of the
              same ids to them)
policy        in the train step, the policy's own per-token outputs at the start of the step
              (the entropy of the distribution each action token was drawn from), detached
reference     in the train step, the log-probs of the sampled tokens under the reference
              policy: the trained parameters as the run started (the KL term's frozen copy)
env           on the host, from what the environment reports: the ``info`` fields it declares
              in ``Env.reports`` (per turn: the state the agent acted in; ``final_<name>``: the
              state after the last action), recorded by the collector; and ``switch``, made
              from the ``info["subgoal"]`` it reports
signal        on the host after collection, from a judge / process-reward / rubric plug-in
              (``signals: [{name, params}]``; registry kind ``signal``) over the finished
              trajectories, written into the records before packing
============  ================================================================================

Teacher and judge signals never carry gradients. The config checks (``run_checks``), the train
step (``provide``), the trainer's packing (``attach_env_inputs``) and ``jaxrl-agent
estimators --sources`` read this table; nothing else names these fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxrl_agent import segments
from jaxrl_agent.batch import TrajectoryBatch

__all__ = ["LOOP_INPUTS", "LoopInput", "SOURCES", "STEP_SOURCES", "attach_env_inputs",
           "missing_message", "provide", "run_inputs", "sources"]

#: source -> (what it is, the config key that supplies it)
SOURCES = {"value_head": ("the value head", "model.value_head: true"),
           "hidden_state": ("the policy's hidden states", "(always available)"),
           "teacher": ("the teacher's log-probs of the sampled tokens",
                       "teacher.source: base | live | ema | PATH"),
           "teacher_topk": ("the teacher's most likely tokens and their log-probs",
                            "teacher.source: base | live | ema | PATH and teacher.top_k: K"),
           "policy": ("the policy's own per-token outputs", "(always available)"),
           "reference": ("the reference policy (the start weights, as the KL term's)",
                         "(always available)"),
           "env": ("the environment's reports", "an env whose Env.reports declares the field"),
           "signal": ("a judge / signal plug-in", "signals: [{name: ..., params: ...}]")}

#: the sources computed inside the train step (a model runs for them)
STEP_SOURCES = ("value_head", "hidden_state", "teacher", "teacher_topk", "policy", "reference")

#: levels of a field: its shape in the batch (``token[top_k]``: [R, T, teacher.top_k], made
#: concrete by ``run_inputs``)
LEVELS = {"token": "[R, T]", "turn": "[N, K]", "traj": "[N]", "vector": "[N, K, D]",
          "token[top_k]": "[R, T, teacher.top_k]"}


@dataclasses.dataclass(frozen=True)
class LoopInput:
    """One loop-supplied input.

    ``source``: a ``SOURCES`` key; ``level``: a ``LEVELS`` key (``run_inputs`` makes
    ``token[top_k]`` concrete, e.g. ``token[16]``); ``what``: one line for users.
    ``step(batch, outputs)`` makes it inside the train step from ``outputs`` (the models'
    outputs the step computed: ``values`` [R, T], the value before each token; ``hidden``
    [N, K, D]; ``teacher_logprobs``, ``ref_logprobs``, ``entropy`` [R, T]); for a host-side
    input it is
    the stand-in of zeros used when the records carry none. ``from_turns(turns)`` (``env``
    inputs made from other recorded fields only): one value per turn of a record, or None
    when the environment reported nothing.
    """

    source: str
    level: str
    what: str
    step: Callable[[TrajectoryBatch, dict], Any] | None = None
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


def _zeros(level: str):
    """The stand-in of a host-side input the records did not carry: zeros at its level."""
    def make(b: TrajectoryBatch, outputs: dict):
        like = {"token": b.action_mask, "turn": b.turn_mask, "traj": b.traj_mask}[level]
        return jnp.zeros(like.shape, jnp.float32)
    return make


LOOP_INPUTS = {
    "token_values": LoopInput(
        "value_head", "token", "the value head's estimate before each action token",
        lambda b, o: jnp.where(b.action_mask, o["values"], 0.0)),
    "turn_values": LoopInput(
        "value_head", "turn", "the value head's estimate before each turn, V(s_k)",
        lambda b, o: _turn_values(b, o["values"])),
    # one value head serves both levels of a hierarchical critic (as HiPER does)
    "high_values": LoopInput(
        "value_head", "turn", "the high-level (subgoal) values; the same value head as "
        "turn_values", lambda b, o: _turn_values(b, o["values"])),
    "hidden": LoopInput(
        "hidden_state", "vector", "the policy's last hidden state at each decision point, "
        "detached", lambda b, o: o["hidden"]),
    "state_features": LoopInput(
        "hidden_state", "vector", "the same hidden state, read as state features",
        lambda b, o: o["hidden"]),
    "teacher_logprobs": LoopInput(
        "teacher", "token", "the teacher's log-prob of each sampled token, at the rollouts' "
        "temperature (or teacher.temperature), detached", lambda b, o: o["teacher_logprobs"]),
    "teacher_topk_logprobs": LoopInput(
        "teacher_topk", "token[top_k]", "the teacher's log-probs of its teacher.top_k most "
        "likely next tokens at each position (largest first), at the rollouts' temperature "
        "(or teacher.temperature) before truncation, detached", lambda b, o: o["teacher_topk_logprobs"]),
    "entropy": LoopInput(
        "policy", "token", "the entropy of the distribution each action token was drawn from "
        "(the policy at the start of the step), detached", lambda b, o: o["entropy"]),
    "ref_logprobs": LoopInput(
        "reference", "token", "the reference policy's log-prob of each sampled token (the "
        "start weights), detached", lambda b, o: o["ref_logprobs"]),
    "switch": LoopInput(
        "env", "turn", "1 where the environment reported a new subgoal (info['subgoal']); "
        "zeros (one segment per episode) when it reports none", _zeros("turn"),
        _stage_starts),
}


def run_inputs(env_reports: dict | None = None, signal_fields: dict | None = None,
               top_k: int = 0) -> dict:
    """This run's table: ``LOOP_INPUTS`` (the teacher's top-K rows at ``token[top_k]``, K =
    ``teacher.top_k`` when it is > 0) plus, for each field the environment declares in
    ``Env.reports`` (name -> description), ``name`` per turn and ``final_<name>`` per
    trajectory, and each field a signal plug-in provides (``signal_fields``: name -> level).
    A fixed row keeps its place when a report or plug-in names it too."""
    table = {n: (dataclasses.replace(s, level=f"token[{top_k}]")
                 if s.level == "token[top_k]" and top_k > 0 else s)
             for n, s in LOOP_INPUTS.items()}
    for name, what in (env_reports or {}).items():
        table.setdefault(name, LoopInput("env", "turn", f"{what} (info['{name}'] of the state "
                                         "each action was taken in)", _zeros("turn")))
        table.setdefault(f"final_{name}", LoopInput(
            "env", "traj", f"{what} (info['{name}'] after the last action)", _zeros("traj")))
    for name, level in (signal_fields or {}).items():
        table.setdefault(name, LoopInput("signal", level, "provided by a signal plug-in"))
    return table


def sources(reads, table: dict | None = None) -> set:
    """The ``SOURCES`` the fields ``reads`` need (from ``table``, default ``LOOP_INPUTS``)."""
    table = LOOP_INPUTS if table is None else table
    return {table[f].source for f in reads if f in table}


def missing_message(field: str, who: str) -> str:
    """Why a field is configured nowhere, naming the config keys that would supply it."""
    if field in LOOP_INPUTS:
        source = LOOP_INPUTS[field].source
        what, key = SOURCES[source]
        return (f"{who} reads extras['{field}'] ({LOOP_INPUTS[field].what}): set {key}")
    return (f"{who} reads extras['{field}'], which no source of this run supplies: an "
            f"environment that reports it (info['{field}'] declared in Env.reports; "
            f"env.name), a signal plug-in that provides it (signals: [{{name: ...}}], loaded "
            f"with imports:), or, offline, records that carry it (`jaxrl-agent credit`)")


def provide(batch: TrajectoryBatch, reads, outputs: dict) -> TrajectoryBatch:
    """The batch with the step-made inputs ``reads`` needs. Model outputs (value head, hidden
    states, teacher log-probs, the policy's entropy: ``outputs``, None where not computed) are
    detached and replace a field the batch already has; a host-side field is only filled in
    (with its zeros stand-in) when the records did not carry it."""
    extras = dict(batch.extras)
    outputs = {k: None if v is None else jax.lax.stop_gradient(v) for k, v in outputs.items()}
    for name in reads:
        spec = LOOP_INPUTS.get(name)
        if spec is None or (spec.source not in STEP_SOURCES and name in extras):
            continue
        extras[name] = spec.step(batch, outputs)
    return batch.replace(extras=extras)


def attach_env_inputs(records: list, reads) -> list:
    """``records`` with the ``env`` inputs of ``reads`` that are made from other recorded
    fields (``LoopInput.from_turns``) written into each turn's ``turn_extras``, where the
    environment reported them and the record does not carry the field already. Records are
    copied, never changed in place (the originals may be saved as they were collected)."""
    wanted = [(n, LOOP_INPUTS[n]) for n in reads
              if n in LOOP_INPUTS and LOOP_INPUTS[n].from_turns is not None]
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
