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
    """The documented greedy row assignment of ``pack_prefix_trees``: in the given order, each
    sequence goes to the row sharing the longest prefix with it among the rows where its
    unshared suffix still fits (the first such row on ties), else to a new row. Rows are sets
    of prefixes; returns the row of each sequence."""
    rows: list[set] = []
    where = []
    for s in sequences:
        s = tuple(int(t) for t in s)
        best, r = -1, -1
        for i, prefixes in enumerate(rows):
            shared = 0
            while shared < len(s) and s[:shared + 1] in prefixes:
                shared += 1
            if shared > best and len(prefixes) + len(s) - shared <= row_len:
                best, r = shared, i
        if r < 0:
            rows.append(set())
            r = len(rows) - 1
        rows[r].update(s[:k] for k in range(1, len(s) + 1))
        where.append(r)
    return where


def bucket_rows(n: int, cap: int) -> int:
    """``n`` rounded up to a multiple of ``cap // 8`` (at least 1), at most ``max(cap, n)``."""
    q = max(cap // 8, 1)
    return min(-(-n // q) * q, max(cap, n))


def auto_row_len(blocks, T: int, top: int, attn_cost: float, largest: int):
    """``(L, P)`` of ``attach_prefix_trees`` without ``row_len``: among ``L = T, 2T, ..., top``
    and the lengths holding the largest group tree (``largest`` nodes) in 1-4 rows, rounded up
    to multiples of ``max(T // 4, 16)`` and kept in ``[T, 8 T]``, the least
    ``P * L * (1 + attn_cost * L)`` (the shortest on ties), ``P`` the rows the fullest block
    needs (``greedy_rows``) rounded by ``bucket_rows`` to the block's row count."""
    cands, L = set(), T
    while True:
        cands.add(L)
        if L >= top:
            break
        L *= 2
    q = max(T // 4, 16)
    for parts in range(1, 5):
        n = math.ceil(largest / parts)
        cands.add(min(max(math.ceil(n / q) * q, T), 8 * T))
    best = None
    for L in sorted(cands):
        need = max(max(greedy_rows(b, L), default=0) + 1 for b in blocks)
        P = bucket_rows(need, len(blocks[0]))
        cost = P * L * (1.0 + attn_cost * L)
        if best is None or cost < best[0]:
            best = (cost, L, P)
    return best[1], best[2]
