"""Speed of every estimator, jitted, side by side with its slow reference on the same batch.

    python benchmarks/estimators.py            # N in {1k, 8k, 64k} x K in {1, 8, 32}
    python benchmarks/estimators.py --quick    # N in {1k, 8k} x K in {1, 8}

For each (N trajectories, K turns) the script builds one synthetic batch (groups of 8, 4
observation + 4 action tokens per turn, concatenated layout), times each estimator jitted
(after a warm-up call that compiles; median of repeats; blocking on the results), and times the
slow reference of tests/reference on the first n_ref trajectories of the same batch, scaled
linearly to N when n_ref < N (the references loop over trajectories, so their cost is linear
in N; such rows are marked with *). Bytes/s counts the input arrays the jitted function
actually reads plus its outputs, against the memory-copy bandwidth measured in the same run.
No number here is asserted anywhere: tests never time anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl_agent import estimators  # noqa: E402
from jaxrl_agent.batch import TrajectoryBatch, bucket  # noqa: E402
from tests.reference import estimators_ref as ref  # noqa: E402

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
            jax.block_until_ready(call())  # compile
            t_jit = median_time(call, repeats)
            nbytes = read_bytes(traced, batch)
            ref_fn = ref.REFERENCES[name]
            kwargs = {"layout": "concatenated"} if name == "rollout_level" else {}
            if spec.stateful:
                p = state.alpha.shape[0]
                kwargs = {"state": (np.asarray(state.alpha), np.asarray(state.beta)),
                          "task_index": {t: t for t in range(p)}}
            t_ref = median_time(lambda: ref_fn(records, **kwargs), 1)
            t_ref *= n / n_ref
            mark = "*" if n_ref < n else " "
            print(f"{name:<22}{n:>7}{k:>4}{int(batch.action_mask.sum()):>11}"
                  f"{t_jit * 1e3:>10.2f}{t_ref * 1e3:>11.0f}{mark}{t_ref / t_jit:>10.0f}"
                  f"{nbytes / t_jit / 1e9:>8.2f}{100 * nbytes / t_jit / bw:>7.1f}%", flush=True)
    print("\n* reference timed on the first n_ref trajectories and scaled linearly to N")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N in {1k, 8k}, K in {1, 8}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--estimators", nargs="*", default=None, help="names (default: all)")
    args = p.parse_args()
    ns, ks = ((1024, 8192), (1, 8)) if args.quick else ((1024, 8192, 65536), (1, 8, 32))
    run([(n, k) for n in ns for k in ks], args.repeats, args.estimators or estimators.names())


if __name__ == "__main__":
    main()
