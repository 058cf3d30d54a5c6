"""Helpers the family test modules share: packing records at a module's padded shapes and
reading a batch's shape table (the conformance battery in ``test_conformance.py`` runs the
cross-cutting properties; the family modules keep their methods' own invariants)."""

from __future__ import annotations

from jaxrl_agent.rollout.records import pack_records


def packer(pad_table: dict, *, validate: bool = False):
    """``pack(records, layout, pad=None, num_shards=1) -> (batch, index)`` padded to
    ``pad_table[layout]`` unless ``pad`` is given (validated when ``validate``)."""

    def pack(records, layout, pad=None, num_shards=1):
        batch, index = pack_records(records, layout=layout, pad_to=pad or pad_table[layout],
                                    num_shards=num_shards)
        return (batch.validate(num_shards=num_shards) if validate else batch), index

    return pack


def shapes_of(batch) -> dict:
    """``{"N", "K", "R", "T"}``: trajectories, turns, rows and row length of a batch."""
    return {"N": batch.num_traj, "K": batch.num_turns, "R": batch.num_rows, "T": batch.row_len}


def assert_placed(tag: str, adv, placed: dict, layout: str, fields=("token", "turn")) -> None:
    """``adv``'s fields against a reference placed on the batch (``reference.place``: per field
    ``(expected, tolerance)``, or None where the method has no such output): finite, and within
    tolerance everywhere; the AssertionError names the field, layout, position and both
    values."""
    import numpy as np

    for f in fields:
        if placed.get(f) is None:
            assert getattr(adv, f) is None, f"{tag}.{f}: unexpected output"
            continue
        exp, tol = placed[f]
        got = np.asarray(getattr(adv, f), np.float64)
        assert np.isfinite(got).all(), f"{tag}.{f}: non-finite"
        err = np.abs(got - exp)
        if (err > tol).any():
            p = tuple(int(i) for i in np.argwhere(err > tol)[0])
            raise AssertionError(f"{tag}.{f} [{layout}] at {p}: got {got[p]}, "
                                 f"expected {exp[p]} (tol {tol[p]:.3g})")


def assert_each(checks) -> None:
    """Runs every ``(tag, check)`` (a no-argument callable) and fails once, listing every
    failing check's message (prefixed with its tag when one is given), so one failing setting
    does not hide the others."""
    failures = []
    for tag, check in checks:
        try:
            check()
        except AssertionError as e:
            failures.append(f"{tag} {e}" if tag else str(e))
    assert not failures, "\n".join(failures)


def assert_layouts_agree(run_all, pack, recs, ids, pick=lambda out: out.turn) -> None:
    """The per-turn outputs (``pick``) of the settings ``ids`` agree between the records
    packed as one row per trajectory and as one row per turn (trajectory order and the turn
    level do not depend on the layout)."""
    import numpy as np

    a = run_all(pack(recs, "concatenated")[0])
    c = run_all(pack(recs, "per_step")[0])
    for cid in ids:
        np.testing.assert_allclose(pick(a[cid]), pick(c[cid]), atol=1e-6, err_msg=cid)


def colliding_records(seed: int, turn, finish=None, num_traj: int = 8, groups: int = 3) -> list:
    """Deterministic records whose states collide (for plain, non-hypothesis tests): each of
    ``num_traj`` trajectories joins one of ``groups`` task groups, and half of those with an
    earlier member of their group start with a copy of a prefix of its turns (shared
    histories), then add turns ``turn(rng)`` up to 1-4 in all. ``finish(rng, record)`` may
    complete each record (outcome, extras) and returns it."""
    import numpy as np

    rng = np.random.default_rng(seed)
    recs = []
    for _ in range(num_traj):
        g = int(rng.integers(groups))
        earlier = [r for r in recs if r["group"] == g]
        k = int(rng.integers(1, 5))
        turns = []
        if earlier and rng.random() < 0.5:
            src = earlier[int(rng.integers(len(earlier)))]["turns"]
            turns = [dict(t) for t in src[:int(rng.integers(1, min(k, len(src)) + 1))]]
        while len(turns) < k:
            turns.append(turn(rng))
        rec = {"group": g, "task": g, "turns": turns}
        recs.append(finish(rng, rec) if finish else rec)
    return recs
