"""Memory of a planned step: the analytic floor (``memory_floor``: what the step must hold at
least per device), the compiled program's memory analysis and collectives
(``compile_memory`` -> ``CompiledMemory``), and the bytes of sharded trees per device."""

from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp

from jaxrl_agent import sharding
from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import param_dtype
from jaxrl_agent.train.plan.hlo import count_collectives, executed_collectives


def split_of(spec, dim: int, mesh) -> int:
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


def gathered_bytes(tree, shardings, mesh) -> int:
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


def num_params(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


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
