"""Slow references for the prefix-tree packing (``rollout.tree``).

Straight from the definitions, with tuples of tokens as the keys: the nodes of a prefix forest
are the distinct non-empty prefixes of the sequences, a node's multiplicity is the number of
sequences having that prefix, and ancestry is found by walking parent pointers. Nothing here
imports ``jaxrl_agent``.
"""

from __future__ import annotations

import math
from collections import Counter


def prefix_counts(sequences) -> Counter:
    """{prefix tuple: number of sequences that start with it} over all non-empty prefixes."""
    out = Counter()
    for s in sequences:
        s = tuple(int(t) for t in s)
        for k in range(1, len(s) + 1):
            out[s[:k]] += 1
    return out


def ancestors(parent, v) -> set:
    """{v and every node above it} by walking ``parent`` (-1 ends the walk)."""
    out = set()
    while v >= 0:
        if v in out:
            raise AssertionError(f"parent cycle through node {v}")
        out.add(int(v))
        v = int(parent[v])
    return out


def greedy_rows(sequences, row_len: int) -> list:
    """The documented row assignment of ``pack_prefix_trees``: sequences in lexicographic order
    (ties: original order), next-fit: each goes to the current row if the prefixes it adds
    (its prefixes not yet in the row) still fit, else it opens a new row. Rows are sets of
    prefixes; returns the row of each sequence (in the original order)."""
    seqs = [tuple(int(t) for t in s) for s in sequences]
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    where = [0] * len(seqs)
    row, prefixes = 0, set()
    for i in order:
        s = seqs[i]
        new = {s[:k] for k in range(1, len(s) + 1)} - prefixes
        if len(prefixes) + len(new) > row_len:
            row, prefixes = row + 1, set()
            new = {s[:k] for k in range(1, len(s) + 1)}
        prefixes |= new
        where[i] = row
    return where


def bucket_rows(n: int, cap: int) -> int:
    """``n`` rounded up to a multiple of ``cap // 8`` (at least 1), at most ``max(cap, n)``."""
    q = max(cap // 8, 1)
    return min(-(-n // q) * q, max(cap, n))


def auto_row_len(blocks, T: int, top: int, attn_cost: float, largest: int):
    """``(L, P)`` of ``attach_prefix_trees`` without ``row_len``: among the multiples of
    ``q = max(16, min(T // 4, 64))`` from T up to the first holding the largest group tree
    (``largest`` nodes; at most 8 T), skipping L > T whose ``P * L^2`` exceeds twice the
    block's unpacked ``rows * T^2``, the least ``P * L * (1 + attn_cost * L)`` (the shortest
    on ties); ``P`` the rows the fullest block needs (``greedy_rows``) rounded by
    ``bucket_rows``. (``top`` is unused, kept for the call sites.)"""
    q = max(16, min(T // 4, 64))
    cands = [q * math.ceil(T / q)]
    while cands[-1] < min(largest, 8 * T):
        cands.append(cands[-1] + q)
    best = None
    r_blk = len(blocks[0])
    for L in sorted(set(cands)):
        need = max(max(greedy_rows(b, L), default=0) + 1 for b in blocks)
        P = bucket_rows(need, r_blk)
        if L > T and P * L * L > 2 * r_blk * T * T:
            continue
        cost = P * L * (1.0 + attn_cost * L)
        if best is None or cost < best[0]:
            best = (cost, L, P)
    return best[1], best[2]
