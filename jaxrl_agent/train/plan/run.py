"""The plan of a run's train step (``plan_run`` -> ``Plan``): the run's model, optimizer
state and train step built abstractly (shapes only), laid out on the config's mesh over a
topology's devices and compiled; the largest batch the config packs (``batch_dims``,
``abstract_batch``); the micro-batch search (``fit_micro_batches``)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl_agent import config as config_lib
from jaxrl_agent import run_checks
from jaxrl_agent import sharding
from jaxrl_agent.batch import TrajectoryBatch
from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import Transformer, trainable_filter
from jaxrl_agent.train.build import (builtin_model_config, lora_fields, run_optimizer,
                                     step_config)
from jaxrl_agent.train.plan.memory import (CompiledMemory, compile_memory, gathered_bytes,
                                           memory_floor, num_params, split_of)
from jaxrl_agent.train.plan.sampler import (SamplerPlan, abstract_sampler, plan_sampler,
                                            sampler_notes)
from jaxrl_agent.train.call_size import CALL_MEMORY_FRACTION
from jaxrl_agent.train.plan.topology import (HBM_BANDWIDTH, HBM_GIB, PlanError, chip_kind,
                                             topology_devices)
from jaxrl_agent.train.step import init_state_from_params, make_train_step, split_trainable


#: config.json shapes (no weights) of public checkpoints, for planning without a download:
#: ``--hf-config qwen2.5-0.5b``. Copied from the models' published config.json files.
HF_SHAPES = {
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, torch_dtype="bfloat16"),
    "qwen2.5-1.5b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=1536,
                         intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, torch_dtype="bfloat16"),
    "qwen3-1.7b": dict(architectures=["Qwen3ForCausalLM"], hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, torch_dtype="bfloat16"),
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       max_position_embeddings=32768, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, torch_dtype="bfloat16"),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=False, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, torch_dtype="bfloat16",
                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
}


def load_hf_config(source: str) -> dict:
    """The config.json dict of ``source``: a name in ``HF_SHAPES``, a config.json file or a
    folder holding one (weights are not read)."""
    if source.lower() in HF_SHAPES:
        return dict(HF_SHAPES[source.lower()])
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    if not os.path.isfile(path):
        raise PlanError(f"no model config at {source!r}: give a folder with config.json, a "
                        f"config.json file, or one of {sorted(HF_SHAPES)}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path}: not a JSON model config ({e})") from None


def known_shape(path: str) -> str | None:
    """The ``HF_SHAPES`` name a checkpoint folder's name stands for (``.../Qwen2.5-1.5B-Instruct``
    -> ``qwen2.5-1.5b``), or None."""
    name = os.path.basename(os.path.normpath(path)).lower()
    for suffix in ("-instruct", "-base", "-chat"):
        name = name.removesuffix(suffix)
    name = name.removeprefix("meta-")
    return name if name in HF_SHAPES else None


def teacher_model_config(cfg: config_lib.RunConfig, notes: list | None = None) -> ModelConfig:
    """The shapes of a checkpoint teacher (``teacher.source`` a path): its folder's
    config.json, or a known model's published shapes (``HF_SHAPES``) when the path is not on
    this machine; in the student's dtype, no value head, no adapters."""
    src = cfg.teacher.source
    try:
        source = config_lib.teacher_folder(cfg)
    except config_lib.ConfigError:
        source = known_shape(src)
        if source is None:
            raise PlanError(f"teacher.source {src!r}: no config.json there, and not a known "
                            f"shape ({', '.join(sorted(HF_SHAPES))})") from None
        if notes is not None:
            notes.append(f"teacher.source {src} is not on this machine: planned with the "
                         f"published shapes of {source}")
    try:
        return ModelConfig.from_hf(load_hf_config(source), dtype=cfg.model.dtype)
    except ValueError as e:
        raise PlanError(f"teacher model config: {e}") from None


def model_config(cfg: config_lib.RunConfig, hf_config: str | None = None,
                 notes: list | None = None) -> ModelConfig:
    """The ``ModelConfig`` the trainer would build (shapes only): ``hf_config`` (see
    ``load_hf_config``) or the config's ``model.hf_path`` config.json, else the built-in dims.
    A ``model.hf_path`` that is not on this machine but names a known model (``HF_SHAPES``)
    takes that model's shapes (said in ``notes``)."""
    m = cfg.model
    source = hf_config if hf_config is not None else m.hf_path
    if hf_config is None and m.hf_path is not None and not os.path.exists(m.hf_path):
        known = known_shape(m.hf_path)
        if known is not None:
            source = known
            if notes is not None:
                notes.append(f"model.hf_path {m.hf_path} is not on this machine: planned with "
                             f"the published shapes of {known} (--hf-config to choose)")
    if source is not None:
        try:
            return ModelConfig.from_hf(load_hf_config(source), dtype=m.dtype,
                                       value_head=m.value_head,
                                       value_stop_gradient=m.value_stop_gradient,
                                       **lora_fields(cfg))
        except PlanError as e:
            if hf_config is None:
                raise PlanError(f"model.hf_path: {e}; the plan needs only config.json (no "
                                "weights): point --hf-config at one, or name a known shape "
                                f"({', '.join(sorted(HF_SHAPES))})") from None
            raise
        except ValueError as e:
            raise PlanError(f"model config: {e}") from None
    return builtin_model_config(cfg)


def batch_dims(cfg: config_lib.RunConfig, blocks: int) -> dict:
    """The largest packed batch of one step: trajectories N (a multiple of ``blocks``), turns
    K, rows R and row length T."""
    r = cfg.rollout
    n = r.tasks_per_step * r.group_size * r.branch_factor ** len(r.branch_turns)
    n = blocks * max(math.ceil(max(n, 8) / blocks), 1)
    k = r.max_turns
    t = 16 * math.ceil(r.max_context_tokens / 16)
    rows = n * k if cfg.trainer.layout == "per_step" else n
    return {"num_traj": n, "num_turns": k, "num_rows": rows, "row_len": t}


def abstract_batch(dims: dict, layout: str, sharding_: NamedSharding, *,
                   tree_blocks: int = 0, tree_len: int = 0) -> TrajectoryBatch:
    """A ``TrajectoryBatch`` of ``ShapeDtypeStruct``s (rows / trajectories over the batch
    axes). ``tree_blocks`` > 0 adds the prefix-tree extras of ``rollout.tree``'s
    ``attach_prefix_trees`` for that many blocks, at their largest: one tree row of
    ``tree_len`` slots per batch row (no prefix shared; sharing only removes tree rows)."""
    n, k, r, t = dims["num_traj"], dims["num_turns"], dims["num_rows"], dims["row_len"]

    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding_)

    extras = {}
    if tree_blocks:
        length = max(tree_len, t)
        extras = dict(tree_tokens=s((r, length), "int32"), tree_positions=s((r, length), "int32"),
                      tree_ends=s((r, length), "int32"), tree_index=s((r, t), "int32"),
                      tree_blocks=s((tree_blocks,), "int32"))

    return TrajectoryBatch(
        tokens=s((r, t), "int32"), action_mask=s((r, t), "bool"), turn_ids=s((r, t), "int32"),
        row_traj=s((r,), "int32"), old_logprobs=s((r, t), "float32"),
        turn_mask=s((n, k), "bool"), turn_rewards=s((n, k), "float32"),
        state_keys=s((n, k), "uint32"), action_keys=s((n, k), "uint32"),
        group_ids=s((n,), "int32"), task_ids=s((n,), "int32"), traj_mask=s((n,), "bool"),
        outcome=s((n,), "float32"), extras=extras, layout=layout)


@dataclasses.dataclass
class Plan:
    """What ``plan_run`` found (bytes are per device; see the module docstring)."""

    topology: str
    chip: str
    num_devices: int
    num_hosts: int
    device_kind: str
    mesh: dict
    model: dict
    batch: dict
    step: dict
    params_bytes: int
    params_total_bytes: int
    opt_bytes: int
    ref_bytes: int
    batch_bytes: int
    #: the compiled train step: XLA's memory analysis, compile time and collectives
    memory: CompiledMemory
    notes: list
    hbm_bytes: int | None
    #: the JAX sampler's prefill and decode step on its devices (None: not planned, e.g. vLLM)
    sampler: SamplerPlan | None = None
    #: the analytic memory floor per device (``memory_floor``), by part and in total
    floor: dict | None = None
    #: the sampler's weights are freed during the train step (no rollout runs beside it:
    #: ``trainer.async_rollouts`` off; ``JaxSampler.release_weights``)
    sampler_released: bool = False
    #: per device, what one all-gather of every FSDP-split weight returns (``gathered_bytes``):
    #: the unit of ``gathers_per_micro_batch``
    weights_gathered_bytes: int = 0
    #: the teacher's parameters per device (an EMA copy or another checkpoint; 0 without, and
    #: for ``base``, whose copy is ``ref_bytes``, and ``live``)
    teacher_bytes: int = 0

    @property
    def gathers_per_micro_batch(self) -> float | None:
        """The all-gather bytes the step executes over the batch axes (``fsdp``, ``data``),
        per micro-batch pass (``micro_batches x mini_batches x ppo_epochs`` of them), in units
        of ``weights_gathered_bytes``: 2.0 is one gather of every weight in the forward and
        one in the backward pass. Forward-only passes of the step (KL reference, proximal
        log-probs, values for the advantages) add theirs. None without the figures."""
        g = self.memory.gathers
        if not g or not self.weights_gathered_bytes:
            return None
        over = sum(v for k, v in g.items() if k != "unknown loops" and k != "?"
                   and set(k.split("+")) <= set(sharding.BATCH_AXES))
        s = self.step
        passes = s["micro_batches"] * s["mini_batches"] * s["ppo_epochs"]
        return over / passes / self.weights_gathered_bytes

    @property
    def floor_ratio(self) -> float | None:
        """The compiled step's total over the analytic floor (1.0 = at the floor)."""
        if not self.floor or not self.floor.get("total"):
            return None
        return self.total_bytes / self.floor["total"]

    @property
    def total_bytes(self) -> int:
        """The train step's peak per device (``CompiledMemory.total_bytes``)."""
        return self.memory.total_bytes

    @property
    def fits(self) -> bool | None:
        """The train step fits the chip's HBM (None: no limit to check, ``cpu:N``)."""
        return None if self.hbm_bytes is None else self.total_bytes <= self.hbm_bytes

    @property
    def state_bytes(self) -> int:
        """The train state every device keeps between steps: parameters, optimizer state, the
        frozen start copy (KL reference, ``base`` teacher) and the teacher's parameters."""
        return self.params_bytes + self.opt_bytes + self.ref_bytes + self.teacher_bytes

    @property
    def sampler_device_bytes(self) -> int | None:
        """The peak of the device the sampler runs on, which also keeps its share of the train
        state: ``max(sampler peak + train state, train step total + sampler weights)``, the
        sampler's weights counted beside the step only when they stay while it runs
        (asynchronous rollouts; otherwise the trainer frees them for the step). None without a
        sampler plan."""
        s = self.sampler
        if s is None:
            return None
        beside = 0 if self.sampler_released else s.params_bytes
        return max(s.peak_bytes + self.state_bytes, self.total_bytes + beside)

    @property
    def run_fits(self) -> bool | None:
        """``fits``, and the sampler's device fits too (``sampler_device_bytes``) when the
        sampler was planned; None without an HBM limit."""
        if self.hbm_bytes is None:
            return None
        return bool(self.fits) and (self.sampler is None
                                    or self.sampler_device_bytes <= self.hbm_bytes)

    @property
    def gathers_whole_model(self) -> bool:
        """Every device holds (or gathers at once) the whole model although there are several
        devices."""
        if self.num_devices == 1:
            return False
        if self.params_bytes >= 0.99 * self.params_total_bytes:
            return self.mesh["fsdp"] * self.mesh["tensor"] > 1  # pure DP replicates by design
        # an all-gather about the size of all parameters (up to twice: gathered after a cast
        # to float32); larger ones are activations (a tiny model's logits), not weights
        biggest = self.memory.collectives.get("all-gather", {}).get("max_bytes", 0)
        return 0.9 * self.params_total_bytes <= biggest <= 2.1 * self.params_total_bytes

    def verdicts(self) -> list[str]:
        out = []
        gib = 2 ** 30
        if self.gathers_whole_model:
            if self.params_bytes >= 0.99 * self.params_total_bytes:
                out.append("every device holds the whole model: shard it with mesh.fsdp "
                           "(and/or mesh.tensor), or check mesh.rules")
            else:
                out.append("this layout gathers the whole model on every device at once "
                           "(a collective as large as all parameters): check mesh.rules")
        if self.fits is False:
            state = self.state_bytes
            if 2 * state > self.hbm_bytes:  # old + new state alone do not fit
                key = ("raise mesh.fsdp (parameters and optimizer state are split over it) or "
                       "mesh.tensor, or use a larger slice")
            else:
                key = ("set trainer.remat: full, raise trainer.micro_batches, or lower "
                       "rollout.max_context_tokens / rollout.tasks_per_step"
                       if self.step["remat"] not in ("full", True) else
                       "raise trainer.micro_batches, or lower rollout.max_context_tokens / "
                       "rollout.tasks_per_step")
            out.append(f"DOES NOT FIT: {self.total_bytes / gib:.2f} GiB per device > "
                       f"{self.hbm_bytes / gib:.0f} GiB HBM of a {self.chip} chip; {key}")
        elif self.fits:
            pct = 100 * self.total_bytes / self.hbm_bytes
            out.append(f"fits: {self.total_bytes / gib:.2f} GiB of {self.hbm_bytes / gib:.0f} "
                       f"GiB HBM per {self.chip} chip ({pct:.0f}%)")
        else:
            out.append(f"compiled for {self.num_devices} host devices: "
                       f"{self.total_bytes / gib:.2f} GiB per device (no HBM limit to check)")
        return out + self.sampler_verdicts()

    def sampler_verdicts(self) -> list[str]:
        """One line on the sampler's device (empty without a sampler plan): whether its peak
        fits the chip's HBM, alone and beside the train state, and which keys to change."""
        s, gib = self.sampler, 2 ** 30
        if s is None:
            return []
        d = s.dims
        worst = "prefill" if s.prefill.total_bytes >= s.decode.total_bytes else "decode step"
        what = (f"{d['batch']} prompts x {d['cache_len']} cache slots, KV cache "
                f"{s.kv_cache_bytes / gib:.2f} GiB per device")
        if self.hbm_bytes is None:
            return [f"sampler: its {worst} needs {s.peak_bytes / gib:.2f} GiB per device "
                    f"({what}; no HBM limit to check)"]
        hbm = self.hbm_bytes / gib
        spread = s.mesh["data"] * s.mesh["tensor"]
        key = ("split the sampler over more of the host's chips (sampler.data_parallel: "
               "prompts and KV cache rows; sampler.tensor_parallel: weights and KV heads), "
               "lower rollout.max_context_tokens, or the prompts of one call "
               "(rollout.tasks_per_step x group_size, trainer.eval_tasks)"
               if spread == 1 else
               "lower rollout.max_context_tokens or the prompts of one call "
               "(rollout.tasks_per_step x group_size, trainer.eval_tasks), or raise "
               f"sampler.data_parallel x tensor_parallel (now {s.mesh['data']} x "
               f"{s.mesh['tensor']}) if the host has more chips")
        if worst == "prefill":
            key += ("; the prefill's attention scores shrink with sampler.prefill_chunk (now "
                    f"{d.get('prefill_chunk') or 'the whole prompt'})")
        if s.peak_bytes > self.hbm_bytes:
            return [f"sampler DOES NOT FIT: its {worst} needs {s.peak_bytes / gib:.2f} GiB per "
                    f"{self.chip} chip > {hbm:.0f} GiB HBM ({what}); {key}"]
        sampling = s.peak_bytes + self.state_bytes
        if sampling > self.hbm_bytes or (self.fits and self.sampler_device_bytes >
                                         self.hbm_bytes):
            # (a train step that does not fit alone has its own verdict line)
            dev = self.sampler_device_bytes if self.fits else sampling
            return [f"sampler DOES NOT FIT beside the train state: {dev / gib:.2f} GiB on its "
                    f"{self.chip} chip > {hbm:.0f} GiB HBM (sampling "
                    f"{s.peak_bytes / gib:.2f} + train state {self.state_bytes / gib:.2f}, "
                    f"train step {self.total_bytes / gib:.2f}"
                    + ("" if self.sampler_released else
                       f" + sampler weights {s.params_bytes / gib:.2f}")
                    + f"; {what}); {key}, or split the train state over more devices "
                    "(mesh.fsdp)"]
        if not self.fits:  # only sampling beside the state can be judged
            return [f"sampler fits beside the train state: {sampling / gib:.2f} GiB of "
                    f"{hbm:.0f} GiB HBM on its {self.chip} chip (sampling "
                    f"{s.peak_bytes / gib:.2f} + train state {self.state_bytes / gib:.2f}); "
                    "the train step itself does not fit (above)"]
        dev = self.sampler_device_bytes
        return [f"sampler fits: {dev / gib:.2f} GiB of {hbm:.0f} GiB HBM on its {self.chip} "
                f"chip with the train state ({100 * dev / self.hbm_bytes:.0f}%)"]


def plan_run(cfg: config_lib.RunConfig, topology: str, *, hf_config: str | None = None,
             sampler: bool = True) -> Plan:
    """Compiles the run's train step for ``topology`` (shapes only) and reports its memory and
    collectives per device; with ``sampler`` and ``sampler.name: jax`` also the JAX sampler's
    prefill and decode step on the topology's first device (``plan_sampler``). ``cfg`` is
    validated here.

    Raises:
      PlanError / ConfigError: an unknown topology, libtpu missing, a mesh that does not fit the
        topology's devices, heads that the tensor axis does not divide, a bad config.
    """
    devices = topology_devices(topology)  # first: cpu:N must come before JAX's CPU backend
    cfg = run_checks.validate(cfg)
    try:
        mesh = sharding.make_mesh(cfg.mesh, devices=devices)
    except (ValueError, AssertionError) as e:  # JAX's mesh_utils asserts on TPU layouts
        raise PlanError(f"{e} (topology {topology} has {len(devices)} devices)") from None
    notes = []
    n_hosts = len({getattr(d, "process_index", 0) for d in devices})
    if mesh.size < len(devices) and n_hosts > 1:  # what make_mesh refuses on the real slice
        raise PlanError(f"mesh: data*fsdp*tensor = {mesh.size} but the {topology} slice has "
                        f"{len(devices)} chips on {n_hosts} hosts; a multi-host run must use "
                        "them all (set one mesh axis to -1)")
    if mesh.size < len(devices):
        notes.append(f"the mesh uses {mesh.size} of the topology's {len(devices)} devices")
    if cfg.trainer.attention == "splash" and devices[0].platform != "tpu":
        raise PlanError(f"trainer.attention: splash is a TPU kernel and {topology} has "
                        f"{devices[0].platform} devices: plan it on a TPU topology, or set "
                        "trainer.attention: blocked")
    mc = model_config(cfg, hf_config, notes)
    tp = mesh.shape["tensor"]
    if mc.num_heads % tp or mc.num_kv_heads % tp:
        raise PlanError(f"mesh.tensor={tp} must divide the model's attention heads "
                        f"({mc.num_heads}) and key/value heads ({mc.num_kv_heads})")
    data_shards = sharding.batch_shards(mesh)
    pipe = config_lib.pipeline(cfg)
    scfg = step_config(cfg, data_shards, pipe)
    opt = run_optimizer(cfg)
    rules = {**sharding.DEFAULT_RULES, **cfg.mesh.rules}
    est_state = pipe.init(cfg.trainer.task_capacity)
    teacher = scfg.teacher if scfg.needs_teacher else "none"
    with_ref = (cfg.loss.kl_coef > 0 or teacher == "base" or scfg.needs_reference
                or scfg.policy_drift)
    teacher_model, teacher_params = None, ()
    if teacher == "model":
        tmc = teacher_model_config(cfg, notes)
        teacher_model = nnx.eval_shape(lambda: Transformer(tmc, rngs=nnx.Rngs(0)))
        teacher_params = nnx.state(teacher_model, nnx.Param)
    if scfg.teacher_view:
        notes.append("teacher.context / teacher.system_prompt: the teacher's own rows (the "
                     "context's tokens longer) are not in this plan's batch")
    if cfg.trainer.prefix_sharing:
        notes.append("trainer.prefix_sharing: the step is compiled with prefix trees at their "
                     "largest (one tree row per batch row, no shared prefix); shared prefixes "
                     "only remove tree rows")

    model = nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(cfg.trainer.seed)))
    params = nnx.state(model, nnx.Param)
    state = jax.eval_shape(
        lambda p, e, t: init_state_from_params(p, opt, seed=cfg.trainer.seed, est_state=e,
                                               trainable=trainable_filter(mc),
                                               with_reference=with_ref,
                                               ema_teacher=teacher == "ema", teacher_params=t),
        params, est_state, teacher_params)
    shardings = sharding.train_state_shardings(state, opt, mesh, rules,
                                               trainable=trainable_filter(mc))
    for row in sharding.layout_table(params, mesh, rules):
        for n in row["notes"]:
            notes.append(f"{row['path']}: {n}")
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    dims = batch_dims(cfg, scfg.blocks)
    bsh = sharding.batch_sharding(mesh)
    batch = abstract_batch(dims, cfg.trainer.layout, bsh,
                           tree_blocks=scfg.blocks if cfg.trainer.prefix_sharing else 0,
                           tree_len=cfg.trainer.prefix_tree_len)

    step = make_train_step(model, opt, scfg, donate=True, mesh=mesh, state_shardings=shardings,
                           rules=rules, teacher_model=teacher_model)
    state_b = sharding.local_bytes(state, shardings)
    batch_b = sharding.local_bytes(batch, jax.tree.map(lambda _: bsh, batch))
    # a refused compile: arguments and outputs from the shardings (old state + batch in, new
    # state out)
    memory = compile_memory(lambda: step.lower(abstract_state, batch), state_b + batch_b,
                            state_b, mesh_shape=dict(mesh.shape))
    if memory.refused:
        notes.append("XLA refused to compile the step (it ran out of HBM): temporaries are "
                     "XLA's figure, arguments and outputs are from the shardings, collectives "
                     "are unknown")
    sampler_plan = None
    kind = chip_kind(topology)
    if sampler and cfg.sampler.name == "jax":
        # a call sized as a run sizes it: what fits beside the train state on the chip
        budget = (None if kind == "cpu" else
                  int(CALL_MEMORY_FRACTION * HBM_GIB[kind] * 2 ** 30) - state_b)
        sampler_plan = plan_sampler(abstract_sampler(cfg, model, devices, n_hosts), cfg,
                                    num_hosts=n_hosts, budget=budget,
                                    bandwidth=HBM_BANDWIDTH.get(kind))
        notes += sampler_notes(cfg, mc, sampler_plan)
    elif sampler:
        notes.append(f"sampler: {cfg.sampler.name} is not planned (only the JAX sampler's "
                     "steps are compiled here)")
    hosts = n_hosts
    n_params = num_params(params)
    return Plan(
        topology=topology, chip=kind, num_devices=mesh.size, num_hosts=hosts,
        device_kind=getattr(devices[0], "device_kind", devices[0].platform),
        mesh=dict(mesh.shape), batch=dims,
        model={"family": mc.family, "params": n_params, "dtype": mc.dtype,
               "layers": mc.num_layers, "hidden": mc.hidden_size, "vocab": mc.vocab_size,
               "value_head": mc.value_head, "lora_rank": mc.lora_rank},
        step={"estimator": scfg.estimator, "micro_batches": scfg.micro_batches,
              "mini_batches": scfg.mini_batches, "ppo_epochs": scfg.ppo_epochs,
              "remat": scfg.remat, "logits_chunk": scfg.logits_chunk,
              "attention": scfg.attention, "mlp_chunk": scfg.mlp_chunk,
              "kl_reference": cfg.loss.kl_coef > 0, "layout": cfg.trainer.layout,
              "teacher": teacher},
        params_bytes=sharding.local_bytes(state.params, shardings.params),
        params_total_bytes=sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params)),
        opt_bytes=sharding.local_bytes(state.opt_state, shardings.opt_state),
        ref_bytes=sharding.local_bytes(state.ref_params, shardings.ref_params) if with_ref else 0,
        teacher_bytes=(sharding.local_bytes(state.teacher_params, shardings.teacher_params)
                       if teacher in ("ema", "model") else 0),
        batch_bytes=batch_b, memory=memory, notes=notes,
        floor=memory_floor(mc, scfg, dims, dict(mesh.shape), state_bytes=state_b,
                           params_bytes=sharding.local_bytes(
                               *(split_trainable(t, trainable_filter(mc))[0]
                                 for t in (state.params, shardings.params))),
                           donated=True, attention=scfg.attention,
                           residual_split=split_of(sharding.residual_spec(
                               mesh, rules, mc.hidden_size), 2, mesh)),
        hbm_bytes=None if kind == "cpu" else HBM_GIB[kind] * 2 ** 30, sampler=sampler_plan,
        sampler_released=not cfg.trainer.async_rollouts,
        weights_gathered_bytes=gathered_bytes(state.params, shardings.params, mesh))


def fit_micro_batches(cfg: config_lib.RunConfig, topology: str, *,
                      hf_config: str | None = None, log=print) -> tuple[Plan | None, list]:
    """The fewest ``trainer.micro_batches`` whose train step fits the chip's HBM: a bisection
    over the counts the config accepts (divisors of the trajectories per step, at least the
    config's own), assuming memory falls as micro-batches grow; every candidate is a real
    compile (``plan_run`` without the sampler), the chosen one is planned again with it.

    Returns ``(plan of the chosen count or None when even the largest does not fit, [(count,
    total bytes, fits), ...] in the order tried)``."""
    if chip_kind(topology) == "cpu":
        raise PlanError("--fit needs a TPU topology (cpu:N has no HBM limit to fit)")
    r = cfg.rollout
    n = r.tasks_per_step * r.group_size
    start = cfg.trainer.micro_batches
    counts = [d for d in range(1, n + 1) if n % d == 0 and d >= start]
    tried = []
    log(f"searching the fewest trainer.micro_batches that fit {topology} (one compile each):")

    def plan_with(count: int, sampler: bool) -> Plan:
        c = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer,
                                                                 micro_batches=count))
        return plan_run(c, topology, hf_config=hf_config, sampler=sampler)

    lo, hi, best = 0, len(counts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        p = plan_with(counts[mid], sampler=False)
        if p.fits is None:
            raise PlanError("--fit needs a TPU topology (cpu:N has no HBM limit to fit)")
        tried.append((counts[mid], p.total_bytes, p.fits))
        log(f"  micro_batches={counts[mid]}: {p.total_bytes / 2 ** 30:.2f} GiB per device, "
            f"{'fits' if p.fits else 'does not fit'} (compiled in {p.memory.compile_s:.0f} s)")
        if p.fits:
            best, hi = counts[mid], mid - 1
        else:
            lo = mid + 1
    if best is None:
        return None, tried
    return plan_with(best, sampler=True), tried
