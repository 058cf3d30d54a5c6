"""On-policy (self-)distillation as auxiliary losses.

Notation (per action token t): lp_S = the student's current log-prob of the sampled token
(``logprobs``, the only input that carries gradient), lp_old = behaviour log-probs
(``batch.old_logprobs``), lp_T = teacher log-probs of the *same sampled tokens* under a
privileged context (hindsight, skill, experience, feedback, answer, ...). The teacher is run
outside this library: every function here consumes its log-probs as arrays, read from
``batch.extras`` under a field name given as a hyper-parameter (default ``teacher_logprobs``,
[R, T]) or passed explicitly (``teacher_logprobs=``). The special field name ``"old_logprobs"``
means ``batch.old_logprobs``, ``"outcome"`` means ``batch.outcome``. Per-turn / per-trajectory
signals (weights, gaps, gates) may be given as [R, T], [N, K] or [N] arrays.

Every teacher, behaviour, reward and weight input is wrapped in ``jax.lax.stop_gradient``
(stop-gradient); padding is selected away (``jnp.where``) before any arithmetic, so NaN or inf
in padded entries changes nothing, neither the value nor the gradient (padding invariance).

The same teacher signals as advantages (estimators ``opd``, ``credit``; transforms ``seed``,
``cny``) live in ``jaxrl_agent.estimators.distill``. Here, the losses ``f(logprobs, batch, *,
hp, agg="token_mean", agg_constant=None, axis_name=None) -> (sum, denominator)``, registered
under the names ``sdl``, ``sdar``, ``edge``, ``ucob``, ``icsd``, ``craft``, ``treeopsd``,
``t_reg``, ``weighted_sft`` (ASPO / InT / ABC-SFT) and ``topk_kl`` (the forward KL over the
teacher's top-K tokens, which reads the teacher's whole next-token distribution, not one
sampled token's log-prob). Every one of them shares these arguments:

* ``logprobs`` [R, T]: lp_S, the student's current log-probs of the sampled tokens (unless
  a loss's docstring says otherwise; ``topk_kl`` reads ``student_topk_logprobs`` instead,
  the student's log-probs of the teacher's top-K ids, which the train step computes when a
  loss of the run reads ``teacher_topk_logprobs`` and passes to every loss that names it:
  ``losses.step_given``).
* ``agg``: the aggregation mode, one of ``losses.AGG_MODES`` (see ``aggregation``);
  ``agg_constant``: C of ``seq_mean_token_sum_norm`` (default the padded row length T).
* ``axis_name``: the mesh axis under ``shard_map``: trajectory indices are made block-local
  and the pair returned is this shard's share (add the pairs over the axis yourself).

and returns ``(sum, denominator)``, float32 scalars: the per-token loss aggregated over
``action_mask`` (or the subset a docstring names) by ``aggregation.aggregate``; add the pairs
over micro-batches and devices, then divide once.

Shapes: N trajectories x K turns ([N, K]), stored as R token rows of length T ([R, T]).

Where a loss follows a public implementation, its docstring names the repository and file.
Where a paper describes its loss only in words, the docstring says that the formula is our
reading of the paper.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_agent import segments
from jaxrl_agent.batch import TrajectoryBatch
from jaxrl_agent.losses.aggregation import aggregate, check_mode
from jaxrl_agent.checks import (check_choice, check_nonneg,
                                check_positive, check_unit, is_static_real, require, shape_error,
                                spread_field, token_field, token_mask)
from jaxrl_agent.losses.kl import kl_k3
from jaxrl_agent.registry import register

sg = jax.lax.stop_gradient
LOG_CLAMP = 20.0
SDAR_GATES = ("sigmoid", "none", "external")
UCOB_GATES = ("sigmoid", "none")
ICSD_TRUST = ("sdar", "sdl")
CRAFT_LEVELS = ("group", "step")
CRAFT_CREDIT = ("sign", "scaled")


def _student(logprobs, batch: TrajectoryBatch, who: str):
    """The differentiable student log-probs, 0 (with zero gradient) outside ``action_mask``."""
    shape = tuple(batch.action_mask.shape)
    if tuple(jnp.shape(logprobs)) != shape:
        raise shape_error(who, "logprobs", "[R, T]", shape, jnp.shape(logprobs))
    return jnp.where(batch.action_mask, jnp.asarray(logprobs, jnp.float32), 0.0)


def _advantage_tokens(b, advantages, field, who):
    """Stop-gradient per-token advantages [R, T]: ``advantages`` (an array or anything with a
    ``.token``) or ``extras[field]`` ([R, T], [N, K] or [N])."""
    if advantages is not None:
        a = getattr(advantages, "token", advantages)
        shape = tuple(b.action_mask.shape)
        if tuple(jnp.shape(a)) != shape:
            raise shape_error(who, "advantages", "[R, T]", shape, jnp.shape(a))
        return sg(jnp.where(b.action_mask, jnp.asarray(a, jnp.float32), 0.0))
    return sg(spread_field(b, field, who, "advantages / credit (or pass advantages=)"))


def _finish(per_token, batch, agg, agg_constant, axis_name, mask=None):
    """Aggregates over ``action_mask`` (or ``mask``) of the caller's batch (NOT the
    local view: ``aggregate`` localises ``row_traj`` itself)."""
    if mask is not None:
        batch = batch.replace(action_mask=mask)
    return aggregate(per_token, batch, agg, constant=agg_constant, axis_name=axis_name)


# ============================================================================= SDL


def sdl_tokens(lp, lt, lold):
    """Per-token SDL: rho k3 with l = lp - lt, k3 = exp(min(-l, 20)) - 1 + l,
    rho = exp(min(lp - lold, 10)) (rho keeps its gradient, as in the source)."""
    ell = lp - lt
    k3 = jnp.exp(jnp.minimum(-ell, LOG_CLAMP)) - 1.0 + ell
    rho = jnp.exp(jnp.minimum(lp - lold, 10.0))
    return rho * k3


@register("sdl", kind="loss")
def ratio_weighted_reverse_kl(logprobs, batch: TrajectoryBatch, *,
                              teacher: str = "teacher_logprobs", behavior: str = "old_logprobs",
                              teacher_logprobs=None, agg: str = "token_mean",
                              agg_constant=None, axis_name=None):
    """SDL: reverse-KL self-distillation with an on-policy ratio.

        l = lp_S - lp_T,  k3 = exp(-l) - 1 + l  (-l clamped at 20),
        rho = exp(min(lp_S - lp_old, 10)),  loss_t = rho k3.

    Follows the public implementation TU2021/UCOB
    ``verl/trainer/ppo/skillsd_utils.py::compute_sdl_loss`` (the trainer scales it by
    ``sdl_coef`` = 0.1 there). lp_T and lp_old are stop-gradient; rho is not.
    loss >= 0, and 0 with zero gradient iff lp_S = lp_T on the sampled tokens.

    Args:
      logprobs: [R, T] lp_S (the only input that carries gradient).
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``row_traj`` [R, T],
        extras[``teacher``] [R, T] and ``behavior`` [R, T].
      teacher: extras field of lp_T [R, T].
      behavior: field of lp_old [R, T] (default ``batch.old_logprobs``).
      teacher_logprobs: optional [R, T] array of lp_T used instead of extras[``teacher``].
      agg, agg_constant, axis_name: the aggregation (module docstring).

    Returns:
      ``(sum, denominator)`` of the per-token loss (module docstring).
    """
    check_mode(agg)
    b = segments.local_view(batch, axis_name)
    lp = _student(logprobs, b, "sdl")
    lt = token_field(b, teacher, "sdl", override=teacher_logprobs, stop_gradient=True)
    lold = token_field(b, behavior, "sdl", stop_gradient=True)
    return _finish(sdl_tokens(lp, lt, lold), batch, agg, agg_constant, axis_name)


# ============================================================================= SDAR


def _sign_field(b, gate_delta_sign, who):
    if gate_delta_sign is None:
        return None
    if is_static_real(gate_delta_sign):
        return jnp.float32(gate_delta_sign)
    if isinstance(gate_delta_sign, str):
        return sg(spread_field(b, gate_delta_sign, who, "gate_delta_sign per sample/turn/token"))
    raise ValueError(f"gate_delta_sign must be None, a number or an extras field name, got "
                     f"{gate_delta_sign!r}")


def sdar_gate(lp_sg, lt, gate_beta, sign=None):
    """g = sigmoid(gate_beta * s * (lt - lp)) (detached), s = ``sign`` (default 1)."""
    delta = lt - lp_sg
    if sign is not None:
        delta = delta * sign
    return sg(jax.nn.sigmoid(gate_beta * delta))


@register("sdar", kind="loss")
def confidence_gated_distillation(logprobs, batch: TrajectoryBatch, *,
                                  teacher: str = "teacher_logprobs", gate: str = "sigmoid",
                                  gate_beta: float = 5.0, gate_field: str = "gate",
                                  gate_delta_sign=None, weight=None, teacher_logprobs=None,
                                  gate_values=None, agg: str = "token_mean",
                                  agg_constant=None, axis_name=None):
    """SDAR confidence-gated teacher distillation.

        g_t = sigmoid(gate_beta * s (lp_T - sg(lp_S))) (detached),  loss_t = w g_t (lp_T - lp_S)

    so the gradient -w g_t pushes lp_S up where the teacher is more confident. Follows the
    public implementation TU2021/UCOB ``verl/trainer/ppo/sdar_utils.py::compute_sdar_loss``.

    Args:
      logprobs: [R, T] lp_S (the only input that carries gradient).
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``turn_ids``, ``row_traj`` [R, T],
        ``turn_mask`` [N, K], ``traj_mask`` [N], extras[``teacher``] [R, T] and the optional
        fields below.
      teacher: extras field of lp_T [R, T].
      gate: ``"sigmoid"`` (above), ``"none"`` (g = 1: plain sampled-token cross-entropy toward
        the teacher, the source's ``gate_enable=False``), ``"external"`` (g =
        extras[``gate_field``] per token/turn/trajectory, or the array ``gate_values``, e.g.
        ADRS's TVA modulation; stop-gradient).
      gate_beta: sharpness of the sigmoid gate, > 0.
      gate_field: extras field of the external gate, [R, T], [N, K] or [N].
      gate_delta_sign: None, a number, or an extras field ([N], [N, K] or [R, T]) s that
        multiplies the gate's delta (UCOB dual-view training flips it); the optimised
        direction is unchanged.
      weight: optional extras field of a per-sample / per-turn / per-token weight w ([N],
        [N, K] or [R, T]; stop-gradient); None = 1.
      teacher_logprobs: optional [R, T] array of lp_T used instead of extras[``teacher``].
      gate_values: optional array of the external gate ([R, T], [N, K] or [N]) used instead
        of extras[``gate_field``].
      agg, agg_constant, axis_name: the aggregation (module docstring).

    Returns:
      ``(sum, denominator)`` of the per-token loss (module docstring).

    Props: g in (0, 1); |d loss_t / d lp_S| = w g_t; lp_S = lp_T gives loss 0 but gradient
    -w g_t (the gate is 1/2 there): SDAR keeps pulling toward the teacher's sampled tokens.
    """
    check_mode(agg)
    check_choice("gate", gate, SDAR_GATES)
    check_positive("gate_beta", gate_beta)
    b = segments.local_view(batch, axis_name)
    lp = _student(logprobs, b, "sdar")
    lt = token_field(b, teacher, "sdar", override=teacher_logprobs, stop_gradient=True)
    per_token = lt - lp
    if gate == "sigmoid":
        per_token = sdar_gate(sg(lp), lt, gate_beta, _sign_field(b, gate_delta_sign, "sdar")) \
            * per_token
    elif gate == "external":
        per_token = sg(spread_field(b, gate_field, "sdar", "external gate",
                                    override=gate_values)) * per_token
    if weight is not None:
        per_token = sg(spread_field(b, weight, "sdar", "distillation weight")) * per_token
    return _finish(per_token, batch, agg, agg_constant, axis_name)


# ============================================================================= EDGE


def edge_admitted(batch: TrajectoryBatch, *, view: str = "view", score: str = "outcome",
                  above_f_mean: bool = False, axis_name=None):
    """EDGE's gate per trajectory [N] bool, and the group gain Delta_g per trajectory [N].

    Delta_g = mean_{E in g} R - mean_{F in g} R (0 unless the group has both views); admitted:
    E-trajectories (view > 0.5) of groups with Delta_g > 0, and with ``above_f_mean`` only
    those with R_i > mean_F R. Group statistics are local (groups are whole per shard).
    """
    b = segments.local_view(batch, axis_name)
    v = require(b, view, "edge", "[N] view label per trajectory: 1 = experience-conditioned "
                 "(E), 0 = experience-free (F)")
    if tuple(jnp.shape(v)) != (b.num_traj,):
        raise shape_error("edge", f"extras['{view}']", "[N]", (b.num_traj,), jnp.shape(v))
    r = b.outcome if score == "outcome" else require(b, score, "edge", "[N] trajectory score")
    if tuple(jnp.shape(r)) != (b.num_traj,):
        raise shape_error("edge", f"score {score!r}", "[N]", (b.num_traj,), jnp.shape(r))
    r = sg(jnp.asarray(r, jnp.float32))
    is_e = b.traj_mask & (jnp.asarray(v, jnp.float32) > 0.5)
    is_f = b.traj_mask & ~is_e
    mean_e, _, n_e = segments.group_stats(r, b.group_ids, is_e)
    mean_f, _, n_f = segments.group_stats(r, b.group_ids, is_f)
    both = (n_e > 0) & (n_f > 0)
    gain = jnp.where(both, mean_e - mean_f, 0.0)
    admit = is_e & both & (gain > 0)
    if above_f_mean:
        admit = admit & (r > mean_f)
    return admit, jnp.where(b.traj_mask, gain, 0.0)


@register("edge", kind="loss")
def gain_gated_experience_distillation(logprobs, batch: TrajectoryBatch, *, view: str = "view",
                                       score: str = "outcome", teacher: str = "old_logprobs",
                                       above_f_mean: bool = False, teacher_logprobs=None,
                                       agg: str = "token_mean", agg_constant=None,
                                       axis_name=None):
    """EDGE experience distillation for guided exploration.

    This is our reading of the EDGE paper ("experience-distillation for guided
    exploration"), whose abstract describes the loss in words.

    Each group mixes experience-conditioned (E, extras[``view``] = 1) and experience-free (F)
    rollouts. Delta_g = mean_E R - mean_F R (R = ``score``, default the outcome); only when
    Delta_g > 0 (``edge_admitted``) are the E-trajectories distilled into the base policy:

        loss_t = k3(lp_S,noexp, lp_T) = exp(lp_T - lp_S) - (lp_T - lp_S) - 1   (``kl_k3``)

    on the tokens the E-rollout sampled ("own empirical support"), with ``logprobs`` =
    lp_S,noexp, the student's log-probs of the same tokens WITHOUT the experience in context,
    and the teacher = the experience-conditioned behaviour log-probs (default
    ``old_logprobs``). Aggregated over the admitted tokens only (mean per distilled token).
    The RL loss is applied to all trajectories separately. The experience bank is host-side.

    Args:
      logprobs: [R, T] lp_S,noexp, the student's current log-probs of the sampled tokens
        without the experience in context (the only input that carries gradient).
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``row_traj`` [R, T],
        ``group_ids``, ``traj_mask`` [N], extras[``view``] [N], ``score`` [N] and
        ``teacher`` [R, T].
      view: extras field [N] of the view label: 1 (> 0.5) = experience-conditioned (E),
        0 = experience-free (F).
      score: the per-trajectory return R [N]: ``"outcome"`` (``batch.outcome``) or an extras
        field.
      teacher: field of lp_T [R, T] (default ``batch.old_logprobs``).
      above_f_mean: also require R_i > mean_F R for an E-trajectory to be distilled.
      teacher_logprobs: optional [R, T] array of lp_T used instead of the ``teacher`` field.
      agg, agg_constant, axis_name: the aggregation (module docstring).

    Returns:
      ``(sum, denominator)`` of the per-token loss over the action tokens of the admitted
      trajectories only (module docstring); (0, 0) when none is admitted.

    Props: no distillation (0, 0) when no group has Delta_g > 0; loss and gradient 0 when the
    experience does not change the log-probs (lp_S,noexp = lp_T).
    """
    check_mode(agg)
    b = segments.local_view(batch, axis_name)
    lp = _student(logprobs, b, "edge")
    lt = token_field(b, teacher, "edge", override=teacher_logprobs, stop_gradient=True)
    admit, _ = edge_admitted(batch, view=view, score=score, above_f_mean=above_f_mean,
                             axis_name=axis_name)
    on = b.action_mask & admit[jnp.clip(b.row_traj, 0, b.num_traj - 1)][:, None]
    return _finish(kl_k3(lp, lt), batch, agg, agg_constant, axis_name, mask=on)


# ============================================================================= UCOB


@register("ucob", kind="loss")
def return_gap_bidirectional_distillation(logprobs, batch: TrajectoryBatch, *,
                                          other: str = "other_logprobs",
                                          gap: str = "return_gap", gate: str = "sigmoid",
                                          gate_beta: float = 5.0, other_logprobs=None,
                                          agg: str = "token_mean", agg_constant=None,
                                          axis_name=None):
    """UCOB credit-aware bidirectional self-distillation.

    The gated term follows the public implementation TU2021/UCOB
    ``verl/trainer/ppo/sdar_utils.py::compute_sdar_loss`` (target view with gradient,
    detached reference view); the direction rule and the |gap| weight are our reading of the
    UCOB paper, which describes them in words.

    Two views (prompt contexts) of the same task and anchor state score the same tokens:
    lp_a = ``logprobs`` (this row's view, differentiable) and lp_b = ``other`` (the other
    view; extras field, detached, or ``other_logprobs=`` which may carry gradient). The gap
    d = R_b - R_a (extras[``gap``], [N] or [N, K]: return-to-go of the other view minus this
    one) picks the direction: the higher-return view is the teacher (detached), the
    lower one the target, weighted by |d|:

        hi, lo = (b, a) if d > 0 else (a, b)
        loss_t = |d| g_t (sg(lp_hi) - lp_lo),  g_t = sigmoid(gate_beta (lp_hi - lp_lo)) (sg)

    Props: antisymmetric in the gap: swapping the views and negating d gives the same loss
    and swaps the gradients (the direction flips with sign(d)); d = 0 gives zero loss and
    zero gradient. With d < 0 and ``other`` read from extras the token carries value but no
    gradient (its target view is not differentiable here).

    Args:
      logprobs: [R, T] lp_a, this row's view's current log-probs of the sampled tokens
        (differentiable).
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``turn_ids``, ``row_traj`` [R, T],
        ``turn_mask`` [N, K], ``traj_mask`` [N], extras[``other``] [R, T] and extras[``gap``].
      other: extras field of lp_b [R, T] (detached).
      gap: extras field of d, [N], [N, K] or [R, T] (stop-gradient).
      gate: ``"sigmoid"`` (g_t above) or ``"none"`` (g = 1).
      gate_beta: sharpness of the sigmoid gate, > 0.
      other_logprobs: optional [R, T] array of lp_b used instead of extras[``other``]; it
        keeps its gradient.
      agg, agg_constant, axis_name: the aggregation (module docstring).

    Returns:
      ``(sum, denominator)`` of the per-token loss (module docstring).
    """
    check_mode(agg)
    check_choice("gate", gate, UCOB_GATES)
    check_positive("gate_beta", gate_beta)
    b = segments.local_view(batch, axis_name)
    lp_a = _student(logprobs, b, "ucob")
    lp_b = token_field(b, other, "ucob", override=other_logprobs,
                       stop_gradient=other_logprobs is None)
    d = sg(spread_field(b, gap, "ucob", "return gap R_other - R_self"))
    up = d > 0  # the other view is the teacher
    hi = jnp.where(up, sg(lp_b), sg(lp_a))
    lo = jnp.where(up, lp_a, lp_b)
    per_token = hi - lo
    if gate == "sigmoid":
        per_token = sdar_gate(sg(lo), hi, gate_beta) * per_token
    per_token = jnp.abs(d) * per_token
    return _finish(per_token, batch, agg, agg_constant, axis_name)


# ============================================================================= ICSD


def icsd_weights(logprobs, batch: TrajectoryBatch, *, advantages=None,
                 advantage_field: str = "advantages", teacher: str = "teacher_logprobs",
                 behavior: str = "old_logprobs", trust: str = "sdar", gate_beta: float = 5.0,
                 w_min: float = 0.5, eps: float = 1e-8, normalize_mass: bool = True,
                 teacher_logprobs=None, axis_name=None):
    """ICSD's influence-calibrated weights w [R, T] and trust allocation c [R, T] (detached).

    This is our reading of the ICSD paper ("Influence Calibration for Self-Distillation"),
    which describes the weights in words:
      g_t = lp_T - lp_S;  g_bar_k = token mean of g over turn k (the E_pi[g] term);
      u_t = rho_t A_t (g_t - g_bar_k(t)),  rho_t = exp(lp_S - lp_old) (1 at the first epoch);
      w_t = clip(1 + tanh(u_t / (std_batch(u) + eps)), w_min, 2);
      mass per turn (``normalize_mass``): w_t <- w_t sum_{k} c / sum_{k} w c,
    with c = the SDAR gate sigmoid(gate_beta g_t) (``trust="sdar"``) or 1 (``"sdl"``).
    std_batch is the population std over all action tokens (psum over ``axis_name``).

    Props: per turn, sum c w = sum c (mass conservation); u < 0 gives w < 1 before the mass
    step; A = 0 everywhere gives w = 1 (reduction to the base estimator).
    """
    check_choice("trust", trust, ICSD_TRUST)
    check_unit("w_min", w_min)
    check_positive("eps", eps)
    check_positive("gate_beta", gate_beta)
    b = segments.local_view(batch, axis_name)
    m = b.action_mask
    lp = sg(_student(logprobs, b, "icsd"))
    lt = token_field(b, teacher, "icsd", override=teacher_logprobs, stop_gradient=True)
    lold = token_field(b, behavior, "icsd", stop_gradient=True)
    a = _advantage_tokens(b, advantages, advantage_field, "icsd")
    g = lt - lp
    g_bar = segments.turn_to_token(segments.token_to_turn(g, b, "mean"), b)
    rho = jnp.exp(jnp.clip(lp - lold, -LOG_CLAMP, LOG_CLAMP))
    u = jnp.where(m, rho * a * (g - g_bar), 0.0)
    _, var = segments.masked_mean_var(u, m, axis_name)
    std = segments.safe_sqrt(var)
    w = jnp.clip(1.0 + jnp.tanh(u / (std + eps)), w_min, 2.0)
    c = sdar_gate(lp, lt, gate_beta) if trust == "sdar" else jnp.ones_like(lp)
    c = jnp.where(m, c, 0.0)
    w = jnp.where(m, w, 0.0)
    if normalize_mass:
        mass_c = segments.turn_to_token(segments.token_to_turn(c, b), b)
        mass_wc = segments.turn_to_token(segments.token_to_turn(w * c, b), b)
        w = jnp.where(m & (mass_wc > 0), w * mass_c / jnp.where(mass_wc > 0, mass_wc, 1.0), w)
    return sg(w), sg(c)


@register("icsd", kind="loss")
def influence_weighted_distillation(logprobs, batch: TrajectoryBatch, *, advantages=None,
                                    advantage_field: str = "advantages",
                                    teacher: str = "teacher_logprobs",
                                    behavior: str = "old_logprobs", trust: str = "sdar",
                                    gate_beta: float = 5.0, w_min: float = 0.5,
                                    eps: float = 1e-8, teacher_logprobs=None,
                                    agg: str = "token_mean", agg_constant=None, axis_name=None):
    """ICSD influence-calibrated self-distillation: sum_t c_t w_t l_t.

    (w, c) come from ``icsd_weights`` (detached, batch-adaptive, per-turn mass of c w
    preserved) and l_t is the SDAR term lp_T - lp_S (``trust="sdar"``, c = the SDAR gate) or
    the SDL term rho k3 (``"sdl"``, c = 1). This is our reading of the ICSD paper, which
    describes the loss in words.
    The batch std of u is psummed over ``axis_name`` (shard-invariant).

    Args:
      logprobs: [R, T] lp_S (the only input that carries gradient).
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``turn_ids``, ``row_traj`` [R, T],
        ``turn_mask`` [N, K], ``traj_mask`` [N], extras[``teacher``] [R, T], ``behavior``
        [R, T] and, without ``advantages=``, extras[``advantage_field``].
      advantages: optional base advantages A: an [R, T] array or ``Advantages`` (its
        ``token``); stop-gradient.
      advantage_field: extras field of A ([R, T], [N, K] or [N]) when ``advantages`` is None.
      teacher: extras field of lp_T [R, T].
      behavior: field of lp_old [R, T] (default ``batch.old_logprobs``).
      trust: ``"sdar"`` or ``"sdl"`` (see above).
      gate_beta: sharpness of the SDAR gate, > 0.
      w_min: lower clip of the weights, in [0, 1].
      eps: > 0, added to the batch std of u.
      teacher_logprobs: optional [R, T] array of lp_T used instead of extras[``teacher``].
      agg, agg_constant, axis_name: the aggregation (module docstring); the batch std of
        u is also psummed over ``axis_name``.

    Returns:
      ``(sum, denominator)`` of the per-token loss (module docstring).
    """
    check_mode(agg)
    w, c = icsd_weights(logprobs, batch, advantages=advantages, advantage_field=advantage_field,
                        teacher=teacher, behavior=behavior, trust=trust, gate_beta=gate_beta,
                        w_min=w_min, eps=eps, teacher_logprobs=teacher_logprobs,
                        axis_name=axis_name)
    b = segments.local_view(batch, axis_name)
    lp = _student(logprobs, b, "icsd")
    lt = token_field(b, teacher, "icsd", override=teacher_logprobs, stop_gradient=True)
    if trust == "sdar":
        per_token = lt - lp
    else:
        per_token = sdl_tokens(lp, lt, token_field(b, behavior, "icsd", stop_gradient=True))
    return _finish(c * w * per_token, batch, agg, agg_constant, axis_name)


# ============================================================================= CRAFT


class CraftState(NamedTuple):
    """CRAFT Pillar 2's controller state: EMA of gate activity and the two coefficients."""

    activity: jax.Array
    lambda_distill: jax.Array
    lambda_kl: jax.Array


def craft_init(lambda_distill: float = 1.0, lambda_kl: float = 1.0,
               activity: float = 0.0) -> CraftState:
    return CraftState(jnp.float32(activity), jnp.float32(lambda_distill),
                      jnp.float32(lambda_kl))


def craft_controller(state: CraftState, activity, *, beta: float = 0.9, eta: float = 0.1,
                     target: float = 0.5, converse: bool = False) -> CraftState:
    """CRAFT Pillar 2, the asymmetric controller, as a pure state update. This is our reading
    of the CRAFT paper, which describes the controller in words:

        a_bar' = beta a_bar + (1 - beta) activity
        lambda_distill' = lambda_distill exp(+s eta (a_bar' - target))
        lambda_KL'      = lambda_KL      exp(-s eta (a_bar' - target)),  s = -1 if ``converse``

    ``activity``: this step's gate activity, e.g. the share of action tokens with positive
    CTI credit (``craft_credit(...) > 0``). At a_bar' = target the coefficients stay put.
    """
    check_unit("beta", beta)
    check_nonneg("eta", eta)
    s = -1.0 if converse else 1.0
    a_bar = beta * state.activity + (1.0 - beta) * jnp.asarray(activity, jnp.float32)
    step = s * eta * (a_bar - target)
    return CraftState(a_bar, state.lambda_distill * jnp.exp(step),
                      state.lambda_kl * jnp.exp(-step))


def craft_credit(logprobs, batch: TrajectoryBatch, *, advantages=None,
                 advantage_field: str = "advantages", teacher: str = "teacher_logprobs",
                 level: str = "group", temperature: float = 1.0, credit: str = "sign",
                 teacher_logprobs=None, axis_name=None):
    """CRAFT Pillar 1, counterfactual token importance: signed credit c [R, T] (detached).

    This is our reading of the CRAFT paper, which describes the credit in words; the
    estimator is modelled on the SNIS bootstrap of gitrxh/ADRS-arxiv ``cce_utils.py``.
    Anchor groups S: the task group of trajectories (``level="group"``) or, per step, the
    turns of one group with equal ``state_keys`` (``level="step"``; the ``craft_cti``
    transform calls this anchor ``"state"``). Each member m has delta_m = sum over its tokens of
    (lp_T - lp_S) and advantage A_m (its token mean of the base advantage):

        w_m = exp(delta_m / temperature)  (self-normalised, shifted by the group max)
        CTI(S) = sum_m w_m A_m / sum_m w_m - mean_m A_m
        c_t = CTI(S) sign(g_t)  (``credit="sign"``)  or  CTI(S) g_t / max_{t' in i}|g|
        (``"scaled"``),  g_t = lp_T - lp_S.

    CTI = 0 when all delta in S are equal and for singleton groups; the SNIS weights do not
    change when a constant is added to every delta of a group.
    """
    check_choice("level", level, CRAFT_LEVELS)
    check_choice("credit", credit, CRAFT_CREDIT)
    check_positive("temperature", temperature)
    b = segments.local_view(batch, axis_name)
    m = b.action_mask
    lp = sg(_student(logprobs, b, "craft"))
    lt = token_field(b, teacher, "craft", override=teacher_logprobs, stop_gradient=True)
    a = _advantage_tokens(b, advantages, advantage_field, "craft")
    g = jnp.where(m, lt - lp, 0.0)
    n, k = b.num_traj, b.num_turns
    if level == "group":
        counts = segments.traj_token_counts(b)
        delta = jax.ops.segment_sum(g.sum(axis=1), b.row_traj, n)
        a_m = jax.ops.segment_sum(a.sum(axis=1), b.row_traj, n) / jnp.maximum(counts, 1.0)
        valid = b.traj_mask & (counts > 0)
        ids, nseg = b.group_ids, n
    else:
        counts = segments.turn_token_counts(b).reshape(-1)
        delta = segments.token_to_turn(g, b).reshape(-1)
        a_m = (segments.token_to_turn(a, b).reshape(-1) / jnp.maximum(counts, 1.0))
        valid = segments.valid_turns(b).reshape(-1) & (counts > 0)
        ids, nseg = segments.turn_key_ids(b, b.state_keys).reshape(-1), n * k
    ids = jnp.where(valid, ids, nseg)
    safe = jnp.clip(ids, 0, nseg - 1)
    x = delta / temperature
    top = jax.ops.segment_max(jnp.where(valid, x, -jnp.inf), ids, nseg)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.where(valid, jnp.exp(jnp.where(valid, x - top[safe], 0.0)), 0.0)
    sw = jax.ops.segment_sum(w, ids, nseg)
    swa = jax.ops.segment_sum(w * a_m, ids, nseg)
    cnt = jax.ops.segment_sum(valid.astype(jnp.float32), ids, nseg)
    sa = jax.ops.segment_sum(jnp.where(valid, a_m, 0.0), ids, nseg)
    cti_s = swa / jnp.where(sw > 0, sw, 1.0) - sa / jnp.maximum(cnt, 1.0)
    cti_s = jnp.where(cnt > 1, cti_s, 0.0)  # a singleton's counterfactual is itself
    cti = jnp.where(valid, cti_s[safe], 0.0)
    if level == "group":
        cti_tok = segments.traj_to_token(cti, b)
    else:
        cti_tok = segments.turn_to_token(cti.reshape(n, k), b)
    if credit == "sign":
        c = cti_tok * jnp.sign(g)
    else:
        gmax = jax.ops.segment_max(jnp.where(m, jnp.abs(g), 0.0).max(axis=1), b.row_traj, n)
        gmax = segments.traj_to_token(jnp.maximum(gmax, 0.0), b)
        c = cti_tok * g / jnp.where(gmax > 0, gmax, 1.0)
    return sg(jnp.where(m, c, 0.0))


def forward_kl_sampled(lp, lt):
    """Sampled-token estimator of the forward KL(pi_T || pi_S) on tokens drawn from pi_S:
    r log r - (r - 1), r = exp(d), d = clip(lt - lp, -20, 20), value capped at 10 (as
    ``kl_k3``). The teacher-weighted r log r of our reading of CRAFT plus the zero-mean control
    variate -(r - 1) (E_{pi_S}[r - 1] = 0): >= 0, and value and gradient are 0 at lp = lt."""
    d = jnp.clip(lt - lp, -LOG_CLAMP, LOG_CLAMP)
    r = jnp.exp(d)
    return jnp.minimum(r * d - (r - 1.0), 10.0)


@register("craft", kind="loss")
def counterfactual_sign_aware_distillation(logprobs, batch: TrajectoryBatch, *,
                                           advantages=None,
                                           advantage_field: str = "advantages",
                                           teacher: str = "teacher_logprobs", cti: bool = True,
                                           controller: bool = False, polarize: bool = True,
                                           level: str = "group", temperature: float = 1.0,
                                           credit: str = "sign",
                                           controller_state: CraftState | None = None,
                                           teacher_logprobs=None, agg: str = "token_mean",
                                           agg_constant=None, axis_name=None):
    """CRAFT counterfactual, sign-aware self-distillation.

    This is our reading of the CRAFT paper's abstract, which describes the method in words.

    Baseline (every pillar off): plain reverse-KL self-distillation ``kl_k3(lp_S, lp_T)`` per
    token, the same numbers as ``losses.k3(logprobs, batch, ref_logprobs=lp_T)``.

    * Pillar 1 (``cti``): per-token signed credit c_t = ``craft_credit`` (CTI(S) sign(g_t));
      the token's loss is weighted by |c_t|. Off: weight 1 and c_t = sign(g_t).
    * Pillar 2 (``controller``): the loss is scaled by ``controller_state.lambda_distill``
      (``craft_controller`` updates the state outside the loss, from the gate activity).
    * Pillar 3 (``polarize``): tokens with c_t > 0 get the mode-seeking reverse KL
      (``kl_k3``), tokens with c_t < 0 the mode-covering forward KL (``forward_kl_sampled``).
      Off: reverse KL everywhere.

    The switches are Python-static flags: a pillar switched off removes its operations from
    the program, so with all three off loss and gradient are bit-identical to the baseline.
    Teacher = student gives zero loss and zero gradient.

    Args:
      logprobs: [R, T] lp_S (the only input that carries gradient).
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``turn_ids``, ``row_traj`` [R, T],
        ``turn_mask``, ``state_keys`` (``level="step"``) [N, K], ``group_ids``, ``traj_mask``
        [N], extras[``teacher``] [R, T] and, with ``cti`` and without ``advantages=``,
        extras[``advantage_field``].
      advantages: optional base advantages A for Pillar 1: an [R, T] array or
        ``Advantages``; stop-gradient.
      advantage_field: extras field of A ([R, T], [N, K] or [N]) when ``advantages`` is None.
      teacher: extras field of lp_T [R, T].
      cti: Pillar 1 on/off (static).
      controller: Pillar 2 on/off (static); on, ``controller_state`` is required.
      polarize: Pillar 3 on/off (static).
      level: anchor groups of the credit: ``"group"`` or ``"step"`` (see ``craft_credit``).
      temperature: > 0, of the SNIS weights.
      credit: ``"sign"`` or ``"scaled"`` (see ``craft_credit``).
      controller_state: a ``CraftState`` (``craft_init`` / ``craft_controller``).
      teacher_logprobs: optional [R, T] array of lp_T used instead of extras[``teacher``].
      agg, agg_constant, axis_name: the aggregation (module docstring).

    Returns:
      ``(sum, denominator)`` of the per-token loss (module docstring).
    """
    check_mode(agg)
    if controller and controller_state is None:
        raise ValueError("craft(controller=True) needs controller_state= (a CraftState from "
                         "craft_init / craft_controller)")
    b = segments.local_view(batch, axis_name)
    lp = _student(logprobs, b, "craft")
    lt = token_field(b, teacher, "craft", override=teacher_logprobs, stop_gradient=True)
    per_token = kl_k3(lp, lt)
    if cti or polarize:
        if cti:
            c = craft_credit(logprobs, batch, advantages=advantages,
                             advantage_field=advantage_field, teacher=teacher, level=level,
                             temperature=temperature, credit=credit,
                             teacher_logprobs=teacher_logprobs, axis_name=axis_name)
        else:
            c = jnp.sign(sg(lt - lp))
        if polarize:
            per_token = jnp.where(c < 0, forward_kl_sampled(lp, lt), per_token)
        if cti:
            per_token = jnp.abs(c) * per_token
    if controller:
        per_token = sg(jnp.asarray(controller_state.lambda_distill, jnp.float32)) * per_token
    return _finish(per_token, batch, agg, agg_constant, axis_name)


# ============================================================================= TreeOPSD


def treeopsd_target(credit, *, beta: float = 1.0, delta: float = 1.0):
    """TreeOPSD's bounded target log-ratio l* = clip(c / beta, -delta, delta)."""
    return jnp.clip(jnp.asarray(credit, jnp.float32) / beta, -delta, delta)


@register("treeopsd", kind="loss")
def tree_credit_log_ratio_regression(logprobs, batch: TrajectoryBatch, *, advantages=None,
                                     credit: str = "tree_credit",
                                     behavior: str = "old_logprobs", beta: float = 1.0,
                                     delta: float = 1.0, agg: str = "token_mean",
                                     agg_constant=None, axis_name=None):
    """TreeOPSD tree-aware posterior self-distillation.

    This is our reading of the TreeOPSD paper's abstract, which describes the loss in words.

    Turn credit c_k = V(child) - V(node) from tree Monte-Carlo backups (pass a tree
    estimator's ``advantages=`` or give extras[``credit``] as [N, K] / [N] / [R, T]); the
    teacher pi*(y) ∝ pi_b(y) exp(l*) with the bounded target l* = clip(c / beta, -delta,
    delta) relative to the frozen behaviour policy pi_b (``behavior``):

        loss_t = (lp_S - lp_b - l*_{k(t)})^2 / 2.

    At pi_theta = pi_b the gradient is -l* d lp, the PG direction with advantage l*; it
    vanishes once the ratio reaches the target (no overshoot across mini-batches).

    Args:
      logprobs: [R, T] lp_S (the only input that carries gradient).
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``turn_ids``, ``row_traj`` [R, T],
        ``turn_mask`` [N, K], ``traj_mask`` [N], ``behavior`` [R, T] and, without
        ``advantages=``, extras[``credit``].
      advantages: optional credit c: an [R, T] array or ``Advantages`` (its ``token``);
        stop-gradient.
      credit: extras field of c ([N, K], [N] or [R, T]) when ``advantages`` is None.
      behavior: field of lp_b [R, T] (default ``batch.old_logprobs``).
      beta: > 0, temperature of the target (c / beta).
      delta: > 0, bound of the target log-ratio.
      agg, agg_constant, axis_name: the aggregation (module docstring).

    Returns:
      ``(sum, denominator)`` of the per-token loss (module docstring).
    """
    check_mode(agg)
    check_positive("beta", beta)
    check_positive("delta", delta)
    b = segments.local_view(batch, axis_name)
    lp = _student(logprobs, b, "treeopsd")
    lb = token_field(b, behavior, "treeopsd", stop_gradient=True)
    target = sg(treeopsd_target(_advantage_tokens(b, advantages, credit, "treeopsd"),
                                beta=beta, delta=delta))
    return _finish(0.5 * jnp.square(lp - lb - target), batch, agg, agg_constant, axis_name)


# ============================================================================= T-REG


def t_reg_weights(batch: TrajectoryBatch, r, s, temperature):
    """w_t = n_i softmax_{t in i}(s_i r_t / temperature) over trajectory i's action tokens
    (token mean 1 per trajectory). ``batch`` block-local; r [R, T], s per token [R, T]."""
    m = batch.action_mask
    n = batch.num_traj
    x = jnp.where(m, s * r / temperature, -jnp.inf)
    top = jax.ops.segment_max(x.max(axis=1), batch.row_traj, n)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(m, jnp.exp(jnp.where(m, x - top[batch.row_traj][:, None], 0.0)), 0.0)
    z = jax.ops.segment_sum(e.sum(axis=1), batch.row_traj, n)
    cnt = segments.traj_token_counts(batch)
    scale = cnt / jnp.where(z > 0, z, 1.0)
    return jnp.where(m, e * scale[batch.row_traj][:, None], 0.0)


@register("t_reg", kind="loss")
def token_reward_regularizer(logprobs, batch: TrajectoryBatch, *,
                             good: str = "teacher_logprobs", bad: str = "contrast_logprobs",
                             reference="ref_logprobs", sign: str = "outcome",
                             temperature: float = 1.0, agg: str = "token_mean",
                             agg_constant=None, axis_name=None):
    """T-REG token-level reward regulariser.

    This is our reading of the paper, which describes it in words (Zhou et al. 2025, "T-REG:
    Preference Optimization with Token-Level Reward Regularization", arXiv 2412.02685):

        r_t = lp(y_t | x, good instruction) - lp(y_t | x, bad instruction)   (self-generated)
        w_t = n_i softmax_{t in i}(s_i r_t / temperature)                     (mean 1 per i)
        loss_t = -s_i w_t (lp_S - lp_ref)

    s_i = sign of extras[``sign``] (default the outcome: +1 chosen / -1 rejected, 0 = no
    regularisation; 0/1 outcomes therefore regularise only the chosen responses: give a
    +-1 field for both sides). The implicit DPO token reward lp_S - lp_ref is pushed up on
    the chosen response's tokens, and down on the rejected one's, in proportion to the
    self-generated token rewards, so the sequence-level reward is distributed consistently
    with them.
    ``reference=None``: lp_ref = 0 (the gradient is the same). Uniform r gives w = 1.

    Args:
      logprobs: [R, T] lp_S (the only input that carries gradient).
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``turn_ids``, ``row_traj`` [R, T],
        ``turn_mask`` [N, K], ``traj_mask`` [N], extras[``good``], extras[``bad``],
        extras[``reference``] [R, T] and ``sign``.
      good: extras field of lp(y_t | x, good instruction) [R, T].
      bad: extras field of lp(y_t | x, bad instruction) [R, T].
      reference: extras field of lp_ref [R, T], or None (lp_ref = 0).
      sign: field whose sign is s_i: ``"outcome"`` (``batch.outcome``) or an extras field
        ([N], [N, K] or [R, T]).
      temperature: > 0, of the token-weight softmax.
      agg, agg_constant, axis_name: the aggregation (module docstring).

    Returns:
      ``(sum, denominator)`` of the per-token loss (module docstring).
    """
    check_mode(agg)
    check_positive("temperature", temperature)
    b = segments.local_view(batch, axis_name)
    lp = _student(logprobs, b, "t_reg")
    r = (token_field(b, good, "t_reg", stop_gradient=True)
         - token_field(b, bad, "t_reg", stop_gradient=True))
    ref = 0.0 if reference is None else token_field(b, reference, "t_reg", stop_gradient=True)
    s = jnp.sign(sg(spread_field(b, sign, "t_reg", "preference sign")))
    w = sg(t_reg_weights(b, r, s, temperature))
    return _finish(-s * w * (lp - ref), batch, agg, agg_constant, axis_name)


# ============================================================================= weighted SFT


@register("weighted_sft", kind="loss")
def weighted_sft(logprobs, batch: TrajectoryBatch, *, weights=None, mask=None,
                 agg: str = "token_mean", agg_constant=None, axis_name=None):
    """Weighted SFT on the sampled tokens (ASPO / InT / ABC-SFT, as their papers describe them).

        loss_t = -w_t lp_S(y_t)   over the tokens of ``mask`` (default all action tokens)

    * InT (intervention training): ``mask`` = extras field of the intervention tokens
      (optionally the prefix too); aggregated over the masked tokens only.
    * ABC-SFT: ``weights`` = extras field of the clue-anchored step score s_k per turn [N, K]
      (or per trajectory [N] / per token [R, T]); stop-gradient.
    * ASPO's feedback self-distillation is the SDAR loss: use ``sdar`` with the annotated
      teacher's log-probs.

    Args:
      logprobs: [R, T] lp_S (the only input that carries gradient).
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``turn_ids``, ``row_traj`` [R, T],
        ``turn_mask`` [N, K], ``traj_mask`` [N] and the optional fields below.
      weights: optional extras field of w ([R, T], [N, K] or [N]; stop-gradient); None = 1.
      mask: optional extras field of a token mask [R, T] (bool, or > 0.5); None = every
        action token.
      agg, agg_constant, axis_name: the aggregation (module docstring).

    Returns:
      ``(sum, denominator)`` of the per-token loss over the action tokens of ``mask`` only
      (module docstring).
    """
    check_mode(agg)
    b = segments.local_view(batch, axis_name)
    lp = _student(logprobs, b, "weighted_sft")
    on = token_mask(b, mask, "weighted_sft", "SFT token mask")
    per_token = -lp
    if weights is not None:
        per_token = sg(spread_field(b, weights, "weighted_sft", "SFT weight")) * per_token
    return _finish(per_token, batch, agg, agg_constant, axis_name, mask=on)


# ============================================================================= top-k forward KL


def topk_forward_kl_tokens(ls, lt):
    """Per-token sum_k p_T,k (lt_k - ls_k) over the last axis (``ls``, ``lt`` [..., K]), with
    p_T,k = exp(lt_k); an entry whose teacher log-prob is not finite (-inf: probability 0)
    adds 0 and no gradient."""
    ok = jnp.isfinite(lt)
    lt = jnp.where(ok, lt, 0.0)
    return jnp.sum(jnp.where(ok, jnp.exp(lt) * (lt - ls), 0.0), axis=-1)


@register("topk_kl", kind="loss")
def topk_forward_kl(logprobs, batch: TrajectoryBatch, *, student_topk_logprobs=None,
                    teacher: str = "teacher_topk_logprobs", agg: str = "token_mean",
                    agg_constant=None, axis_name=None):
    """On-policy distillation over the teacher's K most likely tokens: the forward KL from the
    teacher to the student at every action position the student visited, restricted to the
    teacher's top K.

        loss_t = sum_{k=1..K} p_T(v_k | s_t) (log p_T(v_k | s_t) - log p_S(v_k | s_t))

    with v_1..v_K the teacher's K most likely next tokens at position t (``teacher.top_k`` in
    a run), p_T their teacher probabilities and log p_S the student's current log-probs of the
    same ids, both of the tempered distribution the rollouts sampled from (before any top-k /
    top-p truncation). Its gradient, -sum_k p_T(v_k) grad log p_S(v_k), is a cross-entropy
    toward the teacher's whole next-token distribution (its top K) at each visited state, not
    one sampled token's log ratio (``opd``, ``sdl``): every position moves the student toward
    every likely teacher token at once. With K = V this is KL(p_T || p_S) at every action token
    (the forward KL of on-policy distillation over the whole vocabulary); with K < V the
    teacher's remaining mass (1 - sum_k p_T(v_k)) is left out, so the value may be negative
    when the student puts more mass than the teacher on the top K. 0 when the student equals
    the teacher; its gradient w.r.t. the student's logits is then 0 with K = V, while with
    K < V it still moves the student's mass outside the teacher's top K onto it (the tail is
    not compared). ``logprobs`` (the sampled tokens') is not read.

    In a run: ``teacher.source`` and ``teacher.top_k: K`` make the step compute the teacher's
    top K ids and log-probs (extras ``teacher_topk_logprobs`` [R, T, K]) and pass the
    student's log-probs of those ids here as ``student_topk_logprobs``.

    Args:
      logprobs: [R, T] lp_S of the sampled tokens (not read; the losses' common contract).
      batch: a ``TrajectoryBatch``; reads ``action_mask``, ``row_traj`` [R, T] and
        extras[``teacher``] [R, T, K].
      student_topk_logprobs: [R, T, K] the student's log-probs of the teacher's top-K ids
        (the only input that carries gradient).
      teacher: extras field of the teacher's top-K log-probs [R, T, K] (stop-gradient).
      agg, agg_constant, axis_name: the aggregation (module docstring).

    Returns:
      ``(sum, denominator)`` of the per-token loss (module docstring).
    """
    check_mode(agg)
    b = segments.local_view(batch, axis_name)
    lt = require(b, teacher, "topk_kl", "the teacher's top-K log-probs [R, T, K]")
    if student_topk_logprobs is None:
        raise ValueError("topk_kl: student_topk_logprobs (the student's log-probs of the "
                         "teacher's top-K ids [R, T, K]) must be given; in a run the step "
                         "passes them when teacher.top_k > 0")
    shape = tuple(b.action_mask.shape)
    if jnp.ndim(lt) != 3 or tuple(jnp.shape(lt))[:2] != shape:
        raise shape_error("topk_kl", f"extras['{teacher}']", "[R, T, K]", shape + ("K",),
                          jnp.shape(lt))
    if tuple(jnp.shape(student_topk_logprobs)) != tuple(jnp.shape(lt)):
        raise shape_error("topk_kl", "student_topk_logprobs", "[R, T, K]",
                          tuple(jnp.shape(lt)), jnp.shape(student_topk_logprobs))
    m = b.action_mask[..., None]
    ls = jnp.where(m, jnp.asarray(student_topk_logprobs, jnp.float32), 0.0)
    lt = sg(jnp.where(m, jnp.asarray(lt, jnp.float32), 0.0))
    return _finish(topk_forward_kl_tokens(ls, lt), batch, agg, agg_constant, axis_name)
