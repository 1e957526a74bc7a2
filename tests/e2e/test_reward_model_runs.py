"""A run scored by a reward model (``task.reward=model:PATH``) trains in every mode, the
scorer's name and version in every rollout and step record, its time in ``time/reward_s``;
a replay of such a run trains on the recorded rewards without loading the scorer.

Most runs use the deterministic stand-in of ``helpers/scorers.py``, put in by the loader's
seam (``a3po_jax.tasks.scorers.load_model_scorer``); the last ones leave the seam alone and
load a real tiny reward model from disk (``load_reward_scorer``).
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from helpers.scorers import VERSION, save_tiny_reward_model, use_test_reward_model
from helpers.trainer_runs import make_cfg, run

from a3po_jax.analysis.run_report import report_rows
from a3po_jax.cli.train import main as train_main
from a3po_jax.model.loader import LoadedModel
from a3po_jax.rollout.ledger import read_events
from a3po_jax.tasks.toy import LetterTask
from a3po_jax.training import recording
from a3po_jax.training.build import build_run
from a3po_jax.training.config import RunSection
from a3po_jax.training.metrics import read_metrics

RM = "model:/reward_models/vowels"
LABEL = f"{RM}@{VERSION}"


def reward_model_cfg(tmp_path, mode, *, steps=2, algo=None, **system):
    cfg = make_cfg(tmp_path, mode, mode=mode, eta=1, steps=steps, **(algo or {}))
    return dataclasses.replace(
        cfg,
        task=dataclasses.replace(cfg.task, reward=RM, no_eos_penalty=0.5),
        system=dataclasses.replace(cfg.system, **system),
    )


@pytest.mark.parametrize(
    "mode,algo,system",
    [
        ("sync", {}, {}),
        ("periodic", {}, {}),
        ("one_step_off", {}, {}),
        ("async", {}, {}),
        # The trainer's thread drives the host (and so the reward stage) itself.
        ("async", {}, {"lockstep_decode_steps": 3}),
        # RLHF's reward: the reward model's score, then R - β Σ KL in the trainer.
        ("sync", {"kl_coef": 0.05, "kl_in_reward": True, "advantage": "rloo"}, {}),
    ],
    ids=["sync", "periodic", "one_step_off", "async", "async-lockstep", "sync-kl-in-reward"],
)
def test_a_reward_model_scores_every_mode(tmp_path, monkeypatch, mode, algo, system):
    loaded = use_test_reward_model(monkeypatch)
    cfg = reward_model_cfg(tmp_path, mode, algo=algo, **system)
    records = run(cfg)
    assert [r["version"] for r in records] == [1, 2]
    (scorer,) = loaded
    group_size = cfg.rollout.group_size
    assert scorer.calls and set(scorer.calls) == {group_size}  # one call per whole group
    for r in records:
        assert np.isfinite(r["loss/total"])
        assert r["reward/scorer"] == LABEL
        assert r["time/reward_s"] >= 0 and "reward/gold_score_mean" in r
        assert r["mem/reward_model_gb"] == 3 / 1024
    assert sum(r["time/reward_s"] for r in records) > 0
    (start,) = [e for e in read_events(Path(cfg.run_dir) / "ledger.jsonl") if e["event"] == "start"]
    assert start["scorer"] == LABEL
    rows = dict(report_rows(records, cfg.to_dict()))
    assert rows["rewards scored by"].startswith(f"{LABEL} (")
    assert rows["peak memory"].endswith("; reward model weights 0.00 GiB")


def test_a_reward_model_run_replays_from_its_recorded_rewards(tmp_path, monkeypatch):
    use_test_reward_model(monkeypatch)
    cfg = reward_model_cfg(tmp_path, "sync", run=RunSection(record_rollouts=True))
    recorded = run(cfg)
    rec_dir = Path(cfg.run_dir)
    groups, _ = recording.read_step(recording.step_path(rec_dir / "rollouts", 1))
    infos = [r.info for g in groups for r in g.rollouts]
    assert {(i["scorer"], i["scorer_version"]) for i in infos} == {(RM, VERSION)}
    # A replay loads no scorer: one that would refuse changes nothing.
    use_test_reward_model(monkeypatch, refuse="a replay must not load the reward model")
    assert train_main(["--replay", str(rec_dir)]) == 0
    replayed = read_metrics(rec_dir / "replay")
    assert len(replayed) == len(recorded) == 2
    for a, b in zip(recorded, replayed, strict=True):
        assert b["reward/mean"] == a["reward/mean"]
        assert b["reward/scorer"] == a["reward/scorer"] == LABEL
        assert "time/reward_s" not in b and "mem/reward_model_gb" not in b
        for key in recording.COMPARED_KEYS:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_a_saved_reward_model_scores_a_run(tmp_path):
    """The real loader: a tiny reward model saved as the training command saves one scores
    an async run; its name and weights' version are in the record."""
    path = save_tiny_reward_model(tmp_path / "rm")
    cfg = reward_model_cfg(tmp_path, "async")
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, reward=f"model:{path}"))
    records = run(cfg)
    assert [r["version"] for r in records] == [1, 2]
    name, _, version = records[0]["reward/scorer"].partition("@")
    assert name == f"model:{path}" and version
    for r in records:
        assert np.isfinite(r["loss/total"]) and np.isfinite(r["reward/mean"])
        assert r["reward/scorer"] == records[0]["reward/scorer"]
        assert r["mem/reward_model_gb"] > 0
    assert sum(r["time/reward_s"] for r in records) > 0


def test_a_saved_reward_model_with_another_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    path = save_tiny_reward_model(tmp_path / "rm")
    cfg = reward_model_cfg(tmp_path, "sync")
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, reward=f"model:{path}"))
    other = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab={"a": 0, "?": 1}, unk_token="?"))
    )
    policy = LoadedModel(config=None, params=None, tokenizer=other)
    with pytest.raises(ValueError, match=r"task\.reward='model:.*tokenizer mismatch"):
        build_run(cfg, policy, task=LetterTask())
    assert not Path(cfg.run_dir).exists()
