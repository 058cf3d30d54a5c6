"""Returns, GAE and lambda-returns, at token level (multi-turn masked) and at turn level.

Rewards: a turn's reward sits on the last action token of that turn (``segments.token_rewards``;
``extras['token_rewards']`` adds dense token rewards). Values come from
``extras['token_values']`` [R, T] (a record turn's ``values``) or ``extras['turn_values']``
[N, K] (a record turn's ``value``, read before the action). Episodes end after their last
valid turn: the value past it is 0.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import check_choice, check_unit, require
from jaxrl_agent.registry import register

# What the critic estimators read: the value head's estimates (the train step supplies both; a
# record's turn 'value' / token 'values' give them offline). Either one is enough.
VALUE_READS = ("token_values", "turn_values")

_TURN_VALUES = "[N, K] per-turn values: give each record turn a 'value'"


def _token_values(b: TrajectoryBatch, who: str):
    if "token_values" in b.extras:
        return jnp.where(b.action_mask, b.extras["token_values"], 0.0)
    if "turn_values" in b.extras:  # a per-turn value serves every token of its turn
        return segments.turn_to_token(b.extras["turn_values"].astype(jnp.float32), b)
    raise ValueError(f"{who} needs values: extras['token_values'] [R, T] (a record turn's "
                     f"'values', one per action token) or extras['turn_values'] {_TURN_VALUES}; "
                     f"the batch has extras: {sorted(b.extras) or 'none'}")


def _next_turn(x):
    return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


@register("returns")
def discounted_returns(batch: TrajectoryBatch, *, gamma: float = 1.0,
                       axis_name=None) -> Advantages:
    """Per-turn reward-to-go G_k = r_k + gamma G_{k+1} (G past the last turn = 0).

    The discount is per turn. ``turn`` and ``turn_returns`` are G; ``token`` broadcasts it.

    Args:
      batch: reads ``turn_rewards`` and ``turn_mask`` [N, K] (N trajectories x K turns).
      gamma: per-turn discount, in [0, 1].
      axis_name: the mesh axis under ``shard_map`` (nothing is reduced across it), or None.

    Returns:
      ``Advantages`` with ``turn`` = ``turn_returns`` = G [N, K] (0 on missing turns) and
      ``token`` [R, T] (G_k on the action tokens of turn k, 0 elsewhere).
    """
    check_unit("gamma", gamma)
    b = segments.local_view(batch, axis_name)
    r = jnp.where(b.turn_mask, b.turn_rewards, 0.0).astype(jnp.float32)
    g = jnp.where(b.turn_mask, segments.reverse_scan(r, gamma, axis=1), 0.0)
    return Advantages(token=segments.turn_to_token(g, b), turn=g, turn_returns=g)


@register("gae", aliases=("generalized_advantage",), reads=VALUE_READS,
          renamed={"whiten": "normalize"})
def gae(batch: TrajectoryBatch, *, gamma: float = 1.0, lam: float = 1.0,
        normalize: bool = True, eps: float = 1e-8, axis_name=None) -> Advantages:
    """Token-level GAE over multi-turn rows (verl's masked GAE, layout-independent).

    Along each trajectory's action tokens in order (observation tokens skipped):
      delta_t = r_t + gamma V_next(t) - V_t,   A_t = delta_t + gamma lam A_next(t),
    where next(t) is the next action token of the trajectory (in the same row or the row of the
    following turn) and V, A past the last action token are 0. Observation tokens carry the
    bootstrap value and the running advantage through unchanged, so inserting them anywhere
    changes nothing. returns = A + V (value targets). With ``normalize``, A is standardised
    token-weighted over the batch (across ``axis_name``): (A - mean) / sqrt(var + eps).
    Limits: lam = 1 gives A = G - V; lam = 0 gives A = delta; V = 0, gamma = lam = 1 gives the
    reward-to-go. Schulman et al. 2016.

    Args:
      batch: reads ``turn_rewards`` [N, K], ``action_mask`` and ``turn_ids`` [R, T],
        ``row_traj`` [R], optional extras['token_rewards'] [R, T], and the values:
        extras['token_values'] [R, T], or else extras['turn_values'] [N, K] (one value for
        every token of its turn).
      gamma: per-token discount, in [0, 1].
      lam: the GAE lambda, in [0, 1].
      normalize: standardise A over the batch's action tokens (True) or leave it raw (False).
        Former name ``whiten``.
      eps: added to the variance of the standardisation.
      axis_name: the mesh axis under ``shard_map``: the standardisation reduces across it, or
        None.

    Returns:
      ``Advantages`` with ``token`` [R, T] (A, standardised if ``normalize``) and
      ``token_returns`` [R, T] (A + V, raw), both 0 outside ``action_mask``.
    """
    check_unit("gamma", gamma)
    check_unit("lam", lam)
    b = segments.local_view(batch, axis_name)
    v = _token_values(b, "gae")
    r = segments.token_rewards(b)
    _, v_next = segments.trajectory_reverse_scan(v, 0.0, b)
    delta = r + gamma * v_next - v
    adv, _ = segments.trajectory_reverse_scan(delta, gamma * lam, b)
    m = b.action_mask
    token = (segments.masked_whiten(adv, m, axis_name, eps) if normalize
             else jnp.where(m, adv, 0.0))
    return Advantages(token=token, token_returns=jnp.where(m, adv + v, 0.0))


def _turn_values(b, who):
    v = require(b, "turn_values", who, _TURN_VALUES)
    return jnp.where(b.turn_mask, v, 0.0).astype(jnp.float32)


def _turn_gae_raw(b, gamma, lam, v):
    r = jnp.where(b.turn_mask, b.turn_rewards, 0.0).astype(jnp.float32)
    delta = jnp.where(b.turn_mask, r + gamma * _next_turn(v) - v, 0.0)
    return jnp.where(b.turn_mask, segments.reverse_scan(delta, gamma * lam, axis=1), 0.0)


@register("turn_gae", aliases=("turn_generalized_advantage",), reads=VALUE_READS,
          renamed={"normalize": "normalization"})
def turn_gae(batch: TrajectoryBatch, *, gamma: float = 1.0, lam: float = 1.0,
             normalization: str = "token", eps: float = 1e-8, axis_name=None) -> Advantages:
    """Turn-level GAE: the same recursion over turns with one value per turn.

    delta_k = r_k + gamma V_{k+1} - V_k (V past the last turn = 0);
    A_k = delta_k + gamma lam A_{k+1}; returns_k = A_k + V_k.
    ``normalization``: ``"token"`` standardises A weighted by each turn's action tokens (what a
    token-mean loss sees), ``"turn"`` over valid turns, ``"none"`` leaves it. Used by HiPER,
    GAGPO and SAPO.

    Args:
      batch: reads ``turn_rewards`` and ``turn_mask`` [N, K] and extras['turn_values']
        [N, K], V_k read before action k; ``action_mask``, ``turn_ids`` [R, T] and
        ``row_traj`` [R] for the token weights and the broadcast.
      gamma: per-turn discount, in [0, 1].
      lam: the GAE lambda, in [0, 1].
      normalization: ``"token"``, ``"turn"`` or ``"none"`` (above); (A - mean) / sqrt(var + eps)
        over the whole batch.
      eps: added to the variance.
      axis_name: the mesh axis under ``shard_map``: the standardisation reduces across it, or
        None.

    Returns:
      ``Advantages`` with ``turn`` [N, K] (A, standardised per ``normalization``), ``token``
      [R, T] (that A on turn k's action tokens) and ``turn_returns`` [N, K] (A + V, raw); 0 on
      missing turns and outside ``action_mask``.
    """
    check_unit("gamma", gamma)
    check_unit("lam", lam)
    check_choice("normalization", normalization, ("token", "turn", "none"))
    b = segments.local_view(batch, axis_name)
    v = _turn_values(b, "turn_gae")
    adv = _turn_gae_raw(b, gamma, lam, v)
    if normalization == "token":
        w = segments.turn_token_counts(b) * b.turn_mask
        mu, var = segments.weighted_mean_var(adv, w, axis_name)
        adv_n = jnp.where(b.turn_mask, (adv - mu) * jnp.reciprocal(jnp.sqrt(var + eps)), 0.0)
    elif normalization == "turn":
        adv_n = segments.masked_whiten(adv, b.turn_mask, axis_name, eps)
    else:
        adv_n = adv
    returns = jnp.where(b.turn_mask, adv + v, 0.0)
    return Advantages(token=segments.turn_to_token(adv_n, b), turn=adv_n, turn_returns=returns)


@register("lambda_returns", reads=VALUE_READS)
def lambda_returns(batch: TrajectoryBatch, *, gamma: float = 1.0, lam: float = 1.0,
                   level: str = "turn", axis_name=None) -> Advantages:
    """Lambda-returns G^lam_t = r_t + gamma ((1 - lam) V_{t+1} + lam G^lam_{t+1}) = A^GAE_t + V_t.

    The return itself is the signal (no baseline): use it as a value target or as a
    baseline-free advantage. ``level="turn"`` uses turn values and gives ``turn``;
    ``level="token"`` runs over action tokens like ``gae``. lam = 1 gives the discounted
    return, lam = 0 the one-step TD target.

    Args:
      batch: ``level="turn"`` reads ``turn_rewards``, ``turn_mask`` and extras['turn_values']
        [N, K]; ``level="token"`` reads what ``gae`` reads (extras['token_values'] [R, T] or
        extras['turn_values'] [N, K]).
      gamma: discount per turn (``"turn"``) or per action token (``"token"``), in [0, 1].
      lam: the lambda of the lambda-return, in [0, 1].
      level: ``"turn"`` or ``"token"``.
      axis_name: the mesh axis under ``shard_map`` (nothing is reduced across it), or None.

    Returns:
      ``Advantages``: for ``"turn"``, ``turn`` = ``turn_returns`` = G^lam [N, K] and ``token``
      [R, T] its broadcast; for ``"token"``, ``token`` = ``token_returns`` = G^lam [R, T].
      0 on missing turns and outside ``action_mask``.
    """
    check_unit("gamma", gamma)
    check_unit("lam", lam)
    check_choice("level", level, ("turn", "token"))
    b = segments.local_view(batch, axis_name)
    if level == "turn":
        v = _turn_values(b, "lambda_returns")
        g = jnp.where(b.turn_mask, _turn_gae_raw(b, gamma, lam, v) + v, 0.0)
        return Advantages(token=segments.turn_to_token(g, b), turn=g, turn_returns=g)
    adv = gae(b, gamma=gamma, lam=lam, normalize=False)
    return Advantages(token=adv.token_returns, token_returns=adv.token_returns)


@register("sapo", aliases=("single_rollout_critic",), reads=VALUE_READS,
          renamed={"normalize": "normalization"})
def sapo(batch: TrajectoryBatch, *, gamma: float = 1.0, lam: float = 0.95,
         normalization: str = "token", eps: float = 1e-8, axis_name=None) -> Advantages:
    """SAPO (Single-rollout Autoregressive Policy Optimization, this project's SAPO; not the
    Soft Adaptive PO gate, which is ``losses.soft_gate``): trajectory-level GAE over turns
    with lambda-return targets and batch normalisation, one rollout per task (no groups).

    V_k = extras['turn_values'][:, k], the shared-backbone value head read at the boundary
    before action k (``segments.turn_values_from_tokens(values, batch, "before_action")``);
    delta_k = r_k + gamma V_{k+1} - V_k (V past the last turn = 0);
    A_k = sum_l (gamma lam)^l delta_{k+l};  targets G^lam_k = A_k + V_k (``turn_returns``);
    A_hat = (A - mu) / sqrt(var + eps) over the whole batch (across ``axis_name``), weighted by
    each turn's action tokens (``normalization="token"``, what a token-mean actor loss sees; our
    choice, since the paper says only "batch normalisation") or by turns (``"turn"``).
    The auxiliary SARSA loss on Q read after the action is ``losses.sarsa``.

    Args:
      batch: reads ``turn_rewards``, ``turn_mask`` and extras['turn_values'] [N, K];
        ``action_mask``, ``turn_ids`` [R, T] and ``row_traj`` [R].
      gamma: per-turn discount, in [0, 1].
      lam: the GAE lambda, in [0, 1].
      normalization: ``"token"`` or ``"turn"`` (``"none"`` is refused: SAPO normalises).
      eps: added to the variance.
      axis_name: the mesh axis under ``shard_map``: the normalisation reduces across it, or
        None.

    Returns:
      ``Advantages`` as ``turn_gae``: ``turn`` [N, K] (A_hat), ``token`` [R, T] and
      ``turn_returns`` [N, K] (the targets G^lam).
    """
    if normalization == "none":
        raise ValueError("sapo normalises its advantages: normalization must be 'token' or 'turn'")
    return turn_gae(batch, gamma=gamma, lam=lam, normalization=normalization, eps=eps,
                    axis_name=axis_name)
