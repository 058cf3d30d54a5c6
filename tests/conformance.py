"""The conformance table: one row per registered credit method (estimator, shaping or
transform stage) of the package. ``tests/test_conformance.py`` runs every row through the
same battery (padding invariance, group-permutation equivariance, shard invariance on host
devices, degenerate batches, jit equals eager, finite outputs and gradients); the family
module that holds the row's reference compares the function with it on generated batches
(``tests/reference/all_refs.py``). A registered name without a row fails the suite.

A row: the slow reference written from the method's formula, the hyper-parameter settings the
battery runs (each a dict; ``{}`` = the defaults), and whether the method's output follows
the records when they are reordered (``order_free``; False only with a reason).

Settings beyond the defaults are few (every one grows the battery's compiled programs): one
is added where it takes a code path the battery checks that the defaults do not, chiefly
statistics that become batch-wide (psum over the mesh axis: ``normalization="batch"``, HAE's
normalisations, FIPO's std, ADRS's gates), another extra or key (per-token signals, history
or state signatures, merged clusters), or where the defaults are the base bit for bit
(FIPO). The family modules keep only their methods' own invariants and the reference
comparisons over their wider settings tables.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from tests.reference import (allocation_ref, bipace_ref, distill_ref, estimators_ref, graph_ref,
                             hae_ref, routing_ref, shaping_ref, step_ref, tree_ref)
from tests.signals import signal_records


@dataclasses.dataclass(frozen=True)
class Row:
    reference: Callable
    settings: tuple = ({},)
    order_free: bool = True
    why_not_order_free: str = ""


E, S, A, R, D = estimators_ref, shaping_ref, allocation_ref, routing_ref, distill_ref
ROWS = {
    # trajectory-level baselines
    "grpo": Row(E.grpo, ({}, {"singleton": "raw"})),
    "dr_grpo": Row(E.dr_grpo),
    "rloo": Row(E.rloo),
    "reinforce_pp": Row(E.reinforce_pp, ({}, {"gamma": 0.9, "kl_coef": 0.1})),
    "reinforce_pp_baseline": Row(E.reinforce_pp_baseline),
    "spo": Row(E.spo),
    "spo_pp": Row(E.spo_pp),
    "rollout_level": Row(E.rollout_level, ({}, {"row_weighted": True})),
    # returns and critics
    "returns": Row(E.returns, ({"gamma": 0.9},)),
    "gae": Row(E.gae, ({"gamma": 0.9, "lam": 0.8},)),
    "turn_gae": Row(E.turn_gae),
    "lambda_returns": Row(E.lambda_returns, ({}, {"level": "token", "gamma": 0.9})),
    "sapo": Row(E.sapo),
    "hae": Row(hae_ref.hae, ({}, {"normalization": "turn", "gamma": 0.9},
                              {"normalization": "token", "switch_stream": "high"})),
    # step-level groups, graphs and trees
    "gigpo": Row(step_ref.gigpo, ({}, {"anchor": "similar"})),
    "step_group": Row(step_ref.step_group, ({}, {"key": "history", "target": "reward"})),
    "matchtir": Row(step_ref.matchtir),
    "g2po": Row(graph_ref.g2po, ({}, {"normalization": "batch", "episode_weight": 0.5,
                                          "episode_weighting": "steps"})),
    "graphgpo": Row(graph_ref.graphgpo),
    "gagpo": Row(graph_ref.gagpo, ({}, {"normalization": "batch", "gamma": 0.9})),
    "rtmc": Row(tree_ref.rtmc, ({}, {"signature": "state", "target": "outcome"})),
    "tree_value": Row(tree_ref.tree_value, ({}, {"child": "action", "baseline": "siblings"})),
    "progpo": Row(tree_ref.progpo),
    "bipace": Row(bipace_ref.bipace, ({}, {"tau": 0.6, "merge_state_keys": True,
                                               "leave_one_out": True, "singleton": "raw",
                                               "step_normalization": "mean_std_norm"})),
    # dense shaping (before an estimator) and its estimators
    "pbrs": Row(S.pbrs), "uniform": Row(S.uniform), "spa": Row(S.spa), "rebel": Row(S.rebel),
    "red": Row(S.red), "vpr": Row(S.vpr), "nasa": Row(S.nasa), "v_rubrics": Row(S.v_rubrics),
    "reward_to_go": Row(S.reward_to_go), "pica": Row(S.pica),
    # transforms of the shaping family
    "trace": Row(S.trace, ({}, {"normalization": "batch", "accumulate": True})),
    "spae": Row(S.spae), "efca": Row(S.efca), "vtca": Row(S.vtca),
    "procredit": Row(S.procredit), "a2tgpo": Row(S.a2tgpo), "cast": Row(S.cast),
    "oprl": Row(S.oprl), "step_gain": Row(S.step_gain), "ups": Row(S.ups), "capo": Row(S.capo),
    # re-allocation
    "reallocate": Row(A.reallocate, ({}, {"weights": "prefix_scores", "level": "group",
                                          "floor": 0.2, "clip_min": 0.5, "clip_max": 1.5})),
    "trial": Row(A.trial), "stepopsd": Row(A.stepopsd), "cort": Row(A.cort), "rvco": Row(A.rvco),
    "agentopsd": Row(A.agentopsd), "pbsd": Row(A.pbsd), "dcsd": Row(A.dcsd),
    "verpo": Row(A.verpo), "taco": Row(A.taco), "eapo": Row(A.eapo),
    # fipo's default (current = old log-probs) is the base bit for bit: the second setting
    # runs its batch-wide std
    "fipo": Row(A.fipo, ({}, {"current": "contrast_logprobs", "kl": "k3"})),
    "craft_cti": Row(A.craft_cti),
    "adrs": Row(A.adrs, ({}, {"tva": "completion", "gate_normalize": True, "target": "turn"},
                         {"tva": "pas", "baseline": "global", "normalization": "per_seq"})),
    "r3l": Row(A.r3l, ({}, {"baseline": "logavgexp", "r_max": None, "normalize": True})),
    "shuffled_control": Row(A.shuffled_control, order_free=False, why_not_order_free=(
        "the control arm permutes credit at random, with the permutation drawn from the "
        "trajectories' positions in the batch")),
    # routing
    "stamp": Row(R.stamp), "iapo": Row(R.iapo), "self_credit": Row(R.self_credit),
    "triage": Row(R.triage), "vict": Row(R.vict), "echo": Row(R.echo),
    "serl": Row(R.serl, ({}, {"relevance": "prefix_scores", "alpha": 3.0})),  # per token
    "skillgate": Row(R.skillgate), "proas": Row(R.proas), "neos": Row(R.neos),
    "ggpo": Row(R.ggpo, ({}, {"redundant": "prefix_scores"})),  # per token
    "ccpo": Row(R.ccpo), "sharp": Row(R.sharp),
    # distillation
    "opd": Row(D.opd, ({}, {"mask": "selection_mask", "clip": 0.5})),
    "credit": Row(D.credit, ({}, {"level": "sequence"})),
    "seed": Row(D.seed), "cny": Row(D.cny),
}

HIDDEN = 4  # width of the hidden-state stand-ins
NEGATIVES = 2  # M of credit's negative_logprobs [R, T, M]


def conformance_records(seed=0, num_groups=4, group_size=4, **kw):
    """``signals.signal_records`` plus the inputs the training loop supplies
    (``train.inputs.LOOP_INPUTS``), written into the records so they move with them when records
    are reordered or padded: a turn value and per-token values (the value head), high-level
    values, subgoal switches, hidden states and state features."""
    recs = signal_records(seed, num_groups=num_groups, group_size=group_size, **kw)
    rng = np.random.default_rng(seed + 1000)
    for rec in recs:
        for t in rec["turns"]:
            t["value"] = float(rng.normal())
            t["values"] = [float(x) for x in rng.normal(size=len(t["action"]))]
            h = [float(x) for x in rng.normal(size=HIDDEN)]
            t["turn_extras"].update(high_values=float(rng.normal()),
                                    switch=float(rng.random() < 0.3), hidden=h,
                                    state_features=h)
    return recs


def with_negatives(batch):
    """credit's ``negative_logprobs`` [R, T, M], a function of each token's own fields (so it
    follows the records however they are packed)."""
    import jax.numpy as jnp
    t = batch.extras["teacher_logprobs"]
    neg = jnp.stack([t - 0.3, 1.1 * batch.old_logprobs][:NEGATIVES], axis=-1)
    neg = jnp.where(batch.action_mask[..., None], neg, 0.0)
    return batch.replace(extras=dict(batch.extras, negative_logprobs=neg))
