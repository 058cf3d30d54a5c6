"""The checks of a run configuration that ask the rest of the package.

``jaxrl_agent.config`` is the schema: dataclasses, YAML, overrides and the checks of each
section's values on their own. What needs the registries, the environments or a trace of the
run's methods lives here, and ``config`` hands over to it (``config.validate``, ``from_dict``,
``load``):

* ``load_imports``: the run's plug-in modules, imported before any name is looked up;
* ``canonical_params``: former hyper-parameter names replaced by today's;
* ``with_env_base_dir``: a task-file environment reads its files next to the config file;
* ``check_env``, ``check_estimator``, ``check_loss``: registered names and their arguments;
* ``check_methods``: the pipeline and the policy loss traced once on a tiny batch like the
  loop's (``dry_batch``), after ``check_reads`` (every input a method reads is one the loop
  supplies, ``train.inputs.LOOP_INPUTS``);
* ``check_group_size``: an estimator that compares a task's rollouts needs two of them.

``config.validate`` runs them between its own section checks, in the order of the sections;
each raises ``config.ConfigError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agent import config, envs, estimators, losses, registry
from jaxrl_agent.config import ConfigError, RunConfig
from jaxrl_agent.estimators.pipeline import type_error
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.train.inputs import LOOP_INPUTS, SOURCES

#: loss arguments the train step passes itself (not hyper-parameters a config may set)
_TRAINER_SUPPLIED = ("old_logprobs", "is_weights", "agg", "agg_constant", "axis_name")


def _kwonly(fn, exclude=()) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in exclude]


def load_imports(cfg: RunConfig) -> None:
    """Imports the run's plug-in modules (``cfg.imports``); ``ConfigError`` naming the item
    when one cannot be found or fails to import."""
    for i, item in enumerate(cfg.imports):
        try:
            registry.load_imports([item])
        except ImportError as e:
            raise ConfigError(f"imports[{i}]: {e}") from None


def canonical_params(cfg: RunConfig) -> RunConfig:
    """``cfg`` with former hyper-parameter names of the estimator, its stages and the policy
    loss replaced by the current ones (``registry.Entry.renamed``), so configs written before a
    rename keep working and the run records today's names. Names not registered (yet) and
    malformed stages pass unchanged (validation reports them)."""
    def fix(name, params, kind, key):
        e = registry.find(name, kind) if isinstance(name, str) else None
        if e is None or not isinstance(params, dict):
            return params
        try:
            return e.canonical(params)
        except ValueError as err:
            raise ConfigError(f"{key}: {err}") from None

    est = cfg.estimator
    staged = {}
    for which in ("shaping", "then"):
        items = []
        for i, item in enumerate(getattr(est, which)):
            if isinstance(item, dict) and isinstance(item.get("params"), dict):
                item = dict(item, params=fix(item.get("name"), item["params"], "estimator",
                                             f"estimator.{which}[{i}].params"))
            items.append(item)
        staged[which] = items
    est = dataclasses.replace(est, params=fix(est.name, est.params, "estimator",
                                              "estimator.params"), **staged)
    loss = dataclasses.replace(cfg.loss, params=fix(cfg.loss.policy, cfg.loss.params, "loss",
                                                    "loss.params"))
    return dataclasses.replace(cfg, estimator=est, loss=loss)


def with_env_base_dir(cfg: RunConfig, base_dir: str) -> RunConfig:
    """An environment whose constructor takes ``base_dir`` (files it reads, such as a task
    file, relative to it) gets the config file's directory unless the config sets it, so a
    config finds its files from any working directory (and the run records the path)."""
    if "base_dir" in cfg.env.kwargs:
        return cfg
    try:
        factory, _ = envs.resolve_env(cfg.env.name)
        takes = "base_dir" in inspect.signature(factory).parameters
    except (ValueError, ImportError, TypeError):
        return cfg  # validation names the problem
    if not takes:
        return cfg
    env = dataclasses.replace(cfg.env, kwargs={**cfg.env.kwargs, "base_dir": base_dir})
    return dataclasses.replace(cfg, env=env)


def check_env(cfg: RunConfig) -> None:
    """The environment: a registered name or a name form (``envs.resolve_env``), and its
    keyword arguments."""
    try:
        env_cls, fixed = envs.resolve_env(cfg.env.name)
    except (ValueError, ImportError) as e:
        raise ConfigError(f"env.name: {e}") from None
    for key in fixed:
        if key in cfg.env.kwargs:
            raise ConfigError(f"env.kwargs.{key}: the env name {cfg.env.name!r} already sets "
                              f"it; leave it out")
    if inspect.isclass(env_cls) or inspect.isfunction(env_cls):
        params = [p for p in inspect.signature(env_cls).parameters.values()
                  if p.name not in fixed and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                        inspect.Parameter.KEYWORD_ONLY)]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD
                   for p in inspect.signature(env_cls).parameters.values()):
            config.check_params(cfg.env.kwargs, [p.name for p in params], "env.kwargs",
                                f"environment {cfg.env.name!r}")
        for p in params:
            if p.default is inspect.Parameter.empty and p.name not in cfg.env.kwargs:
                raise ConfigError(f"env.kwargs.{p.name} is required for environment "
                                  f"{cfg.env.name!r}")


def check_estimator(cfg: RunConfig) -> None:
    """The estimator's name and hyper-parameter names (values: ``_check_methods``)."""
    est = cfg.estimator
    known = estimators.names()
    entry = registry.find(est.name, "estimator") if isinstance(est.name, str) else None
    if entry is None or entry.kind != "estimator":
        raise ConfigError(f"estimator.name: unknown estimator {est.name!r} (known: "
                          f"{', '.join(known)})")
    config.check_params(est.params, list(estimators.spec(est.name).hyper_params),
                        "estimator.params", f"estimator {est.name!r}")


def check_loss(cfg: RunConfig) -> None:
    """The loss section."""
    lo = cfg.loss
    loss_names = [n for n in config.POLICY_LOSSES if n in losses.names()]
    if lo.policy not in loss_names:
        raise ConfigError(f"loss.policy: unknown policy loss {lo.policy!r}; known: "
                          f"{', '.join(loss_names)}")
    config.check_params(lo.params, _kwonly(losses.get(lo.policy), _TRAINER_SUPPLIED),
                        "loss.params", f"loss {lo.policy!r}")
    config.check_choice(lo.agg, losses.AGG_MODES, "loss.agg")
    config.check_choice(lo.kl_estimator,
                        [k for k in config.KL_ESTIMATORS if k in losses.names()],
                        "loss.kl_estimator")
    config.check_positive(lo, "loss", "kl_coef", "entropy_coef", "value_coef", allow_zero=True)
    config.check_choice(lo.is_weights, config.IS_WEIGHTS, "loss.is_weights")
    config.check_choice(lo.is_level, config.IS_LEVELS, "loss.is_level")
    config.check_positive(lo, "loss", "is_cap")
    config.check_positive(lo, "loss", "is_lower", allow_zero=True)
    if lo.is_lower > lo.is_cap:
        raise ConfigError(f"loss.is_lower ({lo.is_lower}) must be <= loss.is_cap ({lo.is_cap})")
    if lo.decoupled and lo.is_weights == "none":
        raise ConfigError("loss.decoupled: true takes the PPO ratio against the proximal policy "
                          "and corrects for the sampler with importance weights, which must be "
                          "bounded: set loss.is_weights: truncate (or mask)")
    if lo.is_weights == "truncate" and not lo.decoupled:
        raise ConfigError("loss.is_weights: truncate multiplies the loss by pi_proximal / "
                          "pi_behaviour, but without loss.decoupled the PPO ratio already "
                          "corrects for the sampler (the weight would count twice): set "
                          "loss.decoupled: true, or use is_weights: mask to drop tokens whose "
                          "weight is out of range")
    sig = inspect.signature(losses.get(lo.policy)).parameters
    needs = (["old_logprobs"] if lo.decoupled else []) + \
        (["is_weights"] if lo.is_weights != "none" else [])
    missing = [n for n in needs if n not in sig]
    if missing:
        raise ConfigError(f"loss.policy {lo.policy!r} takes no {' / '.join(missing)}, which "
                          f"loss.decoupled / loss.is_weights need; use ppo")


def check_methods(cfg: RunConfig) -> None:
    """The estimator, its shaping and transform stages and the policy loss, checked before
    anything is compiled: known names of the right kind, hyper-parameter names and value types
    (``estimators.check_hyper_params``), then one trace (``jax.eval_shape``, seconds) on a tiny
    batch like the loop's, so the ranges and choices each function checks itself, and the
    inputs it reads, fail here with the key named instead of inside the first jitted step."""
    est = cfg.estimator
    try:
        estimators.check_hyper_params(est.name, est.params)
    except ValueError as e:
        raise ConfigError(f"estimator.params: {e}") from None
    for which, kind in (("shaping", "shaping"), ("then", "transform")):
        for i, (name, params) in enumerate(config.stages(est, which)):
            key = f"estimator.{which}[{i}]"
            try:
                stage_spec = estimators.spec(name, kind)
            except ValueError as e:
                raise ConfigError(f"{key}: {e}") from None
            config.check_params(dict(params), list(stage_spec.hyper_params),
                                f"{key}.params", f"{kind} {name!r}")
            try:
                estimators.check_hyper_params(name, dict(params))
            except ValueError as e:
                raise ConfigError(f"{key}: {e}") from None
    check_reads(cfg)
    pipe = config.pipeline(cfg)
    batch = dry_batch(cfg)
    try:
        jax.eval_shape(pipe.apply, batch, pipe.init(8))
    except (ValueError, TypeError) as e:
        msg = str(e).splitlines()[0]
        where = "estimator.params" if len(pipe.names) == 1 else f"estimator {list(pipe.names)}"
        if isinstance(e, estimators.MissingInput):
            raise ConfigError(f"{where}: {msg}. The training loop supplies no such input; use "
                              f"it with `jaxrl-agent credit` on records that carry it") from None
        raise ConfigError(f"{where}: {msg}") from None

    lo = cfg.loss
    fn = losses.get(lo.policy)
    sig = inspect.signature(fn).parameters
    for k, v in lo.params.items():
        want = type_error(sig[k].default, v) if k in sig else None
        if want:
            raise ConfigError(f"loss.params.{k} must be {want} (default {sig[k].default!r}), "
                              f"got {v!r}")
    try:
        jax.eval_shape(lambda b: fn(b.old_logprobs, b, jnp.zeros(b.tokens.shape), agg=lo.agg,
                                    **lo.params), batch)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"loss.params: {str(e).splitlines()[0]}") from None


def check_reads(cfg: RunConfig) -> None:
    """Every input the pipeline reads is one the training loop supplies, from a part this run
    has (a value head for critics); otherwise a ConfigError naming the method and the input."""
    pipe = config.pipeline(cfg)
    for name, params in (*pipe.shaping, pipe.estimator, *pipe.then):
        for field in estimators.spec(name).inputs(dict(params)):
            if field not in LOOP_INPUTS:
                raise ConfigError(
                    f"{name!r} reads extras['{field}'], which the training loop does not "
                    f"supply (it supplies {', '.join(LOOP_INPUTS)}); use it with "
                    f"`jaxrl-agent credit` on records that carry it")
            source = LOOP_INPUTS[field].source
            if source == "value_head" and not cfg.model.value_head:
                raise ConfigError(f"estimator {name!r} reads a critic (extras['{field}'] from "
                                  f"{SOURCES[source]}): set model.value_head: true")


def dry_batch(cfg: RunConfig, group_size: int = 2):
    """A tiny batch shaped like the loop's (``trainer.layout``; 2 tasks, 2 turns each), with
    stand-ins for the inputs the training loop supplies to this pipeline
    (``train.inputs.LOOP_INPUTS``: values, hidden states, subgoal switches)."""
    turn = {"observation": [1, 5], "action": [2, 3], "logprobs": [-1.0, -0.5]}
    outcomes = [0.0, 1.0, 0.5, 2.0][: 2 * group_size] if group_size > 1 else [0.0, 1.0]
    recs = [{"group": i // group_size, "outcome": o, "turns": [turn, turn]}
            for i, o in enumerate(outcomes)]
    batch, _ = pack_records(recs, layout=cfg.trainer.layout)
    extras = dict(batch.extras)
    n, k = batch.turn_mask.shape
    ramp = jnp.arange(n * k, dtype=jnp.float32).reshape(n, k) / (n * k)
    stand_in = {
        "token": jnp.where(batch.action_mask, 0.3, 0.0),
        "turn": ramp,
        "vector": jnp.linspace(-1.0, 1.0, n * k * 4, dtype=jnp.float32).reshape(n, k, 4),
    }
    for name in estimators.reads(config.pipeline(cfg)):
        if name in LOOP_INPUTS:
            spec = LOOP_INPUTS[name]
            x = stand_in[spec.level]
            extras[name] = jnp.zeros_like(x) if spec.source == "env" else x
    return batch.replace(extras=extras)


def check_group_size(cfg: RunConfig) -> None:
    """An estimator that compares the rollouts of one task gives every trajectory 0 credit
    when each task has one rollout: found by running it (eagerly, on a tiny batch of singleton
    groups with different outcomes), not by a list of names."""
    r = cfg.rollout
    if r.group_size > 1 or (r.branch_turns and r.branch_factor > 1):
        return

    est = cfg.estimator
    pipe = config.pipeline(cfg)
    batch = dry_batch(cfg, group_size=1)
    adv, _ = pipe.apply(batch, pipe.init(8))
    if not np.any(np.asarray(adv.token)[np.asarray(batch.action_mask)]):
        raise ConfigError(
            f"rollout.group_size = 1: estimator {est.name!r} compares the rollouts of a task, "
            f"so with one rollout per task every advantage is 0 and nothing is learned; use "
            f"rollout.group_size >= 2, or an estimator with its own baseline (a value head: "
            f"gae, turn_gae; or reinforce_pp)")
