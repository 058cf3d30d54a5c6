"""Credit-assignment estimators: pure functions ``f(batch, *, ..., axis_name=None) -> Advantages``.

Each is registered at its definition (``@register(name, kind=..., reads=...)``, see
``jaxrl_agent.registry``); importing this package registers every family. Look them up by
name with ``get(name)`` / ``spec(name)``; ``names()`` lists them; ``compute(name, batch, **hp)``
validates the batch and runs one jitted; ``Pipeline`` composes shaping -> estimator ->
transforms. Every key also answers to a descriptive name (``jaxrl-agent estimators`` lists
them: ``grpo`` is ``group_normalized_outcome``).

Where is what (family file: registered names by kind; family files import only
``primitives``, never each other):

==================  =========================================================================
``primitives``      shared kernels: ``traj_advantages``, ``episode_advantage``,
                    ``step_returns``, ``normalize_in_groups``, ``combine``, ``token_weights``,
                    ``apply_token_weights``, ``normalize_weights``, ``shuffle_weights``,
                    ``valid_tokens``, ``token_trajectories``, ``potential_differences``,
                    ``potential_terms``, ``normalize_turns``, ``cohort_ids``,
                    ``check_episode_args``
``outcome``         trajectory-level baselines: grpo, dr_grpo, rloo, reinforce_pp,
                    reinforce_pp_baseline, rollout_level, spo, spo_pp, r3l
``temporal``        returns and critics: returns, gae, turn_gae, lambda_returns, sapo
``hierarchical``    hae (high- and low-level critics over subgoals)
``step_group``      step-level groups: gigpo, step_group, matchtir
``graph``           state graphs: g2po, graphgpo, gagpo
``tree``            rollout trees: rtmc, tree_value, progpo
``bipace``          hidden-state clusters with peer baselines: bipace
``shaping``         dense rewards before an estimator (pbrs, uniform, spa, rebel, red, vpr,
                    nasa, v_rubrics, adrs) and estimators built on them (reward_to_go, pica)
``turn_credit``     per-turn terms and factors on a base advantage (trace, spae, efca, vtca,
                    procredit, a2tgpo, cast, oprl, step_gain, ups, capo)
``allocation``      re-allocation transforms (reallocate, trial, stepopsd, cort, rvco,
                    agentopsd, pbsd, dcsd, verpo, taco, eapo, fipo, craft_cti,
                    shuffled_control)
``routing``         label-, citation- and graph-driven routing transforms (stamp, iapo,
                    self_credit, triage, vict, echo, serl, skillgate, proas, neos, ggpo) and
                    the multi-agent estimators ccpo, sharp
``distill``         distillation as advantages: opd, credit (estimators), seed, cny
                    (transforms); the distillation losses are in ``jaxrl_agent.losses``
``pipeline``        lookup by name, hyper-parameter checks, ``Pipeline``, ``compute`` (the
                    registry itself is ``jaxrl_agent.registry``)
==================  =========================================================================

Every named signal a method reads (teacher log-probs, scores, potentials) goes through
``jaxrl_agent.checks.read_field`` with ``stop_gradient=True``: credit never passes gradient
to a learned signal (rewards, behaviour log-probs and critic values are data, as in rlax).
"""

from jaxrl_agent.estimators.primitives import (
    episode_advantage, normalize_in_groups, normalize_weights, shuffle_weights, step_returns,
    token_weights, traj_advantages)
from jaxrl_agent.estimators.outcome import (
    SPOState, check_spo_state, group_centered_outcome, group_normalized_outcome, leave_one_out_outcome,
    reinforce_pp, reinforce_pp_baseline, rollout_level, single_stream, single_stream_pp,
    spo_init)
from jaxrl_agent.estimators import (allocation, distill, primitives, routing, shaping,
                                    turn_credit)
from jaxrl_agent.estimators.allocation import reallocate, shuffled_control
from jaxrl_agent.estimators.bipace import bipace
from jaxrl_agent.estimators.graph import g2po, gagpo, graphgpo
from jaxrl_agent.estimators.hierarchical import hae, hae_streams
from jaxrl_agent.estimators.pipeline import (
    KINDS, EstimatorSpec, MissingInput, Pipeline, check_hyper_params, compute, get, names, reads,
    register, spec)
from jaxrl_agent.estimators.step_group import gigpo, matchtir, step_group
from jaxrl_agent.estimators.temporal import (
    discounted_returns, gae, lambda_returns, sapo, turn_gae)
from jaxrl_agent.estimators.tree import progpo, rtmc, tree_value

__all__ = [
    "KINDS", "Pipeline", "allocation", "distill", "primitives", "routing", "shaping", "turn_credit",
    "normalize_weights",
    "reallocate", "shuffle_weights", "shuffled_control", "token_weights",
    "bipace", "episode_advantage", "g2po", "gagpo", "gigpo", "graphgpo", "hae", "hae_streams", "matchtir",
    "normalize_in_groups", "progpo", "rtmc", "step_group", "step_returns", "tree_value",
    "SPOState", "EstimatorSpec", "MissingInput", "check_spo_state", "check_hyper_params",
    "compute", "discounted_returns", "gae",
    "get", "group_centered_outcome", "group_normalized_outcome", "lambda_returns",
    "leave_one_out_outcome", "names", "reads", "register", "reinforce_pp",
    "reinforce_pp_baseline", "rollout_level", "sapo", "single_stream", "single_stream_pp",
    "spec", "spo_init", "traj_advantages", "turn_gae",
]
