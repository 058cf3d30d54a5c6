"""Families (d), (e), (f) as a user runs them: every registered shaping, re-allocation and
distillation name from the command line on examples/signal_rollouts.jsonl (composed with a
base estimator by kind), the example file in sync with its generator, composition of several
stages, and the reduction of the PBRS invariance through the whole pipeline.

Each method's references, properties, padding and shard invariance are in its own module
(test_shaping, test_allocation, test_routing, test_distill).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxrl_agent import cli
from jaxrl_agent import estimators as E
from jaxrl_agent.rollout.records import pack_records
from tests.signals import NOT_FROM_RECORDS, family_names, signal_records

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "signal_rollouts.jsonl"


def _argv(name):
    kind = E.spec(name).kind
    if kind == "shaping":
        return ["--shaping", name, "--estimator", "grpo"]
    if kind == "transform":
        return ["--estimator", "grpo", "--then", name]
    return ["--estimator", name]


def test_example_matches_its_generator(tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("gen", ROOT / "examples" /
                                                  "make_signal_rollouts.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    out = tmp_path / "s.jsonl"
    gen.main(str(out))
    assert out.read_text() == EXAMPLE.read_text(), "regenerate examples/signal_rollouts.jsonl"


def _one_per_module_and_kind(names):
    """The first name of every (defining module, kind): the command line's plumbing differs
    by kind only; every name runs on these records in tests/test_conformance.py."""
    firsts = {}
    for name in sorted(names):
        spec = E.spec(name)
        firsts.setdefault((spec.origin, spec.kind), name)
    return sorted(firsts.values())


def test_each_family_kind_runs_from_the_command_line(tmp_path, capsys):
    names = family_names()
    assert len(names) >= 50
    ran = []
    for name in _one_per_module_and_kind(set(names) - set(NOT_FROM_RECORDS)):
        out = tmp_path / f"{name}.jsonl"
        rc = cli.main(["credit", str(EXAMPLE), *_argv(name), "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 0, (name, err)
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(rows) == 16
        assert all(np.isfinite(c) for r in rows for c in r["turn_credit"]), name
        ran.append(name)
    assert len({E.spec(n).kind for n in ran}) == 3, ran


def test_not_from_records_names_fail_clearly(tmp_path, capsys):
    for name in NOT_FROM_RECORDS:
        rc = cli.main(["credit", str(EXAMPLE), *_argv(name), "--out", str(tmp_path / "o.jsonl")])
        assert rc == 2 and "needs extras" in capsys.readouterr().err


def test_shaping_then_estimator_then_transforms():
    """pbrs -> returns -> cort -> reallocate(level=turn): each stage sees the previous output."""
    b, _ = pack_records(signal_records(seed=1), layout="per_step")
    shaped = E.get("pbrs")(b)
    base = E.get("returns")(shaped)
    want = E.get("reallocate")(E.get("cort")(base, shaped), shaped, weights="weights",
                               level="turn")
    got = E.compute("returns", b, shaping=["pbrs"],
                    then=["cort", ("reallocate", {"weights": "weights", "level": "turn"})])
    np.testing.assert_allclose(np.asarray(got.token), np.asarray(want.token), rtol=1e-5,
                               atol=1e-6)


def test_pbrs_leaves_grpo_unchanged_when_groups_share_the_start():
    """Phi(terminal) = 0 and gamma = 1: every return moves by -Phi(s_0); with the same s_0 in
    a group, GRPO's advantages do not move (METHODS.md family (d))."""
    recs = signal_records(seed=2)
    for r in recs:
        r["traj_extras"]["final_potential"] = 0.0
        r["turns"][0]["turn_extras"]["potential"] = {"task0": 0.3, "task1": -1.0, "task2": 2.0,
                                                     "task3": 0.0}[r["group"]]
    b, _ = pack_records(recs)
    plain = E.compute("grpo", b)
    shaped = E.compute("grpo", b, shaping=[("pbrs", {"to_outcome": True})])
    np.testing.assert_allclose(np.asarray(shaped.token), np.asarray(plain.token), atol=2e-5)
    same = E.compute("grpo", b, shaping=[("pbrs", {"to_outcome": True, "gamma": 0.5})])
    np.testing.assert_allclose(np.asarray(same.token), np.asarray(plain.token), atol=2e-5)
    # a final potential that differs between members does move them
    for i, r in enumerate(recs):
        r["traj_extras"]["final_potential"] = float(i % 3)
    b, _ = pack_records(recs)
    moved = E.compute("grpo", b, shaping=[("pbrs", {"to_outcome": True})])
    assert not np.allclose(np.asarray(moved.token), np.asarray(plain.token), atol=1e-3)


@pytest.mark.parametrize("name", ["trial", "cort", "iapo", "stamp"])
def test_reallocations_conserve_grpo_mass_on_the_example(name):
    b, index = pack_records(signal_records(seed=3))
    base = E.compute("grpo", b)
    out = E.compute("grpo", b, then=[name])
    m = np.asarray(b.action_mask)
    for i in index.traj:
        s0 = np.asarray(base.token)[i][m[i]].sum()
        s1 = np.asarray(out.token)[i][m[i]].sum()
        if name == "trial":  # an add-on: mass moves, signs of the base may flip
            continue
        assert abs(s1 - s0) <= 1e-4 * max(1.0, abs(s0)), (name, i, s0, s1)
