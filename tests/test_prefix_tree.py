"""Shared-prefix tree training (issue 9): ``rollout.tree`` packs the rows of a batch into prefix
tries laid out in preorder, the model attends along ``key_ends`` ancestor ranges, and the train
step gathers per-token results back to the rows.

* host side (hypothesis, numpy): the trie against ``tests/reference/prefix_tree_ref.py`` (nodes =
  distinct prefixes, multiplicities, parents, depths, the ``u <= v < end[u]`` ancestor rule), the
  packing (every sequence read back through ``index``, the documented greedy row assignment,
  padding slots) and ``tree_mask``;
* the model: every sequence's logits / hidden states / values from the packed trees equal those of
  the sequence run alone; a single path is the plain causal sequence; a token outside a node's
  ancestors (or a padding slot) never changes that node's output;
* the train step: loss, every loss term and the gradients equal the unpacked batch's for every
  aggregation mode (GRPO + KL + entropy, 2 micro-batches), a token critic (gae, per_step) and a
  turn critic (turn_gae, concatenated); on a DP2 x FSDP2 x TP2 mesh too;
* the Trainer with ``trainer.prefix_sharing`` (slow), and the errors.

Compiles dominate on CPU: XLA's backend optimisations are off for this module, shapes are fixed
(``pad_to``, ``row_len``, ``rows_per_block``) so hypothesis examples reuse one compile, and all
the step configurations of one batch shape run inside a single jitted function.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from jaxrl_agent import sharding
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.losses.aggregation import AGG_MODES
from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import Transformer
from jaxrl_agent.rollout.tree import (TREE_KEYS, attach_prefix_trees, attention_cost,
                                      auto_tree_len, build_prefix_tree, pack_prefix_trees,
                                      row_lengths, tree_mask)
from jaxrl_agent.train.step import StepConfig, init_state, make_train_step, train_step
from tests.reference import prefix_tree_ref as ref

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, value_head=True, qk_norm=True)

# Measured on 2 (shared) CPU cores, float32, max over all examples (printed at the end of the
# module with -s):
#   model, packed tree vs each sequence alone: |logits| 8.9e-8, |hidden| 7.2e-7, |values| 4.5e-8
#     (single path vs plain sequence and perturbations outside the ancestors: bitwise equal);
#   step, tree vs unpacked (and sharded tree vs unsharded unpacked): loss / terms 4.8e-7 abs
#     (0.12 of LOSS_TOL), gradients 1.3e-7 abs (0.07 of GRAD_TOL; largest entries ~0.2),
#     critic advantage metrics 2.4e-7 abs (0.04 of ADV_TOL).
MODEL_TOL = dict(rtol=1e-5, atol=1e-5)
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
ADV_TOL = dict(rtol=1e-5, atol=3e-6)  # critic advantages (values through the head) of scale ~1
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True, scope="module")
def _module_compiles(fast_compiles):
    """This module's compiles without XLA's backend optimisations; after it, its cache is
    dropped and the largest differences seen are printed."""
    yield
    _CACHE.clear()
    print("\nlargest differences seen:", {k: f"{v:.2g}" for k, v in sorted(_MAX_DIFF.items())})


_CACHE: dict = {}
_MAX_DIFF: dict = {}  # the largest differences seen (printed at the end with -s)


# ============================================================================ host side

@st.composite
def token_forests(draw, vocab=3, max_depth=3, max_edge=4, allow_empty=True):
    """Root-to-leaf token paths of a random forest (random branching, depth and edge lengths),
    sometimes also a path ending at an inner node (a prefix of another), duplicates and an
    empty sequence, in a random order. The tiny vocabulary makes siblings collide at times
    (they then merge in the trie: the references go by the sequences, not by this forest)."""
    out = []

    def grow(prefix, depth):
        seq = prefix + draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=max_edge))
        kids = draw(st.integers(0, 3)) if depth < max_depth else 0
        if kids == 0 or draw(st.integers(0, 3)) == 0:  # a leaf, or an inner node's own path
            out.append(seq)
        for _ in range(kids):
            grow(seq, depth + 1)

    for _ in range(draw(st.integers(1, 3))):
        grow([], 1)
    dups = draw(st.lists(st.integers(0, len(out) - 1), max_size=3))
    out += [list(out[i]) for i in dups]
    if allow_empty and draw(st.integers(0, 5)) == 0:
        out.append([])
    return draw(st.permutations(out))


def _check_forest(seqs, tokens, parent, depth, end, mult, paths):
    """Every property of a preorder prefix forest against the references."""
    counts = ref.prefix_counts(seqs)
    U = len(tokens)
    assert U == len(counts)  # one node per distinct non-empty prefix
    for a in (tokens, parent, depth, end, mult):
        assert a.shape == (U,)
    assert len(paths) == len(seqs)
    node_of = {}
    for s, path in zip(seqs, paths):
        path = np.asarray(path)
        assert path.shape == (len(s),)
        np.testing.assert_array_equal(tokens[path], np.asarray(s, np.int64).reshape(-1))
        np.testing.assert_array_equal(depth[path], np.arange(len(s)))  # depth == position
        if len(s):
            assert parent[path[0]] == -1
            np.testing.assert_array_equal(parent[path[1:]], path[:-1])
        for k in range(len(s)):  # the same prefix is the same node, another prefix another
            assert node_of.setdefault(tuple(s[:k + 1]), int(path[k])) == path[k]
    assert len(set(node_of.values())) == U
    for prefix, v in node_of.items():
        assert mult[v] == counts[prefix]
    # the ancestor rule of the preorder layout, against walking the parents
    anc = [ref.ancestors(parent, v) for v in range(U)]
    for u in range(U):
        assert u < end[u] <= U
        for v in range(U):
            assert (u <= v < end[u]) == (u in anc[v]), (u, v)


@settings(max_examples=150)
@given(token_forests())
def test_build_prefix_tree_is_the_prefix_forest(seqs):
    tree = build_prefix_tree(seqs)
    _check_forest(seqs, tree.tokens, tree.parent, tree.depth, tree.end, tree.mult, tree.paths)
    assert tree.num_nodes == len(ref.prefix_counts(seqs))
    assert tree.total_tokens == sum(len(s) for s in seqs) == int(tree.mult.sum())
    assert int(tree.mult[tree.parent == -1].sum()) == sum(len(s) > 0 for s in seqs)
    # deterministic preorder: siblings (and roots) in the order of their first sequence
    first = {}
    for i, path in enumerate(tree.paths):
        for v in path:
            first.setdefault(int(v), i)
    for u in range(tree.num_nodes):
        for v in range(u + 1, tree.num_nodes):
            if tree.parent[u] == tree.parent[v]:
                assert first[u] < first[v], (u, v)


def test_build_prefix_tree_examples():
    tree = build_prefix_tree([[1, 2, 3], [1, 2, 4], [1, 2], [5], [1, 2, 3]])
    #   preorder: 1 2 3 4 | 5
    np.testing.assert_array_equal(tree.tokens, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(tree.parent, [-1, 0, 1, 1, -1])
    np.testing.assert_array_equal(tree.depth, [0, 1, 2, 2, 0])
    np.testing.assert_array_equal(tree.end, [4, 4, 3, 4, 5])
    np.testing.assert_array_equal(tree.mult, [4, 4, 2, 1, 1])
    assert [p.tolist() for p in tree.paths] == [[0, 1, 2], [0, 1, 3], [0, 1], [4], [0, 1, 2]]
    empty = build_prefix_tree([])
    assert empty.num_nodes == 0 and empty.paths == ()


@st.composite
def pack_cases(draw):
    seqs = draw(token_forests())
    longest = max([len(s) for s in seqs] + [1])
    row_len = draw(st.integers(longest, 3 * longest))
    return seqs, row_len, draw(st.integers(0, 2))


@settings(max_examples=150)
@given(pack_cases())
def test_pack_prefix_trees(case):
    seqs, L, extra_rows = case
    used = max(ref.greedy_rows(seqs, L), default=-1) + 1
    pack = pack_prefix_trees(seqs, L)
    assert pack.tokens.shape == (max(used, 1), L)
    pack = pack_prefix_trees(seqs, L, num_rows=used + extra_rows)
    P = used + extra_rows
    for a in (pack.tokens, pack.positions, pack.ends, pack.parents, pack.mult):
        assert a.shape == (P, L) and a.dtype == np.int32
    # every sequence read back from the packed tokens (and its positions) through its index
    assert len(pack.index) == len(seqs)
    for s, idx in zip(seqs, pack.index):
        assert np.asarray(idx).shape == (len(s),)
        np.testing.assert_array_equal(pack.tokens.reshape(-1)[idx], np.asarray(s).reshape(-1))
        np.testing.assert_array_equal(pack.positions.reshape(-1)[idx], np.arange(len(s)))
    # the documented greedy assignment; a sequence's tokens all lie in one row
    rows = ref.greedy_rows(seqs, L)
    for s, idx, r in zip(seqs, pack.index, rows):
        assert np.all(np.asarray(idx) // L == r)
    slot = np.arange(L)
    for r in range(P):
        members = [s for s, rr in zip(seqs, rows) if rr == r]
        u = len(ref.prefix_counts(members))
        assert u <= L  # row lengths respected
        # the used slots are this row's prefix forest (slot-local end / parent)
        paths = [np.asarray(i) - r * L for s, i, rr in zip(seqs, pack.index, rows) if rr == r]
        _check_forest(members, pack.tokens[r, :u].astype(np.int64), pack.parents[r, :u],
                      pack.positions[r, :u], pack.ends[r, :u], pack.mult[r, :u], paths)
        # padding: seen by nobody (end == slot), multiplicity 0, no parent, token 0
        pad = slot >= u
        np.testing.assert_array_equal(pack.ends[r, pad], slot[pad])
        assert not pack.mult[r, pad].any() and not pack.tokens[r, pad].any()
        assert (pack.parents[r, pad] == -1).all() and not pack.positions[r, pad].any()
    assert pack.unique_tokens == sum(len(ref.prefix_counts(
        [s for s, rr in zip(seqs, rows) if rr == r])) for r in range(P))
    assert pack.total_tokens == sum(len(s) for s in seqs)
    if used > 1:
        with pytest.raises(ValueError, match=f"need {used} prefix-tree rows.*num_rows={used - 1}"):
            pack_prefix_trees(seqs, L, num_rows=used - 1)


def test_pack_prefix_trees_examples_and_errors():
    # rows of 5: [1 2 4] joins [1 2 3] (4 slots), [7 8] does not fit (6 > 5): a new row;
    # [1 2 3 5] shares 3 tokens with row 0 and fills it; preorder 1 2 3 5 4
    pack = pack_prefix_trees([[1, 2, 3], [1, 2, 4], [7, 8], [1, 2, 3, 5]], 5)
    assert pack.tokens.tolist() == [[1, 2, 3, 5, 4], [7, 8, 0, 0, 0]]
    assert pack.ends.tolist() == [[5, 5, 4, 4, 5], [2, 2, 2, 3, 4]]
    assert pack.mult.tolist() == [[3, 3, 2, 1, 1], [1, 1, 0, 0, 0]]
    assert [i.tolist() for i in pack.index] == [[0, 1, 2], [0, 1, 4], [5, 6], [0, 1, 2, 3]]
    empty = pack_prefix_trees([], 4)
    assert empty.tokens.shape == (1, 4) and empty.ends.tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="sequence 1 has 4 tokens, more than the prefix-tree "
                                         "row length 3"):
        pack_prefix_trees([[1], [1, 2, 3, 4]], 3)
    with pytest.raises(ValueError, match="num_rows=1"):
        pack_prefix_trees([[1, 2, 3], [4, 5, 6]], 4, num_rows=1)


@settings(max_examples=100)
@given(pack_cases())
def test_tree_mask_is_the_ancestor_relation(case):
    seqs, L, extra = case
    pack = pack_prefix_trees(seqs, L, num_rows=max(ref.greedy_rows(seqs, L), default=0) + 1
                             + extra)
    mask = tree_mask(pack.ends)
    assert mask.shape == pack.ends.shape + (L,) and mask.dtype == bool
    for r in range(pack.ends.shape[0]):
        real = pack.mult[r] > 0
        want = np.zeros((L, L), bool)
        for i in np.flatnonzero(real):
            for j in ref.ancestors(pack.parents[r], i):
                want[i, j] = True
        np.testing.assert_array_equal(mask[r], want)
    np.testing.assert_array_equal(tree_mask(np.full(5, 5)), np.tril(np.ones((5, 5), bool)))


# ============================================================================ the model

T_SEQ, R_SEQ, L_TREE = 12, 6, 24  # sequences <= 12 tokens, 6 of them, tree rows of 24 slots


def _model(seed=0):
    return Transformer(MODEL, rngs=nnx.Rngs(seed))


def _forward_fn():
    """jitted (tokens, positions, key_ends) -> (logits, hidden, values) of the tiny model."""
    if "fwd" not in _CACHE:
        graphdef, state = nnx.split(_model())

        @jax.jit
        def fwd(tokens, positions, ends):
            out = nnx.merge(graphdef, state)(tokens, positions=positions, key_ends=ends)
            return out.logits, out.hidden.astype(jnp.float32), out.values

        _CACHE["fwd"] = fwd
    return _CACHE["fwd"]


@st.composite
def model_forests(draw):
    """R_SEQ sequences of 1..T_SEQ tokens from a random forest, in vocab [3, 9)."""
    seqs = [s for s in draw(token_forests(vocab=6, allow_empty=False)) if len(s) <= T_SEQ]
    seqs = [[t + 3 for t in s] for s in seqs][:R_SEQ]
    while len(seqs) < R_SEQ:  # top up with copies / prefixes of the sequences so far
        base = seqs[draw(st.integers(0, len(seqs) - 1))] if seqs else [3, 4, 5]
        seqs.append(base[:draw(st.integers(1, len(base)))])
    return seqs


def _packed(seqs):
    pack = pack_prefix_trees(seqs, L_TREE, num_rows=R_SEQ)
    return pack, (jnp.asarray(pack.tokens), jnp.asarray(pack.positions), jnp.asarray(pack.ends))


@settings(max_examples=15)
@given(model_forests())
def test_packed_trees_give_every_sequence_its_own_outputs(seqs):
    fwd = _forward_fn()
    pack, args = _packed(seqs)
    got = [np.asarray(x) for x in fwd(*args)]
    plain = np.zeros((R_SEQ, T_SEQ), np.int32)
    for r, s in enumerate(seqs):
        plain[r, :len(s)] = s
    want = [np.asarray(x) for x in fwd(jnp.asarray(plain), None, None)]
    for r, (s, idx) in enumerate(zip(seqs, pack.index)):
        for name, g, w in zip(("logits", "hidden", "values"), got, want):
            g = g.reshape((-1,) + g.shape[2:])[idx]
            np.testing.assert_allclose(g, w[r, :len(s)], **MODEL_TOL,
                                       err_msg=f"{name} of sequence {r}")
            _note(f"model {name} abs", float(np.abs(g - w[r, :len(s)]).max()))


def test_single_path_is_the_plain_sequence():
    fwd = _forward_fn()
    rng = np.random.default_rng(0)
    seq = rng.integers(3, 64, size=L_TREE)
    pack = pack_prefix_trees([seq], L_TREE, num_rows=R_SEQ)  # one row + 5 padding rows
    assert pack.ends[0].tolist() == [L_TREE] * L_TREE
    got = fwd(jnp.asarray(pack.tokens), jnp.asarray(pack.positions), jnp.asarray(pack.ends))
    want = fwd(jnp.asarray(np.broadcast_to(seq, (R_SEQ, L_TREE)), jnp.int32), None, None)
    for g, w in zip(got, want):  # the same mask, the same numbers
        np.testing.assert_array_equal(np.asarray(g)[0], np.asarray(w)[0])
    for g in got:  # padding rows attend to nothing, yet stay finite
        assert np.isfinite(np.asarray(g)).all()


@settings(max_examples=15)
@given(model_forests(), st.data())
def test_no_token_attends_outside_its_ancestors(seqs, data):
    fwd = _forward_fn()
    pack, (tok, pos, ends) = _packed(seqs)
    used = [np.flatnonzero(pack.mult[r] > 0) for r in range(R_SEQ)]
    r = data.draw(st.sampled_from([r for r in range(R_SEQ) if len(used[r])]))
    u = data.draw(st.sampled_from(used[r].tolist()))
    new_tok = data.draw(st.integers(9, 63))  # outside the forests' vocabulary [3, 9)
    base = [np.asarray(x) for x in fwd(tok, pos, ends)]
    moved = [np.asarray(x) for x in fwd(tok.at[r, u].set(new_tok), pos, ends)]
    # also fill every padding slot of every row with a token: nobody sees padding
    pad_tok = jnp.where(jnp.asarray(pack.mult) > 0, tok, 17)
    padded = [np.asarray(x) for x in fwd(pad_tok, pos, ends)]
    sub = set(range(u, int(pack.ends[r, u])))  # the nodes that have u as an ancestor
    for v in used[r]:
        for b, m in zip(base, moved):
            if v not in sub:
                np.testing.assert_array_equal(m[r, v], b[r, v], err_msg=f"node {v}, changed {u}")
    assert not np.array_equal(moved[0][r, u], base[0][r, u])  # the change is visible
    for q in range(R_SEQ):  # other rows never see row r
        if q != r:
            for b, m in zip(base, moved):
                np.testing.assert_array_equal(m[q], b[q])
        for b, p in zip(base, padded):
            np.testing.assert_array_equal(p[q, used[q]], b[q, used[q]])


def test_key_ends_with_a_cache_is_an_error():
    model = _model()
    cache = model.init_cache(1, 8)
    with pytest.raises(ValueError, match="key_ends"):
        model(jnp.ones((1, 2), jnp.int32), cache=cache, key_ends=jnp.full((1, 2), 2))


# ============================================================================ the train step

# Fixed padded shapes: hypothesis examples reuse one compile per layout.
T_ROW = 16
N_TRAJ = 32
PAD = {"per_step": {"num_traj": N_TRAJ, "num_turns": 2, "num_rows": 2 * N_TRAJ,
                    "row_len": T_ROW},
       "concatenated": {"num_traj": N_TRAJ, "num_turns": 2, "num_rows": N_TRAJ,
                        "row_len": T_ROW}}
TREE_LEN = 2 * T_ROW  # tree rows of 32 slots; rows_per_block = the block's rows (always fits)

GRPO = StepConfig(estimator="grpo", kl_coef=0.1, entropy_coef=0.01, micro_batches=2)
CONFIGS = {
    "per_step": {**{f"grpo_{m}": dataclasses.replace(GRPO, agg=m) for m in AGG_MODES},
                 "gae": StepConfig(estimator="gae", value_coef=0.5, micro_batches=2,
                                   estimator_params=(("gamma", 0.95), ("lam", 0.9)),
                                   agg="seq_mean_token_sum_norm"),
                 # log-probs of a tempered, truncated sampling distribution (tree gather too)
                 "grpo_tempered": dataclasses.replace(GRPO, temperature=0.7, top_k=5,
                                                      top_p=0.9)},
    "concatenated": {"turn_gae": StepConfig(estimator="turn_gae", value_coef=0.5,
                                            micro_batches=2, entropy_coef=0.01),
                     "grpo_traj": dataclasses.replace(GRPO, agg="traj_mean_token_mean")},
}
_OPT = optax.sgd(1.0, momentum=0.0)  # the trace is the gradient, the update minus it


def _tree_records(seed: int, n_groups: int, branch: int, turns: int, act_len: int, share: float,
                  layout: str) -> list:
    """Records whose trajectories form a tree per task group: a shared prompt; turn-0 actions of
    ``1..branch`` branches (siblings share a random part of the first sibling's action with
    probability ``share``); each branch stops, or forks again at turn 1 (observation + action),
    sometimes with a trajectory that stops at the fork (its rows are prefixes) and sometimes a
    duplicate (always one for a single path). The first two trajectories of a group have
    different outcomes, so no update is skipped for want of signal. At most 4 trajectories per group (whole groups fit a shard block). per_step rows
    carry the history in their observation (as ``history: full`` prompts), so a turn-0 row is a
    prefix of its turn-1 rows."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(3, 10, size=n).tolist()  # noqa: E731 - small: accidental sharing

    def grow(base):  # a sibling: a random part of ``base`` then fresh tokens
        keep = int(rng.integers(0, len(base) + 1)) if base and rng.random() < share else 0
        fresh = int(rng.integers(1 if keep == 0 else 0, act_len - keep + 1))
        return base[:keep] + tok(fresh)

    recs = []
    for g in range(n_groups):
        prompt = tok(int(rng.integers(1, 5)))
        paths = []  # [(obs, act)], ...
        first0 = []
        for _ in range(int(rng.integers(1, branch + 1))):
            a0 = grow(first0)
            first0 = first0 or a0
            kids = int(rng.integers(0, branch + 1)) if turns > 1 else 0
            if kids == 0 or rng.random() < 0.3:
                paths.append([(prompt, a0)])
            obs1, first1 = tok(int(rng.integers(1, 3))), []
            for _ in range(kids):
                o1 = obs1 if rng.random() < share else tok(int(rng.integers(1, 3)))
                a1 = grow(first1)
                first1 = first1 or a1
                paths.append([(prompt, a0), (o1, a1)])
        if rng.random() < 0.3 or len(paths) == 1:  # a duplicate (every group has two members)
            paths.append(list(paths[int(rng.integers(len(paths)))]))
        first_outcome = None
        for p in paths[:4]:
            turns_out, hist = [], []
            for obs, act in p:
                o = hist + obs if layout == "per_step" else obs
                turns_out.append({"observation": list(o), "action": list(act),
                                  "logprobs": (-0.1 - rng.random(len(act))).tolist()})
                hist = hist + obs + act
            outcome = float(rng.random() < 0.5)
            if first_outcome is None:
                first_outcome = outcome
            elif len([r for r in recs if r["group"] == f"g{g}"]) == 1:
                outcome = 1.0 - first_outcome  # mixed outcomes: GRPO's advantages are not all 0
            recs.append({"group": f"g{g}", "outcome": outcome, "turns": turns_out})
    return recs


@st.composite
def step_cases(draw):
    return dict(seed=draw(st.integers(0, 2 ** 16)), n_groups=draw(st.integers(1, 4)),
                branch=draw(st.integers(1, 3)), turns=draw(st.integers(1, 2)),
                act_len=draw(st.integers(1, 3)), share=draw(st.sampled_from([0.0, 0.5, 1.0])))


def _flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    return {jax.tree_util.keystr(p, simple=True, separator="."):
            np.asarray(v.get_value() if isinstance(v, nnx.Variable) else v) for p, v in leaves}


def _state():
    """The policy (seed 0) with a different reference policy (seed 1): a live KL term."""
    if "state" not in _CACHE:
        model = _model()
        state = init_state(model, _OPT, seed=0, with_reference=True)
        state = state.replace(ref_params=nnx.state(_model(seed=1), nnx.Param))
        _CACHE["state"] = (model, state)
    return _CACHE["state"]


def _multi_step(layout: str):
    """One jitted function running every configuration of ``CONFIGS[layout]`` on one batch
    (one compile per batch shape instead of one per configuration): {name: (metrics, grads)}."""
    key = ("multi", layout)
    if key not in _CACHE:
        model, _ = _state()
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)

        @jax.jit
        def run(state, batch):
            out = {}
            for name, cfg in CONFIGS[layout].items():
                new, o = train_step(graphdef, rest, _OPT, cfg, state, batch)
                out[name] = (o["metrics"], new.opt_state[0].trace, new.params)
            return out

        _CACHE[key] = run
    return _CACHE[key]


def _run(layout: str, batch):
    _, state = _state()
    out = jax.device_get(_multi_step(layout)(state, batch))
    p0 = _flat(state.params)
    res = {}
    for name, (metrics, grads, params) in out.items():
        grads, params = _flat(grads), _flat(params)
        for k in grads:  # sgd(1): the update is minus the gradient
            np.testing.assert_allclose(p0[k] - params[k], grads[k], atol=2e-7, err_msg=k)
        res[name] = ({k: float(v) for k, v in metrics.items()}, grads)
    return res


def _pack(recs, layout, blocks):
    batch, _ = pack_records(recs, layout=layout, num_shards=blocks, pad_to=PAD[layout])
    tb, stats = attach_prefix_trees(batch, num_blocks=blocks, row_len=TREE_LEN,
                                    rows_per_block=batch.num_rows // blocks)
    return batch, tb, stats


def _used(got, want, tol):
    """The largest fraction of the tolerance used: |got - want| / (atol + rtol |want|)."""
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))
                        / (tol["atol"] + tol["rtol"] * np.abs(np.asarray(want)))))


def _note(kind, value):
    _MAX_DIFF[kind] = max(_MAX_DIFF.get(kind, 0.0), value)


def _assert_same(got, want, name):
    (mg, gg), (mw, gw) = got, want
    assert mg.keys() == mw.keys()
    assert mw["update_skipped"] == mg["update_skipped"] == 0.0, name
    for k in mw:
        tol = ADV_TOL if k.startswith("adv_") else LOSS_TOL
        np.testing.assert_allclose(mg[k], mw[k], **tol, err_msg=f"{name}: {k}")
        kind = "adv" if k.startswith("adv_") else "loss"
        _note(f"{kind} abs", abs(mg[k] - mw[k]))
        _note(f"{kind} tol used", _used(mg[k], mw[k], tol))
    assert gg.keys() == gw.keys()
    for k in gw:
        np.testing.assert_allclose(gg[k], gw[k], **GRAD_TOL, err_msg=f"{name}: grad {k}")
        _note("grad abs", float(np.abs(gg[k] - gw[k]).max()))
        _note("grad tol used", _used(gg[k], gw[k], GRAD_TOL))


def _check_live(res, layout):
    """The terms under test are not trivially zero."""
    for name, (m, g) in res.items():
        assert m["loss"] != 0.0, name
        assert max(float(np.abs(x).max()) for x in g.values()) > 1e-5, name
        if CONFIGS[layout][name].needs_values:
            assert m["loss_value"] > 0 and float(np.abs(g["value_head.kernel"]).max()) > 1e-6


@pytest.mark.parametrize("layout", ["per_step", "concatenated"])
@settings(max_examples=10)
@given(case=step_cases())
def test_tree_step_equals_unpacked_step(layout, case):
    recs = _tree_records(**case, layout=layout)
    batch, tb, stats = _pack(recs, layout, blocks=2)
    assert stats["unique_tokens"] <= stats["total_tokens"]
    want, got = _run(layout, batch), _run(layout, tb)
    _check_live(want, layout)
    for name in want:
        _assert_same(got[name], want[name], f"{layout}/{name}")


def test_tree_step_shares_prefixes():
    """The fixed case of the sharded test actually shares tokens in both layouts."""
    for layout in PAD:
        recs = _tree_records(seed=3, n_groups=8, branch=2, turns=2, act_len=3, share=0.5,
                             layout=layout)
        _, _, stats = _pack(recs, layout, blocks=2)
        assert stats["total_tokens"] > 1.3 * stats["unique_tokens"], (layout, stats)


def test_sharded_tree_step_equals_unsharded_unpacked_step():
    """DP2 x FSDP2 x TP2: the trees are packed per block (data_shards 4 x micro-batches 2)."""
    layout, name = "per_step", "grpo_seq_mean_token_mean"
    recs = _tree_records(seed=3, n_groups=8, branch=2, turns=2, act_len=3, share=0.5,
                         layout=layout)
    batch, _, _ = _pack(recs, layout, blocks=2)
    want = _run(layout, batch)[name]
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    cfg = dataclasses.replace(CONFIGS[layout][name], data_shards=4)
    _, tb, stats = _pack(recs, layout, blocks=8)
    assert stats["rows"] == tb.extras["tree_tokens"].shape[0] == 2 * N_TRAJ
    model, state = _state()
    sh = sharding.train_state_shardings(state, _OPT, mesh)
    state = jax.device_put(state, sh)
    fn = make_train_step(model, _OPT, cfg, mesh=mesh, state_shardings=sh)
    new, out = fn(state, jax.device_put(tb, sharding.batch_sharding(mesh)))
    got = ({k: float(v) for k, v in jax.device_get(out["metrics"]).items()},
           _flat(jax.device_get(new.opt_state[0].trace)))
    _assert_same(got, want, "sharded")

    assert new.params["lm_head"]["kernel"].get_value().sharding.spec == \
        state.params["lm_head"]["kernel"].get_value().sharding.spec


# ============================================================================ attach / errors

@pytest.mark.parametrize("attn_cost", [0.0, "model", 1.0])
def test_attach_prefix_trees_layout(attn_cost):
    """Default row length / row count by the cost model (0: fewest slots; 1.0: attention
    dominates -> the plain row length; the tiny model's own cost),
    and every row read back through ``tree_index`` from its block's trees."""
    if attn_cost == "model":
        attn_cost = attention_cost(MODEL)
        assert 0 < attn_cost < 1
    recs = _tree_records(seed=0, n_groups=4, branch=3, turns=2, act_len=3, share=0.5,
                         layout="concatenated")
    batch, _ = pack_records(recs, layout="concatenated", num_shards=2,
                            pad_to=PAD["concatenated"])
    lengths = row_lengths(batch)
    tokens = np.asarray(batch.tokens)
    r_blk = batch.num_rows // 2
    seqs = [tokens[r, :lengths[r]] for r in range(batch.num_rows)]
    # auto_tree_len: T * 2^k for the smallest k such that the largest group's tree fits (<= 8 T)
    group = np.asarray(batch.group_ids)[np.asarray(batch.row_traj)]
    largest = max(len(ref.prefix_counts([s for s, gr in zip(seqs, group) if gr == g]))
                  for g in set(group[lengths > 0].tolist()))
    top = T_ROW
    while top < min(largest, 8 * T_ROW):
        top *= 2
    assert auto_tree_len(batch) == top > T_ROW  # a group's tree is longer than one row
    # the row length and row count of the cost model
    tb, stats = attach_prefix_trees(batch, num_blocks=2, attn_cost=attn_cost)
    L, P = ref.auto_row_len([seqs[:r_blk], seqs[r_blk:]], T_ROW, top, attn_cost, largest)
    assert (stats["row_len"], stats["rows"]) == (L, 2 * P)
    if attn_cost == 1.0:
        assert L == T_ROW
    ex = tb.extras
    assert ex["tree_index"].shape == batch.tokens.shape
    for k in ("tree_tokens", "tree_positions", "tree_ends"):
        assert ex[k].shape == (2 * P, L)
    for r in range(batch.num_rows):
        b = r // r_blk
        idx = ex["tree_index"][r, :lengths[r]]
        assert ((idx >= 0) & (idx < P * L)).all()
        blk = ex["tree_tokens"][b * P:(b + 1) * P].reshape(-1)
        np.testing.assert_array_equal(blk[idx], tokens[r, :lengths[r]])
        pos = ex["tree_positions"][b * P:(b + 1) * P].reshape(-1)
        np.testing.assert_array_equal(pos[idx], np.arange(lengths[r]))
    assert stats["total_tokens"] == int(lengths.sum())
    assert stats["unique_tokens"] == sum(len(ref.prefix_counts(
        [seqs[r] for r in range(b * r_blk, (b + 1) * r_blk) if rows[r] == q]))
        for b in range(2) for rows in [dict(enumerate(
            ref.greedy_rows(seqs[b * r_blk:(b + 1) * r_blk], L), start=b * r_blk))]
        for q in range(P)) < stats["total_tokens"]
    assert tb.tokens is batch.tokens


def test_attach_prefix_trees_errors():
    recs = _tree_records(seed=1, n_groups=2, branch=2, turns=2, act_len=3, share=0.5,
                         layout="per_step")
    batch, _ = pack_records(recs, layout="per_step", num_shards=2, pad_to=PAD["per_step"])
    seg = batch.replace(extras={**batch.extras, "segment_ids": np.ones_like(batch.tokens)})
    with pytest.raises(ValueError, match="segment_ids"):
        attach_prefix_trees(seg, num_blocks=2)
    longest = int(row_lengths(batch).max())
    # trainer.prefix_tree_len is a minimum: a longer row widens the packing, never stops a run
    _, stats = attach_prefix_trees(batch, num_blocks=2, row_len=longest - 1)
    assert stats["row_len"] == longest
    with pytest.raises(ValueError, match="num_blocks=5"):
        attach_prefix_trees(batch, num_blocks=5)
    with pytest.raises(ValueError, match="rows_per_block=1"):
        attach_prefix_trees(batch, num_blocks=2, row_len=longest, rows_per_block=1)


def test_partial_tree_extras_are_refused_by_the_step():
    recs = _tree_records(seed=1, n_groups=2, branch=2, turns=1, act_len=2, share=0.5,
                         layout="per_step")
    batch, tb, _ = _pack(recs, "per_step", blocks=2)
    model, state = _state()
    fn = make_train_step(model, _OPT, StepConfig())
    for drop in TREE_KEYS:
        part = tb.replace(extras={k: v for k, v in tb.extras.items() if k != drop})
        with pytest.raises(ValueError, match="prefix-tree extras must come together"):
            fn(state, part)
    _, tb1, _ = _pack(recs, "per_step", blocks=1)  # packed for another block count
    with pytest.raises(ValueError, match="packed in 1 blocks.*num_blocks=2"):
        make_train_step(model, _OPT, StepConfig(micro_batches=2))(state, tb1)


# ============================================================================ the loop

@pytest.mark.slow
def test_trainer_with_prefix_sharing(tmp_path):
    from jaxrl_agent.train import loop
    from jaxrl_agent.train.metrics import read_metrics
    from tests.test_train import tiny_config

    rows = {}
    for shared in (True, False):
        d = tmp_path / str(shared)
        cfg = tiny_config(d, "trainer.steps=1", "trainer.micro_batches=2",
                          f"trainer.prefix_sharing={str(shared).lower()}")
        summary = loop.Trainer(cfg, progress=False).run()
        assert summary.steps == 1
        rows[shared] = read_metrics(d / "metrics" / "metrics.jsonl")[1]
    on, off = rows[True], rows[False]
    assert on["train/prefix_tokens_ratio"] > 1.0 and on["train/update_skipped"] == 0
    assert "train/prefix_tokens_ratio" not in off
    for k in ("train/loss", "train/loss_policy", "train/grad_norm"):
        if k in off:
            np.testing.assert_allclose(on[k], off[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert on["train/reward"] == off["train/reward"]
