"""The offline preference pairs: best against worst of K by the gold scorer, ties left out,
training prompts only; the command on the tiny model."""

import json

import numpy as np
import pytest

from a3po_jax.cli import make_preferences as cli
from a3po_jax.tasks import make_task
from a3po_jax.tasks.scorers import VerifierScorer

TASK = make_task("letters", train_size=8, test_size=4)


def test_best_against_worst_and_ties_left_out():
    prompts = TASK.prompts("train")[:3]
    completions = [["ab", "aaaa", "bbbb", "aaaa"], ["x", "x"], ["", "a"]]
    pairs, ties = cli.preference_pairs(prompts, completions, VerifierScorer(TASK))
    assert ties == 1  # "x" twice: the same score
    first, third = pairs
    assert first["prompt_id"] == prompts[0].prompt_id
    assert first["prompt"] == [dict(m) for m in prompts[0].messages]
    assert (first["chosen"], first["rejected"]) == ("aaaa", "bbbb")
    assert (first["chosen_score"], first["rejected_score"]) == (1.0, 0.0)
    assert (third["chosen"], third["rejected"]) == ("a", "")
    json.dumps(pairs)  # one JSON line each


def test_a_test_prompt_among_the_training_prompts_is_caught():
    class Leaky:
        name = "leaky"

        def prompts(self, split):
            return TASK.prompts("test")  # the same prompts in both splits

    with pytest.raises(AssertionError, match="test-split prompts"):
        cli.training_prompts(Leaky(), 2)
    assert [p.prompt_id for p in cli.training_prompts(TASK, 2)] == [
        "letters/train/0",
        "letters/train/1",
    ]


@pytest.mark.e2e  # a model, a host, sampling
def test_the_command_writes_pairs_from_the_tiny_model(tmp_path, capsys):
    out = tmp_path / "pairs" / "letters.jsonl"
    argv = ["--task", "letters", "--task-options", '{"train_size": 8}', "--model", "tiny"]
    argv += ["--prompts", "4", "--samples", "8", "--max-new-tokens", "24", "--num-slots", "8"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    said = capsys.readouterr().out
    assert f"{len(lines)} pairs from 4 letters/train prompts x 8 samples" in said
    assert "scored by verifier:letters@1" in said
    assert "sampled 4/4 prompts x 8" in said  # the progress line's last
    assert lines, "the random tiny model's samples should differ in their share of 'a's"
    for pair in lines:
        assert pair["prompt_id"].startswith("letters/train/")
        assert pair["chosen_score"] > pair["rejected_score"]
        assert set(pair) == {
            "prompt_id", "prompt", "chosen", "rejected", "chosen_score", "rejected_score"
        }  # fmt: skip
    prompt = TASK.prompts("train")[int(lines[0]["prompt_id"].rsplit("/", 1)[1])]
    assert np.isclose(TASK.score(prompt, lines[0]["chosen"]), lines[0]["chosen_score"])
    assert cli.main([*argv, "--samples", "1", "--out", str(out)]) == 2
    assert "--samples must be >= 2" in capsys.readouterr().err


def test_progress_is_printed_at_each_tenth_and_at_the_end(capsys):
    progress = cli.progress_printer(4)
    for done in range(1, 31):
        progress(done, 30)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == [f"{3 * k}/30" for k in range(1, 11)]
