"""BiPACE = BiGPO + PACE: hidden-state clusters with action-conditioned peer baselines.

A step-level group estimator, read from the paper's abstract and summary, which describe the
method in words: the concrete formulas below are our reading of them, not a reproduction of
released code.

(i) BiGPO: peers of a turn are not the turns with the same hashed observation (which leaves
most turns singletons) but the turns of its task group whose actor hidden states are close:
turns (i, k) and (j, l) of one group are linked iff cos(h_ik, h_jl) >= tau, and a cluster c is
a connected component of that graph (``segments.similarity_clusters``). Cosine similarity of
the policy's own hidden states is a policy-induced proxy for bisimulation. Optionally turns
with equal ``state_keys`` (GiGPO's exact anchors) are linked too, and clusters are the
components of the union graph.

(ii) PACE: inside a cluster the step credit is a local Q(s, a) - V(s) estimate from peers
(action-conditioned peer baselines) instead of "return minus state mean".

Groups are whole on one shard, so everything here is shard-local. The estimator takes
``axis_name``, the mesh axis under ``shard_map`` (or None), and returns ``Advantages`` with
``turn`` [N, K] (A, 0 on missing turns) and ``token`` [R, T] (A[i, k] on turn k's action
tokens, 0 elsewhere). The arguments of GRPO's episode term (``normalization``,
``episode_weighting``, ``singleton``) are those of ``primitives.check_episode_args``.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import check_choice, check_positive, require
from jaxrl_agent.estimators.primitives import (
    MODES, check_episode_args, combine, episode_advantage, step_returns)
from jaxrl_agent.registry import register


def _merge_partitions(labels, other_ids, valid):
    """Connected components of the union of two partitions, exactly (inside jit).

    ``labels`` [N, K]: one partition, as ``segments.similarity_clusters`` labels (each turn's
    label is a flat index <= its own, M = N K for invalid turns). ``other_ids`` [N, K]: a second
    partition (ids in [0, M), M for invalid, e.g. ``segments.turn_key_ids``). Two turns end up
    with one label iff a chain of turns, each consecutive pair sharing a label or an id, joins
    them. The result is the smallest flat index of the merged component (the convention of
    ``similarity_clusters``); invalid turns get M.

    Method: labels := min(label, min over its A-part, min over its B-part), then one pointer
    jump (label := label[label]), in a ``lax.while_loop`` until nothing changes (at most M
    rounds of O(M) work; labels only decrease). Shard-local: no collective inside.
    """
    shape = labels.shape
    m = labels.size
    ok = valid.reshape(m)
    part_a = jnp.where(ok, labels.reshape(m), m)
    part_b = jnp.where(ok, other_ids.reshape(m), m)

    def part_min(lab, part):
        low = jax.ops.segment_min(lab, part, m + 1)
        return low[part]

    def body(state):
        lab, _ = state
        new = jnp.minimum(lab, jnp.minimum(part_min(lab, part_a), part_min(lab, part_b)))
        new = jnp.where(ok, new[jnp.clip(new, 0, m - 1)], m)
        return new, jnp.any(new != lab)

    lab, _ = lax.while_loop(lambda s: s[1], body, (part_a, jnp.any(ok)))
    return lab.reshape(shape)


def cluster_ids(b: TrajectoryBatch, *, tau: float, sim_iters: int = 32,
                merge_state_keys: bool = False):
    """BiPACE's clusters [N, K] (values in [0, N K), N K for invalid turns), see ``bipace``."""
    h = require(b, "hidden", "bipace", "[N, K, D] float hidden state at the decision point: "
                "give each record turn turn_extras.hidden (a vector)")
    if h.ndim != 3:
        raise ValueError(f"bipace: extras['hidden'] must be [N, K, D] (a vector per turn: "
                         f"turn_extras.hidden = [numbers]), got shape {h.shape}")
    valid = jnp.asarray(segments.valid_turns(b))  # jnp: the primitive indexes it with tracers
    labels = segments.similarity_clusters(lax.stop_gradient(jnp.asarray(h)),
                                          jnp.asarray(b.group_ids), valid, tau, sim_iters)
    if merge_state_keys:
        labels = _merge_partitions(labels, segments.turn_key_ids(b, b.state_keys), valid)
    return labels


def pace_advantage(b: TrajectoryBatch, g, clusters, valid, *, leave_one_out: bool = False,
                   normalization: str = "mean_norm", eps: float = 1e-6):
    """PACE's step term A_PACE [N, K] of the target ``g`` [N, K] over ``clusters`` [N, K].

    With c = cluster of (i, k), a = action_keys[i, k], n_c = |c|, n_ca = |{(j, l) in c: a_jl = a}|:
      V(c) = mean_{c} g,   Q(c, a) = mean_{(j, l) in c, a_jl = a} g,
      plain:          A = Q(c, a) - V(c)   (a pair alone in c: Q = g, so A = g - V(c));
      leave_one_out:  A = Q_-(c, a) - V_-(c), both means over the peers without (i, k);
                      a pair alone in c falls back to g - V_-(c) (RLOO's baseline);
      ``normalization="mean_std_norm"``: A / (std_c g + eps), std unbiased over the whole cluster.
    A singleton cluster gives 0, and so does a cluster where every member took the same action
    (n_ca = n_c: exactly 0); invalid turns 0. Plain mode sums to 0 over each cluster:
    sum_a n_ca (Q(c, a) - V(c)) = 0.
    """
    v, std, n_c = segments.key_stats(g, clusters, valid)
    pair = segments.turn_key_ids(b, clusters, b.action_keys, valid=valid)
    q, _, n_ca = segments.key_stats(g, pair, valid)
    if leave_one_out:
        v_loo = v + (v - g) / jnp.maximum(n_c - 1.0, 1.0)  # (n V - g) / (n - 1)
        q_loo = q + (q - g) / jnp.maximum(n_ca - 1.0, 1.0)
        a = jnp.where(n_ca > 1, q_loo - v_loo, g - v_loo)
    else:
        a = q - v
    a = jnp.where(n_ca < n_c, a, 0.0)  # one action in the cluster (or a singleton): 0
    if normalization == "mean_std_norm":
        a = a / (std + eps)
    return jnp.where(valid, a, 0.0)


@register("bipace", aliases=("clustered_peer_baselines",), reads=("hidden",),
          renamed={"normalize": "normalization", "step_normalize": "step_normalization",
                   "mode": "normalization", "step_mode": "step_normalization"})
def bipace(batch: TrajectoryBatch, *, tau: float = 0.9, sim_iters: int = 32,
           merge_state_keys: bool = False, leave_one_out: bool = False,
           step_normalization: str = "mean_norm", step_weight: float = 1.0, gamma: float = 0.95,
           normalization: str = "mean_std_norm", episode_weighting: str = "trajectory",
           eps: float = 1e-6, singleton: str = "zero", axis_name=None) -> Advantages:
    """BiPACE: BiGPO hidden-state clusters + PACE action-conditioned peer baselines.

    This is our reading of the papers, whose abstracts describe the idea in words and give no
    formulas:
      A[i, k] = A_ep(i) + w A_PACE(i, k), broadcast onto turn k's action tokens, where
      A_ep   = GiGPO's / GRPO's episode term (``primitives.episode_advantage`` with
               ``normalization``, ``episode_weighting``, ``eps``, ``singleton``);
      G[i, k] = sum_{j >= k} gamma^(j - k) r[i, j]   (``primitives.step_returns``);
      clusters: turns (i, k), (j, l) of one task group are linked iff
               cos(h_ik, h_jl) >= tau (h = extras['hidden'], detached), and, with
               ``merge_state_keys``, also iff state_keys agree; c(i, k) = its connected
               component (``segments.similarity_clusters``: label propagation with root
               hooking until stable, at most ``sim_iters`` rounds; the key links are merged
               exactly by ``_merge_partitions``);
      A_PACE = Q_hat(c, a_ik) - V_hat(c)  with V_hat(c) = mean_c G and
               Q_hat(c, a) = mean G over the members of c with action_keys = a
               (``pace_advantage``: ``leave_one_out`` peers, ``step_normalization`` std
               scaling).

    Inputs: extras['hidden'] [N, K, D] float (records: turn_extras.hidden, a vector; the
    hidden state at the decision point, e.g. the last prompt token before the action),
    action_keys, state_keys, turn_rewards, outcome, group_ids. tau must be > 0 (a zero hidden
    vector then links to nothing but itself); tau > 1 links nothing.

    Degenerate cases: singleton clusters, clusters with one action, and zero-variance
    clusters give A_PACE = 0 exactly; singleton task groups give A_ep = 0 (``singleton="raw"``:
    R); missing turns and padding give 0. No gradient flows into extras['hidden'].

    Reductions: tau > 1 (every cluster a singleton) gives A = A_ep, i.e. GiGPO with all anchors
    distinct (= GRPO for normalization="mean_std_norm", Dr.GRPO for "mean_norm"): GiGPO's step
    term is 0 for singletons, and so is A_PACE. tau > 1 with ``merge_state_keys`` gives
    GiGPO's exact anchor groups as clusters; if moreover the actions inside every anchor group
    are distinct, Q_hat = G and A_PACE = G - V_hat(c) is GiGPO's step term
    (``step_normalization`` playing GiGPO's ``normalization``): bipace(normalization=m,
    step_normalization=m, merge_state_keys=True, tau>1) = gigpo(normalization=m).
    Identical actions in a cluster give A_PACE = 0; w = 0 gives the episode term alone.

    Args:
      batch: reads extras['hidden'] [N, K, D], ``action_keys``, ``state_keys``,
        ``turn_rewards`` and ``turn_mask`` [N, K] (N trajectories x K turns), ``outcome``,
        ``group_ids`` and ``traj_mask`` [N].
      tau: cosine threshold of a link, > 0 (> 1 links nothing).
      sim_iters: most label-propagation rounds, a positive int.
      merge_state_keys: also link turns with equal ``state_keys``.
      leave_one_out: leave the turn itself out of its Q and V means.
      step_normalization: ``"mean_norm"`` or ``"mean_std_norm"`` (divide A_PACE by the cluster
        std + eps). Former name ``step_mode``.
      step_weight: w, the weight of A_PACE.
      gamma: per-turn discount of G, in [0, 1].
      normalization: ``"mean_std_norm"`` (z-score) or ``"mean_norm"`` (centre only) of the episode
        term. Former name ``mode``.
      eps: added to the stds, > 0.
      episode_weighting, singleton: the episode term's (``primitives.check_episode_args``).

    ``axis_name`` and the result: see the module docstring.
    """
    check_positive("tau", tau)
    if not isinstance(sim_iters, numbers.Integral) or isinstance(sim_iters, bool) or sim_iters < 1:
        raise ValueError(f"sim_iters must be a positive int, got {sim_iters!r}")
    check_choice("merge_state_keys", merge_state_keys, (False, True))
    check_choice("leave_one_out", leave_one_out, (False, True))
    check_choice("step_normalization", step_normalization, MODES)
    check_episode_args(normalization, episode_weighting, eps, singleton, gamma)
    b = segments.local_view(batch, axis_name)
    clusters = cluster_ids(b, tau=tau, sim_iters=sim_iters, merge_state_keys=merge_state_keys)
    valid = segments.valid_turns(b)
    a_pace = pace_advantage(b, step_returns(b, gamma), clusters, valid,
                            leave_one_out=leave_one_out, normalization=step_normalization, eps=eps)
    a_ep = episode_advantage(b, normalization=normalization, weighting=episode_weighting, eps=eps,
                             singleton=singleton)
    return combine(b, a_ep, a_pace, 1.0, step_weight)
