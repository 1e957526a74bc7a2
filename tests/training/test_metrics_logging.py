"""Tests for the JSONL/TensorBoard metrics logger, the progress line and the phase timer."""

import io
import json
import logging
import struct
import time

import jax.numpy as jnp
import numpy as np
import pytest
from helpers.python_snippet import run_snippet
from tensorboardX.proto import event_pb2

from a3po_jax.training.metrics import (
    MetricsLogger,
    ProgressBar,
    Timer,
    histogram_summary,
    read_metrics,
    step_record,
    to_json_value,
)


def read_tensorboard_events(run_dir):
    """{(tag, step): scalar or histogram proto} from the TFRecord event files, parsed by
    hand (8-byte length, 4-byte crc, payload, 4-byte crc) so the test needs no TensorFlow."""
    found = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            payload = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                found[(value.tag, event.step)] = (
                    value.simple_value if kind == "simple_value" else value.histo
                )
    return found


def test_log_writes_flushed_json_lines_with_converted_scalars(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False, console=False)
    logger.log(
        1,
        {
            "loss/total": np.float32(0.25),
            "reward/mean": jnp.asarray(0.5),  # a 0-d JAX array
            "tokens": np.int64(12),
            "flag": True,
            "note": "warmup",
        },
    )
    # Flushed per line: readable before close, as after a crash.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert record["step"] == 1 and isinstance(record["wall_time"], float)
    assert record["loss/total"] == 0.25 and record["reward/mean"] == 0.5
    assert record["tokens"] == 12 and isinstance(record["tokens"], int)
    assert record["flag"] is True and record["note"] == "warmup"
    with pytest.raises(TypeError, match="metric 'bad' has type object"):
        logger.log(2, {"bad": object()})
    with pytest.raises(ValueError, match="reserved"):
        logger.log(2, {"step": 3})
    logger.close()
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(3, {"x": 1.0})


def test_array_metrics_become_histogram_summaries():
    # Per-token staleness: one bin per integer value, so "never above η" and "exactly 1"
    # read straight off the summary.
    summary = histogram_summary(np.array([0, 1, 1, 2, 1], np.int32))
    assert summary == {
        "count": 5,
        "min": 0,
        "max": 2,
        "mean": 1.0,
        "values": [0, 1, 2],
        "counts": [1, 3, 1],
    }
    floats = histogram_summary(np.linspace(-1.0, 1.0, 101, dtype=np.float32))
    assert floats["count"] == 101 and sum(floats["counts"]) == 101
    assert len(floats["edges"]) == len(floats["counts"]) + 1
    assert floats["edges"][0] == -1.0 and floats["edges"][-1] == 1.0
    assert histogram_summary(np.zeros((0,), np.int32)) == {"count": 0}


def test_tensorboard_scalars_and_histograms(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=True, console=False) as logger:
        for step in range(3):
            logger.log(
                step,
                {
                    "loss/total": 1.0 / (step + 1),
                    "staleness/tokens": np.array([0, 1, 1, step], np.int32),
                    "note": "not a number: JSONL only",
                },
            )
    events = read_tensorboard_events(tmp_path)
    assert events[("loss/total", 2)] == pytest.approx(1.0 / 3.0)
    histogram = events[("staleness/tokens", 2)]
    assert histogram.num == 4 and histogram.max == 2.0 and histogram.sum == 4.0
    assert not any(tag == "note" for tag, _ in events)
    assert read_metrics(tmp_path)[2]["staleness/tokens"]["counts"] == [1, 2, 1]


_TENSORBOARD_WITHOUT_TORCH = """
import importlib.util, sys
from a3po_jax.training.metrics import MetricsLogger
with MetricsLogger(sys.argv[1], tensorboard=True, console=False) as logger:
    logger.log(1, {"loss/total": 0.5})
assert "torch" not in sys.modules, "the TensorBoard writer imported torch"
print(importlib.util.find_spec("torch") is not None)  # and torch is importable again
"""


def test_tensorboard_writer_does_not_import_torch(tmp_path):
    """tensorboardX's writer imports torch when it is installed (0.25 GiB, seconds of
    start-up); the logger imports it with torch hidden."""
    pytest.importorskip("torch")
    assert run_snippet(_TENSORBOARD_WITHOUT_TORCH, tmp_path).strip() == "True"
    assert read_tensorboard_events(tmp_path)[("loss/total", 1)] == pytest.approx(0.5)


def test_read_metrics_skips_a_truncated_last_line_and_resume_appends(tmp_path, caplog):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.log(1, {"loss": 1.0})
        logger.log(2, {"loss": 0.5})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 0.2')  # the process died mid-write
    with caplog.at_level(logging.WARNING, logger="a3po_jax.training.metrics"):
        records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert "truncated last line 3" in caplog.text

    # The resumed run appends; its first record must not be glued to the partial line.
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.log(3, {"loss": 0.25})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="a3po_jax.training.metrics"):
        records = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    assert "unreadable line 3" in caplog.text


def test_resumed_run_replaces_the_steps_it_logs_again(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=True, console=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": float(step)})
    # Checkpoint was at step 3; the crashed run had logged up to 5. With purge_step the
    # old 4 and 5 disappear even before the new run reaches them.
    with MetricsLogger(tmp_path, tensorboard=True, console=False, purge_step=4) as logger:
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
        logger.log(4, {"loss": 40.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    # Without a marker a step going backwards is a rewind too: old records >= it go.
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.log(2, {"loss": 20.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 20.0)]
    # Two records of the same step (e.g. train and eval) are both kept.
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.log(2, {"eval/accuracy": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 2]


def test_console_line_every_n_steps(tmp_path):
    stream = io.StringIO()
    with MetricsLogger(
        tmp_path,
        tensorboard=False,
        console=True,
        console_every=2,
        console_keys=["loss", "reward/mean"],
        stream=stream,
    ) as logger:
        for step in range(1, 5):
            logger.log(step, {"loss": 0.123456, "reward/mean": step, "other": 9.0})
    assert stream.getvalue().splitlines() == [
        "step 2 | loss 0.1235 | reward/mean 2",
        "step 4 | loss 0.1235 | reward/mean 4",
    ]


def test_progress_bar_prints_plain_lines_without_a_terminal():
    out = io.StringIO()  # not a TTY, like CI
    with ProgressBar(10, every=5, file=out) as bar:
        for step in range(1, 11):
            bar.update(step, {"reward": np.float32(0.5), "loss": 0.1})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("train 5/10 (50%)") and lines[1].startswith("train 10/10 (100%)")
    assert lines[1].endswith("reward 0.5 | loss 0.1") and "s/step" in lines[1]

    resumed = io.StringIO()
    bar = ProgressBar(7, every=3, initial=4, file=resumed)
    for step in range(5, 8):
        bar.update(step)
    bar.close()
    # Step 6 is a multiple of `every`, step 7 the last.
    assert [line.split(" (")[0] for line in resumed.getvalue().splitlines()] == [
        "train 6/7",
        "train 7/7",
    ]


def test_progress_bar_uses_tqdm_on_a_terminal():
    out = io.StringIO()
    with ProgressBar(4, file=out, tty=True, desc="rl") as bar:
        for step in range(1, 5):
            bar.update(step, {"reward": 0.25})
    text = out.getvalue()
    assert "\r" in text  # redrawn in place, not one line per step
    assert "rl" in text and "4/4" in text and "reward=0.25" in text


def test_timer_records_and_accumulates_phase_time():
    metrics = {}
    with Timer("generate", metrics) as timer:
        time.sleep(0.05)
    assert metrics["time/generate_s"] == timer.elapsed >= 0.05
    with Timer("generate", metrics):
        time.sleep(0.02)
    assert metrics["time/generate_s"] >= 0.07
    with pytest.raises(RuntimeError), Timer("failed", metrics):
        raise RuntimeError("boom")
    assert "time/failed_s" not in metrics
    with pytest.raises(ValueError, match="phase"):
        Timer("a/b")


def test_timer_waits_for_the_value_given():
    class Pending:
        """Stands in for an array still being computed: ready only after block_until_ready."""

        def __init__(self):
            self.blocked_at = None

        def block_until_ready(self):
            time.sleep(0.05)
            self.blocked_at = time.perf_counter()
            return self

    metrics = {}
    pending = Pending()
    with Timer("train", metrics) as timer:
        result = timer.block_on({"out": pending, "array": jnp.ones((2,)) * 2})
    assert result["out"] is pending and pending.blocked_at is not None
    # The wait counts toward the phase: it happened inside the timed region.
    assert metrics["time/train_s"] >= 0.05


def test_lists_of_numbers_are_logged_as_json_lists(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as logger:
        logger.log(1, {"staleness/counts": [3, 0, 2]})
    assert read_metrics(tmp_path)[0]["staleness/counts"] == [3, 0, 2]
    with pytest.raises(TypeError, match="only lists of numbers"):
        to_json_value("bad", ["a"])


def test_step_record_staleness_counts_each_minibatch_at_its_own_version():
    from types import SimpleNamespace

    from a3po_jax.core.types import Rollout, RolloutGroup

    def rollout(group_id, i, versions):
        n = len(versions)
        return Rollout(
            prompt_id=f"p{group_id}",
            group_id=group_id,
            sample_index=i,
            prompt_tokens=np.arange(2, dtype=np.int32),
            completion_tokens=np.arange(n, dtype=np.int32),
            behav_logprobs=np.zeros(n, np.float32),
            versions=np.asarray(versions, np.int32),
            finish_reason="stop",
            reward=float(i),
            info={"correct": float(i)},
        )

    # Two groups of 2 rows, trained from version 4 with k = 2: group 0 at 4, group 1 at 5.
    groups = [
        RolloutGroup("p0", 0, [rollout(0, 0, [4, 4]), rollout(0, 1, [3, 4])], 3),
        RolloutGroup("p1", 1, [rollout(1, 0, [4, 4]), rollout(1, 1, [4, 4])], 4),
    ]
    versions = np.array([[4, 4], [3, 4], [4, 4], [4, 4]])
    batch = SimpleNamespace(
        versions=versions, loss_mask=np.ones_like(versions), rewards=np.array([0.0, 1, 0, 1])
    )
    record = step_record(
        groups=groups,
        batch=batch,
        start_version=4,
        num_minibatches=2,
        step_metrics={"loss/total": 0.5},
        timings={"time/train_s": 2.0},
        version=6,
        host_stats={"version": 6, "tokens_per_s": 10.0},
        counters={"queue": {"dropped_groups": {"stale": 0}, "consumed_groups": 2}},
        skipped_total=0,
    )
    # Group 0: d = 0, 0, 1, 0; group 1 (minibatch 1, version 5): d = 1 on all 4 tokens.
    # Measured from the start version alone, group 1 would read all 0: counts [7, 1].
    assert record["staleness/counts"] == [3, 5]
    assert record["staleness/max"] == record["staleness/max_observed"] == 1.0
    assert record["staleness/mean"] == pytest.approx(5 / 8)
    assert record["version"] == 6 and record["reward/correct"] == 0.5
    assert record["throughput/train_tokens_per_s"] == 4.0
    assert record["queue/dropped_groups/stale"] == 0 and record["queue/consumed_groups"] == 2
