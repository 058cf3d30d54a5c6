"""Sampling rollouts of the tabular policy and packing them as a ``TrajectoryBatch``, in JAX.

A batch holds ``num_groups`` groups of ``group_size`` rollouts (N = num_groups * group_size);
the rollouts of a group share a start state (their task). Every rollout has K = H turn slots;
turn k exists until the rollout enters a terminal state.

Layout (concatenated, one action token per turn, so R = N rows and T = K columns, and
token [n, k] *is* turn (n, k)): ``tokens`` = the action id, ``action_mask`` = ``turn_mask``,
``turn_ids`` = k, ``old_logprobs`` = log pi(a_k | s_k), ``state_keys`` = the observation id
obs(s_k) (what the agent saw; the state id where the task is fully observed, so GiGPO's
anchors recur exactly when states do), ``action_keys`` = the action id, ``turn_rewards`` = the
objective reward of the step, ``outcome`` = the rollout's objective return (success),
``group_ids`` = the index of the group's first rollout, ``task_ids`` = the start state.

Extras (declared in ``extra_levels``):
  ``score`` [N]: the continuous verifier score (outcome + passed checks) / (1 + k) where the
    task has k checks (the prerequisite chain), else the outcome;
  ``progress`` [N, K]: 1 on the turns the verifier checked and found correct (the targeting
    weights of the credit-targeting paper);
  ``progress_shuffled`` [N, K]: ``progress`` permuted at random within each rollout's valid
    turns, drawn fresh every batch (the matched-concentration shuffled control);
  ``turn_values`` [N, K]: the exact V_k(s_k) under the sampling policy (an oracle critic, so
    critic-based estimators such as ``turn_gae`` can run);
  ``potential`` [N, K]: the same exact V_k(s_k) as a shaping potential (PiCA's and PBRS's
    success-probability potential Phi, here known exactly);
  ``exact_adv`` [N, K]: the exact A_k(s_k, a_k), the answer the lab scores against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_agent.batch import TrajectoryBatch
from jaxrl_agent.lab.mdp import TabularMDP, exact_values

EXTRA_LEVELS = (("exact_adv", "turn"), ("potential", "turn"), ("progress", "turn"),
                ("progress_shuffled", "turn"), ("score", "traj"), ("turn_values", "turn"))


def sample_rollouts(key, mdp: TabularMDP, logits, num_groups: int, group_size: int) -> dict:
    """Rollouts of softmax(logits): a dict of arrays [N, K] (``state``, ``action``, ``mask``,
    ``reward``, ``logprob``, ``check``) and [N] (``start``). Jittable; N = num_groups *
    group_size, K = H."""
    n = num_groups * group_size
    k_start, k_steps = jax.random.split(key)
    starts = jax.random.categorical(k_start, jnp.log(mdp.start), shape=(num_groups,))
    s0 = jnp.repeat(starts, group_size)
    logp_all = jax.nn.log_softmax(logits, axis=-1)[mdp.obs]  # [S, A]

    def step(carry, key_t):
        s, alive = carry
        k_a, k_s = jax.random.split(key_t)
        a = jax.random.categorical(k_a, logp_all[s])
        s_next = jax.random.categorical(k_s, jnp.log(mdp.P[s, a]))  # -inf: impossible
        r = mdp.R[s, a] + mdp.arrival[s_next]
        out = dict(state=s, action=a, mask=alive, reward=jnp.where(alive, r, 0.0),
                   logprob=logp_all[s, a], check=jnp.where(alive, mdp.check[s, a], 0.0))
        return (s_next, alive & ~mdp.terminal[s_next]), out

    alive0 = jnp.ones(n, bool)
    _, out = jax.lax.scan(step, (s0, alive0), jax.random.split(k_steps, mdp.horizon))
    out = {name: x.T for name, x in out.items()}  # [K, N] -> [N, K]
    out["start"] = s0
    return out


def shuffle_within_rows(key, w, mask):
    """w [N, K] with the values of each row's valid turns (a prefix) randomly permuted."""
    u = jax.random.uniform(key, w.shape)
    order = jnp.argsort(jnp.where(mask, u, 2.0), axis=1)  # valid slots first, random order
    return jnp.where(mask, jnp.take_along_axis(w, order, axis=1), 0.0)


def to_batch(roll: dict, mdp: TabularMDP, logits, group_size: int, key=None) -> TrajectoryBatch:
    """Packs ``sample_rollouts`` output as a concatenated ``TrajectoryBatch`` (see the module
    docstring for the fields and extras). ``key`` draws the shuffled-control permutation."""
    s, a, m = roll["state"], roll["action"], roll["mask"]
    n, k = s.shape
    turn = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None], (n, k))
    v, q = exact_values(mdp, logits)
    t_idx = jnp.broadcast_to(jnp.arange(k)[None], (n, k))
    values = jnp.where(m, v[t_idx, s], 0.0)
    adv = jnp.where(m, q[t_idx, s, a] - v[t_idx, s], 0.0)
    outcome = jnp.sum(roll["reward"], axis=1)
    checks = jnp.sum(roll["check"], axis=1)
    score = jnp.where(mdp.num_checks > 0, (outcome + checks) / (1.0 + mdp.num_checks), outcome)
    progress = jnp.where(m, roll["check"], 0.0)
    key = jax.random.PRNGKey(0) if key is None else key
    extras = dict(score=score.astype(jnp.float32), progress=progress,
                  progress_shuffled=shuffle_within_rows(key, progress, m),
                  turn_values=values.astype(jnp.float32), potential=values.astype(jnp.float32),
                  exact_adv=adv.astype(jnp.float32))
    return TrajectoryBatch(
        tokens=jnp.where(m, a, 0).astype(jnp.int32), action_mask=m,
        turn_ids=jnp.where(m, turn, -1), row_traj=jnp.arange(n, dtype=jnp.int32),
        old_logprobs=jnp.where(m, roll["logprob"], 0.0).astype(jnp.float32), turn_mask=m,
        turn_rewards=roll["reward"].astype(jnp.float32),
        state_keys=jnp.where(m, mdp.obs[s], 0).astype(jnp.uint32),
        action_keys=jnp.where(m, a, 0).astype(jnp.uint32),
        group_ids=(jnp.arange(n, dtype=jnp.int32) // group_size) * group_size,
        task_ids=roll["start"].astype(jnp.int32), traj_mask=jnp.ones(n, bool),
        outcome=outcome.astype(jnp.float32), extras=extras, layout="concatenated",
        extra_levels=EXTRA_LEVELS)


def sample_batch(key, mdp: TabularMDP, logits, num_groups: int, group_size: int):
    """(batch, rollouts): ``sample_rollouts`` then ``to_batch``. Jittable; deterministic for
    a key."""
    k_roll, k_shuf = jax.random.split(key)
    roll = sample_rollouts(k_roll, mdp, logits, num_groups, group_size)
    return to_batch(roll, mdp, logits, group_size, k_shuf), roll
