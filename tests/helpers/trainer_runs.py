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


def resumed_progress(run_dir, resumes):
    """Steps logged by the current leg of a run killed and resumed ``resumes`` times (0 until
    that leg has logged its resume, or while there is no checkpoint to resume from)."""
    from a3po_jax.cli.train import latest_checkpoint_step

    ledger, metrics = run_dir / "ledger.jsonl", run_dir / "metrics.jsonl"
    if not (ledger.exists() and metrics.exists()):
        return 0
    if ledger.read_text().count('"event": "resume"') < resumes:
        return 0  # the resumed process has not restored its checkpoint yet
    if latest_checkpoint_step(run_dir) < 1:
        return 0  # nothing to resume from yet
    return len(read_metrics(run_dir))
