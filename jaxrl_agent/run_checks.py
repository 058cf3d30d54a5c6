"""The checks of a run configuration that ask the rest of the package.

``jaxrl_agent.config`` is the schema: dataclasses, YAML, overrides and the checks of each
section's values on their own (``config.SECTION_CHECKS``); it imports nothing of the package
above it. A run's config is loaded here, by whoever starts the run (the CLI, the trainer,
``plan``, the studies):

* ``load(path, overrides)``: ``config.load`` without its checks, then ``canonical_params``,
  ``with_env_base_dir`` and ``validate``; ``from_dict(d)``: a recorded config, renamed;
* ``validate(cfg)``: the plug-in modules imported, then the schema's section checks with the
  checks below in between, in the order of the sections (the methods last: they pack a batch
  in ``trainer.layout``, checked before).

The checks that ask the rest of the package:

* ``load_imports``: the run's plug-in modules, imported before any name is looked up;
* ``canonical_params``: former hyper-parameter names replaced by today's;
* ``with_env_base_dir``: a task-file environment reads its files next to the config file;
* ``check_env``, ``check_estimator``, ``check_loss``: registered names and their arguments;
* ``check_methods``: the pipeline and the policy loss traced once on a tiny batch like the
  loop's (``dry_batch``), after ``check_reads`` (every input a method reads is one the loop
  supplies, ``train.inputs.LOOP_INPUTS``);
* ``check_group_size``: an estimator that compares a task's rollouts needs two of them.

Each raises ``config.ConfigError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_agent import config, envs, estimators, losses, registry
from jaxrl_agent.config import ConfigError, RunConfig
from jaxrl_agent.estimators.pipeline import type_error
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.train import inputs as inputs_lib
from jaxrl_agent.train.inputs import run_inputs

#: loss arguments the train step passes itself (not hyper-parameters a config may set)
_TRAINER_SUPPLIED = ("old_logprobs", "is_weights", "agg", "agg_constant", "axis_name")
#: arguments of the auxiliary losses that take arrays (the step passes ``advantages``, the run's
#: advantages; the others are read from the batch through their field-name parameters)
_ARRAY_ARGS = (*losses.STEP_GIVEN, "teacher_logprobs", "other_logprobs", "gate_values",
               "controller_state")
#: registered losses with a key of their own instead of loss.aux
LOSS_KEYS = {**{n: "loss.policy" for n in config.POLICY_LOSSES},
             **{n: "loss.kl_estimator (with loss.kl_coef)" for n in config.KL_ESTIMATORS},
             "entropy": "loss.entropy_coef", "value": "loss.value_coef (with a critic)",
             "sarsa": "loss.sarsa_coef (SAPO's SARSA loss on the value head)"}


def load(path=None, overrides=(), *, validate: bool = True) -> RunConfig:
    """A run's config: ``config.load(path, overrides)`` (the YAML file, ``None`` = the
    defaults, then the ``--set`` overrides, parsed), former hyper-parameter names renamed
    (``canonical_params``), a task-file environment pointed at the config file's folder
    (``with_env_base_dir``), then (unless ``validate=False``) every check (``validate``)."""
    cfg = canonical_params(config.load(path, overrides, validate=False))
    if path is not None:
        cfg = with_env_base_dir(cfg, os.path.dirname(os.path.abspath(path)))
    return _check_all(cfg) if validate else cfg


def from_dict(d: dict | None) -> RunConfig:
    """A recorded config (a run's ``config.yaml``, a checkpoint's metadata): ``config.from_dict``
    with former hyper-parameter names renamed (``canonical_params``). No semantic checks."""
    return canonical_params(config.from_dict(d))


def validate(cfg: RunConfig) -> RunConfig:
    """Every check of a run's config; raises ``ConfigError`` with a clear message, returns
    ``cfg`` otherwise. Imports the run's plug-in modules first (``imports``), so the methods
    they register are known; touches the file system for nothing else (``config.check_paths``
    does). One check per section, in the order of the file: the schema's for the values of a
    section on their own, this module's where the registries, environments or a trace of the
    methods are asked; the methods last (they pack a batch in ``trainer.layout``)."""
    load_imports(cfg)
    own = config.SECTION_CHECKS
    for check in (own["name_and_run"], own["model"], check_env, own["rollout"],
                  check_estimator, check_loss, own["optimizer"], own["trainer"],
                  own["sampler"], own["run_dir"], own["mesh"], own["distributed"],
                  own["teacher"], check_signals, check_methods, check_group_size):
        check(cfg)
    return cfg


_check_all = validate  # ``load``'s keyword ``validate`` shadows the function


def aux_loss_names() -> list[str]:
    """The registered losses that can be a run's auxiliary loss (``loss.aux``): every
    registered loss without a key of its own (``LOSS_KEYS``), plug-ins' included."""
    return [n for n in losses.names() if n not in LOSS_KEYS]


def aux_loss_params(name: str) -> list[str]:
    """The hyper-parameters a config may set for auxiliary loss ``name``."""
    return _kwonly(losses.get(name), _TRAINER_SUPPLIED + _ARRAY_ARGS)


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
    config.check_positive(lo, "loss", "kl_coef", "value_coef", "sarsa_coef", allow_zero=True)
    if not math.isfinite(lo.entropy_coef):  # < 0 is an entropy penalty: it sharpens the policy
        raise ConfigError(f"loss.entropy_coef must be a finite number; got {lo.entropy_coef!r}")
    if not 0.0 <= lo.sarsa_gamma <= 1.0:
        raise ConfigError(f"loss.sarsa_gamma must lie in [0, 1], got {lo.sarsa_gamma}")
    if lo.sarsa_coef and not cfg.model.value_head:
        raise ConfigError("loss.sarsa_coef trains the value head read after each action (SAPO's "
                          "SARSA loss): set model.value_head: true")
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
    for i, (name, coef, params) in enumerate(config.aux_losses(cfg)):
        key = f"loss.aux[{i}]"
        if name in LOSS_KEYS:
            raise ConfigError(f"{key}: {name!r} has a key of its own: {LOSS_KEYS[name]}")
        if name not in aux_loss_names():
            raise ConfigError(f"{key}: unknown loss {name!r}; auxiliary losses: "
                              f"{', '.join(aux_loss_names())}{registry.IMPORT_HINT}")
        config.check_params(dict(params), aux_loss_params(name), f"{key}.params",
                            f"loss {name!r}")
        if coef < 0:
            raise ConfigError(f"{key}.coef must be >= 0, got {coef}")
    sig = inspect.signature(losses.get(lo.policy)).parameters
    needs = (["old_logprobs"] if lo.decoupled else []) + \
        (["is_weights"] if lo.is_weights != "none" else [])
    missing = [n for n in needs if n not in sig]
    if missing:
        raise ConfigError(f"loss.policy {lo.policy!r} takes no {' / '.join(missing)}, which "
                          f"loss.decoupled / loss.is_weights need; use ppo")


def check_signals(cfg: RunConfig) -> None:
    """The signal plug-ins (``signals``): registered names of kind ``signal``, their
    hyper-parameter names, and the fields they declare."""
    for i, (name, params) in enumerate(config.signal_stages(cfg)):
        key = f"signals[{i}]"
        entry = registry.find(name, "signal")
        if entry is None or entry.kind != "signal":
            known = registry.names("signal")
            raise ConfigError(f"{key}: unknown signal {name!r}; known: "
                              f"{', '.join(known) or 'none registered'}{registry.IMPORT_HINT}")
        config.check_params(dict(params), list(entry.hyper_params), f"{key}.params",
                            f"signal {name!r}")
        try:
            fields = entry.outputs(dict(params))
        except Exception as e:  # noqa: BLE001 - the plug-in's own function
            raise ConfigError(f"{key}: signal {name!r} cannot say what it provides "
                              f"({type(e).__name__}: {e})") from None
        bad = {k: v for k, v in fields.items() if registry.parse_level(v) is None}
        if bad:
            raise ConfigError(f"{key}: signal {name!r} provides {bad}; each field's level must "
                              f"be one of {registry.SIGNAL_LEVELS}")


def env_reports(cfg: RunConfig) -> dict:
    """The fields the run's environment declares it reports (``Env.reports``: name ->
    description), read from its class without making it; ``{}`` for none or an unknown env."""
    try:
        factory, _ = envs.resolve_env(cfg.env.name)
    except (ValueError, ImportError):
        return {}
    reports = getattr(factory, "reports", None)
    return dict(reports) if isinstance(reports, dict) else {}


def signal_fields(cfg: RunConfig) -> dict:
    """The fields the run's signal plug-ins provide (name -> level)."""
    out = {}
    for name, params in config.signal_stages(cfg):
        entry = registry.find(name, "signal")
        if entry is not None:
            out.update(entry.outputs(dict(params)))
    return out


def run_table(cfg: RunConfig) -> dict:
    """The inputs this run can supply (``train.inputs.run_inputs``): the loop's own, the
    environment's reports and the signal plug-ins' fields."""
    return run_inputs(env_reports(cfg), signal_fields(cfg), top_k=cfg.teacher.top_k)


def configured(cfg: RunConfig, spec) -> bool:
    """Whether the source of a loop input is switched on in this run."""
    if spec.source == "value_head":
        return bool(cfg.model.value_head)
    if spec.source == "teacher":
        return cfg.teacher.source != "none"
    if spec.source == "teacher_topk":
        return cfg.teacher.source != "none" and cfg.teacher.top_k > 0
    return True


def _trace(cfg: RunConfig, batch) -> None:
    """The pipeline, the policy loss and the auxiliary losses traced (``jax.eval_shape``) on
    ``batch``; raises what they raise."""
    pipe = config.pipeline(cfg)
    lo = cfg.loss
    fn = losses.get(lo.policy)
    aux = config.aux_losses(cfg)

    def run(b):
        adv, _ = pipe.apply(b, pipe.init(8))
        z = jnp.zeros(b.tokens.shape)
        fn(b.old_logprobs, b, z, agg=lo.agg, **lo.params)
        avail = _step_given(b, cfg.teacher.top_k, adv.token)
        for name, _, params in aux:
            f = losses.get(name)
            f(b.old_logprobs, b, agg=lo.agg, **losses.step_given(f, **avail), **dict(params))
        return adv

    jax.eval_shape(run, batch)


def _step_given(b, top_k: int, advantages) -> dict:
    """Stand-ins of what the train step passes to a loss beyond ``(logprobs, batch)``
    (``losses.STEP_GIVEN``): the advantages, and the student's log-probs of the teacher's
    top-K ids when ``teacher.top_k`` > 0."""
    out = {"advantages": advantages}
    if top_k > 0:
        out["student_topk_logprobs"] = jnp.full(b.tokens.shape + (top_k,), -1.0)
    return out


def _where(cfg: RunConfig, e: Exception) -> str:
    """The config key a trace error belongs to: the loss when the loss raised it."""
    tb = e.__traceback__
    mods = set()
    while tb is not None:
        mods.add(tb.tb_frame.f_globals.get("__name__", ""))
        tb = tb.tb_next
    if any(m.startswith("jaxrl_agent.losses") for m in mods) and not any(
            m.startswith("jaxrl_agent.estimators") for m in mods):
        return "loss.aux" if cfg.loss.aux else "loss.params"
    pipe = config.pipeline(cfg)
    return "estimator.params" if len(pipe.names) == 1 else f"estimator {list(pipe.names)}"


def check_methods(cfg: RunConfig) -> None:
    """The estimator, its shaping and transform stages, the policy loss and the auxiliary
    losses, checked before anything is compiled: known names of the right kind,
    hyper-parameter names and value types (``estimators.check_hyper_params``), then one trace
    (``jax.eval_shape``, seconds) on a tiny batch like the loop's that carries every input this
    run supplies (``run_table``), so the ranges and choices each function checks itself, and
    any input it reads that no source of the run supplies, fail here with the key named
    instead of inside the first jitted step."""
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
    lo = cfg.loss
    fn = losses.get(lo.policy)
    sig = inspect.signature(fn).parameters
    for k, v in lo.params.items():
        want = type_error(sig[k].default, v) if k in sig else None
        if want:
            raise ConfigError(f"loss.params.{k} must be {want} (default {sig[k].default!r}), "
                              f"got {v!r}")
    for i, (name, _, params) in enumerate(config.aux_losses(cfg)):
        sig = inspect.signature(losses.get(name)).parameters
        for k, v in params:
            want = type_error(sig[k].default, v) if k in sig else None
            if want:
                raise ConfigError(f"loss.aux[{i}].params.{k} must be {want} (default "
                                  f"{sig[k].default!r}), got {v!r}")
    step_reads(cfg)


#: the last few configs ``step_reads`` traced, with the registry they were traced under and
#: the answer (the run checks and the step's build both ask; tracing takes seconds)
_READS_SEEN: list = []


def step_reads(cfg: RunConfig) -> tuple:
    """The fields the run's methods and losses read from a model the train step runs for them
    (the teacher's log-probs, the policy's entropies: ``train.inputs.STEP_SOURCES``), found by
    tracing them on a batch without those fields (``dry_batch``) and adding each one a method
    asks for; the step computes only these. A field no configured source supplies is a
    ``ConfigError`` naming the method and the config key that would supply it
    (``inputs.missing_message``). The answer for an equal config under the same registered
    methods is remembered."""
    known = tuple(registry.entries())
    for seen, entries, reads in _READS_SEEN:
        if seen == cfg and entries == known:
            return reads
    reads = _step_reads(cfg)
    _READS_SEEN[:] = [*_READS_SEEN[-3:], (cfg, known, reads)]
    return reads


def _step_reads(cfg: RunConfig) -> tuple:
    table = run_table(cfg)
    optional = {n for n, s in table.items()
                if s.source in ("teacher", "teacher_topk", "policy", "reference")}
    given: set = set()
    for _ in range(len(table) + 1):
        batch = dry_batch(cfg, include=given)
        try:
            _trace(cfg, batch)
            return tuple(sorted(given))
        except (ValueError, TypeError) as e:
            if isinstance(e, estimators.MissingInput) and e.field in optional - given \
                    and configured(cfg, table[e.field]):
                given.add(e.field)
                continue
            where = _where(cfg, e)
            if isinstance(e, estimators.MissingInput):
                who = str(e).split(" needs extras")[0]
                raise ConfigError(f"{where}: {inputs_lib.missing_message(e.field, who=who)}"
                                  ) from None
            raise ConfigError(f"{where}: {str(e).splitlines()[0]}") from None
    raise ConfigError("the run's methods ask for inputs without end")  # pragma: no cover


def check_reads(cfg: RunConfig) -> None:
    """Every input the pipeline declares it reads is one this run supplies, from a part the run
    has (a value head for critics); otherwise a ConfigError naming the method, the input and
    the config key that would supply it."""
    pipe = config.pipeline(cfg)
    table = run_table(cfg)
    for name, params in (*pipe.shaping, pipe.estimator, *pipe.then):
        for field in estimators.spec(name).inputs(dict(params)):
            if field not in table or not configured(cfg, table[field]):
                raise ConfigError(inputs_lib.missing_message(field, who=f"estimator {name!r}"))


def dry_batch(cfg: RunConfig, group_size: int = 2, include=None):
    """A tiny batch shaped like the loop's (``trainer.layout``; 2 tasks, 2 turns each), with
    stand-ins for the inputs this run supplies (``run_table``: values, hidden states, subgoal
    switches, the environment's reports, the signal plug-ins' fields); of the inputs a model
    in the step computes only when read (teacher log-probs, entropies), those in ``include``
    (default: all that are configured)."""
    turn = {"observation": [1, 5], "action": [2, 3], "logprobs": [-1.0, -0.5]}
    outcomes = [0.0, 1.0, 0.5, 2.0][: 2 * group_size] if group_size > 1 else [0.0, 1.0]
    recs = [{"group": i // group_size, "outcome": o, "turns": [turn, turn]}
            for i, o in enumerate(outcomes)]
    batch, _ = pack_records(recs, layout=cfg.trainer.layout)
    extras = dict(batch.extras)
    n, k = batch.turn_mask.shape
    ramp = jnp.arange(n * k, dtype=jnp.float32).reshape(n, k) / (n * k)
    stand_in = {
        "token": jnp.where(batch.action_mask, -0.3, 0.0),
        "turn": ramp,
        "traj": jnp.linspace(0.0, 1.0, n, dtype=jnp.float32),
        "vector": jnp.linspace(-1.0, 1.0, n * k * 4, dtype=jnp.float32).reshape(n, k, 4),
    }
    for name, spec in run_table(cfg).items():
        if not configured(cfg, spec):
            continue
        if spec.source in ("teacher", "teacher_topk", "policy", "reference") \
                and include is not None and name not in include:
            continue
        level, width = registry.parse_level(spec.level) or (spec.level, None)
        if level == "edges":  # turn k - 1 -> k in every trajectory, type 0
            extras[name] = jnp.asarray([[[j, j + 1, 0] for j in range(k - 1)]] * n, jnp.int32)
            continue
        x = stand_in[level]
        if width is not None:
            x = jnp.repeat(x[..., None], width, axis=-1) * jnp.arange(1, width + 1)
        extras[name] = jnp.zeros_like(x) if name == "switch" else x
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


# ----------------------------------------------------------------------------- what reads what


def builtin_reports() -> dict:
    """``{field: [env names]}``: the per-turn fields the registered environments declare
    (``Env.reports``), with their ``final_<field>`` trajectory fields."""
    out: dict = {}
    for e in registry.entries("env"):
        for name in getattr(e.fn, "reports", None) or {}:
            for field in (name, f"final_{name}"):
                out.setdefault(field, []).append(e.name)
    return out


def _call_alone(kind: str, name: str, params: dict):
    """``run(batch)`` calling one registered method with ``params`` as the trainer does."""
    if kind == "loss":
        fn = losses.get(name)

        def given(b):
            k = b.extras["teacher_topk_logprobs"].shape[-1] if (
                "teacher_topk_logprobs" in b.extras) else 0
            return losses.step_given(fn, **_step_given(b, k, jnp.zeros(b.tokens.shape)))
        return lambda b: fn(b.old_logprobs, b, **given(b), **params)
    pipe = (estimators.Pipeline((name, tuple(params.items()))) if kind == "estimator" else
            estimators.Pipeline(("grpo", ()), ((name, tuple(params.items())),))
            if kind == "shaping" else
            estimators.Pipeline(("grpo", ()), (), ((name, tuple(params.items())),)))
    return lambda b: pipe.apply(b, pipe.init(8))[0]


def method_reads(kind: str, name: str, params: dict | None = None,
                 layout: str = "per_step") -> list:
    """``[(field, level)]``: the extras fields one registered method reads with these
    hyper-parameters (default: its defaults), found by tracing it on a batch that starts with
    none and gets a stand-in for each field it asks for (at the level the loop's table gives
    it; other fields at the first level the method accepts). A field at a level none of
    ``token``, ``turn``, ``traj``, ``vector`` fits ends the search with level ``"?"``."""
    table = run_inputs(signal_fields=None)
    base = dry_batch(RunConfig(trainer=dataclasses.replace(RunConfig().trainer, layout=layout),
                               model=dataclasses.replace(RunConfig().model, value_head=True),
                               teacher=config.TeacherSection(source="live")), include=())
    base = base.replace(extras={k: v for k, v in base.extras.items()
                                if k in ("positions", "segment_ids")})
    n, k = base.turn_mask.shape
    stand_in = {"token": jnp.where(base.action_mask, -0.3, 0.0),
                "turn": jnp.arange(n * k, dtype=jnp.float32).reshape(n, k) / (n * k),
                "traj": jnp.linspace(0.0, 1.0, n, dtype=jnp.float32),
                "vector": jnp.ones((n, k, 4), jnp.float32)}
    stand_in["token[top_k]"] = jnp.repeat(stand_in["token"][..., None], 4, axis=-1)
    run = _call_alone(kind, name, dict(params or {}))
    found: dict = {}
    trying: tuple = ()
    for _ in range(64):
        extras = {**base.extras, **{f: stand_in[lvl] for f, lvl in found.items()}}
        try:
            jax.eval_shape(run, base.replace(extras=extras))
            return list(found.items())
        except (ValueError, TypeError) as e:
            field = getattr(e, "field", None)
            if isinstance(e, estimators.MissingInput) and field not in found:
                levels = ((table[field].level,) if field in table else
                          ("token", "turn", "traj", "vector"))
                trying = (field, levels, 0)
                found[field] = levels[0]
                continue
            if trying and f"'{trying[0]}'" in str(e) and trying[2] + 1 < len(trying[1]):
                field, levels, i = trying
                trying = (field, levels, i + 1)
                found[field] = levels[i + 1]
                continue
            if trying and f"'{trying[0]}'" in str(e):
                found[trying[0]] = "?"
                return list(found.items())
            return list(found.items())  # an error of its own (a required setting): stop here
    return list(found.items())
