"""Helpers the family test modules share: packing records at a module's padded shapes,
reading a batch's shape table, comparing outputs with the references, and the reference and
layout tests every family module runs (the conformance battery in ``test_conformance.py`` runs
the cross-cutting properties; the family modules keep their methods' own invariants)."""

from __future__ import annotations

import copy
import functools

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


def per_record(adv, index, fields=("token", "turn")) -> dict:
    """field -> list over records of 1-D arrays (turn values; action-token values in order),
    None where ``adv`` has no such output."""
    import numpy as np

    n = len(index.traj)
    res = {}
    for f in fields:
        x = getattr(adv, f)
        if x is None:
            res[f] = None
        elif f.startswith("turn"):
            res[f] = [x[index.traj[i], :len(index.spans[i])] for i in range(n)]
        else:
            res[f] = [np.concatenate([x[r, s:e] for r, s, e in index.spans[i]])
                      for i in range(n)]
    return res


def assert_same_records(a, b, refout, what, order=None, factor=2.0) -> None:
    """Two ``per_record`` results agree on every field within ``factor`` times the reference's
    float32 tolerance. ``order[i]``: the record of ``b`` that corresponds to record i of
    ``a``."""
    import numpy as np

    for f in a:
        if a[f] is None or b[f] is None:
            assert a[f] is None and b[f] is None, f"{what}.{f}: present in one output only"
            continue
        assert len(a[f]) == len(b[f]), f"{what}.{f}: {len(a[f])} vs {len(b[f])} records"
        for i, x in enumerate(a[f]):
            y = b[f][i if order is None else order[i]]
            tol = factor * refout.tol[f][i]
            assert x.shape == y.shape, f"{what}.{f} record {i}: shapes {x.shape} {y.shape}"
            if not np.all(np.abs(x - y) <= tol):
                raise AssertionError(f"{what}.{f} record {i}: {x} vs {y} (tol {tol:.3g})")


def assert_padding_zero(adv, batch, what, fields=("token", "turn")) -> None:
    """``adv``'s outputs are finite, and 0 outside the action mask (token fields) or the turn
    mask (turn fields)."""
    import numpy as np

    am = np.asarray(batch.action_mask)
    tm = np.asarray(batch.turn_mask)
    for f in fields:
        x = getattr(adv, f)
        if x is None:
            continue
        assert np.isfinite(x).all(), f"{what}.{f}: NaN/inf"
        mask = tm if f.startswith("turn") else am
        assert (x[~mask] == 0).all(), f"{what}.{f}: nonzero outside the mask"


def assert_matches(tag: str, adv, refout, index, batch, fields=("token", "turn")) -> None:
    """``adv`` against a reference's per-record result (a ``RefOut``) placed on the batch
    (``assert_placed``)."""
    from tests.reference.estimators_ref import place

    assert_placed(tag, adv, place(refout, index, shapes_of(batch)), batch.layout, fields)


def config_checks(configs, references, ids, out, recs, index, batch,
                  fields=("token", "turn")) -> list:
    """``(tag, check)`` pairs for ``assert_each``: every setting ``cid`` of ``ids`` (``configs``:
    id -> (registry name, hyper-parameters)) against ``references[name](recs, **hp)``."""
    return [("", functools.partial(assert_matches, cid, out[cid],
                                   references[configs[cid][0]](recs, **configs[cid][1]),
                                   index, batch, fields)) for cid in ids]


def assert_each(checks) -> None:
    """Runs every ``(tag, check)`` (a no-argument callable) and fails once, listing every
    failing check's message (prefixed with its tag when one is given), so one failing setting
    does not hide the others. An empty list of checks fails (it would test nothing)."""
    checks = list(checks)
    assert checks, "no checks to run"
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


def unique_keys(recs, field: str = "state_key") -> list:
    """A deep copy of ``recs`` in which every turn has a ``field`` (state or action key) of its
    own, so no two turns share it."""
    recs = copy.deepcopy(recs)
    for n, t in enumerate(t for r in recs for t in r["turns"]):
        t[field] = f"unique-{n}"
    return recs


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


def on_host(program):
    """``program`` with its outputs brought back as host numpy arrays."""
    import jax
    import numpy as np

    def run(*args):
        return jax.tree.map(np.asarray, program(*args))

    return run


def reference_test(ex, strategy, pack, run_all, checks):
    """A family module's ``test_matches_reference(layout, recs)``: hypothesis records of
    ``strategy`` (settings ``ex``) packed in each layout and run through ``run_all``;
    ``checks(out, recs, index, batch)`` lists the ``(tag, check)`` pairs ``assert_each`` runs."""
    import pytest
    from hypothesis import given

    from jaxrl_agent.batch import LAYOUTS

    def test_matches_reference(layout, recs):
        batch, index = pack(recs, layout)
        assert_each(checks(run_all(batch), recs, index, batch))

    _salt_digest(test_matches_reference)
    return pytest.mark.parametrize("layout", LAYOUTS)(ex(given(recs=strategy)(
        test_matches_reference)))


def layouts_agree_test(ex, strategy, run_all, pack, ids, pick=lambda out: out.turn):
    """A family module's ``test_layouts_agree(recs)``: ``assert_layouts_agree`` on hypothesis
    records of ``strategy`` (settings ``ex``)."""
    from hypothesis import given

    def test_layouts_agree(recs):
        assert_layouts_agree(run_all, pack, recs, ids, pick)

    _salt_digest(test_layouts_agree)
    return ex(given(recs=strategy)(test_layouts_agree))


def _salt_digest(test, depth: int = 2) -> None:
    """Hypothesis keys a test (its derandomized seed, its example database) on a digest of its
    source, which every test these factories make shares: add the calling module's name (the
    family module, ``depth`` frames up) so that each family's test is its own."""
    import sys

    test._hypothesis_internal_add_digest = sys._getframe(depth).f_globals["__name__"].encode()
