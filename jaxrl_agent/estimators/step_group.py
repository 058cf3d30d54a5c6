"""Step-level group estimators: peers of a turn are the turns that share a key with it.

A turn (i, k) is compared with the other turns of its task group that share its key: the same
anchor state (GiGPO), the same whole history (exact-prefix groups), the same action signature,
the same turn index (a cohort), or any caller-supplied key. One function, ``step_group``,
covers that family; ``gigpo`` and ``matchtir`` are its two published configurations, and the
key variants of the literature (A2Agent, A^3, DiDPO, ReBel, ASPO) are settings of it (see
``step_group``).

Keys are always scoped by ``group_ids``: turns of different tasks are never peers. Under
``jax.shard_map`` groups are whole on one shard, so every statistic here is shard-local.

Every estimator here takes ``axis_name``, the mesh axis under ``shard_map`` (or None), and
returns ``Advantages`` with ``turn`` [N, K] (A, 0 on missing turns) and ``token`` [R, T] (A[i, k]
on turn k's action tokens, 0 elsewhere). The arguments of GRPO's episode term
(``normalization``, ``episode_weighting``, ``singleton``) are those of
``primitives.check_episode_args``.

The pieces the step-level families share (``episode_advantage``, ``step_returns``,
``normalize_in_groups``, ``combine``) are in ``primitives``.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import check_choice, check_positive, require
from jaxrl_agent.estimators.primitives import (SINGLETONS, check_episode_args, combine,
                                               episode_advantage, normalize_in_groups,
                                               step_returns)
from jaxrl_agent.registry import register


def _gigpo_reads(hp: dict) -> tuple:
    """GiGPO's similarity and bucket anchors group turns by ``extras['state_features']``."""
    return () if hp.get("anchor", "exact") == "exact" else ("state_features",)

KEYS = ("state", "action", "state_action", "history", "turn", "turn_key")
TARGETS = ("return", "reward", "outcome")


def _key_columns(b: TrajectoryBatch, key: str, who: str):
    if key == "state":
        return (b.state_keys,)
    if key == "action":
        return (b.action_keys,)
    if key == "state_action":
        return (b.state_keys, b.action_keys)
    if key == "history":
        return segments.history_keys(b)
    if key == "turn":
        return (jnp.broadcast_to(jnp.arange(b.num_turns, dtype=jnp.int32)[None, :],
                                 b.turn_mask.shape),)
    return (require(b, "turn_keys", f"{who} with key='turn_key'",
                    "[N, K] uint32 keys: give each record turn a 'turn_key'"),)


def _target(b: TrajectoryBatch, target: str, gamma):
    if target == "return":
        return step_returns(b, gamma)
    if target == "reward":
        return jnp.where(b.turn_mask, b.turn_rewards, 0.0).astype(jnp.float32)
    return jnp.where(b.turn_mask, b.outcome[:, None], 0.0).astype(jnp.float32)


# ----------------------------------------------------------------------------- estimators


@register("step_group", renamed={"normalize": "normalization", "mode": "normalization"})
def step_group(batch: TrajectoryBatch, *, key: str = "state", target: str = "return",
               gamma: float = 1.0, episode_weight: float = 1.0, step_weight: float = 1.0,
               normalization: str = "mean_std_norm", episode_weighting: str = "trajectory",
               episode_reward: str = "outcome", combine_as: str = "sum", eps: float = 1e-6,
               singleton: str = "zero", step_singleton: str = "zero",
               axis_name=None) -> Advantages:
    """The configurable step-level group estimator (the common core of the step-level family).

    A[i, k] = we A_ep(i) + ws A_step(i, k)   (``combine_as="mean"``: divided by we + ws), with
      A_ep  = ``episode_advantage`` (GRPO over the task group, ``normalization``,
              ``episode_weighting``, ``episode_reward``, ``singleton``);
      A_step(i, k) = (y[i, k] - mean_S y) / (std_S y + eps)  (``normalization="mean_norm"``: no
              std),
              S = the turns of i's task group whose ``key`` equals that of (i, k); a singleton
              S gives 0 (``step_singleton="raw"``: mean 0, std 1, as MatchTIR's verl code).
    ``target`` y: ``"return"`` G[i, k] = sum_{j >= k} gamma^(j-k) r[i, j]; ``"reward"`` the
    turn reward r[i, k]; ``"outcome"`` the trajectory's R_i.
    ``key``: ``"state"`` state_keys (GiGPO's anchor state); ``"action"`` action_keys;
    ``"state_action"`` both; ``"history"`` the whole history s_0, a_0, ..., s_k (exact-prefix
    groups, ``segments.history_keys``); ``"turn"`` the turn index k (a (group, k) cohort);
    ``"turn_key"`` extras['turn_keys'] (records: a turn's ``turn_key``).

    Published key variants as settings. GiGPO and MatchTIR are their released code; for the
    others this is our reading of the paper, which describes the grouping in words (marked
    "our reading"):
      GiGPO: key="state", target="return", gamma=0.95 (``gigpo``);
      MatchTIR: key="turn", combine_as="mean", episode_reward="reward_sum", singletons raw
        (``matchtir``);
      A2Agent (our reading): key="turn_key" with turn_key = hash of the set of gold regions
        discovered before the turn; discovery/commit rewards as turn rewards;
      A^3 (our reading): key="action" with action_key = the AST-normalised command signature
        (records: ``action_key``); the tree-margin term is a separate reward;
      DiDPO (our reading): key="turn_key" with turn_key = the sub-diff anchor id,
        target="outcome";
      ReBel (our reading): key="turn_key" with turn_key = hash of the normalised belief state;
      ASPO / StepSafe prefix groups (our reading): key="history", target="reward",
        episode_weight=0 (a GRPO group whose id is the prefix);
      MAPO-style turn cohorts (our reading): key="turn".
    Invariants: with every key distinct (or step_weight 0) A = we A_ep (GRPO for
    normalization="mean_std_norm", Dr.GRPO for "mean_norm"); step terms sum to 0 over each key
    group.

    Args:
      batch: reads ``outcome`` [N], ``group_ids`` [N], ``traj_mask`` [N], ``turn_mask`` and
        ``turn_rewards`` [N, K] (N trajectories x K turns), and the key: ``state_keys`` /
        ``action_keys`` [N, K], or extras['turn_keys'] [N, K] for ``key="turn_key"``.
      key: ``"state"``, ``"action"``, ``"state_action"``, ``"history"``, ``"turn"`` or
        ``"turn_key"`` (above).
      target: ``"return"``, ``"reward"`` or ``"outcome"`` (above).
      gamma: per-turn discount of the ``"return"`` target, in [0, 1].
      episode_weight: we, the weight of the episode term (any real; 0 drops it).
      step_weight: ws, the weight of the step term.
      normalization: ``"mean_std_norm"`` (z-score) or ``"mean_norm"`` (centre only), for both
        terms. Former name ``mode``.
      episode_reward: ``"outcome"`` or ``"reward_sum"`` (the sum of turn rewards).
      combine_as: ``"sum"`` or ``"mean"``.
      eps: added to the std, > 0.
      episode_weighting, singleton: the episode term's (``primitives.check_episode_args``).
      step_singleton: ``"zero"`` or ``"raw"``: the step term of a singleton key group.

    ``axis_name`` and the result: see the module docstring.
    """
    check_episode_args(normalization, episode_weighting, eps, singleton, gamma)
    check_choice("step_singleton", step_singleton, SINGLETONS)
    check_choice("key", key, KEYS)
    check_choice("target", target, TARGETS)
    check_choice("episode_reward", episode_reward, ("outcome", "reward_sum"))
    check_choice("combine_as", combine_as, ("sum", "mean"))
    b = segments.local_view(batch, axis_name)
    a_ep = episode_advantage(b, normalization=normalization, weighting=episode_weighting,
                             reward=episode_reward, eps=eps, singleton=singleton)
    valid = segments.valid_turns(b)
    ids = segments.turn_key_ids(b, *_key_columns(b, key, "step_group"))
    a_st = normalize_in_groups(_target(b, target, gamma), ids, valid, normalization=normalization,
                               eps=eps, singleton=step_singleton)
    return combine(b, a_ep, a_st, episode_weight, step_weight, combine_as)


def anchor_ids(b: TrajectoryBatch, anchor: str, *, bucket_width: float = 0.1,
               sim_threshold: float = 0.95, sim_iters: int = 32, who: str = "gigpo"):
    """Anchor-state group ids [N, K] of every turn (scoped by task group).

    ``"exact"``: equal ``state_keys``. ``"bucket"``: equal hashes of
    round(extras['state_features'] / bucket_width) (each feature vector quantised to a grid).
    ``"similar"``: connected components of the graph linking turns of one group whose
    feature vectors have cosine similarity >= ``sim_threshold`` (``segments.similarity_clusters``,
    label propagation with root hooking until stable, at most ``sim_iters`` rounds).
    """
    valid = segments.valid_turns(b)
    if anchor == "exact":
        return segments.turn_key_ids(b, b.state_keys)
    feats = require(b, "state_features", f"{who} with anchor={anchor!r}",
                    "[N, K, D] float observation features: give each record turn "
                    "turn_extras.state_features")
    if feats.ndim != 3:
        raise ValueError(f"{who}: extras['state_features'] must be [N, K, D], got shape "
                         f"{feats.shape}")
    if anchor == "bucket":
        return segments.turn_key_ids(b, segments.bucket_keys(feats, bucket_width))
    return segments.similarity_clusters(feats, b.group_ids, valid, sim_threshold, sim_iters)


@register("gigpo", aliases=("anchor_state_groups",), reads=_gigpo_reads,
          renamed={"normalize": "normalization", "mode": "normalization"})
def gigpo(batch: TrajectoryBatch, *, gamma: float = 0.95, step_weight: float = 1.0,
          normalization: str = "mean_std_norm", episode_weighting: str = "trajectory",
          anchor: str = "exact", bucket_width: float = 0.1, sim_threshold: float = 0.95,
          sim_iters: int = 32, eps: float = 1e-6, singleton: str = "zero",
          axis_name=None) -> Advantages:
    """GiGPO: Group-in-Group Policy Optimization (Feng et al. 2025; verl-agent core_gigpo).

    A[i, k] = A_ep(i) + w A_st(i, k), broadcast onto turn k's action tokens, where
      A_ep(i)    = (R_i - mean_g R) / (std_g R + eps)   (``normalization="mean_norm"``:
                   R_i - mean_g R);
      G[i, k]    = sum_{j >= k} gamma^(j - k) r[i, j]   (discounted step return; r includes
                   invalid-action penalties and the outcome at the last step);
      A_st(i, k) = (G[i, k] - mean_S G) / (std_S G + eps)   (or the mean only), where
                   S = {(j, l): group(j) = group(i), anchor(j, l) = anchor(i, k)}.
    std is unbiased (ddof 1, torch.std as the reference code). Singleton anchor groups give
    A_st = 0; a zero-variance group gives exactly 0. Singleton task groups: A_ep = 0
    (``singleton="raw"``: A_ep = R, verl).

    ``episode_weighting``: ``"trajectory"`` (default) counts each trajectory once in the
    episode mean/std (plain GRPO); ``"steps"`` is the reference code's
    ``compute_mean_std_cross_steps=True``, where the statistics run over per-step rows, so a
    trajectory counts K_i times (length-weighted). They differ whenever the trajectories of a
    group have different lengths; the length-weighted mean leans toward long (usually failed)
    episodes.
    ``anchor``: ``"exact"`` (hashed observation, the paper), ``"bucket"`` or ``"similar"``
    (clusters of extras['state_features'], the reference's similarity option;
    see ``anchor_ids``). The paper's scripts use gamma 0.95, w 1. ``normalization`` is the
    reference code's ``mode``; it defaults to ``"mean_norm"`` in some scripts, this library to
    ``"mean_std_norm"``.
    Reductions: all anchors distinct, or w = 0, gives GRPO (Dr.GRPO with mean_norm).

    Args:
      batch: reads ``outcome`` [N], ``group_ids`` [N], ``traj_mask`` [N], ``turn_mask``,
        ``turn_rewards`` and ``state_keys`` [N, K]; with ``anchor="bucket"`` or
        ``"similar"``, extras['state_features'] [N, K, D] instead of ``state_keys``.
      gamma: per-turn discount of the step return, in [0, 1].
      step_weight: w, the weight of the step term.
      normalization: ``"mean_std_norm"`` (z-score) or ``"mean_norm"`` (centre only), for both
        terms. Former name ``mode``.
      anchor: ``"exact"``, ``"bucket"`` or ``"similar"`` (above).
      bucket_width: grid step of the ``"bucket"`` anchors, > 0.
      sim_threshold: cosine threshold of the ``"similar"`` anchors.
      sim_iters: most label-propagation rounds of the ``"similar"`` anchors.
      eps: added to the std, > 0.
      episode_weighting, singleton: the episode term's (``primitives.check_episode_args``).

    ``axis_name`` and the result: see the module docstring.
    """
    check_episode_args(normalization, episode_weighting, eps, singleton, gamma)
    check_choice("anchor", anchor, ("exact", "bucket", "similar"))
    check_positive("bucket_width", bucket_width)
    b = segments.local_view(batch, axis_name)
    a_ep = episode_advantage(b, normalization=normalization, weighting=episode_weighting, eps=eps,
                             singleton=singleton)
    ids = anchor_ids(b, anchor, bucket_width=bucket_width, sim_threshold=sim_threshold,
                     sim_iters=sim_iters)
    a_st = normalize_in_groups(step_returns(b, gamma), ids, segments.valid_turns(b),
                               normalization=normalization, eps=eps)
    return combine(b, a_ep, a_st, 1.0, step_weight)


@register("matchtir", aliases=("dual_level_tool_credit",), renamed={"lam": "gamma"})
def matchtir(batch: TrajectoryBatch, *, gamma: float = 0.9, eps: float = 1e-6,
             axis_name=None) -> Advantages:
    """MatchTIR's dual-level advantage (Qu et al. 2026; quchangle1/MatchTIR core_algos).

    Turn rewards r[i, k] come from bipartite matching of predicted and gold tool calls (placed
    on each turn's last token by the caller). G[i, k] = sum_{j >= k} gamma^(j - k) r[i, j];
    A_turn = (G - mean) / (std + eps) over the (task group, turn index k) cohort;
    A_traj = GRPO z-score of sum_k r[i, k]; A = (A_traj + A_turn) / 2. Singletons follow the
    verl code (mean 0, std 1) in both terms. Equals ``step_group(key="turn", gamma=gamma,
    combine_as="mean", episode_reward="reward_sum", singleton="raw", step_singleton="raw")``.

    Args:
      batch: reads ``turn_rewards`` and ``turn_mask`` [N, K], ``group_ids`` [N] and
        ``traj_mask`` [N].
      gamma: per-turn discount of G, in [0, 1]. Former name ``lam``.
      eps: added to the std, > 0.

    ``axis_name`` and the result: see the module docstring.
    """
    return step_group(batch, key="turn", target="return", gamma=gamma, combine_as="mean",
                      episode_reward="reward_sum", singleton="raw", step_singleton="raw",
                      eps=eps, axis_name=axis_name)
