"""The train state and the jitted RL train step.

One step, for a packed ``TrajectoryBatch``::

    values   = V_theta(batch)                        (only for critic estimators; likewise the
                                                      teacher's log-probs and the policy's
                                                      entropies, only when a method reads them)
    A, est'  = estimator(batch [+ values], est)      (registry; on the whole batch, once)
    for epoch in 1..ppo_epochs:
      for each mini-batch b (1/mini_batches of the rows, whole trajectories):
        g = 0
        for each micro-batch m of b (gradient accumulation):
            g += grad_theta [ P_m / D_P + kl_coef K_m / D_K - ent_coef H_m / D_H + v_coef V_m / D_V
                              + q_coef Q_m / D_Q             (Q: SAPO's SARSA loss, sarsa_coef)
                              + sum_j c_j X_jm / D_Xj ]      (X_j: auxiliary losses, aux_losses)
        theta, opt = optax update(g)   -- skipped (and counted) when the loss or g is not
                                          finite, or when b carries no learning signal

where each term is a ``(sum, denominator)`` pair of a registry loss: the denominators are
those of the whole mini-batch, so the micro-batched gradient equals the one-pass gradient (for
every aggregation mode, because micro-batches never split a trajectory). The PPO ratio of
every update is taken against the sampler's log-probs (``batch.old_logprobs``): in the first
update it is 1 (the policy has not moved), in later ones the clip binds. "No learning signal"
means every advantage of the mini-batch's action tokens is 0 and no value loss or auxiliary
loss (``StepConfig.aux_losses``, e.g. a distillation loss) is trained:
Adam would otherwise keep moving the parameters along its momentum (and the KL / entropy
terms alone) on steps that learned nothing. Such updates are counted in
``TrainState.idle``; ``TrainState.skipped`` counts the non-finite ones.

Log-probs of the distribution actually sampled: with ``StepConfig.temperature`` (and
``top_k`` / ``top_p``) the train step computes ``log softmax(z)[x]`` of the processed logits
``z`` = ``sampling.process_logits(logits / T, top_k, top_p)``, the sampler's own formula, so
``lp - batch.old_logprobs`` is 0 before the first update. A token outside the current top-k /
top-p set (possible after earlier updates moved the policy) gets the tempered log-prob
without truncation, a finite stand-in (counted in ``outside_truncation_frac``).

Off-policy correction, for rollouts sampled by older weights (asynchronous rollouts,
``trainer.max_policy_lag > 0``). Three policies meet in a step: the behaviour policy b that
sampled the tokens (``batch.old_logprobs``, possibly several versions old), the proximal
policy p = the parameters at the start of this step (one extra forward pass, no gradient), and
the current policy being updated. With ``StepConfig.is_weights`` the per-token weight
w = p / b (``losses.truncated_is_weights``: per token, or the geometric mean over a row's
action tokens with ``is_level="sequence"``) is truncated at ``is_cap`` (``"truncate"``, TIS) or
turned into a 0/1 mask of ``is_lower <= w <= is_cap`` (``"mask"``, MIS) and multiplies the
policy loss. With ``decoupled`` the PPO ratio is taken against p instead of b (our reading of
AReaL's decoupled PPO objective: the clip keeps the update near the policy that is being
improved, the weight corrects for the policy that sampled), which needs truncated or masked
weights. Without either, the clipped ratio against b is the only correction: tokens whose
ratio left the clip range no longer move the policy. Metrics (once per step, from p and b):
``behaviour_kl_k3`` (k3 estimate of KL(b || p)), ``is_weight_mean``, ``is_ess`` (effective
sample size of the raw weights over the action tokens, as a fraction: (sum w)^2 / (n sum
w^2)) and ``is_corrected_frac`` (tokens whose weight was truncated or masked).

Sharding (``make_train_step(..., mesh=, state_shardings=)``): the batch rows are split over the
mesh's ``data x fsdp`` axes with whole task groups per shard, and the parameters and optimizer
state carry the shardings of ``sharding.rules`` (FSDP along ``embed``, tensor parallelism along
heads / MLP / vocabulary). XLA (GSPMD) inserts the collectives of the model and the loss. The
estimator pipeline runs under ``jax.shard_map`` over the batch axes with ``axis_name`` set: group
statistics stay on their shard, batch-wide ones are reduced across it (the estimators'
shard-invariance contract). The new state is constrained to the input state's shardings, so
the layout never drifts between steps.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_agent import estimators, losses, segments
from jaxrl_agent import sharding as sharding_lib
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.models.transformer import (ATTENTION_IMPLS, Transformer, remat_policy_name,
                                            trainable_filter)
from jaxrl_agent.rollout.tree import TREE_KEYS
from jaxrl_agent.sampling.jax_sampler import process_logits
from jaxrl_agent.train import inputs
from jaxrl_agent.train.logprobs import chunked_token_outputs

#: where the teacher's log-probs come from (``StepConfig.teacher``): none; ``base``: the trained
#: parameters as the run started (the frozen copy the KL term uses; with LoRA, the adapters at
#: their start, i.e. switched off); ``live``: the policy at the start of the step; ``ema``: a
#: moving average of the policy; ``model``: another checkpoint (``TrainState.teacher_params``)
TEACHERS = ("none", "base", "live", "ema", "model")
#: extras of a teacher with a prompt of its own (a privileged context): its rows' tokens and
#: action mask [R, T_teacher], the same rows and action tokens as the batch's
TEACHER_VIEW = ("teacher_tokens", "teacher_action_mask")


@struct.dataclass
class TrainState:
    """Everything a resumed run needs on the device side.

    Attributes:
      params: ``nnx.State`` of the policy's ``nnx.Param`` leaves (value head included; the
        frozen base weights too when LoRA adapters are trained).
      opt_state: the optax state of the trained parameters (``trainable_filter``: all of
        them, or the adapters and value head).
      step: int32, updates attempted so far = the policy version that the next rollouts use.
      rng: uint32 [2] PRNG key data (``jax.random.key_data``), split once per step.
      est_state: the estimator's state (SPO's tracker) or ``()``.
      ref_params: frozen reference copy of the trained parameters for the KL term (the rest
        is shared with ``params``), or ``()``.
      skipped: int32, updates skipped because the loss or the gradient was not finite.
      idle: int32, updates skipped because their mini-batch carried no learning signal (every
        advantage 0 and no value loss).
      teacher_params: the teacher's parameters when the step holds them (``StepConfig.teacher``
        ``"ema"``: an exponential moving average of the trained parameters, updated after each
        step; ``"model"``: another checkpoint's parameters, frozen, never saved), or ``()``.
    """

    params: Any
    opt_state: Any
    step: Any
    rng: Any
    est_state: Any = ()
    ref_params: Any = ()
    skipped: Any = 0
    idle: Any = 0
    teacher_params: Any = ()


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static part of a train step (hashable: one compile per setting and batch shape)."""

    estimator: str = "grpo"
    estimator_params: tuple = ()
    shaping: tuple = ()  # ((name, params), ...) before the estimator (registry kind "shaping")
    then: tuple = ()  # ((name, params), ...) after it (registry kind "transform")
    policy_loss: str = "ppo"
    policy_params: tuple = ()
    agg: str = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    value_coef: float = 0.5
    micro_batches: int = 1  # gradient accumulation within one update
    mini_batches: int = 1  # optimizer updates per epoch, each on 1/mini_batches of the rows
    ppo_epochs: int = 1  # passes over the batch
    remat: str = "none"  # what each decoder layer keeps for the backward pass (REMAT_POLICIES)
    logits_chunk: int = 512  # log-probs / entropies computed this many positions at a time
    attention: str = "blocked"  # training attention: blocked (flash tiles) | splash (TPU) | dense
    mlp_chunk: int = 0  # > 0: each layer's MLP this many positions at a time (long rows)
    data_shards: int = 1  # blocks of the batch (data x fsdp)
    temperature: float = 1.0  # the rollouts' sampling parameters (log-probs of that distribution)
    top_k: int = 0
    top_p: float = 1.0
    # Off-policy correction (module docstring): importance weights pi_prox / pi_behaviour
    is_weights: str = "none"  # none | truncate | mask
    is_level: str = "token"  # token | sequence
    is_cap: float = 2.0
    is_lower: float = 0.0  # mask mode: weights below it are masked too
    decoupled: bool = False  # PPO ratio against the proximal policy, not the sampler's
    # Signals (``train.inputs``): the teacher whose log-probs the methods read, fields the
    # run's methods read beyond their declared ones (found by ``run_checks.step_reads``), and
    # auxiliary losses ((name, coef, params), ...) added to the policy loss
    teacher: str = "none"  # none | base | live | ema | model (TEACHERS)
    teacher_ema: float = 0.99  # ema: teacher <- d teacher + (1 - d) policy after each step
    extra_reads: tuple = ()
    aux_losses: tuple = ()
    teacher_view: bool = False  # the teacher reads rows of its own (extras TEACHER_VIEW)
    # > 0: the teacher's this many most likely ids per position too (teacher_topk_logprobs),
    # and the student's log-probs of them for the losses that read them (``topk_kl``)
    teacher_top_k: int = 0
    # the temperature the teacher is scored at (None: ``temperature``, the rollouts'); a
    # teacher scored at another temperature runs a pass of its own (never shared with the
    # policy's or the reference's)
    teacher_temperature: float | None = None
    sarsa_coef: float = 0.0  # SAPO's auxiliary SARSA loss on the value head (needs one)
    sarsa_gamma: float = 1.0
    # how far the step moved the policy (``drift_metrics``): one more forward pass after the
    # update; KL to the start weights too when the state holds them (``ref_params``)
    policy_drift: bool = False

    def __post_init__(self):
        object.__setattr__(self, "remat", remat_policy_name(self.remat))  # True -> "full"
        if int(self.logits_chunk) < 1:
            raise ValueError(f"logits_chunk must be >= 1, got {self.logits_chunk}")
        if not isinstance(self.mlp_chunk, int) or self.mlp_chunk < 0:
            raise ValueError(f"mlp_chunk must be an int >= 0, got {self.mlp_chunk!r}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {sorted(ATTENTION_IMPLS)}, got "
                             f"{self.attention!r}")
        if self.teacher not in TEACHERS:
            raise ValueError(f"teacher must be one of {TEACHERS}, got {self.teacher!r}")
        if not isinstance(self.teacher_top_k, int) or self.teacher_top_k < 0:
            raise ValueError(f"teacher_top_k must be an int >= 0, got {self.teacher_top_k!r}")
        tt = self.teacher_temperature
        if tt is not None and not (isinstance(tt, (int, float)) and 0 < tt < float("inf")):
            raise ValueError(f"teacher_temperature must be None or a number > 0, got {tt!r}")

    @property
    def retempered_teacher(self) -> bool:
        """The teacher is scored at a temperature other than the rollouts'."""
        return (self.teacher_temperature is not None
                and self.teacher_temperature != self.temperature)

    @property
    def proximal(self) -> bool:
        """The step computes the proximal log-probs (the policy at the start of the step, one
        extra forward pass): for importance weights or the decoupled ratio."""
        return self.is_weights != "none" or self.decoupled

    @property
    def blocks(self) -> int:
        """Blocks of whole groups the batch is packed into: data_shards x mini x micro
        (``pack_records(num_shards=cfg.blocks)``)."""
        return self.data_shards * self.mini_batches * self.micro_batches

    @property
    def updates_per_step(self) -> int:
        return self.ppo_epochs * self.mini_batches

    @property
    def truncated(self) -> bool:
        """The rollouts were sampled from a top-k / top-p truncated distribution."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def pipeline(self) -> "estimators.Pipeline":
        return estimators.Pipeline((self.estimator, self.estimator_params), self.shaping,
                                   self.then)

    @property
    def reads(self) -> tuple:
        """The extras fields the pipeline's stages declare (``estimators.reads``) and those the
        run's checks found its methods and losses read (``extra_reads``)."""
        declared = estimators.reads(self.pipeline)
        return declared + tuple(f for f in self.extra_reads if f not in declared)

    @property
    def needs_teacher(self) -> bool:
        """A method or loss reads the teacher's log-probs: the step runs the teacher."""
        return bool({"teacher", "teacher_topk"} & inputs.sources(self.reads))

    @property
    def topk(self) -> int:
        """K of the teacher's top-K distribution the step computes (and the student's
        log-probs of those ids): ``teacher_top_k`` when a loss reads it, else 0."""
        return self.teacher_top_k if "teacher_topk" in inputs.sources(self.reads) else 0

    @property
    def needs_entropy(self) -> bool:
        return "policy" in inputs.sources(self.reads)

    @property
    def needs_reference(self) -> bool:
        """A method reads the reference policy's log-probs (the start weights' copy)."""
        return "reference" in inputs.sources(self.reads)

    @property
    def needs_values(self) -> bool:
        """The pipeline reads the value head (a critic estimator): values are computed and the
        value loss is trained."""
        return "value_head" in inputs.sources(self.reads)

    @property
    def needs_hidden(self) -> bool:
        return "hidden_state" in inputs.sources(self.reads)


def make_optimizer(lr: float, *, total_steps: int, warmup_steps: int = 0, decay: str = "cosine",
                   weight_decay: float = 0.0, grad_clip: float = 1.0, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """AdamW with linear warm-up, cosine (to 10% of ``lr``) or constant schedule, and global-norm
    clipping (``grad_clip <= 0`` turns it off). Steps count optimizer updates.

    The warm-up's update ``c`` (0-based, ``c < warmup_steps``) uses ``lr (c + 1) / (warmup_steps
    + 1)``: the first update already moves the parameters (a schedule starting at exactly 0
    wastes it), and update ``warmup_steps`` is the first at the full ``lr``.

    ``eps`` matters for RL on small models: Adam divides by ``sqrt(v) + eps``, so parameters
    whose gradients are tiny but consistently signed (the LM-head rows of tokens the policy
    almost never samples, nudged through the softmax by every negative advantage) move by a
    full ``lr`` per step unless ``eps`` is above their gradient scale.
    """
    return optax.chain(*_clip(grad_clip), optax.adamw(
        lr_schedule(lr, total_steps=total_steps, warmup_steps=warmup_steps, decay=decay),
        b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))


def lr_schedule(lr: float, *, total_steps: int, warmup_steps: int = 0, decay: str = "cosine"):
    """``make_optimizer``'s learning rate per update (``warmup_schedule`` with the warm-up
    kept below ``total_steps``)."""
    total_steps = max(int(total_steps), 1)
    warmup_steps = min(max(int(warmup_steps), 0), total_steps - 1) if total_steps > 1 else 0
    return warmup_schedule(lr, total_steps, warmup_steps, decay)


def warmup_schedule(lr: float, total_steps: int, warmup_steps: int, decay: str = "cosine"):
    """The learning rate per update: ``lr (c + 1) / (warmup_steps + 1)`` for ``c <
    warmup_steps``, then cosine from ``lr`` to ``0.1 lr`` at ``total_steps`` or constant."""
    if decay not in ("cosine", "constant"):
        raise ValueError(f"decay must be 'cosine' or 'constant', got {decay!r}")
    if decay == "cosine":
        rest = optax.cosine_decay_schedule(lr, max(total_steps - warmup_steps, 1), alpha=0.1)
    else:
        rest = optax.constant_schedule(lr)
    if not warmup_steps:
        return rest
    ramp = optax.linear_schedule(lr / (warmup_steps + 1), lr, warmup_steps)
    return optax.join_schedules([ramp, rest], [warmup_steps])


def _clip(grad_clip: float) -> list:
    return [optax.clip_by_global_norm(grad_clip)] if grad_clip and grad_clip > 0 else []


def init_state(model: nnx.Module, optimizer: optax.GradientTransformation, *, seed: int,
               est_state=(), with_reference: bool = False, ema_teacher: bool = False,
               teacher_params=()) -> TrainState:
    """The train state of ``model``: its parameters, the optimizer state of those it trains
    (``trainable_of(model)``)."""
    return init_state_from_params(nnx.state(model, nnx.Param), optimizer, seed=seed,
                                  est_state=est_state, with_reference=with_reference,
                                  trainable=trainable_of(model), ema_teacher=ema_teacher,
                                  teacher_params=teacher_params)


def trainable_of(model: nnx.Module):
    """The filter of the parameters the step trains: ``models.trainable_filter`` of a
    ``Transformer``'s config (LoRA: the adapters and value head), every ``nnx.Param``
    otherwise."""
    return trainable_filter(model.config) if isinstance(model, Transformer) else nnx.Param


def split_trainable(params, trainable=nnx.Param):
    """``(trained, frozen)`` parts of ``params`` (``nnx.State``) under the ``trainable``
    filter; ``nnx.merge_state(trained, frozen)`` gives ``params`` back (same tree)."""
    return nnx.split_state(params, trainable, ...)


def init_state_from_params(params, optimizer: optax.GradientTransformation, *, seed: int,
                           est_state=(), with_reference: bool = False,
                           trainable=nnx.Param, ema_teacher: bool = False,
                           teacher_params=()) -> TrainState:
    """``init_state`` from the parameters (an ``nnx.State``); jit it with ``out_shardings`` to
    create the optimizer state (and reference copy) directly in its sharded layout. The
    optimizer state, the KL reference and an EMA teacher (``ema_teacher``) cover the
    ``trainable`` parameters only; ``teacher_params``: another model's parameters (a
    ``model`` teacher), kept as given."""
    trained, _ = split_trainable(params, trainable)
    if ema_teacher:
        teacher_params = jax.tree.map(jnp.copy, trained)
    return TrainState(
        params=params, opt_state=optimizer.init(trained), step=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.key(seed)), est_state=est_state,
        ref_params=jax.tree.map(jnp.copy, trained) if with_reference else (),
        skipped=jnp.zeros((), jnp.int32), idle=jnp.zeros((), jnp.int32),
        teacher_params=teacher_params)


# ----------------------------------------------------------------------------- forward


def _tree_of(extras: dict) -> dict:
    tree = {k: extras[k] for k in TREE_KEYS if k in extras}
    if tree and len(tree) != len(TREE_KEYS):
        raise ValueError(f"prefix-tree extras must come together: {TREE_KEYS}, got "
                         f"{sorted(tree)} (use rollout.tree.attach_prefix_trees)")
    return tree


def _at_node(x, index, blocks: int, prev: bool = False):
    """Per-node outputs ``x`` [blocks * P, L, ...] read for every row token t at the node of
    token t (``prev``: of token t - 1; t = 0 reads token 0's node) -> [R, T, ...]. ``index``
    [R, T] holds block-local slots; the gather is batched over the blocks, so it stays on each
    block's devices."""
    R, T = index.shape
    if prev:
        index = jnp.concatenate([index[:, :1], index[:, :-1]], axis=1)
    at = index.reshape(blocks, R // blocks, T)
    xb = x.reshape((blocks, -1) + x.shape[2:])
    out = jax.vmap(lambda xs, i: jnp.take(xs, i, axis=0, mode="clip"))(xb, at)
    return out.reshape((R, T) + x.shape[2:])


def _process(logits, temperature: float, top_k: int, top_p: float):
    """``(z, zt)``: the logits [..., V] divided by the rollouts' temperature (float32), and the
    same after the sampler's top-k / top-p truncation (``sampling.process_logits``: -inf
    outside the kept set), or ``None`` without truncation."""
    z = jnp.asarray(logits, jnp.float32)
    if temperature > 0 and temperature != 1.0:
        z = z / temperature
    if not (temperature > 0 and (top_k > 0 or top_p < 1.0)):
        return z, None
    flat = z.reshape(-1, z.shape[-1])
    n = flat.shape[0]
    zt = process_logits(flat, jnp.ones((n,), jnp.float32), jnp.full((n,), top_k, jnp.int32),
                        jnp.full((n,), top_p, jnp.float32))
    return z, zt.reshape(z.shape)


def _pick(z, zt, at, nxt):
    """Log-prob of token ``nxt`` under the distribution at node ``at`` (``at``/``nxt`` index
    the leading axes of ``z`` through ``take``): ``zt`` where it keeps the token, else the
    untruncated ``z``. Returns ``(lp, outside)``."""
    def one(a):
        return a.at[at + (nxt,)].get(mode="clip"), jax.nn.logsumexp(a, axis=-1).at[at].get(
            mode="clip")
    picked, lse = one(z)
    lp = picked - lse
    if zt is None:
        return lp, jnp.zeros(lp.shape, bool)
    picked_t, lse_t = one(zt)
    outside = jnp.isneginf(picked_t)
    return jnp.where(outside, lp, jnp.where(outside, 0.0, picked_t) - lse_t), outside


def sampled_logprobs(logits, tokens, *, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0):
    """The dense form of what the train step computes in chunks
    (``train.logprobs.chunked_sampled_logprobs``, from the hidden states; this one takes the
    full ``[R, T, V]`` logits and is the tests' reference). Log-probs of ``tokens`` [R, T]
    under the distribution a sampler with these parameters draws from: ``lp[:, t] = log softmax(z[:, t - 1])[tokens[:, t]]`` (0 at t = 0) with
    ``z = process_logits(logits / temperature, top_k, top_p)``, the sampler's own processing
    (``temperature <= 0``, greedy, means the untempered, untruncated distribution, as the
    sampler reports for greedy rows). A token outside the top-k / top-p set of ``z`` (the
    policy moved since it was sampled) gets the tempered log-prob without truncation, a finite
    stand-in.

    Returns ``(lp [R, T], outside [R, T] bool, z [R, T, V])``, ``z`` the processed logits (the
    entropy of the distribution each token was drawn from is ``entropy_from_logits(z)`` one
    position earlier).
    """
    z, zt = _process(logits, temperature, top_k, top_p)
    R, T = tokens.shape
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], (R, T - 1))
    cols = jnp.broadcast_to(jnp.arange(T - 1)[None, :], (R, T - 1))
    lp, out = _pick(z, zt, (rows, cols), jnp.asarray(tokens, jnp.int32)[:, 1:])
    pad = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)  # noqa: E731
    return pad(lp), pad(out), (z if zt is None else zt)


def _forward(graphdef, params, rest, tokens, extras, *, cfg: "StepConfig", want_entropy: bool,
             remat="none", pin=None, residual=None, layer_use=None, blocks: int = 1, at=None,
             top_n: int = 0):
    """Per-token (log-prob, entropy, value, outside-truncation, more) of the rows ``tokens``
    [R, T] under the rollouts' sampling distribution (``cfg.temperature``, ``top_k``,
    ``top_p``); ``more``: the log-probs of the ids ``at`` [R, T, K] (``at_lp``, [R, T, K])
    and the ``top_n`` most likely ids with their log-probs (``top_lp``, ``top_ids``, each
    [R, T, top_n]), of the distribution before truncation (``chunked_token_outputs``), when
    asked;
    with prefix-tree extras the model runs on the packed trees (``blocks`` of them) and the
    final hidden states are gathered back to the rows: the same numbers, each shared prefix's
    layers computed once.

    The LM head runs inside ``chunked_sampled_logprobs``, ``cfg.logits_chunk`` positions at a
    time (the [R, T, V] float32 logits never exist, in the forward or the backward pass)."""
    model = nnx.merge(graphdef, params, rest)
    tree = _tree_of(extras)
    if tree:
        out = model(tree["tree_tokens"], positions=tree["tree_positions"],
                    key_ends=tree["tree_ends"], remat=remat, activation_sharding=pin,
                    residual_sharding=residual, layer_shardings=layer_use, compute_logits=False,
                    attention=cfg.attention, mlp_chunk=cfg.mlp_chunk)
        idx = tree["tree_index"]
        hidden = _at_node(out.hidden, idx, blocks)  # row token t's node -> [R, T, D]
        first = (jnp.arange(tokens.shape[1]) == 0)[None, :]
        values = (None if out.values is None else
                  jnp.where(first, 0.0, _at_node(out.values, idx, blocks, prev=True)))
    else:
        out = model(tokens, positions=extras.get("positions"),
                    segment_ids=extras.get("segment_ids"), remat=remat, activation_sharding=pin,
                    residual_sharding=residual, layer_shardings=layer_use, compute_logits=False,
                    attention=cfg.attention, mlp_chunk=cfg.mlp_chunk)
        hidden, values = out.hidden, out.values
        if values is not None:  # value of the state before token t (head read at t - 1)
            values = jnp.concatenate([jnp.zeros_like(values[:, :1]), values[:, :-1]], axis=1)
    weight, tied = model.head_weight()
    copies = None if pin is None else NamedSharding(
        pin.mesh, P(sharding_lib.BATCH_AXES, P.UNCONSTRAINED, P.UNCONSTRAINED))
    out = chunked_token_outputs(
        hidden, weight, tokens, tied=tied, temperature=cfg.temperature, top_k=cfg.top_k,
        top_p=cfg.top_p, chunk=cfg.logits_chunk, want_entropy=want_entropy,
        shards=cfg.data_shards if pin is not None else 1, shard_sharding=copies, at=at,
        top_n=top_n)
    more = {k: out[k] for k in ("at_lp", "top_lp", "top_ids") if k in out}
    return out["lp"], out["ent"], values, out["outside"], more


def _decision_hidden(graphdef, params, rest, batch: TrajectoryBatch, tree=None, blocks=1,
                     attention: str = "dense", pin=None, mlp_chunk: int = 0):
    """[N, K, D] final hidden state at each turn's decision point (the position before its
    first action token: the state the action was drawn from), detached. ``pin``: the rows'
    layout (``_forward``'s; the splash kernel runs per row block under it)."""
    model = nnx.merge(graphdef, params, rest)
    run = functools.partial(model, compute_logits=False, attention=attention,
                            activation_sharding=pin, mlp_chunk=mlp_chunk)
    if tree:
        h = run(tree["tree_tokens"], positions=tree["tree_positions"],
                key_ends=tree["tree_ends"]).hidden.astype(jnp.float32)
        h = _at_node(h, tree["tree_index"], blocks, prev=True)
    else:
        h = run(batch.tokens, positions=batch.extras.get("positions"),
                segment_ids=batch.extras.get("segment_ids")).hidden.astype(jnp.float32)
        h = jnp.concatenate([h[:, :1], h[:, :-1]], axis=1)  # h[t - 1] at position t
    first, _ = segments.turn_boundary_masks(batch)
    n, k = batch.num_traj, batch.num_turns
    idx = batch.row_traj[:, None] * k + jnp.clip(batch.turn_ids, 0, k - 1)
    idx = jnp.where(first, idx, n * k)
    out = jax.ops.segment_sum(jnp.where(first[..., None], h, 0.0).reshape(-1, h.shape[-1]),
                              idx.reshape(-1), n * k)
    return jax.lax.stop_gradient(out.reshape(n, k, -1))


def _row_extras(extras: dict, num_rows: int) -> dict:
    return {k: v for k, v in extras.items() if v.ndim >= 1 and v.shape[0] == num_rows}


def _split_rows(x, cfg: StepConfig):
    """[R, ...] -> [mini, micro, R / (mini * micro), ...]: micro-batch u of mini-batch b holds
    block (b, u) of every data shard (the packer's blocks are shard-major: block index =
    shard * mini * micro + b * micro + u)."""
    d, b, u = cfg.data_shards, cfg.mini_batches, cfg.micro_batches
    r = x.shape[0] // (d * b * u)
    x = jnp.moveaxis(x.reshape((d, b, u, r) + x.shape[1:]), 0, 2)
    return x.reshape((b, u, d * r) + x.shape[4:])


def _unsplit_rows(x, cfg: StepConfig):
    """The inverse of ``_split_rows``: [mini, micro, R / (mini * micro), ...] -> [R, ...]."""
    d, b, u = cfg.data_shards, cfg.mini_batches, cfg.micro_batches
    r = x.shape[2] // d
    x = jnp.moveaxis(x.reshape((b, u, d, r) + x.shape[3:]), 2, 0)
    return x.reshape((d * b * u * r,) + x.shape[4:])


def _by_micro_batch(f, rows: dict, cfg: StepConfig, pin=None):
    """``f(rows)`` (a forward-only pass: ``rows`` a dict of [R, ...] arrays, the outputs any
    pytree of [R, ...] arrays) one micro-batch of rows at a time (``_split_rows``' blocks,
    under ``lax.map``), so a teacher's or reference pass holds one micro-batch's activations,
    as the update does; the outputs are put back in row order. ``pin``: the rows' sharding
    of each block."""
    if cfg.mini_batches * cfg.micro_batches == 1:
        return f(rows)
    split = {k: _split_rows(v, cfg) for k, v in rows.items()}
    lead = split["tokens"].shape[:2]
    flat = {k: v.reshape((-1,) + v.shape[2:]) for k, v in split.items()}

    def one(block):
        if pin is not None:
            block = {k: jax.lax.with_sharding_constraint(v, pin) for k, v in block.items()}
        return f(block)

    out = jax.lax.map(one, flat)
    return jax.tree.map(lambda y: _unsplit_rows(y.reshape(lead + y.shape[1:]), cfg), out)


# ----------------------------------------------------------------------------- the step


def _off_policy_args(cfg: StepConfig, mbd) -> dict:
    """The policy loss's extra arguments for the off-policy correction of one block."""
    out = {}
    if cfg.decoupled:
        out["old_logprobs"] = mbd["prox"]
    if cfg.is_weights != "none":
        out["is_weights"] = mbd["isw"]
    return out


def _terms(lp, ent, values, mb: TrajectoryBatch, adv_tok, ref_lp, returns, cfg: StepConfig,
           off_policy: dict | None = None, topk_lp=None):
    """(sum, denominator) of every loss term on one (micro-)batch; ``topk_lp``: the student's
    log-probs of the teacher's top-K ids [r, T, K] (with ``cfg.topk``)."""
    pol = losses.get(cfg.policy_loss)
    out = {"policy": pol(lp, mb, adv_tok, agg=cfg.agg, **dict(cfg.policy_params),
                         **(off_policy or {}))}
    if cfg.kl_coef:
        out["kl"] = losses.get(cfg.kl_estimator)(lp, mb, ref_logprobs=ref_lp, agg=cfg.agg)
    if cfg.entropy_coef:
        out["entropy"] = losses.get("entropy")(ent, mb, agg=cfg.agg)
    if cfg.needs_values and cfg.value_coef:
        out["value"] = losses.get("value")(values, returns, mb.action_mask)
    if cfg.sarsa_coef and values is not None:
        out["sarsa"] = _sarsa_term(values, mb, cfg.sarsa_gamma)
    avail = {"advantages": adv_tok}
    if topk_lp is not None:
        avail["student_topk_logprobs"] = topk_lp
    for name, _, params in cfg.aux_losses:  # auxiliary losses, given what they name (the run's
        fn = losses.get(name)               # advantages, the student's top-K log-probs)
        given = losses.step_given(fn, **avail)
        out[f"aux_{name}"] = fn(lp, mb, agg=cfg.agg, **given, **dict(params))
    return out


def _sarsa_term(values, mb: TrajectoryBatch, gamma: float):
    """SAPO's auxiliary SARSA loss (``losses.sarsa``) on one micro-batch: Q_k = the value head
    read at turn k's last action token (``values`` [r, T] is the value before each token, so
    it is read one position later), over the turns of the trajectories whose rows this
    micro-batch holds."""
    at_token = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    q = segments.turn_values_from_tokens(at_token, mb, "last_action")
    n = mb.num_traj
    has = jnp.any(mb.action_mask, axis=1)
    present = jax.ops.segment_max(has.astype(jnp.int32), jnp.clip(mb.row_traj, 0, n - 1), n) > 0
    return losses.get("sarsa")(q, mb.replace(turn_mask=mb.turn_mask & present[:, None]),
                               gamma=gamma)


def _coefs(cfg: StepConfig) -> dict:
    return {"policy": 1.0, "kl": cfg.kl_coef, "entropy": -cfg.entropy_coef,
            "value": cfg.value_coef, "sarsa": cfg.sarsa_coef,
            **{f"aux_{n}": c for n, c, _ in cfg.aux_losses}}


def _clip_params(cfg: StepConfig) -> dict | None:
    """The clip range of the policy loss (its defaults overridden by ``policy_params``) for the
    clip-fraction diagnostics, or None for losses without one (``reinforce``)."""
    sig = inspect.signature(losses.get(cfg.policy_loss)).parameters
    if "clip_low" not in sig or "clip_high" not in sig:
        return None
    out = {k: sig[k].default for k in ("clip_low", "clip_high", "dual_clip") if k in sig}
    out.update({k: v for k, v in cfg.policy_params if k in out})
    return out


def _token_returns(adv: Advantages, batch: TrajectoryBatch):
    if adv.token_returns is not None:
        return adv.token_returns
    if adv.turn_returns is not None:
        return segments.turn_to_token(adv.turn_returns, batch)
    return jnp.zeros(batch.tokens.shape, jnp.float32)


def _run_estimator(pipe, est_batch, est_state, mesh):
    """The estimator pipeline on the whole batch; under ``shard_map`` over the batch axes when
    the batch is split (groups are whole per shard, so only batch-wide statistics cross)."""
    if mesh is None or sharding_lib.batch_shards(mesh) == 1:
        return pipe.apply(est_batch, est_state)
    axes = sharding_lib.BATCH_AXES
    rows = sharding_lib.batch_spec()
    f = lambda b, s: pipe.apply(b, s, axis_name=axes)  # noqa: E731
    return jax.shard_map(f, mesh=mesh, in_specs=(rows, P()),
                         out_specs=(rows, P()))(est_batch, est_state)


def _forward_only(f, p, ent=False, tokens=None, *, cfg: StepConfig, batch, tree,
                  top_n: int = 0):
    """One forward-only pass of ``f`` (a ``_forward``) with parameters ``p`` over the batch's
    rows (or ``tokens``: rows of the same count, e.g. a teacher's view), one micro-batch at a
    time unless the rows are packed as prefix trees (their blocks are the trees'). Returns
    ``f``'s outputs ``(log-probs, entropies, values, outside, more)`` (``more``: the ``top_n``
    most likely ids and their log-probs, when asked)."""
    if tree:
        return f(p, tokens=batch.tokens, extras={**batch.extras, **tree}, want_entropy=ent,
                 blocks=cfg.blocks, top_n=top_n)
    rows = {"tokens": tokens}
    if tokens is None:  # the policy's rows, with their positions / segments if packed so
        rows = {"tokens": batch.tokens, **{k: batch.extras[k] for k in
                                           ("positions", "segment_ids") if k in batch.extras}}
    return _by_micro_batch(lambda r: f(p, tokens=r["tokens"], extras=r, want_entropy=ent,
                                       blocks=cfg.blocks, top_n=top_n), rows, cfg,
                           f.keywords.get("pin"))


def _step_outputs(graphdef, rest, fwd, tfwd, cfg: StepConfig, view: TrainState, batch, tree,
                  join) -> dict:
    """The model outputs the run's methods and losses read (``inputs.LOOP_INPUTS``), each
    computed only when read: the value head's estimates and the hidden states at decision
    points (one forward pass each), the policy's entropies (one pass, shared with a ``live``
    teacher), the teacher's log-probs of the sampled tokens (a pass of the teacher: ``fwd``
    on the start weights (``view.ref_params``), the EMA (``view.teacher_params``) or ``tfwd``
    on another model's parameters), all at the rollouts' sampling parameters and chunked. With
    ``cfg.teacher_view`` the teacher reads rows of its own (``TEACHER_VIEW``: the policy's rows
    with a privileged context in the prompt) and its log-probs are moved onto the policy's
    action tokens (``segments.align_action_tokens``); with ``cfg.teacher_temperature`` the
    teacher is scored at that temperature instead (a pass of its own)."""
    out = {"values": None, "hidden": None, "teacher_logprobs": None, "entropy": None,
           "ref_logprobs": None, "teacher_topk_logprobs": None, "teacher_topk_ids": None}
    run = functools.partial(_forward_only, cfg=cfg, batch=batch, tree=tree)
    if cfg.needs_values:
        out["values"] = run(fwd, view.params)[2]
    if cfg.needs_hidden:
        out["hidden"] = _decision_hidden(graphdef, view.params, rest, batch, tree, cfg.blocks,
                                         cfg.attention, fwd.keywords.get("pin"), cfg.mlp_chunk)
    teacher = cfg.teacher if cfg.needs_teacher else "none"
    # one pass may serve the teacher and the policy (or the reference) when the teacher reads
    # the policy's rows at the policy's temperature
    shared = not cfg.teacher_view and not cfg.retempered_teacher

    def from_teacher(res, align=None):  # its log-probs (and top K) into ``out``
        lp, more = res[0], res[4]
        if align is not None:  # its own rows: moved onto the policy's action tokens
            lp = align(lp)
            more = {k: jax.vmap(align, in_axes=2, out_axes=2)(v) for k, v in more.items()}
        out["teacher_logprobs"] = lp
        if cfg.topk:
            out["teacher_topk_logprobs"], out["teacher_topk_ids"] = (more["top_lp"],
                                                                   more["top_ids"])

    if cfg.needs_entropy or (teacher == "live" and shared):
        res = run(fwd, view.params, cfg.needs_entropy,
                  top_n=cfg.topk if teacher == "live" and shared else 0)
        out["entropy"] = res[1]
        if teacher == "live" and shared:
            from_teacher(res)
    if (teacher == "base" and shared) or cfg.needs_reference:  # the start weights
        res = run(fwd, view.ref_params, top_n=cfg.topk if teacher == "base" and shared else 0)
        out["ref_logprobs"] = res[0] if cfg.needs_reference else None
        if teacher == "base" and shared:
            from_teacher(res)
    params = {"live": lambda: view.params, "base": lambda: view.ref_params,
              "ema": lambda: join(view.teacher_params), "model": lambda: view.teacher_params}
    if teacher in ("ema", "model") or (teacher != "none" and not shared):
        f = tfwd if teacher == "model" else fwd
        if cfg.retempered_teacher:  # its own temperature, the rest of the sampling the same
            f = functools.partial(f, cfg=dataclasses.replace(
                cfg, temperature=float(cfg.teacher_temperature)))
        if not cfg.teacher_view:
            from_teacher(run(f, params[teacher](), top_n=cfg.topk))
        else:  # its own rows (a context the policy does not see), aligned token for token
            from_teacher(run(f, params[teacher](), tokens=batch.extras["teacher_tokens"],
                             top_n=cfg.topk),
                         align=lambda x: segments.align_action_tokens(
                             x, batch.extras["teacher_action_mask"], batch.action_mask))
    return {k: None if v is None else jax.lax.stop_gradient(v) for k, v in out.items()}


def _with_token_outputs(batch: TrajectoryBatch, outputs: dict) -> TrajectoryBatch:
    """The batch the losses read: the step's per-token outputs (teacher log-probs, entropies)
    added to its extras, detached."""
    tok = {k: outputs[k] for k in ("teacher_logprobs", "ref_logprobs", "entropy",
                                   "teacher_topk_logprobs", "teacher_topk_ids")
           if outputs.get(k) is not None}
    return batch.replace(extras={**batch.extras, **tok}) if tok else batch


def teacher_metrics(outputs: dict, batch: TrajectoryBatch) -> dict:
    """``teacher_kl``: the mean over action tokens of lp_old - lp_T, the sampled-token (k1)
    estimate of KL(rollout policy || teacher); 0 when the two agree. Empty without a teacher
    pass."""
    t = outputs.get("teacher_logprobs")
    if t is None:
        return {}
    m = batch.action_mask
    n = jnp.maximum(jnp.sum(m.astype(jnp.float32)), 1.0)
    return {"teacher_kl": jnp.sum(jnp.where(m, batch.old_logprobs - t, 0.0)) / n}


def drift_metrics(new_lp, batch: TrajectoryBatch, ref_lp=None) -> dict:
    """How far the policy is from where it was, over the batch's action tokens (sampled by the
    rollout policy b, log-probs ``batch.old_logprobs``), each the k3 estimate mean of (r - 1) -
    log r, >= 0 and 0 when the two policies agree on the sampled tokens:

    * ``kl_after_update``: KL(b || the policy after this step's updates), r = p_new / b: how
      far the step moved the policy (with one update per step the PPO ratio is 1 during the
      update, so ``approx_kl`` and ``clip_fraction`` read 0 and say nothing about this);
    * ``kl_to_start`` (when ``ref_lp``, the start weights' log-probs, is given): KL(b || the
      start weights), r = p_start / b: how far the rollout policy has drifted from the warm
      start."""
    m = batch.action_mask
    n = jnp.maximum(jnp.sum(m.astype(jnp.float32)), 1.0)

    def k3(lp):
        lr = jnp.where(m, lp - batch.old_logprobs, 0.0)
        return jnp.sum(jnp.where(m, jnp.exp(lr) - 1.0 - lr, 0.0)) / n

    out = {"kl_after_update": k3(new_lp)}
    if ref_lp is not None:
        out["kl_to_start"] = k3(ref_lp)
    return out


def _step_metrics(cfg: StepConfig, per, dens, n_bad, n_idle, adv_tok, batch) -> dict:
    """The step's metrics from the updates' outputs ``per`` ([epochs, mini] each): loss terms
    and the sampling policy's entropy from the first epoch (the on-policy values), ratio
    diagnostics over every update, update counts, and the advantages' distribution."""
    terms, diag = per["aux"]
    first = lambda x: jnp.mean(x[0])  # noqa: E731
    metrics = {"loss": first(per["loss"]), "grad_norm": jnp.mean(per["grad_norm"]),
               "update_skipped": n_bad.astype(jnp.float32),
               "updates_idle": n_idle.astype(jnp.float32),
               "updates": (cfg.updates_per_step - n_bad - n_idle).astype(jnp.float32),
               **advantage_metrics(adv_tok, batch)}
    for k, v in terms.items():
        metrics[f"loss_{k}"] = first(v / jnp.maximum(dens[k][None, :], 1.0))
    tok_all = jnp.maximum(jnp.sum(diag["tokens"]), 1.0)
    tok_first = jnp.maximum(jnp.sum(diag["tokens"][0]), 1.0)
    for k, v in diag.items():
        if k == "entropy":
            metrics[k] = jnp.sum(v[0]) / tok_first
        elif k == "outside_truncation_frac":
            if cfg.truncated:
                metrics[k] = jnp.sum(v) / tok_all
        elif k != "tokens":
            metrics[k] = jnp.sum(v) / tok_all
    return metrics


def advantage_metrics(adv_tok, batch: TrajectoryBatch) -> dict:
    """The distribution of the token advantages over action tokens (mean, std, |A| mean, min,
    max, fractions > 0 and == 0) and ``group_zero_frac``: the share of real groups in which
    every action token's advantage is 0 (nothing to learn from them: all rollouts of the
    task scored alike under a group baseline)."""
    m = batch.action_mask
    mf = m.astype(jnp.float32)
    n_tok = jnp.maximum(jnp.sum(mf), 1.0)
    a = jnp.where(m, adv_tok, 0.0)
    mean = jnp.sum(a) / n_tok
    n, big = batch.num_traj, jnp.finfo(jnp.float32).max
    traj_abs = jax.ops.segment_max(jnp.max(jnp.abs(a), axis=1), batch.row_traj, n)
    traj_abs = jnp.where(batch.traj_mask, jnp.maximum(traj_abs, 0.0), 0.0)
    gid = jnp.where(batch.traj_mask, batch.group_ids, n)
    group_abs = jax.ops.segment_max(traj_abs, gid, n + 1)[:n]
    real = jax.ops.segment_max(batch.traj_mask.astype(jnp.int32), gid, n + 1)[:n] > 0
    return {
        "adv_mean": mean, "adv_abs": jnp.sum(jnp.abs(a)) / n_tok,
        "adv_std": jnp.sqrt(jnp.sum(jnp.where(m, (adv_tok - mean) ** 2, 0.0)) / n_tok),
        "adv_min": jnp.min(jnp.where(m, adv_tok, big)) * (jnp.sum(mf) > 0),
        "adv_max": jnp.max(jnp.where(m, adv_tok, -big)) * (jnp.sum(mf) > 0),
        "adv_pos_frac": jnp.sum(jnp.where(m, (adv_tok > 0).astype(jnp.float32), 0.0)) / n_tok,
        "adv_zero_frac": jnp.sum(jnp.where(m, (adv_tok == 0).astype(jnp.float32), 0.0)) / n_tok,
        "group_zero_frac": jnp.sum(real & (group_abs == 0)) / jnp.maximum(jnp.sum(real), 1),
    }


def _step_inputs(fwd, cfg: StepConfig, state: TrainState, batch: TrajectoryBatch, adv, tree,
                 mesh):
    """The rows every update reads, split into ``[mini, micro, rows, ...]`` blocks: the batch
    fields and row extras, the advantages, value targets and reference log-probs, the prefix
    trees; with each mini-batch's loss denominators (they depend on masks only) and whether it
    carries any learning signal."""
    adv_tok = jax.lax.stop_gradient(adv.token)
    ref_lp = jnp.zeros(batch.tokens.shape, jnp.float32)
    if cfg.kl_coef:
        ref_lp, *_ = fwd(state.ref_params, tokens=batch.tokens,
                              extras={**batch.extras, **tree}, want_entropy=False,
                              blocks=cfg.blocks)
        ref_lp = jax.lax.stop_gradient(ref_lp)
    row_fields = dict(tokens=batch.tokens, action_mask=batch.action_mask, turn_ids=batch.turn_ids,
                      row_traj=batch.row_traj, old_logprobs=batch.old_logprobs)
    per_row = dict(fields=row_fields, extras=_row_extras(batch.extras, batch.num_rows),
                   adv=adv_tok, returns=_token_returns(adv, batch), ref=ref_lp,
                   tree=tree)  # tree rows are per block too: block (b, u) of each shard's trees
    off_metrics = {}
    if cfg.proximal:
        prox, *_ = fwd(state.params, tokens=batch.tokens, extras={**batch.extras, **tree},
                            want_entropy=False, blocks=cfg.blocks)
        prox = jax.lax.stop_gradient(prox)
        per_row["prox"] = prox
        if cfg.is_weights != "none":
            per_row["isw"] = losses.truncated_is_weights(
                prox, batch, level=cfg.is_level, cap=cfg.is_cap, mode=cfg.is_weights,
                lower=cfg.is_lower)
        off_metrics = off_policy_metrics(prox, batch, per_row.get("isw"), cfg)
    split = jax.tree.map(lambda x: _split_rows(x, cfg), per_row)  # [mini, micro, rows, ...]
    if mesh is not None:  # micro-batch (b, u) keeps block (b, u) of every shard on that shard
        mb_rows = NamedSharding(mesh, P(None, None, sharding_lib.BATCH_AXES))
        split = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, mb_rows), split)

    def micro_dens(mbd):  # the denominators depend on masks only: evaluate at lp = lp_old
        mb = _micro_batch(batch, mbd)
        z = jnp.zeros(mb.tokens.shape, jnp.float32)
        zk = (jnp.zeros(mb.extras["teacher_topk_ids"].shape, jnp.float32) if cfg.topk
              else None)
        return {k: d for k, (_, d) in _terms(mb.old_logprobs, z, z, mb, mbd["adv"], mbd["ref"],
                                             mbd["returns"], cfg, _off_policy_args(cfg, mbd),
                                             zk).items()}

    # Each mini-batch's denominators: sums over its micro-batches (counts are additive).
    dens = {k: jnp.sum(v, axis=1) for k, v in jax.vmap(jax.vmap(micro_dens))(split).items()}
    signal = jnp.any((split["adv"] != 0) & split["fields"]["action_mask"], axis=(1, 2, 3))
    signal = signal | bool((cfg.needs_values and cfg.value_coef) or cfg.sarsa_coef
                           or any(c for _, c, _ in cfg.aux_losses))  # losses of their own
    return split, dens, signal, off_metrics


def off_policy_metrics(prox, batch: TrajectoryBatch, weights, cfg: StepConfig) -> dict:
    """How far the sampling (behaviour) policy b is from the proximal policy p, over the
    action tokens: ``behaviour_kl_k3`` = mean of (r - 1) - log r with r = p / b (k3 estimate
    of KL(b || p), >= 0), ``is_weight_mean`` and ``is_ess`` of the raw weights r (at the
    correction's level; ESS as a fraction, 1 when on-policy), and ``is_corrected_frac``: the
    share of tokens whose weight ``weights`` (the truncated / masked ones, or None) was
    masked (0) or truncated (below r)."""
    m = batch.action_mask
    mf = m.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(mf), 1.0)
    lr = jnp.where(m, losses.log_ratio(prox, batch.old_logprobs), 0.0)
    raw = losses.truncated_is_weights(prox, batch, level=cfg.is_level, cap=jnp.inf)
    out = {"behaviour_kl_k3": jnp.sum(jnp.where(m, jnp.exp(lr) - 1.0 - lr, 0.0)) / n,
           "is_weight_mean": jnp.sum(raw) / n,
           "is_ess": jnp.sum(raw) ** 2 / jnp.maximum(n * jnp.sum(raw ** 2), 1e-30)}
    if weights is not None:  # masked (weight 0) or truncated (weight below the raw one)
        corrected = weights == 0 if cfg.is_weights == "mask" else weights < raw
        out["is_corrected_frac"] = jnp.sum(jnp.where(m, corrected.astype(jnp.float32),
                                                     0.0)) / n
    return out


def _micro_batch(batch: TrajectoryBatch, mbd) -> TrajectoryBatch:
    """The batch of one micro-batch's rows (``mbd``: one block of ``_step_inputs``' split)."""
    return batch.replace(**mbd["fields"], extras={**batch.extras, **mbd["extras"]})


def _micro_loss(fwd, cfg: StepConfig, batch: TrajectoryBatch):
    """``loss(params, mbd, den) -> (total, (term sums, diagnostic sums))`` of one micro-batch:
    every loss term's sum over the mini-batch's denominator, weighted by its coefficient."""
    coefs = _coefs(cfg)
    clip = _clip_params(cfg)

    def micro_loss(params, mbd, den):
        mb = _micro_batch(batch, mbd)
        at = mb.extras["teacher_topk_ids"] if cfg.topk else None
        lp, ent, values, outside, more = fwd(params, tokens=mb.tokens,
                                             extras={**mb.extras, **mbd["tree"]},
                                             want_entropy=True, remat=cfg.remat,
                                             blocks=cfg.data_shards, at=at)
        off = _off_policy_args(cfg, mbd)
        terms = _terms(lp, ent, values, mb, mbd["adv"], mbd["ref"], mbd["returns"], cfg, off,
                       more.get("at_lp"))
        total = sum(coefs[k] * s / jnp.maximum(den[k], 1.0) for k, (s, _) in terms.items())
        # token sums of the diagnostics (divided by the token count after the scans)
        pm = losses.policy_metrics(lp, mb, mbd["adv"], **(clip or {}),
                                   old_logprobs=off.get("old_logprobs"))
        if clip is None:
            pm = {k: v for k, v in pm.items() if "clip" not in k}
        diag = {k: s for k, (s, _) in pm.items()}
        diag["entropy"] = losses.aggregate(jax.lax.stop_gradient(ent), mb)[0]
        diag["outside_truncation_frac"] = losses.aggregate(outside.astype(jnp.float32), mb)[0]
        diag["tokens"] = jnp.sum(mb.action_mask.astype(jnp.float32))
        return total, ({k: s for k, (s, _) in terms.items()}, diag)

    return micro_loss


def _accumulate(grad_fn, params, mbs, den, aux0):
    """Gradients, loss and diagnostics summed over one mini-batch's micro-batches (a scan)."""
    def body(carry, mbd):
        g_acc, l_acc, aux_acc = carry
        (loss, aux), g = grad_fn(params, mbd, den)
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + loss,
                jax.tree.map(jnp.add, aux_acc, aux)), None

    g0 = jax.tree.map(jnp.zeros_like, params)
    (grads, loss, aux), _ = jax.lax.scan(body, (g0, jnp.zeros((), jnp.float32), aux0), mbs)
    return grads, loss, aux


def _apply_update(optimizer, params, opt_state, grads, loss, has_signal):
    """One optimizer update, kept only when the loss and gradient are finite and the
    mini-batch has a learning signal. Returns ``(params, opt_state, finite, grad_norm)``."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    apply = finite & has_signal
    updates, new_opt = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)  # noqa: E731
    return keep(new_params, params), keep(new_opt, opt_state), finite, grad_norm


def train_step(graphdef, rest, optimizer, cfg: StepConfig, state: TrainState,
               batch: TrajectoryBatch, *, mesh=None, state_shardings=None, residual=None,
               layer_use=None, trainable=nnx.Param, teacher_graph=None):
    """One step: ``cfg.ppo_epochs x cfg.mini_batches`` optimizer updates on one batch; pure
    (jit it with ``graphdef``, ``rest``, ``optimizer``, ``cfg`` static, or use
    ``make_train_step``). Returns ``(new_state, {"metrics": ..., "advantages": ...})``.

    The stages: advantages (``_step_outputs``: the models' outputs the methods read, then the
    credit pipeline on the batch with them, ``inputs.provide``) ->
    the rows each update reads (``_step_inputs``) -> per mini-batch, gradients accumulated
    over its micro-batches (``_accumulate``) -> the update (``_apply_update``), repeated for
    ``ppo_epochs`` passes -> metrics.

    ``mesh``: the batch is split over its ``data x fsdp`` axes (the estimator then runs under
    ``shard_map``); ``state_shardings``: the shardings the new state is constrained to;
    ``residual``: the residual stream's layout between layers (``sharding.residual_spec``;
    default: the rows' layout); ``layer_use``: the layout each layer's weights are used in
    (``sharding.layer_use_shardings``; default: XLA chooses, and may gather a weight once
    per use); ``trainable``: the filter of the parameters trained (``trainable_of``; the
    others get no gradient and keep their values); ``teacher_graph``: ``(graphdef, rest)``
    of a ``model`` teacher (its parameters are ``state.teacher_params``).
    """
    pin = None if mesh is None else NamedSharding(mesh, sharding_lib.batch_spec())
    residual = None if mesh is None or residual is None else NamedSharding(mesh, residual)
    fwd = functools.partial(_forward, graphdef, rest=rest, pin=pin, residual=residual,
                            layer_use=None if mesh is None else layer_use, cfg=cfg)
    all_blocks = cfg.blocks
    tree = _tree_of(batch.extras)  # prefix sharing: the model runs on the packed trees
    if tree and tree["tree_blocks"].shape[0] != all_blocks:
        raise ValueError(f"the prefix trees were packed in {tree['tree_blocks'].shape[0]} "
                         f"blocks, but this step splits the batch into data_shards x "
                         f"mini_batches x micro_batches = {all_blocks}: "
                         f"attach_prefix_trees(batch, num_blocks={all_blocks})")
    batch = batch.replace(extras={k: v for k, v in batch.extras.items() if k not in tree})
    trained, frozen = split_trainable(state.params, trainable)
    join = lambda p: nnx.merge_state(p, frozen)  # noqa: E731
    has_ref = not (isinstance(state.ref_params, tuple) and not state.ref_params)
    view = state.replace(ref_params=join(state.ref_params)) if has_ref else state
    tfwd = None
    if teacher_graph is not None:
        tfwd = functools.partial(_forward, teacher_graph[0], rest=teacher_graph[1], pin=pin,
                                 cfg=cfg)
    outputs = _step_outputs(graphdef, rest, fwd, tfwd, cfg, view, batch, tree, join)
    batch = batch.replace(extras={k: v for k, v in batch.extras.items()
                                  if k not in TEACHER_VIEW})
    adv, est_state = _run_estimator(cfg.pipeline, inputs.provide(batch, cfg.reads, outputs),
                                    state.est_state, mesh)
    batch = _with_token_outputs(batch, outputs)
    split, dens, signal, off_metrics = _step_inputs(fwd, cfg, view, batch, adv, tree, mesh)
    micro_loss = _micro_loss(fwd, cfg, batch)
    grad_fn = jax.value_and_grad(lambda p, mbd, den: micro_loss(join(p), mbd, den),
                                 has_aux=True)
    aux0 = jax.tree.map(lambda x: jnp.zeros((), jnp.float32),
                        jax.eval_shape(lambda: grad_fn(trained, jax.tree.map(
                            lambda x: x[0, 0], split), {k: v[0] for k, v in dens.items()})[0][1]))

    def update(carry, xs):
        params, opt_state, n_bad, n_idle = carry
        mbs, den, has_signal = xs
        grads, loss, aux = _accumulate(grad_fn, params, mbs, den, aux0)
        params, opt_state, finite, grad_norm = _apply_update(optimizer, params, opt_state,
                                                             grads, loss, has_signal)
        carry = (params, opt_state, n_bad + (~finite).astype(jnp.int32),
                 n_idle + (finite & ~has_signal).astype(jnp.int32))
        return carry, {"loss": loss, "grad_norm": grad_norm, "aux": aux}

    def epoch(carry, _):
        return jax.lax.scan(update, carry, (split, dens, signal))

    zero = jnp.zeros((), jnp.int32)
    (params, opt_state, n_bad, n_idle), per = jax.lax.scan(
        epoch, (trained, state.opt_state, zero, zero), None, length=cfg.ppo_epochs)
    rng, _ = jax.random.split(jax.random.wrap_key_data(state.rng))
    ok = n_bad == 0
    teacher_params = state.teacher_params
    if cfg.teacher == "ema":  # teacher <- d teacher + (1 - d) policy, after a finite step
        d = cfg.teacher_ema
        teacher_params = jax.tree.map(
            lambda t, p: jnp.where(ok, (d * t + (1.0 - d) * p).astype(t.dtype), t),
            state.teacher_params, params)
    new_state = state.replace(
        params=join(params), opt_state=opt_state,
        est_state=jax.tree.map(lambda a, b: jnp.where(ok, a, b), est_state, state.est_state),
        step=state.step + 1, rng=jax.random.key_data(rng), skipped=state.skipped + n_bad,
        idle=state.idle + n_idle, teacher_params=teacher_params)
    if state_shardings is not None:
        new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)

    metrics = _step_metrics(cfg, per, dens, n_bad, n_idle, jax.lax.stop_gradient(adv.token),
                            batch)
    metrics.update(off_metrics)
    metrics.update(teacher_metrics(outputs, batch))
    if cfg.policy_drift:
        run = functools.partial(_forward_only, cfg=cfg, batch=batch, tree=tree)
        new_lp = jax.lax.stop_gradient(run(fwd, join(params))[0])
        ref_lp = outputs["ref_logprobs"]
        if ref_lp is None and cfg.kl_coef:
            ref_lp = _unsplit_rows(split["ref"], cfg)
        elif ref_lp is None and has_ref:
            ref_lp = jax.lax.stop_gradient(run(fwd, view.ref_params)[0])
        metrics.update(drift_metrics(new_lp, batch, ref_lp))
    return new_state, {"metrics": metrics, "advantages": adv}


def make_train_step(model: nnx.Module, optimizer, cfg: StepConfig, *, donate: bool = False,
                    mesh=None, state_shardings=None, rules=None, teacher_model=None):
    """``step(state, batch) -> (state, out)`` jitted; ``model`` supplies the graph and any
    non-parameter state (e.g. RoPE tables are computed, so usually nothing).

    The batch must be packed into ``cfg.blocks = data_shards * mini_batches * micro_batches``
    blocks of whole groups (``pack_records(num_shards=cfg.blocks)``); with ``mesh`` its rows
    are split over the ``data x fsdp`` axes (``cfg.data_shards = data * fsdp``).
    ``state_shardings`` (``sharding.train_state_shardings``) pins the layout of the returned
    state. ``rules`` (default ``sharding.DEFAULT_RULES``): the partition rules; their
    ``activation_embed`` entry lays out the residual stream between layers
    (``sharding.residual_spec``), and each layer's weights are gathered once per layer per
    pass (``sharding.layer_use_shardings``).
    """
    if mesh is not None and cfg.data_shards != sharding_lib.batch_shards(mesh):
        raise ValueError(f"StepConfig.data_shards={cfg.data_shards} but the mesh splits the "
                         f"batch into data*fsdp={sharding_lib.batch_shards(mesh)} blocks")
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    rules = sharding_lib.DEFAULT_RULES if rules is None else rules
    residual = layer_use = None
    if mesh is not None and isinstance(model, Transformer):
        residual = sharding_lib.residual_spec(mesh, rules, model.config.hidden_size)
        layer_use = sharding_lib.layer_use_shardings(nnx.state(model.layers), mesh, rules)
    if (teacher_model is None) != (cfg.teacher != "model"):
        raise ValueError(f"StepConfig.teacher={cfg.teacher!r}: pass teacher_model exactly when "
                         f"the teacher is 'model'")
    teacher_graph = None
    if teacher_model is not None:
        t_graph, _, t_rest = nnx.split(teacher_model, nnx.Param, ...)
        teacher_graph = (t_graph, t_rest)
    fn = functools.partial(train_step, graphdef, rest, optimizer, cfg, mesh=mesh,
                           state_shardings=state_shardings, residual=residual,
                           layer_use=layer_use, trainable=trainable_of(model),
                           teacher_graph=teacher_graph)
    return jax.jit(fn, donate_argnums=(0,) if donate else ())
