"""`host_placement.check_placement`: every placement the meshes, the placed weights, the
batch or the embedded host would refuse once loaded is refused from the config, the
model's config and a device count, naming the fields, in one line.

The device count is an argument, so these run in the main process's one device; the CLI's
answer on 4 virtual devices (exit 2 before the start-up line, nothing written) is in
tests/cli/test_config_fuzz.py.
"""

import pytest

from a3po_jax.model import ModelConfig
from a3po_jax.model.loader import TINY_MAX_SEQ_LEN, load_model_config
from a3po_jax.parallel import sharding
from a3po_jax.training import host_placement
from a3po_jax.training.config import TrainConfig, apply_overrides

TINY = ModelConfig.tiny(max_seq_len=TINY_MAX_SEQ_LEN)  # V=128, D=64, H=4, N=2, F=128


def check(overrides, devices=4, model=TINY, processes=1):
    cfg = apply_overrides(TrainConfig(), ["model.name=tiny", *overrides])
    host_placement.check_placement(cfg, model, devices, processes=processes)


# What each refusal said before (after the start-up line and the model load), and the
# fields it names now.
REFUSED = [
    # "embed/embedding: vocab = 128 (dimension 0) is not divisible by mesh axes ('tensor',)"
    (
        ["system.placement.inference_devices=3", "system.placement.inference_mesh_tensor=3"],
        "system.placement.inference_mesh_tensor=3 does not divide the model's vocab_size=128",
    ),
    # "make_mesh: data=1 x fsdp=4 x tensor=1 = 4 but there are 2 devices"
    (
        ["system.placement.inference_devices=2", "system.mesh.fsdp=4"],
        "system.mesh.data=1 x system.mesh.fsdp=4 x system.mesh.tensor=1 = 4 but there are 2 "
        "devices left to the trainer by system.placement.inference_devices=2",
    ),
    # "make_mesh: fsdp=-1 cannot be inferred: 4 devices are not divisible by ..."
    (["system.mesh.data=3"], "system.mesh.fsdp=-1 cannot be inferred: 4 devices"),
    # "embed/embedding: embed = 64 (dimension 1) is not divisible by mesh axes ('fsdp',)"
    (
        ["system.placement.inference_devices=1", "system.mesh.fsdp=3"],
        "system.mesh.fsdp=3 does not divide the model's d_model=64",
    ),
    # "layers/attn/k_proj/kernel: kv_heads = 2 (dimension 2) is not divisible by ..."
    (["system.mesh.tensor=4"], "system.mesh.tensor=4 does not divide the model's n_kv_heads=2"),
    # "num_slots=3 must be a multiple of the inference mesh's data x fsdp size 2"
    (
        ["system.placement.inference_devices=2", "rollout.num_slots=3"],
        "rollout.num_slots=3 must be a multiple of the host's data axis "
        "(system.placement.inference_devices=2 / system.placement.inference_mesh_tensor=1 = 2)",
    ),
    # "batch: batch = 2 (dimension 0) is not divisible by mesh axes ('data', 'fsdp') of size 4"
    (
        ["system.mesh.fsdp=4", "rollout.group_size=2", "rollout.groups_per_step=1"],
        "a micro-batch's 2 sequences (rollout.group_size=2, rollout.groups_per_step=1",
    ),
    # "system.placement.inference_devices=4 must leave the trainer at least one of the 4 devices"
    (
        ["system.placement.inference_devices=4"],
        "system.placement.inference_devices=4 must leave the trainer",
    ),
]


@pytest.mark.parametrize("overrides,message", REFUSED)
def test_each_placement_that_cannot_run_is_refused_naming_its_fields(overrides, message):
    with pytest.raises(ValueError) as err:
        check(overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["system.placement.inference_devices=2", "system.placement.inference_mesh_tensor=2"],
        ["system.placement.inference_devices=2", "system.mesh.fsdp=2"],
        ["system.placement.inference_devices=1", "system.mesh.data=3", "rollout.groups_per_step=3"],
        ["system.mesh.tensor=2", "system.mesh.fsdp=2"],
        [
            "system.placement.inference_devices=2",
            "system.placement.inference_mesh_tensor=2",
            "rollout.num_slots=3",
        ],
    ],
)
def test_placements_that_run_pass(overrides):
    check(overrides)


def test_the_model_dimensions_decide_not_the_tiny_model():
    # SmolLM2 has 9 heads and 3 kv heads: a host of tensor 2 splits no head evenly, 3 does.
    smollm2 = load_model_config("smollm2")
    with pytest.raises(ValueError, match="inference_mesh_tensor=2 does not divide the model's"):
        check(
            ["system.placement.inference_devices=2", "system.placement.inference_mesh_tensor=2"],
            model=smollm2,
        )
    check(
        ["system.placement.inference_devices=3", "system.placement.inference_mesh_tensor=3"],
        model=smollm2,
    )


def test_split_devices_in_a_multi_process_job_are_refused_before_loading():
    with pytest.raises(
        ValueError, match="system.placement.inference_devices=2 runs in one process"
    ):
        check(["system.placement.inference_devices=2"], processes=2)


def test_every_dimension_a_rule_splits_has_its_model_field():
    # A rule added for a new logical axis must say which ModelConfig field it splits, or
    # check_placement would not see it.
    for rules in (sharding.TRAIN_RULES, sharding.INFERENCE_RULES):
        for logical, axes in sharding.rule_axes(rules).items():
            if axes and logical != "batch":
                assert logical in host_placement.MODEL_DIMENSIONS, logical
                assert hasattr(TINY, host_placement.MODEL_DIMENSIONS[logical]), logical


def test_the_model_config_is_read_as_the_loader_builds_it(tmp_path):
    from a3po_jax.model.checkpoint_io import save_hf_checkpoint
    from a3po_jax.model.loader import load_model

    loaded = load_model("tiny")
    assert load_model_config("tiny") == loaded.config
    save_hf_checkpoint(loaded.params, loaded.config, tmp_path)
    read = load_model_config(str(tmp_path))
    assert (read.vocab_size, read.n_heads, read.n_kv_heads, read.ffn_dim, read.d_model) == (
        128,
        4,
        2,
        128,
        64,
    )
    with pytest.raises(FileNotFoundError, match="model.name"):
        load_model_config(str(tmp_path / "missing"))
