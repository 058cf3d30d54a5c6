"""`jaxrl-agent credit` and `jaxrl-agent estimators`, run as a user runs them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl_agent import estimators
from jaxrl_agent.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rollouts.jsonl"
EXAMPLE_VALUES = ROOT / "examples" / "rollouts_with_values.jsonl"
EXAMPLE_STEPS = ROOT / "examples" / "gridworld_steps.jsonl"


def run(argv, capsys):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_grpo_on_example(tmp_path, capsys):
    out_path = tmp_path / "credit.jsonl"
    rc, out, err = run(["credit", EXAMPLE, "--estimator", "grpo", "--out", out_path], capsys)
    assert rc == 0, err
    rows = read_jsonl(out_path)
    records = read_jsonl(EXAMPLE)
    assert len(rows) == len(records)
    for i, (row, rec) in enumerate(zip(rows, records)):
        assert row["record"] == i and row["group"] == rec["group"]
        assert len(row["turn_credit"]) == len(rec["turns"])
        assert [len(t) for t in row["token_credit"]] == [len(t["action"]) for t in rec["turns"]]
        # GRPO is one value per trajectory
        assert len({round(c, 5) for c in row["turn_credit"]}) == 1
    # zero-sum within each group (P1)
    by_group = {}
    for row in rows:
        by_group.setdefault(row["group"], []).append(row["turn_credit"][0])
    for credits in by_group.values():
        assert abs(sum(credits)) < 1e-4
    assert "mean credit" in out and "positive" in out
    assert out.splitlines()[1].split()[0] == "0"  # the table starts at turn 0


def test_gae_without_values_names_the_missing_field(tmp_path, capsys):
    out_path = tmp_path / "credit.jsonl"
    rc, _, err = run(["credit", EXAMPLE, "--estimator", "gae", "--out", out_path], capsys)
    assert rc == 2
    assert "token_values" in err and "turn_values" in err and "'value'" in err
    assert not out_path.exists()


@pytest.mark.parametrize("name", ["gae", "turn_gae", "lambda_returns"])
def test_value_estimators_with_values(tmp_path, capsys, name):
    out_path = tmp_path / "credit.jsonl"
    rc, _, err = run(["credit", EXAMPLE_VALUES, "--estimator", name, "--set", "gamma=0.9",
                      "--set", "lam=0.95", "--out", out_path], capsys)
    assert rc == 0, err
    rows = read_jsonl(out_path)
    assert all(np.isfinite(c) for r in rows for c in r["turn_credit"])
    assert "turn_returns" in rows[0] or "token_returns" in rows[0]


def test_an_estimator_of_each_module_runs_on_the_examples(tmp_path, capsys):
    """One estimator per module on the example files (every name runs on signal records in
    tests/test_conformance.py; the command line's path is the same for all)."""
    from tests.reference.all_refs import OWN_MODULE
    from tests.signals import family_names
    firsts = {}
    for name in sorted(set(estimators.names()) - set(family_names())):  # those: test_families
        firsts.setdefault(estimators.spec(name).origin, name)
    firsts.update(turn_gae="turn_gae", spo="spo")  # a critic on values; a stateful one
    for name in sorted(set(firsts.values())):
        src = EXAMPLE_VALUES if name in ("gae", "turn_gae", "lambda_returns", "sapo") else EXAMPLE
        if name in OWN_MODULE:  # step-level: states recur; HAE/BiPACE read extras
            src = EXAMPLE_STEPS
        rc, _, err = run(["credit", src, "--estimator", name, "--out", tmp_path / f"{name}.jsonl"],
                         capsys)
        assert rc == 0, (name, err)


def test_layouts_agree(tmp_path, capsys):
    for name in ("grpo", "turn_gae", "reinforce_pp"):
        got = {}
        for layout in ("concatenated", "per_step"):
            out_path = tmp_path / f"{layout}.jsonl"
            rc, _, err = run(["credit", EXAMPLE_VALUES, "--estimator", name, "--layout", layout,
                              "--out", out_path], capsys)
            assert rc == 0, err
            got[layout] = read_jsonl(out_path)
        for a, b in zip(got["concatenated"], got["per_step"]):
            np.testing.assert_allclose(a["turn_credit"], b["turn_credit"], atol=1e-5)


def _write(tmp_path, lines):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"group": 0, "outcome": 1.0, "turns": [{"observation": [1], "action": [2]}]})


def test_malformed_json_reports_line_and_writes_nothing(tmp_path, capsys):
    out_path = tmp_path / "credit.jsonl"
    out_path.write_text("previous result\n")
    src = _write(tmp_path, [GOOD, "", GOOD, '{"group": 0, "turns": ['])
    rc, _, err = run(["credit", src, "--estimator", "grpo", "--out", out_path], capsys)
    assert rc == 2 and ":4:" in err and "invalid JSON" in err
    assert out_path.read_text() == "previous result\n"  # untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_bad_record_reports_line(tmp_path, capsys):
    bad = json.dumps({"group": 0, "outcome": 1.0, "turns": [{"observation": [1], "action": [],
                                                             "reward": 0.0}]})
    src = _write(tmp_path, [GOOD, "", bad])
    rc, _, err = run(["credit", src, "--estimator", "grpo", "--out", tmp_path / "o.jsonl"], capsys)
    assert rc == 2 and ":3:" in err and "turns[0].action" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_nan_reward_reports_line(tmp_path, capsys):
    bad = '{"group": 0, "outcome": 1.0, "turns": [{"action": [1], "reward": NaN}]}'
    src = _write(tmp_path, [bad])
    rc, _, err = run(["credit", src, "--estimator", "grpo", "--out", tmp_path / "o.jsonl"], capsys)
    assert rc == 2 and ":1:" in err and "reward" in err and "finite" in err


@pytest.mark.parametrize("argv, needle", [
    (["--estimator", "nope"], "unknown estimator 'nope'"),
    (["--estimator", "grpo", "--set", "gama=1"], "no hyper-parameter(s) ['gama']"),
    (["--estimator", "grpo", "--set", "eps"], "expected key=value"),
    (["--estimator", "gae", "--set", "gamma=1.5"], "gamma must lie in [0, 1]"),
])
def test_bad_arguments(tmp_path, capsys, argv, needle):
    src = EXAMPLE_VALUES
    rc, _, err = run(["credit", src, *argv, "--out", tmp_path / "o.jsonl"], capsys)
    assert rc == 2 and needle in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_missing_and_empty_file(tmp_path, capsys):
    rc, _, err = run(["credit", tmp_path / "none.jsonl", "--estimator", "grpo", "--out",
                      tmp_path / "o.jsonl"], capsys)
    assert rc == 2 and "no such file" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    rc, _, err = run(["credit", empty, "--estimator", "grpo", "--out", tmp_path / "o.jsonl"],
                     capsys)
    assert rc == 2 and "no rollout records" in err


def test_estimators_lists_every_name(capsys):
    rc, out, _ = run(["estimators"], capsys)
    assert rc == 0
    for name in estimators.names():
        assert name in out


def test_console_script(tmp_path):
    script = Path(sys.executable).parent / "jaxrl-agent"
    if not script.exists():
        pytest.skip("console script not installed next to this interpreter")
    out_path = tmp_path / "credit.jsonl"
    proc = subprocess.run([str(script), "credit", str(EXAMPLE), "--estimator", "rloo", "--out",
                           str(out_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert len(read_jsonl(out_path)) == len(read_jsonl(EXAMPLE))


def test_convert_round_trip(tiny_checkpoint, tmp_path, capsys):
    from safetensors.numpy import load_file

    out = tmp_path / "converted"
    rc, _, err = run(["convert", tiny_checkpoint, out, "--max-shard-bytes", "400000"], capsys)
    assert rc == 0, err
    assert "read back identically" in err
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    src = load_file(str(tiny_checkpoint / "model.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for name, shard in index["weight_map"].items():
        np.testing.assert_array_equal(load_file(str(out / shard))[name], src[name])
    assert set(index["weight_map"]) == set(src)
    rc, _, err = run(["convert", tmp_path / "missing", out], capsys)
    assert rc == 2 and "no such model folder" in err


def test_sample_from_a_checkpoint(tiny_checkpoint, capsys):
    rc, out, err = run(["sample", tiny_checkpoint, "--prompt", "add 3 and 4", "--max-new-tokens",
                        "6", "--num-samples", "2", "--temperature", "0"], capsys)
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 2 and rows[0]["token_ids"] == rows[1]["token_ids"]  # greedy
    assert 1 <= len(rows[0]["token_ids"]) <= 6 and rows[0]["finish_reason"] in ("stop", "length")
    rc, _, err = run(["sample", tiny_checkpoint, "--prompt-ids", "1,2,100000"], capsys)
    assert rc == 2 and "outside the vocabulary" in err
