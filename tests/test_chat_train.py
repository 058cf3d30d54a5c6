"""The two chat configs of ``configs/`` train end to end on the tiny Qwen2-style checkpoint
(``examples/make_tiny_checkpoint.py``, Qwen2.5-Instruct's real chat template): a task file with
a reward function, and tool calls through the bundled MCP server. Random weights learn nothing;
what is checked is that every piece runs together through ``jaxrl-agent train``'s loop and
that the records it trains on hold the sampled tokens under the template's own tokens. The
token bookkeeping itself is property-tested in test_chat_rollouts.py, the tools and the MCP
server in test_tools.py and test_mcp.py."""

from pathlib import Path

import pytest

from jaxrl_agent import run_checks
from jaxrl_agent.train import loop
from jaxrl_agent.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["trainer.steps=1", "trainer.eval_every=0", "trainer.eval_tasks=2",
         "rollout.tasks_per_step=2", "rollout.group_size=2", "checkpoint.every=0",
         "rollout.max_new_tokens=8"]


@pytest.mark.parametrize("name", ["tiny_chat_tasks", "tiny_chat_mcp"])
def test_chat_config_trains(name, tiny_checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("mcp")
    monkeypatch.chdir(ROOT)  # the configs name examples/ relative to the repository
    cfg = run_checks.load(ROOT / "configs" / f"{name}.yaml",
                          SMALL + [f"model.hf_path={tiny_checkpoint}", f"run.dir={tmp_path}"])
    trainer = loop.Trainer(cfg, progress=False)
    seen = []
    collect = trainer._collect

    def spy(tasks, rollout_cfg, seed):
        records, stats = collect(tasks, rollout_cfg, seed)
        if rollout_cfg.group_size > 1:  # a training step's rollouts, not an evaluation's
            seen.append((records, stats))
        return records, stats

    trainer._collect = spy
    summary = trainer.run()
    assert summary.steps == 1
    rows = read_metrics(tmp_path / "metrics" / "metrics.jsonl")
    assert rows[-1]["step"] == 1 and "train/chat_rerender_differs" in rows[-1]
    records, stats = seen[-1]
    assert stats["trajectories"] == 4 and stats["chat_template_prefix_stable"] in (0, 1)
    tok = trainer.codec
    for rec in records:
        first = tok.decode(rec["turns"][0]["observation"])
        assert first.startswith("<|im_start|>system\n") and first.endswith(
            "<|im_start|>assistant\n")
        if name == "tiny_chat_mcp":  # the server's tools, rendered by the template
            assert "<tools>" in first and '"calculate"' in first
        for turn in rec["turns"]:  # the trained tokens are the sampled ones, as sampled
            assert len(turn["action"]) == len(turn["logprobs"]) >= 1
            assert turn["action_text"] == tok.decode(
                turn["action"][:-1] if turn["action"][-1] in (tok.eos_token_id,)
                else turn["action"])
