"""Trainer -> vLLM weight sync on one GPU at a realistic size, against the device copy floor.

    pip install vllm 'jaxrl-agent' 'jax[cuda12]'       # a GPU machine
    python benchmarks/gpu_weight_sync.py                # Qwen2.5-0.5B shape, bf16, random init
    python benchmarks/gpu_weight_sync.py --model qwen2.5-1.5b --repeats 10 --json out.json

Needs a CUDA GPU visible to both JAX and torch (it exits with a message otherwise; ``--help``
works anywhere). JAX and vLLM share the device: ``XLA_PYTHON_CLIENT_MEM_FRACTION``
(``--jax-mem-fraction``, default 0.4) is set before JAX is imported, and vLLM gets
``--gpu-memory-utilization`` (default 0.4) of the memory.

What it measures:

1. Copy floors on the device, best of repeats, on a buffer of the model's exported bytes:
   device-to-device (``jax.jit(jnp.copy)``, ``block_until_ready``; the floor of
   ``transfer="dlpack"``), device-to-host (``jax.device_get``) and host-to-device
   (``torch.Tensor.cuda``); their sum is the floor of ``transfer="host"``.
2. ``sync_weights(state, v, probe=False)``: one engine (``VllmSampler``, random-init model with
   the chosen config, ``load_format="dummy"``), the transfer switched between ``"dlpack"`` and
   ``"host"`` on the same engine, interleaved, after a warm-up sync per path; median of
   ``--repeats``, split into export (jitted NNX -> HF tensors) and load (hand-over + vLLM's
   ``reload_weights`` + prefix-cache reset), with the ratio to the D2D floor (the issue's
   target: sync within 2x of the copy floor). Then one parity probe per path (max |vLLM -
   trainer| teacher-forced log-prob; bf16 numbers are loose by nature).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# HF config.json fields of the shapes used here (no download: the weights are random).
PRESETS = {
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
    "qwen2.5-1.5b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=1536,
                         intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(PRESETS), default="qwen2.5-0.5b")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5, help="timed syncs per path (median)")
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--jax-mem-fraction", default="0.4",
                    help="XLA_PYTHON_CLIENT_MEM_FRACTION (unless already set in the env)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--kv-cache-mb", type=int, default=0,
                    help="vLLM KV-cache MiB (0: gpu_memory_utilization decides)")
    ap.add_argument("--probe-tol", type=float, default=None,
                    help="reported against the probe error (default: the sampler's by dtype)")
    ap.add_argument("--json", metavar="OUT", help="also write the numbers to this file")
    return ap.parse_args()


def best_time(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    args = parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.jax_mem_fraction))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import jax
    import jax.numpy as jnp
    import numpy as np

    try:
        gpu = jax.default_backend() == "gpu" and bool(jax.devices("gpu"))
    except RuntimeError:
        gpu = False
    if not gpu:
        raise SystemExit(f"gpu_weight_sync.py needs a CUDA GPU visible to JAX (backend here: "
                         f"{jax.default_backend()}; install jax[cuda12]). For the CPU numbers "
                         "run benchmarks/weight_sync.py")
    try:
        import torch
        torch_gpu = torch.cuda.is_available()
    except ImportError:
        torch_gpu = False
    if not torch_gpu:
        raise SystemExit("gpu_weight_sync.py needs torch with CUDA (pip install vllm)")

    from flax import nnx

    from jaxrl_agent.models import ModelConfig, Transformer
    from jaxrl_agent.sampling.vllm import VllmSampler, vllm_available
    if not vllm_available():
        raise SystemExit("vLLM is not installed: pip install vllm")

    cfg = ModelConfig.from_hf(PRESETS[args.model], dtype=args.dtype)
    t0 = time.perf_counter()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    jax.block_until_ready(state)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    print(f"{args.model} shape, {args.dtype}, {n_params / 1e6:.1f} M params, init "
          f"{time.perf_counter() - t0:.1f} s on {jax.devices()[0]}; torch sees "
          f"{torch.cuda.get_device_name(0)}", flush=True)

    t0 = time.perf_counter()
    sampler = VllmSampler(model, max_len=args.max_len, dtype=args.dtype,
                          kv_cache_bytes=args.kv_cache_mb * 2 ** 20 or None,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          probe_every=0, probe_tol=args.probe_tol, transfer="dlpack")
    startup = time.perf_counter() - t0
    nbytes = sampler.last_sync["bytes"]
    print(f"VllmSampler startup {startup:.1f} s; sync payload {nbytes / 1e6:.1f} MB",
          flush=True)

    # 1. copy floors on a buffer of the same bytes
    buf = jax.block_until_ready(jnp.ones((nbytes // 2,), jnp.bfloat16))
    copy = jax.jit(jnp.copy)
    d2d = best_time(lambda: jax.block_until_ready(copy(buf)), 5)
    d2h = best_time(lambda: jax.device_get(buf), 3)
    host = np.array(jax.device_get(buf)).view(np.uint16)   # writable copy
    host_t = torch.from_numpy(host)

    def h2d():
        host_t.cuda()
        torch.cuda.synchronize()
    h2d_s = best_time(h2d, 3)
    floors = dict(d2d_s=d2d, d2h_s=d2h, h2d_s=h2d_s, host_path_s=d2h + h2d_s)
    del buf, host, host_t

    # 2. sync: dlpack vs host, interleaved on the same engine
    sampler.probe(model)                         # compiles the trainer side of the probe
    res = {t: dict(syncs=[], error=None) for t in ("dlpack", "host")}
    for t, r in res.items():                     # warm-up per path
        sampler.transfer = t
        try:
            sampler.sync_weights(state, 1, probe=False)
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
    for i in range(args.repeats):
        for t, r in res.items():
            if r["error"]:
                continue
            sampler.transfer = t
            t0 = time.perf_counter()
            sampler.sync_weights(state, 10 + i, probe=False)
            r["syncs"].append(dict(sampler.last_sync, total=time.perf_counter() - t0))
    rows = []
    for t, r in res.items():
        row = dict(transfer=t, error=r["error"])
        if not r["error"]:
            sampler.transfer = t
            sampler.sync_weights(state, 100, probe=False)
            t0 = time.perf_counter()
            row["probe_error"] = sampler.probe(model)
            row["probe_ms"] = 1e3 * (time.perf_counter() - t0)
            for k in ("total", "export", "load"):
                row[f"{k}_ms"] = 1e3 * statistics.median(s[k] for s in r["syncs"])
            row["ratio_d2d"] = row["total_ms"] / (1e3 * d2d)
        rows.append(row)
    sampler.close()

    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    print(f"\n== copy floors for {nbytes / 1e6:.1f} MB (best of repeats)")
    print(f"{'path':<34} {'ms':>9} {'GB/s':>8}")
    for name, s in (("device->device (jnp.copy)", d2d), ("device->host (device_get)", d2h),
                    ("host->device (torch .cuda())", h2d_s),
                    ("host path floor (D2H + H2D)", d2h + h2d_s)):
        print(f"{name:<34} {1e3 * s:>9.2f} {gbs(s):>8.1f}")
    print(f"\n== sync_weights(state, v, probe=False), median of {args.repeats}, tol "
          f"{sampler.probe_tol:g}")
    print(f"{'transfer':>8} {'sync ms':>9} {'export ms':>9} {'load ms':>9} {'probe ms':>9} "
          f"{'sync/D2D':>9} {'probe err':>9}  note")
    for r in rows:
        if r["error"]:
            print(f"{r['transfer']:>8} {'n/a':>9} {'n/a':>9} {'n/a':>9} {'n/a':>9} {'n/a':>9} "
                  f"{'n/a':>9}  {r['error']}")
            continue
        note = "" if r["probe_error"] <= sampler.probe_tol else "PROBE ABOVE TOLERANCE"
        print(f"{r['transfer']:>8} {r['total_ms']:>9.1f} {r['export_ms']:>9.1f} "
              f"{r['load_ms']:>9.1f} {r['probe_ms']:>9.1f} {r['ratio_d2d']:>8.1f}x "
              f"{r['probe_error']:>9.2e}  {note}")
    ok = [r["transfer"] for r in rows if not r["error"] and r["ratio_d2d"] <= 2.0]
    print(f"target sync <= 2x device copy floor: "
          f"{'met by ' + ', '.join(ok) if ok else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, dtype=args.dtype, params=n_params, bytes=nbytes,
                           startup_s=startup, floors=floors, sync=rows,
                           device=str(jax.devices()[0])), f, indent=1, default=str)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
