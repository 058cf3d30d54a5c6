"""Device meshes: one 3-axis mesh ``(data, fsdp, tensor)`` for every layout.

* ``data``: pure data parallelism; parameters are replicated over it.
* ``fsdp``: the batch is split over it too, and parameters (and the optimizer state) are split
  along their ``embed`` dimension (ZeRO-3 / FSDP); XLA gathers them per layer.
* ``tensor``: Megatron-style tensor parallelism; heads, MLP and vocabulary dimensions are split.

The batch is sharded over ``data x fsdp`` (``BATCH_AXES``); a size-1 axis costs nothing, so
DP-only, FSDP-only and mixed layouts run the same code. Axes are ``AxisType.Auto``: XLA (GSPMD)
places the collectives and inputs need no manual pre-sharding (``jax.make_mesh`` defaults to
``Explicit`` axes, which reject unsharded arguments to ``shard_map``).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def resolve_axes(data: int = 1, fsdp: int = 1, tensor: int = 1, *,
                 num_devices: int) -> tuple[int, int, int]:
    """Sizes with the one ``-1`` axis (if any) given all remaining devices.

    Raises:
      ValueError: a size < 1 other than -1, more than one -1, or sizes that do not fit
        ``num_devices`` (naming the field ``mesh.<axis>``).
    """
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1):
            raise ValueError(f"mesh.{name} must be an int >= 1 or -1 (all remaining devices); "
                             f"got {v!r}")
    free = [n for n, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis may be -1; got {sizes}")
    fixed = 1
    for v in sizes.values():
        fixed *= max(v, 1)
    if free:
        if num_devices % fixed:
            raise ValueError(f"mesh: the fixed axes (product {fixed}) do not divide the "
                             f"{num_devices} devices")
        sizes[free[0]] = num_devices // fixed
    elif fixed > num_devices:
        raise ValueError(f"mesh: data*fsdp*tensor = {fixed}, but there are only {num_devices} "
                         "devices")
    return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(config: Any = None, *, devices: Sequence | None = None, **sizes) -> Mesh:
    """The ``(data, fsdp, tensor)`` mesh for ``config`` (anything with ``data``/``fsdp``/
    ``tensor`` attributes or keys, e.g. the YAML ``mesh:`` section) or keyword sizes.

    ``-1`` takes the remaining devices. Sizes whose product is smaller than the number of
    devices use the first devices (handy for tests and for a quick single-device run on a
    multi-device host); a multi-process run must use all devices.
    """
    if config is not None:
        get = config.get if isinstance(config, dict) else lambda k, d: getattr(config, k, d)
        sizes = {k: get(k, 1) for k in AXES} | sizes
    devices = list(jax.devices() if devices is None else devices)
    d, f, t = resolve_axes(**{k: sizes.get(k, 1) for k in AXES}, num_devices=len(devices))
    n = d * f * t
    if n < len(devices):
        if jax.process_count() > 1:
            raise ValueError(f"mesh: data*fsdp*tensor = {n} but the job has {len(devices)} "
                             "devices; a multi-process run must use them all (use -1)")
        devices = devices[:n]
    return jax.make_mesh((d, f, t), AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def sampler_mesh(data: int = 1, tensor: int = 1, *, devices: Sequence | None = None) -> Mesh:
    """The mesh a host's JAX sampler splits its calls over (``sampler.data_parallel`` x
    ``sampler.tensor_parallel``): ``(data, fsdp=1, tensor)`` over this process's own devices
    (``jax.local_devices()``; or ``devices``), so the run's partition rules apply unchanged
    and the ``embed`` dimension (``fsdp`` in the rules) stays whole: sampling gathers no
    weights per token. ``-1`` takes the remaining devices; sizes smaller than the device count
    use the first devices.

    Raises:
      ValueError: sizes that do not fit the devices (naming ``sampler.data_parallel`` /
        ``sampler.tensor_parallel``).
    """
    devices = list(jax.local_devices() if devices is None else devices)
    try:
        d, _, t = resolve_axes(data=data, tensor=tensor, num_devices=len(devices))
    except ValueError as e:
        raise ValueError(f"sampler.data_parallel x tensor_parallel = {data} x {tensor} on "
                         f"this host's {len(devices)} devices: {e}") from None
    return jax.make_mesh((d, 1, t), AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices[:d * t])


def batch_spec() -> P:
    """Leading (row / trajectory) axis over ``data x fsdp``; the rest replicated."""
    return P(BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, batch_spec())


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_shards(mesh: Mesh) -> int:
    """How many blocks the batch is split into (``data * fsdp``): the packer's ``num_shards``
    (times the micro-batches) so whole task groups stay on one shard."""
    return mesh.shape["data"] * mesh.shape["fsdp"]
