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
