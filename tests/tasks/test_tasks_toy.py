"""The `letters` toy task: deterministic prompts, splits, scoring, registry, learnability."""

import numpy as np
import pytest

from a3po_jax.tasks import Prompt, RewardConfig, Task, make_task, shaped_reward
from a3po_jax.tasks.toy import TEST_SEED_OFFSET, LetterTask


def prompt_for(target: str) -> Prompt:
    return Prompt(
        "letters/train/0", ({"role": "user", "content": "x"},), target, {"target": target}
    )


# --- prompts and splits ------------------------------------------------------------------


def test_prompts_are_deterministic_and_sized():
    a, b = (
        LetterTask(letters="abc", train_size=20, test_size=7),
        LetterTask(letters="abc", train_size=20, test_size=7),
    )
    assert [p.to_json() for p in a.prompts("train")] == [p.to_json() for p in b.prompts("train")]
    assert len(a.prompts("train")) == 20 and len(a.prompts("test")) == 7
    assert [p.prompt_id for p in a.prompts("test")[:2]] == ["letters/test/0", "letters/test/1"]
    # Same object on the second call: the iterator and checkpoints index into one sequence.
    assert a.prompts("train") is a.prompts("train")


def test_prompt_is_a_pure_function_of_seed_split_and_index():
    task = LetterTask(letters="abcdefgh", seed=3, train_size=50)
    # Prompt i of train is generated from seed + i; the test split from seed + offset + i,
    # so building prompt 7 alone gives the same prompt as the split's element 7.
    assert task.make_prompt("train", 7) == task.prompts("train")[7]
    # The test split is drawn from other generator seeds, not a copy of the train split.
    test = task.prompts("test")
    assert [p.messages for p in test] != [p.messages for p in task.prompts("train")[: len(test)]]
    # A different seed shifts the generator: train prompt i of seed 4 is prompt i+1 of seed 3
    # (documents the seed arithmetic; the test split is far away at TEST_SEED_OFFSET).
    shifted = LetterTask(letters="abcdefgh", seed=4, train_size=50)
    assert shifted.prompts("train")[0].messages == task.prompts("train")[1].messages
    assert TEST_SEED_OFFSET > 50


def test_targets_come_from_the_letters_and_the_prompt_names_its_target():
    task = LetterTask(letters="xyz", train_size=60)
    targets = {p.metadata["target"] for p in task.prompts("train")}
    assert targets == {"x", "y", "z"}  # 60 draws from 3 letters cover all of them
    for p in task.prompts("train"):
        assert p.answer == p.metadata["target"]
        assert f"letter {p.answer} " in p.messages[-1]["content"]
    single = LetterTask()  # default: one target, the easiest setting
    assert {p.answer for p in single.prompts("test")} == {"a"}


def test_prompts_fit_the_toy_prefill_bucket():
    # The toy experiments pad prompts to 64 characters with the ChatML template around the
    # question (~44 characters of template): the question must stay short.
    from a3po_jax.model.char_tokenizer import char_tokenizer
    from a3po_jax.tasks import render_prompt

    tok = char_tokenizer()
    task = LetterTask(letters="abcdefghijklmnopqrstuvwxyz", train_size=100)
    assert max(len(render_prompt(tok, p)) for p in task.prompts("train")) <= 64


# --- scoring ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,target,expected",
    [
        ("aaab", "a", 0.75),  # 3 of 4 characters
        ("aaaa", "a", 1.0),
        ("bbbb", "a", 0.0),
        ("", "a", 0.0),  # an empty completion earns nothing (not 0/0)
        ("a a", "a", 2 / 3),  # spaces count as characters: the reward asks for only-letter text
        ("AAAa", "a", 0.25),  # case matters: 'A' is not 'a'
        ("xyzx", "x", 0.5),
    ],
)
def test_score_is_the_fraction_of_target_characters(text, target, expected):
    assert LetterTask().score(prompt_for(target), text) == pytest.approx(expected)


def test_format_ok_and_extract_answer():
    task = LetterTask()
    assert task.format_ok("aaa") and task.format_ok(" ab c ")
    assert not task.format_ok("") and not task.format_ok("   ") and not task.format_ok("a1")
    p = prompt_for("a")
    assert task.extract_answer(p, "abbb") == "b"
    assert task.extract_answer(p, "abab") == "a"  # ties go to the alphabetically first letter
    assert task.extract_answer(p, "123 !") is None


def test_shaped_reward_marks_all_target_completions_correct():
    task = LetterTask()
    reward, info = shaped_reward(
        task, prompt_for("a"), "aaaa", finished=True, num_tokens=5, config=RewardConfig()
    )
    assert reward == 1.0 and info["correct"] == 1
    reward, info = shaped_reward(
        task,
        prompt_for("a"),
        "aab",
        finished=False,
        num_tokens=3,
        config=RewardConfig(no_eos_penalty=0.5),
    )
    assert reward == pytest.approx(2 / 3 - 0.5) and info["correct"] == 0


# --- validation and registry --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(letters=""), "letters must be a non-empty string"),
        (dict(letters="aA"), "distinct lowercase ASCII letters"),
        (dict(letters="aa"), "distinct lowercase ASCII letters"),
        (dict(train_size=0), "train_size must be an int >= 1"),
        (dict(test_size=True), "test_size must be an int >= 1"),
        (dict(seed=-1), "seed must be an int >= 0"),
    ],
)
def test_bad_options_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LetterTask(**kwargs)


def test_unknown_split_is_an_error():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        LetterTask().prompts("dev")


def test_registered_as_letters():
    task = make_task("letters", letters="ab", train_size=4, test_size=2)
    assert isinstance(task, LetterTask) and isinstance(task, Task)
    assert task.name == "letters" and len(task.prompts("train")) == 4


# --- learnability -------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_random_tiny_model_learns_it_in_tens_of_steps(tmp_path):
    """The reason the task exists: the toy experiments' config lifts the reward of a random
    2-layer model several-fold within 25 synchronous steps on a CPU (about a minute)."""
    import dataclasses
    from pathlib import Path

    from a3po_jax.training.config import load_experiment
    from a3po_jax.training.metrics import read_metrics
    from a3po_jax.training.trainer import Trainer, load_policy

    experiment = Path(__file__).parents[2] / "experiments" / "a3po_compare_toy.py"
    cfg = load_experiment(experiment)
    cfg = dataclasses.replace(
        cfg,
        system=dataclasses.replace(cfg.system, mode="sync"),
        steps=25,
        run_dir=str(tmp_path / "run"),
    )
    Trainer(cfg, load_policy(cfg.model), console=False).run()
    rewards = np.asarray([r["reward/mean"] for r in read_metrics(cfg.run_dir)])
    # Uniform sampling over ~99 characters gives ~0.01; learning must lift it well clear.
    assert rewards[:5].mean() < 0.05
    assert rewards[-5:].mean() > 3 * rewards[:5].mean() and rewards[-5:].mean() > 0.1
