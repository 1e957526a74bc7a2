"""scripts/bench_decode_dispatch.py: a decode step timed pipelined, read every step, and a
trivial program over the same arguments (the GPU figures in the README come from it)."""

import dataclasses
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_decode_dispatch import main, measure  # noqa: E402

from a3po_jax import model  # noqa: E402


def test_measure_times_the_three_ways_on_the_steps_arguments():
    cfg = dataclasses.replace(model.ModelConfig.tiny(), max_seq_len=256)
    params = model.init_params(cfg, jax.random.key(0))
    t = measure(cfg, params, batch=2, steps=2)
    assert set(t) == {"pipelined", "read_each_step", "trivial_program", "arguments"}
    assert all(t[k] > 0 for k in ("pipelined", "read_each_step", "trivial_program"))
    # every per-layer weight leaf and every decode-state leaf is an argument
    assert t["arguments"] > 4 * cfg.n_layers


def test_main_prints_one_line_per_model_and_batch(capsys):
    main(["--models", "tiny", "--batches", "1,2", "--steps", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device: ")
    assert [line.split(":")[0] for line in lines[1:]] == [
        "tiny float32 batch 1",
        "tiny float32 batch 2",
    ]
