"""``jaxrl-agent train`` as a two-process job (2 processes x 4 CPU devices on localhost, pure
data parallelism: parameters replicated across hosts), then resumed by one process with 8
devices on a data x fsdp x tensor = 2 x 2 x 2 layout. (Parameters split across hosts are
covered by the child of test_multihost.py: a matmul with the weight split across hosts and
``host_gather``.)

What it pins down: both processes finish; only process 0 writes metrics and prints; the
checkpoint written by both processes together restores into a single process and a
different mesh, and the run continues from it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import child_env, free_port, wait_all

TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
        "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=16",
        "rollout.tasks_per_step=4", "rollout.group_size=2", "rollout.max_turns=4",
        "rollout.max_new_tokens=8", "rollout.history=last", "trainer.layout=per_step",
        "trainer.eval_tasks=4", "trainer.eval_every=2", "trainer.warmup_sft_steps=0",
        "metrics.tensorboard=false", "metrics.plots=false", "checkpoint.every=1",
        "optimizer.warmup_steps=0", "checkpoint.export_warmup=false"]


def _args(d: Path, *extra: str) -> list:
    sets = TINY + [f"run.dir={d}/run", *extra]
    return ([sys.executable, "-m", "jaxrl_agent.cli", "train"]
            + [a for s in sets for a in ("--set", s)])


def _wait(procs, logs, timeout):
    codes = wait_all(procs, timeout)
    texts = [Path(f).read_text() for f in logs]
    tails = "\n".join(f"--- process {i} ---\n{t[-3000:]}" for i, t in enumerate(texts))
    assert codes == [0] * len(procs), f"exit codes {codes}\n{tails}"
    return texts


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["model.lora.rank=4"]], ids=["full", "lora"])
def test_two_process_training_then_single_process_resume(tmp_path, lora):
    """Two processes train (data parallel), then one process with another mesh resumes: a
    full fine-tune, and LoRA adapters (checkpoints without the base, restored whole)."""
    port = free_port()
    # pure data parallelism (the default mesh): parameters replicated across the two hosts
    mesh = ["mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1", "trainer.steps=2", *lora]
    procs, logs = [], []
    for pid in range(2):
        log = tmp_path / f"p{pid}.log"
        logs.append(log)
        env = child_env(4, JAXRL_COORDINATOR=f"localhost:{port}", JAXRL_NUM_PROCESSES="2",
                        JAXRL_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen(_args(tmp_path, *mesh), env=env, cwd=tmp_path,
                                      stdout=open(log, "w"), stderr=subprocess.STDOUT))
    p0, p1 = _wait(procs, logs, timeout=400)
    assert "mesh data=8 fsdp=1 tensor=1 on 8 x cpu (2 processes)" in p0
    assert "done: 2 steps" in p0 and "done:" not in p1  # process 0 reports, 1 stays quiet
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics" / "metrics.jsonl").read_text().split("\n")
            if x.strip()]
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == [1, 2]  # written once, by process 0
    assert (run / "final_model" / "config.json").exists()
    assert (run / "checkpoints" / "2").is_dir()

    # one process, 8 devices, another layout: restore the two-process checkpoint, go on
    log = tmp_path / "resume.log"
    proc = subprocess.Popen(_args(tmp_path, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                  "trainer.steps=3", *lora) + ["--resume"], env=child_env(8),
                            cwd=tmp_path,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    (out,) = _wait([proc], [log], timeout=300)
    assert "resumed from" in out and "at step 2" in out and "done: 3 steps" in out
    rows = [json.loads(x) for x in (run / "metrics" / "metrics.jsonl").read_text().split("\n")
            if x.strip()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
