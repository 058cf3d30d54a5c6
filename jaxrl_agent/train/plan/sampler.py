"""The JAX sampler's plan: its jitted prefill and decode step compiled for the devices one
host gives it (``plan_sampler`` -> ``SamplerPlan``), around a model of shapes only
(``abstract_sampler``), for the run's largest call (``sampler_dims``)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxrl_agent import config as config_lib
from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import Transformer, param_dtype
from jaxrl_agent.sampling.jax_sampler import JaxSampler
from jaxrl_agent.train.build import jax_sampler_args, sampler_batch_buckets
from jaxrl_agent.train.plan.memory import CompiledMemory, compile_memory, local_bytes, num_params
from jaxrl_agent.train.plan.topology import PlanError


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
    than the model's positions, the kept caches of earlier calls, several rollout workers
    sampling at once."""
    out = [f"sampler {name}: XLA refused to compile it (it ran out of HBM): temporaries are "
           "XLA's figure, arguments and outputs are from the shapes"
           for name, m in (("prefill", sp.prefill), ("decode step", sp.decode)) if m.refused]
    if sp.dims["cache_len"] > mc.max_position_embeddings:
        out.append(f"the sampler's KV cache ({sp.dims['cache_len']} slots, from "
                   "rollout.max_context_tokens) is longer than the model's "
                   f"max_position_embeddings ({mc.max_position_embeddings})")
    if cfg.sampler.name == "jax" and cfg.sampler.reuse_calls:
        n = cfg.sampler.reuse_calls
        out.append(f"sampler.reuse_calls: {n}: between a rollout's turns up to {n} earlier "
                   f"calls' KV caches (up to {n * sp.kv_cache_bytes / 2**30:.2f} GiB per device) "
                   "stay beside a call, not counted above; every weight sync drops them "
                   "(set 0 where the sampler's memory is tight)")
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
    params_b = local_bytes(state, [x.sharding for x in leaves])
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
                       dims=dims, num_params=num_params(state), params_bytes=params_b,
                       kv_cache_bytes=cache_b, prefill=pre, decode=dec)
