"""A learned reward model: the decoder trunk with a scalar head, and its checkpoints.

Model layer (pure core): imports only the core, model and parallel layers.

The reward model is Hugging Face's `LlamaForSequenceClassification` (or the Qwen2 / Qwen3
one) with one label: the decoder's final-norm hidden states (`decoder.hidden_states`), a
bias-free linear head ``score`` ([D] -> 1), read at each sequence's last real token. Which
token is last comes from an explicit `lengths` array (right padding), never from looking
for the pad token, so a completion that happens to contain the pad id scores the same.

Its parameters are the decoder's tree without the lm_head plus ``score/kernel`` [D, 1]; its
`ModelConfig` has ``tie_embeddings=True`` so nothing expects an lm_head (the decoder reads
only ``embed``, ``layers`` and ``final_norm``). It is made from a policy by name
(`init_reward_model`: ``tiny``, ``smollm2``, a checkpoint directory; the head zero or
small-normal), or read from a sequence-classification checkpoint (`load_reward_checkpoint`),
and written back in that format (`save_reward_checkpoint`) so transformers reads it too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax.model import checkpoint_io
from a3po_jax.model.checkpoint_io import CheckpointError
from a3po_jax.model.config import ModelConfig, Params
from a3po_jax.model.decoder import hidden_states

# config.json "architectures" of a reward checkpoint -> the causal model of the same trunk.
SEQUENCE_CLASSIFICATION_ARCHITECTURES = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
SCORE_TENSOR = "score.weight"  # HF's `nn.Linear(hidden, num_labels, bias=False)`: [1, D]
# Written beside the weights by the training command; what `reward_model_info` reads.
INFO_FILE = "reward_model.json"


@dataclasses.dataclass
class RewardModel:
    """A reward model ready to run: trunk architecture, parameters, tokenizer."""

    config: ModelConfig  # the trunk; tie_embeddings=True (there is no lm_head)
    params: Params  # embed, layers, final_norm, score/kernel [D, 1]
    tokenizer: Any  # a transformers tokenizer, or None when the checkpoint has none
    pad_token_id: int  # written to config.json (transformers needs one for batches)
    base: str  # what it was made from: a model name or a checkpoint directory


def trunk_config(config: ModelConfig) -> ModelConfig:
    """`config` without an lm_head: the reward model's trunk."""
    return dataclasses.replace(config, tie_embeddings=True)


def init_score_head(config: ModelConfig, key: jax.Array | None, *, std: float = 0.0) -> Params:
    """``{"kernel": [D, 1]}``: zeros (every pair starts at margin 0, loss log 2) or, with
    `std` > 0 and a key, normal(std)."""
    dtype = jnp.dtype(config.param_dtype)
    if std > 0:
        if key is None:
            raise ValueError("init_score_head: std > 0 needs a key")
        kernel = std * jax.random.normal(key, (config.d_model, 1), jnp.float32)
    else:
        kernel = jnp.zeros((config.d_model, 1), jnp.float32)
    return {"kernel": kernel.astype(dtype)}


def reward_params_from_policy(
    params: Params, config: ModelConfig, key: jax.Array | None = None, *, head_std: float = 0.0
) -> tuple[ModelConfig, Params]:
    """A policy's (config, params) -> the reward model's: the lm_head dropped (a tied
    model's embedding table stays, as the trunk's input), a fresh score head added."""
    trunk = {name: params[name] for name in ("embed", "layers", "final_norm")}
    trunk["score"] = init_score_head(config, key, std=head_std)
    return trunk_config(config), trunk


def init_reward_model(
    name: str,
    *,
    seed: int = 0,
    head_std: float = 0.0,
    param_dtype: str = "float32",
    compute_dtype: str = "float32",
    remat: bool = False,
) -> RewardModel:
    """A reward model to train: from a policy (`loader.load_model`'s names: ``tiny``,
    ``smollm2``, a causal-LM checkpoint directory, a .gguf) with a new head, or, when
    `name` is a sequence-classification checkpoint directory, that checkpoint as it is.

    Raises:
      FileNotFoundError: naming the model when `name` is none of these.
      CheckpointError: for a checkpoint that does not fit.
    """
    numerics = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat)
    if is_reward_checkpoint(name):
        return load_reward_checkpoint(name, **numerics)
    from a3po_jax.model.loader import load_model

    policy = load_model(name, seed=seed, **numerics)
    key = jax.random.fold_in(jax.random.key(seed), 1)  # not the tiny trunk's own init key
    config, params = reward_params_from_policy(policy.params, policy.config, key, head_std=head_std)
    return RewardModel(config, params, policy.tokenizer, _pad_id(policy.tokenizer), name)


def _pad_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its EOS id, else 0: transformers needs one to batch."""
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    return 0


# ---------------------------------------------------------------------------------------------
# The forward pass


def reward_scores(
    params: Params, tokens: jax.Array, lengths: jax.Array, *, config: ModelConfig
) -> jax.Array:
    """Scores of right-padded sequences: the head at each row's last real token.

    Args:
      params: the reward model's parameters.
      tokens: [B, T] int32, right-padded (what is past a row's length is never attended to).
      lengths: [B] int32, the number of real tokens per row; a row of length 0 (a batch
        filler) scores the head at position 0, a value to mask out.
      config: the trunk's architecture.
    Returns:
      [B] float32 scores.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
    hidden, _ = hidden_states(params, tokens, positions, config=config, segment_ids=segment_ids)
    last = jnp.clip(lengths - 1, 0, t - 1)
    pooled = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, D]
    return jnp.dot(pooled, params["score"]["kernel"].astype(jnp.float32))[:, 0]


# ---------------------------------------------------------------------------------------------
# Sequence-classification checkpoints


def read_reward_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """`path/config.json` of a reward checkpoint, checked to be one.

    Raises:
      CheckpointError: naming the path: no config.json, not JSON, not a
        sequence-classification architecture, or more than one label.
    """
    config_file = pathlib.Path(path) / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read config.json ({err})") from err
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file} is not a JSON object")
    architectures = raw.get("architectures") or []
    if not any(a in SEQUENCE_CLASSIFICATION_ARCHITECTURES for a in architectures):
        raise CheckpointError(
            f"{path} is not a reward model: config.json architectures {architectures!r}, "
            f"expected one of {sorted(SEQUENCE_CLASSIFICATION_ARCHITECTURES)}"
        )
    labels = raw.get("num_labels", len(raw.get("id2label") or {0: "LABEL_0"}))
    if labels != 1:
        raise CheckpointError(f"{path}: a reward model has one label, config.json has {labels}")
    return raw


def is_reward_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory whose config.json names a sequence-classification
    architecture (no error for anything else)."""
    try:
        read_reward_config_json(path)
    except (CheckpointError, TypeError):
        return False
    return True


def load_reward_checkpoint(
    path: str | os.PathLike,
    *,
    param_dtype: str = "float32",
    compute_dtype: str | None = None,
    with_tokenizer: bool = True,
    **overrides,
) -> RewardModel:
    """Read a sequence-classification checkpoint (config.json + *.safetensors, tokenizer
    files when `with_tokenizer`) without torch.

    Raises:
      CheckpointError: naming the path, for anything that is not a one-label Llama /
        Qwen2 / Qwen3 sequence-classification checkpoint with every tensor in place.
    """
    path = pathlib.Path(path)
    raw = read_reward_config_json(path)
    causal = dict(raw)
    causal["architectures"] = [
        SEQUENCE_CLASSIFICATION_ARCHITECTURES.get(a, a) for a in raw["architectures"]
    ]
    config = checkpoint_io.config_from_hf_json(
        causal,
        path / "config.json",
        param_dtype=param_dtype,
        compute_dtype=compute_dtype,
        **{**overrides, "tie_embeddings": True},
    )

    index, get_tensor = checkpoint_io.safetensors_reader(path)
    if SCORE_TENSOR not in index:
        raise CheckpointError(f"{path}: no {SCORE_TENSOR!r} tensor (not a reward model)")

    params = checkpoint_io.hf_tensors_to_params(
        get_tensor, [n for n in index if n != SCORE_TENSOR], config
    )
    score = get_tensor(SCORE_TENSOR)
    if tuple(score.shape) != (1, config.d_model):
        raise CheckpointError(
            f"{path}: tensor {SCORE_TENSOR!r} has shape {tuple(score.shape)}, expected "
            f"(1, {config.d_model})"
        )
    kernel = np.ascontiguousarray(score.T).astype(jnp.dtype(config.param_dtype))
    params["score"] = {"kernel": jnp.asarray(kernel)}
    tokenizer = None
    if with_tokenizer and (
        (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    ):
        tokenizer = checkpoint_io.load_tokenizer(path)
    pad = raw.get("pad_token_id")
    pad = pad if isinstance(pad, int) else _pad_id(tokenizer)
    return RewardModel(config, params, tokenizer, pad, str(path))


def save_reward_checkpoint(model: RewardModel, path: str | os.PathLike) -> pathlib.Path:
    """Write `model` as a Hugging Face sequence-classification checkpoint (config.json,
    model.safetensors and, when the model has one, its tokenizer's files), which
    `load_reward_checkpoint` and transformers' `AutoModelForSequenceClassification` read."""
    from safetensors.numpy import save_file

    config = model.config
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = checkpoint_io.hf_config_from(config)
    causal = checkpoint_io.hf_architecture(config)
    arch = next(k for k, v in SEQUENCE_CLASSIFICATION_ARCHITECTURES.items() if v == causal)
    hf_config.architectures = [arch]
    hf_config.num_labels = 1
    hf_config.pad_token_id = int(model.pad_token_id)
    hf_config.tie_word_embeddings = False  # no lm_head to tie
    hf_config.to_json_file(str(path / "config.json"))
    trunk = {k: v for k, v in model.params.items() if k != "score"}
    tensors = checkpoint_io.params_to_hf_tensors(trunk, config)
    tensors[SCORE_TENSOR] = np.ascontiguousarray(np.asarray(model.params["score"]["kernel"]).T)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(path))
    return path


def weights_version(path: str | os.PathLike) -> str:
    """A short content hash of a checkpoint's config.json and safetensors files: the same
    files give the same version wherever they are copied."""
    path = pathlib.Path(path)
    digest = hashlib.sha256()
    for file in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def reward_model_info(path: str | os.PathLike) -> dict[str, Any] | None:
    """The training command's `reward_model.json` beside the weights, or None."""
    info = pathlib.Path(path) / INFO_FILE
    return json.loads(info.read_text()) if info.is_file() else None
