"""task.reward's table: the spec's forms, the verifier as a Scorer, the model loader's refusals."""

import numpy as np
import pytest
from helpers.scorers import VowelScorer, use_test_reward_model

from a3po_jax.tasks import make_task
from a3po_jax.tasks.scorers import (
    REWARD_SOURCES,
    Scorer,
    VerifierScorer,
    parse_reward,
    resolve_scorer,
    scorer_label,
)
from a3po_jax.training.config import ConfigError, TaskSection


def test_the_spec_forms_and_their_refusals_name_the_field():
    assert parse_reward("verifier") == (REWARD_SOURCES["verifier"], None)
    assert parse_reward("model:/ckpt/rm") == (REWARD_SOURCES["model"], "/ckpt/rm")
    assert TaskSection(reward="model:runs/rm").reward == "model:runs/rm"
    for bad in ("model:", "model:  ", "gold", "verifier:x", ""):
        with pytest.raises(ConfigError, match=r"task\.reward .*(verifier|model:PATH)"):
            TaskSection(reward=bad)


def test_the_verifier_scores_as_the_task_does():
    task = make_task("letters", train_size=4)
    scorer, per_group = resolve_scorer("verifier", task=task, tokenizer=None)
    assert isinstance(scorer, Scorer) and isinstance(scorer, VerifierScorer) and not per_group
    assert scorer_label(scorer) == "verifier:letters@1"
    prompts = task.prompts("train")[:3]
    texts = ["aaa", "abab", ""]
    want = [task.score(p, t) for p, t in zip(prompts, texts, strict=True)]
    got = scorer.score(prompts, texts)
    assert got.dtype == np.float64 and got.tolist() == want  # the same floats, exactly


def test_a_model_path_with_nothing_there_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no reward model at"):
        resolve_scorer(f"model:{tmp_path}/missing", task=None, tokenizer=None)


def test_the_model_loader_is_the_seam_and_scores_per_group(monkeypatch):
    loaded = use_test_reward_model(monkeypatch)
    scorer, per_group = resolve_scorer("model:/any", task=None, tokenizer=None)
    assert per_group and loaded == [scorer] and isinstance(scorer, VowelScorer)
    assert scorer.name == "model:/any"
    use_test_reward_model(monkeypatch, refuse="tokenizer mismatch")
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        resolve_scorer("model:/any", task=None, tokenizer=None)
