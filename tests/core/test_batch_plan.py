"""The batch plan: the step's geometry from the config in one place, and make_batch."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.factories import synthetic_groups

from a3po_jax import model
from a3po_jax.core import objectives, optim
from a3po_jax.core import train_step as ts
from a3po_jax.core.batch_plan import BatchPlan, make_batch
from a3po_jax.core.batching import build_batch, concat_batches
from a3po_jax.training import step_builder
from a3po_jax.training.config import ConfigError, TrainConfig, apply_overrides

CFG = model.ModelConfig.tiny()


def plan_of(*overrides: str) -> BatchPlan:
    return apply_overrides(TrainConfig(), list(overrides)).batch_plan


def groups(n=4, g=4, seed=0):
    return synthetic_groups(n, g, prompt_len=(3, 8), response_len=(2, 9), vocab=128, seed=seed)


def test_geometry_golden_values():
    # 8 groups of 4 = 32 sequences; 2 minibatches of 16; micro-batches of 4: 8 in all.
    plan = plan_of(
        "algo.num_minibatches=2",
        "system.batch.micro_batch_size=4",
        "system.batch.packed_prompts=false",
    )
    assert (plan.rows, plan.minibatch_rows, plan.micro_batch_rows) == (32, 16, 4)
    assert (plan.micro_batches, plan.leading_rows, plan.leading_rows_per_micro_batch) == (8, 32, 4)
    assert not plan.balance_rows  # with 2 minibatches the order decides the versions
    # Packed, 2 groups per row: 4 rows of 8 sequences, micro-batches of one row.
    packed = plan_of(
        "algo.num_minibatches=2",
        "system.batch.micro_batch_size=8",
        "system.batch.packed_prompts=true",
        "system.batch.groups_per_row=2",
    )
    assert (packed.micro_batches, packed.leading_rows) == (4, 4)
    assert packed.leading_rows_per_micro_batch == 1
    # No micro-batch size: one micro-batch per minibatch.
    assert (
        plan_of().micro_batches == 1
        and plan_of("algo.num_minibatches=4", "system.mode=sync").micro_batches == 4
    )
    assert plan_of("algo.loss=dpo", "rollout.group_size=2").layout is objectives.PAIRS


def test_the_periodic_fold_plan_is_one_group():
    periodic = ("system.mode=periodic", "system.max_staleness=0")
    fold = plan_of(
        *periodic, "system.batch.micro_batch_size=2", "system.batch.packed_prompts=false"
    ).fold
    assert (fold.groups, fold.rows, fold.micro_batches, fold.leading_rows) == (1, 4, 2, 4)
    # A packed group is one row: it is never split, whatever system.batch.micro_batch_size says.
    packed = plan_of(
        *periodic,
        "system.batch.packed_prompts=true",
        "system.batch.groups_per_row=2",
        "system.batch.micro_batch_size=8",
    )
    assert (packed.fold.micro_batches, packed.fold.leading_rows, packed.fold.groups_per_row) == (
        1,
        1,
        1,
    )
    assert not packed.padded.packed and packed.padded.rows == packed.rows


def test_a_batch_that_does_not_split_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match="algo.num_minibatches=3 must divide the batch of 16"):
        BatchPlan(group_size=4, groups=4, num_minibatches=3)
    with pytest.raises(
        ValueError, match="system.batch.micro_batch_size=3 must divide the minibatch"
    ):
        BatchPlan(group_size=4, groups=4, micro_batch_size=3)
    with pytest.raises(ValueError, match="must be a multiple of rollout.group_size=4"):
        BatchPlan(group_size=4, groups=4, micro_batch_size=2, packed=True)
    with pytest.raises(ValueError, match="system.batch.groups_per_row=2 packs groups into rows"):
        BatchPlan(group_size=4, groups=4, groups_per_row=2)


@pytest.mark.parametrize("packed", [False, True])
def test_make_batch_lays_out_the_plans_layout(packed):
    plan = BatchPlan(group_size=4, groups=4, packed=packed, length_bucket=16)
    gs = groups()
    made = make_batch(gs, plan)
    batch, arrays = made.batch, made.arrays
    plain = build_batch(gs, advantage="grpo", length_bucket=16)
    # Either way the loss inputs are the padded batch's; the leading axis is the plan's.
    for key in ("loss_mask", "behav_logp", "advantages", "versions"):
        np.testing.assert_array_equal(arrays[key], getattr(plain, key))
    assert len(arrays["packed_tokens" if packed else "tokens"]) == plan.leading_rows
    assert ("packed_tokens" in arrays) == packed
    np.testing.assert_array_equal(batch.rewards, plain.rewards)
    with pytest.raises(ValueError, match="3 groups, the plan has 4"):
        make_batch(gs[:3], plan)


@pytest.mark.parametrize("packed_fold", [False, True])
@pytest.mark.parametrize("loss", ["ppo", "dpo"])
def test_the_folds_batches_side_by_side_are_the_whole_batch(packed_fold, loss):
    """Periodic's metrics take the folded groups' own batches side by side
    (``concat_batches``): the batch one build of all the groups gives."""
    g = 2 if loss == "dpo" else 4
    plan = plan_of(f"algo.loss={loss}", f"rollout.group_size={g}", "rollout.groups_per_step=4")
    fold = dataclasses.replace(plan.fold, packed=packed_fold)
    gs = groups(4, g, seed=5)
    sides = concat_batches([make_batch([group], fold).batch for group in gs])
    whole = make_batch(gs, dataclasses.replace(plan.padded, groups=len(gs))).batch
    for field in dataclasses.fields(whole):
        np.testing.assert_array_equal(
            getattr(sides, field.name), getattr(whole, field.name), err_msg=field.name
        )


def test_make_batch_orders_pairs_for_a_pairwise_objective():
    plan = plan_of("algo.loss=dpo", "rollout.group_size=2", "rollout.groups_per_step=4")
    gs = groups(4, 2, seed=3)
    batch = make_batch(gs, plan).batch
    chosen, rejected = batch.rewards[0::2], batch.rewards[1::2]
    assert np.all(chosen >= rejected)
    np.testing.assert_array_equal(batch.pair_mask[0::2], (chosen != rejected).astype(np.float32))


def test_the_step_refuses_a_batch_its_plan_does_not_describe():
    cfg = apply_overrides(
        TrainConfig(),
        ["rollout.group_size=4", "rollout.groups_per_step=4", "system.batch.packed_prompts=false"],
    )
    algo = step_builder.algorithm(cfg, CFG)
    opt = step_builder.optimizer(cfg)
    state = optim.init_train_state(model.init_params(CFG, jax.random.key(0)), opt)
    arrays = make_batch(groups(2, 4), BatchPlan(group_size=4, groups=2, length_bucket=16)).arrays
    step = functools.partial(ts.train_step, algo=algo, optimizer=opt, grad_clip=1.0)
    with pytest.raises(ValueError, match="the batch has 8 sequences, its plan 16"):
        jax.eval_shape(step, state, {k: jnp.asarray(v) for k, v in arrays.items()}, None)


# --------------------------------------------------------------------------------------
# system.batch.packed_prompts: "auto" (the default), true, false
# --------------------------------------------------------------------------------------


def test_the_default_packs_whenever_the_geometry_allows():
    assert TrainConfig().system.batch.packed_prompts == "auto"
    assert plan_of().packed  # micro_batch_size=0: whole groups in every micro-batch
    assert plan_of("system.batch.micro_batch_size=8").packed  # a multiple of group_size=4
    assert plan_of("system.mode=periodic", "system.max_staleness=0").packed
    assert plan_of("algo.loss=dpo", "rollout.group_size=2").packed
    assert BatchPlan.packing_refusal(TrainConfig()) is None


def test_the_default_trains_unpacked_where_groups_do_not_fit_a_micro_batch():
    plan = plan_of("system.batch.micro_batch_size=2")  # group_size=4: no error, padded rows
    assert not plan.packed and plan.leading_rows == plan.rows == 32
    why = BatchPlan.packing_refusal(
        apply_overrides(TrainConfig(), ["system.batch.micro_batch_size=2"])
    )
    assert "system.batch.micro_batch_size=2" in why and "rollout.group_size=4" in why
    # Periodic mode with micro-batches that split a group: the fold takes them unpacked.
    periodic = ("system.mode=periodic", "system.max_staleness=0")
    assert not plan_of(*periodic, "system.batch.micro_batch_size=2").packed


def test_explicit_true_on_a_geometry_that_cannot_pack_is_refused_naming_the_fields():
    with pytest.raises(ConfigError) as err:
        plan_of("system.batch.micro_batch_size=2", "system.batch.packed_prompts=true")
    for field in (
        "system.batch.packed_prompts",
        "system.batch.micro_batch_size=2",
        "rollout.group_size=4",
    ):
        assert field in str(err.value)


def test_explicit_false_stays_unpacked():
    assert not plan_of("system.batch.packed_prompts=false").packed
    assert not plan_of(
        "system.batch.packed_prompts=false", "system.batch.micro_batch_size=8"
    ).packed
    assert plan_of("system.batch.packed_prompts=true").packed


def test_groups_per_row_under_the_default_packs_or_is_refused_as_packing():
    assert plan_of("system.batch.groups_per_row=2").packed
    # Packing is what groups_per_row asks for: its refusal, not an unpacked fallback.
    with pytest.raises(ConfigError, match="packed row's 8 sequences"):
        plan_of("system.batch.groups_per_row=2", "system.batch.micro_batch_size=4")
    with pytest.raises(ConfigError, match="needs system.batch.packed_prompts=true"):
        plan_of("system.batch.groups_per_row=2", "system.batch.packed_prompts=false")


def test_the_default_trains_unpacked_where_packed_rows_do_not_split_over_the_mesh():
    cfg = TrainConfig()  # 8 groups: 8 packed rows, 32 unpacked
    assert BatchPlan.from_config(cfg, batch_shards=8).packed
    assert not BatchPlan.from_config(cfg, batch_shards=16).packed
    assert "16" in BatchPlan.packing_refusal(cfg, batch_shards=16)
    assert not step_builder.algorithm(cfg, CFG, batch_shards=16).plan.packed
    # Explicit true is kept: the trainer's mesh check refuses it, naming both numbers.
    packed = apply_overrides(cfg, ["system.batch.packed_prompts=true"])
    assert BatchPlan.from_config(packed, batch_shards=16).packed


def test_the_default_never_refuses_a_geometry_that_trains_unpacked():
    """Over a grid of geometries: wherever false builds, the default builds too, and it is
    the packed plan where true builds, else the unpacked one."""

    def build(*overrides):
        try:
            return apply_overrides(TrainConfig(), list(overrides)).batch_plan
        except ConfigError:
            return None

    checked = 0
    for g, n, k, mb, mode in itertools.product(
        (1, 2, 4), (1, 2, 4, 8), (1, 2), (0, 1, 2, 4, 8), ("sync", "periodic")
    ):
        geometry = (
            f"rollout.group_size={g}",
            f"rollout.groups_per_step={n}",
            f"algo.num_minibatches={k}",
            f"system.batch.micro_batch_size={mb}",
            f"system.mode={mode}",
            "system.max_staleness=0",
        )
        unpacked = build(*geometry, "system.batch.packed_prompts=false")
        packed = build(*geometry, "system.batch.packed_prompts=true")
        auto = build(*geometry)
        assert auto == (packed or unpacked), geometry  # None: all three refused
        checked += auto is not None
    assert checked > 100
