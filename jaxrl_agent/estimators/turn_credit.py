"""Per-turn credit transforms: a dense per-turn term added to a base estimator's advantage, or
a per-turn factor applied to it.

Each is a *transform* ``f(adv, batch, *, ..., axis_name=None) -> Advantages`` (see
``jaxrl_agent.registry``; the registered names, used in configs, in parentheses):
A'[i, k] = A[i, k] + w d[i, k] or A[i, k] f[i, k], from a per-turn signal the batch carries
(judge scores, potentials, progress, verifier verdicts, gold log-probs): ``trace``, ``spae``,
``efca``, ``vtca``, ``procredit``, ``a2tgpo``, ``cast``, ``oprl``, ``step_gain``, ``ups``,
``capo``. The dense rewards that go *before* an estimator (PBRS and its relatives) are in
``shaping``; the re-allocations of a fixed advantage mass in ``allocation``.

Every transform takes ``adv``, the base ``Advantages`` (``token`` [R, T], ``turn`` [N, K] or
None), and ``axis_name``, the mesh axis of a sharded batch (or None), and returns ``adv`` with
``token`` [R, T] and ``turn`` [N, K] replaced (value targets pass through).

Shapes: N trajectories, K turns, R token rows of length T (see ``jaxrl_agent.batch``).
Potentials and progress follow the PBRS layout of ``shaping``: ``extras['potential']`` [N, K]
is Phi(s_k) before action k and ``extras['final_potential']`` [N] Phi after the last turn
(``primitives.potential_terms``). Every signal read from the batch is wrapped in
``jax.lax.stop_gradient``; outputs are 0 outside ``action_mask`` / valid turns. Group and
cohort statistics are local (groups are whole per shard); batch-wide statistics (CAST's RMS,
``normalization="batch"``) psum over ``axis_name``.

Sources: each docstring names its paper. Where a method is pinned to the authors' public
code, the repository and file are named. Where the paper describes a step only in words, the
docstring says that the formula is our reading of it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import (check_choice, check_nonneg, check_positive, check_unit,
                                require, token_field, traj_field, turn_field)
from jaxrl_agent.estimators.primitives import (NORMS, apply_token_weights, normalize_turns,
                                               potential_terms, token_weights)
from jaxrl_agent.registry import register

F32 = jnp.float32


def _base_turn(adv: Advantages, b):
    turn = adv.turn if adv.turn is not None else segments.token_to_turn(adv.token, b, "mean")
    return jnp.where(segments.valid_turns(b), turn, 0.0)


def add_turn_term(adv: Advantages, b, term) -> Advantages:
    """A'_t = A_t + term[k(t)] on action tokens, A'_turn = A_turn + term (returns kept)."""
    valid = segments.valid_turns(b)
    term = jnp.where(valid, term, 0.0).astype(F32)
    tok = jnp.where(b.action_mask, adv.token + segments.turn_to_token(term, b), 0.0)
    return adv.replace(token=tok.astype(F32),
                       turn=jnp.where(valid, _base_turn(adv, b) + term, 0.0).astype(F32))


def _scale_turns(adv: Advantages, b, factor, term=None) -> Advantages:
    """A'_t = A_t factor[k(t)] (+ term[k(t)]); factor 1 and term 0 leave A bit-identical."""
    valid = segments.valid_turns(b)
    f_tok = segments.turn_to_token(factor, b)
    tok = jnp.where(f_tok == 1.0, adv.token, adv.token * f_tok)
    turn = _base_turn(adv, b)
    turn = jnp.where(factor == 1.0, turn, turn * factor)
    if term is not None:
        term = jnp.where(valid, term, 0.0)
        tok = tok + segments.turn_to_token(term, b)
        turn = turn + term
    return adv.replace(token=jnp.where(b.action_mask, tok, 0.0).astype(F32),
                       turn=jnp.where(valid, turn, 0.0).astype(F32))


def _check_norm(by):
    check_choice("normalization", by, NORMS)


# ----------------------------------------------------------------------------- TRACE


def trace_rewards(batch: TrajectoryBatch, *, potential: str = "potential",
                  final_potential: str = "final_potential", length: str | None = None,
                  axis_name=None):
    """TRACE's log-ratio TD rewards [N, K]: r_k = lp_gold[k+1] - lp_gold[k] (our reading of
    the paper, which describes the step in words).

    lp_gold[k] = log p_ref(gold answer | x, h_{<k}) is ``extras[potential]`` [N, K] (the
    state before action k; k = 0 is the prompt alone) and lp_gold[K_i] is
    ``extras[final_potential]`` [N] (required). V_k = lp_gold[k] - lp_gold[0], so
    sum_k r_k = lp_gold[K_i] - lp_gold[0] (telescoping) and a constant shift of a trajectory's
    lp_gold leaves r unchanged. ``length`` names an [N] field (the gold answer's token
    count) for the per-token-normalised variant (lp_gold / length).
    """
    b = segments.local_view(batch, axis_name)
    r = potential_terms(b, potential, final_potential, 1.0, True, "trace")
    if length is not None:
        n = traj_field(b, length, "trace", "gold answer length in tokens, [N]", stop_gradient=True)
        r = r / jnp.maximum(n, 1.0)[:, None]
    return r


@register("trace", kind="transform", renamed={"normalize": "normalization"})
def gold_logprob_turn_credit(adv: Advantages, batch: TrajectoryBatch, *,
                             potential: str = "potential",
                             final_potential: str = "final_potential", beta: float = 0.5,
                             normalization: str = "cohort", accumulate: bool = False,
                             length: str | None = None, eps: float = 1e-6,
                             axis_name=None) -> Advantages:
    """TRACE: Turn-level Reward Assignment via Credit Estimation (log-ratio TD credit).

    This is our reading of the paper, which describes the step in words:
    A'[i, k] = A[i, k] + beta z(r)[i, k] with r = ``trace_rewards`` (a frozen reference
    model's gold-answer log-prob at each tool-call boundary, consumed as arrays) and z the
    ``normalization`` z-score of ``normalize_turns`` (``"cohort"``: same group and turn index;
    ``"group"``: pooled over the group's turns; ``"none"``: raw r). ``accumulate=True``
    adds the turn reward-to-go of z(r), sum_{j >= k} z(r)_j, instead. No critic, no labels;
    a redundant tool call (unchanged evidence) gives r = 0. Compose with ``grpo``.

    Args:
      batch: reads ``extras[potential]`` [N, K] (lp_gold before action k),
        ``extras[final_potential]`` [N] (required) and, with ``length``, ``extras[length]``
        [N]; ``group_ids`` [N] and ``state_keys`` [N, K] for the peer sets.
      potential: extras name of lp_gold[k], [N, K].
      final_potential: extras name of lp_gold after the last turn, [N].
      beta: >= 0, weight of the term.
      normalization: peer set of the z-score: ``"cohort"``, ``"group"``, ``"state"``,
        ``"batch"`` or ``"none"`` (see ``normalize_turns``).
      accumulate: use the reward-to-go of z(r) instead of z(r).
      length: optional extras name of the gold answer's token count [N] (lp_gold / length).
      eps: > 0, added to the std.
      axis_name: mesh axis; ``normalization="batch"`` reduces over it.

    ``adv`` and the result (A + the term): see the module docstring.
    """
    check_nonneg("beta", beta)
    _check_norm(normalization)
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    r = trace_rewards(b, potential=potential, final_potential=final_potential, length=length)
    z = normalize_turns(r, b, by=normalization, eps=eps, axis_name=axis_name)
    if accumulate:
        z = segments.reverse_scan(z, 1.0, axis=1)
    return add_turn_term(adv, b, beta * z)


# ----------------------------------------------------------------------------- SPAE


def spae_potential(acc, conf):
    """SPAE's step potential Phi = 1.5 acc conf + 0.5 acc - conf (public code cii030/SPAE-RL
    ``inference/probe_mechanism_example.py``); in [-1, 1] for acc, conf in [0, 1], -1 when
    confident and wrong. ``acc``/``conf``: the probe's averaged ground-truth probability and
    confidence exp(-entropy) after the step."""
    acc = jnp.asarray(acc, F32)
    conf = jnp.asarray(conf, F32)
    return 1.5 * acc * conf + 0.5 * acc - conf


@register("spae", kind="transform")
def step_potential_advantage(adv: Advantages, batch: TrajectoryBatch, *,
                             potential: str | None = "step_potential", acc: str = "acc",
                             conf: str = "conf", alpha: float = 0.1, c_sat: float = 1.0,
                             saturation: float = 0.9, axis_name=None) -> Advantages:
    """SPAE: Step Potential Advantage Estimation.

    The potential is pinned to the public code (``spae_potential``); the advantage is our
    reading of the paper, which describes the step in words:
    Phi_k = the probe potential measured *after* step k: ``extras[potential]`` [N, K], or
    with ``potential=None`` ``spae_potential(extras[acc], extras[conf])``.
    DeltaPhi_k = Phi_k - Phi_{k-1} (0 for the first step); saturation: the first step with
    Phi_k > ``saturation`` reaches the solution and every later step gets s = ``c_sat``
    (s = 1 up to and including it). A'_t = A_t s(k(t)) + alpha DeltaPhi_{k(t)}: potential
    gains amplified, drops penalised, post-saturation checking damped. alpha = 0 and
    c_sat = 1 give the base exactly (reduction to the base estimator).

    Args:
      batch: reads ``extras[potential]`` [N, K], or ``extras[acc]`` and ``extras[conf]``
        [N, K] (in [0, 1]) with ``potential=None``.
      potential: extras name of Phi after step k, [N, K]; None computes it from acc, conf.
      acc: extras name of the probe's ground-truth probability after step k, [N, K].
      conf: extras name of the probe's confidence exp(-entropy) after step k, [N, K].
      alpha: >= 0, weight of the potential difference.
      c_sat: factor on the advantage of steps after saturation.
      saturation: potential threshold that marks the solution reached.

    ``adv``, ``axis_name`` and the result: see the module docstring.
    """
    check_nonneg("alpha", alpha)
    b = segments.local_view(batch, axis_name)
    valid = segments.valid_turns(b)
    if potential is None:
        phi = spae_potential(turn_field(b, acc, "spae", "probe accuracy after step k, [N, K]",
                                        stop_gradient=True),
                             turn_field(b, conf, "spae", "probe confidence after step k, "
                                                         "[N, K]", stop_gradient=True))
    else:
        phi = turn_field(b, potential, "spae", "probe potential Phi after step k, [N, K]",
                         stop_gradient=True)
    phi = jnp.where(valid, phi, 0.0)
    prev = jnp.concatenate([phi[:, :1], phi[:, :-1]], axis=1)
    dphi = jnp.where(valid, phi - prev, 0.0)
    sat = (valid & (phi > saturation)).astype(jnp.int32)
    before = jnp.cumsum(sat, axis=1) - sat  # saturated steps strictly before k
    s = jnp.where(valid & (before > 0), jnp.float32(c_sat), 1.0)
    return _scale_turns(adv, b, s, None if alpha == 0 else alpha * dphi)


# ----------------------------------------------------------------------------- EFCA


def efca_weights(batch: TrajectoryBatch, *, feedback: str = "feedback", fb_coef: float = 0.5,
                 loop_coef: float = 0.5, window: int = 3, w_min: float = 0.0,
                 w_max: float = 2.0, axis_name=None):
    """EFCA's per-turn return weights [N, K] (our reading of the paper, which describes the
    step in words).

    h_k = 1[(state_key_k, action_key_k) occurred at one of the last ``window`` turns
    k - window .. k - 1, i.e. W turns; an open window (k-W, k) would be one shorter]
    + 1[state_key_{k+1} == state_key_k] (no state change; 0 on the last
    turn); w_k = clip(1 + fb_coef fb_k - loop_coef h_k, w_min, w_max) with fb =
    ``extras[feedback]`` in {-1, 0, 1} (parsed environment feedback). 0 off valid turns.
    """
    b = segments.local_view(batch, axis_name)
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    if w_min < 0 or w_max < w_min:
        raise ValueError(f"need 0 <= w_min <= w_max, got w_min={w_min}, w_max={w_max}")
    valid = segments.valid_turns(b)
    fb = turn_field(b, feedback, "efca", "environment feedback in {-1, 0, 1}, [N, K]",
                    stop_gradient=True)
    s, a = b.state_keys, b.action_keys
    k = b.num_turns
    rep = jnp.zeros(valid.shape, bool)
    for d in range(1, min(window, k - 1) + 1):
        s_back = jnp.pad(s, ((0, 0), (d, 0)))[:, :k]
        a_back = jnp.pad(a, ((0, 0), (d, 0)))[:, :k]
        ok_back = jnp.pad(valid, ((0, 0), (d, 0)))[:, :k]
        rep = rep | (ok_back & (s_back == s) & (a_back == a))
    stall = segments.next_turn(valid, False) & (segments.next_turn(s) == s)
    h = rep.astype(F32) + stall.astype(F32)
    w = jnp.clip(1.0 + fb_coef * fb - loop_coef * h, w_min, w_max)
    return jnp.where(valid, w, 0.0)


@register("efca", kind="transform", renamed={"renormalize": "normalize"})
def feedback_weighted_advantage(adv: Advantages, batch: TrajectoryBatch, *,
                                feedback: str = "feedback", fb_coef: float = 0.5,
                                loop_coef: float = 0.5, window: int = 3, w_min: float = 0.0,
                                w_max: float = 2.0, normalize: bool = False,
                                axis_name=None) -> Advantages:
    """EFCA: Environmental-Feedback Credit Assignment, multi-timescale.

    This is our reading of the paper, which describes the step in words:
    return reweighting applied to the base advantage, A'[i, k] = w_k A[i, k] with w from
    ``efca_weights`` (short-term feedback and medium-term loop/stall signals). For a
    trajectory-level base A_i = A(R_i) this is the advantage of the reweighted return
    w_k G_k up to the baseline. ``normalize=True`` rescales w to token mean 1 per
    trajectory first (``primitives.token_weights``): an allocation, so mass conservation and
    sign preservation hold.
    fb_coef = loop_coef = 0 gives the base exactly (reduction to the base estimator) when w_min
    <= 1 <= w_max.

    Args:
      batch: reads ``extras[feedback]`` [N, K] in {-1, 0, 1}, ``state_keys`` and
        ``action_keys`` [N, K].
      feedback: extras name of the parsed environment feedback, [N, K].
      fb_coef: weight of the feedback term.
      loop_coef: weight of the repeat/stall penalty.
      window: int >= 0, how many earlier turns a repeated (state, action) is looked for in.
      w_min: lower clip of w, >= 0.
      w_max: upper clip of w, >= w_min.
      normalize: rescale w to token mean 1 per trajectory.

    ``adv``, ``axis_name`` and the result (A reweighted): see the module docstring.
    """
    b = segments.local_view(batch, axis_name)
    w = efca_weights(b, feedback=feedback, fb_coef=fb_coef, loop_coef=loop_coef, window=window,
                     w_min=w_min, w_max=w_max)
    if normalize:
        return apply_token_weights(adv, token_weights(w, b), b)
    return _scale_turns(adv, b, jnp.where(segments.valid_turns(b), w, 1.0))


# ----------------------------------------------------------------------------- VTCA


def vtca_credit(batch: TrajectoryBatch, *, progress: str = "progress",
                final_progress: str = "final_progress", edges: str = "edges",
                rho: float = 0.3, axis_name=None):
    """VTCA's per-turn credit c [N, K] (WorkRover; our reading of the paper, which describes
    the step in words).

    Delta_k = p_{k+1} - p_k (``progress`` before action k, ``final_progress`` = p_{K_i},
    required). Prerequisite edges ``extras[edges]`` [N, E, 3] (src, dst, type): src is a
    prerequisite of dst (dst used src's artifact); rows of -1, self-loops and duplicate
    (src, dst) pairs are ignored. With P(j) the prerequisites of j:
      c_k = (1 - rho 1[Delta_k > 0, P(k) != {}]) Delta_k
            + sum_{j: k in P(j), Delta_j > 0} rho Delta_j / |P(j)|.
    Conservation: sum_k c_k = p_K - p_0; the passed share is at most rho; negative progress
    is never passed on; no edges gives c = Delta.
    """
    check_unit("rho", rho)
    b = segments.local_view(batch, axis_name)
    delta = potential_terms(b, progress, final_progress, 1.0, True, "vtca")
    e = require(b, edges, "vtca", "prerequisite edges [N, E, 3] (src_turn, dst_turn, type)")
    if e.ndim != 3 or e.shape[0] != b.num_traj or e.shape[2] < 2:
        raise ValueError(f"vtca: extras['{edges}'] must be [N, E, 3], got {e.shape}")
    k = b.num_turns
    valid = segments.valid_turns(b)
    src, dst = e[..., 0].astype(jnp.int32), e[..., 1].astype(jnp.int32)
    ok_idx = (src >= 0) & (dst >= 0) & (src < k) & (dst < k) & (src != dst)
    sc, dc = jnp.clip(src, 0, k - 1), jnp.clip(dst, 0, k - 1)
    rows = jnp.arange(b.num_traj)[:, None]
    real = ok_idx & valid[rows, sc] & valid[rows, dc]
    n_e = e.shape[1]
    earlier = jnp.tril(jnp.ones((n_e, n_e), bool), -1)  # [e, e'] e' < e
    same = (src[:, :, None] == src[:, None, :]) & (dst[:, :, None] == dst[:, None, :])
    dup = jnp.any(same & earlier[None] & real[:, None, :], axis=2)
    real = real & ~dup
    turns = jnp.arange(k)
    dst_hot = (dc[..., None] == turns) & real[..., None]  # [N, E, K]
    src_hot = (sc[..., None] == turns) & real[..., None]
    n_pre = jnp.sum(dst_hot, axis=1).astype(F32)  # [N, K]
    give = jnp.where((delta > 0) & (n_pre > 0), rho * delta, 0.0)
    per_edge = jnp.take_along_axis(give / jnp.maximum(n_pre, 1.0), dc, axis=1)  # [N, E]
    received = jnp.sum(src_hot * jnp.where(real, per_edge, 0.0)[..., None], axis=1)
    return jnp.where(valid, delta - give + received, 0.0)


@register("vtca", kind="transform", renamed={"normalize": "normalization"})
def prerequisite_progress_credit(adv: Advantages, batch: TrajectoryBatch, *,
                                 progress: str = "progress",
                                 final_progress: str = "final_progress", edges: str = "edges",
                                 rho: float = 0.3, eta: float = 1.0, normalization: str = "none",
                                 eps: float = 1e-6, axis_name=None) -> Advantages:
    """VTCA: Verifier-to-Turn Credit Assignment (WorkRover).

    This is our reading of the paper, which describes the step in words:
    A'[i, k] = A[i, k] + eta c~_k with c = ``vtca_credit`` (deterministic workspace-progress
    checks after every turn, a bounded share rho of positive progress passed to prerequisite
    turns) and c~ = ``normalize_turns(c, by=normalization)`` (default ``"none"``: c itself;
    ``"cohort"`` for the cohort-normalised option). eta = 0 gives the base (reduction to the
    base estimator).

    Args:
      batch: reads ``extras[progress]`` [N, K] (p_k before action k),
        ``extras[final_progress]`` [N] (required) and ``extras[edges]`` [N, E, 3]
        (src turn, dst turn, type; rows of -1 are padding).
      progress: extras name of p_k, [N, K].
      final_progress: extras name of p_{K_i}, [N].
      edges: extras name of the prerequisite edges, [N, E, 3].
      rho: share of positive progress passed to prerequisites, in [0, 1].
      eta: weight of the term.
      normalization: peer set of the z-score of c (see ``normalize_turns``); ``"none"`` keeps c.
      eps: > 0, added to the std.
      axis_name: mesh axis; ``normalization="batch"`` reduces over it.

    ``adv`` and the result (A + the term): see the module docstring.
    """
    _check_norm(normalization)
    check_positive("eps", eps)
    check_unit("rho", rho)
    b = segments.local_view(batch, axis_name)
    c = vtca_credit(b, progress=progress, final_progress=final_progress, edges=edges, rho=rho)
    c = normalize_turns(c, b, by=normalization, eps=eps, axis_name=axis_name)
    return add_turn_term(adv, b, eta * c)


# ----------------------------------------------------------------------------- ProCredit


@register("procredit", kind="transform", renamed={"scale_std": "normalize"})
def remaining_progress_credit(adv: Advantages, batch: TrajectoryBatch, *,
                              progress: str = "progress",
                              final_progress: str = "final_progress", weight: float = 1.0,
                              cohort: str = "cohort", normalize: bool = True,
                              eps: float = 1e-6, axis_name=None) -> Advantages:
    """ProCredit: progress rewards across attempts and turns.

    This is our reading of the paper, which describes the step in words:
    r_k = p_{k+1} - p_k (acceptance checks re-run after every turn); G_k = sum_{j >= k} r_j =
    p_K - p_k; A'[i, k] = A[i, k] + weight (G_k - mean_S G) / (std_S G + eps) with S the
    ``cohort`` peers (unbiased std, singleton 0). Flat progress gives a zero turn term;
    all-failed groups still get signal through progress.

    Args:
      batch: reads ``extras[progress]`` [N, K] (p_k before action k) and
        ``extras[final_progress]`` [N] (required); ``group_ids`` [N], ``state_keys`` [N, K].
      progress: extras name of p_k, [N, K].
      final_progress: extras name of p_{K_i}, [N].
      weight: weight of the term (0 gives the base).
      cohort: peer set: ``"cohort"`` (attempts of the same task at the same turn index) or
        ``"state"`` (same task group and state key, as GiGPO's anchor).
      normalize: divide by the peer std + eps (False: centre only).
      eps: > 0, added to the std.

    ``adv``, ``axis_name`` and the result (A + the term): see the module docstring.
    """
    check_choice("cohort", cohort, ("cohort", "state"))
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    p = turn_field(b, progress, "procredit", "progress p_k before action k, [N, K]",
                   stop_gradient=True)
    fin = traj_field(b, final_progress, "procredit", "final progress p_K, [N]", stop_gradient=True)
    g = jnp.where(segments.valid_turns(b), fin[:, None] - p, 0.0)
    term = normalize_turns(g, b, by=cohort, scale_std=normalize, eps=eps)
    return add_turn_term(adv, b, weight * term)


# ----------------------------------------------------------------------------- A2TGPO


def variance_rescaled_returns(x, valid, gamma=1.0):
    """A[i, k] = sum_{j >= k} gamma^{j-k} x_j / sqrt(sum_{j >= k} gamma^{2(j-k)}) over the
    valid turns (A2TGPO's variance-rescaled accumulation): unit variance at every depth when
    the x are i.i.d. with unit variance. 0 off valid turns."""
    valid = jnp.asarray(valid, bool)
    num = segments.reverse_scan(jnp.where(valid, x, 0.0), gamma, axis=1, where=valid)
    den = segments.reverse_scan(valid.astype(F32), gamma * gamma, axis=1, where=valid)
    return jnp.where(valid, num * lax.rsqrt(jnp.where(valid, den, 1.0)), 0.0)


def _a2tgpo_ig(b, potential, final_potential, eps):
    ig = potential_terms(b, potential, final_potential, 1.0, True, "a2tgpo")
    return normalize_turns(ig, b, by="cohort", eps=eps)


@register("a2tgpo", kind="transform")
def rescaled_info_gain_credit(adv: Advantages, batch: TrajectoryBatch, *,
                              potential: str = "potential",
                              final_potential: str = "final_potential", gamma: float = 1.0,
                              weight: float = 1.0, eps: float = 1e-6,
                              axis_name=None) -> Advantages:
    """A2TGPO: Agentic Turn-Group Policy Optimization.

    As the paper describes it; its constants are our choice.
    IG_k = log pi(gt | h_k) - log pi(gt | h_{k-1}): the policy's own gold-answer log-prob at
    each state; (i) IG~ = (IG - mean_(g,k)) / (std_(g,k) + eps) over the same task and turn
    index (unbiased std, singleton 0); (ii) A_IG = ``variance_rescaled_returns(IG~, gamma)``;
    A' = A + weight A_IG. The adaptive clip range (iii) is ``a2tgpo_clip_range``, consumed by
    ``losses.policy.ppo(clip_low=, clip_high=)``.

    Args:
      batch: reads ``extras[potential]`` [N, K] (log pi(gt | h) before action k) and
        ``extras[final_potential]`` [N] (after the last turn, required); ``group_ids`` [N].
      potential: extras name of the gold-answer log-prob before action k, [N, K].
      final_potential: extras name of the gold-answer log-prob after the last turn, [N].
      gamma: discount of the rescaled accumulation, in [0, 1].
      weight: weight of the term (0 gives the base).
      eps: > 0, added to the std.

    ``adv``, ``axis_name`` and the result (A + the term): see the module docstring.
    """
    check_unit("gamma", gamma)
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    ign = _a2tgpo_ig(b, potential, final_potential, eps)
    valid = segments.valid_turns(b)
    return add_turn_term(adv, b, weight * variance_rescaled_returns(ign, valid, gamma))


def a2tgpo_clip_range(batch: TrajectoryBatch, *, potential: str = "potential",
                      final_potential: str = "final_potential", eps0: float = 0.2,
                      kappa: float = 0.5, eps_min: float = 0.1, eps_max: float = 0.3,
                      eps: float = 1e-6, axis_name=None):
    """A2TGPO's adaptive turn-level clip range [R, T] (step iii of the method; the constants
    are our choice).

    eps_k = clip(eps0 (1 + kappa tanh(IG~_k)), eps_min, eps_max), broadcast onto turn k's
    action tokens (0 elsewhere): informative turns get a wider trust region. Monotone in
    IG~ and bounded. Pass it as ``ppo(..., clip_low=c, clip_high=c)``.
    """
    check_nonneg("kappa", kappa)
    if not 0 <= eps_min <= eps_max:
        raise ValueError(f"need 0 <= eps_min <= eps_max, got eps_min={eps_min}, "
                         f"eps_max={eps_max}")
    check_positive("eps0", eps0)
    b = segments.local_view(batch, axis_name)
    ign = _a2tgpo_ig(b, potential, final_potential, eps)
    e = jnp.clip(eps0 * (1.0 + kappa * jnp.tanh(ign)), eps_min, eps_max)
    return segments.turn_to_token(jnp.where(segments.valid_turns(b), e, 0.0), b)


# ----------------------------------------------------------------------------- CAST


def _odd_transform(a, transform):
    if transform == "asinh":
        return jnp.arcsinh(a)
    if transform == "signed_log":
        return jnp.sign(a) * jnp.log1p(jnp.abs(a))
    return a


@register("cast", kind="transform",
          renamed={"normalize": "normalization", "norm": "normalization"})
def solver_oracle_credit(adv: Advantages, batch: TrajectoryBatch, *,
                         oracle: str = "oracle_advantage", alpha: float = 0.3,
                         transform: str = "asinh", normalization: str = "rms", eps: float = 1e-8,
                         axis_name=None) -> Advantages:
    """CAST: credit from solver teachers. Pinned to the public code Wloner0809/CAST
    ``rllm/trainer/verl/oracle_advantage_mapping.py`` (``mapping_cast``, ``_ablate``).

    a_k = the solver's per-turn oracle advantage (Sokoban: N(s_k) - N(s_{k+1});
    Minesweeper: +-K(s_t)). g = asinh(a) (or the chosen ``transform``); RMS = sqrt(mean of
    g^2 over every valid turn of the batch, zeros included; psum over ``axis_name``);
    A'[i, k] = A_i + alpha g / (RMS + eps) (``normalization="none"``: alpha g). The reference
    base is GRPO with groups of std < 1e-6 set to 0 (compose with ``grpo``). a = 0 gives the
    base (reduction to the base estimator); the batch RMS of the term is alpha; sign flips
    where |A_i| is small are allowed.

    Args:
      batch: reads ``extras[oracle]`` [N, K].
      oracle: extras name of the solver's oracle advantage per turn, [N, K].
      alpha: weight of the term.
      transform: ``"asinh"``, ``"identity"`` or ``"signed_log"`` (sign(a) log(1 + |a|)).
      normalization: ``"rms"`` (divide by the batch RMS + eps) or ``"none"``.
      eps: > 0, added to the RMS.
      axis_name: mesh axis; the RMS reduces over it.

    ``adv`` and the result (A + the term): see the module docstring.
    """
    check_choice("transform", transform, ("asinh", "identity", "signed_log"))
    check_choice("normalization", normalization, ("rms", "none"))
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    valid = segments.valid_turns(b)
    g = jnp.where(valid, _odd_transform(turn_field(b, oracle, "cast", "solver oracle "
                                                   "advantage per turn, [N, K]",
                                                       stop_gradient=True), transform),
                  0.0)
    if normalization == "rms":
        ss = segments.psum(jnp.sum(g * g), axis_name)
        cnt = segments.psum(jnp.sum(valid.astype(F32)), axis_name)
        rms = jnp.where(cnt > 0, segments.safe_sqrt(ss / jnp.maximum(cnt, 1.0)), 1.0)
        g = g / (rms + eps)
    return add_turn_term(adv, b, alpha * g)


# ----------------------------------------------------------------------------- OPRL


def implicit_step_rewards(batch: TrajectoryBatch, *, prm: str = "prm_logprobs",
                          ref: str = "ref_logprobs", beta: float = 0.1, axis_name=None):
    """OPRL's implicit PRM step rewards [N, K]: r_k = beta sum_{t in k} (log
    pi_phi(y_t) - log pi_ref(y_t)) over turn k's action tokens; sum_k r_k = beta times the
    trajectory log-ratio. ``prm``/``ref``: [R, T] log-prob fields (``"old_logprobs"`` =
    the batch's behaviour log-probs)."""
    b = segments.local_view(batch, axis_name)
    lp = token_field(b, prm, "oprl", "implicit PRM log-probs of the sampled tokens, [R, T]",
                     stop_gradient=True)
    lr = token_field(b, ref, "oprl", "reference log-probs of the sampled tokens, [R, T]",
                     stop_gradient=True)
    return jnp.where(segments.valid_turns(b), beta * segments.token_to_turn(lp - lr, b), 0.0)


@register("oprl", kind="transform", renamed={"scale_std": "normalize"})
def implicit_process_reward_credit(adv: Advantages, batch: TrajectoryBatch, *,
                                   prm: str = "prm_logprobs", ref: str = "ref_logprobs",
                                   beta: float = 0.1, weight: float = 1.0,
                                   cohort: str = "cohort", normalize: bool = True,
                                   eps: float = 1e-6, axis_name=None) -> Advantages:
    """OPRL: Online Process Reward Learning, as the paper describes it.

    Step rewards r = ``implicit_step_rewards`` (the implicit PRM pi_phi, trained by
    trajectory-level DPO elsewhere, consumed as log-probs), normalised within step groups
    (unbiased std, singleton 0): A = A_ep + weight A_step. weight = 0 gives the base
    (reduction to the base estimator).

    Args:
      batch: reads ``extras[prm]`` and ``extras[ref]`` [R, T] (``old_logprobs`` [R, T] when
        ``ref="old_logprobs"``); ``group_ids`` [N], ``state_keys`` [N, K].
      prm: extras name of the implicit PRM's log-probs of the sampled tokens, [R, T].
      ref: extras name of the reference log-probs, [R, T]; ``"old_logprobs"`` reads the
        batch's behaviour log-probs.
      beta: scale of the implicit reward.
      weight: weight of the term (0 gives the base).
      cohort, normalize, eps: the peer set and its standardisation, as in ``procredit``.

    ``adv``, ``axis_name`` and the result (A + the term): see the module docstring.
    """
    check_choice("cohort", cohort, ("cohort", "state"))
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    r = implicit_step_rewards(b, prm=prm, ref=ref, beta=beta)
    return add_turn_term(adv, b, weight * normalize_turns(r, b, by=cohort,
                                                         scale_std=normalize, eps=eps))


# ----------------------------------------------------------------------------- step gain


@register("step_gain", kind="transform", renamed={"scale_std": "normalize"})
def step_gain(adv: Advantages, batch: TrajectoryBatch, *, potential: str = "potential",
              final_potential: str = "final_potential", weight: float = 1.0,
              normalize: bool = True, eps: float = 1e-6, axis_name=None) -> Advantages:
    """Gain-based step advantages (Stepwise-Flow-GRPO, and the generic "step gain"), as the
    paper describes them.

    R_hat = intermediate reward estimates at each state; gain g_k = R_hat_{k+1} - R_hat_k
    (telescopes to R_hat_K - R_hat_0), normalised per (task group, step index) (unbiased std,
    singleton 0); A' = A + weight g~.

    Args:
      batch: reads ``extras[potential]`` [N, K] (R_hat before action k) and
        ``extras[final_potential]`` [N] (R_hat_K, required); ``group_ids`` [N].
      potential: extras name of R_hat before action k, [N, K].
      final_potential: extras name of R_hat after the last turn, [N].
      weight: weight of the term (0 gives the base).
      normalize: divide by the cohort std + eps (False: centre only).
      eps: > 0, added to the std.

    ``adv``, ``axis_name`` and the result (A + the term): see the module docstring.
    """
    check_positive("eps", eps)
    b = segments.local_view(batch, axis_name)
    g = potential_terms(b, potential, final_potential, 1.0, True, "step_gain")
    return add_turn_term(adv, b, weight * normalize_turns(g, b, by="cohort",
                                                         scale_std=normalize, eps=eps))


# ----------------------------------------------------------------------------- judge verdicts


@register("ups", kind="transform", renamed={"lam": "weight"})
def centered_alignment_credit(adv: Advantages, batch: TrajectoryBatch, *,
                              align: str = "alignment", weight: float = 0.5,
                              center: str = "trajectory", axis_name=None) -> Advantages:
    """UPS-GRPO (SCOUT).

    This is our reading of the paper, which describes the step in words:
    A_k = A_outcome + weight (r_align,k - mean), with the tool-grounded temporal alignment
    rewards r_align centred over the trajectory's turns (``center="trajectory"``) or the
    task group's turns (``"group"``).

    Args:
      batch: reads ``extras[align]`` [N, K]; ``group_ids`` [N] with ``center="group"``.
      align: extras name of the alignment reward per turn, [N, K].
      weight: weight of the centred alignment term (0 gives the base).
      center: ``"trajectory"`` or ``"group"`` (above).

    ``adv``, ``axis_name`` and the result (A + the term): see the module docstring.
    """
    check_choice("center", center, ("trajectory", "group"))
    b = segments.local_view(batch, axis_name)
    valid = segments.valid_turns(b)
    x = turn_field(b, align, "ups", "alignment reward per turn, [N, K]", stop_gradient=True)
    if center == "trajectory":
        turns = jnp.sum(segments.valid_turns(b), axis=1).astype(F32)
        m = jnp.sum(x, axis=1, keepdims=True) / jnp.maximum(turns, 1.0)[:, None]
        d = x - m
    else:
        d = normalize_turns(x, b, by="group", scale_std=False)
        d = jnp.where(valid, d, 0.0)
    return add_turn_term(adv, b, weight * d)


@register("capo", kind="transform")
def step_verdict_penalty(adv: Advantages, batch: TrajectoryBatch, *,
                         verdict: str = "step_verdict", kappa: float = 0.5,
                         reward_correct: bool = False, fail_below: float = 0.5,
                         axis_name=None) -> Advantages:
    """CAPO-GenPRM step penalties from generated critiques.

    This is our reading of the paper, which describes the step in words:
    A'_t = A_t - kappa 1[step k(t) flagged wrong] (+ kappa for steps flagged correct in
    failed responses, R_i < ``fail_below``, with ``reward_correct``). The verdict is the
    majority vote of several generated step critiques, -1 wrong, +1 correct, 0 no verdict.
    kappa = 0 gives the base.

    Args:
      batch: reads ``extras[verdict]`` [N, K] in {-1, 0, 1} and ``outcome`` [N].
      verdict: extras name of the majority-vote step verdict, [N, K].
      kappa: >= 0, size of the penalty (and bonus).
      reward_correct: also add kappa to steps voted correct in failed responses.
      fail_below: outcome below which a response counts as failed.

    ``adv``, ``axis_name`` and the result (A + the term): see the module docstring.
    """
    check_nonneg("kappa", kappa)
    b = segments.local_view(batch, axis_name)
    v = turn_field(b, verdict, "capo", "majority-vote step verdict in {-1, 0, 1}, [N, K]",
                   stop_gradient=True)
    d = -(v < 0).astype(F32)
    if reward_correct:
        failed = (lax.stop_gradient(b.outcome) < fail_below)[:, None]
        d = d + ((v > 0) & failed).astype(F32)
    return add_turn_term(adv, b, kappa * d)


__all__ = sorted({
    "add_turn_term",
    "trace_rewards",
    "gold_logprob_turn_credit",
    "spae_potential",
    "step_potential_advantage",
    "efca_weights",
    "feedback_weighted_advantage",
    "vtca_credit",
    "prerequisite_progress_credit",
    "remaining_progress_credit",
    "variance_rescaled_returns",
    "rescaled_info_gain_credit",
    "a2tgpo_clip_range",
    "solver_oracle_credit",
    "implicit_step_rewards",
    "implicit_process_reward_credit",
    "step_gain",
    "centered_alignment_credit",
    "step_verdict_penalty",
})
