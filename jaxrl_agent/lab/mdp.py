"""Finite-horizon tabular MDPs with a tabular softmax policy, and their exact values.

A task is a ``TabularMDP``: S states, A actions, horizon H (the number of turns K of a
rollout), transition P[s, a, s'], objective reward R[s, a] (what success means: the exact
values below are of this reward), absorbing ``terminal`` states (an episode ends when it
enters one, or after H actions), a start distribution (each start state is a *task*: the G
rollouts of a group share it) and the verifier's per-step checks ``check[s, a]`` in {0, 1}
(which steps a verifier exposes as correct: the prerequisite chain's V_d; 0 elsewhere).

A reward can also be paid on *arriving* in a state, ``arrival[s']`` (reaching the goal, a
success leaf): the reward of a step is R(s, a) + arrival(s').

The policy is pi(a | s) = softmax(logits[obs(s)])_a with ``logits`` [O, A], the same at every
turn: it sees the observation obs(s) (default the state itself, O = S). A chain's agent sees
which step it is at, not whether an earlier step already broke the chain.
Exact values by backward induction over the turn index t = 0..H-1 (gamma = 1):

    V_H(s)    = 0,
    Q_t(s, a) = R(s, a) + sum_s' P(s' | s, a) (arrival(s') + V_{t+1}(s'))   (0 for terminal s),
    V_t(s)    = sum_a pi(a | s) Q_t(s, a),
    A_t(s, a) = Q_t(s, a) - V_t(s).

The expected objective return (the success probability for a 0/1 terminal reward) is
J(pi) = sum_s start(s) V_0(s).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class TabularMDP:
    """Arrays of one task family instance (a pytree: pass it through ``jit``/``vmap``).

    Attributes:
      P: [S, A, S] float32 transition probabilities (rows sum to 1).
      R: [S, A] float32 objective reward of taking a in s.
      arrival: [S] float32 objective reward of arriving in s.
      terminal: [S] bool, absorbing states: the episode ends on entering one.
      start: [S] float32 start distribution (the task of a rollout group).
      check: [S, A] float32 in {0, 1}: the verifier exposes this step as correct.
      num_checks: [] float32, the number k of checks a rollout can pass (0: no verifier).
      obs: [S] int32, the observation the policy sees in s (its row of ``logits``).
      horizon: static int H, the most actions a rollout takes.
    """

    P: jax.Array
    R: jax.Array
    arrival: jax.Array
    terminal: jax.Array
    start: jax.Array
    check: jax.Array
    num_checks: jax.Array
    obs: jax.Array
    horizon: int = struct.field(pytree_node=False, default=1)

    @property
    def num_states(self) -> int:
        return self.P.shape[0]

    @property
    def num_actions(self) -> int:
        return self.P.shape[1]

    @property
    def num_obs(self) -> int:
        """O, the rows of the policy's logits (static: read from the shape of a host array)."""
        return int(np.asarray(self.obs).max()) + 1

    def zero_logits(self):
        """The uniform policy's logits [O, A]."""
        return jnp.zeros((self.num_obs, self.num_actions), jnp.float32)


def make_mdp(P, R, terminal, start, horizon, *, arrival=None, check=None,
             num_checks=0.0, obs=None) -> TabularMDP:
    """Builds and checks a ``TabularMDP`` from numpy-like arrays (host side).

    Raises ValueError naming the array when shapes disagree, P rows do not sum to 1, the
    start distribution is not a distribution or puts mass on terminal states.
    """
    P = np.asarray(P, np.float32)
    if P.ndim != 3 or P.shape[0] != P.shape[2]:
        raise ValueError(f"P must be [S, A, S], got shape {P.shape}")
    S, A, _ = P.shape
    R = np.asarray(R, np.float32)
    terminal = np.asarray(terminal, bool)
    start = np.asarray(start, np.float32)
    check = np.zeros((S, A), np.float32) if check is None else np.asarray(check, np.float32)
    arrival = np.zeros(S, np.float32) if arrival is None else np.asarray(arrival, np.float32)
    for name, x, shape in (("R", R, (S, A)), ("arrival", arrival, (S,)),
                           ("terminal", terminal, (S,)),
                           ("start", start, (S,)), ("check", check, (S, A))):
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    if (P < 0).any() or not np.allclose(P.sum(-1), 1.0, atol=1e-5):
        raise ValueError("P[s, a, :] must be a probability distribution for every s, a")
    if (start < 0).any() or not np.isclose(start.sum(), 1.0, atol=1e-5):
        raise ValueError("start must be a probability distribution over states")
    if (start[terminal] > 0).any():
        raise ValueError("start puts mass on a terminal state")
    obs = np.arange(S) if obs is None else np.asarray(obs)
    if obs.shape != (S,) or obs.min() < 0 or set(np.unique(obs)) != set(range(obs.max() + 1)):
        raise ValueError("obs must be [S] ints covering 0..O-1")
    if int(horizon) < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    return TabularMDP(jnp.asarray(P), jnp.asarray(R), jnp.asarray(arrival),
                      jnp.asarray(terminal), jnp.asarray(start),
                      jnp.asarray(check), jnp.float32(num_checks),
                      jnp.asarray(obs, jnp.int32), int(horizon))


def policy_probs(mdp: TabularMDP, logits):
    """pi [S, A] = softmax(logits[obs(s)]) over actions."""
    return jax.nn.softmax(logits, axis=-1)[mdp.obs]


def exact_values(mdp: TabularMDP, logits):
    """Exact time-indexed values of the softmax policy, by backward induction (gamma = 1).

    Returns ``(V, Q)``: V [H + 1, S] with V[H] = 0 and V[t, s] = 0 for terminal s; Q [H, S, A].
    The advantage is ``Q - V[:-1, :, None]`` (``exact_advantages``).
    """
    pi = policy_probs(mdp, logits)
    live = ~mdp.terminal

    def backup(v_next, _):
        q = mdp.R + jnp.einsum("sat,t->sa", mdp.P, mdp.arrival + v_next)
        q = jnp.where(live[:, None], q, 0.0)
        v = jnp.sum(pi * q, axis=-1)
        return v, (v, q)

    zero = jnp.zeros(mdp.num_states, jnp.float32)
    _, (v, q) = jax.lax.scan(backup, zero, None, length=mdp.horizon, reverse=True)
    return jnp.concatenate([v, zero[None]], axis=0), q


def exact_advantages(mdp: TabularMDP, logits):
    """A [H, S, A] = Q_t(s, a) - V_t(s) under softmax(logits)."""
    v, q = exact_values(mdp, logits)
    return q - v[:-1, :, None]


def expected_return(mdp: TabularMDP, logits):
    """J(pi) = sum_s start(s) V_0(s): the success probability for a 0/1 terminal reward."""
    v, _ = exact_values(mdp, logits)
    return jnp.dot(mdp.start, v[0])


def optimal_return(mdp: TabularMDP):
    """max_pi J(pi) by backward induction with a max over actions (the ceiling of a curve)."""
    live = ~mdp.terminal

    def backup(v_next, _):
        q = mdp.R + jnp.einsum("sat,t->sa", mdp.P, mdp.arrival + v_next)
        q = jnp.where(live[:, None], q, 0.0)
        v = jnp.max(q, axis=-1)
        return v, None

    v0, _ = jax.lax.scan(backup, jnp.zeros(mdp.num_states, jnp.float32), None,
                         length=mdp.horizon, reverse=True)
    return jnp.dot(mdp.start, v0)


def warm_start_logits(mdp: TabularMDP, beta: float, gamma: float = 0.9):
    """logits [S, A] = beta * onehot(argmax_a Q*_0(s, a)) with Q* of the discounted (gamma)
    problem: a policy that prefers a shortest successful plan by a factor e^beta (a stand-in
    for the training loop's supervised warm-up, where a uniform start never succeeds)."""
    live = ~mdp.terminal

    def backup(v_next, _):
        q = mdp.R + gamma * jnp.einsum("sat,t->sa", mdp.P, mdp.arrival + v_next)
        q = jnp.where(live[:, None], q, 0.0)
        return jnp.max(q, axis=-1), q

    _, q = jax.lax.scan(backup, jnp.zeros(mdp.num_states, jnp.float32), None,
                        length=mdp.horizon, reverse=True)
    if mdp.num_obs != mdp.num_states:
        raise ValueError("warm_start_logits needs a fully observed MDP (obs = the state)")
    return beta * jax.nn.one_hot(jnp.argmax(q[0], axis=-1), mdp.num_actions)
