"""On-policy (self-)distillation as advantages: the teacher's log-probs of the sampled tokens
turned into per-token credit (estimators ``opd``, ``credit``) or added to another estimator's
advantages (transforms ``seed``, ``cny``). The distillation *losses* live in
``jaxrl_agent.losses.distill``, which explains the notation: lp_T = teacher log-probs of the
sampled tokens under a privileged context, read from ``batch.extras`` under a field name given
as a hyper-parameter (default ``teacher_logprobs``, [R, T]); lp_old = ``batch.old_logprobs``.

Shapes: N trajectories x K turns ([N, K]), stored as R token rows of length T ([R, T]).

Every teacher and behaviour input is stop-gradient; padding is selected away before any
arithmetic, so NaN or inf in padded entries changes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import (check_choice, check_nonneg, check_optional_positive, require,
                                token_field, token_mask)
from jaxrl_agent.registry import register

sg = jax.lax.stop_gradient
CREDIT_LEVELS = ("token", "sequence")
CREDIT_VARIANTS = ("logmeanexp", "mean")


def _turn_mean(tok, b):
    """Token mean of a per-token array over every valid turn, [N, K]."""
    return jnp.where(segments.valid_turns(b), segments.token_to_turn(tok, b, "mean"), 0.0)


def _clip_signal(x, clip):
    return x if clip is None else jnp.clip(x, -clip, clip)


# ============================================================================= OPD, SEED, CNY


@register("opd")
def teacher_log_ratio_advantage(batch: TrajectoryBatch, *, beta: float = 1.0,
                                teacher: str = "teacher_logprobs",
                                behavior: str = "old_logprobs", mask=None, clip=None,
                                axis_name=None) -> Advantages:
    """On-policy distillation (OPD) as an advantage: A_t = beta (lp_T(y_t) - lp_old(y_t)).

    The per-token negative reverse-KL sample -beta (lp_old - lp_T): no group baseline, no
    whitening, no discount. Fed to a PG/PPO loss it is the standard on-policy estimator of
    -grad KL(pi_theta || pi_T). Follows the public implementation NVIDIA-NeMo/labs-molt
    ``on_policy_distill`` (advantage form; also Thinking Machines' on-policy distillation
    recipe).

    Args:
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``turn_ids``, ``row_traj`` [R, T],
        ``turn_mask`` [N, K], extras[``teacher``] [R, T] and ``behavior`` [R, T].
      beta: scale of the log-ratio, >= 0.
      teacher: extras field of lp_T [R, T] (teacher log-probs of the sampled tokens).
      behavior: field of lp_old [R, T] (default ``batch.old_logprobs``).
      mask: optional extras field of a token mask [R, T] (bool, or > 0.5): A = 0 off it.
      clip: optional bound > 0 on |lp_T - lp_old| (a sharp teacher can otherwise put a huge
        advantage on one token); None = no bound.
      axis_name: mesh axis under ``shard_map`` (no batch-wide statistic here).

    Returns:
      ``Advantages`` with ``token`` [R, T] (0 outside ``action_mask`` and ``mask``) and
      ``turn`` [N, K] = the token mean per turn (0 on missing turns).
      Teacher = behaviour gives A = 0; linear in beta (without ``clip``).
    """
    check_nonneg("beta", beta)
    check_optional_positive("clip", clip)
    b = segments.local_view(batch, axis_name)
    lt = token_field(b, teacher, "opd", stop_gradient=True)
    lb = token_field(b, behavior, "opd", stop_gradient=True)
    on = token_mask(b, mask, "opd")
    tok = jnp.where(on, beta * _clip_signal(lt - lb, clip), 0.0)
    return Advantages(token=tok, turn=_turn_mean(tok, b))


def _dense_addon(adv: Advantages, batch, who, weight, teacher, student, mask, clip, axis_name):
    check_nonneg("weight", weight)
    check_optional_positive("clip", clip)
    b = segments.local_view(batch, axis_name)
    lt = token_field(b, teacher, who, stop_gradient=True)
    ls = token_field(b, student, who, stop_gradient=True)
    on = token_mask(b, mask, who)
    base = jnp.where(b.action_mask, jnp.asarray(adv.token, jnp.float32), 0.0)
    tok = jnp.where(on, base + weight * _clip_signal(lt - ls, clip), base)
    return adv.replace(token=tok, turn=_turn_mean(tok, b))


@register("seed", kind="transform", renamed={"lam": "weight"})
def skill_log_ratio_bonus(adv: Advantages, batch: TrajectoryBatch, *, weight: float = 1.0,
                          teacher: str = "teacher_logprobs", student: str = "old_logprobs",
                          mask=None, clip=None, axis_name=None) -> Advantages:
    """SEED hindsight-skill distillation as a dense advantage add-on.

    Following the SEED paper's description of the method:

        A_t = A_base,t + weight d_t,   d_t = lp(y_t | x, skill) - lp(y_t | x)

    with lp(. | x, skill) = extras[``teacher``] and lp(. | x) = ``student`` (default the
    behaviour log-probs). The skill text is produced by the policy itself outside this library;
    this consumes the two rescorings. Teacher = student context gives A = A_base exactly.

    Args:
      adv: the base ``Advantages`` (``token`` [R, T]); value targets pass through unchanged.
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``turn_ids``, ``row_traj`` [R, T],
        ``turn_mask`` [N, K], extras[``teacher``] [R, T] and ``student`` [R, T].
      weight: coefficient of the log-ratio add-on, >= 0 (formerly ``lam``).
      teacher: extras field of lp(y_t | x, skill) [R, T].
      student: field of lp(y_t | x) [R, T] (default ``batch.old_logprobs``).
      mask: optional extras field of a token mask [R, T]: the add-on applies only on it.
      clip: optional bound > 0 on |d_t|; None = no bound.
      axis_name: mesh axis under ``shard_map`` (no batch-wide statistic here).

    Returns:
      ``Advantages``: ``token`` [R, T] as above (0 outside ``action_mask``), ``turn`` [N, K]
      = its token mean per turn, the other fields of ``adv`` unchanged.
    """
    return _dense_addon(adv, batch, "seed", weight, teacher, student, mask, clip, axis_name)


@register("cny", kind="transform", renamed={"lam": "weight"})
def neighbor_reveal_log_ratio_bonus(adv: Advantages, batch: TrajectoryBatch, *,
                                    weight: float = 1.0, teacher: str = "teacher_logprobs",
                                    student: str = "old_logprobs",
                                    mask: str = "selection_mask", clip=None,
                                    axis_name=None) -> Advantages:
    """CNY destination-conditioned on-policy self-distillation for graph-walk actions.

    Following the CNY paper's description of the method: ``seed``'s add-on

        A_t = A_base,t + weight (lp(a | ctx + revealed) - lp(a | ctx))

    on the neighbour-selection tokens only. ``teacher`` holds the log-probs of the chosen
    action re-scored after the neighbour's content is revealed.

    Args:
      adv: the base ``Advantages`` (``token`` [R, T]); value targets pass through unchanged.
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``turn_ids``, ``row_traj`` [R, T],
        ``turn_mask`` [N, K], extras[``teacher``], ``student`` and extras[``mask``] [R, T].
      weight: coefficient of the log-ratio add-on, >= 0 (formerly ``lam``).
      teacher: extras field of lp(a | ctx + revealed) [R, T].
      student: field of lp(a | ctx) [R, T] (default ``batch.old_logprobs``).
      mask: extras field of the neighbour-selection token mask [R, T] (required; None raises
        ``ValueError``).
      clip: optional bound > 0 on |lp_T - lp_student|; None = no bound.
      axis_name: mesh axis under ``shard_map`` (no batch-wide statistic here).

    Returns:
      ``Advantages``: ``token`` [R, T], ``turn`` [N, K] = its token mean per turn, the other
      fields of ``adv`` unchanged.
    """
    if mask is None:
        raise ValueError("cny needs mask= (the extras field of the neighbour-selection tokens)")
    return _dense_addon(adv, batch, "cny", weight, teacher, student, mask, clip, axis_name)


def _logmeanexp(x, axis):
    top = jnp.max(x, axis=axis, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    return jnp.squeeze(top, axis) + jnp.log(jnp.mean(jnp.exp(x - top), axis=axis))


def contrastive_rewards(teacher_lp, negatives, batch: TrajectoryBatch, *, level: str = "token",
                        variant: str = "logmeanexp"):
    """CREDIT's contrastive reward [R, T] (``level="token"``) or per trajectory [N]
    (``"sequence"``). This is our reading of the CREDIT paper, which describes the reward in
    words:

    token:    r_t = lp_T(y_t | x_i) - log mean_{j in {i} + negatives} exp(lp_T(y_t | x_j))
    sequence: r_i = S_i - log mean_j exp(S_ij),  S = sum over the trajectory's action tokens
    ``variant="mean"``: subtract the plain mean of the negatives' log-probs instead (the
    cheaper baseline; no bound). ``negatives`` [R, T, M]: the teacher's log-probs of the same
    tokens under M other in-batch inputs (e.g. from a signal plug-in in training).

    Props (logmeanexp): r <= log(M + 1) (InfoNCE bound; per token, and per trajectory for the
    sequence level); identical inputs (negatives = teacher) give exactly 0.
    ``batch`` must be block-local; inputs are treated as detached.

    Args:
      teacher_lp: [R, T] teacher log-probs of the sampled tokens under the trajectory's own
        input x_i.
      negatives: [R, T, M] the teacher's log-probs of the same tokens under M other inputs.
      batch: reads ``action_mask``, ``row_traj`` [R, T] and ``traj_mask`` [N].
      level: ``"token"`` or ``"sequence"``.
      variant: ``"logmeanexp"`` or ``"mean"``.

    Returns:
      r [R, T] (0 outside ``action_mask``) for ``level="token"``, or r [N] (0 on padding
      trajectories) for ``"sequence"``.
    """
    m = batch.action_mask
    lt = sg(jnp.where(m, jnp.asarray(teacher_lp, jnp.float32), 0.0))
    neg = sg(jnp.where(m[..., None], jnp.asarray(negatives, jnp.float32), 0.0))
    if level == "sequence":
        n = batch.num_traj
        s_self = jax.ops.segment_sum(lt.sum(axis=1), batch.row_traj, n)
        s_neg = jax.ops.segment_sum(neg.sum(axis=1), batch.row_traj, n)  # [N, M]
        if variant == "mean":
            r = s_self - jnp.mean(s_neg, axis=1)
        else:
            r = s_self - _logmeanexp(jnp.concatenate([s_self[:, None], s_neg], axis=1), 1)
        return jnp.where(batch.traj_mask, r, 0.0)
    if variant == "mean":
        r = lt - jnp.mean(neg, axis=-1)
    else:
        r = lt - _logmeanexp(jnp.concatenate([lt[..., None], neg], axis=-1), -1)
    return jnp.where(m, r, 0.0)


@register("credit")
def contrastive_teacher_advantage(batch: TrajectoryBatch, *, beta: float = 1.0,
                                  teacher: str = "teacher_logprobs",
                                  negatives: str = "negative_logprobs", level: str = "token",
                                  variant: str = "logmeanexp", axis_name=None) -> Advantages:
    """CREDIT contrastive reward from distillation as an advantage.

    This is our reading of the CREDIT paper's abstract, which describes the reward in words:
    A_t = beta r_t with r from ``contrastive_rewards`` (token level), or A_t = beta r_i on
    every token of trajectory i (sequence level: the trajectory's pointwise mutual
    information with an InfoNCE batch baseline).

    Args:
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``turn_ids``, ``row_traj`` [R, T],
        ``turn_mask`` [N, K], ``traj_mask`` [N], extras[``teacher``] [R, T] and
        extras[``negatives``] [R, T, M].
      beta: scale of the reward, >= 0.
      teacher: extras field of the feedback-conditioned teacher's log-probs [R, T].
      negatives: extras field [R, T, M], M >= 1: the teacher's log-probs of the same tokens
        under M other in-batch inputs (in training, e.g. from a signal plug-in).
      level: ``"token"`` (per-token reward) or ``"sequence"`` (one reward per trajectory,
        broadcast to its tokens).
      variant: ``"logmeanexp"`` (InfoNCE baseline, r <= log(M + 1)) or ``"mean"`` (the plain
        mean of the negatives' log-probs as the baseline).
      axis_name: mesh axis under ``shard_map`` (``row_traj`` is made block-local; no
        batch-wide statistic).

    Returns:
      ``Advantages`` with ``token`` [R, T] (0 outside ``action_mask``) and ``turn`` [N, K] =
      the token mean per turn. Negatives equal to the teacher give A = 0.
    """
    check_nonneg("beta", beta)
    check_choice("level", level, CREDIT_LEVELS)
    check_choice("variant", variant, CREDIT_VARIANTS)
    b = segments.localize(batch, axis_name)
    lt = token_field(b, teacher, "credit", stop_gradient=True)
    neg = jnp.asarray(require(batch, negatives, "credit",
                               "[R, T, M] teacher log-probs of the tokens under M other inputs"))
    r_, t_ = b.action_mask.shape
    if neg.ndim != 3 or tuple(neg.shape[:2]) != (r_, t_) or neg.shape[2] < 1:
        raise ValueError(f"credit: extras['{negatives}'] must have shape [R, T, M] = "
                         f"({r_}, {t_}, M >= 1), got {tuple(neg.shape)}")
    # zero_padding masks [N, K]-shaped extras by turn_mask, which could misread [R, T, M]
    # when R = N and T = K: the negatives are masked here from the raw extras instead.
    b = segments.zero_padding(b)
    r = contrastive_rewards(lt, neg, b, level=level, variant=variant)
    tok = beta * (segments.traj_to_token(r, b) if level == "sequence" else r)
    tok = jnp.where(b.action_mask, tok, 0.0)
    return Advantages(token=tok, turn=_turn_mean(tok, b))
