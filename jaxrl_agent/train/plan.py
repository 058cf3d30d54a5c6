"""Ahead-of-time plan of a run's train step on a device topology (``jaxrl-agent plan``).

Builds the run's model, optimizer state and train step *abstractly* (shapes only: no weights
are read or allocated), lays them out on the config's ``(data, fsdp, tensor)`` mesh over the
devices of a named topology, and compiles the real jitted train step for it::

    devices  = topology_devices("v5e:2x4")           # abstract TPU devices (libtpu), or cpu:N
    mesh     = sharding.make_mesh(cfg.mesh, devices=devices)
    state    = eval_shape(init_state_from_params)     # + sharding.train_state_shardings
    batch    = the largest batch the config packs (sizes below), over the batch axes
    compiled = make_train_step(...).lower(state, batch).compile()   # exactly the Trainer's step
    report   = compiled.memory_analysis() + collectives read from compiled.as_text()

TPU topologies (``v4:2x2x4``, ``v5e:2x2``, ``v5e:2x4``, ``v5p:2x2x1``, ``v6e:2x4``, ...) need
``libtpu`` (the ``tpu-aot`` extra) but no TPU: JAX compiles for the topology on a CPU-only host
(``jax.experimental.topologies.get_topology_desc``). ``cpu:N`` uses N host devices (set before
JAX starts its CPU backend, or by ``XLA_FLAGS=--xla_force_host_platform_device_count=N``).

The batch is the largest the config can pack in one step: ``N = tasks_per_step x group_size x
branch_factor ** len(branch_turns)`` trajectories (rounded up to the packer's blocks), ``K =
rollout.max_turns`` turns, rows of ``rollout.max_context_tokens`` tokens (rounded up to 16;
one row per trajectory, or one per turn with ``layout: per_step``). Real batches are at most
this long, so the memory reported is an upper bound for the step's shapes.

Numbers per device: ``parameters`` / ``optimizer state`` / ``reference`` from the shardings
(the layout the rules give); ``arguments`` / ``outputs`` / ``temporaries`` / ``code`` from XLA's
``memory_analysis()`` of the compiled program. ``total = arguments + outputs - aliased +
temporaries + code`` is what the step needs at its peak (the trainer donates the old state,
so the new one is written into its buffers: the aliased bytes are counted once). Beside it,
``memory_floor``: the analytic floor of the step per device. Collectives are counted
statically in the compiled HLO (an op inside a loop, micro-batches or layers, runs once per
iteration but is counted once); their bytes are the per-device result buffers.

With ``sampler: jax`` the plan also compiles the JAX sampler's own jitted prefill and decode
loop (``plan_sampler``, through ``JaxSampler.lower``) on the devices one host gives it: one
device with the whole model by default, or ``sampler.data_parallel`` x ``tensor_parallel`` of
the host's devices (``sharding.sampler_mesh``: prompts and KV cache rows over data, weights
and KV heads over tensor by the run's partition rules). It is planned for the run's largest
sampler call (``sampler_dims``): one host's prompts of a step (``tasks_per_step x
group_size``, times the forks of ``branch_turns``) or of an evaluation, padded to the
sampler's batch bucket; prompts of up to ``max_context_tokens - max_new_tokens`` tokens and a
KV cache of up to ``max_context_tokens`` slots, as ``JaxSampler.generate`` buckets them. The
sampler is built around a model of shapes only (``abstract_sampler``). Its numbers per device:
parameters and KV cache from the shapes and shardings; arguments / outputs / temporaries /
code from ``memory_analysis()`` of each program. Those devices also keep their share of the
train state, so their peak is ``max(sampler peak + train state, train step total + sampler
weights)``.

With ``trainer.prefix_sharing`` the step is compiled with the prefix-tree extras at their
largest: one tree row of ``max(prefix_tree_len, row length)`` slots per batch row, as when no
two rows share a prefix (shared prefixes only remove tree rows; an automatic tree length may
pick longer, fewer rows within ``rollout.tree.MEMORY_FACTOR`` of the unpacked attention).

Not covered yet: the vLLM sampler, and several rollout workers sampling at once
(``trainer.async_rollouts``: one call is planned, and said so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl_agent import config as config_lib
from jaxrl_agent import run_checks
from jaxrl_agent import sharding
from jaxrl_agent.batch import TrajectoryBatch
from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import Transformer, param_dtype, trainable_filter
from jaxrl_agent.sampling.jax_sampler import JaxSampler
from jaxrl_agent.train.build import (builtin_model_config, jax_sampler_args, lora_fields,
                                     run_optimizer, sampler_batch_buckets, step_config)
from jaxrl_agent.train.step import init_state_from_params, make_train_step, split_trainable

__all__ = ["PlanError", "Plan", "SamplerPlan", "CompiledMemory", "HBM_GIB", "HF_SHAPES",
           "topology_devices", "plan_run", "plan_sampler", "abstract_sampler", "sampler_dims",
           "format_plan", "count_collectives", "executed_collectives", "executions",
           "compile_memory", "memory_floor", "fit_micro_batches"]

#: HBM per chip in GiB (Google Cloud TPU system architecture pages).
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
_KIND_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v5": "v5p"}
#: cores per chip in the accelerator-type names (v4-32 is 16 chips; v5e/v6e count chips)
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
_ACCEL_PREFIX = {"v4": "v4", "v5p": "v5p", "v5e": "v5litepod", "v6e": "v6e"}

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

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


class PlanError(ValueError):
    """A mistake the user can fix (unknown topology, a mesh that does not fit the devices,
    libtpu missing, no model shapes): one clear message, no traceback."""


# ----------------------------------------------------------------------------- topologies


def chip_kind(topology: str) -> str | None:
    """``"v5e"`` for ``"v5e:2x4"`` (also ``v5litepod``), ``"cpu"`` for ``cpu:N``; None when the
    prefix is not a known chip."""
    head = topology.split(":", 1)[0].strip().lower()
    if head == "cpu":
        return "cpu"
    head = _KIND_ALIASES.get(head, head)
    return head if head in HBM_GIB else None


def _cpu_devices(n: int) -> list:
    """``n`` host CPU devices: asks JAX for them when its CPU backend has not started yet."""
    if n < 1:
        raise PlanError(f"--topology cpu:{n}: need at least one device")
    try:
        if jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend is already up: use what it has
        pass
    have = jax.devices("cpu")
    if len(have) < n:
        raise PlanError(f"--topology cpu:{n}: this process has {len(have)} CPU devices (JAX "
                        "started before the plan could ask for more); set XLA_FLAGS="
                        f"--xla_force_host_platform_device_count={n}")
    return list(have[:n])


def _chips(topology: str) -> int:
    dims = topology.split(":", 1)[1] if ":" in topology else ""
    try:
        return math.prod(int(x) for x in dims.lower().split("x"))
    except ValueError:
        return 0


@contextlib.contextmanager
def _quiet_stderr():
    """libtpu writes warnings to file descriptor 2 while it starts; keep them, and hand them
    back only when something fails (``buf[0]``)."""
    buf = [""]
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield buf
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            buf[0] = tmp.read().decode("utf-8", "replace")


def _tpu_env(topology: str, kind: str) -> None:
    """The TPU_* variables libtpu looks for on a TPU VM (unset on a CPU host): set quietly so it
    does not warn or try the metadata server. Values already set are kept."""
    chips = _chips(topology)
    if chips:
        os.environ.setdefault("TPU_ACCELERATOR_TYPE",
                              f"{_ACCEL_PREFIX[kind]}-{chips * _CORES_PER_CHIP[kind]}")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # compiling only: no chip is opened, so several processes may load libtpu at once (without
    # this the second one fails on libtpu's lock file)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def libtpu_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


INSTALL_HINT = ('compiling for TPU needs libtpu: pip install -e ".[tpu-aot]" (or pip install '
                f'"jax[tpu]=={jax.__version__}"); no TPU is needed')


def topology_devices(topology: str) -> list:
    """The devices of ``topology``: ``cpu:N`` host devices, or the abstract devices of a TPU
    slice that libtpu knows (``v5e:2x2``, ``v5p:2x2x1``, ``v4:2x2x4``, ``v6e:2x4``, ...).

    Raises:
      PlanError: an unknown name, or libtpu not installed (with how to install it).
    """
    name = topology.strip()
    kind = chip_kind(name)
    if kind == "cpu":
        try:
            n = int(name.split(":", 1)[1]) if ":" in name else 1
        except ValueError:
            raise PlanError(f"--topology {name!r}: expected cpu:N, e.g. cpu:8") from None
        return _cpu_devices(n)
    if kind is None or not _chips(name):
        raise PlanError(f"unknown topology {name!r}: use cpu:N or a TPU slice such as "
                        "v5e:2x2, v5e:2x4, v5p:2x2x1, v4:2x2x4, v6e:2x4 "
                        f"(chips: {', '.join(HBM_GIB)})")
    if not libtpu_available():
        raise PlanError(f"--topology {name}: {INSTALL_HINT}")
    _tpu_env(name, kind)
    from jax.experimental import topologies

    with _quiet_stderr() as log:
        try:
            # v4 / v5p chips have two TensorCores; JAX meshes want one device per chip
            chip_config = "megacore" if kind in ("v4", "v5p") else "default"
            desc = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                                chip_config_name=chip_config)
            err = None
        except Exception as e:  # libtpu's errors are JaxRuntimeError / ValueError
            err = e
    if err is not None:
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "INVALID_ARGUMENT" in detail or "Invalid" in detail or "topology" in detail.lower():
            raise PlanError(f"libtpu does not know the topology {name!r} ({detail}); examples: "
                            "v5e:2x2, v5e:2x4, v5p:2x2x1, v4:2x2x4, v6e:2x4")
        raise PlanError(f"libtpu could not describe the topology {name!r}: {detail}")
    del log
    return list(desc.devices)


# ----------------------------------------------------------------------------- the run


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


def _split_of(spec, dim: int, mesh) -> int:
    """How many ways ``spec`` splits dimension ``dim`` on ``mesh``."""
    part = spec[dim] if len(spec) > dim else None
    axes = () if part is None else (part,) if isinstance(part, str) else tuple(part)
    return math.prod(mesh.shape[a] for a in axes)


def memory_floor(mc: ModelConfig, scfg, dims: dict, mesh_shape: dict, *, state_bytes: int,
                 params_bytes: int, donated: bool, attention: str = "dense",
                 residual_split: int = 1) -> dict:
    """The analytic memory floor of one train step per device (bytes; our estimate of what any
    implementation of this step must hold at its peak, to judge the compiled figure against):

    * ``train state``: parameters, optimizer state and KL reference from the shardings;
    * ``new state``: the step's output while the input is alive (0 when the state is donated);
    * ``gradients``: one accumulator the size of the local trained parameters (all, or the
      LoRA adapters and value head);
    * ``saved layer inputs``: what the remat policy keeps per layer for the backward pass, for
      one micro-batch's rows on this device (``r = rows / (data x fsdp x mini x micro)``):
      ``n_layers r T D / residual_split`` (``full``, ``offload``; ``residual_split`` the
      mesh axes the residual stream's embedding dimension is split over, ``tensor`` by
      default: ``sharding.residual_spec``), plus every matmul output
      ``n_layers r T (q + k + v + o + gate + up + down) / tensor`` (``save_dots``, ``none``;
      a lower bound for ``none``, which also keeps norms and softmax);
    * ``one layer's working set``: one decoder layer's weights gathered (FSDP: ``1 / tensor``
      of a layer), its activations for ``r`` rows (the MLP's for ``trainer.mlp_chunk``
      positions when it is tiled), and its attention scores and probabilities
      ``2 r (H / tensor) T^2 4`` bytes with dense attention (one block of 512 queries of
      them with ``blocked`` or ``splash`` attention);
    * ``one chunk of logits``: ``r x logits_chunk x V / tensor`` float32, twice (logits and
      probabilities / their cotangent);
    * ``the LM head gathered``: ``D x V / tensor`` (FSDP gathers the head, the largest
      single weight, while the logits are computed, as it gathers each layer).
    """
    b = jnp.dtype(param_dtype(mc)).itemsize
    tp = mesh_shape.get("tensor", 1)
    r = max(dims["num_rows"] // (scfg.data_shards * scfg.mini_batches * scfg.micro_batches), 1)
    t = dims["row_len"]
    D, F, V, L = mc.hidden_size, mc.intermediate_size, mc.vocab_size, mc.num_layers
    qkv = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
    mlp_t = min(t, scfg.mlp_chunk) if scfg.mlp_chunk else t  # MLP tiles: one alive
    dots = (r * t * (qkv + mc.num_heads * mc.head_dim) + r * mlp_t * 2 * F) * b // tp \
        + r * t * 2 * D * b
    saved = L * r * t * D * b // max(residual_split, 1)
    if scfg.remat in ("save_dots", "none"):
        saved += L * dots
    layer_params = (D * (qkv + mc.num_heads * mc.head_dim) + 3 * D * F) * b // tp
    heads = max(mc.num_heads // tp, 1)
    q_len = t if attention == "dense" else min(t, 512)
    scores = 2 * r * heads * q_len * t * 4
    working = layer_params + dots + scores
    logits = 2 * r * min(scfg.logits_chunk, t) * (V // tp) * 4
    parts = {"train state": state_bytes, "new state": 0 if donated else state_bytes,
             "gradients": params_bytes, "saved layer inputs": saved,
             "one layer's working set": working, "one chunk of logits": logits,
             "the LM head gathered": D * V * b // tp}
    return {**parts, "total": sum(parts.values())}


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


# ----------------------------------------------------------------------------- the HLO

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


def _shape_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in _DTYPE_BYTES:
            continue
        out.append(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
    return out


_FUSED_RS = re.compile(r"=\s*(.*?)\sfusion\(.*calls=%?(all-reduce-scatter[\w.-]*)")


def count_collectives(hlo_text: str) -> dict:
    """``{op: {"count": n, "bytes": b, "max_bytes": m}}`` for every collective in the compiled
    HLO text: static op counts (an op in a loop body counts once), ``bytes`` the sum of the
    per-device result buffers (for an async ``*-start`` op the largest buffer of its tuple: the
    result), ``max_bytes`` the largest single one. The TPU compiler emits a reduce-scatter as a
    fusion calling an ``all-reduce-scatter`` computation (an all-reduce and a slice inside):
    that fusion counts as one reduce-scatter of its result, and the all-reduce inside it is
    not counted again."""
    out = {op: {"count": 0, "bytes": 0, "max_bytes": 0} for op in COLLECTIVES}

    def add(op, b):
        e = out[op]
        e["count"] += 1
        e["bytes"] += b
        e["max_bytes"] = max(e["max_bytes"], b)

    computation = ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[0].lstrip("%")  # a computation's header line
            continue
        if computation.startswith("all-reduce-scatter"):
            continue
        f = _FUSED_RS.search(line)
        if f:
            add("reduce-scatter", sum(_shape_bytes(f.group(1))))
            continue
        m = _OP.search(line)
        if m:
            sizes = _shape_bytes(m.group(1))
            add(m.group(2), max(sizes, default=0) if m.group(3) else sum(sizes))
    return out


_CALLS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)"
                    r"=%?([\w.-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_CONST = re.compile(r"%?([\w.-]+) = [su]\d+\[\]\S* constant\((\d+)\)")
_LT = re.compile(r"(?:compare|fusion)\(%?([\w.-]+), %?([\w.-]+)\)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS = re.compile(r"replica_groups=\{\{([\d,]+)\}")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                          r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}")
#: one executed collective op of a line: ``= <result shape> <op>(`` or ``<op>-start(``
_EXECUTED = {op: re.compile(r"=\s*(.*?)\s" + op + r"(-start)?\(")
             for op in ("all-gather", "all-reduce")}


def _computations(hlo_text: str) -> tuple[dict, str]:
    """``({name: [instruction lines]}, entry name)`` of an HLO module's text."""
    comps, name, entry = {}, None, ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            words = line.split()
            is_entry = words[0] == "ENTRY"
            name = words[1 if is_entry else 0].lstrip("%")
            entry = name if is_entry else entry
            comps[name] = []
        elif name is not None and line.startswith(" "):
            comps[name].append(line)
    return comps, entry


def _trip_count(lines: list, comps: dict) -> int | None:
    """A while loop's trip count read from its condition: ``i < N`` with ``N`` a constant (the
    counter starting at 0, as XLA writes scans and fori loops), the compare written out or in
    a fusion (the CPU compiler wraps it); None otherwise."""
    consts = {m.group(1): int(m.group(2)) for m in map(_CONST.search, lines) if m}
    for line in lines:
        m = _LT.search(line)
        if not m or m.group(2) not in consts:
            continue
        callee = re.search(r"calls=%?([\w.-]+)", line)
        body = " ".join(comps.get(callee.group(1), [])) if callee else line
        if "direction=LT" in body:
            return consts[m.group(2)]
    return None


def executions(hlo_text: str) -> tuple[dict, int]:
    """``({computation: times it runs per execution of the module}, loops of unknown trip
    count)``: the entry runs once, a while loop's body and condition run its trip count
    (``_trip_count``; 1 when unknown) times per run of the caller, every other called
    computation (fusions, calls, both branches of a conditional: an upper bound) once."""
    comps, entry = _computations(hlo_text)
    calls = {}
    unknown = 0
    for name, lines in comps.items():
        out = []
        for line in lines:
            trips = 1
            if " while(" in line:
                cond = re.search(r"condition=%?([\w.-]+)", line)
                known = _TRIPS.search(line)
                n = (int(known.group(1)) if known else
                     _trip_count(comps.get(cond.group(1), []), comps) if cond else None)
                unknown += n is None
                trips = 1 if n is None else n
            for kind, callee in _CALLS.findall(line):
                out.append((callee, trips if kind in ("body", "condition") else 1))
            for group in _BRANCHES.findall(line):
                out += [(c.strip().lstrip("%"), 1) for c in group.split(",") if c.strip()]
        calls[name] = out
    times: dict = {}

    def visit(name, n):
        times[name] = times.get(name, 0) + n
        for callee, k in calls.get(name, ()):
            if callee in comps:
                visit(callee, n * k)

    if entry:
        visit(entry, 1)
    return times, unknown


def _group_axes(line: str, mesh_shape: dict) -> str:
    """The mesh axes a collective's first replica group spans (``"fsdp"``, ``"tensor"``,
    ``"fsdp+tensor"``...; ``"?"`` when the groups cannot be read). Device ids are positions in
    the mesh's device order (``mesh.devices.flat``), axes in ``mesh_shape``'s order."""
    import numpy as np
    names, dims = list(mesh_shape), [int(v) for v in mesh_shape.values()]
    m, mm = _GROUPS_IOTA.search(line), _GROUPS_MESH.search(line)
    if mm:  # mesh['axis_0'=a,...], device_ids=([dims]T(perm)) {'axis_k', ...}: the group
        # spans the listed axes of that (internal) mesh, the others fixed at 0
        names_ = re.findall(r"'(\w+)'=(\d+)", mm.group(1))
        sizes = [int(v) for _, v in names_]
        ids = np.arange(math.prod(sizes))
        if mm.group(2):
            ids = ids.reshape([int(x) for x in mm.group(2).split(",")])
            if mm.group(3):
                ids = ids.transpose([int(x) for x in mm.group(3).split(",")])
        ids = ids.reshape(sizes)
        spans = set(re.findall(r"'(\w+)'", mm.group(4)))
        first = ids[tuple(slice(None) if n in spans else 0 for n, _ in names_)].reshape(-1)
    elif m:
        g, s = int(m.group(1)), int(m.group(2))
        shape = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(shape)).reshape(shape)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        first = ids.reshape(g, s)[0]
    else:
        m = _GROUPS.search(line)
        if not m:
            return "?"
        first = np.array([int(x) for x in m.group(1).split(",")])
    if first.max() >= math.prod(dims):
        return "?"
    coords = np.array(np.unravel_index(first, dims))
    spans = [n for n, c in zip(names, coords) if len(set(c.tolist())) > 1]
    return "+".join(spans) or "none"


def executed_collectives(hlo_text: str, mesh_shape: dict, op: str = "all-gather") -> dict:
    """The bytes of ``op`` (``all-gather`` or ``all-reduce``) executed per run of the compiled
    program, by the mesh axes they span: ``{"fsdp": bytes, "tensor": bytes, ...}`` (per-device
    result bytes of each op times the number of times its computation runs, ``executions``),
    plus ``"unknown loops"``: while loops whose trip count could not be read (counted once).
    An op in a loop over tiles or chunks counts once per iteration: this is where a gradient
    reduced in every tile instead of once shows (``trainer.mlp_chunk``). The all-reduce inside
    the TPU compiler's ``all-reduce-scatter`` computations is a reduce-scatter
    (``count_collectives``) and is not counted.

    The TPU compiler splits an asynchronous all-gather over several fused computations (its
    start, its continuation, its end), each holding a copy of the op with the same
    ``channel_id``: one channel counts once."""
    pattern = _EXECUTED[op]
    times, unknown = executions(hlo_text)
    comps, _ = _computations(hlo_text)
    seen: dict = {}
    out: dict = {}
    for name, lines in comps.items():
        n = times.get(name, 0)
        if not n or name.startswith("all-reduce-scatter"):
            continue
        for line in lines:
            m = pattern.search(line)
            if not m:
                continue
            sizes = _shape_bytes(m.group(1))
            b = max(sizes, default=0) if m.group(2) else sum(sizes)
            axes = _group_axes(line, mesh_shape)
            channel = re.search(r"channel_id=(\d+)", line)
            key = ("channel", channel.group(1)) if channel else ("op", name, line)
            seen[key] = max(seen.get(key, (axes, 0)), (axes, b * n), key=lambda e: e[1])
    for axes, b in seen.values():
        out[axes] = out.get(axes, 0) + b
    out["unknown loops"] = unknown
    return out


# ----------------------------------------------------------------------------- the plan


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
    #: per device, what one all-gather of every FSDP-split weight returns (``_gathered_bytes``):
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


_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _exhausted_bytes(message: str) -> int | None:
    """The bytes XLA says the step's temporaries need when it refuses to compile for lack of
    HBM ("... HLO temporaries (46.20G) exceeds available HBM ..."); None for other errors."""
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    m = re.search(r"temporaries \(([0-9.]+)([KMGT]?)\)", message)
    if m is None:
        m = re.search(r"required[^0-9]*([0-9.]+)([KMGT]?)", message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0


def _local_bytes(tree, shardings) -> int:
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
    return total


def _gathered_bytes(tree, shardings, mesh) -> int:
    """Per device, the bytes one all-gather of every weight over its FSDP split (the batch axes
    ``data x fsdp`` a parameter is split over) returns: its local bytes times that split."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        split = _split_axes(s.spec, mesh, sharding.BATCH_AXES)
        if split > 1:
            total += math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize * split
    return total


def _split_axes(spec, mesh, axes) -> int:
    """How many ways ``spec`` splits an array over the mesh axes ``axes``, all dims together."""
    n = 1
    for part in spec:
        for a in (() if part is None else (part,) if isinstance(part, str) else part):
            n *= mesh.shape[a] if a in axes else 1
    return n


def _num_params(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- the sampler


@dataclasses.dataclass
class CompiledMemory:
    """XLA's ``memory_analysis()`` of one compiled program (bytes per device), its compile
    time and its collectives. ``refused``: XLA would not compile it for lack of HBM;
    ``temp_bytes`` is then XLA's figure, and the arguments / outputs are the bytes of their
    shapes."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    compile_s: float
    refused: bool = False
    #: ``count_collectives`` of the compiled program (empty when XLA refused it)
    collectives: dict = dataclasses.field(default_factory=dict)
    #: ``executed_collectives`` of the compiled program's all-gathers and all-reduces (empty
    #: when XLA refused it or no mesh was given)
    gathers: dict = dataclasses.field(default_factory=dict)
    reduces: dict = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """The program's peak: ``arguments + outputs - aliased + temporaries + code``."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.code_bytes)


def compile_memory(lower, argument_bytes: int, output_bytes: int,
                   mesh_shape: dict | None = None) -> CompiledMemory:
    """Compiles ``lower()`` (a ``jax.stages.Lowered``) and reads its memory analysis and
    collectives (``count_collectives``). When XLA refuses for lack of HBM the result is
    ``refused``, with XLA's temporaries figure and the given ``argument_bytes`` /
    ``output_bytes`` (from the shapes); other errors propagate. With ``mesh_shape`` (the
    program's mesh, axes in order) also the all-gather and all-reduce bytes it executes by
    mesh axis (``executed_collectives``)."""
    t0 = time.perf_counter()
    try:
        compiled = lower().compile()
    except Exception as e:  # XLA's "ran out of memory" is a result, not a crash
        need = _exhausted_bytes(str(e))
        if need is None:
            raise
        return CompiledMemory(argument_bytes, output_bytes, 0, need, 0,
                              time.perf_counter() - t0, refused=True)
    seconds = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    text = compiled.as_text()
    return CompiledMemory(int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
                          int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes),
                          int(ma.generated_code_size_in_bytes), seconds,
                          collectives=count_collectives(text),
                          gathers={} if mesh_shape is None else executed_collectives(
                              text, mesh_shape, "all-gather"),
                          reduces={} if mesh_shape is None else executed_collectives(
                              text, mesh_shape, "all-reduce"))


@dataclasses.dataclass
class SamplerPlan:
    """The JAX sampler's prefill and decode step compiled for the devices of one host it runs
    on: ``mesh`` ``{"data": d, "tensor": t}`` (``sampler.data_parallel`` x
    ``sampler.tensor_parallel``; 1 x 1 is one device with the whole model). Bytes are per
    device; ``dims`` is the call planned for (``sampler_dims``)."""

    device_kind: str
    mesh: dict
    dims: dict
    num_params: int
    params_bytes: int
    kv_cache_bytes: int
    prefill: CompiledMemory
    decode: CompiledMemory

    @property
    def peak_bytes(self) -> int:
        """The larger of the prefill's and the decode step's totals. They do not add up: the
        cache the prefill returns is one of the decode step's arguments."""
        return max(self.prefill.total_bytes, self.decode.total_bytes)


class _ShapesOnlySampler(JaxSampler):
    """A ``JaxSampler`` around a model of ``ShapeDtypeStruct``s (``nnx.eval_shape``): its
    weights are shapes placed on ``device`` (no mesh) or on the given shardings, so nothing is
    allocated; the buckets, the graph and the jitted prefill / decode functions are the
    sampler's own (``JaxSampler.lower``)."""

    def __init__(self, model, *, device, **kwargs):
        self._device = device
        super().__init__(model, **kwargs)

    def _place(self, state, shardings):
        if shardings is None:
            one = jax.sharding.SingleDeviceSharding(self._device)
            shardings = jax.tree.map(lambda _: one, state)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, shardings)


def abstract_sampler(cfg: config_lib.RunConfig, model: Transformer, devices,
                     num_hosts: int = 1) -> JaxSampler:
    """The run's ``JaxSampler`` as ``build.build_sampler`` makes it (``build.jax_sampler_args``
    with one host's batch buckets) on the first host's share of ``devices``, around ``model``, a
    ``Transformer`` of shapes only (``nnx.eval_shape``): no weights are made. Only its
    buckets, ``state`` (shapes) and ``lower`` are meant to be used.

    Raises:
      PlanError: sampler sizes that do not fit one host's devices or the model's heads.
    """
    first = getattr(devices[0], "process_index", 0)
    host = [d for d in devices if getattr(d, "process_index", 0) == first]
    try:
        return _ShapesOnlySampler(model, device=host[0], **jax_sampler_args(
            cfg, model, sampler_batch_buckets(cfg, num_hosts), devices=host))
    except ValueError as e:
        raise PlanError(f"{e} ({len(host)} devices per host)") from None


def _smallest_bucket(n: int, buckets) -> int:
    """The smallest of ``buckets`` >= n (the largest one when none is)."""
    return next((b for b in sorted(buckets) if b >= n), max(buckets))


def sampler_dims(cfg: config_lib.RunConfig, sampler, num_hosts: int = 1) -> dict:
    """The largest call the run makes to its JAX sampler, padded as ``JaxSampler.generate``
    pads it. ``sampler``: anything with the sampler's ``batch_buckets``, ``len_buckets``,
    ``new_token_buckets`` and ``max_len``.

    * ``prompts``: the most prompts one host sends at once: its share of the step's tasks
      (``ceil(tasks_per_step / num_hosts)``) x ``group_size`` x ``branch_factor **
      len(branch_turns)`` (every live trajectory after the last fork), or its share of
      ``trainer.eval_tasks`` when the run evaluates (``eval_every > 0``), whichever is more;
      ``call`` says which (``"train"`` or ``"eval"``);
    * ``batch``: ``min(prompts, largest batch bucket)`` (``generate`` splits a larger call into
      chunks of the largest bucket) rounded up to a batch bucket;
    * ``prompt_len``: the longest prompt a turn can have, ``max_context_tokens -
      max_new_tokens`` (the collector ends a trajectory before a turn that would not fit),
      rounded up to a length bucket;
    * ``new_tokens``: ``max_new_tokens`` rounded up to a new-token bucket;
    * ``cache_len``: ``min(prompt_len + new_tokens, sampler.max_len)``, as ``generate`` sizes
      the cache: the largest one the run allocates;
    * ``stop_ids``: 4, the smallest stop-id bucket (the trainer stops at the tokenizer's EOS and
      end-of-turn ids);
    * ``prefill_chunk``: the sampler's (None: the whole prompt at once).
    """
    r, t = cfg.rollout, cfg.trainer
    hosts = max(int(num_hosts), 1)
    train = -(-r.tasks_per_step // hosts) * r.group_size * r.branch_factor ** len(r.branch_turns)
    evals = -(-t.eval_tasks // hosts) if t.eval_every else 0
    prompts = max(train, evals)
    batch = _smallest_bucket(min(prompts, max(sampler.batch_buckets)), sampler.batch_buckets)
    prompt_len = _smallest_bucket(max(r.max_context_tokens - r.max_new_tokens, 1),
                                  sampler.len_buckets)
    new_tokens = _smallest_bucket(r.max_new_tokens, sampler.new_token_buckets)
    return {"prompts": prompts, "call": "train" if train >= evals else "eval", "batch": batch,
            "prompt_len": prompt_len, "new_tokens": new_tokens,
            "cache_len": min(prompt_len + new_tokens, sampler.max_len), "stop_ids": 4,
            "hosts": hosts, "prefill_chunk": getattr(sampler, "prefill_chunk", None)}


def sampler_notes(cfg: config_lib.RunConfig, mc: ModelConfig, sp: SamplerPlan) -> list[str]:
    """What the sampler plan leaves out or assumes, as notes: a refused compile, a cache longer
    than the model's positions, several rollout workers sampling at once."""
    out = [f"sampler {name}: XLA refused to compile it (it ran out of HBM): temporaries are "
           "XLA's figure, arguments and outputs are from the shapes"
           for name, m in (("prefill", sp.prefill), ("decode step", sp.decode)) if m.refused]
    if sp.dims["cache_len"] > mc.max_position_embeddings:
        out.append(f"the sampler's KV cache ({sp.dims['cache_len']} slots, from "
                   "rollout.max_context_tokens) is longer than the model's "
                   f"max_position_embeddings ({mc.max_position_embeddings})")
    t = cfg.trainer
    if t.async_rollouts and t.rollout_workers > 1:
        out.append(f"trainer.async_rollouts: {t.rollout_workers} rollout workers can be inside "
                   "a sampler call at once, each with its own KV cache (planned: one call)")
    return out


def plan_sampler(sampler: JaxSampler, cfg: config_lib.RunConfig, *,
                 num_hosts: int = 1) -> SamplerPlan:
    """Compiles ``sampler``'s own jitted prefill and decode loop ahead of time
    (``JaxSampler.lower``: on its mesh, or on the device of its weights) from shapes only, for
    the run's largest call (``sampler_dims``): prompts ``[batch, prompt_len]``, a KV cache of
    ``cache_len`` slots, outputs of ``new_tokens``. ``sampler`` may be ``abstract_sampler``'s
    (no weights) or a real one.

    Per device: ``params_bytes`` is the bytes of the sampler's state (every parameter, a value
    head too: the trainer hands the sampler its policy module) in its layout;
    ``kv_cache_bytes`` those of the cache the prefill returns (``2 x layers x batch x
    cache_len x kv_heads x head_dim`` x the parameter dtype's bytes, plus ``batch`` int32
    indices), divided over the mesh (rows over ``data``, heads over ``tensor``). A program XLA
    refuses for lack of HBM is reported with XLA's figure (``CompiledMemory.refused``)."""
    dims = sampler_dims(cfg, sampler, num_hosts)
    B, L, N, C, S = (dims[k] for k in ("batch", "prompt_len", "new_tokens", "cache_len",
                                       "stop_ids"))
    prefill, decode = sampler.lower(B, L, N, stop_ids=S, cache_len=C)
    state = sampler.state
    leaves = jax.tree.leaves(state)
    params_b = _local_bytes(state, [x.sharding for x in leaves])
    mc = sampler.config
    rows_sh = sampler.batch_sharding or leaves[0].sharding
    kv_sh = sampler.cache_sharding or rows_sh
    rows = math.prod(rows_sh.shard_shape((B,)))
    kv = math.prod(kv_sh.shard_shape((B, C, mc.num_kv_heads, mc.head_dim)))
    cache_b = 2 * mc.num_layers * kv * jnp.dtype(param_dtype(mc)).itemsize + 4 * rows
    logits_b = rows * mc.vocab_size * 4
    # (when XLA refuses a program: its arguments and outputs from the shapes above)
    pre = compile_memory(lambda: prefill, params_b + rows * (4 * L + 4), cache_b + logits_b)
    dec = compile_memory(lambda: decode, params_b + cache_b + logits_b + rows * (40 + 4 * S),
                         rows * (8 * N + 4) + cache_b)
    device = min(leaves[0].sharding.device_set, key=lambda d: d.id)
    mesh = dict(sampler.mesh.shape) if sampler.mesh is not None else {}
    return SamplerPlan(device_kind=getattr(device, "device_kind", device.platform),
                       mesh={"data": mesh.get("data", 1), "tensor": mesh.get("tensor", 1)},
                       dims=dims, num_params=_num_params(state), params_bytes=params_b,
                       kv_cache_bytes=cache_b, prefill=pre, decode=dec)


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
    state_b = _local_bytes(state, shardings)
    batch_b = _local_bytes(batch, jax.tree.map(lambda _: bsh, batch))
    # a refused compile: arguments and outputs from the shardings (old state + batch in, new
    # state out)
    memory = compile_memory(lambda: step.lower(abstract_state, batch), state_b + batch_b,
                            state_b, mesh_shape=dict(mesh.shape))
    if memory.refused:
        notes.append("XLA refused to compile the step (it ran out of HBM): temporaries are "
                     "XLA's figure, arguments and outputs are from the shardings, collectives "
                     "are unknown")
    sampler_plan = None
    if sampler and cfg.sampler.name == "jax":
        sampler_plan = plan_sampler(abstract_sampler(cfg, model, devices, n_hosts), cfg,
                                    num_hosts=n_hosts)
        notes += sampler_notes(cfg, mc, sampler_plan)
    elif sampler:
        notes.append(f"sampler: {cfg.sampler.name} is not planned (only the JAX sampler's "
                     "steps are compiled here)")
    kind = chip_kind(topology)
    hosts = n_hosts
    n_params = _num_params(params)
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
        params_bytes=_local_bytes(state.params, shardings.params),
        params_total_bytes=sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params)),
        opt_bytes=_local_bytes(state.opt_state, shardings.opt_state),
        ref_bytes=_local_bytes(state.ref_params, shardings.ref_params) if with_ref else 0,
        teacher_bytes=(_local_bytes(state.teacher_params, shardings.teacher_params)
                       if teacher in ("ema", "model") else 0),
        batch_bytes=batch_b, memory=memory, notes=notes,
        floor=memory_floor(mc, scfg, dims, dict(mesh.shape), state_bytes=state_b,
                           params_bytes=_local_bytes(
                               *(split_trainable(t, trainable_filter(mc))[0]
                                 for t in (state.params, shardings.params))),
                           donated=True, attention=scfg.attention,
                           residual_split=_split_of(sharding.residual_spec(
                               mesh, rules, mc.hidden_size), 2, mesh)),
        hbm_bytes=None if kind == "cpu" else HBM_GIB[kind] * 2 ** 30, sampler=sampler_plan,
        sampler_released=not cfg.trainer.async_rollouts,
        weights_gathered_bytes=_gathered_bytes(state.params, shardings.params, mesh))


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


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _mib(b: int) -> str:
    return f"{b / 2 ** 20:,.1f}"


def format_plan(p: Plan, source: str = "") -> str:
    """The fit table printed by ``jaxrl-agent plan``."""
    m, b, s, mem = p.mesh, p.batch, p.step, p.memory
    hosts = f", {p.num_hosts} hosts" if p.num_hosts > 1 else ""
    lines = [
        f"plan{' ' + source if source else ''} on {p.topology}: {p.num_devices} x "
        f"{p.device_kind}{hosts}; mesh data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']}",
        f"model: {p.model['family']}, {_count(p.model['params'])} parameters "
        f"({p.model['dtype']}), {p.model['layers']} layers, hidden {p.model['hidden']}, vocab "
        f"{p.model['vocab']}" + (", value head" if p.model["value_head"] else ""),
        f"step: {s['estimator']}, {s['layout']} rows, micro_batches={s['micro_batches']} "
        f"mini_batches={s['mini_batches']} ppo_epochs={s['ppo_epochs']} remat={s['remat']} "
        f"attention={s['attention']} logits_chunk={s['logits_chunk']}"
        + (f" mlp_chunk={s['mlp_chunk']}" if s.get("mlp_chunk") else "")
        + (", KL reference" if s["kl_reference"] else "")
        + (f", teacher {s['teacher']}" if s.get("teacher", "none") != "none" else ""),
        f"batch: {b['num_traj']} trajectories x {b['num_turns']} turns, {b['num_rows']} rows x "
        f"{b['row_len']} tokens (the largest the config packs: rows of "
        "rollout.max_context_tokens)",
        "",
        f"{'per device':<34}{'MiB':>12}",
        f"{'  parameters':<34}{_mib(p.params_bytes):>12}   (of {_mib(p.params_total_bytes)} "
        "in all)",
        f"{'  optimizer state':<34}{_mib(p.opt_bytes):>12}"
        + (f"   (LoRA rank {p.model['lora_rank']}: {100 * p.opt_bytes / (2 * p.params_bytes):.2f}%"
           " of a full fine-tune's Adam state, 2 x the parameters)"
           if p.model.get("lora_rank") else ""),
    ]
    if p.ref_bytes:
        lines.append(f"{'  start copy (KL ref., base teacher)':<34}{_mib(p.ref_bytes):>12}")
    if p.teacher_bytes:
        lines.append(f"{'  teacher parameters':<34}{_mib(p.teacher_bytes):>12}")
    lines += [
        f"{'  batch':<34}{_mib(p.batch_bytes):>12}",
        f"{'  arguments (compiled)':<34}{_mib(mem.argument_bytes):>12}",
        f"{'  outputs (new state, metrics)':<34}{_mib(mem.output_bytes):>12}",
        f"{'  temporaries (activations, grads)':<34}{_mib(mem.temp_bytes):>12}",
        f"{'  code':<34}{_mib(mem.code_bytes):>12}",
    ]
    if mem.alias_bytes:
        lines.append(f"{'  aliased (counted once)':<34}{'-' + _mib(mem.alias_bytes):>12}")
    hbm = f"   HBM {p.hbm_bytes / 2 ** 30:.0f} GiB per {p.chip} chip" if p.hbm_bytes else ""
    lines += [f"{'  total':<34}{_mib(p.total_bytes):>12}{hbm}"]
    if p.floor:
        lines += ["", f"{'analytic floor, per device':<34}{'MiB':>12}   (memory_floor: what the "
                  "step must hold at least)"]
        lines += [f"{'  ' + k:<34}{_mib(v):>12}" for k, v in p.floor.items() if k != "total"]
        lines.append(f"{'  floor':<34}{_mib(p.floor['total']):>12}   compiled total / floor = "
                     f"{p.floor_ratio:.2f}")
    lines += [f"compile time: {mem.compile_s:.1f} s", ""]
    lines += format_collectives(mem.collectives, "the compiled step")
    lines += format_gathers(p)
    if p.sampler is not None:
        lines += format_sampler(p) + [""]
    notes = list(p.notes)
    if p.num_devices > 1 and p.mesh["fsdp"] * p.mesh["tensor"] == 1:
        notes.append("pure data parallelism: every device holds the whole model and optimizer "
                     "state (mesh.fsdp / mesh.tensor would shard them)")
    lines += [f"note: {n}" for n in notes]
    lines += [f"verdict: {v}" for v in p.verdicts()]
    return "\n".join(lines)


def format_gathers(p: Plan) -> list[str]:
    """The all-gathers and all-reduces the step executes (``executed_collectives``) by mesh
    axis, per micro-batch pass, the gathers against the one-gather-per-layer-per-pass floor
    (empty without the figures)."""
    g = p.memory.gathers
    if not g or set(g) == {"unknown loops"}:
        return []
    s = p.step
    passes = s["micro_batches"] * s["mini_batches"] * s["ppo_epochs"]
    lines = [f"all-gathers executed in one step (loop trip counts applied), per micro-batch "
             f"pass ({passes} of them)",
             f"{'  over':<22}{'MiB / pass':>14}"]
    for axes, b in sorted((k, v) for k, v in g.items() if k != "unknown loops"):
        lines.append(f"{'  ' + axes:<22}{_mib(b / passes):>14}")
    ratio = p.gathers_per_micro_batch
    if ratio is not None:
        lines.append(f"  FSDP: {ratio:.2f} x the FSDP-split weights "
                     f"({_mib(p.weights_gathered_bytes)} MiB) per pass; one gather of each in "
                     "the forward and one in the backward pass is 2.00 (forward-only passes "
                     "add theirs; the embedding table is looked up in place, not gathered)")
    r = {k: v for k, v in p.memory.reduces.items() if k != "unknown loops"}
    if r:
        lines.append("all-reduces executed in one step, per micro-batch pass: " + ", ".join(
            f"over {axes} {_mib(b / passes)} MiB" for axes, b in sorted(r.items())))
    if g.get("unknown loops"):
        lines.append(f"  ({g['unknown loops']} loops of unknown trip count counted once)")
    return lines + [""]


def format_collectives(collectives: dict, what: str) -> list[str]:
    """A table of ``count_collectives``' result (empty when there are none)."""
    if not collectives:
        return []
    lines = [f"collectives in {what} (static count; bytes: per-device results)",
             f"{'  op':<22}{'count':>7}{'MiB':>12}{'largest MiB':>14}"]
    for op, v in collectives.items():
        lines.append(f"{'  ' + op:<22}{v['count']:>7}{_mib(v['bytes']):>12}"
                     f"{_mib(v['max_bytes']):>14}")
    return lines + [""]


def format_sampler(p: Plan) -> list[str]:
    """The sampler's lines of ``format_plan``: the call planned for and a two-column table
    (prefill, decode step) of its device's bytes, plus that device's peak with the train
    state."""
    s = p.sampler
    d = s.dims
    share = "one host's share of " if d["hosts"] > 1 else ""
    call = "the step's trajectories" if d["call"] == "train" else "trainer.eval_tasks"
    pre, dec = s.prefill, s.decode

    def row(label, a, b):
        return f"{'  ' + label:<34}{_mib(a):>12}{_mib(b):>12}"

    m = s.mesh
    if m["data"] * m["tensor"] == 1:
        where = (f"JAX sampler: compiled for ONE {s.device_kind} device (each host runs it on "
                 "one of its devices, with the whole model; sampler.data_parallel / "
                 "tensor_parallel split it over the host's devices)")
    else:
        where = (f"JAX sampler: compiled for {m['data'] * m['tensor']} {s.device_kind} "
                 f"devices of one host: prompts and KV cache rows over data={m['data']}, heads "
                 f"over tensor={m['tensor']}")
    lines = [
        where,
        f"sampler call: {d['prompts']} prompts ({share}{call}) in a batch of {d['batch']}, "
        f"padded to {d['prompt_len']} tokens, {d['new_tokens']} new tokens, KV cache of "
        f"{d['cache_len']} slots",
        "",
        f"{'sampler, per device':<34}{'prefill MiB':>12}{'decode MiB':>12}",
        row("parameters", s.params_bytes, s.params_bytes),
        row("KV cache", s.kv_cache_bytes, s.kv_cache_bytes),
        row("arguments (compiled)", pre.argument_bytes, dec.argument_bytes),
        row("outputs", pre.output_bytes, dec.output_bytes),
        row("temporaries", pre.temp_bytes, dec.temp_bytes),
        row("code", pre.code_bytes, dec.code_bytes),
    ]
    if pre.alias_bytes or dec.alias_bytes:
        lines.append(row("aliased (counted once)", -pre.alias_bytes, -dec.alias_bytes))
    lines += [
        row("total", pre.total_bytes, dec.total_bytes),
        f"{'  compile time (s)':<34}{pre.compile_s:>12.1f}{dec.compile_s:>12.1f}",
        f"{'  device peak with the train state':<34}{_mib(p.sampler_device_bytes):>12}   "
        f"(max of sampler + train state {_mib(p.state_bytes)}, train step"
        + (", the sampler's weights freed during it)" if p.sampler_released else
           " + sampler weights: async rollouts keep them)"),
    ]
    if m["data"] * m["tensor"] > 1:
        lines += [""] + format_collectives(dec.collectives, "the sampler's decode step")[:-1]
    return lines
