"""Shared-prefix trees of token sequences, packed into rows so that each shared token is
computed once (HARTS-style prefix sharing).

The rollouts of a task share their prompt, and tree rollouts share whole turns. Training every
row separately recomputes those prefixes. Here the rows of a batch are merged into prefix
trees (tries) by exact token-prefix matching: a row continues a node only if its tokens start
with exactly the tokens on the path to that node. Each tree is laid out in depth-first
preorder, so

* a node's **position** is its depth: RoPE sees the same positions as in the unpacked row;
* the subtree of node ``u`` is the contiguous slot range ``[u, end[u])``; hence node ``u`` is
  an ancestor of (or equal to) node ``v`` iff ``u <= v < end[u]``. Attention over a packed row
  needs only ``end`` (``[L]`` per row), never a stored ``[L, L]`` mask: query ``i`` attends to
  key ``j`` iff ``j <= i < end[j]`` (``Transformer(..., key_ends=end)``). Trees packed one
  after another in a row cannot see each other, and padding slots (``end[j] = j``) are seen
  by nobody;
* ``mult[v]`` is the number of rows through node ``v``; ``index`` maps every token of every
  row to its node, so per-token results of the unpacked rows are a gather from the packed
  ones, and gradients come back through the gather's scatter-add, i.e. weighted by ``mult``.

A node's log-prob, value or entropy is read from its *parent's* output, exactly as the
unpacked row reads token ``t`` from position ``t - 1``: the trainer gathers the packed outputs
at ``index[:, t - 1]``.

Everything here is host-side numpy; ``attach_prefix_trees`` puts the packing into
``batch.extras`` (``tree_tokens``, ``tree_positions``, ``tree_ends`` [blocks * P, L] and
``tree_index`` [R, T]) for ``train.step``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

TREE_KEYS = ("tree_tokens", "tree_positions", "tree_ends", "tree_index", "tree_blocks")
# A packing may hold at most this many times the unpacked rows' attention scores (memory).
MEMORY_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class PrefixTree:
    """A forest of token tries in depth-first preorder (``U`` unique nodes).

    Attributes:
      tokens: [U] token id of each node.
      parent: [U] preorder index of the parent, -1 for a root.
      depth: [U] depth = the token's position in every sequence through it.
      end: [U] one past the last node of the subtree (``u`` is an ancestor-or-self of ``v``
        iff ``u <= v < end[u]``).
      mult: [U] number of sequences through the node.
      paths: per sequence, the node of each of its tokens (``tokens[paths[s]] == seq_s``).
    """

    tokens: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    end: np.ndarray
    mult: np.ndarray
    paths: tuple

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def total_tokens(self) -> int:
        return int(sum(len(p) for p in self.paths))


class _Trie:
    """Insertion-ordered trie; nodes are created in insertion order and renumbered in
    preorder by ``layout``."""

    def __init__(self):
        self.children: list[dict] = [{}]  # node 0 is the virtual root
        self.token: list[int] = [-1]
        self.count: list[int] = [0]
        self.paths: list[list[int]] = []

    @property
    def size(self) -> int:
        return len(self.token) - 1

    def insert(self, seq) -> None:
        node, path = 0, []
        for tok in seq:
            nxt = self.children[node].get(tok)
            if nxt is None:
                nxt = len(self.token)
                self.children[node][tok] = nxt
                self.children.append({})
                self.token.append(tok)
                self.count.append(0)
            self.count[nxt] += 1
            path.append(nxt)
            node = nxt
        self.paths.append(path)

    def layout(self) -> PrefixTree:
        n = self.size
        order = np.empty(n, np.int64)  # preorder slot -> trie node
        slot_of = np.full(n + 1, -1, np.int64)
        parent = np.full(n, -1, np.int64)
        depth = np.zeros(n, np.int64)
        end = np.zeros(n, np.int64)
        k = 0
        stack = [(c, -1, 0) for c in reversed(list(self.children[0].values()))]
        while stack:
            node, par, d = stack.pop()
            if node is None:  # pushed before the children, popped after them: close `par`
                end[par] = k
                continue
            order[k], slot_of[node], parent[k], depth[k] = node, k, par, d
            stack.append((None, k, 0))
            stack.extend((c, k, d + 1) for c in reversed(list(self.children[node].values())))
            k += 1
        tok = np.asarray(self.token, np.int64)[order]
        mult = np.asarray(self.count, np.int64)[order]
        paths = tuple(slot_of[np.asarray(p, np.int64)] for p in self.paths)
        return PrefixTree(tokens=tok.astype(np.int32), parent=parent.astype(np.int32),
                          depth=depth.astype(np.int32), end=end.astype(np.int32),
                          mult=mult.astype(np.int32), paths=paths)


def build_prefix_tree(sequences: Sequence[Sequence[int]]) -> PrefixTree:
    """The prefix forest of ``sequences`` (exact token-prefix matching), in preorder.

    Sequences with equal first tokens share a root; a sequence that is a prefix of another
    ends inside its path. Children are ordered by first insertion, so the layout is
    deterministic.
    """
    trie = _Trie()
    for s in sequences:
        trie.insert([int(t) for t in s])
    return trie.layout()


@dataclasses.dataclass(frozen=True)
class TreePack:
    """Prefix trees packed into ``P`` rows of ``L`` slots.

    Attributes:
      tokens, positions, ends, parents, mult: [P, L] int32 per slot: token id, depth
        position, subtree end (slot index within the row; ``end = slot`` for padding), parent
        slot (-1 for roots and padding) and multiplicity (0 for padding).
      index: per sequence, the flat slot ``row * L + slot`` of each of its tokens.
    """

    tokens: np.ndarray
    positions: np.ndarray
    ends: np.ndarray
    parents: np.ndarray
    mult: np.ndarray
    index: tuple

    @property
    def unique_tokens(self) -> int:
        return int((self.mult > 0).sum())

    @property
    def total_tokens(self) -> int:
        return int(self.mult.sum())


def _sorted_lcp(sequences: list) -> tuple[list, list]:
    """Lexicographic order of ``sequences`` (lists of ints) and, at each position of that order,
    the longest common prefix with the previous one. In sorted order the longest prefix a
    sequence shares with *any* earlier one is the one it shares with its predecessor."""
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    lcp = [0] * len(order)
    for j in range(1, len(order)):
        a, b = sequences[order[j - 1]], sequences[order[j]]
        n = min(len(a), len(b))
        k = 0
        while k < n and a[k] == b[k]:
            k += 1
        lcp[j] = k
    return order, lcp


def _plan_rows(sequences: list, order: list, lcp: list, row_len: int) -> list:
    """Row of each sequence under next-fit in sorted order: a sequence costs the tokens it does
    not share with its predecessor (all of them at the start of a row); a row is closed when
    the next sequence no longer fits. O(number of sequences)."""
    rows = [0] * len(sequences)
    row, used = 0, 0
    for j, i in enumerate(order):
        n = len(sequences[i])
        new = n - (lcp[j] if used else 0)
        if used + new > row_len:
            row, used = row + 1, n
        else:
            used += new
        rows[i] = row
    return rows


def pack_prefix_trees(sequences: Sequence[Sequence[int]], row_len: int,
                      num_rows: int | None = None, _plan=None) -> TreePack:
    """Packs ``sequences`` into rows of ``row_len`` slots, each row a prefix forest.

    Next-fit in lexicographic order (``_plan_rows``): sequences sharing a prefix are adjacent
    there, so a row holds runs of them and each shared token is stored once per row. A
    sequence longer than ``row_len`` is an error. ``num_rows`` pads to that many rows (an error
    if more are needed); default: as many as used (at least one).
    """
    sequences = [[int(t) for t in s] for s in sequences]
    too_long = [i for i, s in enumerate(sequences) if len(s) > row_len]
    if too_long:
        raise ValueError(f"sequence {too_long[0]} has {len(sequences[too_long[0]])} tokens, "
                         f"more than the prefix-tree row length {row_len}")
    order, lcp = _plan if _plan is not None else _sorted_lcp(sequences)
    row_of = _plan_rows(sequences, order, lcp, row_len)
    rows = [_Trie() for _ in range(max(row_of, default=-1) + 1)]
    where = [None] * len(sequences)
    for i in order:
        trie = rows[row_of[i]]
        trie.insert(sequences[i])
        where[i] = (row_of[i], len(trie.paths) - 1)
    p = max(len(rows), 1) if num_rows is None else num_rows
    if len(rows) > p:
        raise ValueError(f"the sequences need {len(rows)} prefix-tree rows of {row_len} slots, "
                         f"more than num_rows={p}")
    slots = np.arange(row_len, dtype=np.int32)
    out = {k: np.zeros((p, row_len), np.int32) for k in ("tokens", "positions", "mult")}
    out["ends"] = np.broadcast_to(slots, (p, row_len)).copy()
    out["parents"] = np.full((p, row_len), -1, np.int32)
    trees = [t.layout() for t in rows]
    for r, tree in enumerate(trees):
        u = tree.num_nodes
        out["tokens"][r, :u], out["positions"][r, :u] = tree.tokens, tree.depth
        out["ends"][r, :u], out["parents"][r, :u], out["mult"][r, :u] = (tree.end, tree.parent,
                                                                        tree.mult)
    index = tuple(r * row_len + trees[r].paths[j] for r, j in where)
    return TreePack(tokens=out["tokens"], positions=out["positions"], ends=out["ends"],
                    parents=out["parents"], mult=out["mult"], index=index)


def tree_mask(ends) -> np.ndarray:
    """[..., L, L] bool reference mask of packed rows: ``mask[i, j] = j <= i < ends[j]``
    (for tests and docs; the model computes the same from ``ends`` on the fly)."""
    ends = np.asarray(ends)
    t = np.arange(ends.shape[-1])
    return (t[:, None] >= t[None, :]) & (t[:, None] < ends[..., None, :])


def row_lengths(batch) -> np.ndarray:
    """[R] tokens of each row that matter for training: up to its last action token.
    Everything the loss reads for token t comes from positions < t, so the padding after a
    row's last action can be dropped (a row without action tokens has length 0)."""
    am = np.asarray(batch.action_mask)
    t = np.arange(am.shape[1])
    return np.where(am.any(axis=1), np.max(np.where(am, t + 1, 0), axis=1), 0)


def _bucket_rows(n: int, cap: int) -> int:
    """``n`` rounded up to a multiple of an eighth of ``cap`` (at most 8 distinct row counts,
    at most 1/8 of the unpacked rows wasted), and at most ``max(cap, n)``."""
    q = max(cap // 8, 1)
    return min(-(-n // q) * q, max(cap, n))


def unique_tokens(sequences) -> int:
    """Nodes of the prefix forest of ``sequences``: the total length minus, in lexicographic
    order, each sequence's common prefix with its predecessor."""
    seqs = [[int(t) for t in q] for q in sequences]
    _, lcp = _sorted_lcp(seqs)
    return sum(len(q) for q in seqs) - sum(lcp)


def largest_group_tree(batch) -> int:
    """Nodes of the largest task group's prefix tree (the unique tokens of its rows)."""
    tokens = np.asarray(batch.tokens)
    lengths = row_lengths(batch)
    group = np.asarray(batch.group_ids)[np.asarray(batch.row_traj)]
    largest = 0
    for g in np.unique(group[lengths > 0]):
        rows = np.flatnonzero((group == g) & (lengths > 0))
        largest = max(largest, unique_tokens([tokens[r, :lengths[r]] for r in rows]))
    return largest


def auto_tree_len(batch, max_factor: int = 8) -> int:
    """The default prefix-tree row length: ``T * 2^k`` for the smallest k such that the largest
    task group's prefix tree fits in one row (so a group is packed as one tree), at most
    ``max_factor * T`` (larger groups are split over rows, repeating their shared prefix).

    Longer rows share more but cost more attention: dense attention over a row is O(L^2)."""
    T = np.asarray(batch.tokens).shape[1]
    largest = largest_group_tree(batch)
    L = T
    while L < largest and L < max_factor * T:
        L *= 2
    return L


# Dense attention costs more than its FLOPs: the mask, softmax and layout work on the
# [heads, L, L] scores. Measured on CPU (benchmarks/prefix_sharing.py): 2-5x the FLOP share.
ATTENTION_OVERHEAD = 3.0


def attention_cost(model_config) -> float:
    """The cost of one (query, key) pair of dense attention relative to one token through the
    rest of the model (projections, MLP, LM head), for a ``ModelConfig``-like
    ``model_config``: ``ATTENTION_OVERHEAD`` x the FLOP ratio. It is the ``a`` of the cost
    model ``rows * L * (1 + a * L)`` that picks a packing's row length."""
    c = model_config
    hd = c.head_dim
    per_layer = (2 * c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * hd
                 + 2 * c.num_heads * hd * c.hidden_size + 6 * c.hidden_size * c.intermediate_size)
    per_token = c.num_layers * per_layer + 2 * c.hidden_size * c.vocab_size
    return ATTENTION_OVERHEAD * 4 * c.num_heads * hd * c.num_layers / per_token


def candidate_lengths(T: int, largest_tree: int, max_factor: int = 8) -> list[int]:
    """Row lengths ``attach_prefix_trees`` tries: multiples of ``q = max(16, min(T // 4, 64))``
    from ``T`` (rounded up to ``q``) to the first that holds the largest group's tree, at most
    ``max_factor * T``. The grid bounds the distinct shapes a run compiles while wasting at
    most ``q`` slots per row."""
    q = max(16, min(T // 4, 64))
    L = q * -(-T // q)
    out = [L]
    while out[-1] < min(largest_tree, max_factor * T):
        out.append(out[-1] + q)
    return out


def attach_prefix_trees(batch, num_blocks: int = 1, row_len: int | None = None,
                        rows_per_block: int | None = None, attn_cost: float = 0.0):
    """Returns ``(batch', stats)``: ``batch`` with the prefix-tree packing of its rows in
    ``extras`` (``TREE_KEYS``), built separately for each of the ``num_blocks`` equal blocks of
    rows (the train step's ``data_shards x micro_batches`` blocks: a block's trees never
    reference another block; ``extras['tree_blocks']`` records the count and the step checks
    it).

    ``extras['tree_tokens' | 'tree_positions' | 'tree_ends']`` are [num_blocks * P, L] (block b
    owns rows ``b * P .. (b + 1) * P - 1``) and ``extras['tree_index']`` [R, T] holds, for
    each token of row r in block b, its slot ``p * L + l`` within block b's rows (positions
    past the row's length point at slot 0: finite, never read by the loss). ``P`` =
    ``rows_per_block`` (default: the most any block needs, rounded by ``_bucket_rows`` so that
    few distinct shapes are compiled).

    ``L``: ``row_len`` when given (raised to the longest row if a row is longer); None or 0
    picks, among ``candidate_lengths``, the length of least estimated cost ``P * L * (1 +
    attn_cost * L)`` (``attention_cost(model_config)``: dense attention makes a long row cost
    O(L^2)), skipping lengths whose attention scores ``P * L^2`` would exceed
    ``MEMORY_FACTOR`` times the unpacked ``rows * T^2``. Row counts of the candidates come from
    ``_plan_rows`` (arithmetic on the sorted rows' common prefixes); only the chosen packing is
    built. ``stats``: ``total_tokens`` (trained tokens of the unpacked rows), ``unique_tokens``,
    ``rows`` (``num_blocks * P``) and ``row_len`` (L).
    """
    tokens = np.asarray(batch.tokens)
    R, T = tokens.shape
    if R % num_blocks:
        raise ValueError(f"num_blocks={num_blocks} must divide the batch's {R} rows")
    extras = dict(batch.extras or {})
    if "segment_ids" in extras or "positions" in extras:
        raise ValueError("prefix sharing needs one sequence per row starting at position 0; "
                         "this batch has extras['segment_ids'/'positions'] (already packed)")
    lengths = row_lengths(batch)
    r_blk = R // num_blocks
    seqs = [tokens[r, :lengths[r]].tolist() for r in range(R)]
    blocks = [seqs[b * r_blk:(b + 1) * r_blk] for b in range(num_blocks)]
    plans = [_sorted_lcp(q) for q in blocks]

    def rows_needed(L):
        need = max(max(_plan_rows(q, *pl, L), default=0) + 1 for q, pl in zip(blocks, plans))
        P = _bucket_rows(need, r_blk) if rows_per_block is None else int(rows_per_block)
        if need > P:
            raise ValueError(f"a block needs {need} prefix-tree rows of {L} slots, more than "
                             f"rows_per_block={P}")
        return P

    if row_len:  # a minimum: a longer row than expected must never stop a run
        L = max(int(row_len), int(lengths.max(initial=1)))
        P = rows_needed(L)
    else:
        best = None
        for L in candidate_lengths(T, largest_group_tree(batch)):
            p = rows_needed(L)
            if L > T and p * L * L > MEMORY_FACTOR * r_blk * T * T:
                continue  # the [rows, heads, L, L] attention scores would outgrow the unpacked
            cost = p * L * (1.0 + attn_cost * L)
            if best is None or cost < best[0]:
                best = (cost, L, p)
        _, L, P = best
    packs = [pack_prefix_trees(q, L, num_rows=P, _plan=pl) for q, pl in zip(blocks, plans)]
    index = np.zeros((R, T), np.int32)
    for b, pack in enumerate(packs):
        for j, idx in enumerate(pack.index):
            index[b * r_blk + j, :len(idx)] = idx
    cat = lambda f: np.concatenate([getattr(p, f) for p in packs])  # noqa: E731
    tree_tok = cat("tokens")
    blk = np.repeat(np.arange(num_blocks), r_blk)[:, None]
    check = tree_tok.reshape(num_blocks, -1)[blk, index]
    valid = np.arange(T)[None, :] < lengths[:, None]
    if not np.array_equal(np.where(valid, check, 0), np.where(valid, tokens, 0)):
        raise AssertionError("prefix-tree packing does not reproduce the batch's tokens")
    extras.update(tree_tokens=tree_tok, tree_positions=cat("positions"), tree_ends=cat("ends"),
                  tree_index=index, tree_blocks=np.arange(num_blocks, dtype=np.int32))
    stats = {"total_tokens": int(lengths.sum()),
             "unique_tokens": sum(p.unique_tokens for p in packs), "rows": num_blocks * P,
             "row_len": L}
    return batch.replace(extras=extras), stats
