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
