"""GiGPO benchmark pieces: a synthetic batch with anchor-state collisions, the loop baseline
written the way verl-agent's core_gigpo works, and the byte count of the bandwidth floor,
for ``estimators.py --gigpo``. Nothing here is imported by the library or the tests.

The baseline (``gigpo_loop``) follows the structure of verl-agent's
``compute_gigpo_outcome_advantage`` (written independently, not copied): one entry per step, in
trajectory order; discounted step returns by a reverse loop over each trajectory's steps; the
episode term from a dict ``index -> scores`` with numpy mean/std per group (one score per
trajectory, the library's default ``episode_weighting="trajectory"``; verl-agent's default
counts every step); step groups from a dict ``(index, anchor_obs) -> [positions]`` with one uid
per cluster; the step term from a dict ``uid -> returns`` with numpy mean/std per group; both
assigned back by a loop over steps and summed; the final broadcast onto action tokens is one
vectorised numpy gather (the original's ``scores.unsqueeze(-1).tile(...) * response_mask``).
It is a *charitable* version of the original: the original finds each group's rows with
``np.where(index == idx)`` per unique index and each step's position in its trajectory with
``np.where(traj_uid == uid)`` per step (quadratic in the batch), and names clusters with
``uuid4`` strings; here every group lookup is a dict (linear) and uids are ints.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from jaxrl_agent.batch import TrajectoryBatch, bucket

OBS, ACT, GROUP = 4, 4, 8
INVALID_PENALTY, P_INVALID = -0.1, 0.1  # verl-agent's invalid-action penalty, and its rate


def gigpo_batch(n: int, k: int, layout: str = "concatenated", seed: int = 0) -> TrajectoryBatch:
    """A valid batch of n trajectories (groups of 8) with (k + 1) // 2 .. k turns each.

    Anchor states collide the way they do in ALFWorld/WebShop rollouts: turn 0 of every
    trajectory of a group is the task's initial observation, later turns draw their state from a
    per-group pool of max(2, k) observations, so an anchor group has ~6 members on average
    (``anchor_group_sizes``). Turn rewards: an invalid-action penalty of -0.1 on 10% of the
    turns, plus the 0/1 outcome on the last turn. Token rows are short: 4 observation + 4 action
    tokens per turn, either all turns of a trajectory in one row (``"concatenated"``, R = N) or
    one row per turn (``"per_step"``, verl-agent's layout; R = the number of turns rounded up to
    a power of two as ``pack_records`` does, padding rows empty).
    """
    rng = np.random.default_rng(seed)
    n_pad, k_pad = bucket(n, 8), bucket(k)
    turns = rng.integers((k + 1) // 2, k + 1, n)
    turn_mask = np.zeros((n_pad, k_pad), bool)
    turn_mask[:n] = np.arange(k_pad)[None, :] < turns[:, None]
    traj_mask = np.arange(n_pad) < n
    group_ids = np.where(traj_mask, (np.arange(n_pad) // GROUP) * GROUP, 0).astype(np.int32)

    pool_size = max(2, k)
    pool = rng.integers(0, 2**32, (n_pad // GROUP + 1, pool_size), dtype=np.uint32)
    pick = rng.integers(0, pool_size, (n_pad, k_pad))
    pick[:, 0] = 0  # the task's initial observation
    state_keys = np.where(turn_mask, pool[(np.arange(n_pad) // GROUP)[:, None], pick], 0)
    state_keys = state_keys.astype(np.uint32)

    outcome = np.zeros(n_pad, np.float32)
    outcome[:n] = rng.integers(0, 2, n)
    turn_rewards = np.where(turn_mask & (rng.random((n_pad, k_pad)) < P_INVALID),
                            INVALID_PENALTY, 0.0).astype(np.float32)
    turn_rewards[np.arange(n), turns - 1] += outcome[:n]

    per_turn = OBS + ACT
    if layout == "concatenated":
        t_pad = bucket(k * per_turn, 16)
        pos = np.arange(t_pad)
        turn_of_pos, in_turn = pos // per_turn, pos % per_turn
        action_mask = np.zeros((n_pad, t_pad), bool)
        action_mask[:n] = (in_turn >= OBS)[None, :] & (turn_of_pos[None, :] < turns[:, None])
        turn_ids = np.where(action_mask, turn_of_pos[None, :], -1).astype(np.int32)
        row_traj = np.arange(n_pad, dtype=np.int32)
    elif layout == "per_step":
        t_pad = bucket(per_turn)
        ti, tk = np.nonzero(turn_mask)  # one row per turn, in trajectory order
        r_pad = bucket(len(ti), 8)
        action_mask = np.zeros((r_pad, t_pad), bool)
        action_mask[:len(ti), OBS:per_turn] = True
        turn_ids = np.full((r_pad, t_pad), -1, np.int32)
        turn_ids[:len(ti), OBS:per_turn] = tk[:, None]
        row_traj = np.zeros(r_pad, np.int32)
        row_traj[:len(ti)] = ti
    else:
        raise ValueError(f"layout must be 'concatenated' or 'per_step', got {layout!r}")
    r_pad = action_mask.shape[0]
    return TrajectoryBatch(
        tokens=rng.integers(0, 1000, (r_pad, t_pad)).astype(np.int32), action_mask=action_mask,
        turn_ids=turn_ids, row_traj=row_traj,
        old_logprobs=np.zeros((r_pad, t_pad), np.float32), turn_mask=turn_mask,
        turn_rewards=turn_rewards, state_keys=state_keys,
        action_keys=rng.integers(0, 2**32, (n_pad, k_pad), dtype=np.uint32),
        group_ids=group_ids, task_ids=(np.arange(n_pad) // GROUP).astype(np.int32),
        traj_mask=traj_mask, outcome=outcome, layout=layout).validate()


def anchor_group_sizes(b: TrajectoryBatch) -> np.ndarray:
    """Sizes of the (group, anchor state) groups of the valid turns."""
    tm = np.asarray(b.turn_mask) & np.asarray(b.traj_mask)[:, None]
    g = np.broadcast_to(np.asarray(b.group_ids)[:, None], tm.shape)[tm].astype(np.uint64)
    s = np.asarray(b.state_keys)[tm].astype(np.uint64)
    _, counts = np.unique((g << np.uint64(32)) | s, return_counts=True)
    return counts


def gigpo_bytes(b: TrajectoryBatch) -> int:
    """Bytes GiGPO must read (turn_mask, turn_rewards, state_keys, group_ids, traj_mask, outcome,
    action_mask, turn_ids, row_traj) and write (token [R, T] f32, turn [N, K] f32)."""
    read = sum(np.asarray(getattr(b, f)).nbytes for f in (
        "turn_mask", "turn_rewards", "state_keys", "group_ids", "traj_mask", "outcome",
        "action_mask", "turn_ids", "row_traj"))
    write = 4 * (b.num_rows * b.row_len + b.num_traj * b.num_turns)
    return read + write


def host_arrays(b: TrajectoryBatch) -> dict:
    """Host numpy copies of the fields the baseline reads."""
    return {f: np.asarray(getattr(b, f)) for f in (
        "turn_mask", "turn_rewards", "state_keys", "group_ids", "traj_mask", "outcome",
        "action_mask", "turn_ids", "row_traj")}


def gigpo_loop(h: dict, gamma: float = 0.95, step_weight: float = 1.0, eps: float = 1e-6):
    """GiGPO the way verl-agent computes it (see the module docstring), from ``host_arrays``.

    Same definition as ``jaxrl_agent.estimators.gigpo`` with its defaults (mean_std_norm, episode
    statistics over trajectories, unbiased std, singleton anchor groups 0), in float64.

    Returns:
      (token [R, T] float32, turn [N, K] float32).
    """
    turn_mask, traj_mask = h["turn_mask"].tolist(), h["traj_mask"].tolist()
    rewards, anchors = h["turn_rewards"].tolist(), h["state_keys"].tolist()
    group_ids, outcome = h["group_ids"].tolist(), h["outcome"].tolist()
    n, k = h["turn_mask"].shape

    # One entry per step (verl-agent's per-step rows): index, traj uid, anchor obs, reward.
    index, traj_uid, anchor_obs, step_reward, where = [], [], [], [], []
    for i in range(n):
        if not traj_mask[i]:
            continue
        for t in range(k):
            if turn_mask[i][t]:
                index.append(group_ids[i])
                traj_uid.append(i)
                anchor_obs.append(anchors[i][t])
                step_reward.append(rewards[i][t])
                where.append((i, t))
    bsz = len(index)

    # Discounted step returns, trajectory by trajectory (compute_step_discounted_returns).
    steps_of = defaultdict(list)
    for p in range(bsz):
        steps_of[traj_uid[p]].append(p)
    returns = [0.0] * bsz
    for positions in steps_of.values():
        running = 0.0
        for p in reversed(positions):
            running = step_reward[p] + gamma * running
            returns[p] = running

    # Episode term (episode_norm_reward, one score per trajectory).
    id2score, seen = defaultdict(list), set()
    for p in range(bsz):
        if (index[p], traj_uid[p]) in seen:
            continue
        seen.add((index[p], traj_uid[p]))
        id2score[index[p]].append(outcome[traj_uid[p]])
    id2mean, id2std = {}, {}
    for idx, scores in id2score.items():
        if len(scores) == 1:
            id2mean[idx], id2std[idx] = scores[0], 1.0  # the library's singleton: 0
        else:
            arr = np.array(scores)
            id2mean[idx], id2std[idx] = np.mean(arr), np.std(arr, ddof=1)
    episode = [(outcome[traj_uid[p]] - id2mean[index[p]]) / (id2std[index[p]] + eps)
               for p in range(bsz)]

    # Step groups (build_step_group): cluster equal anchor observations within each index.
    clusters = defaultdict(list)
    for p in range(bsz):
        clusters[(index[p], anchor_obs[p])].append(p)
    step_uid = [0] * bsz
    for uid, positions in enumerate(clusters.values()):
        for p in positions:
            step_uid[p] = uid

    # Step term (step_norm_reward): normalise the returns within each step group.
    id2score = defaultdict(list)
    for p in range(bsz):
        id2score[step_uid[p]].append(returns[p])
    id2mean, id2std = {}, {}
    for uid, scores in id2score.items():
        arr = np.array(scores)
        if len(scores) == 1:
            id2mean[uid], id2std[uid] = np.mean(arr), 1.0
        else:
            id2mean[uid], id2std[uid] = np.mean(arr), np.std(arr, ddof=1)
    step = [(returns[p] - id2mean[step_uid[p]]) / (id2std[step_uid[p]] + eps)
            for p in range(bsz)]

    # Combine, assign back to [N, K], broadcast onto each turn's action tokens.
    turn = np.zeros((n, k), np.float64)
    for p in range(bsz):
        turn[where[p]] = episode[p] + step_weight * step[p]
    turn = turn.astype(np.float32)
    tid = np.clip(h["turn_ids"], 0, k - 1)
    token = np.where(h["action_mask"], turn[h["row_traj"][:, None], tid], np.float32(0))
    return token, turn
