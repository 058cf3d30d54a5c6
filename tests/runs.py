"""Tiny training runs for the loop and run-directory tests: one shape, a few seconds each."""

from jaxrl_agent import run_checks

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
        "model.num_heads=2", "model.num_kv_heads=2", "model.vocab_size=260",
        "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_turns=4",
        "rollout.max_new_tokens=8", "rollout.history=last", "trainer.layout=per_step",
        "trainer.eval_tasks=4", "trainer.eval_every=2", "trainer.sft_tasks=8",
        "trainer.sft_batch_size=8", "metrics.tensorboard=false", "mesh.data=1",
        "checkpoint.every=2", "checkpoint.keep=3", "optimizer.lr=1e-3",
        "trainer.warmup_sft_steps=0", "trainer.steps=4", "optimizer.warmup_steps=0"]


def tiny_config(run_dir, *extra):
    """The tiny run's config, living in ``run_dir``."""
    return run_checks.load(None, TINY + [f"run.dir={run_dir}", *extra])


def deterministic(rows):
    """Metrics rows without wall-clock fields (everything else repeats exactly)."""
    return [{k: v for k, v in r.items()
             if k not in ("time",) and not k.startswith("time/") and k != "train/tokens_per_s"}
            for r in rows]
