"""Rollout-tree estimators: RTMC, tree-node value differences (TreePS-RAG, SPO-tree, TEMPO,
TreeMem) and ProGPO.

The rollout tree of a task group
--------------------------------
Turn (i, k) is taken from the tree node H(i, k) = the exact history (s_0, a_0, ..., a_{k-1},
s_k) of trajectory i (``segments.history_keys``: two uint32 streams, 64 bits, scoped by task
group). Two turns sit at the same node iff their trajectories belong to one task group and
agree on every state and action key up to s_k; a trajectory visits a node at most once (the
node fixes the depth k). Different first observations give different roots of one group.

The child entered by action k (``child="history"``, the default) is
  * the next node H(i, k + 1) when turn k + 1 exists, and
  * at the trajectory's last turn, a leaf identified by (H(i, k), a_k).
Child ids are the node id of turn k + 1, or the id of the pair (H(i, k), a_k) offset by
N K for a leaf: leaves and inner nodes live in disjoint id ranges, so no key value can make a
leaf equal an inner node. Two trajectories that take the same action at the same node but
where one ends and the other continues (or sees a different next observation) enter
different children.
With ``child="action"`` the child is the action node (H(i, k), a_k) for every turn: chance
outcomes of the environment are averaged inside one child (in a deterministic environment the
two coincide except for ended vs continued trajectories).

Either way every trajectory through a node takes exactly one child, so with N(.) the number of
trajectories through a node and V(.) = the mean of their outcomes (tree consistency):
  N(p) = sum_c N(c),  V(p) = sum_c N(c) V(c) / N(p),  sum_c N(c) (V(c) - V(p)) = 0.

All statistics are scoped by task group; groups are whole on one shard, so everything here is
shard-local (no collective is needed with ``axis_name``). Every estimator works on the turn
level [N, K] and broadcasts to the action tokens, so both layouts give the same advantages.
Turns are expected to be a prefix 0..K_i - 1 of each trajectory (as ``pack_records`` builds
them); a missing turn ends the trajectory's path for ``is_last``.

Every estimator here takes ``axis_name``, the mesh axis under ``shard_map`` (or None), and
returns ``Advantages`` with ``turn`` [N, K] (A, 0 on missing turns) and ``token`` [R, T] (A[i, k]
on turn k's action tokens, 0 elsewhere). The arguments of GRPO's episode term
(``normalization``, ``episode_weighting``, ``singleton``) are those of
``primitives.check_episode_args``.

Private helpers (candidates for ``segments``): ``_first_of`` (first member of every id),
``_first_visits`` (first visit of a key per trajectory), ``_stats`` (segment mean/count over
ids from any range), ``_tree_ids`` (node and child ids).
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import check_choice, check_positive
from jaxrl_agent.estimators.primitives import (
    MODES, check_episode_args, combine, episode_advantage, normalize_in_groups, step_returns)
from jaxrl_agent.registry import register

SIGNATURES = ("history", "state")
CHILDREN = ("history", "action")
BASELINES = ("parent", "siblings")
TARGETS = ("return", "outcome")
TERMINALS = ("outcome", "td")


# ----------------------------------------------------------------------------- checks


def _check_nonneg_finite(name, value):
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and \
            not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


# ----------------------------------------------------------------------------- tree helpers


def _first_of(ids, valid, num_ids):
    """[N, K] bool: (i, k) is the first valid turn, in flat (i, k) order, of its id (ids in
    [0, num_ids); invalid turns are never first)."""
    n, k = ids.shape
    flat = jnp.arange(n * k, dtype=jnp.int32).reshape(n, k)
    seg = jnp.where(valid, ids, num_ids).reshape(-1)
    first = jax.ops.segment_min(jnp.where(valid, flat, n * k).reshape(-1), seg, num_ids)
    return valid & (first[jnp.clip(ids, 0, num_ids - 1)] == flat)


def _stats(x, ids, valid, num_ids, weights=None):
    """(mean, count) [N, K] of x over the turns sharing an id in [0, num_ids), gathered back."""
    mean, _, count = segments.segment_stats(x.reshape(-1), ids.reshape(-1), valid.reshape(-1),
                                            num_ids, 1, None if weights is None
                                            else weights.reshape(-1))
    safe = jnp.clip(ids, 0, num_ids - 1)
    return mean[safe], count[safe]


def _first_visits(ids, valid):
    """[N, K] bool: turn k is the first valid turn of its trajectory with key id ``ids[i, k]``
    (first-visit Monte Carlo). Pairwise over the K turns of a trajectory: O(N K^2)."""
    k = ids.shape[1]
    earlier = jnp.arange(k)[None, :] < jnp.arange(k)[:, None]  # [k, j]: j < k
    seen = (ids[:, :, None] == ids[:, None, :]) & valid[:, None, :] & earlier[None]
    return valid & ~jnp.any(seen, axis=2)


def _tree_ids(b: TrajectoryBatch, child: str = "history"):
    """(node ids [N, K] in [0, N K), child ids [N, K] in [0, 2 N K)), scoped by task group (see
    the module doc): node = H(i, k); child = H(i, k + 1) (the node id of turn k + 1), or at the
    last turn the leaf (H(i, k), a_k), whose ids are offset by N K so that a leaf never equals
    an inner node (``child="action"``: (H(i, k), a_k) at every turn). Invalid turns get an
    out-of-range id."""
    m = b.num_traj * b.num_turns
    h = segments.history_keys(b)
    node = segments.turn_key_ids(b, *h)
    act = segments.turn_key_ids(b, *h, b.action_keys)  # (H(i, k), a_k)
    if child == "action":
        return node, act
    valid = segments.valid_turns(b)
    last = valid & ~segments.next_turn(valid, False)
    kid = jnp.where(last, m + act, segments.next_turn(node, m))
    return node, jnp.where(valid, kid, 2 * m)


def _target(b: TrajectoryBatch, target: str, gamma):
    if target == "return":
        return step_returns(b, gamma)
    return jnp.where(b.turn_mask, b.outcome[:, None], 0.0).astype(jnp.float32)


# ----------------------------------------------------------------------------- RTMC


def _shrink(count, kappa):
    """kappa / (count + kappa): the weight of the prior (0 when kappa = 0, never NaN)."""
    return kappa / jnp.maximum(count + kappa, 1e-30)


def _rtmc_terms(b: TrajectoryBatch, *, kappa, signature, target, gamma):
    """RTMC's per-turn statistics: dict of [N, K] arrays (0 on invalid turns)
    v_hat, q_hat (raw first-visit MC means), n_s, n_sa (trajectory counts), v, q (smoothed)."""
    valid = segments.valid_turns(b)
    g = _target(b, target, gamma)
    cols = segments.history_keys(b) if signature == "history" else (b.state_keys,)
    s_ids = segments.turn_key_ids(b, *cols)
    sa_ids = segments.turn_key_ids(b, *cols, b.action_keys)
    if signature == "history":  # a history node is visited at most once per trajectory
        first_s = first_sa = valid
    else:
        first_s, first_sa = _first_visits(s_ids, valid), _first_visits(sa_ids, valid)
    v_hat, _, n_s = segments.key_stats(g, s_ids, first_s)
    q_hat, _, n_sa = segments.key_stats(g, sa_ids, first_sa)
    root = segments.group_stats(g[:, 0], b.group_ids, valid[:, 0])[0]  # group mean of G_0
    lam_s, lam_sa = _shrink(n_s, kappa), _shrink(n_sa, kappa)
    if signature == "history":
        # V_k = v_hat_k + lam_k (V_{k-1} - v_hat_k). With D_k = V_k - v_hat_k:
        # D_k = lam_k (v_hat_{k-1} - v_hat_k) + lam_k D_{k-1}, D_{-1} = 0, v_hat_{-1} = root.
        # (Equal v_hat everywhere gives D = 0 exactly.) A forward scan = a reversed one.
        prev = jnp.concatenate([root[:, None], v_hat[:, :-1]], axis=1)
        x = jnp.where(valid, lam_s * (prev - v_hat), 0.0)
        d = segments.reverse_scan(x[:, ::-1], lam_s[:, ::-1], axis=1,
                                  where=valid[:, ::-1])[:, ::-1]
        v = v_hat + d
    else:
        v = v_hat + lam_s * (root[:, None] - v_hat)
    q = q_hat + lam_sa * (v - q_hat)
    z = lambda x: jnp.where(valid, x, 0.0)  # noqa: E731
    return {"v_hat": z(v_hat), "q_hat": z(q_hat), "n_s": z(n_s), "n_sa": z(n_sa), "v": z(v),
            "q": z(q)}


@register("rtmc", aliases=("rollout_tree_monte_carlo",),
          renamed={"normalize": "normalization", "mode": "normalization"})
def rtmc(batch: TrajectoryBatch, *, kappa: float = 1.0, signature: str = "history",
         target: str = "return", gamma: float = 1.0, episode_weight: float = 0.0,
         normalization: str = "mean_std_norm", episode_weighting: str = "trajectory",
         eps: float = 1e-6, singleton: str = "zero", axis_name=None) -> Advantages:
    """RTMC: Rollout-Tree Monte Carlo advantages with prior-smoothed node values. The paper's
    abstract describes the smoothing in words; the formulas of the smoothing below are our
    reading of it.

    Nodes s = the turn's state signature: ``signature="history"`` (default) the exact history
    node H(i, k) of the rollout tree (module doc); ``"state"`` the plain ``state_keys`` (a
    graph: a state may recur, also within one trajectory). Actions a = ``action_keys``. Returns
    G[i, k]: ``target="return"`` the discounted reward-to-go sum_{j >= k} gamma^(j-k) r[i, j];
    ``"outcome"`` R_i at every turn. Everything is scoped by task group.

    First-visit Monte Carlo: in each trajectory only the first occurrence of s (for V) and of
    the pair (s, a) (for Q) counts, so
      N(s) = #trajectories visiting s,   V_hat(s) = mean of G over first visits of s,
      N(s, a), Q_hat(s, a) likewise over first visits of (s, a).
    Smoothing (our reading):
      V~(s)    = (sum_{first visits} G + kappa V_prior(s)) / (N(s) + kappa),
      Q~(s, a) = (sum_{first visits} G + kappa V~(s)) / (N(s, a) + kappa),
      V_prior(s) = V~(parent of s) for the history signature (computed root-down by a scan
        over the depth k), and the root prior mean_g G[., 0] (the group mean of the first-turn
        return: the group mean of R for outcome rewards) for depth-0 nodes; with the state
        signature (no unique parent) every state's prior is that root prior (our choice).
    A[i, k] = Q~(s, a) - V~(s) + episode_weight A_ep(i), broadcast onto turn k's action tokens
    (A_ep = GRPO, ``episode_advantage`` with ``normalization``, ``episode_weighting``,
    ``singleton``; off by default, as in the paper).

    Limits: kappa = 0 gives the raw first-visit MC estimate Q_hat - V_hat (whose count-weighted
    sum over the actions of a history node is 0, tree consistency); kappa -> inf gives A -> 0;
    repeating a loop of (s, a) pairs inside one trajectory leaves the statistics unchanged
    (first visit).
    A singleton node with kappa > 0 gives kappa (G - V_prior) / (1 + kappa)^2 (shrunk toward
    its parent, not 0). All-equal returns give exactly 0. ``kappa`` >= 0 and finite.

    Args:
      batch: reads ``state_keys``, ``action_keys``, ``turn_rewards`` and ``turn_mask`` [N, K]
        (N trajectories x K turns), ``outcome``, ``group_ids`` and ``traj_mask`` [N].
      kappa: prior strength, finite and >= 0 (0 = no smoothing).
      signature: ``"history"`` or ``"state"`` (above).
      target: ``"return"`` or ``"outcome"`` (above).
      gamma: per-turn discount of the ``"return"`` target, in [0, 1].
      episode_weight: weight of A_ep (0 = off).
      normalization: ``"mean_std_norm"`` (z-score) or ``"mean_norm"`` (centre only) of A_ep.
        Former name ``mode``.
      eps: added to the std of A_ep, > 0.
      episode_weighting, singleton: the episode term's (``primitives.check_episode_args``).

    ``axis_name`` and the result: see the module docstring.
    """
    _check_nonneg_finite("kappa", kappa)
    check_choice("signature", signature, SIGNATURES)
    check_choice("target", target, TARGETS)
    check_episode_args(normalization, episode_weighting, eps, singleton, gamma)
    b = segments.local_view(batch, axis_name)
    t = _rtmc_terms(b, kappa=kappa, signature=signature, target=target, gamma=gamma)
    a_ep = episode_advantage(b, normalization=normalization, weighting=episode_weighting, eps=eps,
                             singleton=singleton)
    return combine(b, a_ep, t["q"] - t["v"], episode_weight, 1.0)


# ----------------------------------------------------------------------------- tree values


def _tree_terms(b: TrajectoryBatch, *, child, baseline):
    """Tree-node values, dict of [N, K] arrays (0 on invalid turns): v_parent V(H(i, k)),
    v_child V(child), n_child N(child), n_children (distinct children of the node), a_proc."""
    valid = segments.valid_turns(b)
    r = jnp.where(valid, b.outcome[:, None], 0.0).astype(jnp.float32)
    m = b.num_traj * b.num_turns
    node, kid = _tree_ids(b, child)
    v_p = _stats(r, node, valid, m)[0]
    v_c, n_c = _stats(r, kid, valid, 2 * m)
    rep = _first_of(kid, valid, 2 * m).astype(jnp.float32)  # one turn per distinct child
    base, n_ch = _stats(v_c, node, valid, m, weights=rep)  # n_ch: distinct children per node
    if baseline == "parent":
        base = v_p  # (else: the unweighted mean of V over the node's distinct children)
    a_proc = jnp.where(n_ch > 1, v_c - base, 0.0)  # branch gating (exact 0 for one child)
    z = lambda x: jnp.where(valid, x, 0.0)  # noqa: E731
    return {"v_parent": z(v_p), "v_child": z(v_c), "n_child": z(n_c), "n_children": z(n_ch),
            "a_proc": z(a_proc)}


@register("tree_value", renamed={"normalize": "normalization", "mode": "normalization"})
def tree_value(batch: TrajectoryBatch, *, episode_weight: float = 1.0, step_weight: float = 1.0,
               baseline: str = "parent", child: str = "history",
               normalization: str = "mean_std_norm", episode_weighting: str = "trajectory",
               eps: float = 1e-6, singleton: str = "zero", axis_name=None) -> Advantages:
    """Tree-node value differences: TreePS-RAG, Segment-PO tree, TEMPO / P2T at turn
    granularity, TreeMem. The node values follow those papers; their combination with GRPO's
    episode term is our choice.

    On the rollout tree of each task group (module doc; ``child`` picks the child node):
      V(u) = mean of the outcome R over the trajectories passing through node u;
      A_proc(i, k) = V(c) - V(p) for the step entering child c = child(i, k) from parent
        p = H(i, k) (``baseline="parent"``; TreePS-RAG, SPO-tree, TreeMem, TEMPO's delta), or
        V(c) - mean_{c' in children(p)} V(c') (``"siblings"``: each distinct child counted once,
        c included);
      A_proc = 0 where p has a single child (TEMPO's branch gating; for ``"parent"`` this is
        what the formula gives anyway, and is kept exact);
      A[i, k] = episode_weight A_ep(i) + step_weight A_proc(i, k), broadcast onto turn k's
        action tokens, A_ep = GRPO (``episode_advantage``: ``normalization`` ``"mean_std_norm"``
        GRPO, ``"mean_norm"`` Dr.GRPO; ``episode_weighting``, ``singleton``).
    Properties: tree consistency (V(p) is the leaf-count weighted mean of its children, so the
    step terms of a node sum to 0 over its trajectories for ``"parent"``); a depth-1 tree (one
    shared root, distinct actions, single-turn trajectories) gives A_proc = R_i - mean_g R
    (Dr.GRPO); step_weight = 0 gives GRPO exactly; for ``"parent"`` A_proc telescopes along a
    trajectory to V(its leaf) - V(its root) (= R_i - V(root) unless another trajectory ends in
    the same leaf; gated terms are 0 by the formula anyway). Singleton groups and equal outcomes
    give A_proc = 0.

    Args:
      batch: reads ``state_keys``, ``action_keys`` and ``turn_mask`` [N, K] (N trajectories x
        K turns), ``outcome``, ``group_ids`` and ``traj_mask`` [N].
      episode_weight: weight of A_ep.
      step_weight: weight of A_proc.
      baseline: ``"parent"`` or ``"siblings"`` (above).
      child: ``"history"`` or ``"action"`` (module doc).
      normalization: ``"mean_std_norm"`` (z-score) or ``"mean_norm"`` (centre only) of A_ep.
        Former name ``mode``.
      eps: added to the std of A_ep, > 0.
      episode_weighting, singleton: the episode term's (``primitives.check_episode_args``).

    ``axis_name`` and the result: see the module docstring.
    """
    check_choice("baseline", baseline, BASELINES)
    check_choice("child", child, CHILDREN)
    check_episode_args(normalization, episode_weighting, eps, singleton, 1.0)
    b = segments.local_view(batch, axis_name)
    a_ep = episode_advantage(b, normalization=normalization, weighting=episode_weighting, eps=eps,
                             singleton=singleton)
    t = _tree_terms(b, child=child, baseline=baseline)
    return combine(b, a_ep, t["a_proc"], episode_weight, step_weight)


# ----------------------------------------------------------------------------- ProGPO


def _progpo_terms(b: TrajectoryBatch, *, gamma, max_depth, prior_std, terminal,
                  prefix_normalization, eps):
    """ProGPO's per-turn pieces, dict (0 on invalid turns): g [N, K] returns, phi_d and w_d
    [N, K, D + 1] depth potentials and fusion weights, phi [N, K] fused potential, credit C,
    a_pre (exact-prefix term)."""
    valid = segments.valid_turns(b)
    g = step_returns(b, gamma)
    s0sq = jnp.square(jnp.asarray(prior_std, jnp.float32))
    phis, ws = [], []
    for d in range(max_depth + 1):  # depth 0: the state alone
        ids = segments.turn_key_ids(b, *(segments.history_keys(b, depth=d) if d else
                                         (b.state_keys,)))
        mean, std, n = segments.key_stats(g, ids, valid, ddof=1)
        var = jnp.where(n > 1, std * std, s0sq)
        phis.append(mean)
        ws.append(jnp.where(valid, n / (var + s0sq), 0.0))
    phi_d, w_d = jnp.stack(phis, -1), jnp.stack(ws, -1)
    # Fused around the depth-0 mean: equal depth means give exactly that mean.
    tot = jnp.sum(w_d, -1)
    phi = phi_d[..., 0] + jnp.sum(w_d * (phi_d - phi_d[..., :1]), -1) / jnp.maximum(tot, 1e-30)
    phi = jnp.where(valid, phi, 0.0)
    last = valid & ~segments.next_turn(valid, False)
    if terminal == "outcome":
        nxt = jnp.where(last, b.outcome[:, None], segments.next_turn(phi))
        credit = gamma * nxt - phi
    else:
        nxt = jnp.where(last, 0.0, segments.next_turn(phi))
        r = jnp.where(b.turn_mask, b.turn_rewards, 0.0)
        credit = r + gamma * nxt - phi
    ids = segments.turn_key_ids(b, *segments.history_keys(b))
    a_pre = normalize_in_groups(g, ids, valid, normalization=prefix_normalization, eps=eps)
    z = lambda x: jnp.where(valid, x, 0.0)  # noqa: E731
    return {"g": z(g), "phi_d": jnp.where(valid[..., None], phi_d, 0.0), "w_d": w_d,
            "phi": phi, "credit": z(credit), "a_pre": a_pre}


@register("progpo", aliases=("progress_reliability_credit",),
          renamed={"normalize": "normalization", "prefix_normalize": "prefix_normalization",
                   "mode": "normalization", "prefix_mode": "prefix_normalization"})
def progpo(batch: TrajectoryBatch, *, gamma: float = 1.0, prefix_weight: float = 1.0,
           transition_weight: float = 1.0, max_depth: int = 2, prior_std: float = 0.5,
           terminal: str = "outcome", normalization: str = "mean_std_norm",
           prefix_normalization: str = "mean_norm", episode_weighting: str = "trajectory",
           eps: float = 1e-6, singleton: str = "zero", axis_name=None) -> Advantages:
    """ProGPO: Progress- and Reliability-Oriented Group PO. This is our reading of the paper,
    whose abstract describes the method in words: the formulas below are ours.

    G[i, k] = sum_{j >= k} gamma^(j-k) r[i, j]; keys scoped by task group.
      Exact-prefix term: A_pre(i, k) = G[i, k] - mean{G[j, l]: H(j, l) = H(i, k)} over the
        turns with the same whole history (``prefix_normalization="mean_std_norm"``: divided
        by std + eps, unbiased); 0 for a singleton prefix.
      Depth potentials, d = 0..D (D = ``max_depth``): key_d(i, k) = the last d turns of history
        and the current state (``segments.history_keys(depth=d)``; d = 0 the state alone);
        Phi_d = mean of G over the turns (visits) sharing key_d, n_d their number, sigma_d^2
        the unbiased sample variance, or the prior variance s0^2 (s0 = ``prior_std``) when
        n_d = 1.
      Inverse-variance fusion: w_d = n_d / (sigma_d^2 + s0^2) >= 0,
        Phi(s) = sum_d w_d Phi_d / sum_d w_d  (a convex combination of the depth means).
      Transition credit: C(i, k) = gamma Phi(s_{i,k+1}) - Phi(s_{i,k}) with Phi(terminal) = R_i
        (``terminal="outcome"``), so sum_k gamma^k C(i, k) = gamma^{K_i} R_i - Phi(s_{i,0})
        (gamma = 1: R_i - Phi(s_{i,0}), telescoping); or the TD form (``terminal="td"``)
        C = r[i, k] + gamma Phi(s_{i,k+1}) - Phi(s_{i,k}) with Phi(terminal) = 0, which
        telescopes to G[i, 0] - Phi(s_{i,0}).
      A[i, k] = A_ep(i) + w1 A_pre(i, k) + w2 C(i, k)   (w1 = ``prefix_weight``,
        w2 = ``transition_weight``; A_ep = GRPO via ``episode_advantage`` with ``normalization``).
    Reductions: w2 = 0 with prefix_normalization = normalization is step_group(key="history")
    (exact-prefix GiGPO); w1 = w2 = 0 is GRPO. Degenerate cases: a lone trajectory in which no
    state recurs has every key to itself, so Phi = G and C = gamma G_{k+1} - G_k (G_K := R; 0
    for outcome-only rewards and gamma = 1); equal returns and outcomes everywhere give
    Phi = G and A = 0 for gamma = 1. Sums of zero weight never divide (no NaN).
    Not implemented: the paper's "semantic expansion" (merging near-duplicate observations);
    pass such merged ids as ``state_keys``.

    Args:
      batch: reads ``state_keys``, ``action_keys``, ``turn_rewards`` and ``turn_mask`` [N, K]
        (N trajectories x K turns), ``outcome``, ``group_ids`` and ``traj_mask`` [N].
      gamma: per-turn discount, in [0, 1].
      prefix_weight: w1, the weight of A_pre.
      transition_weight: w2, the weight of C.
      max_depth: D, the longest history suffix of the potentials, an int >= 0.
      prior_std: s0, > 0.
      terminal: ``"outcome"`` or ``"td"`` (above).
      normalization: ``"mean_std_norm"`` (z-score) or ``"mean_norm"`` (centre only) of A_ep.
        Former name ``mode``.
      prefix_normalization: the same choice for A_pre. Former name ``prefix_mode``.
      eps: added to the stds, > 0.
      episode_weighting, singleton: the episode term's (``primitives.check_episode_args``).

    ``axis_name`` and the result: see the module docstring.
    """
    check_choice("terminal", terminal, TERMINALS)
    check_choice("prefix_normalization", prefix_normalization, MODES)
    check_positive("prior_std", prior_std)
    if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < 0:
        raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
    check_episode_args(normalization, episode_weighting, eps, singleton, gamma)
    b = segments.local_view(batch, axis_name)
    a_ep = episode_advantage(b, normalization=normalization, weighting=episode_weighting, eps=eps,
                             singleton=singleton)
    t = _progpo_terms(b, gamma=gamma, max_depth=max_depth, prior_std=prior_std,
                      terminal=terminal, prefix_normalization=prefix_normalization, eps=eps)
    return combine(b, a_ep, prefix_weight * t["a_pre"] + transition_weight * t["credit"],
                   1.0, 1.0)
