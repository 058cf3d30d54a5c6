"""Dense reward and potential shaping, and the estimators built on shaped rewards.

Two kinds of functions live here (see ``jaxrl_agent.registry``; the registered names, used
in configs, are given in parentheses):

* shaping ``f(batch, *, ..., axis_name=None) -> TrajectoryBatch``: writes shaped
  ``turn_rewards`` [N, K], ``outcome`` [N] and/or ``extras['token_rewards']`` [R, T] for the
  estimator that follows (``pbrs``, ``uniform``, ``spa``, ``rebel``, ``red``, ``vpr``,
  ``nasa``, ``v_rubrics``, ``adrs``);
* estimator ``f(batch, *, ...) -> Advantages`` where the method replaces the base advantage
  (``reward_to_go``, ``pica``).

The transforms that add a per-turn term to a base estimator's advantage (or scale it) are in
``turn_credit``; the PBRS term itself (``potential_differences``, ``potential_terms``) and
``normalize_turns`` in ``primitives``, which both use.

Shapes: N trajectories, K turns, R token rows of length T (see ``jaxrl_agent.batch``).

Potential convention (PBRS): ``extras[potential]`` [N, K] is Phi(s_k), the potential of the
state *before* action k, and ``extras[final_potential]`` [N] is Phi after the last turn
(absent -> 0, the PBRS convention Phi(terminal) = 0; methods that need the real final value
require it). The shaping term of turn k is

    F_k = gamma Phi_{k+1} - Phi_k,   Phi_{K_i} = final_potential,

so sum_k gamma^k F_k = gamma^{K_i} Phi_{K_i} - Phi_0 (telescoping). Progress-based
methods (VTCA, ProCredit in ``turn_credit``) use the same layout: ``progress`` [N, K] = p_k
before action k and ``final_progress`` [N] = p_{K_i}.

Every signal read from the batch is wrapped in ``jax.lax.stop_gradient``. Outputs are 0
outside ``action_mask`` / valid turns. Group and cohort statistics are local (groups are whole
per shard); batch-wide statistics psum over ``axis_name``.
Where a method needs an LLM judge, a solver or a reward model at run time, the function
consumes its outputs (labels, scores, log-probs) as arrays.

Sources: each docstring names its paper. Where a method is pinned to the authors' public
code, the repository and file are named. Where the paper describes a step only in words, the
docstring says that the formula is our reading of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.estimators.primitives import (normalize_turns, potential_terms,
                                               token_trajectories, valid_tokens)
from jaxrl_agent.checks import (check_choice, check_nonneg, check_positive, check_unit,
                                require, token_field, traj_field, turn_field)
from jaxrl_agent.registry import register

F32 = jnp.float32


def _sg(x):
    return lax.stop_gradient(x)


def _valid(b):
    return segments.valid_turns(b)


def _num_turns(b):
    return jnp.sum(_valid(b), axis=1).astype(F32)


def _last_turn(b):
    v = _valid(b)
    return v & ~segments.next_turn(v, False)


# ----------------------------------------------------------------------------- primitives


def potential_rewards(batch: TrajectoryBatch, *, potential: str = "potential",
                      final_potential: str = "final_potential", gamma: float = 1.0,
                      require_final: bool = False, axis_name=None):
    """The PBRS term F [N, K]: F_k = gamma Phi(s_{k+1}) - Phi(s_k) (Ng et al. 1999).

    Phi from ``extras[potential]`` [N, K] (before action k) and ``extras[final_potential]``
    [N] (after the last turn; absent -> 0 unless ``require_final``). Stop-gradient, 0 off the
    valid turns. The other potential-based methods here reuse it.
    """
    check_unit("gamma", gamma)
    b = segments.local_view(batch, axis_name)
    return potential_terms(b, potential, final_potential, gamma, require_final, "pbrs")


def _turn_advantages(a, b) -> Advantages:
    a = jnp.where(_valid(b), a, 0.0).astype(F32)
    return Advantages(token=segments.turn_to_token(a, b), turn=a)


def _clean(batch, b):
    """The batch with its padded rewards and outcomes zeroed (a shaping's output is 0 off the
    masks even where the input padding held NaN); indices stay global."""
    out = batch.replace(turn_rewards=b.turn_rewards, outcome=b.outcome)
    if "token_rewards" in b.extras:
        out = out.replace(extras=dict(batch.extras, token_rewards=b.extras["token_rewards"]))
    return out


def _set_turn_rewards(batch, b, r, replace):
    valid = _valid(b)
    new = r if replace else b.turn_rewards + r
    return _clean(batch, b).replace(turn_rewards=jnp.where(valid, new, 0.0).astype(F32))


def _add_token_rewards(batch, b, r):
    old = b.extras.get("token_rewards")
    new = r if old is None else old + r
    out = _clean(batch, b)
    return out.replace(extras=dict(out.extras, token_rewards=jnp.where(b.action_mask, new, 0.0)
                                   .astype(F32)))


# ----------------------------------------------------------------------------- PBRS (generic)


@register("pbrs", kind="shaping")
def potential_based_shaping(batch: TrajectoryBatch, *, potential: str = "potential",
                            final_potential: str = "final_potential", gamma: float = 1.0,
                            scale: float = 1.0, to_outcome: bool = False,
                            axis_name=None) -> TrajectoryBatch:
    """Potential-based reward shaping (Ng, Harada & Russell 1999): r'_k = r_k + scale F_k.

    F_k = gamma Phi_{k+1} - Phi_k (``potential_rewards``). With ``to_outcome=True`` the
    discounted sum of the shaping, sum_k gamma^k scale F_k = scale (gamma^{K_i} Phi_{K_i} -
    Phi_0), is also added to ``outcome`` (for trajectory-level estimators such as GRPO: with
    Phi(terminal) = 0 and gamma = 1 each return moves by -scale Phi_0 only, so GRPO
    advantages within a group that shares s_0 are unchanged). Multi-agent potentials (as in
    multi-agent LLM RL): give each agent's turns its own Phi_i in the same [N, K] field.

    Args:
      batch: reads ``turn_rewards`` [N, K], ``outcome`` [N], ``extras[potential]`` [N, K] and
        ``extras[final_potential]`` [N] (absent -> 0).
      potential: extras name of Phi(s_k) before action k, [N, K].
      final_potential: extras name of Phi after the last turn, [N].
      gamma: discount in [0, 1].
      scale: weight of the shaping term (any real).
      to_outcome: also add the discounted sum of the term to ``outcome``.
      axis_name: mesh axis of a sharded batch (no cross-shard statistic is used).

    Returns:
      The batch with ``turn_rewards`` [N, K] = r + scale F (and ``outcome`` [N] moved with
      ``to_outcome``); 0 off the valid turns.
    """
    check_unit("gamma", gamma)
    b = segments.local_view(batch, axis_name)
    f = scale * potential_terms(b, potential, final_potential, gamma, False, "pbrs")
    out = _set_turn_rewards(batch, b, f, replace=False)
    if to_outcome:
        disc = jnp.power(jnp.float32(gamma), jnp.arange(b.num_turns, dtype=F32))
        total = jnp.sum(f * disc[None, :], axis=1)
        out = out.replace(outcome=jnp.where(b.traj_mask, b.outcome + total, 0.0).astype(F32))
    return out


# ----------------------------------------------------------------------------- verifier density


@register("uniform", kind="shaping")
def uniform_reward_redistribution(batch: TrajectoryBatch, *, score: str = "outcome",
                                  replace: bool = True, axis_name=None) -> TrajectoryBatch:
    """Uniform redistribution of a trajectory score over its turns (the uniform arm of the
    verifier-information-density paper).

    This is our reading of the paper, which describes the step in words:
    r[i, k] = S_i / K_i on every valid turn, from the continuous trajectory score S. The turn
    rewards sum to S_i (mass conservation). Follow it with a turn-return reader (``returns``,
    ``step_group``, ``turn_gae``) for the dense arm; trajectory-level GRPO on the outcome is
    unchanged by it.

    Args:
      batch: reads ``extras[score]`` [N] (or ``outcome`` [N]) and ``turn_rewards`` [N, K].
      score: name of the trajectory score S [N]; ``"outcome"`` (default) reads the outcome.
      replace: True writes r as the turn rewards; False adds it to the existing ones.
      axis_name: mesh axis of a sharded batch (no cross-shard statistic is used).

    Returns:
      The batch with ``turn_rewards`` [N, K] shaped; 0 off the valid turns.
    """
    b = segments.local_view(batch, axis_name)
    s = traj_field(b, score, "uniform", "continuous trajectory score S_i, [N]", stop_gradient=True)
    r = jnp.where(_valid(b), (s / jnp.maximum(_num_turns(b), 1.0))[:, None], 0.0)
    return _set_turn_rewards(batch, b, r, replace)


@register("reward_to_go", renamed={"scale_std": "normalize"})
def reward_to_go(batch: TrajectoryBatch, *, score: str = "outcome", baseline: str = "cohort",
                 normalize: bool = False, eps: float = 1e-6, axis_name=None) -> Advantages:
    """The reward-to-go arm of the verifier-information-density paper.

    This is our reading of the paper, which describes the step in words:
    G[i, k] = sum_{j >= k} S_i / K_i = S_i (K_i - k) / K_i (uniform redistribution of the
    score S). Advantage:
      ``baseline="cohort"``: A = G - mean of G over the (task group, turn index k) cohort
        (divided by its unbiased std + eps with ``normalize``; a singleton cohort gives 0);
      ``baseline="group"``: A = (S_i - b_g) (K_i - k) / K_i with b_g = mean_g S (the group
        baseline scaled by the remaining fraction; ``normalize`` divides S_i - b_g by the
        group std + eps; a singleton group gives 0).
    Non-increasing in k for S >= 0 (before the baseline).

    Args:
      batch: reads ``extras[score]`` [N] (or ``outcome`` [N]), ``group_ids`` [N],
        ``turn_mask`` [N, K].
      score: name of the trajectory score S [N]; ``"outcome"`` (default) reads the outcome.
      baseline: ``"cohort"`` or ``"group"`` (above).
      normalize: divide by the peer std + eps (False: centre only).
      eps: > 0, added to the std.
      axis_name: mesh axis of a sharded batch (groups are whole per shard).

    Returns:
      ``Advantages`` with ``turn`` [N, K] = A and ``token`` [R, T] (A of each token's turn);
      0 off the valid turns / action tokens.
    """
    check_choice("baseline", baseline, ("cohort", "group"))
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    s = traj_field(b, score, "reward_to_go", "continuous trajectory score S_i, [N]",
                   stop_gradient=True)
    kk = _num_turns(b)[:, None]
    frac = jnp.where(_valid(b), (kk - jnp.arange(b.num_turns)[None, :]) / jnp.maximum(kk, 1.0),
                     0.0)
    if baseline == "cohort":
        a = normalize_turns(s[:, None] * frac, b, by="cohort", scale_std=normalize, eps=eps)
    else:
        mean, std, count = segments.group_stats(s, b.group_ids, b.traj_mask)
        d = s - mean
        if normalize:
            d = d / (std + eps)
        a = jnp.where(count > 1, d, 0.0)[:, None] * frac
    return _turn_advantages(a, b)


def verifier_density(exposed, valid=None):
    """V_d = (# steps of the C-step causal chain whose correctness the verifier exposes) / C.

    A diagnostic, not an estimator: ``exposed`` [..., C] bool/0-1 per chain step;
    ``valid`` [..., C] marks the chain's real steps (default all). Returns [...]; 0 for an
    empty chain.
    """
    exposed = jnp.asarray(exposed, F32)
    valid = jnp.ones_like(exposed) if valid is None else jnp.asarray(valid, F32)
    c = jnp.sum(valid, axis=-1)
    return jnp.sum(exposed * valid, axis=-1) / jnp.maximum(c, 1.0)


# ----------------------------------------------------------------------------- PiCA


def _pica_stats(x, gid, valid, n):
    """PiCA's pooled statistics: mean, population std sqrt(E[(x-mean)^2] + 1e-8), and std 1
    for a pool of at most one entry."""
    mean, std0, count = segments.segment_stats(x, gid, valid, n, ddof=0)
    std = jnp.sqrt(std0 * std0 + 1e-8)
    std = jnp.where(count <= 1, 1.0, std)
    return mean, std


@register("pica",
          renamed={"normalize": "normalization", "norm": "normalization",
                    "scale_std": "std_normalize"})
def pivot_info_gain_advantage(batch: TrajectoryBatch, *, potential: str | None = "potential",
                              gamma: float = 1.0, normalization: str = "separate",
                              std_normalize: bool = True, f1_weight: float = 1.0,
                              ig_weight: float = 1.0, eps: float = 1e-6,
                              axis_name=None) -> Advantages:
    """PiCA: pivot-based credit assignment with PBRS. Pinned to the public code novdream/PiCA
    ``Search-R1/verl/trainer/ppo/core_algos.py`` (``compute_grpo_outcome_advantage``).

    Rewards: the info gain IG_k = Phi_{k+1} - Phi_k of every intermediate turn
    k < K_i - 1 (Phi = a step reward model's success probability) and the outcome F1 =
    ``outcome`` on the last turn; the curriculum weights ``f1_weight`` / ``ig_weight`` scale
    the two normalised parts.
    Normalisation within the task group: ``normalization="separate"`` z-scores F1 over the
    group's trajectories and IG pooled over all the group's intermediate turns; ``"joint"``
    pools both. mean, population std sqrt(E[(x - mean)^2] + 1e-8), a pool of one entry gets
    std 1; x~ = (x - mean) / (std + eps) (``std_normalize=False``: x - mean; ``eps`` is ours,
    on top of the source's 1e-8 inside the sqrt).
    Backward accumulation over the intermediate turns: A_turn_k = IG~_k + gamma A_turn_{k+1};
    A[i, k] = A_turn_k + F1~_i for intermediate turns and F1~_i for the last turn.
    Deviation, stated: the code finds turns as non-zero reward positions (an IG of exactly 0
    merges its turn into the next); here turns come from the batch, so every intermediate
    turn is in the IG pool.

    Args:
      batch: reads ``extras[potential]`` [N, K] (or ``turn_rewards`` [N, K] with
        ``potential=None``), ``outcome`` [N], ``group_ids`` [N].
      potential: extras name of Phi before action k, [N, K]; None reads IG_k directly from
        ``turn_rewards``.
      gamma: discount of the backward accumulation, in [0, 1].
      normalization: ``"separate"`` or ``"joint"`` pools (above).
      std_normalize: divide by the pool std + eps (False: centre only).
      f1_weight: weight of the normalised outcome part.
      ig_weight: weight of the normalised info-gain part.
      eps: > 0, added to the std.
      axis_name: mesh axis of a sharded batch (groups are whole per shard).

    Returns:
      ``Advantages`` with ``turn`` [N, K] = A and ``token`` [R, T]; 0 off the valid turns.
    """
    check_unit("gamma", gamma)
    check_choice("normalization", normalization, ("separate", "joint"))
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    n, k = b.turn_mask.shape
    valid = _valid(b)
    inter = valid & segments.next_turn(valid, False)
    if potential is None:
        ig = jnp.where(inter, _sg(b.turn_rewards.astype(F32)), 0.0)
    else:
        phi = turn_field(b, potential, "pica", "success-probability potential Phi, [N, K]",
                         stop_gradient=True)
        ig = jnp.where(inter, segments.next_turn(phi) - phi, 0.0)
    f1 = _sg(jnp.where(b.traj_mask, b.outcome.astype(F32), 0.0))
    g = jnp.clip(b.group_ids, 0, n - 1)
    g_turn = jnp.broadcast_to(g[:, None], (n, k)).reshape(-1)
    if normalization == "separate":
        m_f, s_f = _pica_stats(f1, g, b.traj_mask, n)
        m_i, s_i = _pica_stats(ig.reshape(-1), g_turn, inter.reshape(-1), n)
    else:
        m_f, s_f = _pica_stats(jnp.concatenate([f1, ig.reshape(-1)]),
                               jnp.concatenate([g, g_turn]),
                               jnp.concatenate([b.traj_mask, inter.reshape(-1)]), n)
        m_i, s_i = m_f, s_f

    def z(x, mean, std):
        d = x - mean
        return d / (std + eps) if std_normalize else d

    # curriculum weights on the normalised parts (before it, the z-score would cancel them)
    f1n = jnp.where(b.traj_mask, f1_weight * z(f1, m_f[g], s_f[g]), 0.0)
    ign = jnp.where(inter, ig_weight * z(ig, m_i[g][:, None], s_i[g][:, None]), 0.0)
    acc = segments.reverse_scan(ign, gamma, axis=1, where=inter)
    a = jnp.where(inter, acc, 0.0) + f1n[:, None]
    return _turn_advantages(a, b)


# ----------------------------------------------------------------------------- SPA


@register("spa", kind="shaping")
def progress_attribution_rewards(batch: TrajectoryBatch, *, contribution: str = "contribution",
                                 grounded: str = "grounded", bonus: float = 0.5,
                                 replace: bool = True, axis_name=None) -> TrajectoryBatch:
    """SPA: Stepwise Progress Attribution. Pinned to the public code
    WangHanLinHenry/SPA-RL-Agent ``prm/rl_data_org.py``.

    r_k = c_k + bonus 1[action k grounded/valid] and the final turn gets another + bonus,
    with c the trained progress estimator's per-turn contributions
    (``spa_decomposition_loss`` trains it). Follow with a turn-level estimator
    (``turn_gae``).

    Args:
      batch: reads ``extras[contribution]`` [N, K], ``extras[grounded]`` [N, K] and
        ``turn_rewards`` [N, K].
      contribution: extras name of the per-turn progress contributions c, [N, K].
      grounded: extras name of the grounded/valid indicator (> 0.5 = grounded), [N, K].
      bonus: bonus for a grounded action and for the final turn.
      replace: True writes r as the turn rewards; False adds it to the existing ones.
      axis_name: mesh axis of a sharded batch (no cross-shard statistic is used).

    Returns:
      The batch with ``turn_rewards`` [N, K] shaped; 0 off the valid turns.
    """
    b = segments.local_view(batch, axis_name)
    c = turn_field(b, contribution, "spa", "per-turn progress contributions, [N, K]",
                   stop_gradient=True)
    gr = turn_field(b, grounded, "spa", "1 where the action is grounded/valid, [N, K]",
                    stop_gradient=True) > 0.5
    r = c + bonus * gr.astype(F32) + bonus * _last_turn(b).astype(F32)
    return _set_turn_rewards(batch, b, r, replace)


def spa_decomposition_loss(contributions, batch: TrajectoryBatch, *, axis_name=None):
    """SPA's progress-estimator loss: mean over real trajectories of (sum_k c_k - R_i)^2.

    ``contributions`` [N, K] are the estimator's (differentiable) outputs; the outcome is a
    stop-gradient target. Returns a scalar (psum over ``axis_name``)."""
    b = segments.local_view(batch, axis_name)
    s = jnp.sum(jnp.where(_valid(b), contributions, 0.0), axis=1)
    err = jnp.where(b.traj_mask, s - _sg(b.outcome), 0.0)
    n = segments.psum(jnp.sum(b.traj_mask.astype(F32)), axis_name)
    return segments.psum(jnp.sum(err * err), axis_name) / jnp.maximum(n, 1.0)


# ----------------------------------------------------------------------------- ReBel


SCHEDULES = ("linear", "cosine", "exp", "constant")


def decay_weight(step, *, total_steps: int, schedule: str = "linear", start: float = 1.0,
                 end: float = 0.0, warmup: int = 0):
    """A weight that decays from ``start`` to ``end`` over training steps.

    p = clip((step - warmup) / (total_steps - warmup), 0, 1); ``"linear"``: start +
    (end - start) p; ``"cosine"``: end + (start - end) (1 + cos(pi p)) / 2; ``"exp"``:
    start (end / start)^p (start, end > 0); ``"constant"``: start. Monotone between start
    and end, ``start`` during warm-up. ``step`` may be traced (a jnp scalar). Used for
    ReBel's component weights and the decaying process-reward weight.
    """
    check_choice("schedule", schedule, SCHEDULES)
    if total_steps <= warmup:
        raise ValueError(f"total_steps ({total_steps}) must exceed warmup ({warmup})")
    if schedule == "exp" and not (start > 0 and end > 0):
        raise ValueError(f"the exp schedule needs start > 0 and end > 0, got {start}, {end}")
    p = jnp.clip((jnp.asarray(step, F32) - warmup) / (total_steps - warmup), 0.0, 1.0)
    if schedule == "linear":
        return start + (end - start) * p
    if schedule == "cosine":
        return end + (start - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
    if schedule == "exp":
        return start * jnp.power(end / start, p)
    return jnp.full_like(p, start)


def rebel_component_weights(step, *, total_steps: int, schedule: str = "linear",
                            min_weight: float = 0.1, warmup: int = 0,
                            consistency_exp: float = 1.0, progress_exp: float = 1.0):
    """ReBel's decaying component weights (cw_state, cw_task, cw_pred, cw_format).

    d = ``decay_weight(step, schedule, start=1, end=min_weight)``; consistency terms (state
    and prediction) get d^consistency_exp, task progress d^progress_exp, format d (the
    decay exponents are our reading of the paper). Non-increasing in step after warm-up.
    """
    d = decay_weight(step, total_steps=total_steps, schedule=schedule, start=1.0,
                     end=min_weight, warmup=warmup)
    c = jnp.power(d, consistency_exp)
    return c, jnp.power(d, progress_exp), c, d


def rebel_reward(r_state, r_task, r_pred, r_format, weights=(1.0, 1.0, 1.0, 1.0),
                 coefs=(0.3, 0.4, 0.3, 0.1)):
    """r_int = alpha r_state cw_s + beta r_task cw_t + gamma r_pred cw_p + delta r_format cw_f
    (ReBel ``belief_tracker.py``; coefs (alpha, beta, gamma, delta) = (0.3, 0.4, 0.3, 0.1));
    bounded by sum(coefs) for components in [0, 1] and weights in [0, 1]."""
    parts = (r_state, r_task, r_pred, r_format)
    return sum(c * w * jnp.asarray(x, F32) for c, w, x in zip(coefs, weights, parts))


@register("rebel", kind="shaping")
def belief_consistency_rewards(batch: TrajectoryBatch, *, state: str = "belief_state",
                               task: str = "belief_task", pred: str = "belief_pred",
                               format: str = "belief_format", w_state: float = 0.3,
                               w_task: float = 0.4, w_pred: float = 0.3, w_format: float = 0.1,
                               cw_state: float = 1.0, cw_task: float = 1.0,
                               cw_pred: float = 1.0, cw_format: float = 1.0,
                               replace: bool = False, axis_name=None) -> TrajectoryBatch:
    """ReBel belief-consistency reward. Pinned to the public code Fateyetian/Rebel
    ``belief_tracker.py``.

    r_int[i, k] = w_state r_state cw_state + w_task r_task cw_task + w_pred r_pred cw_pred +
    w_format r_format cw_format from four per-turn component scores [N, K] in [0, 1] (state
    consistency of the parsed belief against a ground-truth tracker, task-progress
    consistency, next-observation prediction consistency, format; computed by the caller),
    added to the turn rewards. The decaying weights cw_* come from
    ``rebel_component_weights(step, ...)``; they are static here (one compile per value):
    inside a jitted train step call ``rebel_reward`` with traced weights instead.

    Args:
      batch: reads ``extras[state]``, ``extras[task]``, ``extras[pred]``, ``extras[format]``
        [N, K] (component scores in [0, 1]) and ``turn_rewards`` [N, K].
      state, task, pred, format: extras names of the four component scores, [N, K].
      w_state, w_task, w_pred, w_format: fixed coefficients of the components.
      cw_state, cw_task, cw_pred, cw_format: decaying component weights, in [0, 1].
      replace: True writes r_int as the turn rewards; False (default) adds it.
      axis_name: mesh axis of a sharded batch (no cross-shard statistic is used).

    Returns:
      The batch with ``turn_rewards`` [N, K] shaped; 0 off the valid turns.
    """
    b = segments.local_view(batch, axis_name)
    what = "component score in [0, 1] per turn, [N, K]"
    state, task, pred, format = (turn_field(b, f, "rebel", what, stop_gradient=True)
                                 for f in (state, task, pred, format))
    r = rebel_reward(state, task, pred, format,
                     (cw_state, cw_task, cw_pred, cw_format),
                     (w_state, w_task, w_pred, w_format))
    return _set_turn_rewards(batch, b, r, replace)


# ----------------------------------------------------------------------------- RED


def prefix_score_rewards(batch: TrajectoryBatch, *, scores: str = "prefix_scores",
                         initial_score: str = "initial_score", axis_name=None):
    """RED's token rewards [R, T]: r_t = RM(x, y_{<=t}) - RM(x, y_{<t}).

    ``extras[scores]`` [R, T]: the reward model's score of the prefix ending at each action
    token; the previous prefix of a turn's first token is the last token of the previous
    turn (any layout), and before the first action token ``extras[initial_score]`` [N]
    (RM(x, empty); absent -> 0). sum_t r_t = RM(x, y) - RM(x, empty) (telescoping).
    """
    b = segments.local_view(batch, axis_name)
    s = token_field(b, scores, "red", "reward-model score of each action-token prefix, [R, T]",
                    stop_gradient=True)
    init = traj_field(b, initial_score, "red", "RM(x, empty), [N]", default=0.0, stop_gradient=True)
    first, last = segments.turn_boundary_masks(b)
    last_s = segments.token_to_turn(jnp.where(last, s, 0.0), b)
    prev_turn = jnp.concatenate([init[:, None], last_s[:, :-1]], axis=1)
    shifted = jnp.concatenate([jnp.zeros_like(s[:, :1]), s[:, :-1]], axis=1)
    prev = jnp.where(first, segments.turn_to_token(prev_turn, b), shifted)
    return jnp.where(b.action_mask, s - prev, 0.0)


@register("red", kind="shaping")
def token_reward_redistribution(batch: TrajectoryBatch, *, scores: str = "prefix_scores",
                                initial_score: str = "initial_score", scale: float = 1.0,
                                axis_name=None) -> TrajectoryBatch:
    """RED: token reward redistribution, as the paper describes it.

    Adds scale ``prefix_score_rewards`` to ``extras['token_rewards']`` (token-level PBRS with
    Phi = the off-the-shelf reward model's prefix score; read by ``reinforce_pp``, ``gae``
    via ``segments.token_rewards``). Also covers Grad2Reward-style token rewards when the
    caller supplies the scores.

    Args:
      batch: reads ``extras[scores]`` [R, T], ``extras[initial_score]`` [N] (absent -> 0)
        and ``extras['token_rewards']`` [R, T] where present.
      scores: extras name of the reward model's score of each action-token prefix, [R, T].
      initial_score: extras name of RM(x, empty), [N].
      scale: weight of the token rewards.
      axis_name: mesh axis of a sharded batch (no cross-shard statistic is used).

    Returns:
      The batch with ``extras['token_rewards']`` [R, T] added to; 0 off the action tokens.
    """
    b = segments.local_view(batch, axis_name)
    r = prefix_score_rewards(b, scores=scores, initial_score=initial_score)
    return _add_token_rewards(batch, b, scale * r)


# ------------------------------------------------------------------ verifier and judge rewards


@register("vpr", kind="shaping")
def verified_process_rewards(batch: TrajectoryBatch, *, label: str = "verified",
                             scale: float = 1.0, to: str = "outcome", replace: bool = False,
                             axis_name=None) -> TrajectoryBatch:
    """Verifier/judge-derived per-turn process rewards (VPR and kin), as the papers describe
    them.

    x = ``extras[label]`` (VPR: 1[oracle verifies action k]); ``to="outcome"``:
    R_total = R + scale sum_k x_k; ``"turns"``: r_k += scale x_k (``replace=True``: r_k =
    scale x_k); ``"both"``: both. Settings for related methods: DiscoPO label = new verified
    evidence-graph nodes per turn (normalised by the caller); ABC-GRPO label = clue-anchored
    step score, to="turns", replace=True, then ``step_group(key="turn", target="reward")``;
    MAPPA label = per-action judge reward, to="turns", then ``step_group(key="turn_key")``
    with the agent id as turn_key; CALM label = 1[judge: subgoal achieved at option end],
    to="turns"; CoACT label = 1[same next action] + lambda length reduction; decaying PRM
    reward label = PRM score, scale = ``decay_weight(step, ...)``.

    Args:
      batch: reads ``extras[label]`` [N, K], ``turn_rewards`` [N, K], ``outcome`` [N].
      label: extras name of the per-turn verification label or score, [N, K].
      scale: weight of the label.
      to: ``"outcome"``, ``"turns"`` or ``"both"`` (above).
      replace: with ``to`` in (``"turns"``, ``"both"``), write scale x as the turn rewards
        instead of adding it.
      axis_name: mesh axis of a sharded batch (no cross-shard statistic is used).

    Returns:
      The batch with ``turn_rewards`` [N, K] and/or ``outcome`` [N] shaped; 0 off the valid
      turns / trajectories.
    """
    check_choice("to", to, ("outcome", "turns", "both"))
    b = segments.local_view(batch, axis_name)
    x = scale * turn_field(b, label, "vpr", "per-turn verification label/score, [N, K]",
                           stop_gradient=True)
    out = _clean(batch, b)
    if to in ("turns", "both"):
        out = _set_turn_rewards(out, b, x, replace)
    if to in ("outcome", "both"):
        out = out.replace(outcome=jnp.where(b.traj_mask, b.outcome + jnp.sum(x, axis=1),
                                            0.0).astype(F32))
    return out


@register("nasa", kind="shaping")
def evidence_necessity_rewards(batch: TrajectoryBatch, *, evidence: str = "evidence",
                               necessity: str = "necessity", threshold: float = 0.5,
                               scale: float = 1.0, replace: bool = False,
                               axis_name=None) -> TrajectoryBatch:
    """NASA-GRPO tool-level reward (AdaVDR).

    This is our reading of the paper, which describes the step in words:
    u_k = evidence_contribution_k * necessity_k (both clipped at >= 0), normalised within the
    trajectory to sum 1 (uniform 1/K_i when all are 0), times the outcome sign s_i = +1 if
    R_i > ``threshold``, -1 if below, 0 at it: r_k += scale s_i u_k / sum u.

    Args:
      batch: reads ``extras[evidence]`` and ``extras[necessity]`` [N, K], ``outcome`` [N],
        ``turn_rewards`` [N, K].
      evidence: extras name of each tool call's evidence contribution (>= 0), [N, K].
      necessity: extras name of each tool call's necessity (>= 0), [N, K].
      threshold: outcome above it counts as success, below it as failure.
      scale: weight of the term.
      replace: True writes the term as the turn rewards; False (default) adds it.
      axis_name: mesh axis of a sharded batch (no cross-shard statistic is used).

    Returns:
      The batch with ``turn_rewards`` [N, K] shaped; 0 off the valid turns.
    """
    b = segments.local_view(batch, axis_name)
    valid = _valid(b)
    u = jnp.maximum(turn_field(b, evidence, "nasa", "evidence contribution >= 0, [N, K]",
                               stop_gradient=True), 0.0)
    u = u * jnp.maximum(turn_field(b, necessity, "nasa", "tool necessity >= 0, [N, K]",
                                   stop_gradient=True), 0.0)
    tot = jnp.sum(u, axis=1, keepdims=True)
    share = jnp.where(tot > 0, u / jnp.where(tot > 0, tot, 1.0),
                      1.0 / jnp.maximum(_num_turns(b), 1.0)[:, None])
    r = _sg(b.outcome)
    sign = jnp.where(r > threshold, 1.0, jnp.where(r < threshold, -1.0, 0.0))
    return _set_turn_rewards(batch, b, jnp.where(valid, scale * sign[:, None] * share, 0.0),
                             replace)


def action_ordinals(batch: TrajectoryBatch, *, axis_name=None):
    """[R, T] int32: the position of each action token in its trajectory's stream of action
    tokens (0, 1, ... turn by turn, any layout); -1 off the action tokens."""
    b = segments.local_view(batch, axis_name)
    m = b.action_mask
    cs = jnp.cumsum(m.astype(jnp.int32), axis=1) - 1
    first, _ = segments.turn_boundary_masks(b)
    f = segments.token_to_turn(jnp.where(first, cs, 0).astype(F32), b)
    counts = segments.turn_token_counts(b)
    offset = jnp.cumsum(counts, axis=1) - counts
    pos = segments.turn_to_token(offset - f, b) + cs
    return jnp.where(m, pos.astype(jnp.int32), -1)


@register("v_rubrics", kind="shaping")
def rubric_span_rewards(batch: TrajectoryBatch, *, scores: str = "rubric_scores",
                        starts: str = "rubric_start", ends: str = "rubric_end",
                        mode: str = "span", scale: float = 1.0,
                        axis_name=None) -> TrajectoryBatch:
    """V-Rubrics prefix-localised rubric credit, as token rewards.

    This is our reading of the paper, which describes the step in words:
    rubric item j of trajectory i has score s_ij and an evidence span of action-token
    positions (``action_ordinals``) [start_ij, end_ij] (end < 0: unlocalised).
    ``mode="span"`` credits the span, ``"prefix"`` the prefix [0, end]; an unlocalised item,
    or a span with no token of the trajectory, goes to all its tokens. Each item's score is
    split evenly over its tokens, so the token rewards of a trajectory sum to
    scale sum_j s_j. Added to ``extras['token_rewards']``.

    Args:
      batch: reads ``extras[scores]``, ``extras[starts]``, ``extras[ends]`` [N, J] (J rubric
        items) and ``extras['token_rewards']`` [R, T] where present.
      scores: extras name of the item scores, [N, J].
      starts: extras name of each item's first evidence token (action ordinal), [N, J].
      ends: extras name of each item's last evidence token (< 0: unlocalised), [N, J].
      mode: ``"span"`` or ``"prefix"`` (above).
      scale: weight of the token rewards.
      axis_name: mesh axis of a sharded batch (no cross-shard statistic is used).

    Returns:
      The batch with ``extras['token_rewards']`` [R, T] added to; 0 off the action tokens.
    """
    check_choice("mode", mode, ("span", "prefix"))
    b = segments.local_view(batch, axis_name)
    what = "per rubric item, [N, J] (traj_extras vectors)"
    s = _sg(require(b, scores, "v_rubrics", f"item scores {what}").astype(F32))
    lo = _sg(require(b, starts, "v_rubrics", f"first evidence token {what}"))
    hi = _sg(require(b, ends, "v_rubrics", f"last evidence token {what}"))
    for name, x in ((scores, s), (starts, lo), (ends, hi)):
        if x.ndim != 2 or x.shape[0] != b.num_traj:
            raise ValueError(f"v_rubrics: extras['{name}'] must be [N, J], got {x.shape}")
    lo = jnp.round(lo).astype(jnp.int32)
    hi = jnp.round(hi).astype(jnp.int32)
    if mode == "prefix":
        lo = jnp.zeros_like(hi)
    lo = jnp.maximum(lo, 0)
    pos = action_ordinals(b)[..., None]  # [R, T, 1]
    rt = jnp.clip(b.row_traj, 0, b.num_traj - 1)
    m = b.action_mask[..., None]
    inside = m & (hi[rt][:, None, :] >= 0) & (pos >= lo[rt][:, None, :]) & \
        (pos <= hi[rt][:, None, :])
    size = jax.ops.segment_sum(jnp.sum(inside, axis=1).astype(F32), rt, b.num_traj)  # [N, J]
    everywhere = (size == 0)[rt][:, None, :]
    inside = jnp.where(everywhere, m, inside)
    n_tok = segments.traj_token_counts(b)[:, None]
    size = jnp.where(size == 0, n_tok, size)
    per_tok = jnp.where(b.traj_mask[:, None] & (size > 0), s / jnp.maximum(size, 1.0), 0.0)
    r = jnp.sum(jnp.where(inside, per_tok[rt][:, None, :], 0.0), axis=2)
    return _add_token_rewards(batch, b, scale * r)


# ----------------------------------------------------------------------------- ADRS (shaping)


def _masked_std(x, mask, axis_name, ddof):
    """(std of x over ``mask`` across ``axis_name``, total count)."""
    _, var = segments.masked_mean_var(x, mask, axis_name, ddof)
    count = segments.psum(jnp.sum(mask.astype(jnp.float32)), axis_name)
    return segments.safe_sqrt(var), count


def _tva(alpha, reward, ids, valid, num):
    """Teacher value advantage per segment: E_alpha[R] - E_{1-alpha}[R] (0 below 2 members)."""
    def seg_sum(v):
        return jax.ops.segment_sum(jnp.where(valid, v, 0.0), ids, num)

    out = (seg_sum(alpha * reward) / (seg_sum(alpha) + 1e-8)
           - seg_sum((1.0 - alpha) * reward) / (seg_sum(1.0 - alpha) + 1e-8))
    out = jnp.where(seg_sum(jnp.ones_like(alpha)) >= 2, out, 0.0)
    return jnp.where(valid, out[jnp.clip(ids, 0, num - 1)], 0.0)


@register("adrs", kind="shaping",
          renamed={"normalize": "normalization", "gate_norm": "gate_normalize"})
def gated_teacher_reward(batch: TrajectoryBatch, *, teacher: str = "teacher_logprobs",
                         tva: str = "step", eta: float = 0.1, temperature: float = 1.0,
                         tau: float = 2.0, baseline: str = "step", normalization: str = "global",
                         gate_normalize: bool = False, gamma: float = 1.0,
                         ref: str = "ref_logprobs", target: str = "token",
                         update_outcome: bool = True, gate_field: str | None = None,
                         axis_name=None) -> TrajectoryBatch:
    """ADRS: self-distilled token reward shaping with a teacher-value-advantage gate. Pinned:
    gitrxh/ADRS-arxiv ``verl/trainer/ppo/adrs_utils.py`` (``compute_adrs_reward``).

    A *shaping*: the token reward r_t += eta g_t u_t is added before the advantage
    computation, as in the repository (``token_level_rewards += modulated_reward``).

        u_t = lp_T,t - mean_{t' in step(t)} lp_T   (``baseline="global"``: the batch mean),
              divided by the batch std of u (unbiased, + 1e-8; ``normalization="per_seq"``: the
              per-trajectory population std + 1e-8; ``"none"``)
        gate g (``tva``):
          "step": alpha_s = sigmoid((mean_{t in s} lp_T - batch mean lp_T) / T) per turn;
                 TVA = sum alpha R / sum alpha - sum (1-alpha) R / sum (1-alpha) over the
                 GiGPO anchor group of the turn (task group + equal ``state_keys``; < 2 turns:
                 0); R = the turn's discounted return-to-go of ``turn_rewards`` (``gamma``)
          "completion": the same per task group with the trajectory mean lp_T and the
                 trajectory's total reward (turn rewards + ``extras['token_rewards']``)
          "pas": sigmoid(tau (lp_T - lp_ref) / std) per token (std over the batch)
          "none": no gate, r_t += eta u_t (the gate reported is 0.5)
        g = sigmoid(tau TVA'), TVA' = TVA or, with ``gate_normalize``, TVA / std(TVA) when the
        std exceeds 1e-8 (sign kept).

    Output: ``target="token"`` adds r to ``extras['token_rewards']`` (read by token-reward
    estimators: reinforce_pp, gae, ...); ``target="turn"`` adds its per-turn sums to
    ``turn_rewards`` (gigpo, turn_gae, ...). ``update_outcome`` adds the per-trajectory sum of r
    to ``outcome`` (what verl's GRPO sums; outcome readers such as grpo). ``gate_field`` also
    stores g [R, T] in that extra (e.g. to gate a distillation loss). Batch-wide means and stds
    are psummed over ``axis_name``. eta = 0 leaves every field bit for bit.

    Args:
      batch: the batch; reads the teacher log-probs [R, T], ``turn_rewards`` [N, K],
        ``state_keys`` [N, K] and ``group_ids`` [N] (``tva="step"``), ``turn_rewards`` and
        ``extras['token_rewards']`` [R, T] if present (``"completion"``), the reference
        log-probs [R, T] (``"pas"``).
      teacher: the teacher log-probs: the name of an [R, T] extra, or ``"old_logprobs"``.
      tva: the gate: ``"step"``, ``"completion"``, ``"pas"`` or ``"none"``.
      eta: >= 0, the size of the shaped reward.
      temperature: > 0, T of the gate's alpha.
      tau: > 0, the sharpness of the gate's sigmoid.
      baseline: ``"step"`` (the turn's mean teacher log-prob) or ``"global"`` (the batch's).
      normalization: how u is scaled: ``"global"``, ``"per_seq"`` or ``"none"`` (above).
      gate_normalize: divide TVA by its batch std (``"step"`` and ``"completion"`` gates).
      gamma: in [0, 1], the discount of the return-to-go of the ``"step"`` gate.
      ref: the reference log-probs of the ``"pas"`` gate: an [R, T] extra's name, or
        ``"old_logprobs"``.
      target: ``"token"`` or ``"turn"``: where the shaped reward is added.
      update_outcome: also add each trajectory's sum of r to ``outcome``.
      gate_field: if set, the extra that receives the gate g [R, T].
      axis_name: the mesh axis a sharded batch is split over, or None.

    Returns:
      ``batch`` with ``extras['token_rewards']`` [R, T] (``target="token"``) or
      ``turn_rewards`` [N, K] (``"turn"``) shaped, ``outcome`` [N] updated when
      ``update_outcome``, and ``extras[gate_field]`` [R, T] when set.
    """
    check_positive("tau", tau)
    check_choice("tva", tva, ("step", "completion", "pas", "none"))
    check_choice("baseline", baseline, ("step", "global"))
    check_choice("normalization", normalization, ("global", "per_seq", "none"))
    check_choice("target", target, ("token", "turn"))
    check_nonneg("eta", eta)
    check_positive("temperature", temperature)
    check_unit("gamma", gamma)
    b = segments.local_view(batch, axis_name)
    valid = valid_tokens(b)
    lp = token_field(b, teacher, "adrs", "teacher log-probs [R, T]",
                     stop_gradient=True, valid_only=True)
    n, k = b.num_traj, b.num_turns
    vf = valid.astype(jnp.float32)
    seg = token_trajectories(b)

    # raw teacher reward u
    if baseline == "step":
        cnt = segments.token_to_turn(vf, b)
        mean = segments.token_to_turn(lp, b) / jnp.maximum(cnt, 1.0)
        base = segments.turn_to_token(mean, b)
    else:
        tot = segments.psum(jnp.sum(lp), axis_name)
        cnt = segments.psum(jnp.sum(vf), axis_name)
        base = tot / jnp.maximum(cnt, 1.0)
    u = jnp.where(valid, lp - base, 0.0)
    if normalization == "global":
        std, cnt = _masked_std(u, valid, axis_name, ddof=1)
        u = u / jnp.where(cnt > 1, std + 1e-8, 1.0)
    elif normalization == "per_seq":
        c = jax.ops.segment_sum(jnp.sum(vf, axis=1), b.row_traj, n)
        m = jax.ops.segment_sum(jnp.sum(u, axis=1), b.row_traj, n) / jnp.maximum(c, 1.0)
        dev = jnp.where(valid, u - m[seg], 0.0)
        var = jax.ops.segment_sum(jnp.sum(dev * dev, axis=1), b.row_traj, n) / jnp.maximum(c, 1.0)
        u = jnp.where(valid, u / (segments.safe_sqrt(var) + 1e-8)[seg], 0.0)

    def gate_from(tva_vals, where):
        if gate_normalize:
            std, _ = _masked_std(tva_vals, where, axis_name, ddof=1)
            tva_vals = jnp.where(std > 1e-8, tva_vals / (std + 1e-8), tva_vals)
        return jax.nn.sigmoid(tau * tva_vals)

    if tva == "none":
        gate = jnp.where(valid, 0.5, 0.0)
        shaped = eta * u
    else:
        if tva == "pas":
            d = jnp.where(valid, lp - token_field(b, ref, "adrs", "reference log-probs [R, T]",
                                                  stop_gradient=True, valid_only=True),
                          0.0)
            std, cnt = _masked_std(d, valid, axis_name, ddof=1)
            gate = jax.nn.sigmoid(tau * d / jnp.where(cnt > 1, std + 1e-8, 1.0))
        elif tva == "completion":
            ok = b.traj_mask
            c = jax.ops.segment_sum(jnp.sum(vf, axis=1), b.row_traj, n)
            comp = jax.ops.segment_sum(jnp.sum(lp, axis=1), b.row_traj, n) / (c + 1e-8)
            rew = jax.ops.segment_sum(jnp.sum(jnp.where(valid, segments.token_rewards(b), 0.0),
                                              axis=1), b.row_traj, n)
            gm = (segments.psum(jnp.sum(jnp.where(ok, comp, 0.0)), axis_name)
                  / jnp.maximum(segments.psum(jnp.sum(ok.astype(jnp.float32)), axis_name), 1.0))
            al = jax.nn.sigmoid((comp - gm) / (temperature + 1e-8))
            t = _tva(al, rew, jnp.where(ok, b.group_ids, n), ok, n)
            gate = segments.traj_to_token(gate_from(t, ok), b)
        else:
            vt = segments.valid_turns(b)
            cnt_t = segments.token_to_turn(vf, b)
            step_mean = segments.token_to_turn(lp, b) / (cnt_t + 1e-8)
            gm = (segments.psum(jnp.sum(lp), axis_name)
                  / (segments.psum(jnp.sum(vf), axis_name) + 1e-8))
            al = jax.nn.sigmoid((step_mean - gm) / (temperature + 1e-8))
            rtg = segments.reverse_scan(jnp.where(vt, b.turn_rewards, 0.0), gamma, axis=1,
                                        where=vt)
            ids = segments.turn_key_ids(b, b.state_keys)
            t = _tva(al.reshape(-1), rtg.reshape(-1), ids.reshape(-1), vt.reshape(-1), n * k)
            gate = segments.turn_to_token(gate_from(t.reshape(n, k), vt), b)
        gate = jnp.where(valid, gate, 0.0)
        shaped = eta * gate * u
    shaped = jnp.where(valid, shaped, 0.0)
    if eta == 0:
        shaped = jnp.zeros_like(shaped)
    extras = dict(batch.extras)
    out = {}
    if target == "token":
        extras["token_rewards"] = (jnp.where(b.action_mask, b.extras["token_rewards"], 0.0)
                                   + shaped if "token_rewards" in b.extras else shaped)
    else:
        out["turn_rewards"] = b.turn_rewards + segments.token_to_turn(shaped, b)
    if update_outcome:
        out["outcome"] = b.outcome + jax.ops.segment_sum(jnp.sum(shaped, axis=1), b.row_traj, n)
    if gate_field is not None:
        extras[gate_field] = gate
    return batch.replace(extras=extras, **out)


__all__ = sorted({
    "potential_based_shaping", "uniform_reward_redistribution", "progress_attribution_rewards",
    "belief_consistency_rewards", "token_reward_redistribution", "verified_process_rewards",
    "evidence_necessity_rewards", "rubric_span_rewards", "gated_teacher_reward", "reward_to_go",
    "pivot_info_gain_advantage", "potential_rewards", "verifier_density",
    "spa_decomposition_loss", "decay_weight", "rebel_component_weights", "rebel_reward",
    "prefix_score_rewards", "action_ordinals"})
