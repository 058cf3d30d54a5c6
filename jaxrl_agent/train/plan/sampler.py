"""The JAX sampler's plan: its jitted prefill and decode step compiled for the devices one
host gives it (``plan_sampler`` -> ``SamplerPlan``), around a model of shapes only
(``abstract_sampler``), for the run's largest call (``sampler_dims``) or, where it does not fit
beside the train state, the call size a run chooses (``train.call_size``); and one decode step
alone, whose bytes accessed against the chip's bandwidth predict the decode speed."""

from __future__ import annotations

import dataclasses
import math
import time

import jax

from jaxrl_agent import config as config_lib
from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import Transformer
from jaxrl_agent.sampling.jax_sampler import JaxSampler
from jaxrl_agent.sharding import local_bytes
from jaxrl_agent.train.build import jax_sampler_args, sampler_batch_buckets
from jaxrl_agent.train.call_size import (choose_call_size, kept_bytes, kv_cache_bytes,
                                         sampler_dims)
from jaxrl_agent.train.plan.hlo import on_chip_copy_bytes
from jaxrl_agent.train.plan.memory import CompiledMemory, compile_memory, num_params
from jaxrl_agent.train.plan.topology import PlanError


@dataclasses.dataclass
class SamplerPlan:
    """The JAX sampler's prefill and decode step compiled for the devices of one host it runs
    on: ``mesh`` ``{"data": d, "tensor": t}`` (``sampler.data_parallel`` x
    ``sampler.tensor_parallel``; 1 x 1 is one device with the whole model). Bytes are per
    device; ``dims`` is the call planned for (``sampler_dims``, its ``batch`` the rows of one
    call)."""

    device_kind: str
    mesh: dict
    dims: dict
    num_params: int
    params_bytes: int
    kv_cache_bytes: int
    prefill: CompiledMemory
    decode: CompiledMemory
    #: how the call was sized to fit beside the train state (``sampler.call_rows: 0`` on a chip
    #: with a memory limit, ``call_size.choose_call_size``): ``{"budget", "tried": [(rows,
    #: reuse_calls, bytes or None)], "rows", "reuse_dropped"}``; None when the size was not
    #: searched (set by the user, or no limit to fit)
    sized: dict | None = None
    #: the kept KV caches beside the call's last chunk (``call_size.kept_bytes``)
    kept_bytes: int = 0
    #: one decode step (``_decode_step_bytes``): its HBM traffic (XLA's bytes accessed of one
    #: more step less the copies into on-chip memory, ``hlo.on_chip_copy_bytes``), XLA's
    #: figure as counted, and the compile time of the two programs; None when not compiled
    step_bytes: int | None = None
    step_compile_s: float = 0.0
    step_bytes_counted: int | None = None
    #: bytes of the sampler's state a decode step need not read: an untied embedding table
    #: (the step gathers one row per sampled token; the LM head is another matrix)
    unread_bytes: int = 0
    #: the chip's memory bandwidth (bytes/s; ``topology.HBM_BANDWIDTH``), None off a TPU
    bandwidth: float | None = None

    @property
    def peak_bytes(self) -> int:
        """The larger of the prefill's and the decode step's totals, plus the kept caches of
        earlier calls. The two programs do not add up: the cache the prefill returns is one of
        the decode step's arguments."""
        return max(self.prefill.total_bytes, self.decode.total_bytes) + self.kept_bytes

    @property
    def floor_step_bytes(self) -> int:
        """What one decode step must read at least per device: every weight it uses (all but
        an untied embedding table, of which it gathers a row per token) and the whole KV
        cache of the call, once each (the decode roofline's bytes)."""
        return self.params_bytes - self.unread_bytes + self.kv_cache_bytes

    @property
    def roofline_fraction(self) -> float | None:
        """``floor_step_bytes / step_bytes``: 1.0 is a step that reads nothing but the
        weights and the cache, once (None without the step's cost)."""
        return None if not self.step_bytes else self.floor_step_bytes / self.step_bytes

    @property
    def step_seconds(self) -> float | None:
        """One decode step's time predicted at the chip's memory bandwidth: ``step_bytes /
        bandwidth`` (decode is memory-bound: each step reads every weight for a few rows)."""
        if not self.step_bytes or not self.bandwidth:
            return None
        return self.step_bytes / self.bandwidth

    @property
    def tokens_per_s_per_chip(self) -> float | None:
        """The call's rows decoded per predicted step time, per chip of the sampler's mesh."""
        t = self.step_seconds
        chips = self.mesh["data"] * self.mesh["tensor"]
        return None if t is None else self.dims["batch"] / t / chips


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
    if sp.sized and sp.sized["reuse_dropped"]:
        out.append(f"sampler.reuse_calls: {cfg.sampler.reuse_calls}: the kept KV caches of "
                   "earlier calls fit at no call size beside the train state, so a run on this "
                   "slice turns them off (every turn prefills its whole prompt)")
    elif cfg.sampler.name == "jax" and cfg.sampler.reuse_calls:
        n = cfg.sampler.reuse_calls
        out.append(f"sampler.reuse_calls: {n}: between a rollout's turns up to {n} earlier "
                   f"calls' KV caches ({sp.kept_bytes / 2**30:.2f} GiB per device) stay beside "
                   "a call, counted in the sampler's peak; every weight sync drops them (set 0 "
                   "where the sampler's memory is tight)")
    t = cfg.trainer
    if t.async_rollouts and t.rollout_workers > 1:
        out.append(f"trainer.async_rollouts: {t.rollout_workers} rollout workers can be inside "
                   "a sampler call at once, each with its own KV cache (planned: one call)")
    return out


def plan_sampler(sampler: JaxSampler, cfg: config_lib.RunConfig, *, num_hosts: int = 1,
                 budget: int | None = None, bandwidth: float | None = None,
                 decode_step: bool = True) -> SamplerPlan:
    """Compiles ``sampler``'s own jitted prefill and decode loop ahead of time
    (``JaxSampler.lower``: on its mesh, or on the device of its weights) from shapes only, for
    the run's largest call (``sampler_dims``): prompts ``[batch, prompt_len]``, a KV cache of
    ``cache_len`` slots, outputs of ``new_tokens``. ``sampler`` may be ``abstract_sampler``'s
    (no weights) or a real one.

    With ``budget`` (bytes per device a call may use beside the train state:
    ``call_size.CALL_MEMORY_FRACTION`` of the chip's HBM minus the train state) and
    ``sampler.call_rows: 0``, the call is sized as a run sizes it (``call_size.fit_call_rows``
    over the call's rows and their halvings, each size compiled once) and the sampler limited
    to the rows chosen; the plan is that call's. ``sampler.call_rows: N`` limits it to N.

    With ``decode_step``, also the decode step alone with its layers unrolled
    (``JaxSampler.lower_step``, 1 and 2 steps): the difference of XLA's bytes accessed is one
    step's memory traffic (``_decode_step_bytes``), against the floor of reading every weight
    and the KV cache once; with ``bandwidth`` (bytes/s) the step time and tokens/s that
    traffic predicts.

    Per device: ``params_bytes`` is the bytes of the sampler's state (every parameter, a value
    head too: the trainer hands the sampler its policy module) in its layout;
    ``kv_cache_bytes`` those of the cache the prefill returns (``call_size.kv_cache_bytes``).
    A program XLA refuses for lack of HBM is reported with XLA's figure
    (``CompiledMemory.refused``)."""
    if cfg.sampler.call_rows:
        sampler.limit_call_rows(cfg.sampler.call_rows)
    dims = sampler_dims(cfg, sampler, num_hosts)
    state = sampler.state
    leaves = jax.tree.leaves(state)
    params_b = local_bytes(state, [x.sharding for x in leaves])
    mc = sampler.config
    unread = 0
    if not mc.tie_word_embeddings:  # the table is gathered from, a row per sampled token
        table = jax.tree.leaves(state["embed_tokens"])
        unread = local_bytes(table, [x.sharding for x in table])
    rows_sh = sampler.batch_sharding or leaves[0].sharding
    compiled = {}

    def programs(B):
        if B not in compiled:
            L, N, C, S = (dims[k] for k in ("prompt_len", "new_tokens", "cache_len",
                                            "stop_ids"))
            prefill, decode = sampler.lower(B, L, N, stop_ids=S, cache_len=C)
            rows = math.prod(rows_sh.shard_shape((B,)))
            cache_b = kv_cache_bytes(sampler, B, C)
            logits_b = rows * mc.vocab_size * 4
            # (when XLA refuses a program: its arguments and outputs from the shapes above)
            compiled[B] = (
                compile_memory(lambda: prefill, params_b + rows * (4 * L + 4),
                               cache_b + logits_b),
                compile_memory(lambda: decode, params_b + cache_b + logits_b
                               + rows * (40 + 4 * S), rows * (8 * N + 4) + cache_b))
        return compiled[B]

    sized = None
    if budget is not None and not cfg.sampler.call_rows:
        # as a run sizes it (call_size.size_sampler_calls), XLA's figure where it refuses
        rows, reuse, tried = choose_call_size(
            lambda B: max(m.total_bytes for m in programs(B)), sampler, dims, budget)
        sized = {"budget": budget, "tried": tried, "rows": rows,
                 "reuse_dropped": reuse != sampler.reuse_calls}
        if rows is not None:
            sampler.limit_call_rows(rows)
            sampler.reuse_calls = reuse
            dims = sampler_dims(cfg, sampler, num_hosts)
    B = dims["batch"]
    pre, dec = programs(B)
    step_bytes, counted, step_s = None, None, 0.0
    if decode_step:
        step_bytes, counted, step_s = _decode_step_bytes(sampler, dims, cfg.rollout.top_k,
                                                         cfg.rollout.top_p)
    device = min(leaves[0].sharding.device_set, key=lambda d: d.id)
    mesh = dict(sampler.mesh.shape) if sampler.mesh is not None else {}
    return SamplerPlan(device_kind=getattr(device, "device_kind", device.platform),
                       mesh={"data": mesh.get("data", 1), "tensor": mesh.get("tensor", 1)},
                       dims=dims, num_params=num_params(state), params_bytes=params_b,
                       kv_cache_bytes=kv_cache_bytes(sampler, B, dims["cache_len"]),
                       prefill=pre, decode=dec, sized=sized,
                       kept_bytes=kept_bytes(sampler, dims, B, sampler.reuse_calls),
                       step_bytes=step_bytes, step_bytes_counted=counted, unread_bytes=unread,
                       step_compile_s=step_s, bandwidth=bandwidth)


def _decode_step_bytes(sampler: JaxSampler, dims: dict, top_k: int,
                       top_p: float) -> tuple[int | None, int | None, float]:
    """One decode step's HBM bytes per device, XLA's bytes accessed of it, and the two
    compile times: the cost analysis of 2 decode steps minus that of 1
    (``JaxSampler.lower_step``, layers unrolled, every row sampling with the run's
    ``rollout.top_k`` / ``top_p``: the vocabulary sort counts only when they truncate), so
    the layout copies XLA puts at a program's entry and exit (once per call in the decode
    loop) are not counted. The HBM figure leaves out, in each program, the bytes the cost
    analysis counts for buffers placed in on-chip memory (``hlo.on_chip_copy_bytes``: on TPU
    each layer's KV-cache slice is copied into VMEM before its attention, and XLA counts the
    slice three times where HBM serves it once). None when XLA refuses a program or gives no
    figure."""
    t0 = time.perf_counter()
    got, hbm = [], []
    for steps in (1, 2):
        try:
            compiled = sampler.lower_step(dims["batch"], dims["cache_len"], dims["new_tokens"],
                                          stop_ids=dims["stop_ids"], steps=steps, top_k=top_k,
                                          top_p=top_p).compile()
        except Exception as e:  # XLA's "ran out of memory": no figure
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return None, None, time.perf_counter() - t0
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        b = (cost or {}).get("bytes accessed")
        got.append(b)
        hbm.append(None if not b else b - on_chip_copy_bytes(compiled.as_text()))
    if not all(got):
        return None, None, time.perf_counter() - t0
    return int(hbm[1] - hbm[0]), int(got[1] - got[0]), time.perf_counter() - t0
