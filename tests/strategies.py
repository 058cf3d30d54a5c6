"""Random rollout records and batches for tests, in a few fixed shape buckets.

Every batch built here has one of two static shapes per layout, so jitted functions compile
once per test module instead of once per example.
"""

import numpy as np
from hypothesis import strategies as st

from jaxrl_agent.rollout.records import pack_records

MAX_TRAJ, MAX_TURNS, MAX_OBS, MAX_ACT = 8, 4, 3, 3
PAD = {
    "concatenated": {"num_traj": 8, "num_turns": 4, "row_len": 32},
    "per_step": {"num_traj": 8, "num_turns": 4, "num_rows": 32, "row_len": 8},
}


def make_batch(records, layout="concatenated", num_shards=1, pad_to=None):
    pad = PAD[layout] if pad_to is None else pad_to
    return pack_records(records, layout=layout, pad_to=pad, num_shards=num_shards)[0]


def random_records(rng, num_traj=MAX_TRAJ, max_turns=MAX_TURNS, num_groups=3, binary=False,
                   logprobs=False, values=False, token_values=False, ref_logprobs=False,
                   max_obs=MAX_OBS, max_act=MAX_ACT):
    """Random records from a numpy Generator (for non-hypothesis tests)."""
    recs = []
    for i in range(num_traj):
        turns = []
        for _ in range(int(rng.integers(1, max_turns + 1))):
            n_act = int(rng.integers(1, max_act + 1))
            t = {"observation": [int(x) for x in rng.integers(0, 100, rng.integers(0, max_obs + 1))],
                 "action": [int(x) for x in rng.integers(0, 100, n_act)],
                 "reward": float(np.round(rng.normal(), 3))}
            if logprobs:
                t["logprobs"] = [float(-abs(x)) for x in rng.normal(size=n_act)]
            if ref_logprobs:
                t["ref_logprobs"] = [float(-abs(x)) for x in rng.normal(size=n_act)]
            if values:
                t["value"] = float(rng.normal())
            if token_values:
                t["values"] = [float(x) for x in rng.normal(size=n_act)]
            turns.append(t)
        outcome = float(rng.integers(0, 2)) if binary else float(np.round(rng.normal(), 3))
        recs.append({"group": int(rng.integers(0, num_groups)), "task": f"t{i % 5}",
                     "outcome": outcome, "turns": turns})
    return recs


_tok = st.integers(0, 99)
# no subnormal floats: XLA on CPU flushes them to 0 where a numpy reference keeps them (an
# outcome of -1.4e-45 is then a success at a threshold of 0 for one and a failure for the
# other); no reward is ever one.
_reward = st.floats(-3, 3, allow_nan=False, allow_subnormal=False, width=32)


@st.composite
def records(draw, min_traj=1, max_traj=MAX_TRAJ, binary=False, logprobs=False, values=False,
            token_values=False, ref_logprobs=False):
    """A list of valid records that fits the PAD buckets."""
    n = draw(st.integers(min_traj, max_traj))
    num_groups = draw(st.integers(1, n))
    recs = []
    for i in range(n):
        turns = []
        for _ in range(draw(st.integers(1, MAX_TURNS))):
            n_act = draw(st.integers(1, MAX_ACT))
            t = {"observation": draw(st.lists(_tok, max_size=MAX_OBS)),
                 "action": draw(st.lists(_tok, min_size=n_act, max_size=n_act)),
                 "reward": draw(_reward)}
            if logprobs:
                t["logprobs"] = draw(st.lists(st.floats(-5, 0, width=32), min_size=n_act,
                                              max_size=n_act))
            if ref_logprobs:
                t["ref_logprobs"] = draw(st.lists(st.floats(-5, 0, width=32), min_size=n_act,
                                                  max_size=n_act))
            if values:
                t["value"] = draw(_reward)
            if token_values:
                t["values"] = draw(st.lists(_reward, min_size=n_act, max_size=n_act))
            turns.append(t)
        outcome = float(draw(st.integers(0, 1))) if binary else draw(_reward)
        recs.append({"group": draw(st.integers(0, num_groups - 1)), "task": draw(st.integers(0, 3)),
                     "outcome": outcome, "turns": turns})
    return recs


_small_reward = st.sampled_from([-1.0, -0.1, 0.0, 0.5, 1.0])


@st.composite
def step_records(draw, min_traj=1, max_traj=MAX_TRAJ, binary=None, tree=True, extras=None):
    """Records whose turns collide: observations and actions from tiny alphabets, so state
    keys, state-action pairs and whole histories recur inside groups (step-level groups are
    then non-trivial). With ``tree`` a new trajectory often copies the first j turns of an
    earlier member of its group (observations, actions and rewards) before diverging: a
    rollout tree. ``extras``: callable(draw, record) adding method-specific turn fields.
    Fits the PAD buckets."""
    binary = draw(st.booleans()) if binary is None else binary
    n = draw(st.integers(min_traj, max_traj))
    num_groups = draw(st.integers(1, min(n, 3)))
    recs = []
    for _ in range(n):
        g = draw(st.integers(0, num_groups - 1))
        k = draw(st.integers(1, MAX_TURNS))
        earlier = [r for r in recs if r["group"] == g]
        turns = []
        if tree and earlier and draw(st.booleans()):
            src = draw(st.sampled_from(earlier))["turns"]
            turns = [dict(t) for t in src[:draw(st.integers(1, min(k, len(src))))]]
        while len(turns) < k:
            n_act = draw(st.integers(1, 2))
            turns.append({"observation": [draw(st.integers(0, 2))],
                          "action": draw(st.lists(st.integers(0, 1), min_size=n_act,
                                                  max_size=n_act)),
                          "reward": draw(_small_reward if draw(st.booleans()) else _reward)})
        outcome = float(draw(st.integers(0, 1))) if binary else draw(_reward)
        rec = {"group": g, "task": g, "outcome": outcome, "turns": turns}
        if extras is not None:
            extras(draw, rec)
        recs.append(rec)
    return recs
