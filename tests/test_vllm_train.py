"""Training with ``sampler: vllm``: the default config (the built-in model's dims) runs a few steps
with vLLM generating the rollouts and every weight sync probed; a failing probe stops the run
with a clear error and keeps the newest finished step; a missing vLLM is a clear CLI error."""

import importlib.util
import sys

import pytest

from jaxrl_agent import cli
from jaxrl_agent import run_checks
from jaxrl_agent.train import loop
from jaxrl_agent.train.checkpoint import latest_step
from jaxrl_agent.train.metrics import read_metrics

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed (the [vllm] extra)")

# The default config (model dims included) with a small rollout.
SMALL = ["sampler=vllm", "sampler.kv_cache_mb=64", "rollout.tasks_per_step=2",
         "rollout.group_size=4", "rollout.max_turns=4", "trainer.eval_tasks=8",
         "trainer.eval_every=2", "trainer.warmup_sft_steps=10", "trainer.sft_tasks=16",
         "trainer.sft_batch_size=16", "metrics.tensorboard=false", "metrics.plots=false",
         "checkpoint.every=1", "checkpoint.keep=5", "optimizer.warmup_steps=0",
         "optimizer.lr=1e-3", "mesh.data=1"]


def _cfg(d, *extra):
    return run_checks.load(None, SMALL + [
        f"run.dir={d}", "checkpoint.export_warmup=false", *extra])


@needs_vllm
@pytest.mark.slow
def test_default_config_trains_with_vllm_and_a_bad_sync_stops_it(tmp_path, monkeypatch):
    from jaxrl_agent.sampling.vllm import VllmSampler, WeightSyncError

    cfg = _cfg(tmp_path, "trainer.steps=3")
    assert cfg.model.head_dim == 32 and cfg.model.num_heads == 4   # the default dims
    trainer = loop.Trainer(cfg, progress=False)
    assert isinstance(trainer.sampler, VllmSampler)
    versions = []
    generate = VllmSampler.generate

    def spy(self, prompts, params):
        outs = generate(self, prompts, params)
        versions.extend(o.policy_version for o in outs)
        return outs

    # Syncs: version 0 (start), 0 (after warm-up), then 1, 2, 3. The one after step 2 is
    # corrupted, so step 2's metrics are written and the run stops there.
    real_probe = VllmSampler.probe
    calls = []

    def probe(self, params):      # runs before the new version is stamped
        calls.append(self.policy_version)
        return 1.0 if len(calls) == 4 else real_probe(self, params)

    monkeypatch.setattr(VllmSampler, "generate", spy)
    monkeypatch.setattr(VllmSampler, "probe", probe)
    with pytest.raises(WeightSyncError, match="policy version 2"):
        trainer.run()
    rows = read_metrics(tmp_path / "metrics" / "metrics.jsonl")
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [1]
    assert all(r["sampler/probe_error"] < 1e-3 for r in train_rows)
    assert all(r["time/sync_s"] > 0 for r in train_rows)
    assert calls == [0, 0, 0, 1]          # the versions held while syncing 0, 0, 1 and 2
    assert trainer.sampler.policy_version == 1      # the failed sync stamped nothing
    assert set(versions) == {0, 1}          # rollouts of step 1 at version 0, step 2 at 1
    assert latest_step(tmp_path / "checkpoints") == 1

    # --resume with a healthy engine finishes the run, asynchronously: a rollout thread
    # generates with vLLM while the trainer trains and syncs (each sync probed).
    monkeypatch.setattr(VllmSampler, "probe", real_probe)
    cfg = _cfg(tmp_path, "trainer.steps=3", "trainer.async_rollouts=true",
               "trainer.max_policy_lag=1", "trainer.rollout_workers=1")
    summary = loop.Trainer(cfg, resume=True, progress=False).run()
    assert summary.steps == 3
    rows = read_metrics(tmp_path / "metrics" / "metrics.jsonl")
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert all(r["sampler/probe_error"] < 1e-3 for r in train_rows)
    assert all(r["async/lag_max"] <= 1 for r in train_rows[1:])
    assert max(versions) == 3                # the final evaluation runs at version 3


def test_cli_says_how_to_install_vllm(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)     # `import vllm` raises ImportError
    argv = ["train", "--quiet"] + [f"--set={s}" for s in SMALL] + [
        f"--set=run.dir={tmp_path}/run"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "jaxrl-agent[vllm]" in err and "pip install" in err


@needs_vllm
def test_head_dim_vllm_cannot_run_is_a_config_error(tmp_path, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("the head-size restriction is vLLM's CPU attention")
    argv = ["train", "--quiet", "--set=sampler=vllm", "--set=model.head_dim=null",
            f"--set=run.dir={tmp_path}/run"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "head_dim 16" in err and "num_heads" in err
