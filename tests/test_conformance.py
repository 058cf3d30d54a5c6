"""The conformance battery, run over every row of ``tests/conformance.py`` (every registered
credit method of the package, each in its settings) in one jitted program per batch shape:

* every registered name has a row (and a reference, compared in its family's module);
* jit equals eager (eager on a batch whose padding holds NaN);
* padding invariance: more padded trajectories, turns, rows and tokens, holding NaN, change
  nothing, and every output (credit and value targets: ``token``, ``turn``,
  ``token_returns``, ``turn_returns``) is exactly 0 on padding;
* group-permutation equivariance: reordering the records (and so the groups and their
  members) moves each record's credit with it;
* shard invariance: on 4 host devices, whole groups per shard, under ``shard_map`` with
  ``axis_name``, the same credit as on one device (per-step layout);
* degenerate batches (every group a singleton; every group's rollouts scoring alike; rows of
  padding only; a batch of padding only): finite credit, 0 on padding;
* finite gradients of the credit with respect to every float input, and none at all with
  respect to a learned signal (``GRADIENT_INPUTS`` lists the inputs that may carry one).

Shaping stages run before ``grpo``, transforms after it.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_agent import estimators as E
from jaxrl_agent import registry
from jaxrl_agent.batch import LAYOUTS
from jaxrl_agent.rollout.records import UnknownFieldWarning, pack_records
from tests.conformance import ROWS, conformance_records, with_negatives
from tests.reference.all_refs import REFERENCES

TASKS = 8  # SPO trackers' size (task ids of the records are < 4)
PAD = {"concatenated": {"num_traj": 16, "num_turns": 4, "row_len": 32},
       "per_step": {"num_traj": 16, "num_turns": 4, "num_rows": 64, "row_len": 16}}
BIG = {"concatenated": {"num_traj": 24, "num_turns": 6, "row_len": 40},
       "per_step": {"num_traj": 24, "num_turns": 6, "num_rows": 96, "row_len": 20}}
SHARDS = 4


def _pipeline(name, hp):
    kind = E.spec(name).kind
    if kind == "shaping":
        return E.Pipeline.build("grpo", shaping=[(name, hp)])
    if kind == "transform":
        return E.Pipeline.build("grpo", then=[(name, hp)])
    return E.Pipeline.build(name, hp)


CASES = [(f"{name}#{i}", _pipeline(name, hp)) for name, row in sorted(ROWS.items())
         for i, hp in enumerate(row.settings)]


def run_all(batch, axis_name=None):
    """{case: (token [R, T], turn [N, K], token_returns [R, T], turn_returns [N, K])} of every
    case (0 where the method has no such output)."""
    out = {}
    for key, pipe in CASES:
        adv, _ = pipe.apply(batch, pipe.init(TASKS), axis_name=axis_name)
        tz, kz = jnp.zeros(batch.action_mask.shape), jnp.zeros(batch.turn_mask.shape)
        out[key] = (adv.token, kz if adv.turn is None else adv.turn,
                    tz if adv.token_returns is None else adv.token_returns,
                    kz if adv.turn_returns is None else adv.turn_returns)
    return out


run_all_jit = jax.jit(run_all)


def pack(records, layout, pad=None, num_shards=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownFieldWarning)
        batch, index = pack_records(records, layout=layout, pad_to=pad or PAD[layout],
                                    num_shards=num_shards)
    return with_negatives(batch), index


FIELDS = ("token", "turn", "token_returns", "turn_returns")


def per_record(out, index):
    """{case: [(values of each field of FIELDS: a turn field's values of the record's turns,
    a token field's values of its action tokens in order) per record]}."""
    res = {}
    for key, arrays in out.items():
        arrays = [np.asarray(x) for x in arrays]
        res[key] = [tuple(np.concatenate([x[r, s:e] for r, s, e in sp]) if f.startswith("token")
                          else x[index.traj[i], :len(sp)] for f, x in zip(FIELDS, arrays))
                    for i, sp in enumerate(index.spans)]
    return res


def assert_same(a, b, what, order=None, rtol=2e-4, atol=2e-5):
    bad = []
    for key in a:
        for i, fields in enumerate(a[key]):
            j = i if order is None else order[i]
            for x, y, f in zip(fields, b[key][j], FIELDS):
                if x.shape != y.shape or not np.allclose(x, y, rtol=rtol, atol=atol):
                    bad.append(f"{key} record {i} {f}: {x} vs {y}")
                    break
    assert not bad, f"{what}: {len(bad)} differences, e.g.\n" + "\n".join(bad[:5])


def assert_padding_zero(out, batch, what):
    am, tm = np.asarray(batch.action_mask), np.asarray(batch.turn_mask)
    for key, arrays in out.items():
        for f, x in zip(FIELDS, arrays):
            x, mask = np.asarray(x), am if f.startswith("token") else tm
            assert np.all(np.isfinite(x)), f"{what} {key}: {f} not finite"
            assert np.all(x[~mask] == 0), f"{what} {key}: {f} nonzero on padding"


@pytest.fixture(scope="module", params=LAYOUTS)
def base(request):
    layout = request.param
    recs = conformance_records(seed=0)
    batch, index = pack(recs, layout)
    return layout, recs, batch, index, jax.tree.map(np.asarray, run_all_jit(batch))


# ----------------------------------------------------------------------------- the table


def test_every_registered_name_has_a_row():
    package = {e.name for kind in E.KINDS for e in registry.entries(kind)
               if e.origin.startswith("jaxrl_agent.")}
    assert package - set(ROWS) == set(), "registered without a conformance row"
    assert set(ROWS) - package == set(), "rows of names that are not registered"
    for name, row in ROWS.items():
        assert REFERENCES.get(name) is row.reference, f"{name}: reference not compared"
        assert row.settings and all(isinstance(hp, dict) for hp in row.settings)
        assert row.order_free or row.why_not_order_free, name
        for hp in row.settings:
            E.check_hyper_params(name, hp)


# ----------------------------------------------------------------------------- the battery


def test_every_case_gives_credit_zero_on_padding(base):
    layout, _, batch, _, out = base
    assert_padding_zero(out, batch, layout)
    silent = [k for k, (tok, *_) in out.items() if not np.any(tok)]
    assert not silent, f"no credit at all on the conformance batch: {silent}"


def test_jit_equals_eager(base):
    layout, _, batch, index, out = base
    if layout != "per_step":
        pytest.skip("one layout is enough: eager runs op by op (slow), the code is the same")
    with jax.disable_jit():  # on NaN padding: eager code has no select to hide a NaN * 0
        eager = run_all(nan_padding(batch))
    assert_same(per_record(out, index), per_record(eager, index), f"eager {layout}")


def nan_padding(batch):
    """Every float entry outside its mask set to NaN (the contract: padding may hold anything);
    ``batch.validate`` accepts it."""
    masks = {"token": np.asarray(batch.action_mask), "turn": np.asarray(batch.turn_mask),
             "traj": np.asarray(batch.traj_mask)}

    def dirty(x, level):
        x = np.asarray(x)
        if level is None or not np.issubdtype(x.dtype, np.floating):
            return x
        m = masks[level]
        return np.where(m.reshape(m.shape + (1,) * (x.ndim - m.ndim)), x, np.nan).astype(x.dtype)

    out = batch.replace(old_logprobs=dirty(batch.old_logprobs, "token"),
                        turn_rewards=dirty(batch.turn_rewards, "turn"),
                        outcome=dirty(batch.outcome, "traj"),
                        extras={k: dirty(v, batch.extra_level(k, np.shape(v)))
                                for k, v in batch.extras.items()})
    return out.validate()


def test_padding_invariance(base):
    """More padding, holding NaN in every float entry, changes nothing."""
    layout, recs, _, index, out = base
    if layout != "per_step":
        pytest.skip("per_step pads every axis (trajectories, turns, rows, tokens): enough")
    big, big_index = pack(recs, layout, BIG[layout])
    big = nan_padding(big)
    assert np.isnan(np.asarray(big.outcome)).any() and np.isnan(np.asarray(big.old_logprobs)).any()
    big_out = jax.tree.map(np.asarray, run_all_jit(big))
    assert_padding_zero(big_out, big, f"padded {layout}")
    assert_same(per_record(out, index), per_record(big_out, big_index), f"padded {layout}")


def test_group_permutation_equivariance(base):
    layout, recs, _, index, out = base
    order = np.random.default_rng(3).permutation(len(recs))
    shuffled = [recs[i] for i in order]
    s_batch, s_index = pack(shuffled, layout)
    s_out = jax.tree.map(np.asarray, run_all_jit(s_batch))
    where = {int(i): j for j, i in enumerate(order)}  # record i of recs sits at where[i]
    keep = {k for k in out if ROWS[k.split("#")[0]].order_free}
    a = {k: v for k, v in per_record(out, index).items() if k in keep}
    b = {k: v for k, v in per_record(s_out, s_index).items() if k in keep}
    assert_same(a, b, f"permuted {layout}", order=[where[i] for i in range(len(recs))])


def test_shard_invariance(base):
    layout, recs, _, _, _ = base
    if layout != "per_step":
        pytest.skip("per_step is enough: its shard blocks hold several rows per trajectory, so "
                    "row and trajectory offsets differ (concatenated: one row each)")
    mesh = Mesh(np.array(jax.devices()[:SHARDS]), ("data",))
    batch, index = pack(recs, layout, num_shards=SHARDS)
    sharded = jax.jit(jax.shard_map(functools.partial(run_all, axis_name="data"), mesh=mesh,
                                    in_specs=(P("data"),), out_specs=P("data")))
    got = per_record(jax.tree.map(np.asarray, sharded(batch)), index)
    want = per_record(jax.tree.map(np.asarray, run_all_jit(batch)), index)
    assert_same(want, got, f"{SHARDS} shards {layout}")


def _degenerate(recs, how):
    if how == "all_padding":
        return recs
    out = []
    for i, r in enumerate(recs):
        r = dict(r)
        if how == "singleton":
            r["group"] = r["task"] = f"solo{i}"
        else:  # every rollout of a task scores alike
            r["outcome"] = float(int(r["group"][-1]) % 2)
        out.append(r)
    return out


@pytest.mark.parametrize("how", ["singleton", "equal", "all_padding"])
def test_degenerate_batches_give_finite_credit(base, how):
    layout, recs, _, _, _ = base
    batch, _ = pack(_degenerate(recs[:12], how), layout)  # 4 trajectories of padding
    if how == "all_padding":  # every row, turn and trajectory padding: credit exactly 0
        batch = batch.replace(traj_mask=np.zeros_like(batch.traj_mask),
                              turn_mask=np.zeros_like(batch.turn_mask),
                              action_mask=np.zeros_like(batch.action_mask),
                              turn_ids=np.full_like(batch.turn_ids, -1))
    out = jax.tree.map(np.asarray, run_all_jit(batch))
    assert_padding_zero(out, batch, f"{how} {layout}")


#: the float inputs credit may pass gradient to: rewards, the behaviour and reference log-probs
#: (KL-in-reward) and the critic's values, the data of the formulas (as in rlax, stopping their
#: gradient is the caller's choice). Every other float extra is a learned signal (a teacher's
#: or reward model's log-probs, entropies, probe scores, potentials), read with
#: ``checks.read_field(..., stop_gradient=True)``.
GRADIENT_INPUTS = {"outcome", "turn_rewards", "old_logprobs", "ref_logprobs", "token_values",
                   "turn_values", "high_values"}


def test_gradients_are_finite(base):
    layout, recs, _, _, _ = base
    if layout != "per_step":
        pytest.skip("one layout is enough: the same estimator code runs on both")
    batch, _ = pack(_degenerate(recs[:12], "equal"), layout)
    batch = jax.tree.map(jnp.asarray, batch)
    floats = {k: v for k, v in batch.extras.items() if jnp.issubdtype(v.dtype, jnp.floating)}
    inputs = dict(outcome=batch.outcome, turn_rewards=batch.turn_rewards,
                  old_logprobs=batch.old_logprobs, extras=floats)

    def totals(x):
        b = batch.replace(outcome=x["outcome"], turn_rewards=x["turn_rewards"],
                          old_logprobs=x["old_logprobs"], extras={**batch.extras,
                                                                   **x["extras"]})
        return {k: jnp.sum(tok ** 2) + jnp.sum(turn ** 2)
                for k, (tok, turn, *_) in run_all(b).items()}

    # one backward pass through every case (a NaN anywhere makes the sum's gradient NaN);
    # only when it is not finite, one per case to name the culprits
    grad = jax.jit(jax.grad(lambda x: sum(totals(x).values())))(inputs)
    leaked = sorted(k for k, g in grad["extras"].items()
                    if k not in GRADIENT_INPUTS and np.any(np.asarray(g) != 0))
    assert not leaked, f"credit passes gradient to learned signals: {leaked}"
    assert set(floats) - GRADIENT_INPUTS, "no learned signal among the batch's extras"
    if all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grad)):
        return
    bad = [k for k, _ in CASES if not all(
        np.all(np.isfinite(np.asarray(g)))
        for g in jax.tree.leaves(jax.jit(jax.grad(lambda x, k=k: totals(x)[k]))(inputs)))]
    assert not bad, f"non-finite gradients: {bad}"
