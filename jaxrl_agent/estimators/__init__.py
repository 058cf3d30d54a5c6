"""Credit-assignment estimators: pure functions ``f(batch, *, ..., axis_name=None) -> Advantages``.

Each is registered at its definition (``@register(name, kind=..., reads=...)``, see
``jaxrl_agent.registry``); importing this package registers every family. Look them up by
name with ``get(name)`` / ``spec(name)``; ``names()`` lists them; ``compute(name, batch, **hp)``
validates the batch and runs one jitted; ``Pipeline`` composes shaping -> estimator ->
transforms.
"""

from jaxrl_agent.estimators.outcome import (
    SPOState, check_spo_state, group_centered_outcome, group_normalized_outcome, leave_one_out_outcome,
    reinforce_pp, reinforce_pp_baseline, rollout_level, single_stream, single_stream_pp,
    spo_init, traj_advantages)
from jaxrl_agent.estimators import allocation, distill, routing, shaping
from jaxrl_agent.estimators.allocation import (normalize_weights, reallocate, shuffle_weights,
                                               shuffled_control, token_weights)
from jaxrl_agent.estimators.bipace import bipace
from jaxrl_agent.estimators.graph import g2po, gagpo, graphgpo
from jaxrl_agent.estimators.hierarchical import hae, hae_streams
from jaxrl_agent.estimators.registry import (
    KINDS, EstimatorSpec, MissingInput, Pipeline, check_hyper_params, compute, get, names, reads,
    register, spec)
from jaxrl_agent.estimators.step_group import (
    episode_advantage, gigpo, matchtir, normalize_in_groups, step_group, step_returns)
from jaxrl_agent.estimators.temporal import (
    discounted_returns, gae, lambda_returns, sapo, turn_gae)
from jaxrl_agent.estimators.tree import progpo, rtmc, tree_value

__all__ = [
    "KINDS", "Pipeline", "allocation", "distill", "routing", "shaping", "normalize_weights",
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
