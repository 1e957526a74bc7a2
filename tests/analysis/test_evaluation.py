"""evaluate(): pass@1 / mean@k with standard errors, checked exactly with a fake generate_fn.

The fake "model" reads the rendered prompt back (decoding its token ids), answers the
chain_sum question right or wrong by a rule the test knows, and ends with EOS. The
expected accuracy is computed from the prompts' own metadata, independently of the
render → generate → decode → extract → score path under test.
"""

import math
import re

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from a3po_jax.analysis.evaluation import EvalResult, accuracy_with_stderr, evaluate
from a3po_jax.tasks import ReasoningGymTask, render_prompt


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte, ChatML special tokens, no chat template (ChatML fallback)."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )


TOKENIZER = byte_tokenizer()
TASK = ReasoningGymTask(
    "chain_sum",
    min_terms=2,
    max_terms=2,
    min_digits=1,
    max_digits=1,
    train_size=8,
    test_size=100,
)


def _operands(expression):
    a, op, b = expression.split()
    return int(a), op, int(b)


def sample_is_right(a: int, sample: int) -> bool:
    """The fake model's rule: sample j of a question "a op b" is right iff a + j is even."""
    return (a + sample) % 2 == 0


class FakeGenerate:
    """Answers chain_sum prompts by `sample_is_right`, recording how it was called."""

    def __init__(self, unfinished_every: int = 0):
        self.calls = []
        self.unfinished_every = unfinished_every

    def __call__(self, prompt_token_lists, *, num_samples, temperature, max_new_tokens, seed):
        self.calls.append(
            dict(
                n=len(prompt_token_lists), k=num_samples, t=temperature, m=max_new_tokens, seed=seed
            )
        )
        out = []
        for ids in prompt_token_lists:
            text = TOKENIZER.decode(ids, skip_special_tokens=True)
            a, op, b = _operands(re.search(r"(\d [+-] \d) =", text).group(1))
            gold = a + b if op == "+" else a - b
            samples = []
            for j in range(num_samples):
                answer = gold if sample_is_right(a, j) else gold + 1
                finished = not (self.unfinished_every and j % self.unfinished_every == 1)
                tokens = TOKENIZER.encode(
                    f"{a} {op} {b} = \\boxed{{{answer}}}", add_special_tokens=False
                )
                if finished:
                    tokens = tokens + [TOKENIZER.eos_token_id]  # EOS must not reach the scorer
                samples.append((tokens, finished))
            out.append(samples)
        return out


def _first_operands(n):
    return [
        _operands(p.metadata["entry"]["metadata"]["expression"])[0]
        for p in TASK.prompts("test")[:n]
    ]


def test_greedy_pass_at_1_and_binomial_stderr():
    generate = FakeGenerate()
    result = evaluate(TASK, "test", generate, TOKENIZER, num_prompts=64, max_new_tokens=32)
    assert isinstance(result, EvalResult)
    right = np.array([sample_is_right(a, 0) for a in _first_operands(64)], dtype=float)
    p = right.mean()
    assert 0.2 < p < 0.8  # the split is mixed, so the check below is not trivially 0 or 1
    assert result.n == 64 and result.k == 1 and result.metric == "pass@1"
    assert result.accuracy == pytest.approx(p, abs=1e-12)
    # Binomial standard error sqrt(p(1-p)/n); a sample std (ddof=1) would be larger by
    # sqrt(64/63), so this separates the two.
    assert result.stderr == pytest.approx(math.sqrt(p * (1 - p) / 64), abs=1e-12)
    assert result.pass_at_k == pytest.approx(p)
    assert generate.calls == [dict(n=64, k=1, t=0.0, m=32, seed=0)]
    record = result.records[0]
    assert record.prompt_id == "chain_sum/test/0"
    assert record.completions[0].endswith("}")  # decoded without the EOS token text
    assert record.scores == (float(right[0]),)
    assert record.extracted[0] == re.search(r"boxed\{(-?\d+)\}", record.completions[0]).group(1)
    assert result.finished_fraction == 1.0
    assert "pass@1 = " in result.summary() and "n=64" in result.summary()


def test_mean_at_k_stderr_is_over_prompts_of_per_prompt_means():
    generate = FakeGenerate(unfinished_every=3)
    result = evaluate(
        TASK,
        "test",
        generate,
        TOKENIZER,
        num_prompts=20,
        k=3,
        temperature=1.0,
        seed=7,
        batch_size=8,
    )
    # Per prompt, samples 0..2 are right iff a + j is even: 2/3 of them for even a, 1/3 for odd.
    means = np.array(
        [np.mean([sample_is_right(a, j) for j in range(3)]) for a in _first_operands(20)]
    )
    assert set(np.round(means, 6)) == {round(1 / 3, 6), round(2 / 3, 6)}
    assert result.metric == "mean@3"
    assert result.accuracy == pytest.approx(means.mean(), abs=1e-12)
    assert result.stderr == pytest.approx(means.std() / math.sqrt(20), abs=1e-12)
    # Every prompt has a right sample (a + j is even for some j of 0, 1).
    assert result.pass_at_k == 1.0
    # 20 prompts in batches of 8: three calls with seeds 7, 8, 9.
    assert [(c["n"], c["seed"]) for c in generate.calls] == [(8, 7), (8, 8), (4, 9)]
    assert all(c["k"] == 3 and c["t"] == 1.0 for c in generate.calls)
    # Sample j = 1 of each prompt did not finish: 2/3 of the samples finished.
    assert result.finished_fraction == pytest.approx(2 / 3)
    assert result.records[0].finished == (True, False, True)
    # Accuracy among the finished samples (j = 0 and 2): right iff a is even, so half the
    # prompts' pairs; the unfinished j = 1 samples do not count.
    finished_right = [sample_is_right(a, j) for a in _first_operands(20) for j in (0, 2)]
    assert result.finished_accuracy == pytest.approx(np.mean(finished_right), abs=1e-12)
    assert f"scoring {result.finished_accuracy:.3f}" in result.summary()


def test_generate_fn_receives_rendered_prompts():
    seen = []

    def generate(prompt_token_lists, **kwargs):
        seen.extend(prompt_token_lists)
        return [[([], True)] for _ in prompt_token_lists]

    result = evaluate(TASK, "test", generate, TOKENIZER, num_prompts=3)
    assert seen == [render_prompt(TOKENIZER, p) for p in TASK.prompts("test")[:3]]
    # Empty completions hold no answer: scored 0, extracted None.
    assert result.accuracy == 0.0 and result.stderr == 0.0
    assert result.records[0].extracted == (None,)


def test_accuracy_with_stderr_golden():
    # Two prompts with means 1 and 0.5: accuracy 0.75; deviations ±0.25 → std 0.25,
    # stderr 0.25 / sqrt(2).
    acc, se = accuracy_with_stderr(np.array([[1.0, 1.0], [1.0, 0.0]]))
    assert acc == 0.75 and se == pytest.approx(0.25 / math.sqrt(2))
    with pytest.raises(ValueError, match=r"shape \[N, K\]"):
        accuracy_with_stderr(np.zeros((0, 1)))


def test_evaluate_rejects_bad_arguments_and_bad_generate_output():
    generate = FakeGenerate()
    with pytest.raises(ValueError, match=r"num_prompts must be in \[1, 100\]"):
        evaluate(TASK, "test", generate, TOKENIZER, num_prompts=101)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        evaluate(TASK, "test", generate, TOKENIZER, k=0)
    with pytest.raises(ValueError, match="temperature must be finite"):
        evaluate(TASK, "test", generate, TOKENIZER, temperature=-1.0)

    def too_few_samples(prompt_token_lists, **kwargs):
        return [[([1], True)] for _ in prompt_token_lists]

    with pytest.raises(ValueError, match="returned 1 samples for prompt 0, expected num_samples=2"):
        evaluate(TASK, "test", too_few_samples, TOKENIZER, num_prompts=2, k=2, temperature=1.0)

    def too_few_prompts(prompt_token_lists, **kwargs):
        return [[([1], True)]]

    with pytest.raises(ValueError, match="returned 1 sample lists for 2 prompts"):
        evaluate(TASK, "test", too_few_prompts, TOKENIZER, num_prompts=2)


# --- the command line on a run: it scores what the run trained on ---------------------------


RUN_TASK_OPTIONS = '{"letters": "xyz", "test_size": 5}'


def tiny_run(tmp_path):
    """A run dir of the tiny model trained on `letters` with non-default options: its
    config.json and one checkpoint (the random init: the params do not matter here)."""
    import json

    from a3po_jax.model.loader import load_model
    from a3po_jax.training.checkpointing import CheckpointManager
    from a3po_jax.training.config import (
        ModelSection,
        RolloutSection,
        TaskSection,
        TrainConfig,
    )

    run = tmp_path / "run"
    cfg = TrainConfig(
        model=ModelSection(name="tiny"),
        task=TaskSection(name="letters", options=RUN_TASK_OPTIONS),
        rollout=RolloutSection(max_new_tokens=5),
        eval_prompts=3,
        run_dir=str(run),
    )
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    policy = load_model(cfg.model.name, seed=cfg.model.seed)
    with CheckpointManager(run / "checkpoints", async_save=False) as manager:
        manager.save(
            1, params=policy.params, opt_state={"count": np.zeros(())}, extra={}, force=True
        )
    return run


def test_eval_spec_from_run_config():
    from a3po_jax.analysis.evaluation import EvalSpec
    from a3po_jax.training.config import RolloutSection, TaskSection, TrainConfig

    cfg = TrainConfig(
        task=TaskSection(name="letters", options=RUN_TASK_OPTIONS, split="train"),
        rollout=RolloutSection(max_new_tokens=7),
        eval_prompts=9,
    )
    spec = EvalSpec.from_run_config(cfg)
    # The run's task and budget; the test split (the trainer draws from train).
    assert spec == EvalSpec("letters", RUN_TASK_OPTIONS, "test", 9, 7)
    same, notes = spec.override(task_options='{"test_size":5, "letters":"xyz"}', split=None)
    assert same == spec and notes == []  # the same options written differently
    changed, notes = spec.override(max_new_tokens=3)
    assert changed.max_new_tokens == 3 and notes == ["max_new_tokens: 7 -> 3"]


@pytest.mark.e2e  # the evaluate command whole: the run's model, a host, the scoring
def test_cli_scores_a_run_on_its_own_task_and_budget(tmp_path, capsys):
    import json

    from a3po_jax.cli import evaluate as cli
    from a3po_jax.tasks import make_task

    run = tiny_run(tmp_path)
    out = tmp_path / "result.json"
    assert cli.main(["--run-dir", str(run), "--json", str(out), "--num-slots", "4"]) == 0
    result = json.loads(out.read_text())
    # The run's task with the run's options, not the CLI's chain_sum defaults: the targets
    # x/y/z exist only with letters="xyz" (the default letters task asks for "a").
    expected = make_task("letters", letters="xyz", test_size=5).prompts("test")[:3]
    assert result["task"] == "letters" and result["split"] == "test"
    assert result["n"] == 3  # the run's eval_prompts, not the CLI's 64
    assert [r["prompt_id"] for r in result["records"]] == [p.prompt_id for p in expected]
    assert [r["answer"] for r in result["records"]] == [p.answer for p in expected]
    # The run's generation budget (rollout.max_new_tokens=5), not the CLI's 64.
    lengths = [n for r in result["records"] for n in r["num_tokens"]]
    assert max(lengths) <= 5
    err = capsys.readouterr().err
    assert "overrides" not in err and "from the run's config" in err

    # Flags override explicitly and say so.
    options = '{"letters": "q", "test_size": 4}'
    argv = ["--run-dir", str(run), "--json", str(out), "--num-slots", "4"]
    argv += ["--task-options", options, "--max-new-tokens", "3", "--num-prompts", "2"]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["n"] == 2 and {r["answer"] for r in result["records"]} == {"q"}
    assert max(n for r in result["records"] for n in r["num_tokens"]) <= 3
    err = capsys.readouterr().err
    assert "a flag overrides the run's config: max_new_tokens: 5 -> 3" in err
    assert "a flag overrides the run's config: task_options:" in err
    assert "a flag overrides the run's config: num_prompts: 3 -> 2" in err


def test_cli_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    from a3po_jax.cli import evaluate as cli

    assert cli.main(["--run-dir", str(tmp_path)]) == 2
    assert "no config.json (not a run directory)" in capsys.readouterr().err
    run = tiny_run(tmp_path)
    assert cli.main(["--run-dir", str(run), "--task", "no_such_task"]) == 2
    assert "unknown task 'no_such_task'" in capsys.readouterr().err
