"""Trainer -> vLLM weight sync against the memory-copy floor, and vLLM vs JAX sampling speed.

    python benchmarks/weight_sync.py                    # sizes 64x2, 256x4, 512x8 (about 3 min)
    python benchmarks/weight_sync.py --quick            # smallest size only (smoke run)
    python benchmarks/weight_sync.py --sizes 1024x8,2048x4 --json /tmp/ws.json

Needs vLLM (``pip install 'jaxrl-agent[vllm]'``). Runs on the CPU; on a GPU machine it also
measures the device-to-device copy floor (benchmarks/gpu_weight_sync.py is the GPU run at a
realistic size).

1. Copy floor: host memory-copy bandwidth (``np.copyto`` into a preallocated float32 buffer of
   ``--copy-mb`` MiB, best of repeats; the allocating ``np.copy``, which also pays the page
   faults of a fresh buffer, is shown next to it), the same with a jitted JAX ``x + 1`` on the
   default device (the device-to-device floor on a GPU).
2. Sync vs bytes: for each size ``HIDDENxLAYERS`` (float32, MLP 4 x hidden, head_dim 32 below
   hidden 128 else 64, vocab ``--vocab``) one ``VllmSampler`` is started, then
   ``sync_weights(state, v, probe=False)`` is timed ``--repeats`` times (median; after one
   warm-up sync) and split into ``last_sync["export"]`` (jitted NNX -> HF tensors) and
   ``["load"]`` (torch hand-over + vLLM's ``reload_weights`` + prefix-cache reset); the rest of
   the wall time is the parameter check; "(best)" is the fastest of the timed syncs and "(cpu
   ms)" the median process CPU time (both help when other jobs share the cores). The parity
   probe is timed separately (syncs with ``probe=True``). Floor = bytes / copy bandwidth (host
   numpy on a CPU, the JAX device copy on a GPU); the target is sync <= 2 x floor. On vLLM-CPU
   the load part is vLLM's layer-wise reload: fresh parameter buffers per layer (page
   faults), a copy into them, then oneDNN re-packing of every linear weight (profiled at
   512x8: copy_ ~0.24 s + create_onednn_mm_handler ~0.28 s of ~0.7 s); a per-call fixed cost
   of ~20-30 ms dominates small models.
3. Transfer paths on the middle size: ``transfer="host"`` (device_get + torch.from_numpy) vs
   ``"dlpack"`` (torch.utils.dlpack.from_dlpack of the JAX buffers), switched on the same engine,
   interleaved; each path is then checked by a probed sync (probe error column). On a CPU
   both paths are zero-copy (``device_get`` of a CPU array is a view), so they should tie.
4. Tokens/s: ``JaxSampler`` vs ``VllmSampler`` on the smallest model, the same 64 prompts
   (lengths 8..64) x 32 new tokens (no stop tokens), greedy and T=1, after a warm-up call
   each; median of ``--gen-repeats``.

Both samplers share the process (vLLM pins torch to one thread; JAX uses all cores), so run it
on an idle machine: the load average is printed before and after. No number here is asserted
anywhere: tests never time anything.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_agent.models import ModelConfig, Transformer  # noqa: E402
from jaxrl_agent.sampling import JaxSampler, SamplingParams  # noqa: E402

# vLLM logs every reload at INFO and WARNING level ("RotaryEmbedding: Failed to load weights" is
# harmless: it has no weights); keep the tables readable unless the caller chose a level.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# vllm must first be imported by jaxrl_agent.sampling.vllm (it sets the environment defaults).
from jaxrl_agent.sampling.vllm import VllmSampler, vllm_available  # noqa: E402

DEFAULT_SIZES = "64x2,256x4,512x8"
MAX_LEN = 256
N_PROMPTS, NEW_TOKENS = 64, 32


def loadavg() -> str:
    try:
        return "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "load average n/a"


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        h, _, n = item.strip().lower().partition("x")
        try:
            sizes.append((int(h), int(n)))
        except ValueError:
            raise SystemExit(f"--sizes: expected HIDDENxLAYERS items such as 256x4, got {item!r}")
    return sizes


def make_config(hidden: int, layers: int, vocab: int) -> ModelConfig:
    head_dim = 32 if hidden < 128 else 64   # vLLM's CPU attention needs head_dim >= 32
    if hidden % head_dim:
        raise SystemExit(f"hidden {hidden} must be a multiple of {head_dim}")
    heads = hidden // head_dim
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_layers=layers, num_heads=heads, num_kv_heads=heads,
                       max_position_embeddings=512, dtype="float32")


def kv_cache_bytes(cfg: ModelConfig) -> int:
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    return max(64 * 2 ** 20, 8 * MAX_LEN * per_token)


# --------------------------------------------------------------------------- 1. copy floor

def host_copy_bandwidth(mb: int, repeats: int) -> dict:
    n = mb * 2 ** 20 // 4
    src = np.random.default_rng(0).random(n, dtype=np.float32)
    dst = np.empty_like(src)
    dst.fill(0.0)                                  # touch the pages once
    best_into, best_fresh = float("inf"), float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best_into = min(best_into, time.perf_counter() - t0)
        t0 = time.perf_counter()
        y = np.copy(src)
        best_fresh = min(best_fresh, time.perf_counter() - t0)
        del y
    return dict(bytes=src.nbytes, copyto_gbs=src.nbytes / best_into / 1e9,
                copy_fresh_gbs=src.nbytes / best_fresh / 1e9)


def jax_copy_bandwidth(mb: int, repeats: int) -> dict:
    n = mb * 2 ** 20 // 4
    x = jax.block_until_ready(jnp.zeros((n,), jnp.float32) + 1.0)
    f = jax.jit(lambda a: a + 1.0)                 # one read + one write, cannot be elided
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t0)
    return dict(bytes=x.nbytes, gbs=x.nbytes / best / 1e9, device=str(jax.devices()[0]))


# --------------------------------------------------------------------------- 2./3. sync

def timed_syncs(sampler, state, repeats: int, version0: int, probe: bool = False):
    rows = []
    for i in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        sampler.sync_weights(state, version0 + i, probe=probe)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        rows.append(dict(sampler.last_sync, total=total, cpu=cpu))
    return rows


def median(rows, key):
    return statistics.median(r[key] for r in rows)


def bench_transfer(sampler, state, repeats: int) -> list[dict]:
    """host vs dlpack on the same engine, interleaved; then one probed sync per path."""
    results = {t: dict(transfer=t, syncs=[], error=None) for t in ("host", "dlpack")}
    original = sampler.transfer
    try:
        for i in range(repeats):
            for t, res in results.items():
                if res["error"] is not None:
                    continue
                sampler.transfer = t
                try:
                    res["syncs"] += timed_syncs(sampler, state, 1, 1000 + 10 * i)
                except Exception as e:           # reported as n/a
                    res["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:120]
        for t, res in results.items():
            if res["error"] is None:
                sampler.transfer = t
                try:
                    sampler.sync_weights(state, 2000, probe=True)
                    res["probe_error"] = sampler.last_sync["probe_error"]
                except Exception as e:
                    res["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:120]
    finally:
        sampler.transfer = original
        sampler.sync_weights(state, 0, probe=True)
    out = []
    for t, res in results.items():
        row = dict(transfer=t, error=res["error"], probe_error=res.get("probe_error"))
        if res["syncs"] and res["error"] is None:
            row.update(sync_ms=1e3 * median(res["syncs"], "total"),
                       export_ms=1e3 * median(res["syncs"], "export"),
                       load_ms=1e3 * median(res["syncs"], "load"))
        out.append(row)
    return out


# --------------------------------------------------------------------------- 4. tokens/s

def bench_generate(model, vllm_sampler, repeats: int) -> list[dict]:
    cfg = model.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist()
               for n in rng.integers(8, 65, N_PROMPTS)]
    jax_sampler = JaxSampler(model, max_len=MAX_LEN, batch_buckets=(N_PROMPTS,),
                             len_buckets=(64,), new_token_buckets=(NEW_TOKENS,))
    rows = []
    for label, temp in (("greedy", 0.0), ("T=1", 1.0)):
        params = SamplingParams(temperature=temp, max_new_tokens=NEW_TOKENS)
        for name, sampler in (("JaxSampler", jax_sampler), ("VllmSampler", vllm_sampler)):
            def run():
                outs = sampler.generate(prompts, params)
                assert sum(len(o.token_ids) for o in outs) == N_PROMPTS * NEW_TOKENS
            t0 = time.perf_counter()
            run()                                  # warm-up (JAX: compiles)
            first = time.perf_counter() - t0
            times, cpus = [], []
            for _ in range(repeats):
                c0, t0 = time.process_time(), time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            med = statistics.median(times)
            rows.append(dict(sampler=name, mode=label, first_s=first, median_s=med,
                             cpu_s=statistics.median(cpus),
                             tokens_per_s=N_PROMPTS * NEW_TOKENS / med))
    return rows


# --------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=DEFAULT_SIZES,
                    help=f"comma-separated HIDDENxLAYERS (default {DEFAULT_SIZES}); one "
                         "VllmSampler start (20-60 s on 2 CPU cores) per size")
    ap.add_argument("--quick", action="store_true", help="smallest size only, fewer repeats")
    ap.add_argument("--vocab", type=int, default=260)
    ap.add_argument("--repeats", type=int, default=5, help="timed syncs per size (median)")
    ap.add_argument("--probe-repeats", type=int, default=3)
    ap.add_argument("--gen-repeats", type=int, default=3)
    ap.add_argument("--copy-mb", type=int, default=256, help="buffer of the copy-floor test")
    ap.add_argument("--json", metavar="OUT", help="also write the numbers to this file")
    args = ap.parse_args()
    if not vllm_available():
        raise SystemExit("vLLM is not installed: pip install 'jaxrl-agent[vllm]'")
    sizes = parse_sizes(args.sizes)
    if args.quick:
        sizes = [min(sizes, key=lambda s: s[0] * s[0] * s[1])]
        args.repeats, args.probe_repeats, args.gen_repeats = 3, 2, 2
        args.copy_mb = min(args.copy_mb, 64)
    sizes = sorted(sizes, key=lambda s: s[0] * s[0] * s[1])
    middle = sizes[len(sizes) // 2]
    report = dict(backend=jax.default_backend(), cpu_count=os.cpu_count(), sizes=sizes,
                  load_before=loadavg())
    t_start = time.time()
    print(f"backend {jax.default_backend()} ({jax.devices()[0]}), {os.cpu_count()} CPU cores; "
          f"{report['load_before']}")

    # 1. copy floor
    host = host_copy_bandwidth(args.copy_mb, repeats=5)
    dev = jax_copy_bandwidth(args.copy_mb, repeats=5)
    report["copy"] = dict(host=host, jax=dev)
    on_gpu = jax.default_backend() == "gpu"
    floor_gbs = dev["gbs"] if on_gpu else host["copyto_gbs"]   # where the weights live
    report["floor_gbs"] = floor_gbs
    print(f"\n== 1. memory-copy floor ({args.copy_mb} MiB float32, best of 5)")
    print(f"{'what':<40}  {'GB/s':>7}")
    print(f"{'numpy copyto (preallocated)' + ('' if on_gpu else ' = floor'):<40}  "
          f"{host['copyto_gbs']:>7.2f}")
    print(f"{'numpy copy (fresh buffer, page faults)':<40}  {host['copy_fresh_gbs']:>7.2f}")
    print(f"{'jax jit x+1 on ' + dev['device'] + (' = floor' if on_gpu else ''):<40}  "
          f"{dev['gbs']:>7.2f}")

    # 2. + 3. + 4.
    sync_rows, transfer_rows, gen_rows = [], [], []
    for idx, (hidden, layers) in enumerate(sizes):
        cfg = make_config(hidden, layers, args.vocab)
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        state = nnx.state(model, nnx.Param)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
        t0 = time.perf_counter()
        sampler = VllmSampler(model, max_len=MAX_LEN, kv_cache_bytes=kv_cache_bytes(cfg),
                              max_num_seqs=N_PROMPTS)
        startup = time.perf_counter() - t0
        try:
            timed_syncs(sampler, state, 1, 1)                      # warm-up
            syncs = timed_syncs(sampler, state, args.repeats, 2)
            probes = timed_syncs(sampler, state, args.probe_repeats, 100, probe=True)
            nbytes = syncs[0]["bytes"]
            floor_s = nbytes / (floor_gbs * 1e9)
            row = dict(size=f"{hidden}x{layers}", params=n_params, bytes=nbytes,
                       transfer=sampler.transfer, startup_s=startup,
                       sync_ms=1e3 * median(syncs, "total"),
                       sync_best_ms=1e3 * min(r["total"] for r in syncs),
                       sync_cpu_ms=1e3 * median(syncs, "cpu"),
                       export_ms=1e3 * median(syncs, "export"),
                       load_ms=1e3 * median(syncs, "load"),
                       probe_ms=1e3 * median(probes, "probe"),
                       probe_error=max(p["probe_error"] for p in probes),
                       floor_ms=1e3 * floor_s)
            row["ratio"] = row["sync_ms"] / row["floor_ms"]
            sync_rows.append(row)
            print(f"  [{hidden}x{layers}: startup {startup:.1f} s, sync {row['sync_ms']:.1f} ms"
                  f"; {loadavg()}]", flush=True)
            if (hidden, layers) == middle:
                for r in bench_transfer(sampler, state, args.repeats):
                    r.update(size=f"{hidden}x{layers}", bytes=nbytes)
                    transfer_rows.append(r)
            if idx == 0:
                gen_rows = bench_generate(model, sampler, args.gen_repeats)
                gen_rows = [dict(r, size=f"{hidden}x{layers}") for r in gen_rows]
        finally:
            sampler.close()
            del sampler
            gc.collect()

    report.update(sync=sync_rows, transfer=transfer_rows, generate=gen_rows,
                  load_after=loadavg(), wall_s=time.time() - t_start)

    print(f"\n== 2. sync_weights(state, v, probe=False) vs bytes (float32, vocab {args.vocab}, "
          f"median of {args.repeats}; probe: median of {args.probe_repeats}; floor = bytes / "
          f"{floor_gbs:.2f} GB/s)")
    hdr = (f"{'size':>8} {'transfer':>8} {'params':>11} {'MB':>8} {'sync ms':>9} {'(best)':>7} "
           f"{'(cpu ms)':>8} {'export ms':>9} {'load ms':>9} {'probe ms':>9} {'floor ms':>9} "
           f"{'sync/floor':>10} {'probe err':>9}")
    print(hdr)
    for r in sync_rows:
        print(f"{r['size']:>8} {r['transfer']:>8} {r['params']:>11,} {r['bytes'] / 1e6:>8.2f} "
              f"{r['sync_ms']:>9.1f} {r['sync_best_ms']:>7.1f} {r['sync_cpu_ms']:>8.1f} "
              f"{r['export_ms']:>9.1f} "
              f"{r['load_ms']:>9.1f} {r['probe_ms']:>9.1f} {r['floor_ms']:>9.2f} "
              f"{r['ratio']:>9.1f}x {r['probe_error']:>9.1e}")
    met = [r["size"] for r in sync_rows if r["ratio"] <= 2.0]
    print(f"target sync <= 2x copy floor: {'met for ' + ', '.join(met) if met else 'NOT met'}"
          f"{' (not met for the others)' if met and len(met) < len(sync_rows) else ''}")

    if transfer_rows:
        print(f"\n== 3. transfer paths on {transfer_rows[0]['size']} "
              f"({transfer_rows[0]['bytes'] / 1e6:.2f} MB; same engine, interleaved, median of "
              f"{args.repeats})")
        print(f"{'transfer':>8} {'sync ms':>9} {'export ms':>9} {'load ms':>9} {'probe err':>9}"
              "  note")
        for r in transfer_rows:
            if r.get("sync_ms") is None:
                print(f"{r['transfer']:>8} {'n/a':>9} {'n/a':>9} {'n/a':>9} {'n/a':>9}  "
                      f"{r['error']}")
            else:
                pe = r["probe_error"]
                print(f"{r['transfer']:>8} {r['sync_ms']:>9.1f} {r['export_ms']:>9.1f} "
                      f"{r['load_ms']:>9.1f} {('n/a' if pe is None else f'{pe:.1e}'):>9}  "
                      f"{r['error'] or ''}")

    if gen_rows:
        print(f"\n== 4. sampling {N_PROMPTS} prompts (lengths 8..64) x {NEW_TOKENS} new tokens, "
              f"model {gen_rows[0]['size']} (median of {args.gen_repeats}, after a warm-up)")
        print(f"{'mode':>6} {'sampler':>12} {'warm-up s':>10} {'median s':>9} {'(cpu s)':>8} "
              f"{'tokens/s':>9}")
        for r in gen_rows:
            print(f"{r['mode']:>6} {r['sampler']:>12} {r['first_s']:>10.2f} "
                  f"{r['median_s']:>9.3f} {r['cpu_s']:>8.3f} {r['tokens_per_s']:>9.0f}")

    print(f"\n{report['load_before']} before, {report['load_after']} after; "
          f"total {report['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
