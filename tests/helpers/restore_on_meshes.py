"""Test helper: restores a run's checkpoints onto meshes of several shapes and checks that
every one gets the same numbers, laid out as its mesh asks.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=4 \
       python tests/helpers/restore_on_meshes.py CONFIG_JSON CHECKPOINT_DIR [...]

For every checkpoint directory (its newest complete step), the train state is restored with
:func:`a3po_jax.training.checkpointing.restore_train_state`, the trainer's own resume, into
a state placed as the trainer places it (``place_train_state``) on each mesh of
``MESHES``, over the first devices of this process. Every restored leaf must carry the
template's sharding, and the params, Adam's moments and count must be the same bits on every
mesh (one device included: the numbers the checkpoint holds). Prints one JSON line per
checkpoint: the step, the version, Adam's count and the meshes checked. Used by
tests/e2e/test_resume_on_another_mesh.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# (data, fsdp, tensor): one device; FSDP over 2 and 4; data x FSDP; FSDP x tensor.
MESHES = ((1, 1, 1), (1, 2, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2))


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    import jax
    import numpy as np

    from a3po_jax.core.placement import place_train_state
    from a3po_jax.parallel.sharding import make_mesh
    from a3po_jax.training import step_builder
    from a3po_jax.training.checkpointing import CheckpointManager, restore_train_state
    from a3po_jax.training.config import config_from_dict
    from a3po_jax.training.trainer import load_policy

    cfg = config_from_dict(json.loads(Path(argv[0]).read_text()))
    params = load_policy(cfg.model).params
    optimizer = step_builder.optimizer(cfg)
    for directory in argv[1:]:
        reference, summary = None, {"directory": directory, "meshes": []}
        with CheckpointManager(directory, async_save=False) as manager:
            for shape in MESHES:
                count = int(np.prod(shape))
                mesh = make_mesh(*shape, devices=jax.devices()[:count])
                template = place_train_state(params, optimizer, mesh)
                state, extra, step = restore_train_state(manager, template)
                paths = jax.tree_util.tree_flatten_with_path(state)[0]
                for (path, leaf), want in zip(paths, jax.tree.leaves(template), strict=True):
                    name = jax.tree_util.keystr(path)
                    assert leaf.sharding == want.sharding, (shape, name, leaf.sharding)
                    assert leaf.sharding.mesh.devices.size in (1, count), (shape, name)
                leaves = [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in paths]
                if reference is None:
                    reference = leaves
                for (name, got), (_, want) in zip(leaves, reference, strict=True):
                    assert got.dtype == want.dtype, (shape, name)
                    np.testing.assert_array_equal(got, want, err_msg=f"{shape} {name}")
                summary["meshes"].append(list(shape))
        counts = [x for name, x in reference if name.endswith(".count")]
        summary.update(step=step, version=int(extra["version"]), adam_count=int(counts[0]))
        assert int(state.step) == summary["version"]
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
