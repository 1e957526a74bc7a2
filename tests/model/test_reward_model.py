"""The reward model against transformers' `LlamaForSequenceClassification`.

A tiny random sequence-classification model is built in PyTorch with one label and a pad
id, saved with `save_pretrained`, and read through `reward_model.load_reward_checkpoint`;
its scores of right-padded rows of different lengths must equal transformers' pooled
logits. What `save_reward_checkpoint` writes must load back identically and be read by
transformers with the same scores. Nothing is downloaded.
"""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from a3po_jax.model import ModelConfig, init_params  # noqa: E402
from a3po_jax.model.checkpoint_io import CheckpointError, save_hf_checkpoint  # noqa: E402
from a3po_jax.model.reward_model import (  # noqa: E402
    RewardModel,
    init_reward_model,
    is_reward_checkpoint,
    load_reward_checkpoint,
    reward_params_from_policy,
    reward_scores,
    save_reward_checkpoint,
    weights_version,
)

PAD = 0
_SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    num_labels=1,
    pad_token_id=PAD,
)


def _random_hf_reward_model(kind="llama", seed=0):
    """Every parameter random (HF's init leaves norms at one, which would hide a dropped
    norm), the score head included."""
    torch.manual_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(**_SMALL, rope_parameters={"rope_theta": 5000.0})
        cls = transformers.LlamaForSequenceClassification
    else:
        config = transformers.Qwen2Config(**_SMALL)
        cls = transformers.Qwen2ForSequenceClassification
    config._attn_implementation = "eager"
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def _right_padded(vocab, lengths, t=10, seed=0):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(1, vocab, size=(len(lengths), t)).astype(np.int32)  # no pad id inside
    for row, n in enumerate(lengths):
        tokens[row, n:] = PAD
    return tokens, np.asarray(lengths, np.int32)


def _hf_scores(model, tokens, lengths):
    mask = (np.arange(tokens.shape[1])[None] < lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask),
        )
    return out.logits.float().numpy()[:, 0]


def _our_scores(model: RewardModel, tokens, lengths):
    fn = jax.jit(lambda p, t, n: reward_scores(p, t, n, config=model.config))
    return np.asarray(fn(model.params, tokens, lengths))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_scores_equal_transformers(kind, tmp_path):
    hf = _random_hf_reward_model(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_reward_checkpoint(tmp_path)
    assert model.pad_token_id == PAD and model.config.qkv_bias == (kind == "qwen2")
    tokens, lengths = _right_padded(model.config.vocab_size, [10, 7, 3, 1])
    ours, ref = _our_scores(model, tokens, lengths), _hf_scores(hf, tokens, lengths)
    # Scores here are O(1); a wrong pooling position or layout gives O(1) differences.
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_save_roundtrip_and_transformers_reads_it(tmp_path):
    hf = _random_hf_reward_model("llama", seed=1)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    model = load_reward_checkpoint(tmp_path / "hf")
    save_reward_checkpoint(model, tmp_path / "ours")
    again = load_reward_checkpoint(tmp_path / "ours")
    assert again.config == model.config and again.pad_token_id == PAD
    jax.tree.map(np.testing.assert_array_equal, model.params, again.params)
    reread = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    assert type(reread).__name__ == "LlamaForSequenceClassification"
    tokens, lengths = _right_padded(model.config.vocab_size, [9, 4], seed=2)
    np.testing.assert_allclose(
        _hf_scores(reread, tokens, lengths), _hf_scores(hf, tokens, lengths), rtol=1e-6
    )
    # The same files give the same version; other weights another.
    assert weights_version(tmp_path / "ours") == weights_version(tmp_path / "ours")
    assert weights_version(tmp_path / "ours") != weights_version(tmp_path / "hf")


def test_a_pad_id_inside_the_text_does_not_move_the_pooling():
    """Pooling reads the explicit lengths: a row whose last real token is the pad id scores
    there, not at the token before."""
    config = ModelConfig.tiny()
    _, params = reward_params_from_policy(
        init_params(config, jax.random.key(0)), config, jax.random.key(1), head_std=0.5
    )
    tokens = np.array([[5, 6, PAD, 0], [5, 6, 0, 0]], np.int32)
    scores = np.asarray(reward_scores(params, tokens, np.array([3, 2], np.int32), config=config))
    assert scores[0] != scores[1]


def test_init_from_a_policy_has_a_zero_head_and_no_lm_head(tmp_path):
    model = init_reward_model("tiny")
    assert set(model.params) == {"embed", "layers", "final_norm", "score"}
    assert np.all(np.asarray(model.params["score"]["kernel"]) == 0)
    assert model.config.tie_embeddings and model.base == "tiny"
    # An untied causal checkpoint loses its lm_head; saving and reading back needs none.
    config = ModelConfig.tiny(tie_embeddings=False, max_seq_len=64)
    save_hf_checkpoint(init_params(config, jax.random.key(3)), config, tmp_path / "policy")
    model.tokenizer.save_pretrained(str(tmp_path / "policy"))
    from_dir = init_reward_model(str(tmp_path / "policy"), head_std=0.02)
    assert "lm_head" not in from_dir.params
    assert np.asarray(from_dir.params["score"]["kernel"]).std() > 0
    assert not is_reward_checkpoint(tmp_path / "policy")
    save_reward_checkpoint(from_dir, tmp_path / "rm")
    assert is_reward_checkpoint(tmp_path / "rm")
    # A reward checkpoint given as the base is taken as it is.
    reread = init_reward_model(str(tmp_path / "rm"))
    jax.tree.map(np.testing.assert_array_equal, reread.params, from_dir.params)


def test_not_a_reward_checkpoint_is_refused_naming_the_path(tmp_path):
    config = ModelConfig.tiny(max_seq_len=64)
    save_hf_checkpoint(init_params(config, jax.random.key(0)), config, tmp_path / "causal")
    with pytest.raises(CheckpointError, match=r"causal is not a reward model"):
        load_reward_checkpoint(tmp_path / "causal")
    with pytest.raises(CheckpointError, match="missing"):
        load_reward_checkpoint(tmp_path / "missing")
    two = tmp_path / "two_labels"
    two.mkdir()
    raw = json.loads((tmp_path / "causal" / "config.json").read_text())
    raw.update(architectures=["LlamaForSequenceClassification"], num_labels=2)
    (two / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="one label"):
        load_reward_checkpoint(two)
