"""Arms: the credit rules the lab compares, as registered estimator pipelines.

An arm maps a lab batch to per-turn credit C [N, K] (the estimator's ``Advantages.token``;
with one action token per turn, token [n, k] is turn (n, k)). Spec syntax on the command
line and in ``parse_arm``:

    ESTIMATOR                       a registered estimator with its defaults (``grpo``, ``gigpo``)
    SHAPING:ESTIMATOR               a registered shaping stage first (``uniform:step_group``)
    ESTIMATOR+TRANSFORM[+...]       registered transforms after it (``grpo+reallocate``)
    NAMED                           one of ``NAMED_ARMS`` below (compositions with settings)

Named arms (the credit-targeting paper's arms are compositions of registered stages):

    sparse      grpo on the binary outcome (the "sparse binary outcome" arm)
    uniform     shaping ``uniform(score="score")`` -> ``step_group(episode_reward="reward_sum",
                step_weight=0)``: GRPO on the continuous verifier score S_i spread uniformly,
                r[i, k] = S_i / K_i (the "uniform redistribution of a dense reward" arm)
    targeted    ``uniform`` then ``reallocate(weights="progress")``: the same advantage
                concentrated on the turns the verifier found correct
    shuffled    ``uniform`` then ``reallocate(weights="progress_shuffled")``: the same weights
                permuted at random within each rollout (matched-concentration shuffled control;
                the lab draws a fresh permutation per batch, where the registered
                ``shuffled_control`` hashes a static seed)
    mc_minus_v  ``turn_gae(lam=1, normalization="none")`` with the exact V as the critic:
                A_k = G_k - V_k(s_k), unbiased for the exact advantage (an oracle baseline)
    exact       the exact advantage A_k(s_k, a_k) itself (the ceiling; not an estimator)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_agent import estimators
from jaxrl_agent.batch import TrajectoryBatch

_UNIFORM = dict(estimator=("step_group", {"episode_reward": "reward_sum", "step_weight": 0.0}),
                shaping=[("uniform", {"score": "score"})])

NAMED_ARMS = {
    "sparse": (dict(estimator=("grpo", {})), "GRPO on the binary outcome"),
    "uniform": (_UNIFORM, "GRPO on the verifier score, spread uniformly over turns"),
    "targeted": (dict(_UNIFORM, then=[("reallocate", {"weights": "progress"})]),
                 "uniform's advantage concentrated on verified-correct turns"),
    "shuffled": (dict(_UNIFORM, then=[("reallocate", {"weights": "progress_shuffled"})]),
                 "targeted's weights permuted within the rollout (matched control)"),
    "mc_minus_v": (dict(estimator=("turn_gae", {"lam": 1.0, "normalization": "none"})),
                   "return-to-go minus the exact V (oracle critic)"),
    "exact": (None, "the exact advantage (ceiling)"),
}


@dataclasses.dataclass(frozen=True)
class Arm:
    """A named credit rule. ``pipeline`` is None only for the ``exact`` oracle."""

    name: str
    pipeline: estimators.Pipeline | None
    description: str

    def credit(self, batch: TrajectoryBatch):
        """Per-turn credit [N, K] (0 off the valid turns). Jittable."""
        if self.pipeline is None:
            c = batch.extras["exact_adv"]
        else:
            c = self.pipeline(batch).token
        return jnp.where(batch.turn_mask, c, 0.0)


def known_arms() -> str:
    """A one-paragraph list of what ``parse_arm`` accepts (for error messages)."""
    return (f"named arms: {', '.join(NAMED_ARMS)}; estimators: "
            f"{', '.join(estimators.names('estimator'))}; shaping (NAME:EST): "
            f"{', '.join(estimators.names('shaping'))}; transforms (EST+NAME): "
            f"{', '.join(estimators.names('transform'))}")


def parse_arm(spec: str) -> Arm:
    """An ``Arm`` from a spec string (module docstring); ValueError listing the known names."""
    spec = spec.strip()
    if spec in NAMED_ARMS:
        stages, desc = NAMED_ARMS[spec]
        if stages is None:
            return Arm(spec, None, desc)
        est, params = stages["estimator"]
        pipe = estimators.Pipeline.build(est, params, shaping=stages.get("shaping", ()),
                                         then=stages.get("then", ()))
        return Arm(spec, pipe, desc)
    shaping, _, rest = spec.rpartition(":")
    est, *then = rest.split("+")
    try:
        pipe = estimators.Pipeline.build(est, {}, shaping=[s for s in shaping.split(":") if s],
                                         then=then)
    except ValueError as e:  # the registry's own list of names is in known_arms() below
        raise ValueError(f"arm {spec!r}: {str(e).split('; known: ')[0]}\n{known_arms()}") from None
    if pipe.stateful:
        raise ValueError(f"arm {spec!r}: {est!r} is stateful (a persistent value tracker); "
                         f"the lab runs stateless estimators only")
    return Arm(spec, pipe, " -> ".join(pipe.names))


def parse_arms(text: str) -> list[Arm]:
    """Comma-separated specs -> arms (duplicates rejected)."""
    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise ValueError("no estimators given")
    twice = sorted({s for s in specs if specs.count(s) > 1})
    if twice:
        raise ValueError(f"estimator(s) given twice: {', '.join(twice)}")
    return [parse_arm(s) for s in specs]
