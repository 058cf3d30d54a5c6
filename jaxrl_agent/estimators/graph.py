"""State-graph estimators: G2PO, GraphGPO and GAGPO.

All three merge the turns of one task group that saw the same observation (equal
``state_keys``) into one node of a state-transition graph: turn k of trajectory i is the edge
s_{i,k} -> s_{i,k+1}, and the last turn of a trajectory leads to a sentinel node (TERMINAL;
for GraphGPO SUCCESS or a dead end). Sentinels are separate key tuples, never hash values, so
no ``state_keys`` value can collide with them. Nodes never span task groups (``group_ids``),
and under ``jax.shard_map`` groups are whole on one shard, so everything here is shard-local
except the optional batch-wide normalisation (``normalization="batch"``), which psums over
``axis_name``.

Turns are a prefix of each trajectory (as ``pack_records`` makes them); a turn whose
successor is missing is treated as the last one.

Every estimator here takes ``axis_name``, the mesh axis under ``shard_map`` (or None), and
returns ``Advantages`` with ``turn`` [N, K] (A, 0 on missing turns) and ``token`` [R, T] (A[i, k]
on turn k's action tokens, 0 elsewhere).

  ``g2po``      TD error of the grouped state values, standardised over the group's edges;
  ``graphgpo``  distance-to-success return omega^d(next), standardised per source state, plus
                GRPO's episode term;
  ``gagpo``     turn-level GAE over the grouped state values, normalised per group.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import check_choice, check_positive, check_unit
from jaxrl_agent.estimators.primitives import (
    EPISODE_WEIGHTINGS, combine, episode_advantage, normalize_in_groups, step_returns)
from jaxrl_agent.registry import register

NORMALIZE = ("group", "batch", "none")
CONVENTIONS = ("reference", "paper")


# ----------------------------------------------------------------------------- shared pieces


def _grouped_values(b: TrajectoryBatch, gamma):
    """(V(s_k), delta_k, valid), each [N, K], for the grouped value proxy.

    G[i, k] = sum_{j >= k} gamma^(j-k) r[i, j]; V(s) = mean of G over every visit of s in the
    task group; V past the last turn (TERMINAL) = 0;
    delta_k = r_k + gamma V(s_{k+1}) - V(s_k), computed as gamma e_{k+1} - e_k with
    e_k = V(s_k) - G_k (e = 0 past the last turn): the same number, since
    G_k = r_k + gamma G_{k+1}, but a state visited once has e = 0 exactly (V = G bit for bit),
    so unmerged turns get delta = 0 exactly on every backend and however the scan associates,
    and no large returns cancel."""
    valid = segments.valid_turns(b)
    g = step_returns(b, gamma)
    v, _, _ = segments.key_stats(g, segments.turn_key_ids(b, b.state_keys), valid)
    v = jnp.where(valid, v, 0.0)
    e = jnp.where(valid, v - g, 0.0)
    e_next = jnp.where(segments.next_turn(valid, False), segments.next_turn(e), 0.0)
    return v, jnp.where(valid, gamma * e_next - e, 0.0), valid


def _standardize(x, b: TrajectoryBatch, valid, how: str, eps, axis_name):
    """(x - mean) / (std + eps) over the valid turns of each task group (``"group"``) or of the
    whole batch across ``axis_name`` (``"batch"``), std unbiased (ddof 1); one turn alone, or
    equal values, give 0. ``"none"`` returns x on valid turns."""
    if how == "group":  # group ids are dense already: no sort needed
        ids = jnp.where(valid, b.group_ids[:, None], b.num_traj * b.num_turns)
        return normalize_in_groups(x, ids, valid, eps=eps)
    if how == "batch":
        mean, var = segments.masked_mean_var(x, valid, axis_name, ddof=1)
        count = segments.psum(jnp.sum(valid.astype(jnp.float32)), axis_name)
        a = (x - mean) / (segments.safe_sqrt(var) + eps)
        return jnp.where(valid & (count > 1), a, 0.0)
    return jnp.where(valid, x, 0.0)


def _episode_term(b, weight, weighting, eps):
    """GRPO's episode term, skipped (zeros, nothing compiled) when ``weight`` is a static 0."""
    if isinstance(weight, numbers.Real) and weight == 0:
        return jnp.zeros(b.outcome.shape, jnp.float32)
    return episode_advantage(b, weighting=weighting, eps=eps)


def _check_iters(max_iters):
    if max_iters is not None and (not isinstance(max_iters, numbers.Integral)
                                  or isinstance(max_iters, bool) or max_iters < 1):
        raise ValueError(f"max_iters must be None or a positive int, got {max_iters!r}")


def _distances_to_target(src, dst, edge_ok, is_target, max_iters):
    """Hop distances [M] from every node to the nearest target node.

    Bellman-Ford with unit edge costs over the padded edge list (src[e] -> dst[e], node ids in
    [0, M), ids >= M and ``edge_ok`` False drop the edge): d = 0 on targets, +inf elsewhere,
    then d[u] <- min(d[u], min_{e: src e = u} 1 + d[dst e]) (``segment_min``). ``max_iters``
    None iterates until nothing changes (at most M rounds: exact); an int runs that many
    rounds, so nodes more than ``max_iters`` hops away stay +inf. Nodes that cannot reach a
    target stay +inf."""
    m = is_target.shape[0]
    d0 = jnp.where(is_target, 0.0, jnp.inf).astype(jnp.float32)
    dst_c = jnp.clip(dst, 0, m - 1)

    def relax(d):
        cand = jnp.where(edge_ok, 1.0 + d[dst_c], jnp.inf)
        return jnp.minimum(d, jax.ops.segment_min(cand, src, m))

    if max_iters is not None:
        return lax.fori_loop(0, max_iters, lambda _, d: relax(d), d0)

    def cond(c):
        return c[1] & (c[2] < m)

    def body(c):
        d, _, it = c
        new = relax(d)
        return new, jnp.any(new != d), it + 1

    changed = jnp.any(is_target) | jnp.zeros((), bool)
    return lax.while_loop(cond, body, (d0, changed, jnp.zeros((), jnp.int32)))[0]


# ----------------------------------------------------------------------------- G2PO


@register("g2po", aliases=("group_graph_credit",), renamed={"normalize": "normalization"})
def g2po(batch: TrajectoryBatch, *, gamma: float = 1.0, normalization: str = "group",
         episode_weight: float = 0.0, episode_weighting: str = "trajectory",
         eps: float = 1e-6, axis_name=None) -> Advantages:
    """G2PO: Group-Graph Policy Optimization. This is our reading of the paper, whose abstract
    describes the method in words: the concrete formulas below are ours.

    Identical observations of a task group are merged into one node of a state-transition
    graph; every turn is an edge s_{i,k} -> s'_{i,k} = s_{i,k+1} (TERMINAL after the last turn).
      G[i, k]   = sum_{j >= k} gamma^(j-k) r[i, j]                  (discounted step return)
      V(s)      = mean of G[j, l] over all visits (j, l) of s in the task group; V(TERMINAL) = 0
      delta(i,k)= r[i, k] + gamma V(s'_{i,k}) - V(s_{i,k})          (edge TD error)
      A_td      = (delta - mean delta) / (std delta + eps) over all valid edges of the task group
                  (``normalization="group"``) or of the whole batch (``"batch"``, psum over
                  ``axis_name``), std unbiased (ddof 1); ``"none"`` keeps delta (for tests)
      A[i, k]   = A_td(i, k) + episode_weight * A_ep(i)
    A_ep is GRPO's z-score of the outcome (``episode_advantage``, ``episode_weighting``
    "trajectory" or "steps"). Our choices in particular: the ddof 1 / eps standardisation,
    the scope (task group by default) and the optional episode term (weight 0 by default).

    Properties: A_td has zero mean over each group's edges (batch with ``"batch"``). With no
    merging (every state distinct) V(s_{i,k}) = G[i, k], so delta = r + gamma G[i,k+1] - G[i,k]
    = 0 on every edge and A = 0 whatever the rewards (with terminal-only rewards and gamma = 1
    this is the reduction test). Degenerate: a group with one edge or equal deltas
    gives 0; padding gives 0.

    Args:
      batch: reads ``state_keys``, ``turn_rewards`` and ``turn_mask`` [N, K] (N trajectories x
        K turns), ``group_ids`` and ``traj_mask`` [N]; ``outcome`` [N] for the episode term.
      gamma: per-turn discount, in [0, 1].
      normalization: ``"group"``, ``"batch"`` or ``"none"`` (above).
      episode_weight: weight of A_ep (0 by default: a static 0 skips it).
      episode_weighting: ``"trajectory"`` or ``"steps"``.
      eps: added to the std, > 0.
      axis_name: the mesh axis under ``shard_map``: only ``normalization="batch"`` reduces across
        it (groups are whole on one shard), or None.

    Returns:
      ``Advantages`` with ``turn`` [N, K] (A, 0 on missing turns) and ``token`` [R, T] (A[i, k]
      on turn k's action tokens, 0 elsewhere).
    """
    check_unit("gamma", gamma)
    check_choice("normalization", normalization, NORMALIZE)
    check_choice("episode_weighting", episode_weighting, EPISODE_WEIGHTINGS)
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    _, delta, valid = _grouped_values(b, gamma)
    a_td = _standardize(delta, b, valid, normalization, eps, axis_name)
    a_ep = _episode_term(b, episode_weight, episode_weighting, eps)
    return combine(b, a_ep, a_td, episode_weight, 1.0)


# ----------------------------------------------------------------------------- GraphGPO


def graph_distances(b: TrajectoryBatch, success, max_iters=None):
    """Distance d(next) [N, K] from each turn's next state to SUCCESS in its task group's graph.

    Nodes: (task group, state_key) for every observed state, plus two sentinels per group:
    SUCCESS (the next state of the last turn of a trajectory with ``success`` [N] True) and
    a dead end (that of an unsuccessful trajectory's last turn; it has no outgoing edges).
    Edges: every valid turn, s_{i,k} -> next state, unit cost (parallel edges are harmless: the
    minimum is taken). Distances by Bellman-Ford (``_distances_to_target``); a node that cannot
    reach SUCCESS (the dead end, or one farther than ``max_iters`` hops) gets
    max_finite + 1, max_finite being the largest finite distance in the group (the GraphGPO
    reference kernel's rule). Groups without a success get d = 1 everywhere (their graph term
    is 0 anyway). Returns (d_next [N, K], group_has_success [N] per trajectory).
    """
    n, k = b.num_traj, b.num_turns
    valid = segments.valid_turns(b)
    has_next = segments.next_turn(valid, False)
    g = jnp.broadcast_to(b.group_ids[:, None], (n, k))
    zeros = jnp.zeros((n, k), jnp.int32)
    end_kind = jnp.where(success[:, None], 1, 2)  # 1 = SUCCESS, 2 = dead end
    kind_next = jnp.where(has_next, 0, end_kind) + zeros
    key_next = jnp.where(has_next, segments.next_turn(b.state_keys), 0).astype(jnp.uint32)
    cols = [jnp.concatenate([x.reshape(-1), y.reshape(-1)]) for x, y in (
        (g, g), (zeros, kind_next), (b.state_keys.astype(jnp.uint32), key_next))]
    ok = jnp.concatenate([valid.reshape(-1), valid.reshape(-1)])
    ids, _ = segments.dense_ids(*cols, valid=ok)
    m, nk = 2 * n * k, n * k
    src, dst = ids[:nk], ids[nk:]
    is_success = jax.ops.segment_max((ok & (cols[1] == 1)).astype(jnp.int32), ids, m) > 0
    d = _distances_to_target(src, dst, valid.reshape(-1), is_success, max_iters)
    d_entry = jnp.where(ok, d[jnp.clip(ids, 0, m - 1)], jnp.inf)
    finite = jnp.where(jnp.isfinite(d_entry), d_entry, -jnp.inf)
    gmax = jax.ops.segment_max(finite, jnp.where(ok, cols[0], n), n)
    gmax = jnp.where(jnp.isfinite(gmax), gmax, 0.0)
    d_next = d[jnp.clip(dst, 0, m - 1)].reshape(n, k)
    gid = jnp.clip(b.group_ids, 0, n - 1)
    d_next = jnp.where(jnp.isfinite(d_next), d_next, gmax[gid][:, None] + 1.0)
    group_success = jax.ops.segment_max((success & b.traj_mask).astype(jnp.int32),
                                        jnp.where(b.traj_mask, b.group_ids, n), n) > 0
    has_succ = group_success[gid] & b.traj_mask
    return jnp.where(valid & has_succ[:, None], d_next, 1.0), has_succ


@register("graphgpo", aliases=("state_graph_credit",))
def graphgpo(batch: TrajectoryBatch, *, omega: float = 0.1, success_reward: float = 10.0,
             success_threshold: float = 0.5, convention: str = "reference",
             episode_weight: float = 1.0, graph_weight: float = 1.0,
             episode_weighting: str = "trajectory", max_iters: int | None = None,
             eps: float = 1e-6, axis_name=None) -> Advantages:
    """GraphGPO (the GraphGPO reference kernel ``graph_credit.py``, paper code
    verl-agent ``recipe/GraphGPO``).

    Per task group, a graph of all sampled transitions s_{i,k} -> s_{i,k+1} (unit costs); the
    last turn of a successful trajectory (outcome >= ``success_threshold``) leads to SUCCESS,
    that of an unsuccessful one to a dead end. d(s) = hop distance from s to SUCCESS
    (``graph_distances``: fixed-point Bellman-Ford; unreachable -> max_finite + 1 of the group).
      q(i, k)      = R_succ * omega^d(s_{i,k+1})      (``convention="paper"``: omega^(d + 1),
                     the paper's Eq. 4 with unit cost; only the eps term sees the difference)
      A_graph(i,k) = (q - mean_S q) / (std_S q + eps) over the same-source-state group
                     S = {(j, l): group(j) = group(i), s_{j,l} = s_{i,k}}, std unbiased;
                     a singleton S or equal q gives 0; a group in which no trajectory
                     succeeded gives A_graph = 0 exactly
      A[i, k]      = episode_weight * A_ep(i) + graph_weight * A_graph(i, k)
    A_ep: GRPO z-score of the outcome (``episode_advantage``): ``episode_weighting=
    "trajectory"`` (the kernel's "trajectory_once") or ``"steps"`` (its
    "reference_cross_steps": each trajectory counted once per turn). One difference: a
    singleton task group gives A_ep = 0 here (the kernel's steps branch gives R / (1 + eps) for
    a one-turn singleton).

    Our choices where the batch lacks what the kernel reads:
    R_succ = ``success_reward``, a constant (10.0: the paper's ALFWorld success reward and the
    kernel's default), not the trajectory outcome. q is only compared inside a source group
    after z-scoring, so R_succ matters only against eps (it sets how far from SUCCESS
    differences are still resolved). Success is read from ``outcome`` >= ``success_threshold``
    (0.5 suits 0/1 outcomes and the kernel's 10 * success - 0.1 * invalid returns). The next
    state of an unsuccessful last turn is not in the batch, so it is a dead end even when that
    observation occurs elsewhere (the kernel would use the real observation). ``max_iters``:
    None (exact, the kernel's Dijkstra) or a fixed number of Bellman-Ford rounds (nodes
    farther away count as unreachable).

    Properties: a transition into SUCCESS gets the largest q; q falls with d(next); within a
    source state, edges that get closer to SUCCESS than the average get A_graph > 0; if every
    source state is a singleton, or no trajectory of the group succeeded, A = A_ep (GRPO
    when the weights are 1, 0). Duplicating a trajectory changes the counts and so A_graph.

    Args:
      batch: reads ``state_keys`` and ``turn_mask`` [N, K] (N trajectories x K turns),
        ``outcome``, ``group_ids`` and ``traj_mask`` [N].
      omega: the decay per hop of q, in [0, 1].
      success_reward: R_succ, > 0.
      success_threshold: an outcome >= this counts as a success.
      convention: ``"reference"`` (omega^d) or ``"paper"`` (omega^(d + 1)).
      episode_weight: weight of A_ep (a static 0 skips it).
      graph_weight: weight of A_graph.
      episode_weighting: ``"trajectory"`` or ``"steps"``.
      max_iters: None (exact distances) or a positive int of Bellman-Ford rounds.
      eps: added to the std, > 0.

    ``axis_name`` and the result: see the module docstring.
    """
    check_unit("omega", omega)
    check_positive("success_reward", success_reward)
    check_choice("convention", convention, CONVENTIONS)
    check_choice("episode_weighting", episode_weighting, EPISODE_WEIGHTINGS)
    check_positive("eps", eps)
    _check_iters(max_iters)
    b = segments.local_view(batch, axis_name)
    valid = segments.valid_turns(b)
    success = b.outcome >= success_threshold
    d_next, has_succ = graph_distances(b, success, max_iters)
    exponent = d_next + (1.0 if convention == "paper" else 0.0)
    q = success_reward * jnp.power(jnp.float32(omega), exponent)
    q = jnp.where(valid & has_succ[:, None], q, 0.0)
    a_graph = normalize_in_groups(q, segments.turn_key_ids(b, b.state_keys), valid, eps=eps)
    a_graph = jnp.where(has_succ[:, None], a_graph, 0.0)
    a_ep = _episode_term(b, episode_weight, episode_weighting, eps)
    return combine(b, a_ep, a_graph, episode_weight, graph_weight)


# ----------------------------------------------------------------------------- GAGPO


@register("gagpo", aliases=("grouped_generalized_advantage",),
          renamed={"normalize": "normalization"})
def gagpo(batch: TrajectoryBatch, *, gamma: float = 1.0, lam: float = 0.95,
          normalization: str = "group", eps: float = 1e-6, axis_name=None) -> Advantages:
    """GAGPO: Generalized Advantage Grouped Policy Optimization. This is our reading of the
    paper, whose abstract describes the method in words: the concrete formulas below are ours.

    Rollouts are grouped by identical states; the grouped value proxy replaces a critic:
      V_hat(s)  = mean of G[j, l] over all visits (j, l) of s in the task group,
                  G[i, k] = sum_{j >= k} gamma^(j-k) r[i, j];  V_hat(TERMINAL) = 0
      delta[i,k]= r[i, k] + gamma V_hat(s_{i,k+1}) - V_hat(s_{i,k})
      A_raw     = sum_{l >= 0} (gamma lam)^l delta[i, k+l]          (turn-level GAE)
      A         = (A_raw - mean) / (std + eps) over all valid turns of the task group
                  (``normalization="group"``; ``"batch"``: the whole batch across ``axis_name``;
                  ``"none"``: A_raw), std unbiased (ddof 1); one turn alone or equal values: 0
    ``turn_returns`` = A_raw + V_hat(s_{i,k}) (lambda-returns on the proxy values).
    Ours are all of the above formulas (the abstract names the pieces only) and the default
    lam = 0.95. The paper's per-turn sequence-wide ratio (GSPO style) belongs to the policy
    loss, not here.

    Limits: lam = 1 gives A_raw = G[i, k] - V_hat(s_{i,k}) (GiGPO's step residual, mean_norm);
    lam = 0 gives delta. With every state distinct V_hat = G and A_raw = 0. Zero mean per
    group after ``"group"`` normalisation (zero sum).

    Args:
      batch: reads ``state_keys``, ``turn_rewards`` and ``turn_mask`` [N, K] (N trajectories x
        K turns), ``group_ids`` and ``traj_mask`` [N].
      gamma: per-turn discount, in [0, 1].
      lam: the GAE lambda, in [0, 1].
      normalization: ``"group"``, ``"batch"`` or ``"none"`` (above).
      eps: added to the std, > 0.
      axis_name: the mesh axis under ``shard_map``: only ``normalization="batch"`` reduces across
        it, or None.

    Returns:
      ``Advantages`` with ``turn`` [N, K] (A), ``token`` [R, T] (A[i, k] on turn k's action
      tokens) and ``turn_returns`` [N, K] (A_raw + V_hat); 0 on missing turns and outside
      ``action_mask``.
    """
    check_unit("gamma", gamma)
    check_unit("lam", lam)
    check_choice("normalization", normalization, NORMALIZE)
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    v, delta, valid = _grouped_values(b, gamma)
    raw = jnp.where(valid, segments.reverse_scan(delta, gamma * lam, axis=1), 0.0)
    a = _standardize(raw, b, valid, normalization, eps, axis_name).astype(jnp.float32)
    return Advantages(token=segments.turn_to_token(a, b), turn=a,
                      turn_returns=jnp.where(valid, raw + v, 0.0))
