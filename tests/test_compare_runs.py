"""examples/compare_runs.py's statistics on synthetic runs: paired differences, AUC, intervals."""

import importlib.util
import json
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cr():
    spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "examples" / "compare_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(root, variant, seed, evals, zero_frac=0.25, step_s=1.0):
    d = root / variant / f"seed{seed}" / "metrics"
    d.mkdir(parents=True)
    rows = []
    for step in range(max(evals) + 1):
        row = {"step": step}
        if step > 0:
            row.update({"train/group_zero_frac": zero_frac, "time/rollout_s": step_s / 2,
                        "time/train_s": step_s / 2})
        if step in evals:
            row["eval/success"] = evals[step]
        rows.append(json.dumps(row))
    (d / "metrics.jsonl").write_text("\n".join(rows) + "\nnot json\n")


def test_paired_differences_auc_and_means(cr, tmp_path):
    base = {0: [0.5, 0.4, 0.6], 10: [0.6, 0.5, 0.7], 20: [0.7, 0.6, 0.8]}
    for s in range(3):
        _write(tmp_path, "a", s, {k: v[s] for k, v in base.items()})
        # b = a + 0.1 at every later evaluation in every seed: the paired interval is exactly 0
        _write(tmp_path, "b", s, {k: v[s] + (0.1 if k else 0.0) for k, v in base.items()},
               zero_frac=0.5, step_s=3.0)
    out = cr.summarize(tmp_path, [("a", []), ("b", ["x=1"])], [0, 1, 2], eval_tasks=100)
    assert out["steps"] == [0, 10, 20]
    a, b = out["variants"]["a"], out["variants"]["b"]
    assert a["per_step"][20]["mean"] == pytest.approx(0.7)
    assert a["per_step"][20]["ci95"] == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert b["per_step"][20]["diff_vs_a"] == pytest.approx(0.1)
    assert b["per_step"][20]["diff_ci95"] == pytest.approx(0.0, abs=1e-9)
    assert a["auc"] == pytest.approx(0.65) and b["auc_diff_vs_a"] == pytest.approx(0.1)
    assert b["group_zero_frac"] == pytest.approx(0.5) and b["step_s"] == pytest.approx(3.0)
    assert a["per_step"][0]["eval_se"] == pytest.approx(
        sum(math.sqrt(x * (1 - x) / 100) for x in base[0]) / 3)
    cr.write_report(tmp_path, out)
    table = (tmp_path / "summary.md").read_text()
    assert "| b |" in table and "+0.100 +- 0.000" in table
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_one_seed_has_no_interval(cr):
    m, h = cr._ci([0.3])
    assert m == 0.3 and math.isnan(h)
    assert cr._t95(2) == 12.706 and cr._t95(5) == 2.776
