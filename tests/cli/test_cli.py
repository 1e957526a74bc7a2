"""`a3po-train`: nothing is written before a run is accepted, every refusal is one line on
stderr with exit code 2, and the long silent phases (model load, first step, resume) are
announced."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from a3po_jax.cli.train import latest_checkpoint_step, main
from a3po_jax.training.checkpointing import COMMIT_MARKER
from a3po_jax.training.config import apply_overrides, load_experiment
from a3po_jax.training.trainer import Trainer, load_policy

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "experiments" / "smoke_tiny.py")


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes: equal snapshots = nothing written."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def is_progress(line: str) -> bool:
    """The start-up banner and the lines announcing long work (they end in "...")."""
    return line.startswith("a3po-train[") or line.endswith(" ...")


def refusal(capsys) -> str:
    """The one stderr line a refused run ends with (no traceback, no usage block)."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if not is_progress(line)]
    assert len(lines) == 1 and lines[0] == err.splitlines()[-1], err
    assert lines[0].startswith("a3po-train: ")
    return lines[0]


def finished_run_dir(tmp_path: Path) -> Path:
    """A run dir as a finished run leaves it: its config and a committed checkpoint."""
    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints" / "3"
    step.mkdir(parents=True)
    (step / COMMIT_MARKER).write_text("")
    (run_dir / "config.json").write_text('{"the": "old run"}')
    (run_dir / "metrics.jsonl").write_text('{"step": 3, "wall_time": 1.0}\n')
    return run_dir


def test_a_fresh_run_onto_checkpoints_is_refused_before_anything_is_written(tmp_path, capsys):
    # Before: the model was loaded and config.json replaced, then a FileExistsError traceback.
    run_dir = finished_run_dir(tmp_path)
    before = snapshot(run_dir)
    assert main([SMOKE, f"run_dir={run_dir}", "algo.prox=recompute"]) == 2
    err = refusal(capsys)
    assert "already has checkpoints (newest step 3)" in err and "--resume" in err
    assert "nothing was overwritten" in err
    assert snapshot(run_dir) == before


def test_uncommitted_steps_are_not_checkpoints(tmp_path):
    run_dir = finished_run_dir(tmp_path)
    (run_dir / "checkpoints" / "5").mkdir()  # a save cut short: no commit marker
    (run_dir / "checkpoints" / "7.orbax-checkpoint-tmp-1").mkdir()
    assert latest_checkpoint_step(run_dir) == 3
    assert latest_checkpoint_step(tmp_path / "nowhere") == 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["model.name=/no/such/checkpoint"], "model.name='/no/such/checkpoint'"),
        (["algo.prox=nope"], "config error: algo.prox='nope' is not one of"),
        (["steps=0"], "config error: steps must be > 0"),
        (["rollout.group_size"], "must look like section.field=value"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--log-level", "loud"], "--log-level"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    try:
        code = main([SMOKE, f"run_dir={run_dir}", *argv])
    except SystemExit as stop:  # argparse exits (code 2) instead of returning
        code = stop.code
    assert code == 2
    assert message in refusal(capsys)
    assert not run_dir.exists()


def test_bad_experiment_files_are_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing.py")]) == 2
    err = refusal(capsys)
    assert f"experiment file '{tmp_path / 'missing.py'}' does not exist" in err
    broken = tmp_path / "broken.py"
    broken.write_text("import a3po_jax\n\nfrom a3po_jax import no_such_module\n")
    assert main([str(broken)]) == 2
    err = refusal(capsys)
    assert f"'{broken}' line 3 failed to import" in err and "no_such_module" in err
    raises = tmp_path / "raises.py"
    raises.write_text("def config():\n    return {}['missing']\n")
    assert main([str(raises)]) == 2
    assert "line 2: config() raised KeyError: 'missing'" in refusal(capsys)


def test_a_bad_report_plots_value_is_refused_naming_the_variable(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("A3PO_REPORT_PLOTS", "no")
    run_dir = tmp_path / "run"
    assert main([SMOKE, f"run_dir={run_dir}"]) == 2
    assert "A3PO_REPORT_PLOTS='no': expected 0 (no plots) or 1 (plots)" in refusal(capsys)
    assert not run_dir.exists()


def test_bad_input_in_a_subprocess_is_one_line(tmp_path):
    """The installed entry point's view: stderr has one line, no traceback, exit code 2."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "a3po_jax.cli.train", SMOKE, "model.name=/no/such/checkpoint"]
        + [f"run_dir={run_dir}"],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("a3po-train:")]
    assert "Traceback" not in proc.stderr
    assert lines[-1].startswith("a3po-train: config error: model.name=")
    assert not run_dir.exists()


@pytest.mark.e2e
def test_a_real_run_is_announced_refused_and_resumed(tmp_path, capsys):
    """Two steps with checkpoints; a fresh run onto them, from the CLI or from the library,
    is refused and leaves the run dir (config.json: evaluation rebuilds the run's model from
    it) as the finished run wrote it; --resume says where it continues. Before, both wrote
    the refused run's config.json, and the CLI ended in a FileExistsError traceback."""
    run_dir = tmp_path / "run"
    common = [SMOKE, f"run_dir={run_dir}", "checkpoint_every=1", "system.mode=sync"]
    assert main([*common, "steps=2"]) == 0
    err = capsys.readouterr().err
    assert "a3po-train: loading model 'tiny' ..." in err
    assert "a3po-train: step 1: compiling" in err
    assert json.loads((run_dir / "config.json").read_text())["steps"] == 2
    finished = snapshot(run_dir)

    assert main([*common, "steps=3", "algo.prox=recompute"]) == 2
    assert "nothing was overwritten" in refusal(capsys)
    assert snapshot(run_dir) == finished

    cfg = apply_overrides(load_experiment(SMOKE), [*common[1:], "steps=3", "seed=7"])
    trainer = Trainer(cfg, load_policy(cfg.model), console=False)
    with pytest.raises(FileExistsError, match="nothing was overwritten"):
        trainer.run()
    assert snapshot(run_dir) == finished

    assert main([*common, "steps=3", "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"a3po-train: resuming {run_dir} from step 2 of 3" in err
    assert "a3po-train: step 3: compiling" in err
    assert json.loads((run_dir / "config.json").read_text())["steps"] == 3
