"""Meshes, partition rules and multi-host helpers: the same train step on 1 CPU or a pod.

* ``mesh``: ``make_mesh`` -> a ``(data, fsdp, tensor)`` mesh; the batch goes over
  ``data x fsdp``.
* ``rules``: logical parameter axes -> mesh axes (``DEFAULT_RULES``), shardings for the train
  state (optimizer state like its parameters), a per-parameter layout table.
* ``multihost``: ``jax.distributed`` start, host-local work sharing, global batches.
"""

from jaxrl_agent.sharding.mesh import (AXES, BATCH_AXES, batch_shards, batch_sharding,
                                       batch_spec, make_mesh, replicated, resolve_axes,
                                       sampler_mesh)
from jaxrl_agent.sharding.rules import (DEFAULT_RULES, bytes_per_device, check_rules,
                                        layer_use_shardings, layout_table, local_bytes,
                                        logical_axes,
                                        param_shardings, param_specs, residual_spec, spec_for,
                                        train_state_shardings)

__all__ = [
    "AXES", "BATCH_AXES", "DEFAULT_RULES", "batch_shards", "batch_sharding", "batch_spec",
    "bytes_per_device", "check_rules", "layer_use_shardings", "layout_table", "local_bytes",
    "logical_axes",
    "make_mesh", "param_shardings", "param_specs", "replicated", "residual_spec", "resolve_axes",
    "sampler_mesh", "spec_for", "train_state_shardings",
]
