"""Speed of every estimator, jitted, side by side with its slow reference on the same batch.

    python benchmarks/estimators.py            # N in {1k, 8k, 64k} x K in {1, 8, 32}, then GiGPO
    python benchmarks/estimators.py --quick    # N in {1k, 8k} x K in {1, 8} (no GiGPO section)
    python benchmarks/estimators.py --gigpo    # only the GiGPO section
    python benchmarks/estimators.py --allocation   # only the re-allocation section

For each (N trajectories, K turns) the script builds one synthetic batch (groups of 8, 4
observation + 4 action tokens per turn, concatenated layout), times each estimator jitted
(after a warm-up call that compiles; median of repeats; blocking on the results), and times the
slow reference of tests/reference on the first n_ref trajectories of the same batch, scaled
linearly to N when n_ref < N (the references loop over trajectories, so their cost is linear
in N; such rows are marked with *). Bytes/s counts the input arrays the jitted function
actually reads plus its outputs, against the memory-copy bandwidth measured in the same run.
Estimators that cannot run on this batch (they need extras it lacks) are listed as skipped;
those without a reference show "-".

The GiGPO section (``run_gigpo``) times ``gigpo`` at N=8192 x K=32 and N=65536 x K=8, in the
concatenated and the per-step layout, on batches with realistic anchor-state collisions
(benchmarks/gigpo_loop.py), against a loop baseline written the way verl-agent's core_gigpo
works (dicts of groups, numpy per group), run in full on the same batch (host copies), and
against the memory-bandwidth floor of the bytes GiGPO must read and write. It then profiles
where the jitted time goes and times sort-free prototypes of the dominant op. Timings are
medians of wall-clock time and of process CPU time (the CPU time is the steadier number when
other jobs share the cores).
The re-allocation section (``run_allocation``) times GRPO followed by the allocation
primitive (turn weights, token weights, exact-mass clipping, the shuffled control) and two
methods built on it (TRIAL: token log-prob gaps; IAPO: an influence graph), against GRPO alone
(so the increment is the re-allocation's own cost), a per-trajectory numpy loop of the
primitive, and the memory-copy floor.
No number here is asserted anywhere: tests never time anything.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from jaxrl_agent import estimators, segments  # noqa: E402
from jaxrl_agent.batch import TrajectoryBatch, bucket  # noqa: E402
from tests.reference import estimators_ref as ref  # noqa: E402
from tests.reference import step_ref  # noqa: E402
from benchmarks import gigpo_loop  # noqa: E402

REFERENCES = {**ref.REFERENCES, **step_ref.REFERENCES}

OBS, ACT, GROUP = 4, 4, 8


def synthetic_batch(n: int, k: int, seed: int = 0):
    """A valid concatenated batch of n trajectories with 1..k turns, built with numpy."""
    rng = np.random.default_rng(seed)
    n_pad, k_pad, t_pad = bucket(n, 8), bucket(k), bucket(k * (OBS + ACT), 16)
    turns = rng.integers((k + 1) // 2, k + 1, n)  # number of turns of each trajectory
    turn_mask = np.arange(k_pad)[None, :] < turns[:, None]
    pos = np.arange(t_pad)
    turn_of_pos, in_turn = pos // (OBS + ACT), pos % (OBS + ACT)
    is_act = (in_turn >= OBS)[None, :] & (turn_of_pos[None, :] < turns[:, None])
    action_mask = np.zeros((n_pad, t_pad), bool)
    action_mask[:n] = is_act
    turn_ids = np.where(action_mask, turn_of_pos[None, :], -1).astype(np.int32)
    outcome = np.zeros(n_pad, np.float32)
    outcome[:n] = rng.integers(0, 2, n)
    turn_rewards = np.zeros((n_pad, k_pad), np.float32)
    turn_rewards[np.arange(n), turns - 1] = outcome[:n]
    traj_mask = np.arange(n_pad) < n
    tm = np.zeros((n_pad, k_pad), bool)
    tm[:n] = turn_mask
    group_ids = np.where(traj_mask, (np.arange(n_pad) // GROUP) * GROUP, 0).astype(np.int32)
    f32 = lambda shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    batch = TrajectoryBatch(
        tokens=rng.integers(0, 1000, (n_pad, t_pad)).astype(np.int32), action_mask=action_mask,
        turn_ids=turn_ids, row_traj=np.arange(n_pad, dtype=np.int32),
        old_logprobs=np.where(action_mask, -np.abs(f32((n_pad, t_pad))), 0).astype(np.float32),
        turn_mask=tm, turn_rewards=turn_rewards,
        state_keys=rng.integers(0, 2**32, (n_pad, k_pad), dtype=np.uint32),
        action_keys=rng.integers(0, 2**32, (n_pad, k_pad), dtype=np.uint32),
        group_ids=group_ids, task_ids=(np.arange(n_pad) // GROUP).astype(np.int32),
        traj_mask=traj_mask, outcome=outcome,
        extras={"turn_values": np.where(tm, f32((n_pad, k_pad)), 0).astype(np.float32),
                "token_values": np.where(action_mask, f32((n_pad, t_pad)), 0).astype(np.float32),
                "ref_logprobs": np.where(action_mask, -np.abs(f32((n_pad, t_pad))), 0)
                .astype(np.float32)})
    return batch.validate()


def first_records(batch: TrajectoryBatch, n: int):
    """The first n trajectories of a concatenated batch, as rollout records."""
    records = []
    b = jax.tree.map(np.asarray, batch)
    for i in range(n):
        turns = []
        for k in np.nonzero(b.turn_mask[i])[0]:
            act = np.nonzero(b.turn_ids[i] == k)[0]
            obs = np.arange(act[0] - OBS, act[0])
            turns.append({"observation": b.tokens[i, obs].tolist(),
                          "action": b.tokens[i, act].tolist(),
                          "reward": float(b.turn_rewards[i, k]),
                          "logprobs": b.old_logprobs[i, act].tolist(),
                          "ref_logprobs": b.extras["ref_logprobs"][i, act].tolist(),
                          "values": b.extras["token_values"][i, act].tolist(),
                          "value": float(b.extras["turn_values"][i, k])})
        records.append({"group": int(b.group_ids[i]), "task": int(b.task_ids[i]),
                        "outcome": float(b.outcome[i]), "turns": turns})
    return records


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bytes(fn, batch) -> int:
    """Bytes of the input arrays the traced function reads plus the bytes of its outputs."""
    closed = jax.make_jaxpr(fn)(batch)
    used = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars}
    used |= {id(v) for v in closed.jaxpr.outvars}
    leaves = jax.tree.leaves(batch)
    n_in = sum(np.asarray(x).nbytes for x, v in zip(leaves, closed.jaxpr.invars) if id(v) in used)
    n_out = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in closed.out_avals)
    return n_in + n_out


def copy_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Measured memory-copy bandwidth (bytes read + written per second), numpy memcpy."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = median_time(lambda: np.copyto(dst, src), 5)
    return 2 * nbytes / t


def run(sizes, repeats, names):
    bw = copy_bandwidth()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores); "
          f"memory-copy bandwidth {bw / 1e9:.1f} GB/s (read + write)\n", flush=True)
    header = (f"{'estimator':<22}{'N':>7}{'K':>4}{'tokens':>11}{'jit ms':>10}{'ref ms':>12}"
              f"{'speed-up':>10}{'GB/s':>8}{'% copy':>8}")
    print(header)
    print("-" * len(header), flush=True)
    for n, k in sizes:
        batch = synthetic_batch(n, k)
        device_batch = jax.device_put(batch)
        n_ref = min(n, max(32, 65536 // (k * (OBS + ACT))))
        records = first_records(batch, n_ref)
        for name in names:
            spec = estimators.spec(name)
            state = spec.init_state(int(batch.task_ids.max()) + 1) if spec.stateful else None
            if spec.stateful:
                fn = jax.jit(lambda b, s, f=spec.fn: f(b, state=s))
                call = lambda: fn(device_batch, state)  # noqa: E731
                traced = lambda b, f=spec.fn, s=state: f(b, state=s)  # noqa: E731
            else:
                fn = jax.jit(spec.fn)
                call = lambda: fn(device_batch)  # noqa: E731
                traced = spec.fn
            try:
                jax.block_until_ready(call())  # compile
            except (ValueError, NotImplementedError) as e:  # needs extras this batch lacks
                print(f"{name:<22}{n:>7}{k:>4}  skipped: {str(e).splitlines()[0][:60]}")
                continue
            t_jit = median_time(call, repeats)
            nbytes = read_bytes(traced, batch)
            ref_fn = REFERENCES.get(name)
            kwargs = {"layout": "concatenated"} if name == "rollout_level" else {}
            if spec.stateful:
                p = state.alpha.shape[0]
                kwargs = {"state": (np.asarray(state.alpha), np.asarray(state.beta)),
                          "task_index": {t: t for t in range(p)}}
            mark = "*" if n_ref < n else " "
            if ref_fn is None:
                ref_cols = f"{'-':>11} {'-':>10}"
            else:
                t_ref = median_time(lambda: ref_fn(records, **kwargs), 1) * n / n_ref
                ref_cols = f"{t_ref * 1e3:>11.0f}{mark}{t_ref / t_jit:>10.0f}"
            print(f"{name:<22}{n:>7}{k:>4}{int(batch.action_mask.sum()):>11}"
                  f"{t_jit * 1e3:>10.2f}{ref_cols}"
                  f"{nbytes / t_jit / 1e9:>8.2f}{100 * nbytes / t_jit / bw:>7.1f}%", flush=True)
    print("\n* reference timed on the first n_ref trajectories and scaled linearly to N")


GIGPO_SIZES = ((8192, 32), (65536, 8))
GIGPO_LAYOUTS = ("concatenated", "per_step")


def median_times(fn, repeats: int):
    """Medians of (wall-clock seconds, process CPU seconds) over ``repeats`` calls."""
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn())
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(wall), statistics.median(cpu)


def copy_bandwidths(nbytes: int = 256 * 2**20, repeats: int = 9):
    """``copy_bandwidth`` by wall-clock and by CPU time (bytes read + written per second)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    wall, cpu = median_times(lambda: np.copyto(dst, src), repeats)
    return 2 * nbytes / wall, 2 * nbytes / cpu


def _mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def run_gigpo(repeats: int, loop_repeats: int, profile: bool = True, sizes=GIGPO_SIZES):
    """GiGPO jitted vs the verl-agent-style loop and vs the bandwidth floor; then a profile."""
    bw, bw_cpu = copy_bandwidths()
    load = os.getloadavg()
    print(f"GiGPO: jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores, "
          f"load average {load[0]:.1f}); memory-copy bandwidth {bw / 1e9:.1f} GB/s by wall "
          f"clock, {bw_cpu / 1e9:.1f} GB/s by CPU time; MemAvailable "
          f"{_mem_available_gb():.1f} GiB\n", flush=True)
    header = (f"{'N':>6}{'K':>4} {'layout':<13}{'rows x T':>13}{'anchor':>7}{'jit ms':>9}"
              f"{'loop ms':>10}{'speed-up':>9}{'MB':>7}{'floor ms':>9}{'ratio':>7}"
              f"{' |':>3}{'jit cpu':>8}{'loop cpu':>10}{'speed-up':>9}{'ratio':>7}"
              f"{'max|diff|':>11}")
    print(header)
    print("-" * len(header), flush=True)
    gigpo = jax.jit(estimators.get("gigpo"))
    batches = {}
    for n, k in sizes:
        for layout in GIGPO_LAYOUTS:
            batch = gigpo_loop.gigpo_batch(n, k, layout)
            device_batch = jax.device_put(batch)
            out = jax.block_until_ready(gigpo(device_batch))  # compile
            t_jit, c_jit = median_times(lambda: gigpo(device_batch), repeats)
            host = gigpo_loop.host_arrays(batch)
            walls, cpus = [], []
            for _ in range(loop_repeats):
                w, c = time.perf_counter(), time.process_time()
                token, turn = gigpo_loop.gigpo_loop(host)
                cpus.append(time.process_time() - c)
                walls.append(time.perf_counter() - w)
            t_loop, c_loop = statistics.median(walls), statistics.median(cpus)
            diff = max(float(np.max(np.abs(token - np.asarray(out.token)))),
                       float(np.max(np.abs(turn - np.asarray(out.turn)))))
            nbytes = gigpo_loop.gigpo_bytes(batch)
            floor, floor_cpu = nbytes / bw, nbytes / bw_cpu
            anchor = float(np.mean(gigpo_loop.anchor_group_sizes(batch)))
            shape = f"{batch.num_rows}x{batch.row_len}"
            print(f"{n:>6}{k:>4} {layout:<13}{shape:>13}{anchor:>7.1f}{t_jit * 1e3:>9.1f}"
                  f"{t_loop * 1e3:>10.0f}{t_loop / t_jit:>9.0f}{nbytes / 1e6:>7.1f}"
                  f"{floor * 1e3:>9.2f}{t_jit / floor:>7.0f}{' |':>3}{c_jit * 1e3:>8.1f}"
                  f"{c_loop * 1e3:>10.0f}{c_loop / c_jit:>9.0f}{c_jit / floor_cpu:>7.0f}"
                  f"{diff:>11.1e}", flush=True)
            batches[(n, k, layout)] = (device_batch, nbytes, c_loop)
            del host, token, turn, out
    print(f"\nloop: benchmarks/gigpo_loop.py gigpo_loop, run in full on every batch (no "
          f"scaling), median of {loop_repeats}; jit: median of {repeats}. anchor = mean size of "
          f"the (group, anchor state) groups. floor = MB / copy bandwidth (wall, or CPU for the "
          f"cpu ratio); ratio = jit / floor. max|diff| = loop vs jit, token and turn arrays.",
          flush=True)
    if profile:
        profile_gigpo(batches, repeats, bw, bw_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\npeak resident memory of this process: {peak:.1f} GiB", flush=True)


def profile_gigpo(batches, repeats, bw, bw_cpu):
    """Where the jitted gigpo time goes, part by part, and sort-free prototypes of the ids."""
    sg = importlib.import_module("jaxrl_agent.estimators.step_group")
    print("\nProfile: each part jitted alone on the same batch (median ms, wall and CPU); "
          "% = share of the whole gigpo CPU time (parts are timed separately, so on a shared "
          "machine they need not add up); ratio = whole-estimator CPU time / CPU floor; "
          "speed-up = loop CPU time / whole-estimator CPU time", flush=True)
    header = f"{'N':>6}{'K':>4} {'layout':<13}{'part':<52}{'wall ms':>9}{'cpu ms':>9}{'%':>6}"
    print(header)
    print("-" * len(header), flush=True)
    for (n, k, layout), (b, nbytes, c_loop) in batches.items():
        valid = jax.jit(segments.valid_turns)(b)
        ids = jax.jit(lambda b: segments.turn_key_ids(b, b.state_keys))(b)
        x = jax.jit(lambda b: sg.step_returns(b, 0.95))(b)
        a = jax.jit(estimators.get("gigpo"))(b).turn

        parts = [
            ("gigpo (library, whole)", estimators.get("gigpo"), (b,)),
            ("  episode_advantage (with local_view)",
             lambda b: sg.episode_advantage(segments.local_view(b)), (b,)),
            ("  step_returns", lambda b: sg.step_returns(b, 0.95), (b,)),
            ("  turn_key_ids (hash table, linear probing)",
             lambda b: segments.turn_key_ids(b, b.state_keys), (b,)),
            ("  turn_key_ids forced onto its sort fallback",
             lambda b: segments.turn_key_ids(b, b.state_keys, max_rounds=0), (b,)),
            ("  key_stats (segment max/sum, gathers)",
             lambda x, i, v: segments.key_stats(x, i, v), (x, ids, valid)),
            ("  turn_to_token (broadcast to [R, T])", segments.turn_to_token, (a, b)),
        ]
        whole = None
        for name, fn, args in parts:
            f = jax.jit(fn)
            res = jax.block_until_ready(f(*args))
            t, c = median_times(lambda: f(*args), 1)
            if t < 0.2:  # cheap parts: more repeats, the medians of a shared machine need them
                t, c = median_times(lambda: f(*args), 3 * repeats)
            elif repeats > 1:
                t, c = median_times(lambda: f(*args), repeats)
            whole = c if whole is None else whole
            extra = ""
            if name.startswith("gigpo"):
                extra = f"  ratio {c / (nbytes / bw_cpu):.0f}  speed-up {c_loop / c:.0f}"
            print(f"{n:>6}{k:>4} {layout:<13}{name:<52}{t * 1e3:>9.1f}{c * 1e3:>9.1f}"
                  f"{100 * c / whole:>5.0f}%{extra}", flush=True)


ALLOC_SIZES = ((8192, 32), (65536, 8))
# (label, pipeline stages after grpo); a stage whose name is not registered is skipped
ALLOC_CASES = (
    ("grpo alone (the base)", ()),
    ("reallocate", (("reallocate", {"weights": "w"}),)),
    ("reallocate clip [.5, 2]", (("reallocate", {"weights": "w", "clip_min": 0.5,
                                                 "clip_max": 2.0}),)),
    ("reallocate per token", (("reallocate", {"weights": "w_tok"}),)),
    ("shuffled_control", (("shuffled_control", {"weights": "w"}),)),
    ("trial", (("trial", {}),)),
    ("iapo", (("iapo", {}),)),
)


def allocation_batch(n: int, k: int, seed: int = 0):
    """``synthetic_batch`` plus the signals re-allocation reads: turn weights ``w`` [N, K],
    token weights ``w_tok`` and ``teacher_logprobs`` [R, T], and an influence graph
    ``edges`` [N, 8, 3] (each turn but the first points back at an earlier one)."""
    b = synthetic_batch(n, k, seed)
    rng = np.random.default_rng(seed + 1)
    am, tm = np.asarray(b.action_mask), np.asarray(b.turn_mask)
    lp = np.asarray(b.old_logprobs)
    e = np.full((b.num_traj, 8, 3), -1, np.int32)
    turns = tm.sum(axis=1)
    for j in range(8):
        dst = np.minimum(j + 1, np.maximum(turns - 1, 0))
        ok = (j + 1 < turns)
        e[ok, j, 0] = rng.integers(0, j + 1, ok.sum())
        e[ok, j, 1] = dst[ok]
        e[ok, j, 2] = rng.integers(0, 2, ok.sum())
    extras = dict(b.extras, w=np.where(tm, rng.random(tm.shape), 0).astype(np.float32),
                  w_tok=np.where(am, rng.random(am.shape), 0).astype(np.float32),
                  teacher_logprobs=np.where(am, lp + rng.normal(0, 0.5, am.shape), 0)
                  .astype(np.float32), edges=e)
    return b.replace(extras=extras).validate()


def reallocate_loop(batch, adv, weights: str, clip_min=None, clip_max=None):
    """The loop baseline: per trajectory, numpy, the way a PyTorch trainer would write it
    (normalise the turn weights by token counts, clip and renormalise until stable), given
    the base advantages ``adv`` [R, T] (numpy)."""
    b = jax.tree.map(np.asarray, batch)
    out = np.zeros_like(adv)
    for i in np.nonzero(b.traj_mask)[0]:
        m = b.action_mask[i]
        w = b.extras[weights][i][b.turn_ids[i][m]]
        w = w * m.sum() / w.sum() if w.sum() > 0 else np.ones_like(w)
        pinned = np.zeros(w.shape, bool)
        for _ in range(64):
            lo, hi = clip_min if clip_min is not None else -np.inf, clip_max or np.inf
            new = pinned | (w < lo) | (w > hi)
            w = np.clip(w, lo, hi)
            free = w[~new].sum()
            if free > 0:
                w[~new] *= (m.sum() - w[new].sum()) / free
            pinned = new
            if not ((w[~pinned] < lo) | (w[~pinned] > hi)).any():
                break
        out[i, m] = adv[i, m] * w
    return out


def run_allocation(repeats: int, sizes=ALLOC_SIZES):
    """grpo -> re-allocation pipelines, jitted, against grpo alone (the increment is what the
    re-allocation costs), a per-trajectory numpy loop of ``reallocate`` and the copy floor."""
    bw = copy_bandwidth()
    print(f"Re-allocation on top of GRPO (jax {jax.__version__}, {os.cpu_count()} cores; "
          f"memory-copy bandwidth {bw / 1e9:.1f} GB/s)\n")
    header = (f"{'pipeline':<28}{'N':>7}{'K':>4}{'tokens':>10}{'jit ms':>9}{'+ over grpo':>12}"
              f"{'loop ms':>10}{'speed-up':>9}{'% copy':>8}")
    print(header)
    print("-" * len(header), flush=True)
    for n, k in sizes:
        batch = allocation_batch(n, k)
        dev = jax.device_put(batch)
        base_adv = np.asarray(jax.jit(estimators.get("grpo"))(dev).token)
        base_ms = None
        for label, then in ALLOC_CASES:
            if any(name not in estimators.names("transform") for name, _ in then):
                continue
            pipe = estimators.Pipeline.build("grpo", then=then)
            fn = jax.jit(pipe)
            try:
                jax.block_until_ready(fn(dev))
            except ValueError as e:
                print(f"{label:<28}{n:>7}{k:>4}  skipped: {str(e).splitlines()[0][:60]}")
                continue
            t = median_time(lambda: fn(dev), repeats)
            base_ms = t * 1e3 if base_ms is None else base_ms
            nbytes = read_bytes(pipe, batch)
            loop = "-", "-"
            if label in ("reallocate", "reallocate clip [.5, 2]"):
                hp = dict(then[0][1])
                t_loop = median_time(lambda: reallocate_loop(batch, base_adv, hp["weights"],
                                                             hp.get("clip_min"),
                                                             hp.get("clip_max")), 1)
                loop = f"{t_loop * 1e3:.0f}", f"{t_loop / t:.0f}x"
            print(f"{label:<28}{n:>7}{k:>4}{int(batch.action_mask.sum()):>10}{t * 1e3:>9.2f}"
                  f"{t * 1e3 - base_ms:>12.2f}{loop[0]:>10}{loop[1]:>9}"
                  f"{100 * nbytes / t / bw:>7.1f}%", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N in {1k, 8k}, K in {1, 8}; no GiGPO")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--estimators", nargs="*", default=None,
                   help="names (default: all); giving names leaves out the GiGPO section")
    p.add_argument("--gigpo", action="store_true",
                   help="only the GiGPO section (8192 x 32 and 65536 x 8, both layouts)")
    p.add_argument("--loop-repeats", type=int, default=3,
                   help="runs of the GiGPO loop baseline per batch (median)")
    p.add_argument("--no-profile", action="store_true", help="GiGPO table without the profile")
    p.add_argument("--allocation", action="store_true",
                   help="only the re-allocation section (grpo -> reallocate / trial / iapo)")
    args = p.parse_args()
    if args.allocation:
        run_allocation(args.repeats)
        return
    if not args.gigpo:
        ns, ks = ((1024, 8192), (1, 8)) if args.quick else ((1024, 8192, 65536), (1, 8, 32))
        run([(n, k) for n in ns for k in ks], args.repeats, args.estimators or estimators.names())
    if args.gigpo or not (args.quick or args.estimators):
        print()
        run_gigpo(args.repeats, args.loop_repeats, profile=not args.no_profile)


if __name__ == "__main__":
    main()
