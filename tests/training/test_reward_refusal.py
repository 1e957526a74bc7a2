"""A reward model that cannot score the run (no checkpoint at the path, another tokenizer)
is refused by build_run before anything starts: no run directory, no compiled step, no
host; the error names task.reward. The policy is a stand-in with the tiny model's tokenizer
(the refusal needs nothing else of it), so no weights are made."""

import dataclasses
from pathlib import Path

import pytest
from helpers.scorers import use_test_reward_model
from helpers.trainer_runs import make_cfg

from a3po_jax.model.char_tokenizer import char_tokenizer
from a3po_jax.model.loader import LoadedModel
from a3po_jax.tasks.toy import LetterTask
from a3po_jax.training import build, trainer
from a3po_jax.training.build import build_run

POLICY = LoadedModel(config=None, params=None, tokenizer=char_tokenizer())


@pytest.fixture
def nothing_may_start(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("something started before the reward model was checked")

    monkeypatch.setattr(build, "build_train", started)
    monkeypatch.setattr(build.host_placement, "start_run_host", started)


def reward_cfg(tmp_path, reward):
    cfg = make_cfg(tmp_path, "refused", mode="sync")
    return dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, reward=reward))


def test_a_path_with_no_reward_model_is_refused_naming_the_field(tmp_path, nothing_may_start):
    cfg = reward_cfg(tmp_path, f"model:{tmp_path}/no_such_rm")
    with pytest.raises(ValueError, match=r"task\.reward='model:.*no_such_rm'.*no reward model"):
        build_run(cfg, POLICY, task=LetterTask())
    assert not Path(cfg.run_dir).exists()


def test_a_tokenizer_mismatch_is_refused_naming_the_field(tmp_path, monkeypatch, nothing_may_start):
    use_test_reward_model(monkeypatch, refuse="tokenizer mismatch: the reward model's is not")
    cfg = reward_cfg(tmp_path, "model:/rm")
    with pytest.raises(ValueError, match=r"task\.reward='model:/rm'.*tokenizer mismatch"):
        build_run(cfg, POLICY, task=LetterTask())
    assert not Path(cfg.run_dir).exists()


def test_a3po_train_refuses_it_by_the_field(tmp_path, monkeypatch, capsys, nothing_may_start):
    from a3po_jax.cli.train import main

    monkeypatch.setattr(trainer, "load_policy", lambda section: POLICY)

    smoke = Path(__file__).resolve().parents[2] / "experiments" / "smoke_tiny.py"
    run_dir = tmp_path / "run"
    argv = [str(smoke), f"run_dir={run_dir}", f"task.reward=model:{tmp_path}/no_rm"]
    assert main(argv) == 2
    assert "task.reward='model:" in capsys.readouterr().err
    assert not (run_dir / "checkpoints").exists()
