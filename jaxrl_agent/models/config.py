"""``ModelConfig``: the hyper-parameters of the decoder, and their mapping to HF ``config.json``.

Supported families (HF architectures):

=========  =====================  ==========================================================
family     HF architecture        what differs
=========  =====================  ==========================================================
llama      ``LlamaForCausalLM``   ``attention_bias`` -> q/k/v/o biases, ``mlp_bias``, ``head_dim``
qwen2      ``Qwen2ForCausalLM``   q/k/v biases (always), no o bias
qwen3      ``Qwen3ForCausalLM``   per-head RMSNorm on q and k before RoPE; ``attention_bias``
=========  =====================  ==========================================================

RoPE variants (``rope_scaling``, the HF dict, ``rope_type`` key): ``None`` (plain RoPE),
``"linear"``, ``"dynamic"`` (NTK, see ``transformer.rope_frequencies`` for the one caveat),
``"llama3"`` (Llama 3.1) and ``"yarn"``. Anything else raises ``ValueError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
FAMILIES = tuple(ARCHITECTURES.values())
DTYPES = ("float32", "bfloat16")
#: the projections LoRA can adapt (PEFT's ``target_modules`` names)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")

# Keys each rope type needs (besides rope_type) and the ones it may carry.
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
_ROPE_OPTIONAL = {
    "linear": (),
    "dynamic": (),
    "llama3": (),
    "yarn": ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "truncate"),
}


class FrozenDict(Mapping):
    """A small hashable, read-only dict (the config is a static attribute of the NNX module,
    so it must be hashable for ``nnx.jit`` caching)."""

    __slots__ = ("_items",)

    def __init__(self, data=()):
        items = dict(data)
        for k, v in items.items():
            if isinstance(v, list):
                items[k] = tuple(v)
        object.__setattr__(self, "_items", items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def __hash__(self):
        return hash(tuple(sorted(self._items.items())))

    def __eq__(self, other):
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self):
        return f"FrozenDict({self._items!r})"


def _normalize_rope_scaling(rope_scaling, max_position_embeddings) -> FrozenDict | None:
    """Validates an HF rope scaling dict and returns it with ``rope_type`` set (or None)."""
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise ValueError(f"rope_scaling must be None or a dict, got {rope_scaling!r}")
    d = {k: v for k, v in dict(rope_scaling).items() if k not in ("rope_theta", "type")}
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}; supported: "
                         f"{list(ROPE_TYPES)} (or None / 'default' for plain RoPE)")
    prf = d.pop("partial_rotary_factor", None)
    if prf not in (None, 1, 1.0):
        raise ValueError(f"rope_scaling: partial_rotary_factor={prf} is not supported (only 1.0)")
    d["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        d.setdefault("original_max_position_embeddings", max_position_embeddings)
    for key in _ROPE_REQUIRED[rope_type]:
        if d.get(key) is None:
            raise ValueError(f"rope_scaling: rope_type {rope_type!r} needs the key {key!r}")
    allowed = set(_ROPE_REQUIRED[rope_type]) | set(_ROPE_OPTIONAL[rope_type]) | {"rope_type"}
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(f"rope_scaling: unknown keys {unknown} for rope_type {rope_type!r}; "
                         f"allowed: {sorted(allowed)}")
    return FrozenDict(d)


def projection_shapes(hidden_size: int, head_dim: int, intermediate_size: int,
                      num_heads: int, num_kv_heads: int) -> dict:
    """``(in, out)`` of each projection of a decoder layer (the ``LORA_TARGETS``)."""
    h, d, i = hidden_size, head_dim, intermediate_size
    return {"q_proj": (h, num_heads * d), "k_proj": (h, num_kv_heads * d),
            "v_proj": (h, num_kv_heads * d), "o_proj": (num_heads * d, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the decoder-only transformer (Llama / Qwen2 / Qwen3 layout).

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads: sizes
        (``num_heads`` must be a multiple of ``num_kv_heads``: grouped-query attention).
      head_dim: size of one attention head; default ``hidden_size // num_heads``.
      rope_theta: RoPE base.
      rope_scaling: None, or the HF rope dict (``{"rope_type": "linear"|"dynamic"|"llama3"|
        "yarn", "factor": ..., ...}``); stored as a hashable ``FrozenDict``.
      rms_norm_eps: epsilon of every RMSNorm.
      qkv_bias: q/k/v projections have a bias (Qwen2: True; Llama/Qwen3: ``attention_bias``).
      o_bias: the output projection has a bias (Llama/Qwen3 ``attention_bias``; Qwen2: False).
      mlp_bias: gate/up/down projections have a bias (Llama ``mlp_bias``).
      qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3).
      tie_word_embeddings: the LM head is the transposed embedding matrix.
      max_position_embeddings: as in HF (used by dynamic/yarn/llama3 rope and by ``to_hf``).
      dtype: parameter (and activation) dtype, ``"float32"`` or ``"bfloat16"``. Softmax,
        RMSNorm statistics, RoPE angles, logits and log-softmax are always float32.
      family: ``"llama"``, ``"qwen2"`` or ``"qwen3"``.
      value_head: add a ``Linear(hidden -> 1)`` value head on the final hidden states (SAPO).
      value_stop_gradient: the value head reads ``stop_gradient(hidden)`` so a value loss does
        not train the backbone.
      bos_token_id, eos_token_id, pad_token_id: carried through to ``config.json``.
      lora_rank: 0 (no adapters: every weight is trained), or the rank ``r`` of the LoRA
        adapters on the ``lora_targets`` projections: ``y = x W + (alpha / r) (x A) B`` with
        ``A [in, r]`` and ``B [r, out]`` (float32), ``B`` zero at the start so the adapted
        model equals the base model exactly.
      lora_alpha: the adapters' scale numerator (PEFT's ``lora_alpha``).
      lora_targets: the adapted projections, a subset of ``LORA_TARGETS``.
      lora_train_norms: with LoRA, the RMSNorm weights are trained too (else frozen).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    family: str = "llama"
    value_head: bool = False
    value_stop_gradient: bool = False
    bos_token_id: int | None = None
    eos_token_id: Any = None
    pad_token_id: int | None = None
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple = LORA_TARGETS
    lora_train_norms: bool = False

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"ModelConfig: hidden_size {self.hidden_size} is not divisible by "
                                 f"num_heads {self.num_heads}; set head_dim explicitly")
            set_("head_dim", self.hidden_size // self.num_heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) \
                or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError("ModelConfig.head_dim must be a positive even int, got "
                             f"{self.head_dim!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig: num_heads {self.num_heads} must be a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family must be one of {FAMILIES}, got {self.family!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        set_("rope_theta", float(self.rope_theta))
        set_("rope_scaling", _normalize_rope_scaling(self.rope_scaling,
                                                     self.max_position_embeddings))
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        r = self.lora_rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"ModelConfig.lora_rank must be an int >= 0, got {r!r}")
        set_("lora_targets", tuple(self.lora_targets))
        bad = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if bad or (r and not self.lora_targets):
            raise ValueError(f"ModelConfig.lora_targets must be a non-empty subset of "
                             f"{list(LORA_TARGETS)}, got {list(self.lora_targets)}")
        if not self.lora_alpha > 0:
            raise ValueError(f"ModelConfig.lora_alpha must be > 0, got {self.lora_alpha!r}")
        set_("lora_alpha", float(self.lora_alpha))
        if r:
            shapes = self.projection_shapes
            name, (n_in, n_out) = min(((t, shapes[t]) for t in self.lora_targets),
                                      key=lambda x: min(x[1]))
            if r >= min(n_in, n_out):
                raise ValueError(
                    f"ModelConfig.lora_rank {r} is not below the smaller side of {name} "
                    f"({n_in} x {n_out}); the largest valid rank is {min(n_in, n_out) - 1}")

    @property
    def projection_shapes(self) -> dict:
        """``(in, out)`` of each projection a LoRA adapter can target (``LORA_TARGETS``)."""
        return projection_shapes(self.hidden_size, self.head_dim, self.intermediate_size,
                                 self.num_heads, self.num_kv_heads)

    @property
    def num_kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------- HF mapping

    @classmethod
    def from_hf(cls, config: Mapping, *, dtype: str | None = None, **overrides) -> "ModelConfig":
        """Builds a config from an HF ``config.json`` dict.

        Reads both the transformers-5 format (``rope_parameters``) and the older one
        (``rope_theta`` + ``rope_scaling``). ``dtype`` None takes the checkpoint's ``dtype`` /
        ``torch_dtype`` when it is float32 or bfloat16 and float32 otherwise (float16 is
        widened). ``overrides`` (e.g. ``value_head=True``) replace fields at the end.

        Raises:
          ValueError: an architecture other than Llama/Qwen2/Qwen3ForCausalLM (naming it and the
            supported ones), a non-SiLU activation, sliding-window attention, an unsupported
            rope type.
        """
        c = dict(config)
        archs = c.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        family = None
        for a in archs:
            if a in ARCHITECTURES:
                family = ARCHITECTURES[a]
                break
        if family is None:
            if archs:
                raise ValueError(f"unsupported architecture {archs[0]!r} (architectures={archs}); "
                                 f"supported: {sorted(ARCHITECTURES)}")
            mt = c.get("model_type")
            if mt not in FAMILIES:
                raise ValueError(f"config has no 'architectures' and model_type {mt!r} is not "
                                 f"supported; supported architectures: {sorted(ARCHITECTURES)}")
            family = mt
        act = c.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        if c.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported (full attention only)")

        def need(key):
            if c.get(key) is None:
                raise ValueError(f"config.json lacks the required key {key!r}")
            return c[key]

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = c.get("num_key_value_heads") or heads
        max_pos = c.get("max_position_embeddings", 2048)
        head_dim = c.get("head_dim")
        if family == "qwen3" and head_dim is None:
            head_dim = 128  # Qwen3Config's default
        if head_dim is None:
            head_dim = hidden // heads

        rp = c.get("rope_parameters")
        if isinstance(rp, Mapping) and rp:
            theta = rp.get("rope_theta", c.get("rope_theta", 10000.0))
            scaling = dict(rp)
        else:
            theta = c.get("rope_theta", 10000.0)
            scaling = c.get("rope_scaling")
            scaling = dict(scaling) if scaling else None
        if c.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor={c['partial_rotary_factor']} is not supported")

        if family == "qwen2":
            qkv_bias, o_bias, mlp_bias, qk_norm = True, False, False, False
        else:
            ab = bool(c.get("attention_bias", False))
            qkv_bias, o_bias = ab, ab
            mlp_bias = bool(c.get("mlp_bias", False)) if family == "llama" else False
            qk_norm = family == "qwen3"

        if dtype is None:
            src = c.get("dtype") or c.get("torch_dtype") or "float32"
            dtype = src if src in DTYPES else "float32"
        fields = dict(
            vocab_size=need("vocab_size"), hidden_size=hidden,
            intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
            rope_scaling=scaling, rms_norm_eps=c.get("rms_norm_eps", 1e-6), qkv_bias=qkv_bias,
            o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=qk_norm,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos, dtype=dtype, family=family,
            bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"),
            pad_token_id=c.get("pad_token_id"))
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict:
        """The HF ``config.json`` dict for this config (value-head fields are not part of it).

        Writes the rope settings in both formats (``rope_parameters`` for transformers >= 5,
        ``rope_theta``/``rope_scaling`` for older readers).

        Raises:
          ValueError: options the family's HF class cannot express (e.g. Qwen2 without q/k/v
            bias, Llama with q/k/v bias but no o bias, qk_norm outside Qwen3).
        """
        fam = self.family
        if fam == "qwen2" and not (self.qkv_bias and not self.o_bias and not self.mlp_bias):
            raise ValueError("to_hf: Qwen2 always has q/k/v biases and no o/mlp bias; got "
                             f"qkv_bias={self.qkv_bias}, o_bias={self.o_bias}, "
                             f"mlp_bias={self.mlp_bias}")
        if fam in ("llama", "qwen3") and self.qkv_bias != self.o_bias:
            raise ValueError(f"to_hf: {fam} has one attention_bias for q/k/v/o; got "
                             f"qkv_bias={self.qkv_bias}, o_bias={self.o_bias}")
        if fam == "qwen3" and self.mlp_bias:
            raise ValueError("to_hf: Qwen3 has no mlp_bias")
        if self.qk_norm != (fam == "qwen3"):
            raise ValueError(f"to_hf: qk_norm={self.qk_norm} is not expressible for family {fam!r} "
                             "(only Qwen3 has q/k norms)")
        arch = {v: k for k, v in ARCHITECTURES.items()}[fam]
        scaling = dict(self.rope_scaling) if self.rope_scaling is not None else None
        rope_parameters = dict(scaling or {"rope_type": "default"}, rope_theta=self.rope_theta)
        out = {
            "architectures": [arch],
            "model_type": fam,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": 0.02,
            "use_cache": True,
            "dtype": self.dtype,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                             else self.eos_token_id),
            "pad_token_id": self.pad_token_id,
        }
        if fam == "llama":
            out["attention_bias"] = self.qkv_bias
            out["mlp_bias"] = self.mlp_bias
        elif fam == "qwen3":
            out["attention_bias"] = self.qkv_bias
        if fam in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
            out["max_window_layers"] = self.num_layers
        return out
