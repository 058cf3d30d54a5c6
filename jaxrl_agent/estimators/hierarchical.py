"""HiPER's hierarchical advantage estimation (HAE): planner and executor credit over subgoals.

HiPER (reference code JonP07/HiPER-agent ``hier_gae/core_hgae.py``) lets the
policy write, at some turns, a new subgoal (``<switch>SWITCH</switch><subgoal>...</subgoal>``)
and at the others keep the current one. A *boundary* turn starts a new subgoal; the maximal
runs of turns between boundaries are *segments*. Two (optionally three) advantage streams
are computed per trajectory and routed to disjoint sets of tokens:

* low level (execution): turn GAE inside each segment, bootstrapped at the segment end with
  the high-level value of the next boundary (a semi-MDP boundary);
* high level (planning): GAE over segments with segment returns and gamma^duration;
* termination (optional): the return to the segment end minus a termination-head value.

Inputs (records -> batch): turn rewards r [N, K]; V_low = extras['turn_values'] (a record
turn's ``value``); V_high = extras['high_values'] (``turn_extras.high_values``, read only at
boundary turns; if absent V_low serves, HiPER's single-head fallback); V_term =
extras['term_values'] (``turn_extras.term_values``, optional); boundaries extras['switch']
(``turn_extras.switch``, 1 = a new subgoal starts; the first turn is always a boundary);
token masks extras['subgoal_mask'] and extras['switch_mask'] [R, T] (``token_extras``, one
bool per action token; read only on action tokens).

Everything here is per trajectory except the optional batch-wide standardisation, which
reduces across ``axis_name``; one reverse ``lax.scan`` over the K turns does the rest.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxrl_agent import segments
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.checks import check_choice, check_positive, check_unit, require
from jaxrl_agent.registry import register

SWITCH_STREAMS = ("auto", "term", "high", "none")
NORMS = ("none", "turn", "token")


def _backward_pass(r, v_low, v_high, bound, valid, gamma, lam_turn, lam_seg):
    """One reverse scan over the K turns of every trajectory (missing turns carry through).

    The carry describes the next valid turn k+1: ``v_next`` (V_high(k+1) if it starts a
    segment, else V_low(k+1); 0 past the episode end), ``ends`` (k ends its segment: k+1 is a
    boundary or past the end), and the running A_low, G (return to the segment end with the
    V_high bootstrap), g^d (gamma to the number of turns left in the segment) and A_high of the
    next segment. Returns (A_low, G, A_high at boundaries) [N, K].
    """
    def step(carry, x):
        v_next, ends, a_low, ret, disc, a_high = carry
        r_k, vl_k, vh_k, b_k, m_k = x
        inner = 1.0 - ends
        a_low_k = r_k + gamma * v_next - vl_k + gamma * lam_turn * inner * a_low
        ret_k = r_k + gamma * (ends * v_next + inner * ret)
        disc_k = gamma * (ends + inner * disc)
        a_high_k = ret_k - vh_k + lam_seg * disc_k * a_high  # used at boundaries only
        new = (jnp.where(b_k, vh_k, vl_k), b_k.astype(r_k.dtype), a_low_k, ret_k, disc_k,
               jnp.where(b_k, a_high_k, a_high))
        carry = tuple(jnp.where(m_k, n, c) for n, c in zip(new, carry))
        return carry, (a_low_k, ret_k, a_high_k)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (r, v_low, v_high, bound, valid))
    zero = jnp.zeros_like(xs[0][0])  # varies over the same mesh axes as the inputs
    init = (zero, zero + 1.0, zero, zero, zero, zero)
    _, ys = lax.scan(step, init, xs, reverse=True)
    return tuple(jnp.moveaxis(y, 0, 1) for y in ys)


def _token_mask(b: TrajectoryBatch, name: str):
    if name not in b.extras:
        return jnp.zeros_like(b.action_mask)
    m = b.extras[name]
    if m.shape != b.action_mask.shape:
        raise ValueError(f"hae: extras['{name}'] must have shape [R, T] = "
                         f"{tuple(b.action_mask.shape)}, got {tuple(m.shape)}")
    return b.action_mask & (m != 0)


def _turn_values(b: TrajectoryBatch, name: str, what: str, valid):
    v = require(b, name, "hae", what)
    if v.shape != valid.shape:
        raise ValueError(f"hae: extras['{name}'] must have shape [N, K] = {tuple(valid.shape)},"
                         f" got {tuple(v.shape)}")
    return jnp.where(valid, v, 0.0).astype(jnp.float32)


def _streams(b: TrajectoryBatch, gamma, lam_turn, lam_seg, switch_stream):
    """All streams of HAE on a local view ``b`` (see ``hae_streams``)."""
    valid = segments.valid_turns(b)
    r = jnp.where(valid, b.turn_rewards, 0.0).astype(jnp.float32)
    v_low = _turn_values(b, "turn_values", "[N, K] low-level values V_low: give each record "
                         "turn a 'value'", valid)
    v_high = (_turn_values(b, "high_values", "", valid) if "high_values" in b.extras
              else v_low)
    sw = _turn_values(b, "switch", "[N, K] 0/1 subgoal boundaries: give each record turn "
                      "turn_extras.switch", valid)
    has_term = "term_values" in b.extras
    if switch_stream == "auto":
        switch_stream = "term" if has_term else "none"
    if switch_stream == "term" or has_term:
        v_term = _turn_values(b, "term_values", "[N, K] termination-head values: give each "
                              "record turn turn_extras.term_values (switch_stream='term')",
                              valid)
    sub, swm = _token_mask(b, "subgoal_mask"), _token_mask(b, "switch_mask")
    first = valid & (jnp.cumsum(valid, axis=1) == 1)
    bound = valid & ((sw > 0.5) | first)
    a_low, ret, a_high = _backward_pass(r, v_low, v_high, bound, valid, gamma, lam_turn,
                                        lam_seg)
    zero = jnp.zeros_like(r)
    out = {
        "boundary": bound,
        "low": jnp.where(valid, a_low, zero),
        "low_returns": jnp.where(valid, a_low + v_low, zero),
        "high": jnp.where(bound, a_high, zero),
        "high_returns": jnp.where(bound, a_high + v_high, zero),
        "term_returns": jnp.where(valid, ret, zero),
    }
    if switch_stream == "term" or has_term:
        out["term"] = jnp.where(valid, ret - v_term, zero)
    # token routing: switch tokens first, then subgoal tokens, the rest is low level
    btok = segments.turn_to_token(bound, b)
    out["low_tokens"] = b.action_mask & ~sub & ~swm
    out["high_tokens"] = (sub & ~swm & btok) | ((swm & btok) if switch_stream == "high"
                                                 else jnp.zeros_like(swm))
    out["term_tokens"] = swm if switch_stream == "term" else jnp.zeros_like(swm)
    return out


def hae_streams(batch: TrajectoryBatch, *, gamma: float = 1.0, lam_turn: float = 1.0,
                lam_seg: float = 0.95, switch_stream: str = "auto", axis_name=None) -> dict:
    """Every stream of HAE and its value targets, unnormalised (what ``hae`` assembles).

    Returns a dict of [N, K] arrays (0 on missing turns): ``boundary`` (bool), ``low`` (A_low)
    and ``low_returns`` (A_low + V_low, the V_low targets), ``high`` and ``high_returns``
    (A_high and A_high + V_high at boundary turns, 0 elsewhere: the V_high targets),
    ``term_returns`` (the return to the segment end bootstrapped with V_high: the V_term
    targets) and, when extras['term_values'] is given, ``term`` (A_term); and the [R, T] bool
    token masks ``low_tokens``, ``high_tokens``, ``term_tokens`` (pairwise disjoint, inside
    ``action_mask``). Formulas and arguments: see ``hae``.
    """
    _check(gamma, lam_turn, lam_seg, switch_stream, "none", 1.0)
    return _streams(segments.local_view(batch, axis_name), gamma, lam_turn, lam_seg,
                    switch_stream)


def _check(gamma, lam_turn, lam_seg, switch_stream, normalization, eps):
    check_unit("gamma", gamma)
    check_unit("lam_turn", lam_turn)
    check_unit("lam_seg", lam_seg)
    check_choice("switch_stream", switch_stream, SWITCH_STREAMS)
    check_choice("normalization", normalization, NORMS)
    check_positive("eps", eps)


def _standardise(x, b, tokens, normalize, eps, axis_name):
    """(x - mu) / (std + eps) over the turns (``"turn"``) or tokens (``"token"``) that carry
    the stream; the identity when nothing carries it."""
    count = segments.token_to_turn(tokens.astype(jnp.float32), b)
    w = count if normalize == "token" else (count > 0).astype(jnp.float32)
    mu, var = segments.weighted_mean_var(x, w, axis_name)
    total = segments.psum(jnp.sum(w), axis_name)
    return jnp.where(total > 0, (x - mu) / (segments.safe_sqrt(var) + eps), x)


@register("hae", aliases=("hierarchical_advantage",),
          reads=("turn_values", "high_values", "switch"),
          renamed={"normalize": "normalization", "norm_adv": "normalization"})
def hae(batch: TrajectoryBatch, *, gamma: float = 1.0, lam_turn: float = 1.0,
        lam_seg: float = 0.95, switch_stream: str = "auto", normalization: str = "none",
        eps: float = 1e-8, axis_name=None) -> Advantages:
    """HAE: hierarchical advantage estimation (HiPER; JonP07/HiPER-agent).

    Segments: boundary turns are the first turn and every turn with switch > 0.5; segment j
    runs from boundary s_j to the turn before s_{j+1} (or the last turn), d_j turns long.
    Episodes end after their last valid turn (done: no bootstrap past it).

    Low level (execution), turn GAE inside each segment:
      delta_k = r_k + gamma V_next(k) - V_low(k),
      V_next(k) = V_low(k+1) inside the segment, V_high(s_{j+1}) at its last turn (0 at the
      episode end);  A_low_k = delta_k + gamma lam_turn A_low_{k+1} (reset at the segment end).
    High level (planning, semi-MDP over segments):
      R_seg_j = sum_{p < d_j} gamma^p r_{s_j + p},
      delta_j = R_seg_j + gamma^{d_j} V_high(s_{j+1}) - V_high(s_j)   (V_high past the end 0),
      A_high_j = delta_j + gamma^{d_j} lam_seg A_high_{j+1}, stored at turn s_j.
    Termination (when extras['term_values'] is given):
      G_k = sum_{p=k}^{e_j} gamma^{p-k} r_p + gamma^{e_j - k + 1} V_high(s_{j+1}),
      A_term_k = G_k - V_term(k)   (HiPER's code form; the paper's (q - beta)(V_high - V_low)
      is not used).

    Tokens: each action token carries exactly one stream or nothing (our routing of HiPER's
    masks; HiPER adds the masked streams, which is the same when its masks are disjoint):
    a switch_mask token carries A_term (``switch_stream="term"``), A_high on boundary turns
    and nothing on others (``"high"``, HiPER's assign_high_to_switch), or nothing
    (``"none"``); ``"auto"`` is ``"term"`` when extras['term_values'] exists, else ``"none"``
    (HiPER's defaults). Otherwise a subgoal_mask token carries A_high on a boundary
    turn and nothing on other turns (a kept subgoal is not a decision). Every other action
    token carries A_low. Without extras['subgoal_mask'] / ['switch_mask'] those masks are
    empty (our default): every action token carries A_low and A_high reaches no token
    (``hae_streams`` still returns it).

    ``normalization`` (HiPER's ``norm_adv``): ``"turn"`` standardises each stream over the turns
    that carry at least one of its tokens, ``"token"`` weights each such turn by its number of
    stream tokens (an option of ours); (A - mean) / (std + eps), population std, batch-wide
    (across ``axis_name``). A stream that no token carries is left as it is.

    Reductions: no switches gives A_low = turn GAE (``turn_gae``, normalization="none") and
    A_high_0 = G_0 - V_high(0); every turn a boundary gives A_low_k = r_k + gamma
    V_high(k+1) - V_low(k). lam = 1 gives return - value and lam = 0 the one-step TD error,
    per level. Degenerate input: missing turns and padding give 0; one-turn episodes give
    A_low = r - V_low, A_high = r - V_high; the standardisation never divides by 0.

    Args:
      batch: reads ``turn_rewards`` and ``turn_mask`` [N, K] (N trajectories x K turns);
        extras['turn_values'] (V_low) and extras['switch'] (boundaries) [N, K]; optional
        extras['high_values'] (V_high, else V_low serves) and extras['term_values'] (V_term)
        [N, K]; optional token masks extras['subgoal_mask'] and extras['switch_mask'] [R, T].
      gamma: per-turn discount, in [0, 1].
      lam_turn: the GAE lambda of the low level, in [0, 1].
      lam_seg: the GAE lambda of the high level (over segments), in [0, 1].
      switch_stream: what switch tokens carry: ``"auto"``, ``"term"``, ``"high"`` or
        ``"none"`` (above).
      normalization: ``"none"``, ``"turn"`` or ``"token"`` (above). Former name ``norm_adv``.
      eps: added to the std of the standardisation, > 0.
      axis_name: the mesh axis under ``shard_map``: the standardisation reduces across it;
        the streams themselves are per trajectory. Or None.

    Returns:
      ``Advantages`` with ``token`` [R, T] (each action token's stream as above, 0 outside
      ``action_mask``), ``turn`` [N, K] = A_low (standardised like its tokens) and
      ``turn_returns`` [N, K] = A_low + V_low (raw), the V_low targets. The V_high and V_term
      targets and the raw streams come from ``hae_streams``.
    """
    _check(gamma, lam_turn, lam_seg, switch_stream, normalization, eps)
    b = segments.local_view(batch, axis_name)
    s = _streams(b, gamma, lam_turn, lam_seg, switch_stream)
    low, high = s["low"], s["high"]
    term = s.get("term", jnp.zeros_like(low))
    if normalization != "none":
        low = _standardise(low, b, s["low_tokens"], normalization, eps, axis_name)
        high = _standardise(high, b, s["high_tokens"], normalization, eps, axis_name)
        term = _standardise(term, b, s["term_tokens"], normalization, eps, axis_name)
    valid = segments.valid_turns(b)
    low = jnp.where(valid, low, 0.0)
    token = (jnp.where(s["low_tokens"], segments.turn_to_token(low, b), 0.0)
             + jnp.where(s["high_tokens"], segments.turn_to_token(high, b), 0.0)
             + jnp.where(s["term_tokens"], segments.turn_to_token(term, b), 0.0))
    return Advantages(token=token, turn=low, turn_returns=s["low_returns"])
