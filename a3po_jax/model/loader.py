"""The one way to build a model by name (model layer): config, parameters and tokenizer.

The trainer (`training.trainer.load_policy`, which `a3po-train` and
`python -m a3po_jax.cli.evaluate` use) and the gRPC inference server
(`inference.grpc_server.load_model`, `python -m a3po_jax.cli.serve --model`) all call
`load_model`, so one name builds the same model everywhere:

* ``"tiny"``: `ModelConfig.tiny` with random weights from `seed`, the character tokenizer
  and ``max_seq_len=TINY_MAX_SEQ_LEN`` (tests and smoke runs);
* ``"smollm2"``: SmolLM2-135M-Instruct from the offline cache (`assets.prepare_smollm2`);
* a Hugging Face checkpoint directory (config.json + *.safetensors + tokenizer files);
* a ``.gguf`` file (config from its metadata, tensors dequantised, tokenizer rebuilt).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import jax

from a3po_jax.model.config import ModelConfig, Params
from a3po_jax.model.decoder import init_params

# The longest position a "tiny" model serves and trains on: long enough for the toy tasks'
# prompts plus their completion budgets (a 512-token rollout on a 256-token bucket fits).
TINY_MAX_SEQ_LEN = 1024
MODEL_NAMES = "'tiny', 'smollm2', a Hugging Face checkpoint directory or a .gguf file"


def check_model_name(name: str) -> pathlib.Path | None:
    """The checkpoint path ``name`` names (None for "tiny" and "smollm2"), checked without
    reading any weights, so a run can refuse a bad ``model.name`` before it starts.

    Raises:
      FileNotFoundError: naming `model.name` when `name` is none of the names, or a
        checkpoint this process cannot read.
    """
    if name in ("tiny", "smollm2"):
        return None
    try:
        path = pathlib.Path(name).expanduser()
        is_gguf = path.suffix == ".gguf" and path.is_file()
        found = is_gguf or (path / "config.json").is_file()
    except (OSError, ValueError):  # a name too long for the filesystem, a NUL byte
        found = False
    if not found:
        raise FileNotFoundError(
            f"model.name={name!r}: not {MODEL_NAMES} (no such file, or a directory "
            "without config.json)"
        )
    readable = path if is_gguf else path / "config.json"
    if not os.access(readable, os.R_OK):
        raise FileNotFoundError(f"model.name={name!r}: {readable} is not readable")
    return path


def load_model_config(
    name: str, *, param_dtype: str = "float32", compute_dtype: str = "float32", remat: bool = False
) -> ModelConfig:
    """The `ModelConfig` `load_model(name, ...)` would build, read without any weights (a
    checkpoint's config.json, a .gguf's metadata; SmolLM2's known architecture, so that its
    cache need not be prepared): what a run checks its placement against before loading.

    Raises:
      FileNotFoundError: as `check_model_name`.
      ValueError: a config the loader would refuse (`checkpoint_io.CheckpointError`).
    """
    numerics = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat)
    if name == "tiny":
        return ModelConfig.tiny(max_seq_len=TINY_MAX_SEQ_LEN, **numerics)
    from a3po_jax.model import assets, checkpoint_io

    if name == "smollm2":
        return assets.smollm2_config(**numerics)
    path = check_model_name(name)
    if path.suffix == ".gguf":
        import gguf

        from a3po_jax.model import gguf_io

        return gguf_io.gguf_config(gguf.GGUFReader(str(path)), **numerics)
    return checkpoint_io.load_hf_config(path, **numerics)


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run: its architecture, its parameters and its tokenizer."""

    config: ModelConfig  # architecture and numerics (dtypes, remat) as loaded
    params: Params  # nested-dict parameters in config.param_dtype
    tokenizer: Any  # a transformers tokenizer; for "tiny" the character tokenizer (same API)


def load_model(
    name: str,
    *,
    param_dtype: str = "float32",
    compute_dtype: str = "float32",
    remat: bool = False,
    seed: int = 0,
) -> LoadedModel:
    """Build the model `name` names (see the module docstring for the names).

    Args:
      name: "tiny", "smollm2", a checkpoint directory or a .gguf path ("~" is expanded).
      param_dtype: parameter storage dtype ("float32", "bfloat16" or "float16").
      compute_dtype: matmul dtype; norms, softmax and logits stay float32.
      remat: rematerialise each layer's activations in the backward pass.
      seed: init seed of the random "tiny" model (ignored for checkpoints).
    Returns:
      LoadedModel(config, params, tokenizer).
    Raises:
      FileNotFoundError naming `model.name` when `name` is none of these.
    """
    numerics = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat)
    if name == "tiny":
        from a3po_jax.model.char_tokenizer import char_tokenizer

        config = ModelConfig.tiny(max_seq_len=TINY_MAX_SEQ_LEN, **numerics)
        return LoadedModel(config, init_params(config, jax.random.key(seed)), char_tokenizer())

    from a3po_jax.model import assets, checkpoint_io, gguf_io

    path = assets.prepare_smollm2() if name == "smollm2" else check_model_name(name)
    if path.suffix == ".gguf":
        config, params = gguf_io.load_gguf(path, **numerics)
    else:
        config, params = checkpoint_io.load_hf_checkpoint(path, **numerics)
    return LoadedModel(config, params, checkpoint_io.load_tokenizer(path))
