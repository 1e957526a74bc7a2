"""A whole run in-process on the tiny model and the letters task: the config the
end-to-end tests start from, and one call that runs it and reads its metrics back."""

from a3po_jax.tasks.toy import LetterTask  # reward: fraction of 'a's
from a3po_jax.training.config import (
    AlgoSection,
    ModelSection,
    RolloutSection,
    SystemSection,
    TaskSection,
    TrainConfig,
)
from a3po_jax.training.metrics import read_metrics
from a3po_jax.training.trainer import Trainer, load_policy

__all__ = ["LetterTask", "make_cfg", "run"]


def make_cfg(tmp_path, name, *, mode="async", eta=2, steps=3, **algo):
    group_size = 2 if algo.get("loss") == "dpo" else 4
    return TrainConfig(
        model=ModelSection(name="tiny"),
        task=TaskSection(name="letters"),
        rollout=RolloutSection(
            group_size=group_size,
            groups_per_step=2,
            max_new_tokens=6,
            num_slots=8,
            prompt_buckets=(64,),
        ),
        algo=AlgoSection(**algo),
        system=SystemSection(mode=mode, max_staleness=eta if mode == "async" else 0),
        steps=steps,
        seed=1,
        run_dir=str(tmp_path / name),
        checkpoint_every=0,
    )


def run(cfg, *, resume=False):
    trainer = Trainer(cfg, load_policy(cfg.model), task=LetterTask(), console=False)
    trainer.run(resume=resume)
    return read_metrics(cfg.run_dir)
