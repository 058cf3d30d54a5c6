"""The train state and the jitted RL train step.

One step, for a packed ``TrajectoryBatch``::

    values   = V_theta(batch)                        (only for critic estimators)
    A, est'  = estimator(batch [+ values], est)      (registry; on the whole batch)
    for each micro-batch m (rows of whole trajectories):
        g += grad_theta [ P_m / D_P + kl_coef K_m / D_K - ent_coef H_m / D_H + v_coef V_m / D_V ]
    theta', opt' = optax update(g)   -- skipped (and counted) when the loss or g is not finite

where each term is a ``(sum, denominator)`` pair of a registry loss: the denominators are
those of the whole batch, so the micro-batched gradient equals the one-pass gradient (for
every aggregation mode, because micro-batches never split a trajectory).

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
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_agent import estimators, losses, segments
from jaxrl_agent import sharding as sharding_lib
from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.losses.kl import entropy_from_logits
from jaxrl_agent.models.transformer import token_logprobs
from jaxrl_agent.rollout.tree import TREE_KEYS

# What critic estimators read from the value head.
TOKEN_VALUE_ESTIMATORS = ("gae", "lambda_returns")
TURN_VALUE_ESTIMATORS = ("turn_gae", "sapo", "hae")
CRITIC_ESTIMATORS = TOKEN_VALUE_ESTIMATORS + TURN_VALUE_ESTIMATORS


def needs_hidden(estimator: str, params: dict) -> bool:
    """Estimators that read the policy's hidden state at each decision point: BiPACE's
    clusters (extras['hidden']) and GiGPO's similarity/bucket anchors (extras['state_features'])."""
    return estimator == "bipace" or (estimator == "gigpo"
                                     and params.get("anchor", "exact") != "exact")


@struct.dataclass
class TrainState:
    """Everything a resumed run needs on the device side.

    Attributes:
      params: ``nnx.State`` of the policy's ``nnx.Param`` leaves (value head included).
      opt_state: the optax state.
      step: int32, updates attempted so far = the policy version that the next rollouts use.
      rng: uint32 [2] PRNG key data (``jax.random.key_data``), split once per step.
      est_state: the estimator's state (SPO's tracker) or ``()``.
      ref_params: frozen reference parameters for the KL term, or ``()``.
      skipped: int32, updates skipped because the loss or the gradient was not finite.
    """

    params: Any
    opt_state: Any
    step: Any
    rng: Any
    est_state: Any = ()
    ref_params: Any = ()
    skipped: Any = 0


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
    micro_batches: int = 1
    remat: bool = False  # recompute each decoder layer in the backward pass
    data_shards: int = 1  # blocks of the batch (data x fsdp); the packer's num_shards / micro

    @property
    def needs_values(self) -> bool:
        return self.estimator in CRITIC_ESTIMATORS

    @property
    def needs_hidden(self) -> bool:
        return needs_hidden(self.estimator, dict(self.estimator_params))


def make_optimizer(lr: float, *, total_steps: int, warmup_steps: int = 0, decay: str = "cosine",
                   weight_decay: float = 0.0, grad_clip: float = 1.0, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """AdamW with linear warm-up, cosine (to 10% of ``lr``) or constant schedule, and global-norm
    clipping (``grad_clip <= 0`` turns it off).

    ``eps`` matters for RL on small models: Adam divides by ``sqrt(v) + eps``, so parameters
    whose gradients are tiny but consistently signed (the LM-head rows of tokens the policy
    almost never samples, nudged through the softmax by every negative advantage) move by a
    full ``lr`` per step unless ``eps`` is above their gradient scale.
    """
    total_steps = max(int(total_steps), 1)
    warmup_steps = min(max(int(warmup_steps), 0), total_steps - 1) if total_steps > 1 else 0
    if decay == "cosine":
        sched = optax.warmup_cosine_decay_schedule(
            0.0 if warmup_steps else lr, lr, warmup_steps, total_steps, end_value=0.1 * lr)
    elif decay == "constant":
        sched = (optax.linear_schedule(0.0, lr, warmup_steps) if warmup_steps
                 else optax.constant_schedule(lr))
        if warmup_steps:
            sched = optax.join_schedules([sched, optax.constant_schedule(lr)], [warmup_steps])
    else:
        raise ValueError(f"decay must be 'cosine' or 'constant', got {decay!r}")
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip and grad_clip > 0 else []
    parts.append(optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts)


def init_state(model: nnx.Module, optimizer: optax.GradientTransformation, *, seed: int,
               est_state=(), with_reference: bool = False) -> TrainState:
    return init_state_from_params(nnx.state(model, nnx.Param), optimizer, seed=seed,
                                  est_state=est_state, with_reference=with_reference)


def init_state_from_params(params, optimizer: optax.GradientTransformation, *, seed: int,
                           est_state=(), with_reference: bool = False) -> TrainState:
    """``init_state`` from the parameters (an ``nnx.State``); jit it with ``out_shardings`` to
    create the optimizer state (and reference copy) directly in its sharded layout."""
    return TrainState(
        params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.key(seed)), est_state=est_state,
        ref_params=jax.tree.map(jnp.copy, params) if with_reference else (),
        skipped=jnp.zeros((), jnp.int32))


# ----------------------------------------------------------------------------- forward


def _tree_of(extras: dict) -> dict:
    tree = {k: extras[k] for k in TREE_KEYS if k in extras}
    if tree and len(tree) != len(TREE_KEYS):
        raise ValueError(f"prefix-tree extras must come together: {TREE_KEYS}, got "
                         f"{sorted(tree)} (use rollout.tree.attach_prefix_trees)")
    return tree


def _at_prev(x, index, blocks: int):
    """Per-node outputs ``x`` [blocks * P, L, ...] read for every row token t at the node of
    token t - 1 (t = 0 reads token 0's node) -> [R, T, ...]. ``index`` [R, T] holds block-local
    slots; the gather is batched over the blocks, so it stays on each block's devices."""
    R, T = index.shape
    prev = jnp.concatenate([index[:, :1], index[:, :-1]], axis=1).reshape(blocks, R // blocks, T)
    xb = x.reshape((blocks, -1) + x.shape[2:])
    out = jax.vmap(lambda xs, i: jnp.take(xs, i, axis=0, mode="clip"))(xb, prev)
    return out.reshape((R, T) + x.shape[2:])


def _tree_logprobs(logits, tokens, index, blocks: int):
    """``token_logprobs`` of the unpacked rows from the packed trees' logits [blocks * P, L, V]:
    ``log p(tokens[r, t] | ...) = z[prev, tok] - logsumexp(z[prev])`` with ``prev`` the node of
    token t - 1; 0 at t = 0. Never builds an [R, T, V] copy of the logits."""
    R, T = index.shape
    z = logits.astype(jnp.float32).reshape(blocks, -1, logits.shape[-1])
    lse = jax.nn.logsumexp(z, axis=-1)
    prev = index[:, :-1].reshape(blocks, R // blocks, T - 1)
    nxt = jnp.asarray(tokens, jnp.int32)[:, 1:].reshape(blocks, R // blocks, T - 1)
    pick = jax.vmap(lambda zb, lb, p, n: zb.at[p, n].get(mode="clip") - lb.at[p].get(
        mode="clip"))(z, lse, prev, nxt).reshape(R, T - 1)
    return jnp.concatenate([jnp.zeros_like(pick[:, :1]), pick], axis=1)


def _forward(graphdef, params, rest, tokens, extras, *, want_entropy: bool, remat=False,
             pin=None, blocks: int = 1):
    """Per-token (log-prob, entropy, value) of the rows ``tokens`` [R, T]; with prefix-tree
    extras the model runs on the packed trees (``blocks`` of them) and the results are
    gathered back to the rows: the same numbers, each shared prefix computed once."""
    model = nnx.merge(graphdef, params, rest)
    tree = _tree_of(extras)
    if tree:
        out = model(tree["tree_tokens"], positions=tree["tree_positions"],
                    key_ends=tree["tree_ends"], remat=remat, activation_sharding=pin)
        idx = tree["tree_index"]
        lp = _tree_logprobs(out.logits, tokens, idx, blocks)
        first = (jnp.arange(tokens.shape[1]) == 0)[None, :]
        ent = (jnp.where(first, 0.0, _at_prev(entropy_from_logits(out.logits), idx, blocks))
               if want_entropy else None)
        values = (None if out.values is None else
                  jnp.where(first, 0.0, _at_prev(out.values, idx, blocks)))
        return lp, ent, values
    out = model(tokens, positions=extras.get("positions"), segment_ids=extras.get("segment_ids"),
                remat=remat, activation_sharding=pin)
    lp = token_logprobs(out.logits, tokens)
    ent = None
    if want_entropy:  # the entropy of the distribution token t was drawn from (logits at t - 1)
        h = entropy_from_logits(out.logits)
        ent = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
    values = out.values
    if values is not None:  # value of the state before token t (head read at t - 1)
        values = jnp.concatenate([jnp.zeros_like(values[:, :1]), values[:, :-1]], axis=1)
    return lp, ent, values


def _decision_hidden(graphdef, params, rest, batch: TrajectoryBatch, tree=None, blocks=1):
    """[N, K, D] final hidden state at each turn's decision point (the position before its
    first action token: the state the action was drawn from), detached."""
    model = nnx.merge(graphdef, params, rest)
    if tree:
        h = model(tree["tree_tokens"], positions=tree["tree_positions"],
                  key_ends=tree["tree_ends"], compute_logits=False).hidden.astype(jnp.float32)
        h = _at_prev(h, tree["tree_index"], blocks)
    else:
        h = model(batch.tokens, positions=batch.extras.get("positions"),
                  segment_ids=batch.extras.get("segment_ids"),
                  compute_logits=False).hidden.astype(jnp.float32)
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


def _attach_values(batch: TrajectoryBatch, values, cfg: StepConfig) -> TrajectoryBatch:
    values = jax.lax.stop_gradient(values)
    extras = dict(batch.extras)
    if cfg.estimator in TOKEN_VALUE_ESTIMATORS:
        extras["token_values"] = jnp.where(batch.action_mask, values, 0.0)
    else:  # before_token values at the first action token = V(s_k) ("before_action")
        at_token = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
        extras["turn_values"] = segments.turn_values_from_tokens(at_token, batch, "before_action")
        if cfg.estimator == "hae":
            # One value head serves both levels (HiPER with a single head does the same).
            # Subgoal boundaries come from envs that report info["subgoal"] (the collector
            # turns changes into extras['switch']); without them every episode is one
            # segment, and HAE is turn-level GAE with a one-step SMDP high stream.
            extras.setdefault("high_values", extras["turn_values"])
            extras.setdefault("switch", jnp.zeros(batch.turn_mask.shape, jnp.float32))
    return batch.replace(extras=extras)


def _split_rows(x, cfg: StepConfig):
    """[R, ...] -> [M, R / M, ...] such that micro-batch m holds block m of every data shard."""
    d, m = cfg.data_shards, cfg.micro_batches
    r = x.shape[0] // (d * m)
    x = x.reshape((d, m, r) + x.shape[1:])
    return jnp.moveaxis(x, 1, 0).reshape((m, d * r) + x.shape[3:])


# ----------------------------------------------------------------------------- the step


def _terms(lp, ent, values, mb: TrajectoryBatch, adv_tok, ref_lp, returns, cfg: StepConfig):
    """(sum, denominator) of every loss term on one (micro-)batch."""
    pol = losses.get(cfg.policy_loss)
    out = {"policy": pol(lp, mb, adv_tok, agg=cfg.agg, **dict(cfg.policy_params))}
    if cfg.kl_coef:
        out["kl"] = losses.get(cfg.kl_estimator)(lp, mb, ref_logprobs=ref_lp, agg=cfg.agg)
    if cfg.entropy_coef:
        out["entropy"] = losses.get("entropy")(ent, mb, agg=cfg.agg)
    if cfg.needs_values and cfg.value_coef:
        out["value"] = losses.get("value")(values, returns, mb.action_mask)
    return out


def _coefs(cfg: StepConfig) -> dict:
    return {"policy": 1.0, "kl": cfg.kl_coef, "entropy": -cfg.entropy_coef,
            "value": cfg.value_coef}


def _token_returns(adv: Advantages, batch: TrajectoryBatch):
    if adv.token_returns is not None:
        return adv.token_returns
    if adv.turn_returns is not None:
        return segments.turn_to_token(adv.turn_returns, batch)
    return jnp.zeros(batch.tokens.shape, jnp.float32)


def _run_estimator(pipe, est_batch, est_state, stateful: bool, mesh):
    """The estimator pipeline on the whole batch; under ``shard_map`` over the batch axes when
    the batch is split (groups are whole per shard, so only batch-wide statistics cross)."""
    if mesh is None or sharding_lib.batch_shards(mesh) == 1:
        return pipe(est_batch, state=est_state) if stateful else (pipe(est_batch), est_state)
    axes = sharding_lib.BATCH_AXES
    rows = sharding_lib.batch_spec()
    if stateful:
        f = lambda b, s: pipe(b, state=s, axis_name=axes)  # noqa: E731
        return jax.shard_map(f, mesh=mesh, in_specs=(rows, P()),
                             out_specs=(rows, P()))(est_batch, est_state)
    f = lambda b: pipe(b, axis_name=axes)  # noqa: E731
    return jax.shard_map(f, mesh=mesh, in_specs=(rows,), out_specs=rows)(est_batch), est_state


def train_step(graphdef, rest, optimizer, cfg: StepConfig, state: TrainState,
               batch: TrajectoryBatch, *, mesh=None, state_shardings=None):
    """One update; pure (jit it with ``graphdef``, ``rest``, ``optimizer``, ``cfg`` static, or
    use ``make_train_step``). Returns ``(new_state, metrics)``.

    ``mesh``: the batch is split over its ``data x fsdp`` axes (the estimator then runs under
    ``shard_map``); ``state_shardings``: the shardings the new state is constrained to.
    """
    pin = None if mesh is None else NamedSharding(mesh, sharding_lib.batch_spec())
    fwd = functools.partial(_forward, graphdef, rest=rest, pin=pin)
    all_blocks = cfg.data_shards * cfg.micro_batches
    tree = _tree_of(batch.extras)  # prefix sharing: the model runs on the packed trees
    if tree and tree["tree_blocks"].shape[0] != all_blocks:
        raise ValueError(f"the prefix trees were packed in {tree['tree_blocks'].shape[0]} "
                         f"blocks, but this step splits the batch into data_shards x "
                         f"micro_batches = {all_blocks}: attach_prefix_trees(batch, "
                         f"num_blocks={all_blocks})")
    batch = batch.replace(extras={k: v for k, v in batch.extras.items() if k not in tree})
    spec = estimators.spec(cfg.estimator)
    est_batch = batch
    if cfg.needs_values:
        _, _, v0 = fwd(state.params, tokens=batch.tokens, extras={**batch.extras, **tree},
                       want_entropy=False, blocks=all_blocks)
        est_batch = _attach_values(batch, v0, cfg)
    if cfg.needs_hidden:
        h = _decision_hidden(graphdef, state.params, rest, batch, tree, all_blocks)
        est_batch = est_batch.replace(extras={**est_batch.extras, "hidden": h,
                                              "state_features": h})
    pipe = estimators.Pipeline((cfg.estimator, cfg.estimator_params), cfg.shaping, cfg.then)
    adv, est_state = _run_estimator(pipe, est_batch, state.est_state, spec.stateful, mesh)
    adv_tok = jax.lax.stop_gradient(adv.token)
    returns = _token_returns(adv, batch)
    ref_lp = None
    if cfg.kl_coef:
        ref_lp, _, _ = fwd(state.ref_params, tokens=batch.tokens, extras={**batch.extras, **tree},
                           want_entropy=False, blocks=all_blocks)
        ref_lp = jax.lax.stop_gradient(ref_lp)

    # Whole-batch denominators (they depend on masks only: evaluate the terms at lp = lp_old).
    zeros = jnp.zeros(batch.tokens.shape, jnp.float32)
    dens = {k: d for k, (_, d) in _terms(batch.old_logprobs, zeros, zeros, batch, adv_tok,
                                         ref_lp if ref_lp is not None else zeros, returns,
                                         cfg).items()}
    coefs = _coefs(cfg)

    n_rows = batch.num_rows
    row_fields = dict(tokens=batch.tokens, action_mask=batch.action_mask, turn_ids=batch.turn_ids,
                      row_traj=batch.row_traj, old_logprobs=batch.old_logprobs)
    per_row = dict(fields=row_fields, extras=_row_extras(batch.extras, n_rows), adv=adv_tok,
                   returns=returns, ref=ref_lp if ref_lp is not None else zeros,
                   tree=tree)  # tree rows are per block too: block m of each shard's trees
    split = jax.tree.map(lambda x: _split_rows(x, cfg), per_row)
    if mesh is not None:  # micro-batch m keeps block m of every shard on that shard
        mb_rows = NamedSharding(mesh, P(None, sharding_lib.BATCH_AXES))
        split = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, mb_rows), split)

    def micro_loss(params, mbd):
        mb = batch.replace(**mbd["fields"], extras={**batch.extras, **mbd["extras"]})
        lp, ent, values = fwd(params, tokens=mb.tokens, extras={**mb.extras, **mbd["tree"]},
                              want_entropy=bool(cfg.entropy_coef), remat=cfg.remat,
                              blocks=cfg.data_shards)
        terms = _terms(lp, ent, values, mb, mbd["adv"], mbd["ref"], mbd["returns"], cfg)
        total = sum(coefs[k] * s / jnp.maximum(dens[k], 1.0) for k, (s, _) in terms.items())
        return total, {k: s for k, (s, _) in terms.items()}

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def body(carry, mbd):
        g_acc, l_acc, s_acc = carry
        (loss, sums), g = grad_fn(state.params, mbd)
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + loss,
                jax.tree.map(jnp.add, s_acc, sums)), None

    g0 = jax.tree.map(jnp.zeros_like, state.params)
    s0 = {k: jnp.zeros((), jnp.float32) for k in dens}
    (grads, loss, sums), _ = jax.lax.scan(body, (g0, jnp.zeros((), jnp.float32), s0), split)

    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    rng, _ = jax.random.split(jax.random.wrap_key_data(state.rng))
    new_state = state.replace(
        params=keep(new_params, state.params), opt_state=keep(new_opt, state.opt_state),
        est_state=keep(est_state, state.est_state), step=state.step + 1,
        rng=jax.random.key_data(rng), skipped=state.skipped + (~finite).astype(jnp.int32))
    if state_shardings is not None:
        new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)

    m = batch.action_mask
    mf = m.astype(jnp.float32)
    n_tok = jnp.maximum(jnp.sum(mf), 1.0)
    metrics = {
        "loss": loss, "grad_norm": grad_norm, "update_skipped": (~finite).astype(jnp.float32),
        "adv_mean": jnp.sum(jnp.where(m, adv_tok, 0.0)) / n_tok,
        "adv_abs": jnp.sum(jnp.where(m, jnp.abs(adv_tok), 0.0)) / n_tok,
        "adv_zero_frac": jnp.sum(jnp.where(m, (adv_tok == 0).astype(jnp.float32), 0.0)) / n_tok,
    }
    for k, s in sums.items():
        metrics[f"loss_{k}"] = s / jnp.maximum(dens[k], 1.0)
    return new_state, {"metrics": metrics, "advantages": adv}


def make_train_step(model: nnx.Module, optimizer, cfg: StepConfig, *, donate: bool = False,
                    mesh=None, state_shardings=None):
    """``step(state, batch) -> (state, out)`` jitted; ``model`` supplies the graph and any
    non-parameter state (e.g. RoPE tables are computed, so usually nothing).

    With ``mesh`` the batch must be split over its ``data x fsdp`` axes into
    ``cfg.data_shards = data * fsdp`` blocks of whole groups (``pack_records(num_shards=
    data_shards * micro_batches)``); ``state_shardings`` (``sharding.train_state_shardings``)
    pins the layout of the returned state.
    """
    if mesh is not None and cfg.data_shards != sharding_lib.batch_shards(mesh):
        raise ValueError(f"StepConfig.data_shards={cfg.data_shards} but the mesh splits the "
                         f"batch into data*fsdp={sharding_lib.batch_shards(mesh)} blocks")
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    fn = functools.partial(train_step, graphdef, rest, optimizer, cfg, mesh=mesh,
                           state_shardings=state_shardings)
    return jax.jit(fn, donate_argnums=(0,) if donate else ())
