"""MetricsLogger (JSONL, resume, TensorBoard, progress line) and the PNG plots."""

import io
import json
import struct

import numpy as np
import pytest

from jaxrl_agent.train.metrics import MetricsLogger, read_metrics
from jaxrl_agent.train.plots import credit_picture, learning_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def quiet(directory, **kw):
    kw.setdefault("total_steps", 10)
    kw.setdefault("tensorboard", False)
    kw.setdefault("progress", False)
    return MetricsLogger(directory, **kw)


def with_clock(logger):
    clock = FakeClock()
    logger._clock = clock
    logger._start_time = clock.t
    return logger, clock


def strict_json(line):
    def no_constants(name):
        raise AssertionError(f"non-strict JSON constant {name}")
    return json.loads(line, parse_constant=no_constants)


# ----------------------------------------------------------------------------- JSONL


def test_lines_are_flushed_while_open(tmp_path):
    with quiet(tmp_path / "run") as logger:
        assert logger.path == tmp_path / "run" / "metrics.jsonl"
        logger.log(1, {"train/reward": np.float32(0.41), "n": np.int64(3), "ok": True})
        rows = read_metrics(logger.path)  # read back while the logger is open
        assert len(rows) == 1
        row = rows[0]
        assert row["step"] == 1 and isinstance(row["time"], float)
        assert row["train/reward"] == 0.41 and row["n"] == 3 and row["ok"] is True
        logger.log(2, {"train/reward": 0.5})
        assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    with pytest.raises(RuntimeError):
        logger.log(3, {})


def test_nonfinite_values_are_null_and_listed(tmp_path):
    with quiet(tmp_path) as logger:
        logger.log(1, {"a": float("nan"), "b": np.float32("inf"), "c": -np.inf, "d": 1.5})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    row = strict_json(line)
    assert row["a"] is None and row["b"] is None and row["c"] is None and row["d"] == 1.5
    assert row["nonfinite"] == ["a", "b", "c"]


def test_non_scalar_and_reserved_keys_are_rejected(tmp_path):
    with quiet(tmp_path) as logger:
        with pytest.raises(TypeError, match="'train/adv'.*shape"):
            logger.log(1, {"train/adv": np.zeros(3)})
        with pytest.raises(TypeError, match="'obj'"):
            logger.log(1, {"obj": object()})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(1, {"step": 3})
        assert read_metrics(logger.path) == []  # nothing half-written


def test_fresh_run_overwrites(tmp_path):
    with quiet(tmp_path) as logger:
        logger.log(1, {"x": 1.0})
    with quiet(tmp_path) as logger:
        logger.log(1, {"x": 2.0})
    assert [r["x"] for r in read_metrics(tmp_path)] == [2.0]


def test_resume_truncates_and_drops_a_corrupt_tail(tmp_path):
    with quiet(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"x": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "ti')  # a crash in the middle of a write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]

    with quiet(tmp_path, resume_from_step=3) as logger:
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
        for step in range(4, 11):
            logger.log(step, {"x": float(step)})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n") and "ti\n" not in text
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert [r["x"] for r in rows] == [float(s) for s in range(1, 11)]


def test_read_metrics_rejects_a_corrupt_middle_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 1}\n{"ste\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


def test_resume_without_a_file_starts_one(tmp_path):
    with quiet(tmp_path / "new", resume_from_step=7) as logger:
        logger.log(8, {"x": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path / "new")] == [8]


# ----------------------------------------------------------------------------- TensorBoard


def _tb_scalars(tb_dir):
    """(tag, step, value) of every scalar in the event files, read with the TFRecord framing."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                out.append((v.tag, event.step, v.simple_value))
    return out


def test_tensorboard_scalars(tmp_path):
    with quiet(tmp_path, tensorboard=True) as logger:
        logger.log(1, {"train/reward": 0.5, "eval/success": 1, "bad": float("nan"), "s": "x"})
        logger.log(2, {"train/reward": 0.75})
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    scalars = _tb_scalars(tmp_path / "tb")
    assert sorted(scalars) == [("eval/success", 1, 1.0), ("train/reward", 1, 0.5),
                               ("train/reward", 2, 0.75)]


def test_tensorboard_resume_purges_later_steps(tmp_path):
    from tensorboardX.proto import event_pb2

    with quiet(tmp_path, tensorboard=True) as logger:
        logger.log(1, {"x": 1.0})
    with quiet(tmp_path, tensorboard=True, resume_from_step=5) as logger:
        logger.log(6, {"x": 6.0})
    # TensorBoard reads the files in name order
    files = sorted((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 2
    # TensorBoard drops the events at steps >= 6 of earlier files when it reads this START
    data = files[-1].read_bytes()
    starts, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
        pos += 12 + n + 4
        if event.HasField("session_log"):
            starts.append((event.session_log.status, event.step))
    assert starts == [(event_pb2.SessionLog.START, 6)]
    with quiet(tmp_path, tensorboard=True):  # a fresh run replaces the old event files
        pass
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1


# ----------------------------------------------------------------------------- progress


def test_progress_on_a_plain_stream_prints_first_last_and_every_interval(tmp_path):
    out = io.StringIO()
    logger, clock = with_clock(MetricsLogger(tmp_path, total_steps=10, tensorboard=False,
                                             stream=out, print_every_s=10.0))
    for step in range(1, 11):
        clock.t += 4.0
        logger.log(step, {"train/reward": 0.25, "train/success": 0.5,
                          "train/tokens_per_s": 2100.0})
    logger.event("checkpoint saved at step 10")
    logger.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # first (t=4), then >= 10 s later: step 4 (t=16), step 7 (t=28), step 10 (last, t=40)
    steps = [ln.split()[1] for ln in lines if ln.startswith("step ")]
    assert steps == ["1/10", "4/10", "7/10", "10/10"]
    assert lines[0].startswith("step 1/10  10% | reward 0.25 | success 0.50 | 2.1e3 tok/s")
    assert lines[-2].endswith("00:40<00:00")
    assert lines[-1] == "checkpoint saved at step 10"


def test_progress_rarely_prints_with_a_long_interval(tmp_path):
    out = io.StringIO()
    with MetricsLogger(tmp_path, total_steps=50, tensorboard=False, stream=out,
                       print_every_s=3600) as logger:
        for step in range(1, 51):
            logger.log(step, {"train/reward": 1.0})
    assert [ln.split()[1] for ln in out.getvalue().splitlines()] == ["1/50", "50/50"]


def test_close_prints_the_last_state_when_stopped_early(tmp_path):
    out = io.StringIO()
    with MetricsLogger(tmp_path, total_steps=50, tensorboard=False, stream=out,
                       print_every_s=3600) as logger:
        for step in range(1, 6):
            logger.log(step, {})
    assert [ln.split()[1] for ln in out.getvalue().splitlines()] == ["1/50", "5/50"]


def test_progress_on_a_tty_redraws_in_place(tmp_path):
    out = FakeTTY()
    logger, clock = with_clock(MetricsLogger(tmp_path, total_steps=200, tensorboard=False,
                                             stream=out))
    for step in range(1, 13):
        clock.t += 3.5
        metrics = {"train/reward": 0.41, "train/success": 0.38, "train/tokens_per_s": 2100.0}
        if step == 10:
            metrics["eval/success"] = 0.5
        logger.log(step, metrics)
    text = out.getvalue()
    assert "\n" not in text and text.count("\r") == 12
    last = text.split("\r")[-1]
    assert last.startswith("step 12/200 [=>")
    assert "]   6% | reward 0.41 | success 0.38 | eval 0.50 | 2.1e3 tok/s | 00:42<" in last
    assert last.rstrip().endswith("<10:58")  # 3.5 s a step, 188 steps to go

    logger.event("eval: success 0.50")
    logger.close()
    text = out.getvalue()
    before, after = text.split("eval: success 0.50\n")
    assert before.endswith("\r" + " " * len(last) + "\r")  # the bar line was cleared
    assert after.startswith("\rstep 12/200") and after.endswith("\n")  # redrawn, ended


def test_eta_counts_steps_since_resume(tmp_path):
    out = io.StringIO()
    logger, clock = with_clock(MetricsLogger(tmp_path, total_steps=200, tensorboard=False,
                                             stream=out, resume_from_step=100))
    clock.t += 10.0
    logger.log(110, {})
    logger.close()
    assert out.getvalue().splitlines()[0].endswith("00:10<01:30")


def test_custom_progress_keys_and_silence(tmp_path):
    out = io.StringIO()
    with MetricsLogger(tmp_path, total_steps=2, tensorboard=False, stream=out,
                       progress_keys={"loss": "sft/loss"}) as logger:
        logger.log(1, {"sft/loss": 2.5, "train/reward": 1.0})
    assert "loss 2.50" in out.getvalue() and "reward" not in out.getvalue()

    out = FakeTTY()
    with MetricsLogger(tmp_path, total_steps=2, tensorboard=False, stream=out,
                       progress=False) as logger:
        logger.log(1, {"train/reward": 1.0})
        logger.event("hello")
    assert out.getvalue() == ""


# ----------------------------------------------------------------------------- plots


def _assert_png(path, min_bytes=5000):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > min_bytes


def test_learning_curve_png(tmp_path):
    rng = np.random.default_rng(0)
    rows = [{"step": 0, "sft/loss": 2.0}]
    for step in range(1, 61):
        row = {"step": step, "train/success": float(rng.uniform()),
               "train/reward": float(rng.normal())}
        if step % 10 == 0:
            row["eval/success"] = 0.5
        rows.append(row)
    rows[5]["train/reward"] = None  # a non-finite value read back from metrics.jsonl
    path = learning_curve(rows, tmp_path / "curve.png", title="run")
    assert path == tmp_path / "curve.png"
    _assert_png(path, 20000)
    _assert_png(learning_curve([], tmp_path / "empty.png"))
    _assert_png(learning_curve([{"step": 1, "other": 1.0}], tmp_path / "none.png"))


def test_credit_picture_png(tmp_path):
    trajectory = {"title": "task-1 #0", "turns": [
        {"action": "look around the room carefully", "reward": 0.0, "credit": 0.4},
        {"action": "go\nnorth", "reward": 0.0, "credit": -0.3},
        {"action": "open door", "reward": 1.0, "credit": 1.1}]}
    path = credit_picture([trajectory, {"title": "empty", "turns": []}], tmp_path / "c.png",
                          title="grpo")
    assert path == tmp_path / "c.png"
    _assert_png(path, 20000)
    _assert_png(credit_picture([trajectory] * 9, tmp_path / "many.png"))  # shows 6
    _assert_png(credit_picture([], tmp_path / "none.png"))
    # an untrained policy's bytes are labels, not matplotlib mathtext ("$$" once crashed it)
    garbage = {"title": "a $x$ task", "turns": [{"action": "?$$????<", "reward": 0.0,
                                                 "credit": 0.1}]}
    _assert_png(credit_picture([garbage], tmp_path / "dollars.png"))


def test_success_standard_error():
    """sqrt(p (1 - p) / n): 0.5 on 256 tasks is 1/32; certain outcomes and no tasks give 0."""
    from jaxrl_agent.train.loop import success_se
    assert success_se(0.5, 256) == pytest.approx(1 / 32)
    assert success_se(0.8, 100) == pytest.approx(0.04)
    assert success_se(1.0, 10) == 0.0 and success_se(0.0, 10) == 0.0
    assert success_se(0.3, 0) == 0.0


def test_progress_shows_errors_kl_and_lag_only_while_non_zero(tmp_path):
    out = io.StringIO()
    logger, clock = with_clock(MetricsLogger(tmp_path, total_steps=2, tensorboard=False,
                                             stream=out, print_every_s=0.0))
    clock.t += 1.0
    logger.log(1, {"train/reward": 0.5, "train/env_errors": 0, "train/loss_kl": 0.0,
                   "train/lr": 5e-4})
    clock.t += 1.0
    logger.log(2, {"train/reward": 0.5, "train/env_errors": 3, "train/loss_kl": 0.02,
                   "async/lag_mean": 0.5, "train/lr": 4e-4})
    logger.close()
    first, second = [ln for ln in out.getvalue().splitlines() if ln.startswith("step ")]
    assert "env-errors" not in first and "kl" not in first and "lr 5" in first
    assert "env-errors 3" in second and "kl 0.02" in second and "lag 0.50" in second


def test_tensorboard_text(tmp_path):
    from tensorboardX.proto import event_pb2

    with quiet(tmp_path, tensorboard=True) as logger:
        logger.text(3, "rollouts", "### task: outcome 1.00\n1. reward +1.00 reply: `u`")
    texts = []
    for path in sorted((tmp_path / "tb").glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            texts += [(v.tag, event.step, b"".join(v.tensor.string_val).decode())
                      for v in event.summary.value if v.tensor.string_val]
    assert len(texts) == 1 and texts[0][0].startswith("rollouts") and texts[0][1] == 3
    assert "reply: `u`" in texts[0][2]
