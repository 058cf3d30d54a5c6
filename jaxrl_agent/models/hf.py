"""HF checkpoint import/export: ``config.json`` + ``model.safetensors`` (or sharded with
``model.safetensors.index.json``), HF tensor names, no torch needed.

One table, ``hf_param_map(config)``, maps every HF tensor name to its NNX path and says
whether the array is transposed (HF ``nn.Linear`` weights are ``[out, in]``, our kernels
``[in, out]``). Loading, saving and ``to_hf_tensors`` (the weight sync to a vLLM sampler)
all use it.

The value head is not part of an HF checkpoint: ``save_hf`` writes it to
``value_head.safetensors`` (tensors ``value_head.kernel`` [D, 1], ``value_head.bias`` [1];
metadata ``value_stop_gradient``) next to the HF files, and ``load_hf`` loads it when present.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import (Linear, Transformer, lora_init, lora_paths,
                                            merge_lora, param_dtype)

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
VALUE_HEAD_NAME = "value_head.safetensors"

# Tensors some HF checkpoints carry that are not parameters (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ParamSpec(NamedTuple):
    """One row of ``hf_param_map``.

    Attributes:
      hf_name: HF tensor name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
      path: NNX path in ``Transformer``, e.g. ``("layers", "self_attn", "q_proj", "kernel")``.
      transpose: the HF array is the transpose of the NNX array (2-D linear weights).
      shape: the NNX array shape of this tensor (for a decoder layer's tensor: one layer's
        slice; the HF shape is reversed when ``transpose``).
      layer: for a decoder layer's tensor, its index along the stacked ``[num_layers]`` axis
        of the NNX array at ``path``; None for the others.
    """

    hf_name: str
    path: tuple
    transpose: bool
    shape: tuple
    layer: int | None = None

    @property
    def hf_shape(self) -> tuple:
        return tuple(reversed(self.shape)) if self.transpose else tuple(self.shape)


def hf_param_map(config: ModelConfig) -> list[ParamSpec]:
    """HF tensor name <-> NNX path (+ transpose flag and shape) for every backbone parameter of
    ``config``, in HF order. The value head is not included (not part of HF checkpoints); nor is
    ``lm_head.weight`` when embeddings are tied (HF drops it on save)."""
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    hd, H, KV = config.head_dim, config.num_heads, config.num_kv_heads
    out = [ParamSpec("model.embed_tokens.weight", ("embed_tokens", "embedding"), False, (V, D))]

    def linear(hf_prefix, path, din, dout, bias, layer=None):
        rows = [ParamSpec(f"{hf_prefix}.weight", path + ("kernel",), True, (din, dout), layer)]
        if bias:
            rows.append(ParamSpec(f"{hf_prefix}.bias", path + ("bias",), False, (dout,), layer))
        return rows

    for i in range(config.num_layers):
        p, q = f"model.layers.{i}", ("layers",)
        out.append(ParamSpec(f"{p}.input_layernorm.weight", q + ("input_layernorm", "weight"),
                             False, (D,), i))
        a, qa = f"{p}.self_attn", q + ("self_attn",)
        out += linear(f"{a}.q_proj", qa + ("q_proj",), D, H * hd, config.qkv_bias, i)
        out += linear(f"{a}.k_proj", qa + ("k_proj",), D, KV * hd, config.qkv_bias, i)
        out += linear(f"{a}.v_proj", qa + ("v_proj",), D, KV * hd, config.qkv_bias, i)
        out += linear(f"{a}.o_proj", qa + ("o_proj",), H * hd, D, config.o_bias, i)
        if config.qk_norm:
            out.append(ParamSpec(f"{a}.q_norm.weight", qa + ("q_norm", "weight"), False, (hd,),
                                 i))
            out.append(ParamSpec(f"{a}.k_norm.weight", qa + ("k_norm", "weight"), False, (hd,),
                                 i))
        out.append(ParamSpec(f"{p}.post_attention_layernorm.weight",
                             q + ("post_attention_layernorm", "weight"), False, (D,), i))
        m, qm = f"{p}.mlp", q + ("mlp",)
        out += linear(f"{m}.gate_proj", qm + ("gate_proj",), D, F, config.mlp_bias, i)
        out += linear(f"{m}.up_proj", qm + ("up_proj",), D, F, config.mlp_bias, i)
        out += linear(f"{m}.down_proj", qm + ("down_proj",), F, D, config.mlp_bias, i)
    out.append(ParamSpec("model.norm.weight", ("norm", "weight"), False, (D,)))
    if not config.tie_word_embeddings:
        out.append(ParamSpec("lm_head.weight", ("lm_head", "kernel"), True, (D, V)))
    return out


def _variable(model, path):
    obj = model
    for key in path:
        obj = obj[key] if isinstance(key, int) else getattr(obj, key)
    return obj


def spec_array(spec: ParamSpec, array):
    """The tensor of ``spec`` in the NNX layout, read from the array at ``spec.path`` (one
    layer's slice of a stacked decoder-layer array)."""
    return array if spec.layer is None else array[spec.layer]


def hf_tensors(config: ModelConfig, get: Callable[[tuple], Any], *, merge: bool = True) -> dict:
    """``{hf_name: array}`` in ``hf_param_map`` order and HF layout (``[out, in]`` linear
    weights), from ``get(nnx_path) -> array`` (numpy or jax, jittable). A LoRA-adapted
    projection is written merged: ``kernel + (lora_alpha / r) lora_a lora_b``, so the tensors
    are a plain HF model's; ``merge=False`` writes the base kernels (the adapters alone:
    ``peft_tensors``)."""
    adapted = set(lora_paths(config)) if merge else set()
    scale = config.lora_alpha / config.lora_rank if config.lora_rank else 0.0
    out = {}
    for spec in hf_param_map(config):
        arr = spec_array(spec, get(spec.path))
        if spec.path[:-1] in adapted and spec.path[-1] == "kernel":
            arr = merge_lora(arr, spec_array(spec, get(spec.path[:-1] + ("lora_a",))),
                             spec_array(spec, get(spec.path[:-1] + ("lora_b",))), scale)
        out[spec.hf_name] = arr.T if spec.transpose else arr
    return out


# ----------------------------------------------------------------------------- in memory


def to_hf_tensors(model: Transformer, *, as_numpy: bool = True) -> dict:
    """The backbone parameters under HF names and layouts (``[out, in]`` linear weights), in the
    parameter dtype: ``{hf_name: array}`` in ``hf_param_map`` order. ``as_numpy=False`` keeps
    them as (transposed) ``jax.Array`` s, e.g. for a jitted weight sync."""
    out = hf_tensors(model.config, lambda path: _variable(model, path)[...])
    if as_numpy:
        out = {k: np.ascontiguousarray(np.asarray(v)) for k, v in out.items()}
    return out


def _check_names(config: ModelConfig, shapes: Mapping[str, tuple]):
    """Raises ValueError for a missing, unexpected or mis-shaped tensor (naming it)."""
    specs = hf_param_map(config)
    expected = {s.hf_name for s in specs}
    for name in shapes:
        if name in expected or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied checkpoint may still carry the copy
        raise ValueError(f"unexpected tensor {name!r} with shape {tuple(shapes[name])} in the "
                         f"checkpoint: a {config.family} model with this config has no such "
                         "parameter")
    for s in specs:
        if s.hf_name not in shapes:
            raise ValueError(f"checkpoint lacks tensor {s.hf_name!r} (expected shape "
                             f"{s.hf_shape})")
        got = tuple(shapes[s.hf_name])
        if got != s.hf_shape:
            raise ValueError(f"tensor {s.hf_name!r} has shape {got} in the checkpoint but the "
                             f"config expects {s.hf_shape}")


def from_hf_tensors(config: ModelConfig, tensors: Mapping[str, np.ndarray], *,
                    seed: int = 0,
                    place: Callable[[tuple, np.ndarray], jax.Array] | None = None) -> Transformer:
    """Builds a ``Transformer`` from HF-named arrays (no random init of the backbone).

    Args:
      config: the model config (its ``dtype`` is the parameter dtype; arrays are cast).
      tensors: ``{hf_name: array}``; every name of ``hf_param_map(config)`` must be present with
        its HF shape. Extra tensors raise, except ``*rotary_emb.inv_freq`` buffers and a tied
        checkpoint's ``lm_head.weight``. A value head (``config.value_head``) is freshly
        initialised from ``seed``; ``value_head.kernel``/``value_head.bias`` in ``tensors``
        are used instead when present.
      place: optional ``(nnx_path, np_array) -> jax.Array`` to put each parameter (e.g.
        ``jax.device_put`` with a sharding); default ``jnp.asarray``.

    Raises:
      ValueError: naming the missing / unexpected tensor, or the tensor and both shapes.
    """
    tensors = dict(tensors)
    vh = {k: tensors.pop(k) for k in ("value_head.kernel", "value_head.bias") if k in tensors}
    _check_names(config, {k: np.shape(v) for k, v in tensors.items()})
    return _build(config, lambda name: tensors[name], vh, seed=seed, place=place)


def _build(config, get, value_head_tensors, *, seed, place):
    dtype = param_dtype(config)
    place = place or (lambda path, a: jnp.asarray(a))
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    stacks: dict = {}  # decoder-layer path -> [num_layers] slices, placed once stacked
    for spec in hf_param_map(config):
        arr = np.asarray(get(spec.hf_name))
        if spec.transpose:
            arr = arr.T
        arr = arr.astype(dtype)
        if spec.layer is not None:
            stacks.setdefault(spec.path, []).append(arr)
            if len(stacks[spec.path]) < config.num_layers:
                continue
            arr = np.stack(stacks.pop(spec.path))
        _variable(model, spec.path).set_value(place(spec.path, np.ascontiguousarray(arr)))
    if config.value_head:
        head = Linear(config.hidden_size, 1, use_bias=True, dtype=jnp.float32,
                      rngs=nnx.Rngs(seed))
        for name in ("kernel", "bias"):
            arr = value_head_tensors.get(f"value_head.{name}")
            want = (config.hidden_size, 1) if name == "kernel" else (1,)
            if arr is None:
                arr = np.asarray(getattr(head, name)[...])
            elif tuple(np.shape(arr)) != want:
                raise ValueError(f"tensor 'value_head.{name}' has shape {tuple(np.shape(arr))} "
                                 f"but the config expects {want}")
            _variable(model, ("value_head", name)).set_value(
                place(("value_head", name), np.asarray(arr, np.float32)))
    # LoRA adapters are not part of an HF checkpoint: fresh ones (b = 0: the base model's
    # outputs exactly), drawn from ``seed``
    for path, (a, b) in lora_init(config, jax.random.key(seed)).items():
        for name, arr in (("lora_a", a), ("lora_b", b)):
            _variable(model, path + (name,)).set_value(place(path + (name,), np.asarray(arr)))
    return model


# ----------------------------------------------------------------------------- files


def _shard_files(folder: str) -> list[str]:
    index = os.path.join(folder, SAFETENSORS_INDEX_NAME)
    single = os.path.join(folder, SAFETENSORS_NAME)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(folder, n) for n in dict.fromkeys(weight_map.values())]
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{folder}: neither {SAFETENSORS_NAME} nor {SAFETENSORS_INDEX_NAME}")


def load_hf(folder: str, dtype: str | None = None, *, seed: int = 0,
            place: Callable[[tuple, np.ndarray], jax.Array] | None = None,
            **config_overrides) -> tuple[Transformer, ModelConfig]:
    """Loads a local HF Llama/Qwen2/Qwen3 checkpoint folder into a ``Transformer``.

    Reads ``config.json`` (``ModelConfig.from_hf``) and ``model.safetensors`` or the shards
    listed in ``model.safetensors.index.json``, with the ``safetensors`` numpy API (no torch).
    When ``value_head.safetensors`` is present the value head is enabled and loaded (unless
    ``value_head=False`` is passed); ``value_head=True`` without that file initialises a fresh
    head from ``seed``.

    Args:
      folder: the checkpoint folder.
      dtype: ``"float32"`` / ``"bfloat16"`` parameter dtype; None: the checkpoint's dtype when
        it is one of these, else float32.
      place: see ``from_hf_tensors``.
      config_overrides: ``ModelConfig`` fields to override (``value_head``,
        ``value_stop_gradient``, ...).

    Returns:
      ``(model, config)``.

    Raises:
      ValueError: unsupported architecture; a missing, unexpected or mis-shaped tensor (named,
        with both shapes).
    """
    from safetensors import SafetensorError, safe_open

    if not os.path.isdir(folder):
        raise FileNotFoundError(2, "no such model folder", folder)
    cfg_path = os.path.join(folder, CONFIG_NAME)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            hf_config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path}: not a JSON model config ({e})") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{cfg_path}: not a JSON model config (top level is not an object)")
    vh_path = os.path.join(folder, VALUE_HEAD_NAME)
    vh_tensors = {}
    if os.path.exists(vh_path) and config_overrides.get("value_head", True):
        try:
            with safe_open(vh_path, framework="np") as f:
                meta = f.metadata() or {}
                vh_tensors = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"{vh_path}: not a readable safetensors file ({e})") from None
        config_overrides.setdefault("value_head", True)
        if "value_stop_gradient" in meta:
            config_overrides.setdefault("value_stop_gradient",
                                        meta["value_stop_gradient"].lower() == "true")
    config = ModelConfig.from_hf(hf_config, dtype=dtype, **config_overrides)

    handles, where, shapes, files = [], {}, {}, {}

    def tensor(name):
        try:
            return where[name].get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{files[name]}: tensor {name!r} cannot be read ({e}); the file "
                             f"is truncated or damaged") from None

    try:
        for path in _shard_files(folder):
            try:
                h = safe_open(path, framework="np")
            except SafetensorError as e:
                raise ValueError(f"{path}: not a readable safetensors file ({e}); the file is "
                                 f"truncated or not a safetensors file") from None
            h = h.__enter__()
            handles.append(h)
            for name in h.keys():
                where[name], files[name] = h, path
                shapes[name] = tuple(h.get_slice(name).get_shape())
        _check_names(config, shapes)
        model = _build(config, tensor, vh_tensors, seed=seed, place=place)
    finally:
        for h in handles:
            h.__exit__(None, None, None)
    return model, config


def _shards(names_sizes: Iterable[tuple[str, int]], max_shard_bytes: int | None):
    shards, cur, cur_size = [], [], 0
    for name, size in names_sizes:
        if max_shard_bytes is not None and cur and cur_size + size > max_shard_bytes:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(name)
        cur_size += size
    if cur:
        shards.append(cur)
    return shards


def save_hf(model: Transformer, config: ModelConfig | None, folder: str, *,
            max_shard_bytes: int | None = None) -> None:
    """Writes ``model`` as an HF checkpoint that ``transformers`` (and ``load_hf``) can load.

    ``config`` None means ``model.config`` (a given config must describe the same shapes).

    Files: ``config.json`` (``ModelConfig.to_hf``), then either ``model.safetensors`` or, when
    ``max_shard_bytes`` is set and the tensors exceed it, ``model-0000i-of-0000n.safetensors``
    shards (each at most ``max_shard_bytes`` unless one tensor is larger) plus
    ``model.safetensors.index.json``. Tensors keep the parameter dtype and HF names/layouts.
    With a value head, also ``value_head.safetensors``. Earlier ``model*.safetensors``, the
    index and ``value_head.safetensors`` in ``folder`` are removed first so no stale file
    shadows the new ones.
    """
    from safetensors.numpy import save_file

    config = model.config if config is None else config
    if hf_param_map(config) != hf_param_map(model.config):
        raise ValueError("save_hf: config does not describe the model's parameters "
                         f"(config {config} vs model.config {model.config})")
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if ((name.startswith("model") and name.endswith(".safetensors"))
                or name in (SAFETENSORS_INDEX_NAME, VALUE_HEAD_NAME)):
            os.remove(os.path.join(folder, name))
    with open(os.path.join(folder, CONFIG_NAME), "w") as f:
        json.dump(config.to_hf(), f, indent=2)

    tensors = to_hf_tensors(model)
    meta = {"format": "pt"}
    shards = _shards(((k, v.nbytes) for k, v in tensors.items()), max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, os.path.join(folder, SAFETENSORS_NAME), metadata=meta)
    else:
        n = len(shards)
        weight_map = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file({k: tensors[k] for k in names}, os.path.join(folder, fname), metadata=meta)
            weight_map.update({k: fname for k in names})
        index = {"metadata": {"total_size": int(sum(v.nbytes for v in tensors.values()))},
                 "weight_map": weight_map}
        with open(os.path.join(folder, SAFETENSORS_INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
    if model.value_head is not None:
        vh = {"value_head.kernel": np.asarray(model.value_head.kernel[...], np.float32),
              "value_head.bias": np.asarray(model.value_head.bias[...], np.float32)}
        save_file(vh, os.path.join(folder, VALUE_HEAD_NAME),
                  metadata={"format": "jaxrl_agent",
                            "value_stop_gradient": str(bool(config.value_stop_gradient))})


# ----------------------------------------------------------------------------- LoRA adapters

PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"


def _peft_name(path: tuple, layer: int, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{path[1]}.{path[2]}.{which}.weight"


def peft_tensors(config: ModelConfig, get: Callable[[tuple], Any]) -> dict:
    """The LoRA adapters under PEFT's names and layouts (``lora_A.weight [r, in]``,
    ``lora_B.weight [out, r]`` per layer and adapted projection), from ``get(nnx_path) ->
    array`` (jittable): what ``save_peft_adapter`` writes."""
    out = {}
    for path in sorted(lora_paths(config)):
        a, b = get(path + ("lora_a",)), get(path + ("lora_b",))
        for i in range(config.num_layers):
            out[_peft_name(path, i, "lora_A")] = a[i].T
            out[_peft_name(path, i, "lora_B")] = b[i].T
    return out


def peft_config(config: ModelConfig, base_model_name_or_path: str | None = None) -> dict:
    """The ``adapter_config.json`` dict of ``config``'s adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.lora_rank,
            "lora_alpha": config.lora_alpha, "target_modules": list(config.lora_targets),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": base_model_name_or_path}


def save_peft_adapter(model: Transformer, folder: str, *,
                      base_model_name_or_path: str | None = None) -> None:
    """Writes ``model``'s LoRA adapters as a PEFT adapter folder that
    ``peft.PeftModel.from_pretrained(base, folder)`` loads on the HF base model:
    ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules``)
    and ``adapter_model.safetensors`` with ``...layers.{i}.self_attn.q_proj.lora_A.weight``
    ``[r, in]`` and ``lora_B.weight`` ``[out, r]`` per adapted projection (float32). The value
    head is not part of it (``save_hf`` of the merged model writes it).

    Raises ``ValueError`` when the model has no adapters."""

    config = model.config
    if not config.lora_rank:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters (lora_rank 0)")
    tensors = peft_tensors(config, lambda path: np.asarray(_variable(model, path)[...],
                                                           np.float32))
    write_peft_folder(folder, config, tensors, base_model_name_or_path)


def write_peft_folder(folder: str, config: ModelConfig, tensors: Mapping[str, Any],
                      base_model_name_or_path: str | None = None) -> int:
    """Writes ``peft_tensors`` (numpy or jax arrays) and ``peft_config`` to ``folder``;
    returns the bytes of the tensors."""
    from safetensors.numpy import save_file

    host = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()}
    os.makedirs(folder, exist_ok=True)
    save_file(host, os.path.join(folder, PEFT_WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(folder, PEFT_CONFIG_NAME), "w") as f:
        json.dump(peft_config(config, base_model_name_or_path), f, indent=2)
    return int(sum(v.nbytes for v in host.values()))


def load_peft_adapter(model: Transformer, folder: str) -> None:
    """Sets ``model``'s LoRA adapters from a PEFT adapter folder (``save_peft_adapter``'s
    layout); the model must have been built with the same ``r``, ``lora_alpha`` and
    ``target_modules``. Raises ``ValueError`` naming what differs or is missing."""
    from safetensors.numpy import load_file

    with open(os.path.join(folder, PEFT_CONFIG_NAME)) as f:
        peft = json.load(f)
    c = model.config
    want = {"r": c.lora_rank, "lora_alpha": c.lora_alpha,
            "target_modules": sorted(c.lora_targets)}
    got = {"r": peft.get("r"), "lora_alpha": float(peft.get("lora_alpha", 0)),
           "target_modules": sorted(peft.get("target_modules") or [])}
    if got != want:
        raise ValueError(f"{folder}/{PEFT_CONFIG_NAME}: the adapter has {got}, the model "
                         f"{want}")
    tensors = load_file(os.path.join(folder, PEFT_WEIGHTS_NAME))
    for path in sorted(lora_paths(c)):
        lin = _variable(model, path)
        for which, var in (("lora_A", lin.lora_a), ("lora_B", lin.lora_b)):
            rows = []
            for i in range(c.num_layers):
                name = _peft_name(path, i, which)
                if name not in tensors:
                    raise ValueError(f"{folder}/{PEFT_WEIGHTS_NAME}: missing tensor {name!r}")
                rows.append(tensors[name].T)
            arr = np.stack(rows).astype(np.float32)
            if arr.shape != tuple(var.shape):
                raise ValueError(f"{folder}/{PEFT_WEIGHTS_NAME}: {which} of {'.'.join(path)} "
                                 f"has shape {arr.shape[1:]}, the model {tuple(var.shape)[1:]}")
            var.set_value(jnp.asarray(arr))


def load_model_folder(folder: str, dtype: str | None = None) -> tuple[Transformer, ModelConfig,
                                                                       str]:
    """``(model, config, tokenizer folder)`` of an HF checkpoint folder (``load_hf``) or of a
    PEFT LoRA adapter folder (``adapter_config.json``): the base named by its
    ``base_model_name_or_path`` (a local folder) with the adapters on it. Raises ``ValueError``
    (or ``OSError``) naming the folder and what is wrong."""
    cfg_path = os.path.join(folder, PEFT_CONFIG_NAME)
    if not os.path.exists(cfg_path):
        model, config = load_hf(folder, dtype=dtype)
        return model, config, folder
    with open(cfg_path) as f:
        peft = json.load(f)
    base = peft.get("base_model_name_or_path")
    if peft.get("peft_type") != "LORA" or not base or not os.path.isdir(base):
        raise ValueError(f"{cfg_path}: a LoRA adapter whose base_model_name_or_path is a local "
                         f"HF folder is needed (peft_type {peft.get('peft_type')!r}, base "
                         f"{base!r})")
    model, config = load_hf(base, dtype=dtype, lora_rank=int(peft["r"]),
                            lora_alpha=float(peft["lora_alpha"]),
                            lora_targets=tuple(peft["target_modules"]))
    load_peft_adapter(model, folder)
    return model, config, base
