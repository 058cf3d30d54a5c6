"""Runs that never lose work: one run directory, resume from the run's own config, checkpoints
that degrade gracefully, and a clear message (exit code 2, no traceback) for a user's mistake.

Each case is run the way a user meets it: the CLI (in a subprocess where a second process is
the point), and asserts the message and that nothing was lost."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl_agent import cli
from jaxrl_agent import config as config_lib
from jaxrl_agent.train import loop, rundir
from jaxrl_agent.train.checkpoint import Checkpointer
from jaxrl_agent.train.metrics import read_metrics
from tests.runs import TINY, deterministic, tiny_config

REPO = Path(__file__).resolve().parents[1]


def _tree_digest(root: Path) -> dict:
    """{relative path: sha1} of every file under ``root`` (the lock file aside)."""
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def _cli(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _train_args(run_dir, *extra):
    return ["train", "--quiet"] + [a for s in TINY + [f"run.dir={run_dir}", *extra]
                                   for a in ("--set", s)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step tiny run (checkpoints at 2 and 4); tests copy it before changing it."""
    d = tmp_path_factory.mktemp("finished") / "run"
    loop.Trainer(tiny_config(d), progress=False).run()
    return d


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


# ----------------------------------------------------------------------------- one directory


def test_a_run_keeps_everything_in_its_directory(finished):
    names = sorted(p.name for p in finished.iterdir())
    assert names == [".lock", "base_model", "checkpoints", "config.yaml", "final_model",
                     "metrics", "rollouts"], names  # warm-up export only when there is a
    # warm-up; rollouts/: a few conversations of each step as text (jaxrl-agent show)
    saved = config_lib.read_yaml(finished / "config.yaml")
    assert saved == config_lib.to_dict(tiny_config(finished))


def test_a_second_run_leaves_the_first_untouched(finished, tmp_path, capsys):
    first = _copy(finished, tmp_path / "runs" / "first")
    before = _tree_digest(first)
    rc, _, err = _cli(_train_args(tmp_path / "runs" / "second", "trainer.steps=2"), capsys)
    assert rc == 0, err
    assert _tree_digest(first) == before
    # the same directory again: refused, with the ways out; nothing changed
    rc, _, err = _cli(_train_args(first, "trainer.steps=2"), capsys)
    assert rc == 2 and "already holds a run" in err and "--resume" in err and \
        "--overwrite" in err and "name=NEW" in err
    assert _tree_digest(first) == before


def test_overwrite_replaces_the_earlier_run(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path / "run")
    rc, _, err = _cli(_train_args(run, "trainer.steps=2", "checkpoint.every=0") + ["--overwrite"],
                      capsys)
    assert rc == 0, err
    assert Checkpointer(run / "checkpoints", every=0, keep=1).all_steps() == [2]
    assert [r["step"] for r in read_metrics(run / "metrics")][-1] == 2


def test_old_keys_say_what_to_write_instead(capsys):
    for key, hint in (("checkpoint.dir=x", "run.dir"), ("metrics.dir=x", "run.dir"),
                      ("checkpoint.export_dir=x", "checkpoint.export"),
                      ("checkpoint.warmup_dir=null", "checkpoint.export_warmup")):
        rc, _, err = _cli(["train", "--set", key], capsys)
        assert rc == 2 and "no longer exists" in err and hint in err, err


# ----------------------------------------------------------------------------- the lock


def test_a_refused_second_process_does_not_touch_the_live_run(finished, tmp_path):
    """The live run holds the lock; its in-flight save (orbax's tmp directory) must survive a
    second ``train --resume`` that is refused (orbax would clean tmp directories up)."""
    run = _copy(finished, tmp_path / "run")
    inflight = run / "checkpoints" / "6.orbax-checkpoint-tmp"
    inflight.mkdir()
    (inflight / "data").write_bytes(b"half-written")
    held = rundir.lock_run_dir(str(run))
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-m", "jaxrl_agent.cli", "train", "--resume",
                               str(run), "--quiet"], env=env, capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
    finally:
        held.close()
    assert proc.returncode == 2, proc.stderr
    assert "another process is training" in proc.stderr and "Traceback" not in proc.stderr
    assert (inflight / "data").read_bytes() == b"half-written"


# ----------------------------------------------------------------------------- resume


def test_resume_uses_the_runs_config(finished, tmp_path, capsys):
    """A finished run resumed without its overrides keeps its own values (not the defaults);
    allowed changes are printed, others refused naming each key with both values."""
    run = _copy(finished, tmp_path / "run")
    rc, _, err = _cli(["train", "--resume", run], capsys)  # steps stay 4: nothing to do
    assert rc == 0, err
    assert [r["step"] for r in read_metrics(run / "metrics")][-1] == 4
    rc, _, err = _cli(["train", "--resume", run, "--set", "trainer.steps=5"], capsys)
    assert rc == 0 and "trainer.steps 4 -> 5" in err, err
    assert [r["step"] for r in read_metrics(run / "metrics")][-1] == 5
    assert config_lib.read_yaml(run / "config.yaml")["trainer"]["steps"] == 5
    rc, _, err = _cli(["train", "--resume", run, "--set", "optimizer.lr=0.5", "--set",
                       "trainer.seed=3"], capsys)
    assert rc == 2
    assert "optimizer.lr: the run has 0.001, now 0.5" in err
    assert "trainer.seed: the run has 0, now 3" in err
    # the run named by the config (run.dir) without a RUN argument
    rc, _, err = _cli(["train", "--resume", "--set", f"run.dir={run}"], capsys)
    assert rc == 0, err


def test_resume_falls_back_past_an_unreadable_checkpoint(finished, tmp_path, capsys):
    """Truncate the newest checkpoint's data: resume says so, sets it aside, restarts from
    step 2 and ends with the metrics of the uninterrupted run."""
    run = _copy(finished, tmp_path / "run")
    want = deterministic(read_metrics(finished / "metrics"))
    data = [p for p in (run / "checkpoints" / "4" / "state").rglob("*") if p.is_file()
            and p.stat().st_size > 0 and p.parent.name == "d"]
    assert data, "no array data files found"
    for p in data:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    rc, _, err = _cli(["train", "--resume", run], capsys)
    assert rc == 0, err
    assert "checkpoint step 4 cannot be read" in err and "at step 2" in err
    assert (run / "checkpoints" / "4.unreadable").is_dir()  # set aside, not deleted
    assert deterministic(read_metrics(run / "metrics")) == want
    # nothing readable at all: a clear error naming every step
    run2 = _copy(finished, tmp_path / "run2")
    for step in ("2", "4"):
        shutil.rmtree(run2 / "checkpoints" / step / "meta")
    rc, _, err = _cli(["train", "--resume", run2], capsys)
    assert rc == 2 and "no checkpoint in" in err and "step 4" in err and "step 2" in err


def test_eval_reads_the_run(finished, capsys):
    rc, out, err = _cli(["eval", finished, "--tasks", "3"], capsys)
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["step"] == 4 and res["tasks"] == 3
    rc, out, _ = _cli(["eval", finished / "checkpoints", "--tasks", "2", "--step", "2"], capsys)
    assert rc == 0 and json.loads(out)["step"] == 2
    rc, _, err = _cli(["eval", finished.parent / "nothing"], capsys)
    assert rc == 2 and "is not a run" in err


def test_load_run_policy_holds_the_checkpoint(finished):
    """The run's policy at a checkpoint: the final model's weights at the last step (the run
    exports it), different ones at an earlier step; the run's rollout config and eval
    tasks come with it."""
    from flax import nnx

    from jaxrl_agent.models.hf import load_hf
    last = loop.load_run_policy(finished)
    assert last.step == 4 and last.eval_tasks and last.rollout.observation_template
    exported, _ = load_hf(str(finished / "final_model"))
    for a, b in zip(jax.tree.leaves(nnx.state(last.model, nnx.Param)),
                    jax.tree.leaves(nnx.state(exported, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-6, atol=1e-6)
    early = loop.load_run_policy(finished, step=2)
    assert early.step == 2 and any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(nnx.state(early.model, nnx.Param)),
                        jax.tree.leaves(nnx.state(last.model, nnx.Param))))


def test_the_trained_model_can_be_sampled(finished, capsys):
    rc, out, err = _cli(["sample", finished / "final_model", "--prompt", "A.#..", "--raw",
                         "--max-new-tokens", "4"], capsys)
    assert rc == 0, err
    rc, out, err = _cli(["sample", finished / "final_model", "--prompt", "A.#..",
                         "--max-new-tokens", "4"], capsys)  # the codec's chat template
    assert rc == 0, err
    assert len(json.loads(out.splitlines()[0])["token_ids"]) >= 1


# ----------------------------------------------------------------------------- user errors


def test_user_errors_are_one_clear_message(tmp_path, capsys):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("trainer:\n  steps: 3\n lr: [1\n")
    rc, _, err = _cli(["train", bad_yaml], capsys)
    assert rc == 2 and f"{bad_yaml}:3" in err and "YAML syntax error" in err
    rc, _, err = _cli(["train", tmp_path], capsys)
    assert rc == 2 and "is a directory" in err
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    rc, _, err = _cli(["train", latin], capsys)
    assert rc == 2 and "not UTF-8" in err
    rollouts = REPO / "examples" / "rollouts.jsonl"
    copy = tmp_path / "r.jsonl"
    copy.write_bytes(rollouts.read_bytes())
    before = copy.read_bytes()
    for out, msg in ((tmp_path, "is a directory"), (copy, "is the input")):
        rc, _, err = _cli(["credit", copy, "--estimator", "grpo", "--out", out], capsys)
        assert rc == 2 and msg in err, err
    assert copy.read_bytes() == before
    rc, _, err = _cli(["credit", tmp_path, "--estimator", "grpo", "--out", tmp_path / "o"],
                      capsys)
    assert rc == 2 and "is a directory" in err
    rc, _, err = _cli(["credit", latin, "--estimator", "grpo", "--out", tmp_path / "o"], capsys)
    assert rc == 2 and "not UTF-8" in err


def test_credit_output_gets_a_new_files_mode(tmp_path, capsys):
    out = tmp_path / "credit.jsonl"
    rc, _, err = _cli(["credit", REPO / "examples" / "rollouts.jsonl", "--estimator", "grpo",
                       "--out", out], capsys)
    assert rc == 0, err
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


def test_unwritable_run_dir(tmp_path, capsys):
    """A run directory that cannot be created (here: under a regular file, which fails for
    root too; a read-only directory gives the same message)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, _, err = _cli(_train_args(blocker / "run"), capsys)
    assert rc == 2 and "cannot write the run directory" in err, err


def test_truncated_model_file_is_named(finished, tmp_path, capsys):
    model = _copy(finished / "final_model", tmp_path / "model")
    st = model / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    for argv in (["sample", model, "--prompt", "x", "--raw"], ["convert", model, tmp_path / "o"]):
        rc, _, err = _cli(argv, capsys)
        assert rc == 2 and "model.safetensors" in err and "truncated" in err, err


def _write_records(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_records_are_checked_with_their_line(tmp_path, capsys):
    ok = {"group": "g", "outcome": 1.0,
          "turns": [{"observation": [3], "action": [4, 5], "logprobs": [-0.5, -1.0]}]}
    other = dict(ok, outcome=0.0)
    out = tmp_path / "credit.jsonl"
    cases = [
        (dict(ok, turns=[dict(ok["turns"][0], logprobs=[0.3, -1.0])]),
         "turns[0].logprobs[0] = 0.3 is not a log-probability"),
        (dict(ok, outcome=1e39), "does not fit float32"),
    ]
    for bad, msg in cases:
        path = _write_records(tmp_path / "bad.jsonl", [other, bad])
        rc, _, err = _cli(["credit", path, "--estimator", "grpo", "--out", out], capsys)
        assert rc == 2 and f"{path}:2:" in err and msg in err, err
    # misspelt fields: a warning naming the line and the likely field; --strict refuses
    typo = {"group": "g", "Outcome": 1.0,
            "turns": [dict(ok["turns"][0], reward=1.0, rewards=1.0)]}
    path = _write_records(tmp_path / "typo.jsonl", [dict(ok), typo])
    rc, _, err = _cli(["credit", path, "--estimator", "grpo", "--out", out], capsys)
    assert rc == 0, err
    assert f"{path}:2: unknown field 'Outcome' (did you mean 'outcome'?)" in err
    assert "unknown field 'turns[0].rewards' (did you mean 'reward'?)" in err
    rc, _, err = _cli(["credit", path, "--estimator", "grpo", "--out", out, "--strict"], capsys)
    assert rc == 2 and "--strict" in err
    # the collector's own fields are known: no warning on the example rollouts
    rc, _, err = _cli(["credit", REPO / "examples" / "rollouts.jsonl", "--estimator", "grpo",
                       "--out", out], capsys)
    assert rc == 0 and "unknown field" not in err


def test_credit_hyper_parameter_errors_name_the_key(capsys, tmp_path):
    rc, _, err = _cli(["credit", REPO / "examples" / "rollouts.jsonl", "--estimator", "grpo",
                       "--set", "eps=abc", "--out", tmp_path / "o.jsonl"], capsys)
    assert rc == 2 and "eps must be a finite number" in err, err


def test_a_run_that_cannot_learn_says_so(tmp_path):
    """An untrained tiny policy fails every task: every advantage is 0, every update is
    skipped as idle, and after a few steps the run says why nothing is learned."""
    import io
    out = io.StringIO()
    cfg = tiny_config(tmp_path / "run", "trainer.steps=3", "trainer.eval_every=0",
                      "checkpoint.every=0", "env.kwargs.invalid_penalty=0")  # rewards all 0
    loop.Trainer(cfg, progress=True, stream=out).run()
    text = out.getvalue()
    assert "steps 1-3: every advantage was 0, so nothing was learned" in text, text
    assert "rollout.group_size" in text
    rows = read_metrics(tmp_path / "run" / "metrics")
    assert all(r["train/updates"] == 0 and r["train/updates_idle"] == 1 for r in rows
               if "train/updates" in r)
