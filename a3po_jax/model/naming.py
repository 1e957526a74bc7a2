"""The model's names for its weights: logical axes and the flat "/"-joined weight names.

Model layer (pure core). The only sharding knowledge the model has: every parameter's
dimensions get logical axis names ("embed", "heads", ...), which `parallel/sharding.py` maps to
mesh axes; `flatten_params` gives every weight the one name that logical axes and weight
pushes share.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from a3po_jax.model.config import Params

# Parameter path -> logical axis of each dimension. `sharding.py` maps names to mesh axes.
PARAM_LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "embed/embedding": ("vocab", "embed"),
    "layers/input_norm/scale": ("layers", "norm"),
    "layers/attn/q_proj/kernel": ("layers", "embed", "heads", "head_dim"),
    "layers/attn/q_proj/bias": ("layers", "heads", "head_dim"),
    "layers/attn/k_proj/kernel": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/attn/k_proj/bias": ("layers", "kv_heads", "head_dim"),
    "layers/attn/v_proj/kernel": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/attn/v_proj/bias": ("layers", "kv_heads", "head_dim"),
    "layers/attn/o_proj/kernel": ("layers", "heads", "head_dim", "embed"),
    "layers/attn/q_norm/scale": ("layers", "head_dim"),
    "layers/attn/k_norm/scale": ("layers", "head_dim"),
    "layers/post_attn_norm/scale": ("layers", "norm"),
    "layers/mlp/gate_proj/kernel": ("layers", "embed", "mlp"),
    "layers/mlp/up_proj/kernel": ("layers", "embed", "mlp"),
    "layers/mlp/down_proj/kernel": ("layers", "mlp", "embed"),
    "final_norm/scale": ("norm",),
    "lm_head/kernel": ("embed", "vocab"),
    # The reward model's scalar head (`reward_model.py`): [D, 1], one output "label".
    "score/kernel": ("embed", "labels"),
}

# KV cache and activations: [L, B, S, N, K] and [B, T].
KV_CACHE_LOGICAL_AXES = ("layers", "batch", "cache_length", "kv_heads", "head_dim")
TOKENS_LOGICAL_AXES = ("batch", "length")


def _path_names(path) -> list[str]:
    """The key of each entry of a jax tree path (dict key, attribute or index) as a str."""
    names = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                names.append(str(getattr(entry, attr)))
                break
        else:
            names.append(str(entry))
    return names


def tree_path_str(path) -> str:
    """'a/b/c' for a jax tree path of dict keys, attributes or indices."""
    return "/".join(_path_names(path))


def flatten_params(params: Any) -> dict[str, Any]:
    """`{"layers/attn/q_proj/kernel": leaf, ...}`: every leaf under its "/"-joined path, in
    tree order. The one weight naming of the package (logical axes, weight pushes).

    Raises ValueError if a key itself contains "/" or two leaves get the same name.
    """
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = _path_names(path)
        bad = next((n for n in names if "/" in n), None)
        if bad is not None:
            raise ValueError(f"parameter key {bad!r} contains '/'; cannot flatten it")
        name = "/".join(names)
        if name in out:
            raise ValueError(f"two parameters flatten to the same name {name!r}")
        out[name] = leaf
    return out


def logical_axes(params: Params) -> Params:
    """The logical axis names of every leaf of `params` (or of its shapes).

    A path that ends with a known parameter path (so the same tree nested inside an optimizer
    state also resolves) gets that entry; anything else is an error naming the path.
    """

    def axes_of(path, leaf):
        name = tree_path_str(path)
        match = next(
            (
                axes
                for known, axes in PARAM_LOGICAL_AXES.items()
                if name == known or name.endswith("/" + known)
            ),
            None,
        )
        if match is None:
            raise ValueError(f"parameter {name!r} has no logical axes in model.PARAM_LOGICAL_AXES")
        if len(match) != len(np.shape(leaf)):
            raise ValueError(
                f"parameter {name!r} has shape {tuple(np.shape(leaf))} but logical axes {match}"
            )
        return match

    return jax.tree_util.tree_map_with_path(axes_of, params)
