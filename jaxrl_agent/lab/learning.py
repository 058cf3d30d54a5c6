"""Learning curves: train the tabular policy with an arm's credit and the PPO loss.

One training step (jitted, ``vmap``-ed over seeds, ``lax.scan``-ed over steps):

    batch   = sample num_groups x group_size rollouts of softmax(logits)
    C       = arm.credit(batch)                              (stop-gradient)
    C       = C / sqrt(mean over valid turns of C^2)         (``scale="rms"``, the default)
    for each of ``epochs`` passes over the batch:
        loss    = ppo(log softmax(logits)[s_k, a_k], batch, C)   (token mean, clip 0.2,
                                                                  dual clip 3: the default)
        logits <- sgd(lr) (or adam(lr)) step on loss

Why ``scale="rms"``: an estimator's overall scale acts as a learning rate (GiGPO adds a
step-level term of unit scale to GRPO's and so roughly doubles it). Dividing each batch's
credit by its root mean square compares arms at equal step size: only the *direction* of the
update, i.e. which turns get how much credit, differs. A batch whose credit is all zero stays
zero. ``scale="none"`` trains on the raw credit.

The curve is the *exact* success probability J(pi) = sum_s start(s) V_0(s) after every
step (``mdp.expected_return``), so it carries no evaluation noise: the spread across seeds
is the training noise alone. ``summarize`` gives the mean and a 95% t confidence interval
over seeds (sample std, ddof = 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy.stats import t as student_t

from jaxrl_agent import losses
from jaxrl_agent.lab.arms import Arm
from jaxrl_agent.lab.mdp import TabularMDP, expected_return
from jaxrl_agent.lab.sampling import sample_batch


OPTIMIZERS = {"sgd": optax.sgd, "adam": optax.adam}


def _train_one(key, mdp: TabularMDP, *, arm: Arm, steps: int, num_groups: int,
               group_size: int, lr: float, epochs: int, clip: float, optimizer: str,
               scale: str, init_logits):
    opt = OPTIMIZERS[optimizer](lr)
    logits = jnp.asarray(init_logits, jnp.float32)

    def step(carry, key_t):
        logits, opt_state = carry
        batch, roll = sample_batch(key_t, mdp, logits, num_groups, group_size)
        credit = jax.lax.stop_gradient(arm.credit(batch))
        if scale == "rms":
            m = batch.turn_mask
            ms = jnp.sum(jnp.where(m, credit * credit, 0.0)) / jnp.maximum(jnp.sum(m), 1)
            credit = jnp.where(ms > 1e-12, credit / jnp.sqrt(jnp.maximum(ms, 1e-12)), 0.0)

        def loss_fn(params):
            lp = jax.nn.log_softmax(params, axis=-1)[mdp.obs[roll["state"]], roll["action"]]
            total, count = losses.ppo(lp, batch, credit, clip_low=clip, clip_high=clip)
            return total / jnp.maximum(count, 1.0)

        def epoch(c, _):
            params, st = c
            updates, st = opt.update(jax.grad(loss_fn)(params), st, params)
            return (optax.apply_updates(params, updates), st), None

        (logits, opt_state), _ = jax.lax.scan(epoch, (logits, opt_state), None, length=epochs)
        return (logits, opt_state), (expected_return(mdp, logits), jnp.mean(batch.outcome))

    keys = jax.random.split(key, steps)
    _, (success, sampled) = jax.lax.scan(step, (logits, opt.init(logits)), keys)
    j0 = expected_return(mdp, logits)
    return jnp.concatenate([j0[None], success]), sampled


@functools.lru_cache(maxsize=None)
def _trainer(arm: Arm, steps: int, num_groups: int, group_size: int, lr: float, epochs: int,
             clip: float, optimizer: str, scale: str):
    def fn(key, mdp, init):
        return _train_one(key, mdp, arm=arm, steps=steps, num_groups=num_groups,
                          group_size=group_size, lr=lr, epochs=epochs, clip=clip,
                          optimizer=optimizer, scale=scale, init_logits=init)

    return jax.jit(jax.vmap(fn, in_axes=(0, None, None)))


def train_curves(mdp: TabularMDP, arm: Arm, *, seeds: int = 8, steps: int = 100,
                 num_groups: int = 4, group_size: int = 8, lr: float = 5.0, epochs: int = 2,
                 clip: float = 0.2, optimizer: str = "sgd", scale: str = "rms",
                 init_logits=None, seed: int = 0) -> np.ndarray:
    """Exact success J after 0..steps training steps for each seed: [seeds, steps + 1].
    ``optimizer``: ``"sgd"`` (default: the step follows the credit's magnitude, so credit
    quality shows) or ``"adam"`` (per-logit normalisation: any consistent sign learns fast).
    ``init_logits`` [O, A]: the starting policy (default uniform: zeros).
    Deterministic for (seed, settings)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
    if scale not in ("rms", "none"):
        raise ValueError(f"scale must be 'rms' or 'none', got {scale!r}")
    init = (mdp.zero_logits() if init_logits is None
            else jnp.asarray(init_logits, jnp.float32))
    keys = jax.random.split(jax.random.PRNGKey(seed), seeds)
    success, _ = _trainer(arm, steps, num_groups, group_size, float(lr), epochs, float(clip),
                          optimizer, scale)(keys, mdp, init)
    return np.asarray(success)


def summarize(curves: np.ndarray, level: float = 0.95) -> dict:
    """Mean, std and the half-width of a ``level`` t confidence interval over seeds, per step
    ([steps + 1] each), and the same for the final value and for the area under the curve
    (the mean over steps)."""
    curves = np.asarray(curves, np.float64)
    n = curves.shape[0]
    q = float(student_t.ppf(0.5 + level / 2, n - 1)) if n > 1 else 0.0

    def stats(x):
        sd = x.std(axis=0, ddof=1) if n > 1 else np.zeros_like(x[0])
        return x.mean(axis=0), sd, q * sd / np.sqrt(n)

    mean, sd, half = stats(curves)
    out = dict(mean=mean.tolist(), std=sd.tolist(), ci=half.tolist())
    for name, x in (("final", curves[:, -1]), ("auc", curves.mean(axis=1))):
        m, s, h = stats(x[:, None])
        out[name] = dict(mean=float(m[0]), std=float(s[0]), ci=float(h[0]))
    return out


def paired_difference(a: np.ndarray, b: np.ndarray, level: float = 0.95) -> dict:
    """a - b per seed (same seeds, so paired), mean with a t confidence interval, and how many
    seeds have a > b. ``a``, ``b``: [seeds] (a final value or an AUC per seed)."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    n = len(d)
    q = float(student_t.ppf(0.5 + level / 2, n - 1)) if n > 1 else 0.0
    half = q * d.std(ddof=1) / np.sqrt(n) if n > 1 else 0.0
    return dict(mean=float(d.mean()), ci=float(half), wins=int((d > 0).sum()), seeds=n)
