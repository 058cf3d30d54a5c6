"""Building a run's parts from its config: the model (an HF folder or the built-in one) and
its codec, the sampler (JAX or vLLM), the train step's static settings and the optimizer.

The ``Trainer`` (``train.loop``) and ``jaxrl-agent plan`` (``train.plan``) build from here, so a
planned step is the trained one.
"""

from __future__ import annotations

import pathlib

import jax
from flax import nnx

from jaxrl_agent import config as config_lib
from jaxrl_agent import run_checks, sharding
from jaxrl_agent.batch import bucket
from jaxrl_agent.sampling.jax_sampler import JaxSampler
from jaxrl_agent.sharding import multihost
from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import Transformer, trainable_filter
from jaxrl_agent.rollout.collect import ByteCodec
from jaxrl_agent.train.step import StepConfig, lr_schedule, make_optimizer, split_trainable

__all__ = ["build_model", "build_sampler", "builtin_model_config", "jax_sampler_args",
           "lora_fields", "lora_summary", "run_lr_schedule", "run_optimizer",
           "sampler_batch_buckets", "step_config", "step_paths"]


def builtin_model_config(cfg: config_lib.RunConfig) -> ModelConfig:
    """The built-in model's shapes (``model.hf_path: null``): a Qwen3-style decoder of the
    ``model`` section's dims over the byte codec's ids."""
    m, codec = cfg.model, ByteCodec()
    return ModelConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                       intermediate_size=m.intermediate_size, num_layers=m.num_layers,
                       num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                       max_position_embeddings=m.max_position_embeddings, dtype=m.dtype,
                       family="qwen3", qk_norm=True, value_head=m.value_head,
                       value_stop_gradient=m.value_stop_gradient,
                       bos_token_id=codec.bos_token_id, eos_token_id=codec.eos_token_id,
                       pad_token_id=codec.pad_token_id, **lora_fields(cfg))


def lora_summary(mc: ModelConfig, params, sampler=None) -> str:
    """``"LoRA rank r on q_proj, ...: N of M parameters trained (x%), the base frozen; "`` for
    the start-up summary, and how the sampler gets the adapters (empty without LoRA)."""
    if not mc.lora_rank:
        return ""
    trained, _ = split_trainable(params, trainable_filter(mc))
    n = sum(x.size for x in jax.tree.leaves(trained))
    total = sum(x.size for x in jax.tree.leaves(params))
    return (f"LoRA rank {mc.lora_rank} (alpha {mc.lora_alpha:g}) on "
            f"{', '.join(mc.lora_targets)}: {n:,} of {total:,} parameters trained "
            f"({100 * n / total:.1f}%), the base frozen, "
            + ("the sampler runs the adapters; " if not hasattr(sampler, "adapter_sync") else
               "vLLM receives the adapters alone at each sync (its LoRA path); "
               if sampler.adapter_sync else "vLLM receives the merged weights at each sync; "))


def lora_fields(cfg: config_lib.RunConfig) -> dict:
    """The ``ModelConfig`` fields of the run's ``model.lora`` section (none without LoRA)."""
    lo = cfg.model.lora
    if not lo.rank:
        return {}
    return dict(lora_rank=lo.rank, lora_alpha=lo.alpha, lora_targets=tuple(lo.targets),
                lora_train_norms=lo.train_norms)


def build_model(cfg: config_lib.RunConfig, seed: int):
    """``(model, codec, where)`` for the config: a local HF folder, or the tiny built-in model
    with the byte codec (saved as an HF folder, with the codec as its tokenizer, at
    ``model.builtin_dir`` or ``<run.dir>/base_model`` on first use and loaded from there
    afterwards)."""
    m = cfg.model
    if m.hf_path is not None:
        from jaxrl_agent.models.hf import load_hf
        from jaxrl_agent.models.tokenizer import load_tokenizer
        model, _ = load_hf(m.hf_path, dtype=m.dtype, seed=seed, value_head=m.value_head,
                           value_stop_gradient=m.value_stop_gradient, **lora_fields(cfg))
        return model, load_tokenizer(m.hf_path), m.hf_path
    from jaxrl_agent.models.hf import load_hf, save_hf
    codec = ByteCodec()
    mc = builtin_model_config(cfg)
    folder = pathlib.Path(config_lib.run_paths(cfg).base_model)
    if (folder / "config.json").exists():
        model, loaded = load_hf(str(folder), dtype=m.dtype, seed=seed, value_head=m.value_head,
                                value_stop_gradient=m.value_stop_gradient, **lora_fields(cfg))
        same = {k: getattr(loaded, k) for k in ("vocab_size", "hidden_size", "num_layers",
                                                 "num_heads", "num_kv_heads", "head_dim")}
        want = {k: getattr(mc, k) for k in same}
        if same != want:
            raise config_lib.ConfigError(
                f"model.builtin_dir {str(folder)!r} holds a model with {same}, but the config "
                f"asks for {want}; point model.builtin_dir elsewhere or delete that folder")
        return model, codec, f"{folder} (built-in, loaded)"
    model = Transformer(mc, rngs=nnx.Rngs(seed))  # the same weights on every process (seeded)
    if multihost.is_main_process():
        save_hf(model, mc, str(folder))
        codec.save_pretrained(str(folder))
    return model, codec, f"{folder} (built-in, created now)"


def sampler_batch_buckets(cfg: config_lib.RunConfig, num_hosts: int = 1) -> tuple[int, ...]:
    """The batch buckets of the run's sampler: the most prompts one host sends at once in a
    step (its share of ``tasks_per_step`` x ``group_size`` x the forks of ``branch_turns``)
    and in an evaluation (its share of ``trainer.eval_tasks``), each rounded up to a power of
    two >= 8."""
    r, hosts = cfg.rollout, max(int(num_hosts), 1)
    train = -(-r.tasks_per_step // hosts) * r.group_size * r.branch_factor ** len(r.branch_turns)
    return tuple(sorted({bucket(train, 8), bucket(-(-cfg.trainer.eval_tasks // hosts), 8)}))


def jax_sampler_args(cfg: config_lib.RunConfig, model, batch_buckets,
                     devices=None) -> dict:
    """The keyword arguments the run gives ``JaxSampler`` besides ``model``: ``max_len =
    rollout.max_context_tokens``, ``batch_buckets``, the run's seed, ``sampler.prefill_chunk``
    and ``reuse_calls`` and, with ``sampler.data_parallel`` x ``tensor_parallel`` != 1 x 1, a
    ``sharding.sampler_mesh`` over ``devices`` (default this process's) with the parameters
    laid out by the run's partition rules.

    Raises:
      ValueError: sampler sizes that do not fit the devices.
    """
    s = cfg.sampler
    mesh = shardings = None
    if (s.data_parallel, s.tensor_parallel) != (1, 1):  # split over this host's devices
        mesh = sharding.sampler_mesh(s.data_parallel, s.tensor_parallel, devices=devices)
        shardings = sharding.param_shardings(nnx.state(model), mesh,
                                             {**sharding.DEFAULT_RULES, **cfg.mesh.rules})
    return dict(max_len=cfg.rollout.max_context_tokens, batch_buckets=batch_buckets,
                seed=cfg.trainer.seed, mesh=mesh, param_shardings=shardings,
                prefill_chunk=s.prefill_chunk or None, reuse_calls=s.reuse_calls)


def build_sampler(cfg: config_lib.RunConfig, model, *, batch_buckets=(8, 32, 128)):
    """The run's sampler (``cfg.sampler``): the JAX KV-cache sampler, or vLLM's engine in this
    process (``sampling.vllm.VllmSampler``), both starting from ``model``'s weights."""
    if cfg.sampler.name == "jax":
        try:
            return JaxSampler(model, **jax_sampler_args(cfg, model, batch_buckets))
        except ValueError as e:  # sizes that do not fit the host, heads tensor does not divide
            msg = str(e)
            raise config_lib.ConfigError(msg if msg.startswith("sampler") else
                                         f"sampler: {msg}") from None
    from jaxrl_agent.sampling.vllm import VllmSampler
    try:
        return _vllm_sampler(VllmSampler, cfg, model)
    except ValueError as e:   # a head size vLLM's CPU kernels lack: a config problem
        if "head_dim" not in str(e):
            raise
        raise config_lib.ConfigError(f"sampler: vllm: {e}") from None


def _vllm_sampler(VllmSampler, cfg, model):
    s, r, seed = cfg.sampler, cfg.rollout, cfg.trainer.seed
    return VllmSampler(model, max_len=r.max_context_tokens, dtype=s.dtype,
                       max_num_seqs=s.max_num_seqs,
                       kv_cache_bytes=s.kv_cache_mb * 2 ** 20 if s.kv_cache_mb else None,
                       gpu_memory_utilization=s.gpu_memory_utilization,
                       enforce_eager=s.enforce_eager, seed=seed, transfer=s.transfer,
                       probe_every=s.probe_every, probe_tol=s.probe_tol,
                       adapter_sync=s.lora_sync == "adapters")


def step_config(cfg: config_lib.RunConfig, data_shards: int, pipeline=None) -> StepConfig:
    """The train step's static settings of a run (``data_shards``: the batch's split over the
    mesh's data x fsdp axes; ``pipeline``: the run's ``config.pipeline``, built here when not
    given); the trainer and ``jaxrl-agent plan`` build the step from it."""
    t, r = cfg.trainer, cfg.rollout
    pipe = pipeline if pipeline is not None else config_lib.pipeline(cfg)
    return StepConfig(
        estimator=pipe.estimator[0], estimator_params=pipe.estimator[1],
        shaping=pipe.shaping, then=pipe.then,
        policy_loss=cfg.loss.policy, policy_params=tuple(sorted(cfg.loss.params.items())),
        agg=cfg.loss.agg, kl_coef=cfg.loss.kl_coef, kl_estimator=cfg.loss.kl_estimator,
        entropy_coef=cfg.loss.entropy_coef, value_coef=cfg.loss.value_coef,
        micro_batches=t.micro_batches, mini_batches=t.mini_batches, ppo_epochs=t.ppo_epochs,
        data_shards=data_shards, remat=t.remat, logits_chunk=t.logits_chunk,
        attention=t.attention, mlp_chunk=t.mlp_chunk,
        temperature=r.temperature,
        top_k=r.top_k, top_p=r.top_p, is_weights=cfg.loss.is_weights,
        is_level=cfg.loss.is_level, is_cap=cfg.loss.is_cap, is_lower=cfg.loss.is_lower,
        decoupled=cfg.loss.decoupled, teacher=config_lib.teacher_kind(cfg),
        teacher_ema=cfg.teacher.ema_decay, extra_reads=run_checks.step_reads(cfg),
        teacher_view=config_lib.teacher_has_context(cfg), teacher_top_k=cfg.teacher.top_k,
        teacher_temperature=cfg.teacher.temperature,
        aux_losses=config_lib.aux_losses(cfg), sarsa_coef=cfg.loss.sarsa_coef,
        sarsa_gamma=cfg.loss.sarsa_gamma, policy_drift=cfg.metrics.policy_drift)


def step_paths(scfg: StepConfig) -> str:
    """How the train step computes, in words (the start-up summary): layers under one scan
    with the remat policy, the attention path, log-probs chunked over positions."""
    mlp = f"; MLP in tiles of {scfg.mlp_chunk} positions" if scfg.mlp_chunk else ""
    return (f"layers scanned, remat {scfg.remat}; attention {scfg.attention}{mlp}; "
            f"log-probs/entropy in chunks of {scfg.logits_chunk} positions (no [rows, T, vocab] "
            "logits)")


def _schedule(cfg: config_lib.RunConfig) -> tuple[int, dict]:
    """``(updates per step, the schedule's arguments counted in updates)`` of the run."""
    t, o = cfg.trainer, cfg.optimizer
    updates = t.ppo_epochs * t.mini_batches
    return updates, dict(total_steps=t.steps * updates, warmup_steps=o.warmup_steps * updates,
                         decay=o.decay)


def run_lr_schedule(cfg: config_lib.RunConfig):
    """``step -> learning rate`` of step ``step``'s first update (``run_optimizer``'s
    schedule)."""
    updates, args = _schedule(cfg)
    sched = lr_schedule(cfg.optimizer.lr, **args)
    return lambda step: float(sched(step * updates))


def run_optimizer(cfg: config_lib.RunConfig):
    """The run's optax optimizer: AdamW on the schedule of ``cfg.optimizer``, counted in
    updates (``ppo_epochs x mini_batches`` per step)."""
    o = cfg.optimizer
    return make_optimizer(o.lr, **_schedule(cfg)[1], weight_decay=o.weight_decay,
                          grad_clip=o.grad_clip, b1=o.b1, b2=o.b2, eps=o.eps)

