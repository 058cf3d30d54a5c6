"""Composing loss terms: the SAPO actor-critic objective and weighted sums of terms.

Terms stay ``(sum, denominator)`` pairs until the caller has added them over micro-batches
and devices; ``weighted_total`` then divides each and applies the coefficients.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_agent import segments
from jaxrl_agent.losses.aggregation import safe_ratio
from jaxrl_agent.losses.policy import ppo
from jaxrl_agent.losses.value import sarsa, value


def sapo_terms(logprobs, values, batch, advantages, *, gamma: float = 1.0, policy_loss=ppo,
               **policy_kw) -> dict:
    """The three terms of SAPO (Single-rollout Autoregressive PO), as ``(sum, denom)`` pairs.

    L = L_policy + c_v L_V + c_q L_SARSA, with one value head on the policy's backbone read at
    two causal boundaries:
      V_k = values read before action k (the last observation token),
      Q_k = values read at action k's last token,
    ``values`` [R, T] being the head's output at each position (``models.policy_forward(...,
    value_alignment="at_token")``).
      * ``policy``: ``policy_loss(logprobs, batch, advantages, **policy_kw)`` (PPO by default);
      * ``value``: 0.5 (V_k - sg(G^lam_k))^2 over turns, targets ``advantages.turn_returns``
        (from ``estimators.sapo``);
      * ``sarsa``: 0.5 (Q_k - sg(r_k + gamma Q_{k+1}))^2 over turns (``losses.sarsa``).
    """
    if getattr(advantages, "turn_returns", None) is None:
        raise ValueError("sapo_terms needs advantages with turn_returns (use estimators.sapo)")
    v_turn = segments.turn_values_from_tokens(values, batch, "before_action")
    q_turn = segments.turn_values_from_tokens(values, batch, "last_action")
    return {
        "policy": policy_loss(logprobs, batch, advantages, **policy_kw),
        "value": value(v_turn, advantages.turn_returns, batch.turn_mask),
        "sarsa": sarsa(q_turn, batch, gamma=gamma),
    }


def weighted_total(terms: dict, coefs: dict):
    """sum_name coefs[name] * sum_name / denom_name over the terms named in ``coefs`` (a term
    with denominator 0 contributes 0). Unknown names in ``coefs`` are an error."""
    missing = sorted(set(coefs) - set(terms))
    if missing:
        raise ValueError(f"coefficients for unknown terms {missing}; terms: {sorted(terms)}")
    return sum(jnp.asarray(c, jnp.float32) * safe_ratio(*terms[name])
               for name, c in coefs.items())
