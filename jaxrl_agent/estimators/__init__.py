"""Credit-assignment estimators: pure functions ``f(batch, *, ..., axis_name=None) -> Advantages``.

Look them up by name with ``get(name)``; ``names()`` lists them; ``compute(name, batch, **hp)``
validates the batch and runs one jitted.
"""

from jaxrl_agent.estimators.outcome import (
    SPOState, check_spo_state, group_centered_outcome, group_normalized_outcome, leave_one_out_outcome,
    reinforce_pp, reinforce_pp_baseline, rollout_level, single_stream, single_stream_pp,
    spo_init, traj_advantages)
from jaxrl_agent.estimators import allocation, routing, shaping
from jaxrl_agent.losses import distill as _distill
from jaxrl_agent.estimators.allocation import (normalize_weights, reallocate, shuffle_weights,
                                               shuffled_control, token_weights)
from jaxrl_agent.estimators.bipace import bipace
from jaxrl_agent.estimators.graph import g2po, gagpo, graphgpo
from jaxrl_agent.estimators.hierarchical import hae, hae_streams
from jaxrl_agent.estimators.registry import (
    KINDS, EstimatorSpec, Pipeline, check_hyper_params, compute, get, names, register, spec)
from jaxrl_agent.estimators.step_group import (
    episode_advantage, gigpo, matchtir, normalize_in_groups, step_group, step_returns)
from jaxrl_agent.estimators.temporal import (
    discounted_returns, gae, lambda_returns, sapo, turn_gae)
from jaxrl_agent.estimators.tree import progpo, rtmc, tree_value

register("grpo", group_normalized_outcome)
register("dr_grpo", group_centered_outcome)
register("rloo", leave_one_out_outcome)
register("reinforce_pp", reinforce_pp)
register("reinforce_pp_baseline", reinforce_pp_baseline)
register("spo", single_stream, stateful=True, init_state=spo_init, check_state=check_spo_state)
register("spo_pp", single_stream_pp, stateful=True, init_state=spo_init,
         check_state=check_spo_state)
register("rollout_level", rollout_level)
register("returns", discounted_returns)
register("gae", gae)
register("turn_gae", turn_gae)
register("lambda_returns", lambda_returns)
register("sapo", sapo)
# family (b): step-level groups, graphs and trees; HiPER's hierarchical advantages
register("gigpo", gigpo)
register("step_group", step_group)
register("matchtir", matchtir)
register("g2po", g2po)
register("graphgpo", graphgpo)
register("gagpo", gagpo)
register("rtmc", rtmc)
register("tree_value", tree_value)
register("progpo", progpo)
register("bipace", bipace)
register("hae", hae)
# families (d), (e): dense shaping and re-allocation (each module lists what it registers)
for _module in (shaping, allocation, routing, _distill):
    for _kind, _table in (("estimator", "ESTIMATORS"), ("shaping", "SHAPINGS"),
                          ("transform", "TRANSFORMS")):
        for _name, _fn in getattr(_module, _table, {}).items():
            register(_name, _fn, kind=_kind)

__all__ = [
    "KINDS", "Pipeline", "allocation", "routing", "shaping", "normalize_weights", "reallocate", "shuffle_weights",
    "shuffled_control", "token_weights",
    "bipace", "episode_advantage", "g2po", "gagpo", "gigpo", "graphgpo", "hae", "hae_streams", "matchtir",
    "normalize_in_groups", "progpo", "rtmc", "step_group", "step_returns", "tree_value",
    "SPOState", "EstimatorSpec", "check_spo_state", "check_hyper_params", "compute", "discounted_returns", "gae",
    "get", "group_centered_outcome", "group_normalized_outcome", "lambda_returns",
    "leave_one_out_outcome", "names", "register", "reinforce_pp", "reinforce_pp_baseline",
    "rollout_level", "sapo", "single_stream", "single_stream_pp", "spec", "spo_init",
    "traj_advantages", "turn_gae",
]
