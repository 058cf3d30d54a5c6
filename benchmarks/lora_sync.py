"""Weight sync to vLLM of a LoRA policy: the adapters alone against the merged model.

    python benchmarks/lora_sync.py                      # 512 x 8 (float32), rank 16
    python benchmarks/lora_sync.py --size 256x4 --rank 8 --repeats 3

Needs vLLM (``pip install 'jaxrl-agent[vllm]'``); runs on the CPU. One model shape
(``HIDDENxLAYERS``, float32, MLP 4 x hidden, head_dim 64, vocab ``--vocab``) with LoRA adapters
of rank ``--rank`` on all seven projections (``lora_b`` random, as after training), and two
engines in turn:

* ``adapters``: ``VllmSampler(model)`` (``adapter_sync``: vLLM started with ``enable_lora``;
  the base was sent once at start-up, every later sync writes the adapters as a PEFT folder
  and points the next request at it; vLLM loads it at that request, so the probe, a
  teacher-forced pass with the new adapter, is part of what a sync costs);
* ``merged``: ``VllmSampler(model, adapter_sync=False)``: every sync sends the whole model
  with the adapters merged into their kernels (``reload_weights``).

Per engine: bytes per sync (``last_sync["bytes"]``), then the median of ``--repeats`` syncs
of a changed policy (the adapters move between syncs) with the probe on: export + hand-over
(``export`` + ``load`` of ``last_sync``) and the probe (``probe``: for the adapter path this
includes vLLM loading the adapter), and the probe's error. A baseline in the same run: the
merged path. No number here is asserted anywhere: tests never time anything.
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_agent.models import ModelConfig, Transformer, lora_paths  # noqa: E402
from jaxrl_agent.sampling.vllm import VllmSampler, vllm_available  # noqa: E402


def _move_adapters(model, rng):
    for path in lora_paths(model.config):
        lin = model
        for key in path:
            lin = getattr(lin, key)
        lin.lora_b[...] = jnp.asarray(rng.normal(0, 0.02, lin.lora_b.shape), jnp.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="512x8", help="HIDDENxLAYERS")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=260)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not vllm_available():
        raise SystemExit("vLLM is not installed: pip install 'jaxrl-agent[vllm]'")
    hidden, layers = (int(x) for x in args.size.split("x"))
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_layers=layers, num_heads=max(hidden // 64, 1),
                      num_kv_heads=max(hidden // 64, 1), head_dim=64,
                      max_position_embeddings=512, dtype="float32", lora_rank=args.rank)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    rows = []
    for name, kwargs in (("adapters", {}), ("merged", {"adapter_sync": False})):
        s = VllmSampler(model, max_len=256, kv_cache_bytes=64 * 2 ** 20, max_num_seqs=8,
                        **kwargs)
        try:
            syncs = []
            for v in range(1, args.repeats + 2):
                _move_adapters(model, rng)
                s.sync_weights(model, v, probe=True)
                syncs.append(dict(s.last_sync))
            timed = syncs[1:]  # after one warm-up sync
            med = lambda k: 1e3 * statistics.median(x[k] for x in timed)  # noqa: E731
            rows.append((name, s.adapter_sync, timed[-1]["bytes"],
                         med("export") + med("load"), med("probe"),
                         max(x["probe_error"] for x in timed), s.startup_seconds))
        finally:
            s.close()
    print(f"model {args.size} float32, LoRA rank {args.rank} on all seven projections; median "
          f"of {args.repeats} probed syncs after a warm-up\n")
    head = (f"{'sync':<10}{'MiB / sync':>12}{'export+load ms':>16}{'probe ms':>10}"
            f"{'probe err':>11}{'engine start s':>16}")
    print(head)
    print("-" * len(head))
    for name, _, b, t, p, e, st in rows:
        print(f"{name:<10}{b / 2 ** 20:>12.2f}{t:>16.1f}{p:>10.1f}{e:>11.2e}{st:>16.1f}")
    a, m = rows[0], rows[1]
    print(f"\nadapters / merged: {100 * a[2] / m[2]:.1f}% of the bytes, "
          f"{(a[3] + a[4]) / (m[3] + m[4]):.2f}x the time (sync + probe)")


if __name__ == "__main__":
    main()
