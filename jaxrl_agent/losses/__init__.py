"""Losses for multi-turn agent RL: policy (PPO-clip family), KL, entropy, value.

Every loss returns ``(sum, denominator)`` instead of a mean; add the pairs over micro-batches
and devices, then divide once (``safe_ratio``). See ``aggregation`` and ``docs/losses.md``.

Each loss is registered at its definition (``@register(name, kind="loss")``, see
``jaxrl_agent.registry``); ``get(name)`` -> function, ``names()`` -> the valid names.
"""

from __future__ import annotations

import inspect as _inspect

from jaxrl_agent.losses.aggregation import (AGG_MODES, add_pairs, aggregate, check_mode,
                                            safe_ratio)
from jaxrl_agent.losses.kl import (entropy, entropy_from_logits, k1, k1_st, k2, k3, k3_st,
                                   kl_k1, kl_k1_st, kl_k2, kl_k3, kl_k3_st)
from jaxrl_agent.losses.policy import (advantage_array, cispo, clipped_surrogate, gspo,
                                       gspo_log_ratio, log_ratio, policy_metrics, ppo,
                                       reinforce, soft_gate, soft_gate_fn,
                                       truncated_is_weights)
from jaxrl_agent.losses.value import sarsa, value
from jaxrl_agent.losses.objective import sapo_terms, weighted_total
from jaxrl_agent.losses import distill
from jaxrl_agent import registry as _registry

#: the inputs the train step makes for a loss that names them in its signature: the run's
#: per-token advantages [R, T] (stop-gradient) and the student's log-probs of the teacher's
#: top-K ids [R, T, K] (differentiable; with ``teacher.top_k``)
STEP_GIVEN = ("advantages", "student_topk_logprobs")


def names() -> tuple:
    """The registered loss names (the package's and those of imported plug-ins)."""
    return tuple(_registry.names("loss"))


def get(name: str):
    """The loss function registered under ``name``; ``ValueError`` listing the names if none."""
    if not isinstance(name, str):
        raise ValueError(f"unknown loss {name!r}; valid names: {names()}")
    return _registry.lookup(name, "loss").fn


def step_given(fn, **available) -> dict:
    """Of ``available`` (``STEP_GIVEN`` names -> arrays), those ``fn``'s signature names: what
    the train step (and the run checks' trace) pass to a loss beyond ``(logprobs, batch)``."""
    unknown = sorted(set(available) - set(STEP_GIVEN))
    if unknown:
        raise ValueError(f"step_given: unknown inputs {unknown}; known: {STEP_GIVEN}")
    names = _inspect.signature(fn).parameters
    return {k: v for k, v in available.items() if k in names}


__all__ = [
    "distill",
    "AGG_MODES", "add_pairs", "advantage_array", "aggregate", "check_mode", "cispo",
    "clipped_surrogate", "entropy", "entropy_from_logits", "get", "gspo", "gspo_log_ratio",
    "k1", "k1_st", "k2", "k3", "k3_st", "kl_k1", "kl_k1_st", "kl_k2", "kl_k3", "kl_k3_st",
    "log_ratio", "names", "policy_metrics", "ppo", "reinforce", "safe_ratio", "soft_gate",
    "soft_gate_fn", "sapo_terms", "sarsa", "STEP_GIVEN", "step_given", "truncated_is_weights",
    "value",
    "weighted_total",
]
