"""The train step's update on fixed rollouts, against a recorded fixture.

``tests/data/same_update.json`` holds, for each case below, the step's metrics and the sum
and the sum of squares of every parameter leaf after one step (or one periodic fold and its
update) of the tiny random model on fixed synthetic groups. A refactor of the step, the
objectives or the batch geometry must reproduce them to float tolerance: the cases cover
every prox rule, both token caps, the sequence cap, the reference pass in the loss and in
the reward, Online DPO, shared-prompt packing (1 and 2 groups per row), micro-batches,
minibatches and the periodic fold.

Regenerate (only when the update is meant to change, and say why in the commit):
``PYTHONPATH=. python tests/core/test_same_update.py --write``.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.factories import synthetic_groups

from a3po_jax import model
from a3po_jax.core import optim, placement
from a3po_jax.core import train_step as ts
from a3po_jax.core.batch_plan import make_batch
from a3po_jax.parallel.sharding import make_mesh
from a3po_jax.training import step_builder
from a3po_jax.training.config import TrainConfig, apply_overrides

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "same_update.json"
MODEL = model.ModelConfig.tiny()
LEARNING_RATE = 1e-2  # every case's (case_config)
# A sequence's log-ratio sums up to 10 tokens' log-probs of about 5 (vocab 128), each off
# by an ulp between two compiles (5e-7): up to 5e-6 apart where the metric itself is 0.13.
SEQ_LOG_ATOL = 1e-5
START_VERSION = 3  # the step starts here; tokens were sampled at versions 1..3 (d = 0..2)

# name -> overrides of the base config (4 groups of 4 samples, async, a3po).
CASES: dict[str, list[str]] = {
    "recompute": ["algo.prox=recompute"],
    "a3po": ["algo.prox=a3po"],
    "a3po_zero_behav": ["algo.prox=a3po", "algo.a3po_zero_staleness=behav"],
    "behav": ["algo.prox=behav"],
    # prox = the step's starting weights: w_t = π_θ/π_behav spans about 0.3 to 1.9 here.
    "token_cap_truncate": [
        "algo.prox=recompute",
        "algo.behav_weight_cap=1.2",
        "algo.cap_mode=truncate",
    ],
    "token_cap_mask": ["algo.prox=recompute", "algo.behav_weight_cap=1.2", "algo.cap_mode=mask"],
    "seq_cap_truncate": [
        "algo.prox=recompute",
        "algo.seq_weight_cap=1.05",
        "algo.seq_cap_mode=truncate",
    ],
    "seq_cap_mask_geo": [
        "algo.seq_weight_cap=1.5",
        "algo.seq_cap_mode=mask_both",
        "algo.seq_weight_form=geometric_mean",
    ],
    "clip_variants": [
        "algo.clip_eps_high=0.28",
        "algo.dual_clip=3.0",
        "algo.aggregation=seq_mean_token_sum_norm",
        "algo.advantage=rloo",
    ],
    "seq_mean_drgrpo": ["algo.aggregation=seq_mean_token_mean", "algo.advantage=drgrpo"],
    "kl_in_loss": ["algo.prox=recompute", "algo.kl_coef=0.1", "algo.kl_kind=k2"],
    "kl_in_reward": ["algo.kl_coef=0.5", "algo.kl_in_reward=true"],
    "track_ref_kl": ["algo.track_ref_kl=true"],
    "dpo": ["algo.loss=dpo", "rollout.group_size=2", "rollout.groups_per_step=8"],
    "dpo_ipo_micro": [
        "algo.loss=dpo",
        "algo.dpo_kind=ipo",
        "rollout.group_size=2",
        "rollout.groups_per_step=8",
        "system.batch.micro_batch_size=4",
    ],
    "micro_batches": ["algo.prox=recompute", "system.batch.micro_batch_size=4"],
    "minibatches": ["algo.num_minibatches=2", "system.max_staleness=2"],
    "minibatches_update_unit": [
        "algo.num_minibatches=2",
        "system.max_staleness=2",
        "algo.a3po_staleness_unit=update",
    ],
    "minibatches_micro": [
        "algo.prox=recompute",
        "algo.num_minibatches=2",
        "system.batch.micro_batch_size=4",
    ],
    "one_pass_old": ["algo.prox=recompute", "system.batch.one_pass_old=true"],
    "packed": ["system.batch.packed_prompts=true", "algo.prox=recompute"],
    "packed_two_per_row": ["system.batch.packed_prompts=true", "system.batch.groups_per_row=2"],
    "packed_two_per_row_minibatches": [
        "system.batch.packed_prompts=true",
        "system.batch.groups_per_row=2",
        "algo.num_minibatches=2",
        "algo.prox=recompute",
    ],
    "packed_micro_kl": [
        "system.batch.packed_prompts=true",
        "system.batch.micro_batch_size=8",
        "algo.kl_coef=0.1",
    ],
    "periodic": [
        "system.mode=periodic",
        "system.max_staleness=0",
        "algo.prox=recompute",
        "system.batch.micro_batch_size=2",
    ],
    "periodic_packed_kl": [
        "system.mode=periodic",
        "system.max_staleness=0",
        "system.batch.packed_prompts=true",
        "system.batch.groups_per_row=2",
        "algo.kl_coef=0.1",
    ],
    "periodic_dpo": [
        "system.mode=periodic",
        "system.max_staleness=0",
        "algo.loss=dpo",
        "rollout.group_size=2",
        "rollout.groups_per_step=8",
    ],
    # The staleness-robust objectives (tests/core/test_objectives_offpolicy.py has their maths).
    "m2po": ["algo.loss=m2po", "algo.m2po_tau=0.02"],
    "gspo_micro": ["algo.loss=gspo", "algo.gspo_clip_low=0.003", "system.batch.micro_batch_size=4"],
    "icepop_minibatches": [
        "algo.loss=icepop",
        "algo.icepop_low=0.8",
        "algo.icepop_high=1.25",
        "algo.num_minibatches=2",
        "system.max_staleness=2",
    ],
}
# Combinations of cases above (each ingredient has its own case): the whole suite's alone.
MATRIX = frozenset(
    {
        "dpo_ipo_micro",
        "minibatches_micro",
        "packed_two_per_row_minibatches",
        "packed_micro_kl",
        "periodic_packed_kl",
        "periodic_dpo",
    }
)


def case_config(name: str) -> TrainConfig:
    base = TrainConfig()
    base = apply_overrides(
        base,
        [
            "rollout.group_size=4",
            "rollout.groups_per_step=4",
            "rollout.temperature=0.9",
            "system.batch.length_bucket=16",
            f"optim.learning_rate={LEARNING_RATE}",
            "system.batch.packed_prompts=false",  # as recorded; the packed cases ask for true
        ],
    )
    return apply_overrides(base, CASES[name])


def case_groups(cfg: TrainConfig):
    """Fixed groups; in periodic mode every token is fresh (d = 0, the mode's bound)."""
    periodic = cfg.system.mode == "periodic"
    return synthetic_groups(
        cfg.rollout.groups_per_step,
        cfg.rollout.group_size,
        prompt_len=(3, 8),
        response_len=(2, 11),
        vocab=MODEL.vocab_size,
        versions=(lambda g, i: START_VERSION) if periodic else (lambda g, i: 1 + (g + i) % 3),
        behav_range=(3.5, 5.5),
        admitted_at_version=1,
        seed=11,
    )


def compute_case(name: str) -> dict:
    """One step of case ``name``, as the trainer runs it: its metrics and per-leaf sums of
    the new params."""
    cfg = case_config(name)
    algo = step_builder.algorithm(cfg, MODEL)
    plan = algo.plan
    optimizer = step_builder.optimizer(cfg)
    params = model.init_params(MODEL, jax.random.key(0))
    mesh = make_mesh(1, -1, 1)
    state = placement.place_train_state(params, optimizer, mesh)
    state = state._replace(step=jnp.int32(START_VERSION))
    ref = None
    if algo.keeps_reference:
        ref = model.init_params(MODEL, jax.random.key(1))  # differs from the policy: KL > 0
    kl_in_reward = None
    if algo.kl_in_reward is not None:
        kl_in_reward = jax.jit(functools.partial(ts.kl_in_reward, algo=algo))

    def arrays_of(groups, plan):
        """The step's input arrays, as the trainer's ``step_batch`` builds them."""
        shape = None
        if kl_in_reward is not None:

            def shape(arrays, rewards):
                device = {k: jnp.asarray(v) for k, v in arrays.items()}
                return kl_in_reward(state.params, ref, device, jnp.asarray(rewards))

        arrays = make_batch(groups, plan, shape_rewards=shape).arrays
        return {k: jnp.asarray(v) for k, v in arrays.items()}

    groups = case_groups(cfg)
    if plan.periodic:
        fold = jax.jit(functools.partial(ts.fold_group, algo=algo))
        folded = None
        for group in groups:
            mbs = ts.split_micro_batches(arrays_of([group], plan.fold), plan.fold.micro_batches)
            acc = fold(state.params, ref, mbs, state.step)
            folded = acc if folded is None else optim.add_accumulated(folded, acc)
        apply = jax.jit(
            functools.partial(
                ts.apply_accumulated, optimizer=optimizer, grad_clip=cfg.optim.grad_clip
            )
        )
        state, metrics = apply(state, folded)
    else:
        step = placement.jit_train_step(
            state,
            mesh,
            algo=algo,
            optimizer=optimizer,
            grad_clip=cfg.optim.grad_clip,
            with_reference=ref is not None,
        )
        state, metrics = step(state, arrays_of(groups, plan), ref)
    leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
    return {
        "version": int(state.step),
        "metrics": {k: float(v) for k, v in sorted(jax.device_get(metrics).items())},
        "param_sum": {
            jax.tree_util.keystr(p): float(jnp.sum(x.astype(jnp.float32))) for p, x in leaves
        },
        "param_sumsq": {
            jax.tree_util.keystr(p): float(jnp.sum(jnp.square(x.astype(jnp.float32))))
            for p, x in leaves
        },
    }


def _close(got: float, want: float, what: str, *, rtol: float = 1e-5, atol: float = 1e-6):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.matrix] if n in MATRIX else []) for n in CASES]
)
def test_same_update_as_recorded(name):
    recorded = json.loads(FIXTURE.read_text())[name]
    got = compute_case(name)
    assert got["version"] == recorded["version"]
    assert got["metrics"].keys() == recorded["metrics"].keys()
    # The step's own numbers: the loss and the gradient norm before any update.
    _close(got["metrics"]["loss/total"], recorded["metrics"]["loss/total"], "loss/total")
    _close(got["metrics"]["optim/grad_norm"], recorded["metrics"]["optim/grad_norm"], "grad")
    for key, want in recorded["metrics"].items():
        _close(got["metrics"][key], want, key, atol=SEQ_LOG_ATOL if "seq_log" in key else 1e-6)
    assert got["param_sum"].keys() == recorded["param_sum"].keys()
    for key in recorded["param_sum"]:
        # Adam moves an entry by lr·m/(√v + eps): an entry whose gradient is near eps moves
        # by a fraction of lr that the gradient's last bits decide, so another CPU's rounding
        # moves a leaf's sum by up to 0.027·lr between two x86 CPUs (where the metrics and
        # the sums of squares agree to 1e-6); allow 0.05·lr.
        atol = 0.05 * LEARNING_RATE
        _close(got["param_sum"][key], recorded["param_sum"][key], f"sum {key}", atol=atol)
        _close(got["param_sumsq"][key], recorded["param_sumsq"][key], f"sumsq {key}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: PYTHONPATH=. python {sys.argv[0]} --write")
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps({n: compute_case(n) for n in CASES}, indent=1) + "\n")
    print(f"wrote {FIXTURE} ({len(CASES)} cases)")
