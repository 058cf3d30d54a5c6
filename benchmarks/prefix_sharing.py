"""Train-step time with shared-prefix trees (``attach_prefix_trees``) vs the unpacked rows.

    python benchmarks/prefix_sharing.py            # 256 wide, 2 layers, T = 128 / 512 (~4.5 min)
    python benchmarks/prefix_sharing.py --quick    # 128 wide, 1 layer, fewer cases (~1.5 min)
    python benchmarks/prefix_sharing.py --trees 2x2x2,2x4 --ratios 0.25,0.5,1,2,4,8
    python benchmarks/prefix_sharing.py --tree-len auto,group,tight --groups 2 --long 0

(times: 2 cores shared with other jobs, load average ~5; about 20 shapes are compiled, ~8 s
each there, so compiling is half of it)

What is timed: the whole RL train step, ``make_train_step(model, optax.sgd(1.0),
StepConfig(estimator="grpo"))`` (PPO loss, token mean, one micro-batch): one forward and one
backward pass of the policy plus the GRPO estimator and the SGD update. The same step function
runs (a) on the batch of ``pack_records(layout="concatenated")``, one row per rollout padded to
``T`` = the rollout length (no power-of-two padding: ``pad_to={"row_len": T}``), and (b) on the
same batch after ``attach_prefix_trees(batch)``, where ``train.step._forward`` runs the model
on the packed trees (``key_ends``) and gathers the per-token log-probs back to the rows
(``_tree_logprobs``). Same parameters, same state, two compiles (one per shape). Timing: one
warm-up call each (compile, reported), then ``--repeats`` calls of each, alternating
unpacked / packed, blocking on the returned state (default 3).

Model: ``models.Transformer`` (``--hidden 256 --intermediate 1024 --layers 2 --heads 8
--kv-heads 4 --head-dim 32 --vocab 512``, float32, no value head: GRPO does not read it), a
size where the MLP dominates the per-token cost at T ~ 100.

Batches: ``--groups`` groups of 8 rollouts (synthetic random tokens, numpy, seeded; every
rollout starts its own branch with a distinct token so the sharing is exactly the one
designed):

* ``prompt P/S=r``: a single turn, a shared prompt of P tokens (the observation) and a suffix
  of S tokens (the action) per rollout, ``P + S = --seq`` (so the unpacked cost is the same in
  every row of the sweep and only the sharing changes), for each r in ``--ratios``;
* ``tree AxBxC``: multi-turn tree rollouts, a shared prompt of ``--tree-prompt`` tokens, then
  per level an action of ``--tree-act`` tokens that branches A (then B, C) ways, each action
  followed (except the last) by an observation of ``--tree-obs`` tokens that belongs to its
  branch; 8 leaves (2x2x2 = branch 2 at 3 depths, 2x4, ...);
* ``long``: the prompt sweep at ``--long`` tokens (0 = skip) for ``--long-ratios``: longer
  rows, where the dense O(L^2) attention over a packed row weighs more.

Columns:

* R x T: unpacked slots (rows x padded row length); rows x L: packed slots. L per
  ``--tree-len`` (each value is its own table row, ``[L value]`` after the case name):
  ``auto``, what the trainer does: ``attach_prefix_trees(batch, attn_cost=attention_cost(
  model config))`` picks among ``candidate_lengths`` (multiples of min(T/4, 64) from T up to the first
  that holds a group's tree) the L of least estimated cost ``rows * L * (1 + a * L)`` under a
  memory cap (so it may share only part of a group, or only rows that fit together: L = T);
  ``group``: ``auto_tree_len`` (the smallest ``T * 2^k`` that holds a group's whole tree, at
  most 8 T); ``tight``: the largest group tree rounded up to 16 (every group in one row, no
  power-of-two padding: the most sharing, and the longest rows); or a number;
* ideal = total real tokens / unique tokens of that packing (``attach_prefix_trees``' stats:
  a group split over several rows repeats its prefix, so a shorter L lowers the ideal too);
  slots x = R*T / (rows*L), the gain in computed positions (the MLP-bound ceiling, below the
  ideal when a row has padding slots);
* attn % unp / pk: the dense attention's share of the forward FLOPs (QK^T and PV, 4 * H * hd *
  L per query and layer, over all L keys since the masked attention is computed densely) vs the
  projections, MLP (6 D F) and LM head (2 D V); "flop x" = unpacked FLOPs / packed FLOPs, the
  speed-up a FLOP-bound machine would show. FLOPs only: the softmax/mask element-wise work
  on the [H, L, L] scores is not counted, so on a CPU attention costs more than its share;
* unp ms / pk ms: median wall step times; speedup: the median over the repeats of the ratio
  unpacked / packed wall time of a back-to-back pair (steadier than the ratio of the medians
  when other processes load the cores); / ideal = speedup / ideal; / flop x = speedup / flop x
  (below 1: costs the FLOP count misses, such as the element-wise softmax and masking of the
  [H, L, L] attention scores);
* cpu-time x: the same paired ratio of the process CPU time (all XLA threads) of each call:
  the work, not the latency, so it barely moves when other processes share the cores (but it
  counts threads that spin while waiting, and misses a packed row's poorer parallelism);
* abs dloss: |loss(packed) - loss(unpacked)| of the same state (the behaviour log-probs are
  set near the fresh model's, so PPO's ratios stay unclipped and the loss reads every
  log-prob); max abs dgrad: max abs difference of the parameters after one SGD step with
  learning rate 1, i.e. of the gradients, next to (grad) the largest gradient entry (a fast
  but wrong packed path cannot pass unnoticed).

CPU timings on shared cores: read the ratios, not the milliseconds. No number here is asserted
anywhere: tests never time anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_agent.rollout.records import pack_records  # noqa: E402
from jaxrl_agent.models.config import ModelConfig  # noqa: E402
from jaxrl_agent.models.transformer import Transformer  # noqa: E402
from jaxrl_agent.rollout.tree import (attach_prefix_trees, attention_cost,  # noqa: E402
                                      auto_tree_len, build_prefix_tree)
from jaxrl_agent.train.step import StepConfig, init_state, make_train_step  # noqa: E402

GROUP = 8


# ----------------------------------------------------------------------------- batches


class _Tokens:
    """Random token ids from [4, vocab); ``fresh(n, first)`` starts with a given token so
    sibling branches never share a first token by chance."""

    def __init__(self, vocab: int, seed: int):
        self.rng, self.vocab = np.random.default_rng(seed), vocab

    def __call__(self, n: int, first: int | None = None) -> list[int]:
        out = self.rng.integers(4, self.vocab, n).tolist()
        if first is not None and n:
            out[0] = 4 + first % (self.vocab - 4)
        return out


def _turn(obs, act, rng, vocab):
    # behaviour log-probs near the fresh model's (~ -log V), so the PPO ratios stay inside the
    # clip range and the loss depends on every log-prob (a sensitive equality check)
    return {"observation": obs, "action": act, "reward": 0.0,
            "logprobs": (-np.log(vocab) + 0.05 * rng.standard_normal(len(act))).tolist()}


def prompt_records(groups: int, prompt: int, suffix: int, vocab: int, seed: int) -> list[dict]:
    """``groups`` groups of 8 single-turn rollouts: one shared prompt per group, a distinct
    suffix per rollout."""
    tok = _Tokens(vocab, seed)
    records = []
    for g in range(groups):
        p = tok(prompt)
        for i in range(GROUP):
            records.append({"group": g, "outcome": float(i % 2),
                            "turns": [_turn(p, tok(suffix, first=i), tok.rng, vocab)]})
    return records


def tree_records(groups: int, shape: tuple, prompt: int, act: int, obs: int, vocab: int,
                 seed: int) -> list[dict]:
    """``groups`` groups of prod(shape) tree rollouts: a shared prompt, then per level an
    action that branches ``shape[k]`` ways, followed (except at the last level) by the
    observation of that branch."""
    tok = _Tokens(vocab, seed)
    records = []
    for g in range(groups):
        p = tok(prompt)
        # nodes[k] maps a branch path (i1..ik) to its (action, observation) at level k
        levels = [{(): None}]
        for k, b in enumerate(shape):
            last = k == len(shape) - 1
            levels.append({path + (i,): (tok(act, first=i), [] if last else tok(obs))
                           for path in levels[-1] for i in range(b)})
        for n, leaf in enumerate(levels[-1]):
            turns, o = [], p
            for k in range(1, len(shape) + 1):
                a, nxt = levels[k][leaf[:k]]
                turns.append(_turn(o, a, tok.rng, vocab))
                o = nxt
            records.append({"group": g, "outcome": float(n % 2), "turns": turns})
    return records


def seq_len(rec) -> int:
    return sum(len(t["observation"]) + len(t["action"]) for t in rec["turns"])


# ----------------------------------------------------------------------------- FLOPs


def flops_per_slot(cfg: ModelConfig, row_len: int) -> tuple[float, float]:
    """(attention, total) forward FLOPs of one position in a row of ``row_len`` slots; the
    masked attention is dense, so every query pays for all ``row_len`` keys."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    h, kv = cfg.num_heads, cfg.num_kv_heads
    proj = 2 * d * hd * (2 * h + 2 * kv)
    mlp = 6 * d * f
    attn = 4 * h * hd * row_len
    head = 2 * d * cfg.vocab_size
    return cfg.num_layers * attn, cfg.num_layers * (proj + mlp + attn) + head


# ----------------------------------------------------------------------------- timing


def _timed(step, state, batch):
    """(wall s, process CPU s, output) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = step(state, batch)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, time.process_time() - c0, out


def run_case(name, p_col, s_col, records, tree_len, cfg, step, state, args):
    T = max(seq_len(r) for r in records)
    n_turns = max(len(r["turns"]) for r in records)
    batch, _ = pack_records(records, layout="concatenated",
                            pad_to={"num_traj": len(records), "num_turns": n_turns,
                                    "row_len": T})
    row_len, attn = None, 0.0
    if tree_len == "auto":  # what the trainer does (train/loop.py)
        attn = attention_cost(cfg)
    elif tree_len == "group":
        row_len = auto_tree_len(batch)
    elif tree_len == "tight":
        tok = np.asarray(batch.tokens)
        largest = max(build_prefix_tree([tok[r] for r in range(i, i + GROUP)]).num_nodes
                      for i in range(0, tok.shape[0], GROUP))
        row_len = 16 * -(-largest // 16)
    else:
        row_len = int(tree_len)
    tbatch, stats = attach_prefix_trees(batch, num_blocks=1, row_len=row_len, attn_cost=attn)
    R, L, rows = batch.tokens.shape[0], stats["row_len"], stats["rows"]

    c0 = time.perf_counter()
    _, _, (s_u, o_u) = _timed(step, state, batch)
    c1 = time.perf_counter()
    _, _, (s_p, o_p) = _timed(step, state, tbatch)
    c2 = time.perf_counter()
    tu, tp = [], []
    for _ in range(args.repeats):
        tu.append(_timed(step, state, batch)[:2])
        tp.append(_timed(step, state, tbatch)[:2])
    dloss = abs(float(o_u["metrics"]["loss"]) - float(o_p["metrics"]["loss"]))
    leaves = lambda s: jax.tree.leaves(s.params)  # noqa: E731
    dgrad = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves(s_u), leaves(s_p)))
    grad = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves(s_u), leaves(state)))

    au, fu = flops_per_slot(cfg, T)
    ap, fp = flops_per_slot(cfg, L)
    med = statistics.median
    tu_ms, tp_ms = 1e3 * med(w for w, _ in tu), 1e3 * med(w for w, _ in tp)
    ideal = stats["total_tokens"] / stats["unique_tokens"]
    speedup = med(u[0] / p[0] for u, p in zip(tu, tp))  # pairs run back to back
    cpu_x = med(u[1] / p[1] for u, p in zip(tu, tp))
    row = {"case": name, "P": p_col, "S": s_col, "T": T, "R": R, "rows": rows, "L": L,
           "total": stats["total_tokens"], "unique": stats["unique_tokens"], "ideal": ideal,
           "slots": R * T / (rows * L), "attn_u": au / fu, "attn_p": ap / fp,
           "flop_x": (R * T * fu) / (rows * L * fp), "unp_ms": tu_ms, "pk_ms": tp_ms,
           "speedup": speedup, "of_ideal": speedup / ideal, "cpu_x": cpu_x,
           "dloss": dloss, "dgrad": dgrad, "grad": grad, "compile_u": c1 - c0, "compile_p": c2 - c1,
           "loss": float(o_u["metrics"]["loss"])}
    print(f"  {name}: T {T}, L {L} x {rows} rows, unpacked {tu_ms:.0f} ms, packed {tp_ms:.0f} "
          f"ms (compile {c1 - c0:.1f} + {c2 - c1:.1f} s)", flush=True)
    return row


def print_table(rows):
    head = ("| case | P | S / shape | R x T | rows x L | ideal (tot/uniq) | slots x | attn % unp "
            "| attn % pk | flop x | unp ms | pk ms | speedup | / ideal | / flop x | cpu-time x | "
            "abs dloss | "
            "max abs dgrad (grad) |")
    print("\n" + head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    for r in rows:
        print(f"| {r['case']} | {r['P']} | {r['S']} | {r['R']} x {r['T']} | {r['rows']} x "
              f"{r['L']} | {r['ideal']:.2f} ({r['total']}/{r['unique']}) | {r['slots']:.2f} | "
              f"{100 * r['attn_u']:.0f} | {100 * r['attn_p']:.0f} | {r['flop_x']:.2f} | "
              f"{r['unp_ms']:.0f} | {r['pk_ms']:.0f} | {r['speedup']:.2f} | "
              f"{r['of_ideal']:.2f} | {r['speedup'] / r['flop_x']:.2f} | {r['cpu_x']:.2f} | "
              f"{r['dloss']:.1e} | "
              f"{r['dgrad']:.1e} ({r['grad']:.1e}) |")


def split_ps(total: int, ratio: float) -> tuple[int, int]:
    s = max(1, round(total / (1 + ratio)))
    return total - s, s


def run(args):
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_layers=args.layers,
                      num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                      max_position_embeddings=4096, value_head=False, dtype="float32")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    state = init_state(model, optax.sgd(1.0), seed=0)
    step = make_train_step(model, optax.sgd(1.0), StepConfig(estimator="grpo"))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {jax.device_count()} x {dev.platform} ({dev.device_kind}), "
          f"{os.cpu_count()} cores, load average {'%.2f %.2f %.2f' % os.getloadavg()}\n"
          f"model: hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, {cfg.num_layers} "
          f"layers, {cfg.num_heads} heads / {cfg.num_kv_heads} kv heads x {cfg.head_dim}, vocab "
          f"{cfg.vocab_size}, float32: {n_params / 1e6:.2f} M parameters\n"
          f"timed: make_train_step(optax.sgd(1.0), StepConfig(estimator='grpo')) = forward + "
          f"backward + GRPO + update, median of {args.repeats} (alternating unpacked/packed)\n"
          f"batches: {args.groups} group(s) of {GROUP} rollouts; prefix-tree row length "
          f"{', '.join(args.tree_len)}\n", flush=True)

    cases = []
    for r in args.ratios:
        p, s = split_ps(args.seq, r)
        cases.append((f"prompt P/S={r:g}", p, s,
                      prompt_records(args.groups, p, s, args.vocab, args.seed)))
    for shape in args.trees:
        cases.append((f"tree {'x'.join(map(str, shape))}", args.tree_prompt,
                      f"{'x'.join(map(str, shape))}: a{args.tree_act} o{args.tree_obs}",
                      tree_records(args.groups, shape, args.tree_prompt, args.tree_act,
                                   args.tree_obs, args.vocab, args.seed)))
    if args.long:
        for r in args.long_ratios:
            p, s = split_ps(args.long, r)
            cases.append((f"long P/S={r:g}", p, s,
                          prompt_records(args.groups, p, s, args.vocab, args.seed)))

    rows = []
    t0 = time.perf_counter()
    for name, p, s, recs in cases:
        for tl in args.tree_len:
            label = name if len(args.tree_len) == 1 else f"{name} [L {tl}]"
            rows.append(run_case(label, p, s, recs, tl, cfg, step, state, args))
    print_table(rows)
    print(f"\nwall {time.perf_counter() - t0:.0f} s for the cases; load average after: "
          f"{'%.2f %.2f %.2f' % os.getloadavg()}")


def _floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def _shapes(text):
    out = []
    for item in text.split(","):
        if item.strip():
            shape = tuple(int(x) for x in item.strip().lower().split("x"))
            if int(np.prod(shape)) != GROUP:
                raise SystemExit(f"--trees: {item!r} has {int(np.prod(shape))} leaves, "
                                 f"expected {GROUP}")
            out.append(shape)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--groups", type=int, default=1, help="groups of 8 rollouts in the batch")
    p.add_argument("--seq", type=int, default=128, help="P + S of the prompt sweep")
    p.add_argument("--ratios", type=_floats, default=_floats("0.25,1,2,4,8"),
                   help="P/S values of the prompt sweep")
    p.add_argument("--trees", type=_shapes, default=_shapes("2x2x2"),
                   help="branching shapes with 8 leaves, e.g. 2x2x2,2x4,4x2")
    p.add_argument("--tree-prompt", type=int, default=64)
    p.add_argument("--tree-act", type=int, default=16)
    p.add_argument("--tree-obs", type=int, default=16)
    p.add_argument("--long", type=int, default=512, help="P + S of the long rows (0: skip)")
    p.add_argument("--long-ratios", type=_floats, default=_floats("8"),
                   help="P/S values of the long rows")
    p.add_argument("--tree-len", default="auto,tight",
                   help="prefix-tree row length(s), comma-separated, one table row each: auto "
                        "(the trainer's choice: attach_prefix_trees with attn_cost="
                        "attention_cost(model)), group (auto_tree_len: a group per row), tight "
                        "(the largest group tree rounded up to 16) or a number")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="128 wide, MLP 512, 1 layer; P/S 0.25,1,8, tree 2x2x2, no long rows; "
                        "3 repeats")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.head_dim = 128, 512, 1, 16
        args.ratios, args.trees, args.long, args.repeats = [0.25, 1, 8], [(2, 2, 2)], 0, 3
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    args.tree_len = [x.strip() for x in args.tree_len.split(",") if x.strip()]
    if not args.tree_len or any(x not in ("auto", "group", "tight") and not x.isdigit()
                                for x in args.tree_len):
        p.error("--tree-len: comma-separated auto, group, tight or numbers")
    run(args)


if __name__ == "__main__":
    main()
