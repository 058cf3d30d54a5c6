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
