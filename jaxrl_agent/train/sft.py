"""Supervised warm-up on solver demonstrations (behaviour cloning of ``env.solver()``).

The demonstrations are rollout records built with the same tokenisation as the collector
(``prompt_prefix``, ``observation_template``, action text + EOS), so the warm-up trains on
exactly the prompts the RL rollouts will show the policy. The loss is the token-mean negative
log-likelihood of the action tokens:  L = -sum_t m_t log p(x_t | x_<t) / sum_t m_t.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl_agent.batch import round_up_to_step
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.envs.base import Task, run_episode, solver_policy
from jaxrl_agent.models.transformer import LoRAParam, token_logprobs
from jaxrl_agent.rollout.collect import RolloutConfig
from jaxrl_agent.train.step import warmup_schedule

__all__ = ["demonstration_records", "sft_loss", "run_sft"]


def demonstration_records(env, tasks: Sequence[Task], codec, config: RolloutConfig, *,
                          noise: float = 0.0, seed: int = 0) -> list[dict]:
    """The solver's episodes, tokenised as ``collect_groups`` would: one record per episode, or
    one per turn with ``config.history == "last"`` (each prompt is then self-contained, so a
    mini-batch of ``n`` records is ``n`` turns).

    ``noise`` = eps makes the demonstrator imperfect: at every turn, with probability eps, it
    takes ``env.random_action(rng)`` instead of ``env.solver()`` (the episode continues from
    wherever that action leads, and the random action is what the record holds). Cloning such
    a demonstrator gives a policy that solves part of the tasks and errs at about the
    demonstrator's rate everywhere: errors that a policy-gradient phase can remove, where a
    clean demonstrator leaves little for RL to improve. ``seed`` fixes the coin flips."""
    eos = codec.eos_token_id
    if eos is None:
        raise ValueError("the codec has no eos_token_id; demonstrations need one")
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise!r}")
    rng = random.Random(seed)
    if noise > 0:
        try:
            env.clone().random_action(random.Random(0))
        except NotImplementedError as e:
            raise ValueError(str(e)) from None
    records, failures = [], []
    for task in tasks:
        try:
            turns = _solver_episode(env, task, codec, config, eos, noise, rng)
        except Exception as e:  # a faulty env loses that episode, not the run
            failures.append(f"{task.id}: {type(e).__name__}: {e}")
            continue
        if config.history == "last":
            records.extend({"group": f"{task.id}#{k}", "task": task.id, "turns": [t]}
                           for k, t in enumerate(turns))
        elif turns:
            records.append({"group": task.id, "task": task.id, "turns": turns})
    if failures and not records:
        raise RuntimeError(f"every demonstration episode failed; first: {failures[0]}")
    return records


def _solver_episode(env, task, codec, config: RolloutConfig, eos: int, noise: float,
                    rng: random.Random) -> list[dict]:
    e = env.clone()
    policy = solver_policy(e)
    if noise > 0:
        policy = lambda _obs: e.random_action(rng) if rng.random() < noise else e.solver()  # noqa: E731
    ep = run_episode(e, policy, task, max_turns=config.max_turns)
    turns = []
    for k, (obs, text, reward) in enumerate(zip(ep.observations, ep.actions, ep.rewards)):
        prefix = list(config.prompt_prefix) if (config.history == "last" or k == 0) else []
        ob = prefix + list(codec.encode(config.observation_template.format(observation=obs)))
        turns.append({"observation": ob, "action": list(codec.encode(text)) + [eos],
                      "reward": float(reward)})
    return turns


def sft_loss(graphdef, rest, params, batch):
    model = nnx.merge(graphdef, params, rest)
    extras = batch.extras
    out = model(batch.tokens, positions=extras.get("positions"),
                segment_ids=extras.get("segment_ids"), compute_logits=True)
    lp = token_logprobs(out.logits, batch.tokens)
    m = batch.action_mask.astype(jnp.float32)
    return -jnp.sum(lp * m) / jnp.maximum(jnp.sum(m), 1.0)


def run_sft(model: nnx.Module, records: list[dict], *, steps: int, batch_size: int, lr: float,
            layout: str, seed: int = 0, pad_to: dict | None = None,
            on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Trains ``model`` in place for ``steps`` AdamW steps (linear warm-up over the first 10%,
    starting above 0, then cosine decay) on random mini-batches of ``batch_size`` demonstration records.

    ``pad_to`` fixes the packed shape (one compile); by default it is the bucketed shape of the
    longest records. Returns the loss of every step; ``on_step(step, loss)`` is called after
    each.

    Every weight but LoRA adapters is trained: the warm-up stands in for the base checkpoint
    a LoRA run starts from, so its adapters stay at their initial value (``lora_b = 0``: the
    warm-up model exactly) until RL trains them.
    """
    if steps <= 0 or not records:
        return []
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    graphdef, params, rest = nnx.split(model, nnx.All(nnx.Param, nnx.Not(LoRAParam)), ...)
    sched = warmup_schedule(lr, steps, min(max(1, steps // 10), steps - 1))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
    opt_state = opt.init(params)
    loss_fn = functools.partial(sft_loss, graphdef, rest)

    @jax.jit
    def update(params, opt_state, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    if pad_to is None:
        longest = sorted(records, key=lambda r: -sum(len(t["observation"]) + len(t["action"])
                                                     for t in r["turns"]))[:batch_size]
        b, _ = pack_records(longest, layout=layout)
        pad_to = {"num_traj": b.num_traj, "num_turns": b.num_turns, "row_len": b.row_len,
                  "num_rows": b.num_rows if layout == "concatenated"
                  else batch_size * b.num_turns}
    rng = random.Random(seed)
    out = []
    for i in range(1, steps + 1):
        chosen = rng.sample(records, min(batch_size, len(records)))
        fixed = pad_to
        if layout == "per_step" and "num_rows" in pad_to:  # rows for the turns taken
            need = sum(len(r["turns"]) for r in chosen)
            full = pad_to["num_rows"]  # steps of >= 64 rows: a small warm-up compiles once
            fixed = dict(pad_to, num_rows=round_up_to_step(min(need, full), full,
                                                           min_step=64))
        batch, _ = pack_records(chosen, layout=layout, pad_to=fixed)
        params, opt_state, loss = update(params, opt_state, batch)
        loss = float(loss)
        if not np.isfinite(loss):
            raise FloatingPointError(f"supervised warm-up: loss is {loss} at step {i}")
        out.append(loss)
        if on_step is not None:
            on_step(i, loss)
    nnx.update(model, params)
    return out
