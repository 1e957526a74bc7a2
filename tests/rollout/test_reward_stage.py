"""The reward stage: the verifier per sample, exactly as shaped_reward scores; a reward
model per whole group in one call, shaped on top, with the gold score and the scorer kept."""

import numpy as np
import pytest
from helpers.scorers import VowelScorer

from a3po_jax.inference.types import SampleResult
from a3po_jax.rollout.scoring import RewardStage, scorer_metrics
from a3po_jax.tasks import RewardConfig, make_task, shaped_reward

G = 3
TASK = make_task("letters", train_size=4)
PROMPT = TASK.prompts("train")[0]
SHAPING = RewardConfig(format_reward=0.25, no_eos_penalty=0.5)


def result(index, text, finish="stop"):
    n = len(text)
    return SampleResult(
        request_id="g7",
        sample_index=index,
        prompt_tokens=(1, 2),
        tokens=tuple(range(3, 3 + n)),
        logprobs=(-1.0,) * n,
        versions=(0,) * n,
        finish_reason=finish,
    )


SAMPLES = [(result(0, "aaxa"), "aaxa"), (result(1, "eo", "length"), "eo"), (result(2, "b"), "b")]


def test_the_verifier_scores_each_sample_as_it_arrives_as_before():
    stage = RewardStage(None, task=TASK, config=SHAPING, group_size=G)
    for res, text in SAMPLES:
        (rollout,) = stage.add(res, text, prompt=PROMPT, group_id=7, version=2)
        want, info = shaped_reward(
            TASK, PROMPT, text, finished=res.finish_reason == "stop",
            num_tokens=len(res.tokens), config=SHAPING,
        )  # fmt: skip
        assert rollout.reward == want and rollout.admitted_at_version == 2
        assert rollout.info == {
            **info,
            "num_tokens": len(text),
            "scorer": "verifier:letters",
            "scorer_version": "1",
        }
    assert stage.seconds() > 0


def test_a_model_scores_the_whole_group_in_one_call_with_shaping_on_top():
    scorer = VowelScorer("/rm")
    stage = RewardStage(scorer, task=TASK, config=SHAPING, group_size=G, per_group=True)
    out = []
    for res, text in SAMPLES:
        out.append(stage.add(res, text, prompt=PROMPT, group_id=7, version=0))
    assert out[0] == [] and out[1] == [] and len(out[2]) == G
    assert scorer.calls == [G] and stage.held_samples() == 0
    by_index = {r.sample_index: r for r in out[2]}
    eo = by_index[1]  # all vowels, cut at the budget: the no-EOS penalty applies
    bonus = 0.25 * eo.info["format_ok"]  # the format bonus too
    assert eo.reward == pytest.approx(1.0 + bonus - 0.5)
    assert eo.info["score"] == pytest.approx(1.0) and eo.info["finished"] is False
    assert eo.info["gold_score"] == 0.0 and eo.info["correct"] == 0  # the verifier's
    assert by_index[0].info["gold_score"] == pytest.approx(0.75)
    assert {r.info["scorer"] for r in out[2]} == {"model:/rm"}
    assert {r.info["scorer_version"] for r in out[2]} == {"test-1"}
    assert all(isinstance(r.reward, float) for r in out[2])
    # The step record: the scorer, and over the same samples the gold scorer's mean beside
    # the reward model's own, unshaped, scores ("aaxa" 0.75, "eo" 1, "b" 0 vowels).
    assert scorer_metrics(out[2]) == {
        "reward/scorer": "model:/rm@test-1",
        "reward/gold_score_mean": pytest.approx((0.75 + 0.0 + 0.0) / 3),
        "reward/proxy_score_mean": pytest.approx((0.75 + 1.0 + 0.0) / 3),
    }


def test_a_dropped_group_leaves_nothing_held():
    stage = RewardStage(VowelScorer(), task=TASK, config=RewardConfig(), group_size=G,
                        per_group=True)  # fmt: skip
    for res, text in SAMPLES[:2]:
        assert stage.add(res, text, prompt=PROMPT, group_id=7, version=0) == []
    assert stage.held_samples() == 2
    stage.forget(7)
    assert stage.held_samples() == 0


def test_a_scorer_that_returns_the_wrong_shape_is_named():
    class Broken(VowelScorer):
        def score(self, prompts, texts):
            return np.zeros((len(texts) + 1,), np.float32)

    stage = RewardStage(Broken(), task=TASK, config=RewardConfig(), group_size=1, per_group=True)
    with pytest.raises(ValueError, match="model:test returned shape"):
        stage.add(*SAMPLES[0], prompt=PROMPT, group_id=0, version=0)
