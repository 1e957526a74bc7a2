"""`load_reward_scorer`: what the pipeline's reward stage calls.

It refuses a missing path, a checkpoint that is not a reward model and a tokenizer other
than the reward model's, each with a ValueError naming the path; its scores equal the
model's own forward pass on the shared tokenization (`reward_model_tokens`); a second call
in the same length bucket compiles nothing; the version is the weights' content hash.
"""

import shutil

import jax
import numpy as np
import pytest

from a3po_jax.model import ModelConfig, init_params
from a3po_jax.model.char_tokenizer import char_tokenizer
from a3po_jax.model.checkpoint_io import save_hf_checkpoint
from a3po_jax.model.reward_model import (
    RewardModel,
    reward_params_from_policy,
    reward_scores,
    save_reward_checkpoint,
)
from a3po_jax.tasks.reward_model_scorer import (
    bucket_for,
    length_buckets,
    load_reward_scorer,
    pad_rows,
    reward_model_tokens,
)
from a3po_jax.tasks.task import Prompt, render_prompt

CONFIG = ModelConfig.tiny(max_seq_len=256)


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    config, params = reward_params_from_policy(
        init_params(CONFIG, jax.random.key(0)), CONFIG, jax.random.key(1), head_std=0.3
    )
    tokenizer = char_tokenizer()
    model = RewardModel(config, params, tokenizer, tokenizer.pad_token_id, "tiny")
    return save_reward_checkpoint(model, tmp_path_factory.mktemp("rm") / "rm")


def _prompt(i, text):
    return Prompt(f"t/{i}", ({"role": "user", "content": text},), "")


def test_tokens_are_the_rendered_prompt_then_the_completion():
    tok = char_tokenizer()
    prompt = _prompt(0, "2+3?")
    ids = reward_model_tokens(tok, prompt, "5<|im_end|>")
    rendered = render_prompt(tok, prompt)
    assert ids[: len(rendered)] == rendered
    assert ids[len(rendered) :] == tok.encode("5<|im_end|>", add_special_tokens=False)


def test_padding_keeps_the_last_tokens():
    assert length_buckets(100) == (32, 64, 100) and length_buckets(32) == (32,)
    tokens, lengths = pad_rows([[1, 2, 3, 4, 5], [6]], 3, batch=3, pad_id=9)
    np.testing.assert_array_equal(tokens, [[3, 4, 5], [6, 9, 9], [9, 9, 9]])
    np.testing.assert_array_equal(lengths, [3, 1, 0])


def test_scores_equal_the_models_forward_and_do_not_recompile(reward_dir):
    scorer = load_reward_scorer(reward_dir, tokenizer=char_tokenizer(), max_length=64)
    assert scorer.name == f"model:{reward_dir}" and len(scorer.version) == 12
    prompts = [_prompt(i, f"What is {i} + {i}?") for i in range(5)]
    texts = ["2", "The answer is 4.", "", "6<|im_end|>", "eight " * 3]
    scores = scorer.score(prompts, texts)
    assert scores.dtype == np.float32 and scores.shape == (5,)
    rows = [
        reward_model_tokens(scorer.tokenizer, p, t) for p, t in zip(prompts, texts, strict=True)
    ]
    tokens, lengths = pad_rows(rows, 64)
    direct = reward_scores(scorer.model.params, tokens, lengths, config=scorer.model.config)
    np.testing.assert_allclose(scores, np.asarray(direct), rtol=1e-5, atol=1e-6)
    assert len(set(scores.tolist())) == 5  # each row read at its own last token
    compiled = scorer._scores._cache_size()
    again = scorer.score(prompts[::-1], texts[::-1])
    np.testing.assert_allclose(again, scores[::-1], rtol=1e-5, atol=1e-6)
    assert scorer._scores._cache_size() == compiled


def test_a_bad_path_is_refused_naming_it(tmp_path, reward_dir):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=rf"reward model '{missing}': no such directory"):
        load_reward_scorer(missing)
    causal = tmp_path / "causal"
    save_hf_checkpoint(init_params(CONFIG, jax.random.key(0)), CONFIG, causal)
    with pytest.raises(ValueError, match=r"'.*causal'.*is not a reward model"):
        load_reward_scorer(causal)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(reward_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no_weights.*no \*\.safetensors"):
        load_reward_scorer(no_weights)


def test_a_different_tokenizer_is_a_tokenizer_mismatch(reward_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Same size as the character tokenizer, other ids: only the probes tell them apart.
    ours = char_tokenizer()
    vocab = {tok: (i + 5) % len(ours) for tok, i in ours.get_vocab().items()}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    shuffled = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
    assert len(shuffled) == len(ours)
    with pytest.raises(ValueError, match=r"reward model '.*': tokenizer mismatch"):
        load_reward_scorer(reward_dir, tokenizer=shuffled)
    smaller = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab={"a": 0, "?": 1}, unk_token="?"))
    )
    with pytest.raises(ValueError, match=r"tokenizer mismatch: .*vocabulary size 2"):
        load_reward_scorer(reward_dir, tokenizer=smaller)


def test_a_short_batch_is_padded_to_the_next_power_of_two_rows_not_to_the_batch_size(
    reward_dir,
):
    scorer = load_reward_scorer(reward_dir, tokenizer=char_tokenizer(), max_length=64)
    assert scorer.row_buckets == (1, 2, 4, 8, 16)
    assert [bucket_for(n, scorer.row_buckets) for n in (1, 2, 3, 5, 16)] == [1, 2, 4, 8, 16]
    assert bucket_for(9, length_buckets(12, smallest=1)) == 12
    shapes, scores_fn = [], scorer._scores
    scorer._scores = lambda params, tokens, lengths: (
        shapes.append(tokens.shape) or scores_fn(params, tokens, lengths)
    )
    prompts = [_prompt(i, f"What is {i} + 1?") for i in range(18)]
    texts = [f"{i + 1} is the answer" for i in range(18)]
    together = scorer.score(prompts, texts)
    assert [rows for rows, _ in shapes] == [16, 2]  # 18 rows: a full pass and one of 2
    shapes.clear()
    pair = scorer.score(prompts[:2], texts[:2])  # a group of G = 2, as the reward stage sends
    assert [rows for rows, _ in shapes] == [2]
    np.testing.assert_allclose(pair, together[:2], rtol=1e-5, atol=1e-6)
