"""Hugging Face checkpoints in and out of the `model.py` params pytree, and their tokenizers.

Model layer (pure core): imports only the core, model and parallel layers.

Reading never needs torch: `config.json` is read as JSON with the config classes' defaults
(`_HF_CONFIG_DEFAULTS`; transformers' config module would import torch, hundreds of MB),
`*.safetensors` through `safetensors` with numpy (sharded checkpoints follow
`model.safetensors.index.json`); GGUF files are read by `a3po_jax.model.gguf_io` into the
same Hugging Face names. Layers are stacked on a leading L axis as they are read, into one
preallocated array per parameter, so host memory holds about one copy of the model.

The one table `_hf_tensor_specs` says, for every parameter, its Hugging Face name, the shape
it must have there, and how the layouts convert; loading (safetensors and GGUF) and saving
all use it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Callable, Iterable, Mapping
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from a3po_jax.model import ModelConfig, Params

# config.json "architectures" entry -> what differs from plain Llama.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
}
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: unknown architecture, missing or
    mis-shaped tensors."""


# ---------------------------------------------------------------------------------------------
# Config


def _rope_fields(hf_config) -> dict[str, Any]:
    # transformers 5 keeps θ and scaling in `rope_parameters`; 4.x in rope_theta/rope_scaling.
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope = {**scaling, **rope}
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    fields: dict[str, Any] = dict(rope_theta=float(theta))
    if rope_type == "llama3":
        fields.update(
            rope_type="llama3",
            rope_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type != "default":
        raise CheckpointError(
            f"rope scaling type {rope_type!r} is not supported (supported: default, llama3)"
        )
    return fields


def config_from_hf(
    hf_config, *, param_dtype: str = "float32", compute_dtype: str | None = None, **overrides
) -> ModelConfig:
    """A `ModelConfig` from a transformers config object (LlamaConfig, Qwen2Config, ...)."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", "")
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        by_type["qwen3"] = "Qwen3ForCausalLM"
        arch = by_type.get(model_type) if not architectures else None
    if arch is None:
        raise CheckpointError(
            f"unknown architecture {architectures or model_type!r} in config.json; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if getattr(hf_config, "attention_bias", False) and arch == "LlamaForCausalLM":
        raise CheckpointError("LlamaForCausalLM with attention_bias=True is not supported")
    if getattr(hf_config, "mlp_bias", False):
        raise CheckpointError("mlp_bias=True is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise CheckpointError("use_sliding_window=True is not supported (full attention only)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act={hf_config.hidden_act!r} is not supported (silu only)")
    n_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
    fields = dict(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        ffn_dim=hf_config.intermediate_size,
        rms_eps=float(hf_config.rms_norm_eps),
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_seq_len=int(getattr(hf_config, "max_position_embeddings", 2048)),
        param_dtype=param_dtype,
        compute_dtype=compute_dtype or param_dtype,
        **SUPPORTED_ARCHITECTURES[arch],
        **_rope_fields(hf_config),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


# What transformers' LlamaConfig / Qwen2Config / Qwen3Config (4.46 to 5.x) fill in for a
# field `config_from_hf` reads when config.json leaves it out (a missing Llama
# num_key_value_heads or head_dim falls back in `config_from_hf`, as in LlamaConfig).
# `tests/model/test_checkpoint_io.py` checks the table against the classes themselves.
_HF_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(rms_norm_eps=1e-6, max_position_embeddings=2048),
    "Qwen2ForCausalLM": dict(
        num_key_value_heads=32, rms_norm_eps=1e-6, max_position_embeddings=32768
    ),
    "Qwen3ForCausalLM": dict(
        num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=32768
    ),
}
# Shape fields every real config.json has; the classes' defaults for them (a 7B model's)
# would only hide a truncated file.
_HF_CONFIG_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)


def load_hf_config(path: str | os.PathLike, **kwargs) -> ModelConfig:
    """Read `path/config.json`; kwargs go to `config_from_hf`.

    The file is read as JSON and a field it leaves out takes its architecture's
    transformers default (`_HF_CONFIG_DEFAULTS`), so loading needs neither transformers'
    config classes nor the torch they import (hundreds of MB and seconds of start-up).
    An unknown architecture or a missing shape field is named in the error.
    """
    config_file = pathlib.Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {path}")
    return config_from_hf_json(json.loads(config_file.read_text()), config_file, **kwargs)


def config_from_hf_json(raw: Mapping[str, Any], where: Any, **kwargs) -> ModelConfig:
    """`load_hf_config` on a config.json already read into a dict (`where` names the file
    in errors); a reader of another head's config (the reward model) maps its
    architectures to a causal one first."""
    architectures = raw.get("architectures") or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"unknown architecture {architectures or raw.get('model_type')!r} in {where}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    missing = [f for f in _HF_CONFIG_REQUIRED if raw.get(f) is None]
    if missing:
        raise CheckpointError(f"{where} has no {', '.join(missing)}")
    fields = dict(raw)
    for name, default in _HF_CONFIG_DEFAULTS[arch].items():
        if fields.get(name) is None:
            fields[name] = default
    return config_from_hf(SimpleNamespace(**fields), **kwargs)


def hf_architecture(config: ModelConfig) -> str:
    """The transformers class that has exactly this architecture."""
    if config.qk_norm and not config.qkv_bias:
        return "Qwen3ForCausalLM"
    if config.qkv_bias and not config.qk_norm:
        return "Qwen2ForCausalLM"
    if not (config.qkv_bias or config.qk_norm):
        return "LlamaForCausalLM"
    raise CheckpointError("no transformers architecture has both qkv_bias and qk_norm")


def hf_config_from(config: ModelConfig):
    """The transformers config object describing `config` (for `save_hf_checkpoint`)."""
    import transformers

    arch = hf_architecture(config)
    cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }[arch]
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": config.rope_type}
    if config.rope_type == "llama3":
        rope.update(
            factor=config.rope_factor,
            low_freq_factor=config.rope_low_freq_factor,
            high_freq_factor=config.rope_high_freq_factor,
            original_max_position_embeddings=config.rope_original_max_len,
        )
    kwargs = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_eps,
        tie_word_embeddings=config.tie_embeddings,
        max_position_embeddings=config.max_seq_len,
        architectures=[arch],
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = rope
    else:  # transformers 4.x
        kwargs["rope_theta"] = config.rope_theta
        if config.rope_type != "default":
            kwargs["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------
# The parameter <-> Hugging Face tensor table


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    path: tuple[str, ...]  # where it lives in params
    hf_name: str  # with "{i}" for the layer index when per_layer
    hf_shape: tuple[int, ...]
    to_params: Callable[[np.ndarray], np.ndarray]  # HF layout -> params layout (one layer)
    to_hf: Callable[[np.ndarray], np.ndarray]
    per_layer: bool


def _hf_tensor_specs(config: ModelConfig) -> list[_TensorSpec]:
    d, f, v = config.d_model, config.ffn_dim, config.vocab_size
    h, n, k = config.n_heads, config.n_kv_heads, config.head_dim
    same = lambda w: w

    def heads_in(heads):  # nn.Linear(D -> heads*K): [heads*K, D] <-> [D, heads, K]
        return (lambda w: w.T.reshape(d, heads, k), lambda w: w.reshape(d, heads * k).T)

    def heads_bias(heads):
        return (lambda w: w.reshape(heads, k), lambda w: w.reshape(heads * k))

    transpose = (lambda w: w.T, lambda w: w.T)  # nn.Linear: [out, in] <-> [in, out]
    o_proj = (lambda w: w.T.reshape(h, k, d), lambda w: w.reshape(h * k, d).T)

    layer = "model.layers.{i}."
    rows = [
        (("input_norm", "scale"), "input_layernorm.weight", (d,), (same, same)),
        (("post_attn_norm", "scale"), "post_attention_layernorm.weight", (d,), (same, same)),
        (("attn", "q_proj", "kernel"), "self_attn.q_proj.weight", (h * k, d), heads_in(h)),
        (("attn", "k_proj", "kernel"), "self_attn.k_proj.weight", (n * k, d), heads_in(n)),
        (("attn", "v_proj", "kernel"), "self_attn.v_proj.weight", (n * k, d), heads_in(n)),
        (("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", (d, h * k), o_proj),
        (("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", (f, d), transpose),
        (("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", (f, d), transpose),
        (("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", (d, f), transpose),
    ]
    if config.qkv_bias:
        rows += [
            (("attn", "q_proj", "bias"), "self_attn.q_proj.bias", (h * k,), heads_bias(h)),
            (("attn", "k_proj", "bias"), "self_attn.k_proj.bias", (n * k,), heads_bias(n)),
            (("attn", "v_proj", "bias"), "self_attn.v_proj.bias", (n * k,), heads_bias(n)),
        ]
    if config.qk_norm:
        rows += [
            (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", (k,), (same, same)),
            (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", (k,), (same, same)),
        ]
    specs = [
        _TensorSpec(("embed", "embedding"), "model.embed_tokens.weight", (v, d), same, same, False),
        _TensorSpec(("final_norm", "scale"), "model.norm.weight", (d,), same, same, False),
    ]
    if not config.tie_embeddings:
        specs.append(
            _TensorSpec(("lm_head", "kernel"), "lm_head.weight", (v, d), *transpose, False)
        )
    specs += [
        _TensorSpec(("layers", *path), layer + name, shape, to_p, to_h, True)
        for path, name, shape, (to_p, to_h) in rows
    ]
    return specs


def _set_path(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get_path(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def hf_tensors_to_params(
    get_tensor: Callable[[str], np.ndarray],
    names: Iterable[str],
    config: ModelConfig,
    *,
    shardings: Params | None = None,
) -> Params:
    """Assemble params from Hugging Face tensors.

    Args:
      get_tensor: reads one tensor by its Hugging Face name (lazily, so only one layer's
        tensor is materialised beyond the stacked outputs).
      names: every tensor name the checkpoint holds.
      config: the architecture; parameters are cast to `config.param_dtype`.
      shardings: optional params-shaped pytree of `jax.sharding.Sharding`; each parameter is
        placed with it as soon as it is assembled.
    Raises:
      CheckpointError naming the tensor for a missing tensor, a shape mismatch (both shapes
      given) or an unexpected tensor.
    """
    names = set(names)
    dtype = jnp.dtype(config.param_dtype)
    specs = _hf_tensor_specs(config)
    expected = set()
    for spec in specs:
        layers = range(config.n_layers) if spec.per_layer else [None]
        expected.update(spec.hf_name.format(i=i) for i in layers)
    tied_head = {"lm_head.weight"} if config.tie_embeddings else set()
    missing = sorted(expected - names)
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s), first {missing[0]!r} "
            f"(expected shape {_expected_shape(specs, missing[0])}); missing: {missing[:8]}"
        )
    unexpected = sorted(x for x in names - expected - tied_head if not _IGNORED_TENSORS.match(x))
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} tensor(s) the {hf_architecture(config)} "
            f"config does not use, first {unexpected[0]!r}: {unexpected[:8]}"
        )

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        tensor = get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)} but the config expects {shape}"
            )
        return tensor

    params: Params = {}
    for spec in specs:
        if spec.per_layer:
            out = None
            for i in range(config.n_layers):
                layer = spec.to_params(read(spec.hf_name.format(i=i), spec.hf_shape))
                if out is None:
                    out = np.empty((config.n_layers, *layer.shape), dtype)
                out[i] = layer.astype(dtype)
        else:
            out = np.ascontiguousarray(spec.to_params(read(spec.hf_name, spec.hf_shape)))
            out = out.astype(dtype)
        sharding = _get_path(shardings, spec.path) if shardings is not None else None
        _set_path(params, spec.path, jax.device_put(out, sharding))
    return params


def _expected_shape(specs: list[_TensorSpec], name: str) -> tuple[int, ...] | None:
    for spec in specs:
        if re.fullmatch(re.escape(spec.hf_name).replace(r"\{i\}", r"\d+"), name):
            return spec.hf_shape
    return None


def params_to_hf_tensors(params: Params, config: ModelConfig) -> dict[str, np.ndarray]:
    """The Hugging Face name -> array dict of `params` (in the params' dtype)."""
    tensors = {}
    for spec in _hf_tensor_specs(config):
        value = np.asarray(_get_path(params, spec.path))
        if spec.per_layer:
            for i in range(config.n_layers):
                tensors[spec.hf_name.format(i=i)] = np.ascontiguousarray(spec.to_hf(value[i]))
        else:
            tensors[spec.hf_name] = np.ascontiguousarray(spec.to_hf(value))
    return tensors


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


def safetensors_reader(
    path: pathlib.Path,
) -> tuple[dict[str, pathlib.Path], Callable[[str], np.ndarray]]:
    """A checkpoint directory's tensor index (name -> file) and a reader of one tensor by
    name, each file opened once, when first read."""
    from safetensors import safe_open

    index = _safetensors_index(path)
    handles: dict[pathlib.Path, Any] = {}

    def get_tensor(name: str) -> np.ndarray:
        file = index[name]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="numpy")
        return handles[file].get_tensor(name)

    return index, get_tensor


def _safetensors_index(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> file, from model.safetensors.index.json or every *.safetensors file."""
    from safetensors import safe_open

    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = {name: path / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise CheckpointError(f"{index_file} names {file.name}, which does not exist")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    index = {}
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            index.update({name: file for name in f.keys()})
    return index


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    param_dtype: str = "float32",
    compute_dtype: str | None = None,
    shardings: Params | Callable[[ModelConfig], Params] | None = None,
    **overrides,
) -> tuple[ModelConfig, Params]:
    """Load a Hugging Face checkpoint directory (config.json + *.safetensors) without torch.

    Args:
      path: the directory.
      param_dtype: parameters are cast to this dtype.
      compute_dtype: matmul dtype (defaults to param_dtype).
      shardings: a params pytree of shardings, or a function of the config returning one
        (e.g. `lambda c: param_shardings(abstract_params(c), mesh, TRAIN_RULES)`).
      overrides: other `ModelConfig` fields (e.g. remat=True, max_seq_len=...).
    Returns:
      (config, params).
    """

    path = pathlib.Path(path)
    config = load_hf_config(path, param_dtype=param_dtype, compute_dtype=compute_dtype, **overrides)
    index, get_tensor = safetensors_reader(path)

    if callable(shardings):
        shardings = shardings(config)
    params = hf_tensors_to_params(get_tensor, index.keys(), config, shardings=shardings)
    return config, params


def save_hf_checkpoint(
    params: Params,
    config: ModelConfig,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int | None = None,
) -> pathlib.Path:
    """Write `config.json` and safetensors with Hugging Face names (loadable by transformers).

    With `max_shard_bytes`, tensors are split over `model-0000i-of-0000n.safetensors` files
    with a `model.safetensors.index.json`, as `save_pretrained` does.
    """
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config_from(config).to_json_file(str(path / "config.json"))
    tensors = params_to_hf_tensors(params, config)
    metadata = {"format": "pt"}  # transformers refuses safetensors without a known format
    if max_shard_bytes is None:
        save_file(tensors, str(path / "model.safetensors"), metadata=metadata)
        return path
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata=metadata)
        weight_map.update({name: file for name in shard})
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


# ---------------------------------------------------------------------------------------------
# Tokenizers


def load_tokenizer(path: str | os.PathLike):
    """A transformers fast tokenizer from a folder (tokenizer.json, ...) or a `.gguf` file.

    From a folder this needs neither torch nor network; from a GGUF transformers rebuilds the
    tokenizer from the GGUF vocabulary (seconds), after which `save_pretrained` gives a folder.
    """
    import transformers

    path = pathlib.Path(path)
    if path.suffix == ".gguf":
        return transformers.AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointError(f"no tokenizer.json or tokenizer_config.json in {path}")
    if _plain_fast_tokenizer(path):
        # The class AutoTokenizer would pick, without the auto-class lookup (which imports
        # torch: hundreds of MB and seconds, for nothing a tokenizer uses).
        return transformers.PreTrainedTokenizerFast.from_pretrained(
            str(path), local_files_only=True
        )
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _plain_fast_tokenizer(path: pathlib.Path) -> bool:
    """Whether the folder's tokenizer is transformers' generic fast tokenizer (a
    tokenizer.json whose tokenizer_config.json names no model-specific class)."""
    config_file = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config_file.is_file():
        return False
    name = json.loads(config_file.read_text()).get("tokenizer_class")
    return name in ("PreTrainedTokenizerFast", "TokenizersBackend")
