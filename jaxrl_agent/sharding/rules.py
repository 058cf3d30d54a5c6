"""Partition rules: logical axis names on the parameters -> mesh axes.

Every ``nnx.Param`` of ``models.Transformer`` carries ``logical_axes`` metadata, one name per
dimension::

    embed_tokens.embedding          (vocab, embed)
    q_proj.kernel                   (embed, heads)        k/v_proj: (embed, kv_heads)
    o_proj.kernel                   (heads, embed)
    gate/up_proj.kernel             (embed, mlp)          down_proj: (mlp, embed)
    lm_head.kernel                  (embed, vocab)
    *_layernorm / norm.weight       (norm,)               q/k_norm: (head_dim,)
    value_head.kernel               (embed, None)

One more name is an activation's, not a parameter's: ``activation_embed``, the embedding
dimension of the residual stream ``[rows, T, D]`` the train step carries from layer to layer
(and keeps for the backward pass). ``residual_spec`` reads it.

A rule table (the config's ``mesh.rules``) maps each logical name to a mesh axis, a tuple of
mesh axes, or None (replicated). ``DEFAULT_RULES`` gives FSDP along ``embed`` and Megatron
tensor parallelism along heads / MLP / vocabulary, so per-device parameter bytes scale as
``1 / (fsdp * tensor)`` for the matrices. A dimension that the assigned mesh axes do not divide
evenly stays replicated (``spec_for`` reports it), and a mesh axis is used at most once per
parameter. The optimizer state is sharded exactly like the parameters it tracks.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_agent.sharding.mesh import AXES, BATCH_AXES

DEFAULT_RULES: dict = {
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    "head_dim": None,
    # the residual stream between decoder layers: its embedding dimension split over tensor
    # (each layer gathers it at its first matmul and reduce-scatters its output), so the
    # inputs remat keeps for the backward pass take 1 / tensor of their bytes
    "activation_embed": "tensor",
}


def check_rules(rules: Mapping) -> dict:
    """``rules`` with every value a tuple of mesh axes (possibly empty); ``ValueError`` names
    the offending entry."""
    out = {}
    for name, target in dict(rules).items():
        axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        bad = [a for a in axes if a not in AXES]
        if bad or len(set(axes)) != len(axes):
            raise ValueError(f"mesh.rules.{name}: {target!r} must be null, one of {AXES} or a "
                             "list of distinct ones")
        out[str(name)] = axes
    return out


def logical_axes(variable: Any) -> tuple | None:
    """The ``logical_axes`` metadata of an ``nnx.Variable`` (None when it has none)."""
    if isinstance(variable, nnx.Variable):
        return variable.get_metadata().get("logical_axes")
    return None


def spec_for(axes: tuple | None, shape: tuple, mesh: Mesh, rules: Mapping) -> tuple[P, list]:
    """``(PartitionSpec, notes)`` for one array of ``shape`` whose dims are named ``axes``.

    A logical name missing from ``rules`` is replicated; a mesh axis already used by an
    earlier dimension is skipped; a dimension that the product of its mesh axis sizes does
    not divide stays replicated. ``notes`` lists what was dropped and why.
    """
    rules = check_rules(rules)
    if axes is None:
        return P(), []
    if len(axes) != len(shape):
        raise ValueError(f"logical_axes {axes} do not match the array's shape {shape}")
    used, parts, notes = set(), [], []
    for name, size in zip(axes, shape):
        want = tuple(a for a in rules.get(name, ()) if mesh.shape.get(a, 1) > 1)
        if any(a in used for a in want):
            notes.append(f"{name}: mesh axis already used by another dimension")
            want = tuple(a for a in want if a not in used)
        n = int(np.prod([mesh.shape[a] for a in want])) if want else 1
        if want and size % n:
            notes.append(f"{name}: size {size} not divisible by {'x'.join(want)}={n}")
            want = ()
        used.update(want)
        parts.append(None if not want else want[0] if len(want) == 1 else want)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts), notes


def residual_spec(mesh: Mesh, rules: Mapping, hidden_size: int) -> P:
    """Layout of the residual stream ``[rows, T, D]`` between the decoder layers of the train
    step: rows over the batch axes (``data x fsdp``), the embedding dimension over
    ``rules["activation_embed"]`` (default ``tensor``). Mesh axes of size 1, axes the batch
    already uses, and a split that does not divide ``hidden_size`` are dropped (then ``D`` is
    whole: the plain Megatron layout, every tensor shard holding the full residual).

    With ``D`` split over ``tensor`` the layer's first matmuls all-gather it and its output
    projections reduce-scatter into it (the all-reduce of the plain layout in two halves, the
    same bytes sent), and the layer inputs remat keeps take ``1 / tensor`` of the memory."""
    want = tuple(a for a in check_rules(rules).get("activation_embed", ())
                 if mesh.shape.get(a, 1) > 1 and a not in BATCH_AXES)
    n = int(np.prod([mesh.shape[a] for a in want])) if want else 1
    if not want or hidden_size % n:
        return P(BATCH_AXES)
    return P(BATCH_AXES, None, want[0] if len(want) == 1 else want)


def layer_use_shardings(layers: Any, mesh: Mesh, rules: Mapping) -> Any:
    """How one decoder layer's weights are laid out when the layer runs: the rules' layout of
    the stacked layers (``layers``: their ``nnx.State``, leading axis ``layers``) with the
    batch axes (``data``, ``fsdp``: the FSDP split, gathered for use) dropped and the leading
    axis removed; tensor parallelism stays. Constraining each layer's weights to it inside
    the layer scan makes XLA gather every weight once per layer per pass (forward; again in
    the backward pass when remat recomputes the layer) and hand that one copy to all its
    uses."""
    use = {k: tuple(a for a in v if a not in BATCH_AXES) for k, v in check_rules(rules).items()}

    def one(v):
        spec = spec_for(logical_axes(v), _shape(v), mesh, use)[0]
        return v.replace(NamedSharding(mesh, P(*tuple(spec)[1:])))

    return jax.tree.map(one, layers, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _shape(v: Any) -> tuple:
    """Shape of an array, a ``ShapeDtypeStruct`` or an ``nnx.Variable`` holding either."""
    x = v.get_value() if isinstance(v, nnx.Variable) else v
    return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))


def param_specs(params: Any, mesh: Mesh, rules: Mapping | None = None) -> Any:
    """The ``PartitionSpec`` of every leaf of ``params`` (an ``nnx.State``; its Variables
    carry ``logical_axes``), same tree structure as the raw arrays of ``params``."""
    rules = DEFAULT_RULES if rules is None else rules

    def one(v):
        if isinstance(v, nnx.Variable):  # keep the Variable node: same structure as params
            return v.replace(spec_for(logical_axes(v), _shape(v), mesh, rules)[0])
        return spec_for(None, _shape(v), mesh, rules)[0]

    return jax.tree.map(one, params, is_leaf=lambda v: isinstance(v, nnx.Variable))


def param_shardings(params: Any, mesh: Mesh, rules: Mapping | None = None) -> Any:
    """``NamedSharding`` per leaf of ``params`` (same tree structure)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, mesh, rules),
                        is_leaf=lambda s: isinstance(s, P))


def train_state_shardings(state: Any, optimizer: optax.GradientTransformation, mesh: Mesh,
                          rules: Mapping | None = None, trainable=nnx.Param) -> Any:
    """Shardings for a ``train.step.TrainState``: parameters (and the frozen reference copy)
    by the rules, the optimizer state like the parameters it tracks (``optax.tree_map_params``;
    the ``trainable`` ones: all, or LoRA's adapters and value head), the teacher's parameters
    (an EMA like the trained ones, another model's by the rules), everything else (step,
    rng, estimator state, counters) replicated."""
    repl = NamedSharding(mesh, P())
    ps = param_shardings(state.params, mesh, rules)
    trained, _ = nnx.split_state(ps, trainable, ...)
    opt = optax.tree_map_params(optimizer, lambda _, s: s, state.opt_state, trained,
                                transform_non_params=lambda _: repl)
    everything = jax.tree.map(lambda _: repl, state)
    has_ref = not (isinstance(state.ref_params, tuple) and not state.ref_params)
    teacher = state.teacher_params
    if not (isinstance(teacher, tuple) and not teacher):  # an EMA of the trained parameters
        same = jax.tree.structure(teacher) == jax.tree.structure(trained)
        teacher = trained if same else param_shardings(teacher, mesh, rules)  # another model
    return everything.replace(params=ps, opt_state=opt, ref_params=trained if has_ref else (),
                              teacher_params=teacher)


def layout_table(params: Any, mesh: Mesh, rules: Mapping | None = None) -> list[dict]:
    """One row per parameter: path, shape, logical axes, PartitionSpec, per-device shape and
    notes (why a dimension stayed replicated)."""
    rules = DEFAULT_RULES if rules is None else rules
    rows = []
    flat = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    for path, v in flat:
        shape = _shape(v)
        spec, notes = spec_for(logical_axes(v), shape, mesh, rules)
        local = NamedSharding(mesh, spec).shard_shape(shape)
        rows.append({"path": jax.tree_util.keystr(path, simple=True, separator="."),
                     "shape": shape, "axes": logical_axes(v), "spec": spec,
                     "local_shape": local, "notes": notes})
    return rows


def local_bytes(tree: Any, shardings: Any) -> int:
    """Bytes one device holds of ``tree`` (arrays or ``ShapeDtypeStruct``s) laid out by
    ``shardings`` (a tree of ``Sharding``s with the same leaves): each leaf's shard shape
    times its item size, summed. What the layout puts on a device, before anything is
    placed (``bytes_per_device`` reads placed arrays)."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
    return total


def bytes_per_device(tree: Any) -> int:
    """Bytes of ``tree``'s arrays held by the most loaded device (from the arrays' actual
    shardings: what really sits on each device, not what the rules intended)."""
    per = {}
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        for shard in x.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values(), default=0)
