"""Rollout records that carry every signal the shaping, re-allocation and distillation
families read by default (teacher log-probs, potentials, progress, labels, edges, ...), so
that one batch can run every registered name of every kind. Used by the cross-cutting tests
(padding of every kind in test_batch.py, the CLI on examples/signal_rollouts.jsonl) and by
examples/make_signal_rollouts.py.

Vector trajectory signals have widths that differ from the padded turn count (3 agents, 8
coalitions, 3 rubric items) so no shape can be mistaken for another.
"""

from __future__ import annotations

import numpy as np

AGENTS, RUBRIC_ITEMS = 3, 3


def _labels(rng, n, values):
    return [float(x) for x in rng.choice(values, n)]


def add_signals(rng, rec):
    """Adds every default signal field to a record (in place) and returns it."""
    turns = rec["turns"]
    k = len(turns)
    progress = np.sort(rng.random(k + 1))  # mostly rising, as checks get passed
    potential = rng.normal(size=k + 1)
    acc, conf = rng.random(k), rng.random(k)
    for j, t in enumerate(turns):
        n = len(t["action"])
        lp = t.setdefault("logprobs", [float(-abs(x)) for x in rng.normal(size=n)])
        t.setdefault("ref_logprobs", [float(min(x + rng.normal(0, 0.2), 0.0)) for x in lp])
        t["turn_extras"] = {
            "weights": float(rng.random()), "potential": float(potential[j]),
            "step_potential": float(1.5 * acc[j] * conf[j] + 0.5 * acc[j] - conf[j]),
            "acc": float(acc[j]), "conf": float(conf[j]), "progress": float(progress[j]),
            "feedback": _labels(rng, 1, [-1.0, 0.0, 1.0])[0],
            "oracle_advantage": float(rng.integers(-2, 3)),
            "contribution": float(rng.normal(0.2, 0.2)), "grounded": float(rng.random() < .7),
            "belief_state": float(rng.random()), "belief_task": float(rng.random()),
            "belief_pred": float(rng.random()), "belief_format": float(rng.random() < .9),
            "verified": float(rng.random() < .5), "evidence": float(rng.random()),
            "necessity": float(rng.random()), "alignment": float(rng.random()),
            "step_verdict": _labels(rng, 1, [-1.0, 0.0, 1.0])[0], "probe": float(rng.random()),
            "tree_credit": float(rng.normal(0, 0.3)),
            "supported_citations": float(rng.integers(0, 3)), "cite": float(rng.random() < .4),
            "role": float(rng.integers(0, 4)), "relevance": float(rng.random()),
            "atoms": float(rng.integers(0, 3)), "selected": float(rng.random() < .4),
            "reasonable": float(rng.random() < .7), "deviation": float(rng.integers(0, 3)),
            "redundant": float(rng.random() < .3), "agent": float(rng.integers(0, AGENTS)),
        }
        t["token_extras"] = {
            "teacher_logprobs": [float(x + rng.normal(0, 0.5)) for x in lp],
            "entropy": [float(abs(x)) for x in rng.normal(1.0, 0.5, n)],
            "prm_logprobs": [float(-abs(x)) for x in rng.normal(size=n)],
            "contrast_logprobs": [float(-abs(x)) for x in rng.normal(size=n)],
            "prefix_scores": [float(x) for x in rng.random(n)],
            "selection_mask": [bool(x) for x in rng.random(n) < 0.5],
            "skill_mask": [bool(x) for x in rng.random(n) < 0.3],
        }
    starts = rng.integers(0, 4, RUBRIC_ITEMS)
    rec["traj_extras"] = {
        "final_potential": float(potential[k]), "final_progress": float(progress[k]),
        "score": float(rng.random()), "initial_score": float(rng.random()),
        "view": float(rng.random() < 0.5), "read_correct": _labels(rng, 1, [-1.0, 0.0, 1.0])[0],
        "trace_complete": float(rng.random() < 0.8),
        "divergence_step": float(rng.integers(-1, k)),
        "rubric_scores": [float(x) for x in rng.random(RUBRIC_ITEMS)],
        "rubric_start": [float(x) for x in starts],
        "rubric_end": [float(x) for x in np.where(rng.random(RUBRIC_ITEMS) < .2, -1,
                                                  starts + rng.integers(0, 3, RUBRIC_ITEMS))],
        "counterfactual_outcome": [float(x) for x in rng.random(AGENTS)],
        "coalition_values": [float(x) for x in np.r_[0.0, rng.random(2 ** AGENTS - 1)]],
    }
    rec["edges"] = [[int(s), int(d), int(rng.integers(0, 2))]
                    for d in range(1, k) for s in range(d) if rng.random() < 0.5]
    return rec


def signal_records(seed=0, num_groups=4, group_size=4, max_turns=4, max_act=3, max_obs=3):
    """Records of ``num_groups`` tasks x ``group_size`` rollouts with 1..max_turns turns,
    binary outcomes (every group mixed) and every signal of ``add_signals``."""
    rng = np.random.default_rng(seed)
    recs = []
    for g in range(num_groups):
        for j in range(group_size):
            turns = []
            for _ in range(int(rng.integers(1, max_turns + 1))):
                turns.append({
                    "observation": [int(x) for x in rng.integers(0, 3, rng.integers(1, max_obs + 1))],
                    "action": [int(x) for x in rng.integers(0, 50, rng.integers(1, max_act + 1))],
                    "reward": float(np.round(rng.normal(0, 0.3), 3))})
            outcome = float(j % 2 if j < 2 else rng.integers(0, 2))
            recs.append(add_signals(rng, {"group": f"task{g}", "task": f"task{g}",
                                          "outcome": outcome, "turns": turns}))
    return recs


def family_names() -> list:
    """Every registered name of the shaping, per-turn credit, re-allocation, routing and
    distillation modules."""
    from jaxrl_agent.estimators import allocation, distill, routing, shaping, turn_credit
    from tests.registered import defined_in
    return sorted({n for m in (shaping, turn_credit, allocation, routing, distill)
                   for n in defined_in(m)})


# Names that cannot run on records alone, with the reason (their inputs are no record field).
NOT_FROM_RECORDS = {
    "credit": "negatives [R, T, M] (teacher log-probs under other inputs) come from an extra "
              "teacher pass, not from records",
}
