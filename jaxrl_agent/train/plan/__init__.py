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

The package, by concern (as MaxText keeps ``train_compile`` apart from its trainer):
``topology`` (the devices of a named topology, the chip's HBM), ``hlo`` (reading the compiled
program's collectives and loop trip counts), ``memory`` (the analytic floor and the compiled
memory analysis), ``sampler`` (the JAX sampler's prefill and decode), ``run`` (the train
step's plan, the micro-batch search) and ``report`` (the text ``jaxrl-agent plan`` prints).
Everything a caller needs is imported here.
"""

from jaxrl_agent.train.plan.hlo import (COLLECTIVES, count_collectives, executed_collectives,
                                       executions, on_chip_copy_bytes)
from jaxrl_agent.train.plan.memory import CompiledMemory, compile_memory, memory_floor
from jaxrl_agent.train.plan.report import format_plan
from jaxrl_agent.train.plan.run import (HF_SHAPES, Plan, batch_dims, fit_micro_batches,
                                       load_hf_config, model_config, plan_run,
                                       teacher_model_config)
from jaxrl_agent.train.plan.sampler import (SamplerPlan, abstract_sampler, plan_sampler,
                                           sampler_dims)
from jaxrl_agent.train.plan.topology import (HBM_GIB, PlanError, chip_kind, libtpu_available,
                                            topology_devices)

__all__ = ["PlanError", "Plan", "SamplerPlan", "CompiledMemory", "HBM_GIB", "HF_SHAPES",
           "COLLECTIVES", "topology_devices", "chip_kind", "libtpu_available", "plan_run",
           "plan_sampler", "abstract_sampler", "sampler_dims", "format_plan",
           "count_collectives", "executed_collectives", "executions", "on_chip_copy_bytes",
           "compile_memory",
           "memory_floor", "fit_micro_batches", "model_config", "teacher_model_config",
           "batch_dims", "load_hf_config"]
