"""The JAX sampler's calls sized to fit the chip beside the train state (``sampler.call_rows``).

A rollout turn asks the sampler for every live trajectory's next action at once (``tasks_per_step
x group_size`` prompts, or ``trainer.eval_tasks``); ``JaxSampler.generate`` prefills and decodes
them ``call_rows`` at a time (``JaxSampler.limit_call_rows``: a larger call runs as chunks, one
after the other, with the same samples). ``sampler.call_rows: N`` fixes it; ``0`` (the default)
lets the run choose:

* on a device that reports its memory (TPU, GPU: ``memory_stats()["bytes_limit"]``), the budget
  is ``CALL_MEMORY_FRACTION`` (85%) of it minus the train state's bytes on that device (the
  sampler shares the chip with the train state, which stays between steps);
* a call's bytes are the larger of its compiled prefill's and decode loop's peaks (XLA's memory
  analysis of ``JaxSampler.lower``: arguments + outputs - aliased + temporaries + code) plus the
  KV caches kept beside its last chunk (``kept_bytes``: every chunk of ``sampler.reuse_calls``
  earlier calls and the call's own finished chunks, ``kv_cache_bytes`` each);
* the rows tried are the run's largest call (``sampler_dims``) and its halvings, each a
  multiple of the sampler mesh's ``data`` axis (``call_candidates``); the largest that fits is
  found by bisection (``fit_call_rows``: peaks grow with the rows), one compile per size tried,
  as vLLM sizes its KV cache from a profiling run at start-up;
* when no size fits with the kept caches (they grow with the whole call, not with a chunk),
  the kept caches are turned off for the run (``reuse_calls`` 0: every turn prefills its whole
  prompt) and the sizes tried again;
* on CPU (no memory limit) the whole call.

``jaxrl-agent plan`` makes the same choice from the same programs compiled for a topology
(``train.plan.sampler``), so its report is the call size a run on that slice uses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_agent import config as config_lib
from jaxrl_agent.models.transformer import param_dtype

__all__ = ["CALL_MEMORY_FRACTION", "CallSize", "call_candidates", "choose_call_size",
           "compiled_call_bytes", "device_memory_limit", "fit_call_rows", "kept_bytes",
           "kv_cache_bytes", "sampler_dims", "size_sampler_calls"]

#: the share of a device's memory a sampler call may fill with the train state beside it
CALL_MEMORY_FRACTION = 0.85


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
      chunks of the largest bucket, ``call_rows``) rounded up to a batch bucket;
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


def call_candidates(batch: int, data: int = 1) -> list[int]:
    """The call sizes tried, largest first: ``batch`` and its halvings, each rounded up to a
    multiple of ``data`` (the sampler mesh's rows axis), down to ``data``; distinct."""
    data = max(int(data), 1)
    out, rows = [], int(batch)
    while True:
        r = -(-rows // data) * data
        if r not in out:
            out.append(r)
        if r <= data:
            return out
        rows = -(-rows // 2)


def fit_call_rows(peak_of: Callable[[int], int | None], candidates, budget: int):
    """The largest of ``candidates`` (descending) whose ``peak_of(rows)`` (bytes; None = XLA
    would not compile it for lack of memory) is at most ``budget``, by bisection: peaks grow
    with the rows. The largest is tried first (one compile when the whole call fits).

    Returns:
      ``(rows or None when none fits, [(rows, peak), ...] in the order tried)``.
    """
    tried = []

    def fits(i):
        peak = peak_of(candidates[i])
        tried.append((candidates[i], peak))
        return peak is not None and peak <= budget

    if fits(0):
        return candidates[0], tried
    lo, hi = 1, len(candidates) - 1   # the answer, if any, is in [lo, hi]
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, hi = mid, mid - 1
        else:
            lo = mid + 1
    return (None if best is None else candidates[best]), tried


def kv_cache_bytes(sampler, rows: int, cache_len: int) -> int:
    """Per device, the bytes of a ``rows`` x ``cache_len``-slot KV cache the sampler writes:
    ``2 x layers x rows x kv_heads x cache_len x head_dim`` x the parameter dtype's bytes plus
    ``rows`` int32 indices, divided over its mesh (rows over ``data``, heads over
    ``tensor``)."""
    mc = sampler.config
    leaves = jax.tree.leaves(sampler.state)
    rows_sh = sampler.batch_sharding or leaves[0].sharding
    kv_sh = sampler.cache_sharding or rows_sh
    local_rows = math.prod(rows_sh.shard_shape((rows,)))
    kv = math.prod(kv_sh.shard_shape((mc.num_layers, rows, mc.num_kv_heads, cache_len,
                                      mc.head_dim)))
    return 2 * kv * jnp.dtype(param_dtype(mc)).itemsize + 4 * local_rows


def kept_bytes(sampler, dims: dict, rows: int, reuse_calls: int) -> int:
    """Per device, the kept KV caches beside the last chunk of a call of ``dims["prompts"]``
    prompts in chunks of ``rows``: ``reuse_calls`` earlier calls' ``n`` chunks each and the
    call's own ``n - 1`` finished ones, ``n = ceil(prompts / rows)`` (0 without reuse)."""
    if not reuse_calls:
        return 0
    n = -(-dims["prompts"] // rows)
    return (reuse_calls * n + n - 1) * kv_cache_bytes(sampler, rows, dims["cache_len"])


def _program_bytes(compiled) -> int:
    """A compiled program's peak per device: arguments + outputs - aliased + temporaries +
    code (XLA's memory analysis)."""
    ma = compiled.memory_analysis()
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
               + ma.temp_size_in_bytes + ma.generated_code_size_in_bytes)


def compiled_call_bytes(sampler, dims: dict, rows: int) -> int | None:
    """A call chunk of ``rows`` rows (``dims`` as ``sampler_dims`` gives them): the larger of
    its compiled prefill's and decode loop's peaks per device (no kept caches). None when XLA
    refuses to compile for lack of memory."""
    programs = sampler.lower(rows, dims["prompt_len"], dims["new_tokens"],
                             stop_ids=dims["stop_ids"], cache_len=dims["cache_len"])
    try:
        return max(_program_bytes(p.compile()) for p in programs)
    except Exception as e:  # XLA's "ran out of memory" means: does not fit
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None


def choose_call_size(program_bytes: Callable[[int], int | None], sampler, dims: dict,
                     budget: int) -> tuple[int | None, int, list]:
    """The rows per call and the kept calls (``reuse_calls``) that fit ``budget`` bytes per
    device: ``program_bytes(rows)`` (the compiled chunk's peak, None = refused; called once
    per size) plus ``kept_bytes``, the largest of ``call_candidates`` (``fit_call_rows``),
    first with the sampler's ``reuse_calls`` and, when nothing fits, with 0. A size whose kept
    caches alone exceed the budget is not compiled (its bytes are the kept caches').

    Returns:
      ``(rows or None, reuse_calls, [(rows, reuse_calls, bytes or None)] in the order
      tried)``.
    """
    memo: dict = {}

    def program(rows):
        if rows not in memo:
            memo[rows] = program_bytes(rows)
        return memo[rows]

    data = 1 if sampler.mesh is None else sampler.mesh.shape["data"]
    candidates = call_candidates(dims["batch"], data)
    tried = []
    for reuse in dict.fromkeys((sampler.reuse_calls, 0)):
        def peak(rows, reuse=reuse):
            kept = kept_bytes(sampler, dims, rows, reuse)
            if kept > budget:  # does not fit whatever the program: not compiled
                return kept
            p = program(rows)
            return None if p is None else p + kept

        rows, t = fit_call_rows(peak, candidates, budget)
        tried += [(r, reuse, b) for r, b in t]
        if rows is not None:
            return rows, reuse, tried
    return None, 0, tried


def device_memory_limit(device) -> int | None:
    """The bytes ``device`` may allocate (``memory_stats()["bytes_limit"]``), or None where it
    reports none (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


@dataclasses.dataclass
class CallSize:
    """How a run's sampler calls were sized: ``rows`` per call (None: none fits) and
    ``reuse_calls`` kept (0 when the kept caches did not fit), for the largest call ``dims``,
    within ``budget`` bytes per device (``CALL_MEMORY_FRACTION`` of ``limit`` minus ``state``
    bytes of train state), after ``tried`` ``[(rows, reuse_calls, bytes or None)]``."""

    rows: int | None
    reuse_calls: int
    dims: dict
    limit: int
    state: int
    budget: int
    tried: list

    def summary(self) -> str:
        """One start-up line."""
        gib = 2 ** 30
        tried = ", ".join(f"{r}{' with kept caches' if k else ''}: "
                          f"{'refused' if b is None else f'{b / gib:.2f} GiB'}"
                          for r, k, b in self.tried)
        calls = -(-self.dims["prompts"] // self.rows) if self.rows else 0
        head = (f"sampler calls: {self.rows} rows at once ({calls} chunk"
                f"{'s' if calls != 1 else ''} for {self.dims['prompts']} prompts)"
                if self.rows else "sampler calls: no size fits")
        dropped = (self.rows and not self.reuse_calls
                   and any(k for _, k, _ in self.tried))
        return (f"{head}, sized to fit {self.budget / gib:.2f} GiB per device "
                f"({CALL_MEMORY_FRACTION:.0%} of {self.limit / gib:.2f} GiB - train state "
                f"{self.state / gib:.2f} GiB; tried {tried})"
                + ("; the kept KV caches did not fit: sampler.reuse_calls 0 for this run"
                   if dropped else "") + "; sampler.call_rows fixes the size")


def size_sampler_calls(sampler, cfg: config_lib.RunConfig, *, limit: int, state: int,
                       num_hosts: int = 1,
                       program_bytes: Callable[[int], int | None] | None = None) -> CallSize:
    """Sizes ``sampler``'s calls to fit ``limit`` bytes per device with ``state`` bytes of
    train state beside them (see the module docstring, ``choose_call_size``), limits it to
    the rows chosen (``JaxSampler.limit_call_rows``) and turns its kept caches off when they
    do not fit. ``program_bytes(rows)``: a chunk's compiled peak (default
    ``compiled_call_bytes`` on the sampler's devices).

    Raises:
      config.ConfigError: not even the smallest call fits, naming the keys to change.
    """
    dims = sampler_dims(cfg, sampler, num_hosts)
    budget = int(CALL_MEMORY_FRACTION * limit) - int(state)
    program_bytes = program_bytes or (lambda rows: compiled_call_bytes(sampler, dims, rows))
    rows, reuse, tried = choose_call_size(program_bytes, sampler, dims, budget)
    size = CallSize(rows=rows, reuse_calls=reuse, dims=dims, limit=int(limit),
                    state=int(state), budget=budget, tried=tried)
    if rows is None:
        raise config_lib.ConfigError(
            f"{size.summary()}: not even {tried[-1][0]} rows per call fit; split the sampler "
            "over more of the host's chips (sampler.tensor_parallel), lower "
            "rollout.max_context_tokens, or split the train state over more devices "
            "(mesh.fsdp)")
    sampler.limit_call_rows(rows)
    if reuse != sampler.reuse_calls:
        sampler.reuse_calls = reuse
    return size
