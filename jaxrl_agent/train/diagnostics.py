"""What a step's episodes did and where its credit went: host-side diagnostics from the
step's records (``rollout.collect``'s format) and its per-turn credit (``samples.turn_credit``).

These are the quantities a collapse of RL below its warm start is diagnosed with (docs/
training.md, "Why RL fell below its warm start"): whether the policy loops or stalls, how many
episodes time out, and how much of the step's advantage mass comes from episodes and groups
that failed. Pure numpy; every function takes the records of one step.
"""

from __future__ import annotations

import numpy as np

__all__ = ["episode_metrics", "credit_metrics", "shuffled_outcomes"]


def episode_metrics(records) -> dict:
    """Per step, over the trajectories of ``records`` (each turn's ``state_key`` is the key of
    the state the agent acted in):

    * ``train/truncated``: the share of trajectories ended by ``max_turns`` (or the context
      limit) rather than by the environment;
    * ``train/noop_turns``: the share of turns after which the state was the same (a move into
      a wall, an action that does nothing): turn k + 1's key equals turn k's;
    * ``train/repeat_turns``: the share of turns acted in a state the trajectory had already
      been in (loops; no-ops count too).

    Turn shares are over turns that have a successor (the last turn's effect is not
    recorded). Empty records give an empty dict."""
    if not records:
        return {}
    trunc = float(np.mean([bool(r.get("truncated")) for r in records]))
    noop = repeat = pairs = 0
    for r in records:
        keys = [t.get("state_key") for t in r["turns"]]
        seen = set()
        for k, key in enumerate(keys):
            if k > 0:
                repeat += key in seen
            seen.add(key)
        for a, b in zip(keys, keys[1:]):
            noop += a == b
            pairs += 1
    return {"train/truncated": trunc,
            "train/noop_turns": noop / max(pairs, 1),
            "train/repeat_turns": repeat / max(pairs, 1)}


def credit_metrics(records, turn) -> dict:
    """Where the step's credit went. ``turn``: [N, K] per-turn credit of the records' N
    trajectories (row i is ``records[i]``; turns past a trajectory's end are ignored). With
    |A| summed over each trajectory's turns (the mass an update moves its tokens by):

    * ``train/credit_failed``: the share of the mass on trajectories that failed
      (``success == 0``);
    * ``train/credit_no_success_groups``: the share on groups in which no trajectory
      succeeded: their credit can only come from reward differences among failures (an
      invalid-move penalty, shaping), never from reaching the goal;
    * ``train/credit_failed_signed``: the signed sum of credit on failed trajectories over the
      mass (negative: failures pushed down on the whole; positive: some failures pushed up,
      as the clean failures of a group with one penalised failure are).

    0 mass (every advantage 0) gives zeros."""
    turn = np.asarray(turn, dtype=np.float64)
    if not records:
        return {}
    n = len(records)
    mass = np.zeros(n)
    signed = np.zeros(n)
    for i, r in enumerate(records):
        k = min(len(r["turns"]), turn.shape[1])
        mass[i] = np.abs(turn[i, :k]).sum()
        signed[i] = turn[i, :k].sum()
    failed = np.array([float(r.get("success", 0.0)) <= 0.0 for r in records])
    groups = np.array([r["group"] for r in records])
    won = {g for g, f in zip(groups, failed) if not f}
    no_success = np.array([g not in won for g in groups])
    total = mass.sum()
    if total <= 0:
        return {"train/credit_failed": 0.0, "train/credit_no_success_groups": 0.0,
                "train/credit_failed_signed": 0.0}
    return {"train/credit_failed": float(mass[failed].sum() / total),
            "train/credit_no_success_groups": float(mass[no_success].sum() / total),
            "train/credit_failed_signed": float(signed[failed].sum() / total)}


def shuffled_outcomes(records, seed: int) -> list:
    """A null control: ``records`` with their episode returns permuted across all of the step's
    episodes (across groups too), so the credit keeps its size and distribution and loses any
    relation to what the policy did. Each returned record's ``outcome`` is another episode's
    return (its ``outcome``, else the sum of its turn rewards) and its turn rewards are 0 but
    the last, which carries that return; everything else (``success`` included) is the
    record's own. An outcome-level method (GRPO and its kin) then sees exactly a permutation of
    the step's returns. The inputs are not modified; one record or none comes back unchanged.

    If RL falls below its warm start as fast with this control as with the true returns, the
    fall comes from the updates' size and noise, not from what the credit says."""
    records = list(records)
    if len(records) < 2:
        return records
    returns = [float(r["outcome"]) if "outcome" in r else
               float(sum(t.get("reward", 0.0) for t in r["turns"])) for r in records]
    order = np.random.default_rng(seed).permutation(len(records))
    out = []
    for r, j in zip(records, order):
        turns = [dict(t, reward=0.0) for t in r["turns"]]
        if turns:
            turns[-1]["reward"] = returns[j]
        out.append(dict(r, outcome=returns[j], turns=turns))
    return out
