"""Label-, citation- and graph-driven credit routing.

Each rule reads per-turn (or per-token) labels that a host-side parser, verifier or judge
produced (citations, influence edges, segment roles, environment relevance, proof atoms,
memory selections, skill-name masks, reference-graph verdicts, divergence steps, agent ids,
counterfactual and coalition values) and routes a base advantage with them. The labels are
consumed as arrays; nothing here calls a judge.

Shapes: N trajectories of at most K turns, stored as R token rows of length T (see
``jaxrl_agent.batch``). Every rule returns ``Advantages`` whose ``token`` [R, T] is zero off
the action tokens and whose ``turn`` [N, K] is the token mean of ``token`` over each turn
(the per-agent estimators: each turn's advantage); value targets of a base pass through.

Every transform takes ``adv``, the base ``Advantages`` (``token`` [R, T]), and ``axis_name``,
the mesh axis a sharded batch is split over (or None); a re-allocation transform also takes
``shuffle`` (permute its raw weights within each trajectory first: the matched-concentration
control) and ``seed`` (of that permutation). Each returns ``adv`` with ``token`` [R, T] = A'
and ``turn`` [N, K] its token mean per turn.

Kinds (Python name, with the registry name in parentheses):

* re-allocation transforms ``f(adv, batch, *, ..., axis_name=None) -> Advantages``:
  A'_t = A_t w'_t with raw weights w >= 0 normalised by ``primitives.token_weights`` to
  token-weighted mean 1 per trajectory (mass conservation for a trajectory-constant base, sign
  preservation), constant weights giving the base bit for bit (reduction to the base estimator).
  ``shuffle=True`` permutes the raw weights within each trajectory first
  (``primitives.shuffle_weights``, the matched-concentration control):
  ``supported_citation_reweight`` (``stamp``), ``influence_graph_reweight`` (``iapo``),
  ``self_credit``, ``environment_relevance_reweight`` (``serl``), ``verifier_trace_reweight``
  (``vict``), ``selected_source_boost`` (``echo``), ``progress_aware_reweight`` (``proas``).
* masking / additive transforms: ``segment_role_bonus`` (``triage``, A_i + c_role),
  ``skill_channel_credit`` (``skillgate``, two disjoint token channels),
  ``divergence_step_blame`` (``neos``) and ``redundant_credit_pruning`` (``ggpo``)
  (sign-consistent masks).
* estimators (multi-agent, they replace the base): ``counterfactual_agent_advantage``
  (``ccpo``), ``shapley_agent_advantage`` (``sharp``). Both read ``extras[agent]`` [N, K],
  the agent acting at each turn (integer ids 0..A-1; others count as unknown), build a reward
  per agent R_a [N, A] and run GRPO of R_a per (group, agent) (``per_agent_group_advantage``:
  the std with ``ddof`` delta degrees of freedom, 1 = unbiased, 0 = population, plus ``eps``;
  ``axis_name``: the mesh axis a sharded batch is split over, or None): each turn gets its
  acting agent's advantage (0 for an unknown agent), ``turn`` [N, K] and ``token`` [R, T] (the
  turn's value on its tokens).
* plain functions: ``triage_constants`` (the projection form of TRIAGE),
  ``shapley_values`` (exact Shapley values from coalition values), ``grse_credit``.

"A_i", where a rule needs the trajectory's advantage (its sign, mostly), is the token mean
of ``adv.token`` over the trajectory's action tokens (exactly the base value's sign for a
trajectory-level base such as GRPO); weights then multiply the base per token, so a
turn-level base keeps its shape inside each weight. Success/failure of a rollout means
A_i > 0 / A_i < 0. Every label is wrapped in ``stop_gradient``.

Where a docstring says a formula is our reading of a paper, the paper describes that step in
words and the formula is this library's rendering of it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import (check_choice, check_nonneg, check_positive, check_unit,
                                is_static_real, require)
from jaxrl_agent.estimators.primitives import (apply_token_weights, shuffle_weights,
                                               token_weights)
from jaxrl_agent.registry import register

ROLES = ("progress", "exploration", "infrastructure", "regression")  # TRIAGE label 0..3


# ----------------------------------------------------------------------------- helpers


def _check_range(name, value, lo, hi):
    if is_static_real(value) and not lo <= value <= hi:
        raise ValueError(f"{name} must lie in [{lo}, {hi}], got {value}")


def _turn_signal(b: TrajectoryBatch, name, who, what, token_ok=False):
    """extras[name] as float32 [N, K] (or [R, T] with ``token_ok``), 0 outside the masks,
    gradient stopped."""
    x = require(b, name, who, what)
    shapes = [b.turn_mask.shape] + ([b.tokens.shape] if token_ok else [])
    if tuple(x.shape) not in shapes:
        want = " or ".join(str(tuple(s)) for s in shapes)
        raise ValueError(f"{who}: extras['{name}'] must have shape {want} ({what}), got "
                         f"{tuple(x.shape)}")
    x = jax.lax.stop_gradient(jnp.asarray(x, jnp.float32))
    mask = segments.valid_turns(b) if x.shape == b.turn_mask.shape else b.action_mask
    return jnp.where(mask, x, 0.0)


def _traj_signal(batch, axis_name, name, who, what, vector=False):
    """extras[name] as float32 [N] (or [N, D] with ``vector``), 0 on padding trajectories.
    Read from the localized batch, not ``zero_padding``'s output: an [N, D] vector with
    D = K would be masked there as if it were per turn."""
    b = segments.localize(batch, axis_name)
    x = require(b, name, who, what)
    n = b.num_traj
    ok = (x.ndim == 2 and x.shape[0] == n) if vector else tuple(x.shape) == (n,)
    if not ok:
        want = f"[N, D] with N = {n}" if vector else f"[N] = ({n},)"
        raise ValueError(f"{who}: extras['{name}'] must have shape {want} ({what}), got "
                         f"{tuple(x.shape)}")
    x = jax.lax.stop_gradient(jnp.asarray(x, jnp.float32))
    m = b.traj_mask.reshape((n,) + (1,) * (x.ndim - 1))
    return jnp.where(m, x, 0.0)


def trajectory_advantage(adv: Advantages, b: TrajectoryBatch):
    """A_i [N]: the token mean of ``adv.token`` over each trajectory's action tokens (0 for
    a trajectory without any). ``b`` must be block-local."""
    tok = jnp.where(b.action_mask, adv.token, 0.0)
    s = jax.ops.segment_sum(tok.sum(axis=1), b.row_traj, b.num_traj)
    cnt = segments.traj_token_counts(b)
    return jnp.where(b.traj_mask & (cnt > 0), s / jnp.maximum(cnt, 1.0), 0.0)


def _last_turn(b: TrajectoryBatch):
    """[N, K] bool: k is the trajectory's last valid turn."""
    valid = segments.valid_turns(b)
    k = jnp.arange(b.num_turns)[None, :]
    last = jnp.max(jnp.where(valid, k, -1), axis=1, keepdims=True)
    return valid & (k == last)


def _maybe_shuffle(raw, batch, shuffle, seed, axis_name):
    return shuffle_weights(raw, batch, level="trajectory", seed=seed,
                           axis_name=axis_name) if shuffle else raw


def _route(adv, raw, b, batch, shuffle, seed, axis_name):
    """A'_t = A_t w'_t, w' = raw weights (optionally shuffled) at token mean 1 per
    trajectory."""
    raw = _maybe_shuffle(raw, batch, shuffle, seed, axis_name)
    return apply_token_weights(adv, token_weights(raw, b, level="trajectory"), b)


def _scale(adv, w, b):
    """A'_t = A_t w_t without renormalisation (w per turn [N, K] or per token [R, T])."""
    if w.shape == b.turn_mask.shape:
        w = segments.turn_to_token(w, b)
    return apply_token_weights(adv, w, b)


def _with_token(adv, tok, b):
    tok = jnp.where(b.action_mask, tok, 0.0).astype(jnp.float32)
    turn = jnp.where(segments.valid_turns(b), segments.token_to_turn(tok, b, "mean"), 0.0)
    return adv.replace(token=tok, turn=turn)


# ----------------------------------------------------------------------------- STAMP


@register("stamp", kind="transform")
def supported_citation_reweight(adv: Advantages, batch: TrajectoryBatch, *,
                                citations: str = "supported_citations", alpha: float = 1.0,
                                shuffle: bool = False, seed: int = 0,
                                axis_name=None) -> Advantages:
    """STAMP provenance-based step credit: sign-preserving modulation of each step by the
    supported citations it first exposed.

    c_k = ``extras[citations]`` [N, K]: the number of supported cited documents whose first
    exposure was step k (the verifier and the first-exposure attribution run on the host;
    negative counts are read as 0).

        c~_k = c_k / max(1, sum_k c_k),   m_k = 1 + alpha c~_k,
        A'_t = A_t m'_k(t),  m' = m at token-weighted mean 1 per trajectory.

    This is our reading of the STAMP paper, which describes the step in words. The trajectory
    mean is kept (mass conservation), so the ranking of trajectory means within a group is
    that of A_i; m > 0 (sign preservation); no supported citation (or alpha = 0) gives the
    base exactly (reduction to the base estimator).

    Args:
      batch: the batch; reads ``extras[citations]`` [N, K].
      citations: the name of that extra.
      alpha: >= 0, the strength of the modulation.

    ``adv``, ``shuffle``, ``seed``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("alpha", alpha)
    b = segments.local_view(batch, axis_name)
    c = jnp.maximum(_turn_signal(b, citations, "stamp", "supported citations first exposed at "
                                 "each turn, [N, K]"), 0.0)
    m = 1.0 + alpha * c / jnp.maximum(1.0, c.sum(axis=1, keepdims=True))
    return _route(adv, m, b, batch, shuffle, seed, axis_name)


# ----------------------------------------------------------------------------- IAPO


def influence_degrees(edges, b: TrajectoryBatch, *, num_types: int = 2, dedup: bool = True):
    """Out- and in-degrees of every turn per edge type from an edge list.

    ``edges`` [N, E, 3] int (src_turn, dst_turn, type); an edge counts when both ends are
    valid turns of its trajectory and 0 <= type < ``num_types`` (rows of -1 and other types
    are ignored). With ``dedup`` an edge repeated in one trajectory (same src, dst and type)
    counts once; without, every copy counts.

    Returns:
      (outdeg, indeg): float32 [num_types, N, K].
    """
    edges = jnp.asarray(edges)
    n, k = b.num_traj, b.num_turns
    src, dst, typ = edges[..., 0], edges[..., 1], edges[..., 2]
    valid = segments.valid_turns(b)
    rows = jnp.arange(n)[:, None]
    inside = (src >= 0) & (src < k) & (dst >= 0) & (dst < k) & (typ >= 0) & (typ < num_types)
    ok = inside & valid[rows, jnp.clip(src, 0, k - 1)] & valid[rows, jnp.clip(dst, 0, k - 1)]
    if dedup:
        e = edges.shape[1]
        same = ((src[:, :, None] == src[:, None, :]) & (dst[:, :, None] == dst[:, None, :])
                & (typ[:, :, None] == typ[:, None, :]))
        earlier = jnp.tril(jnp.ones((e, e), bool), -1)  # [e, e']: e' < e
        ok = ok & ~jnp.any(same & ok[:, None, :] & earlier[None], axis=2)
    seg_t = jnp.clip(typ, 0, num_types - 1) * (n * k) + rows * k
    none = num_types * n * k
    one = ok.astype(jnp.float32).reshape(-1)
    out = jax.ops.segment_sum(one, jnp.where(ok, seg_t + src, none).reshape(-1), none)
    inn = jax.ops.segment_sum(one, jnp.where(ok, seg_t + dst, none).reshape(-1), none)
    return out.reshape(num_types, n, k), inn.reshape(num_types, n, k)


@register("iapo", kind="transform")
def influence_graph_reweight(adv: Advantages, batch: TrajectoryBatch, *, edges: str = "edges",
                             alpha: float = 1.0, beta: float = 1.0, dedup: bool = True,
                             shuffle: bool = False, seed: int = 0,
                             axis_name=None) -> Advantages:
    """IAPO (Influence-Aware Policy Optimization): routing over a typed influence graph of
    the trajectory's actions.

    ``extras[edges]`` [N, E, 3] = (src_turn, dst_turn, type) from a parser or judge, type 0 =
    support-use (dst correctly used information src produced), 1 = failed-use (dst misused
    it or acted on missing information); other types and -1 rows are ignored.

        A_i > 0:  u_k = 1 + alpha outdeg_support(k) + beta [k is the final action]
        A_i < 0:  u_k = 1 + alpha outdeg_failed(k) + beta indeg_failed(k)
        A'_t = A_t u'_k(t),  u' = u at token-weighted mean 1 per trajectory.

    This is our reading of the IAPO paper, which describes the step in words. Duplicate
    edges: with ``dedup=True`` (default) a repeated (src, dst, type) counts once, so the
    weights are invariant to duplicated edges; ``dedup=False`` counts multiplicity (a judge
    that repeats an edge means it more). Mass conservation, sign preservation; a failed
    trajectory without edges, and a successful one without edges when beta = 0, gets the base
    exactly (reduction to the base estimator).

    Args:
      batch: the batch; reads ``extras[edges]`` [N, E, 3] int.
      edges: the name of that extra.
      alpha: >= 0, the weight of an out-degree.
      beta: >= 0, the weight of the final action (success) or of an in-degree (failure).
      dedup: count a repeated edge once.

    ``adv``, ``shuffle``, ``seed``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("alpha", alpha)
    check_nonneg("beta", beta)
    b = segments.local_view(batch, axis_name)
    e = require(b, edges, "iapo", "influence edges [N, E, 3] (src_turn, dst_turn, type)")
    if e.ndim != 3 or e.shape[0] != b.num_traj or e.shape[2] != 3:
        raise ValueError(f"iapo: extras['{edges}'] must have shape [N, E, 3] with N = "
                         f"{b.num_traj}, got {tuple(e.shape)}")
    out, inn = influence_degrees(jax.lax.stop_gradient(e), b, dedup=dedup)
    a_i = trajectory_advantage(adv, b)[:, None]
    final = _last_turn(b).astype(jnp.float32)
    u_succ = 1.0 + alpha * out[0] + beta * final
    u_fail = 1.0 + alpha * out[1] + beta * inn[1]
    u = jnp.where(a_i > 0, u_succ, jnp.where(a_i < 0, u_fail, 1.0))
    return _route(adv, u, b, batch, shuffle, seed, axis_name)


# ----------------------------------------------------------------------------- Self-Credit


def citation_rates(cite, success, failure, b: TrajectoryBatch):
    """Per cited turn, the rates at which the successful / failed rollouts of its group cite
    the same action key (``b.action_keys``, matched exactly inside the group):

        s_a = #successful rollouts citing a / max(1, #successful in the group)
        f_a = #failed rollouts citing a / max(1, #failed in the group)

    A rollout citing a in several turns counts once. Args: ``cite`` [N, K] bool,
    ``success``/``failure`` [N] bool. Returns (s, f) [N, K], 0 on uncited turns.
    """
    n, k = b.num_traj, b.num_turns
    nk = n * k
    cite = cite & segments.valid_turns(b)
    ids = segments.turn_key_ids(b, b.action_keys, valid=cite)
    # one representative turn per (rollout, key): no earlier cited turn of the rollout has it
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # [k, k']: k' < k
    seen = jnp.any((ids[:, :, None] == ids[:, None, :]) & cite[:, None, :] & earlier, axis=2)
    first = cite & ~seen

    def rate(flag):
        hits = jax.ops.segment_sum((first & flag[:, None]).astype(jnp.float32).reshape(-1),
                                   ids.reshape(-1), nk)
        total = jax.ops.segment_sum((flag & b.traj_mask).astype(jnp.float32), b.group_ids, n)
        r = hits[jnp.clip(ids, 0, nk - 1)] / jnp.maximum(1.0, total[b.group_ids])[:, None]
        return jnp.where(cite, r, 0.0)

    return rate(success), rate(failure)


@register("self_credit", kind="transform")
def self_credit(adv: Advantages, batch: TrajectoryBatch, *, cite: str = "cite",
                alpha: float = 1.0, alpha_fail: float = 0.5, w_min: float = 0.1,
                variant: str = "reweight", shuffle: bool = False, seed: int = 0,
                axis_name=None) -> Advantages:
    """Self-Credit: self-generated citations with intra-group rescaling.

    ``extras[cite]`` [N, K] (> 0.5: the policy's summary cites turn k); cited turns are
    matched across the rollouts of a group by ``action_keys`` (e.g. the canonical search
    query), giving s_a, f_a (``citation_rates``). Success means A_i > 0, failure A_i < 0.

        successful rollout, cited turn:  w = 1 + alpha (s_a - f_a)_+
        failed rollout, cited turn:      w = max(w_min, 1 - alpha_fail s_a)
        uncited turns (and A_i = 0):     w = 1
        A'_t = A_t w_k(t)        (variant "reweight", the default: cited turns change)
        A'_t = A_t w'_k(t)       (variant "conserve": w' at token mean 1 per trajectory)

    This is our reading of the Self-Credit paper, which describes the step in words. Sign
    preservation (w >= w_min > 0 or w_min = 0); no citation gives the base exactly (reduction
    to the base estimator). Symmetry: a key cited at equal rates by both sides (s_a = f_a)
    keeps w = 1 in successful rollouts.

    Args:
      batch: the batch; reads ``extras[cite]`` [N, K], ``action_keys`` [N, K] and
        ``group_ids`` [N].
      cite: the name of the citation extra.
      alpha: >= 0, the boost of a cited turn in a successful rollout.
      alpha_fail: >= 0, the cut of a cited turn in a failed rollout.
      w_min: in [0, 1], the smallest weight of a cited turn in a failed rollout.
      variant: ``"reweight"`` (weights as they are) or ``"conserve"`` (weights at token mean
        1 per trajectory).

    ``adv``, ``shuffle``, ``seed``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("alpha", alpha)
    check_nonneg("alpha_fail", alpha_fail)
    check_unit("w_min", w_min)
    check_choice("variant", variant, ("reweight", "conserve"))
    b = segments.local_view(batch, axis_name)
    c = _turn_signal(b, cite, "self_credit", "1 where the summary cites turn k, [N, K]") > 0.5
    a_i = trajectory_advantage(adv, b)
    succ, fail = a_i > 0, a_i < 0
    s, f = citation_rates(c, succ, fail, b)
    w_s = 1.0 + alpha * jnp.maximum(s - f, 0.0)
    w_f = jnp.maximum(w_min, 1.0 - alpha_fail * s)
    w = jnp.where(c & succ[:, None], w_s, jnp.where(c & fail[:, None], w_f, 1.0))
    w = jnp.where(segments.valid_turns(b), w, 0.0)
    if variant == "conserve":
        return _route(adv, w, b, batch, shuffle, seed, axis_name)
    return _scale(adv, _maybe_shuffle(w, batch, shuffle, seed, axis_name), b)


# ----------------------------------------------------------------------------- TRIAGE


def _roles(b, role, who):
    r = _turn_signal(b, role, who, "segment role 0=progress 1=exploration 2=infrastructure "
                     "3=regression, [N, K]")
    ri = jnp.round(r).astype(jnp.int32)
    known = segments.valid_turns(b) & (r == ri) & (ri >= 0) & (ri < len(ROLES))
    return jnp.clip(ri, 0, len(ROLES) - 1), known


@register("triage", kind="transform")
def segment_role_bonus(adv: Advantages, batch: TrajectoryBatch, *, role: str = "role",
                       bound: float = 0.5, c_progress: float = 1.0, c_exploration: float = 0.5,
                       c_infrastructure: float = 0.0, c_regression: float = -1.0,
                       sign_consistent: bool = False, axis_name=None) -> Advantages:
    """TRIAGE role-typed credit: bounded segment rewards from role labels.

    ``extras[role]`` [N, K] in {0: decisive progress P, 1: useful exploration E, 2:
    no-progress infrastructure I, 3: regression R} (a structured judge's labels; any other
    value counts as unlabelled, c = 0).

        A'_t = A_t + bound * c_role(k(t)),   c = (c_progress, c_exploration,
                                                  c_infrastructure, c_regression)

    This is our reading of the TRIAGE paper, which describes the step in words. Defaults
    c = (+1, +1/2, 0, -1) (the paper's (+b, +b/2, 0, -b)), each in [-1, 1], so
    |A' - A| <= bound (bounds). ``sign_consistent=True`` keeps the verifier's direction: A' is
    clipped to [0, inf) when A_i > 0 and to (-inf, 0] when A_i < 0 (and set to 0 when
    A_i = 0), so no step of a successful trajectory turns negative nor of a failed one
    positive (sign preservation). All-infrastructure labels give the base exactly (reduction to
    the base estimator). The data-driven constants are ``triage_constants``.

    Args:
      batch: the batch; reads ``extras[role]`` [N, K] (integers 0..3).
      role: the name of that extra.
      bound: >= 0, b: the largest change of an advantage.
      c_progress, c_exploration, c_infrastructure, c_regression: each in [-1, 1], the
        constant of each role, in units of ``bound``.
      sign_consistent: clip A' to the sign of A_i (above).

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("bound", bound)
    for name, v in (("c_progress", c_progress), ("c_exploration", c_exploration),
                    ("c_infrastructure", c_infrastructure), ("c_regression", c_regression)):
        _check_range(name, v, -1.0, 1.0)
    b = segments.local_view(batch, axis_name)
    r, known = _roles(b, role, "triage")
    consts = jnp.asarray([c_progress, c_exploration, c_infrastructure, c_regression],
                         jnp.float32)
    bonus = jnp.where(known, bound * consts[r], 0.0)
    tok = adv.token + segments.turn_to_token(bonus, b)
    if sign_consistent:
        a_i = segments.traj_to_token(trajectory_advantage(adv, b), b)
        tok = jnp.where(a_i > 0, jnp.maximum(tok, 0.0), jnp.where(a_i < 0,
                                                                  jnp.minimum(tok, 0.0), 0.0))
    return _with_token(adv, tok, b)


def triage_constants(target, base, batch: TrajectoryBatch, *, role: str = "role",
                     axis_name=None):
    """TRIAGE's data-driven constants (the projection form; our reading of the TRIAGE paper).

        c_rho = mean over valid turns with role rho of (A*_k - A_k)

    with ``target`` A* [N, K] a better per-segment estimate (e.g. a GiGPO step advantage)
    and ``base`` [N, K] the base per-turn advantage (A_i for a trajectory-level base). This
    is the least-squares minimiser of sum_k (A*_k - A_k - c_role(k))^2 (the conditional
    mean of the residual given the role); a role with no segment gets 0. Each segment
    counts once (not by tokens). Batch-wide: sums are ``psum``-ed over ``axis_name``.

    Returns:
      [4] float32, the constants in ``ROLES`` order, in advantage units (pass
      c / bound to ``segment_role_bonus``, registered as ``triage``, as the c_*
      hyper-parameters).
    """
    b = segments.local_view(batch, axis_name)
    r, known = _roles(b, role, "triage_constants")
    resid = jax.lax.stop_gradient(jnp.asarray(target, jnp.float32) - jnp.asarray(base,
                                                                               jnp.float32))
    onehot = (r[..., None] == jnp.arange(len(ROLES))) & known[..., None]
    num = segments.psum(jnp.sum(jnp.where(onehot, resid[..., None], 0.0), axis=(0, 1)),
                        axis_name)
    cnt = segments.psum(jnp.sum(onehot.astype(jnp.float32), axis=(0, 1)), axis_name)
    return jnp.where(cnt > 0, num / jnp.maximum(cnt, 1.0), 0.0)


# ----------------------------------------------------------------------------- SERL, VICT, ECHO


@register("serl", kind="transform")
def environment_relevance_reweight(adv: Advantages, batch: TrajectoryBatch, *,
                                   relevance: str = "relevance", alpha: float = 1.0,
                                   shuffle: bool = False, seed: int = 0,
                                   axis_name=None) -> Advantages:
    """SERL (selective environment-reweighted learning): the task reward sets the direction,
    environment feedback the placement.

    ``extras[relevance]`` [N, K] or [R, T] >= 0 (e.g. an error right after the action, or
    the divergence from a reference trajectory):

        w = max(0, 1 + alpha relevance),  A'_t = A_t w'_t,  w' at token mean 1 per trajectory.

    Mass conservation, sign preservation; constant relevance or alpha = 0 gives the base exactly
    (reduction to the base estimator).

    Args:
      batch: the batch; reads ``extras[relevance]``, per turn [N, K] or per token [R, T].
      relevance: the name of that extra.
      alpha: >= 0, the strength of the weights.

    ``adv``, ``shuffle``, ``seed``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("alpha", alpha)
    b = segments.local_view(batch, axis_name)
    rel = _turn_signal(b, relevance, "serl", "environment relevance per turn [N, K] or per "
                       "token [R, T]", token_ok=True)
    return _route(adv, jnp.maximum(0.0, 1.0 + alpha * rel), b, batch, shuffle, seed,
                  axis_name)


@register("vict", kind="transform")
def verifier_trace_reweight(adv: Advantages, batch: TrajectoryBatch, *, atoms: str = "atoms",
                            complete: str | None = "trace_complete", alpha: float = 1.0,
                            shuffle: bool = False, seed: int = 0,
                            axis_name=None) -> Advantages:
    """VICT (Verifier-Instrumented Credit Tracing): turn weights from the verifier atoms
    traced to each turn.

    ``extras[atoms]`` [N, K]: the number of verifier atoms traced to turn k along
    dependency-valid proof edges (the tracing runs on the host; negative counts are read as
    0); ``extras[complete]`` [N]: 1 when the trace is complete and unambiguous, 0 to abstain
    (``complete=None``: every trace counts as complete).

        complete:  w_k = 1 + alpha #atoms_k,  A'_t = A_t w'_k(t)  (w' at token mean 1)
        abstain:   A' = A (uniform credit, the base bit for bit)

    This is our reading of the VICT paper, which describes the step in words. Mass
    conservation, sign preservation, reduction to the base estimator (abstain, no atoms or
    alpha = 0 give the base exactly).

    Args:
      batch: the batch; reads ``extras[atoms]`` [N, K] and ``extras[complete]`` [N].
      atoms: the name of the atom-count extra.
      complete: the name of the trace-complete extra, or None.
      alpha: >= 0, the weight of an atom.

    ``adv``, ``shuffle``, ``seed``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("alpha", alpha)
    b = segments.local_view(batch, axis_name)
    n_atoms = jnp.maximum(_turn_signal(b, atoms, "vict", "verifier atoms traced to each turn, "
                                       "[N, K]"), 0.0)
    if complete is None:
        ok = jnp.ones((b.num_traj,), bool)
    else:
        ok = _traj_signal(batch, axis_name, complete, "vict",
                          "1 = complete trace, 0 = abstain, per trajectory") > 0.5
    w = jnp.where(ok[:, None], 1.0 + alpha * n_atoms, 1.0)
    return _route(adv, w, b, batch, shuffle, seed, axis_name)


@register("echo", kind="transform", renamed={"renormalize": "normalize"})
def selected_source_boost(adv: Advantages, batch: TrajectoryBatch, *,
                          selected: str = "selected", eta: float = 1.0,
                          normalize: bool = False, shuffle: bool = False, seed: int = 0,
                          axis_name=None) -> Advantages:
    """ECHO source-indexed credit routing: a successful answer's credit is raised on the
    turns it selected as sources.

    ``extras[selected]`` [N, K] (> 0.5: turn k is a memory source selected into the rebuilt
    context, or a selection action, of a successful answer).

        A_i > 0:  w_k = 1 + eta [k selected];  A_i <= 0: w_k = 1
        A'_t = A_t w_k(t)   (``normalize=True``: w at token mean 1 per trajectory)

    This is our reading of the ECHO paper, which describes the step in words. Sign
    preservation; failed trajectories are unchanged bit for bit.

    Args:
      batch: the batch; reads ``extras[selected]`` [N, K].
      selected: the name of that extra.
      eta: >= 0, the boost of a selected turn.
      normalize: rescale w to token mean 1 per trajectory (mass conservation).

    ``adv``, ``shuffle``, ``seed``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("eta", eta)
    b = segments.local_view(batch, axis_name)
    sel = _turn_signal(b, selected, "echo", "1 where turn k is a selected source, [N, K]") > 0.5
    pos = trajectory_advantage(adv, b)[:, None] > 0
    w = jnp.where(segments.valid_turns(b), jnp.where(pos & sel, 1.0 + eta, 1.0), 0.0)
    if normalize:
        return _route(adv, w, b, batch, shuffle, seed, axis_name)
    return _scale(adv, _maybe_shuffle(w, batch, shuffle, seed, axis_name), b)


# ----------------------------------------------------------------------------- SkillGate


@register("skillgate", kind="transform", renamed={"normalize": "normalization"})
def skill_channel_credit(adv: Advantages, batch: TrajectoryBatch, *,
                         skill_mask: str = "skill_mask", read_correct: str = "read_correct",
                         normalization: str = "group", eps: float = 1e-6,
                         axis_name=None) -> Advantages:
    """SkillGate: two disjoint credit channels, the outcome on the execution tokens and a
    skill-selection score on the skill-naming tokens.

    ``extras[skill_mask]`` [R, T] (true on the skill-naming tokens), ``extras[read_correct]``
    [N] (+1 a single read of the correct skill, -1 a wrong read, 0 multiple or no reads).

        A'_t = A_t [t execution token] + a_sel(i) [t skill-naming token]

    the execution tokens being action tokens outside the skill mask. a_sel =
    ``normalization="group"``: (x_i - mean_g x) / (std_g x + eps) over the group (unbiased std;
    0 for a singleton); ``"raw"``: read_correct itself. The two token sets are disjoint: the
    outcome never touches a skill token and a_sel never an execution token
    (``skillgate_channels`` returns them).

    Args:
      batch: the batch; reads ``extras[skill_mask]`` [R, T], ``extras[read_correct]`` [N]
        and ``group_ids`` [N].
      skill_mask: the name of the skill-token mask extra.
      read_correct: the name of the skill-read score extra.
      normalization: ``"group"`` (standardise x within each group) or ``"raw"``.
      eps: > 0, added to the group std.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_choice("normalization", normalization, ("group", "raw"))
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    mask = require(b, skill_mask, "skillgate", "skill-naming token mask [R, T]")
    if tuple(mask.shape) != b.tokens.shape:
        raise ValueError(f"skillgate: extras['{skill_mask}'] must have shape [R, T] = "
                         f"{b.tokens.shape}, got {tuple(mask.shape)}")
    skill = b.action_mask & (jnp.asarray(mask) > 0.5 if mask.dtype != bool else mask)
    x = _traj_signal(batch, axis_name, read_correct, "skillgate",
                     "+1 correct single read, -1 wrong, 0 none/multiple")
    if normalization == "group":
        mean, std, cnt = segments.group_stats(x, b.group_ids, b.traj_mask)
        x = jnp.where(cnt > 1, (x - mean) / (std + eps), 0.0)
    tok = jnp.where(skill, segments.traj_to_token(x, b), jnp.where(b.action_mask, adv.token,
                                                                   0.0))
    return _with_token(adv, tok, b)


def skillgate_channels(batch: TrajectoryBatch, *, skill_mask: str = "skill_mask"):
    """The two token channels of ``skill_channel_credit`` (``skillgate``): (execution [R, T],
    skill [R, T]) bool, disjoint, their union the action mask."""
    mask = require(batch, skill_mask, "skillgate", "skill-naming token mask [R, T]")
    skill = batch.action_mask & (jnp.asarray(mask) > 0.5 if mask.dtype != bool else mask)
    return batch.action_mask & ~skill, skill


# ----------------------------------------------------------------------------- ProAS


@register("proas", kind="transform")
def progress_aware_reweight(adv: Advantages, batch: TrajectoryBatch, *,
                            reasonable: str = "reasonable", deviation: str = "deviation",
                            alpha: float = 1.0, beta: float = 0.5, shuffle: bool = False,
                            seed: int = 0, axis_name=None) -> Advantages:
    """ProAS progress-aware advantage shaping with an Agentic Reference Graph. The
    reference-graph verdicts are host-side labels: ``extras[reasonable]`` [N, K] (> 0.5: the
    transition lies on a reasonable reference path) and ``extras[deviation]`` [N, K] >= 0
    (downstream deviations caused by the action; > 0 marks a deviating action).

        MUI (A_i > 0):  A'_t = A_t [reasonable_k(t)]     (unreasonable actions get 0)
        APR (A_i < 0):  w_k = 1 + alpha dev_k (deviating), 1 - beta (reasonable, not
                        deviating), 1 (otherwise);  A'_t = A_t w'_k(t), w' at token mean 1
        A_i = 0: unchanged.

    This is our reading of the ProAS paper, which describes the step in words. MUI only
    removes positive mass; APR keeps the trajectory's mass and signs (sign preservation,
    beta <= 1).

    Args:
      batch: the batch; reads ``extras[reasonable]`` and ``extras[deviation]``, [N, K] each.
      reasonable: the name of the reasonable-transition extra.
      deviation: the name of the deviation-count extra (negative values count as 0).
      alpha: >= 0, the weight of a downstream deviation (failed rollouts).
      beta: in [0, 1], the cut of a reasonable, non-deviating action (failed rollouts).

    ``adv``, ``shuffle``, ``seed``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("alpha", alpha)
    check_unit("beta", beta)
    b = segments.local_view(batch, axis_name)
    ok = _turn_signal(b, reasonable, "proas", "1 where the action is reasonable, [N, K]") > 0.5
    dev = jnp.maximum(_turn_signal(b, deviation, "proas", "downstream deviations of each "
                                   "action, [N, K]"), 0.0)
    a_i = trajectory_advantage(adv, b)
    fail = a_i < 0
    apr = jnp.where(dev > 0, 1.0 + alpha * dev, jnp.where(ok, 1.0 - beta, 1.0))
    apr = jnp.where(fail[:, None], apr, 1.0)
    apr = _maybe_shuffle(apr, batch, shuffle, seed, axis_name)
    w = token_weights(apr, b, level="trajectory")
    mui = segments.turn_to_token(ok.astype(jnp.float32), b)
    w = jnp.where(segments.traj_to_token(a_i, b) > 0, mui, w)
    return apply_token_weights(adv, w, b)


# ----------------------------------------------------------------------------- Neos, GGPO


@register("neos", kind="transform")
def divergence_step_blame(adv: Advantages, batch: TrajectoryBatch, *,
                          divergence: str = "divergence_step", after: str = "keep",
                          axis_name=None) -> Advantages:
    """Neos reference-guided credit: a failed search is blamed from its first critical
    divergence from a successful reference on, not before.

    ``extras[divergence]`` [N]: the first critical divergence step of a failed search from an
    aligned verified successful trajectory of the same task (the alignment runs on the host);
    < 0 (or past the last turn) when there is none.

    For a failed trajectory (A_i < 0) with a divergence step d:
        k < d:  A'_k = max(A_i, 0) = 0    (the shared prefix is not blamed)
        k = d:  A'_k = A_k                (the divergence step takes the full penalty)
        k > d:  A'_k = A_k (``after="keep"``) or 0 (``after="zero"``)

    This is our reading of the Neos paper, which describes the step in words. Successful
    trajectories and failed ones without a divergence are unchanged. Only zeroes entries, so
    signs are kept (sign preservation).

    Args:
      batch: the batch; reads ``extras[divergence]`` [N] (rounded to an integer turn index).
      divergence: the name of that extra.
      after: ``"keep"`` or ``"zero"``: the credit of the turns after the divergence step.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_choice("after", after, ("keep", "zero"))
    b = segments.local_view(batch, axis_name)
    d = _traj_signal(batch, axis_name, divergence, "neos",
                     "first divergence step per trajectory, -1 for none")
    d = jnp.round(d).astype(jnp.int32)[:, None]
    k = jnp.arange(b.num_turns)[None, :]
    n_turns = segments.valid_turns(b).sum(axis=1, keepdims=True)
    active = (trajectory_advantage(adv, b)[:, None] < 0) & (d >= 0) & (d < n_turns)
    keep = jnp.where(k < d, 0.0, jnp.where(k == d, 1.0, 1.0 if after == "keep" else 0.0))
    w = jnp.where(active, keep, 1.0)
    return _scale(adv, w, b)


@register("ggpo", kind="transform")
def redundant_credit_pruning(adv: Advantages, batch: TrajectoryBatch, *,
                             redundant: str = "redundant", axis_name=None) -> Advantages:
    """VimRAG graph-guided policy optimization's (GGPO) pruning rule: no positive credit on
    steps pruned as redundant.

    ``extras[redundant]`` [N, K] or [R, T] (> 0.5: the memory-graph node of the turn or
    token was pruned as redundant):

        A'_t = min(A_t, 0) on redundant tokens, A_t elsewhere

    This is our reading of the VimRAG paper, which describes the rule in words. Penalties are
    kept. Sign preservation.

    Args:
      batch: the batch; reads ``extras[redundant]``, per turn [N, K] or per token [R, T].
      redundant: the name of that extra.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    b = segments.local_view(batch, axis_name)
    red = _turn_signal(b, redundant, "ggpo", "1 on pruned redundant turns [N, K] or tokens "
                       "[R, T]", token_ok=True) > 0.5
    if red.shape == b.turn_mask.shape:
        red = segments.turn_to_token(red, b)
    return _with_token(adv, jnp.where(red, jnp.minimum(adv.token, 0.0), adv.token), b)


# ----------------------------------------------------------------------------- multi-agent


def _agents(b, agent, num_agents, who):
    a = _turn_signal(b, agent, who, "acting agent id per turn, [N, K]")
    ai = jnp.round(a).astype(jnp.int32)
    known = segments.valid_turns(b) & (ai >= 0) & (ai < num_agents)
    return jnp.clip(ai, 0, num_agents - 1), known


def per_agent_group_advantage(rewards, agent_ids, known, b: TrajectoryBatch, *,
                              eps: float = 1e-6, ddof: int = 1):
    """GRPO per (group, agent): per-turn advantages [N, K] from role rewards R [N, A].

    Trajectory i enters the statistics of (g(i), a) when agent a acts in one of its valid
    turns; Ahat_{i,a} = (R_{i,a} - mean) / (std + eps) over those (unbiased std by default;
    0 for a singleton). Turn k gets Ahat_{i, agent(k)}; turns of unknown agents get 0.
    """
    n, na = rewards.shape
    onehot = (agent_ids[..., None] == jnp.arange(na)) & known[..., None]  # [N, K, A]
    present = jnp.any(onehot, axis=1) & b.traj_mask[:, None]
    ids = b.group_ids[:, None] * na + jnp.arange(na)[None, :]
    mean, std, cnt = segments.segment_stats(rewards.reshape(-1), ids.reshape(-1),
                                            present.reshape(-1), n * na, ddof)
    safe = jnp.clip(ids, 0, n * na - 1)
    mean, std, cnt = mean[safe], std[safe], cnt[safe]
    a = jnp.where(present & (cnt > 1), (rewards - mean) / (std + eps), 0.0)
    turn = jnp.where(known, jnp.take_along_axis(a, agent_ids, axis=1), 0.0)
    return turn


def _agent_advantages(b, role_rewards, agent, eps, ddof, who):
    """The shared tail of ``ccpo`` and ``sharp``: GRPO of the role rewards [N, A] per (group,
    acting agent), as ``Advantages`` (each turn gets its acting agent's advantage ``turn``
    [N, K], 0 for an unknown agent, and ``token`` [R, T] the turn's value on its tokens)."""
    ag, known = _agents(b, agent, role_rewards.shape[1], who)
    turn = per_agent_group_advantage(role_rewards, ag, known, b, eps=eps, ddof=ddof)
    return Advantages(token=segments.turn_to_token(turn, b), turn=turn)


def _check_group_std(eps, ddof):
    check_positive("eps", eps)
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 or 1, got {ddof}")


@register("ccpo", renamed={"lam": "weight"})
def counterfactual_agent_advantage(batch: TrajectoryBatch, *, agent: str = "agent",
                                   counterfactual: str = "counterfactual_outcome",
                                   weight: float = 1.0, eps: float = 1e-6, ddof: int = 1,
                                   axis_name=None) -> Advantages:
    """CCPO counterfactual credit for multi-agent teams; an estimator. Each agent's reward
    adds what the team loses without it, then GRPO runs per (group, agent).

    ``extras[agent]`` [N, K]: the agent acting at turn k (0..A-1); ``extras[counterfactual]``
    [N, A]: R(team without agent a), from re-executing the pipeline without it (or with a
    null output) on the host; R = ``outcome``.

        c_a = R - R_without_a,   R_a = R + weight c_a,
        A_{i,k} = GRPO of R_{., agent(k)} within (group, agent)  (``per_agent_group_advantage``)

    This is our reading of the CCPO paper, which describes the step in words. An agent whose
    removal leaves R unchanged gets c_a = 0 (R_a = R); weight = 0 gives GRPO of R within each
    (group, agent).

    Args:
      batch: the batch; reads ``outcome`` [N], ``group_ids`` [N], ``extras[agent]`` [N, K]
        and ``extras[counterfactual]`` [N, A].
      counterfactual: the name of the team-outcome-without-each-agent extra.
      weight: >= 0, the weight of the counterfactual contribution c_a.

    ``agent``, ``eps`` (> 0, added to the group std), ``ddof`` (0 or 1), ``axis_name`` and the
    result (``turn`` [N, K] each turn's acting agent's advantage, ``token`` [R, T]): the
    multi-agent section of the module docstring.
    """
    check_nonneg("weight", weight)
    _check_group_std(eps, ddof)
    b = segments.local_view(batch, axis_name)
    without = _traj_signal(batch, axis_name, counterfactual, "ccpo",
                           "team outcome without agent a, [N, A]", vector=True)
    r = jax.lax.stop_gradient(b.outcome)[:, None]
    return _agent_advantages(b, r + weight * (r - without), agent, eps, ddof, "ccpo")


def _shapley_matrix(n: int) -> np.ndarray:
    """W [2^n, n] with phi = v @ W: W[S, a] = w(|S| - 1) if a in S else -w(|S|), where
    w(s) = s! (n - s - 1)! / n!."""
    w = [math.factorial(s) * math.factorial(n - s - 1) / math.factorial(n) for s in range(n)]
    m = np.zeros((2 ** n, n), np.float64)
    for s in range(2 ** n):
        size = bin(s).count("1")
        for a in range(n):
            m[s, a] = w[size - 1] if s >> a & 1 else -w[size]
    return m


def shapley_values(v):
    """Exact Shapley values from coalition values, [..., 2^n] -> [..., n].

    v[..., S] is the value of the coalition whose members are the set bits of S (bit a =
    agent a; v[..., 0] the empty coalition).

        phi_a = sum_{S subset N \\ a} |S|! (n - |S| - 1)! / n! [v(S u a) - v(S)]

    Efficiency sum_a phi_a = v(N) - v(empty); symmetric agents get equal values; a null
    player gets 0. Cost O(2^n n) (n <= 16).
    """
    v = jnp.asarray(v, jnp.float32)
    d = v.shape[-1]
    n = d.bit_length() - 1
    if d < 2 or 2 ** n != d or n > 16:
        raise ValueError(f"coalition values need 2^n entries (1 <= n <= 16) on the last "
                         f"axis, got {d}")
    w = jnp.asarray(_shapley_matrix(n), jnp.float32)
    return jnp.einsum("...s,sa->...a", v, w, precision=jax.lax.Precision.HIGHEST)


@register("sharp")
def shapley_agent_advantage(batch: TrajectoryBatch, *, agent: str = "agent",
                            coalition_values: str = "coalition_values", beta: float = 1.0,
                            tool_rewards: str | None = None, delta: float = 0.0,
                            eps: float = 1e-6, ddof: int = 1, axis_name=None) -> Advantages:
    """SHARP Shapley credit for multi-agent teams; an estimator. Each agent's reward adds its
    exact Shapley value from coalition values, then GRPO runs per (group, agent).

    ``extras[agent]`` [N, K] (acting agent per turn, 0..n-1); ``extras[coalition_values]``
    [N, 2^n] (v(S) per coalition bitmask S, from re-executions on the host);
    ``extras[tool_rewards]`` [N, n] optional per-agent tool rewards; R_global = ``outcome``.

        R_a = R_global + beta phi_a + delta r_tool,a,   phi = ``shapley_values(v)``
        A_{i,k} = GRPO of R_{., agent(k)} within (group, agent)  (advantages per agent)

    This is our reading of the SHARP paper, which describes the step in words.
    beta = delta = 0 gives GRPO of R within each (group, agent).

    Args:
      batch: the batch; reads ``outcome`` [N], ``group_ids`` [N], ``extras[agent]`` [N, K],
        ``extras[coalition_values]`` [N, 2^n] (1 <= n <= 16) and, if named,
        ``extras[tool_rewards]`` [N, n].
      coalition_values: the name of the coalition-value extra.
      beta: >= 0, the weight of the Shapley value.
      tool_rewards: the name of the per-agent tool-reward extra, or None.
      delta: >= 0, the weight of the tool reward.

    ``agent``, ``eps`` (> 0, added to the group std), ``ddof`` (0 or 1), ``axis_name`` and the
    result (``turn`` [N, K] each turn's acting agent's advantage, ``token`` [R, T]): the
    multi-agent section of the module docstring.
    """
    check_nonneg("beta", beta)
    check_nonneg("delta", delta)
    _check_group_std(eps, ddof)
    b = segments.local_view(batch, axis_name)
    v = _traj_signal(batch, axis_name, coalition_values, "sharp",
                     "coalition values v(S) per bitmask S, [N, 2^n]", vector=True)
    phi = shapley_values(v)
    ra = jax.lax.stop_gradient(b.outcome)[:, None] + beta * phi
    if tool_rewards is not None:
        tool = _traj_signal(batch, axis_name, tool_rewards, "sharp",
                            "per-agent tool rewards, [N, n]", vector=True)
        if tool.shape != phi.shape:
            raise ValueError(f"sharp: extras['{tool_rewards}'] must have shape {phi.shape} "
                             f"(one entry per agent), got {tool.shape}")
        ra = ra + delta * tool
    return _agent_advantages(b, ra, agent, eps, ddof, "sharp")


def grse_credit(batch: TrajectoryBatch, *, active: str = "pair_active", axis_name=None):
    """GRSE (agent, skill) pair credit (our reading of the GRSE paper); a plain function, no
    weight update.

    ``extras[active]`` [N, P] (> 0.5: pair p was active in the execution); over the repeated
    executions of one question (a group):

        credit_{g,p} = mean_{i in g: p active} R_i - mean_{i in g: p inactive} R_i

    (0 when either side is empty). Returns [N, P], each trajectory's group credit.
    """
    b = segments.local_view(batch, axis_name)
    act = _traj_signal(batch, axis_name, active, "grse_credit",
                       "1 where the (agent, skill) pair was active, [N, P]", vector=True) > 0.5
    n, p = act.shape
    r = jax.lax.stop_gradient(b.outcome)[:, None]
    ok = b.traj_mask[:, None]

    def group_mean(sel):
        ids = (b.group_ids[:, None] * p + jnp.arange(p)[None, :]).reshape(-1)
        s = jax.ops.segment_sum(jnp.where(sel, r, 0.0).reshape(-1), ids, n * p)
        c = jax.ops.segment_sum(sel.astype(jnp.float32).reshape(-1), ids, n * p)
        safe = ids.reshape(n, p)
        return s[safe] / jnp.maximum(c[safe], 1.0), c[safe]

    on, c_on = group_mean(act & ok)
    off, c_off = group_mean(~act & ok)
    return jnp.where(ok & (c_on > 0) & (c_off > 0), on - off, 0.0)


# Registered by jaxrl_agent.estimators (kind: name -> function).
