"""`python -m a3po_jax.cli.train_reward`: refusals are one stderr line with exit code 2 and
write nothing; a whole run on a synthetic preference set (the chosen side carries a marker
character) lowers the held-out loss from log 2 and raises the held-out pair accuracy from
0.5, writes a reward model `load_reward_scorer` reads, and a resumed run ends where an
uninterrupted one does."""

import json
import math
import random

import numpy as np
import pytest

from a3po_jax.cli.train_reward import main


def _pairs_file(tmp_path, n=64, seed=0):
    """n prompts, one pair each: the chosen completion has "!" where the rejected has "."."""
    rng = random.Random(seed)
    words = ["cat", "dog", "sun", "tree", "box", "red", "blue", "run", "sit", "map"]
    path = tmp_path / "pairs.jsonl"
    with path.open("w") as f:
        for i in range(n):
            prompt = f"Item {i}: " + " ".join(rng.choice(words) for _ in range(3))
            base = " ".join(rng.choice(words) for _ in range(4))
            chosen, rejected = (base + " !", base + " .") if i % 2 else ("! " + base, ". " + base)
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return path


def _refusal(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("python -m a3po_jax.cli.train_reward: "), err
    return last


def test_a_malformed_line_is_refused_by_line_and_field_before_anything_is_written(tmp_path, capsys):
    path = _pairs_file(tmp_path, n=3)
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({"prompt": "p", "chosen": ["not", "text"], "rejected": "b"})
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert main(["--pairs", str(path), "--model", "tiny", "--out", str(out)]) == 2
    assert "pairs.jsonl:2: field 'chosen' must be a string" in _refusal(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--lr", "0"], "--lr must be finite and > 0"),
        (["--holdout-fraction", "1"], "--holdout-fraction must be in [0, 1)"),
        (["--pairs", "/no/such.jsonl"], "--pairs /no/such.jsonl: no such file"),
        (["--model", "/no/such/model"], "--model /no/such/model"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(tmp_path, capsys, flags, message):
    argv = ["--pairs", str(_pairs_file(tmp_path, n=8)), "--model", "tiny"]
    argv += ["--out", str(tmp_path / "out"), "--holdout-fraction", "0.5", *flags]
    assert main(argv) == 2
    assert message in _refusal(capsys)


def test_an_out_dir_with_checkpoints_needs_resume(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoints" / "10").mkdir(parents=True)
    argv = ["--pairs", str(_pairs_file(tmp_path, n=8)), "--model", "tiny", "--out", str(out)]
    assert main([*argv, "--holdout-fraction", "0.5"]) == 2
    assert "pass --resume" in _refusal(capsys)


def _train(pairs, out, *extra):
    argv = ["--pairs", str(pairs), "--model", "tiny", "--out", str(out), "--batch-size", "8"]
    argv += ["--lr", "1e-3", "--holdout-fraction", "0.25", "--max-length", "128"]
    return main([*argv, "--log-every", "10", *extra])


@pytest.mark.e2e
def test_training_lowers_held_out_loss_and_the_scorer_reads_the_result(tmp_path, capsys):
    from a3po_jax.tasks.reward_model_scorer import load_reward_scorer

    pairs, out = _pairs_file(tmp_path), tmp_path / "rm"
    assert _train(pairs, out, "--steps", "30") == 0
    printed = capsys.readouterr().out
    assert "held-out before training: pair accuracy 0.500, loss 0.6931" in printed
    assert "step 30/30  loss" in printed
    info = json.loads((out / "reward_model.json").read_text())
    before, after = info["held_out_before"], info["held_out_after"]
    assert before["loss"] == pytest.approx(math.log(2), rel=1e-5) and before["accuracy"] == 0.5
    assert after["loss"] < 0.5 * before["loss"] and after["accuracy"] >= 0.9
    assert info["pairs"] == 64 and info["held_out_pairs"] == after["pairs"] > 0
    assert info["base_model"] == "tiny" and info["steps"] == 30

    scorer = load_reward_scorer(out, max_length=128)
    assert scorer.version == info["version"]
    from a3po_jax.tasks.preference_pairs import load_preference_pairs

    loaded = load_preference_pairs(pairs)
    chosen = scorer.score([p.prompt for p in loaded], [p.chosen for p in loaded])
    rejected = scorer.score([p.prompt for p in loaded], [p.rejected for p in loaded])
    assert np.mean(chosen > rejected) >= 0.9


@pytest.mark.e2e
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, capsys):
    from safetensors.numpy import load_file

    pairs = _pairs_file(tmp_path)
    assert _train(pairs, tmp_path / "straight", "--steps", "20") == 0
    assert _train(pairs, tmp_path / "halves", "--steps", "10", "--checkpoint-every", "5") == 0
    # A resume with other settings, or past the steps it asks for, is refused.
    assert _train(pairs, tmp_path / "halves", "--steps", "20", "--resume", "--seed", "1") == 2
    assert _train(pairs, tmp_path / "halves", "--steps", "5", "--resume") == 2
    assert _train(pairs, tmp_path / "halves", "--steps", "20", "--resume") == 0
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    halves = load_file(tmp_path / "halves" / "model.safetensors")
    for name, value in straight.items():
        np.testing.assert_allclose(halves[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    info = json.loads((tmp_path / "halves" / "reward_model.json").read_text())
    assert info["steps"] == 20
    err = capsys.readouterr().err
    assert "--resume: " in err and "other settings (['seed'])" in err
    assert "is at step 10, past --steps 5" in err
