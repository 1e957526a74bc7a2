"""The main job's held-out test shares no question with anything its training can draw.

README command 1 runs `experiments/quickstart_a3po.py`; its evaluation scores the first
`eval_prompts` prompts of the task's test split. This builds the task as the trainer does
and reads the whole train split (every prompt training can draw, in any run of any length
up to its size), so the check covers the space training reaches, not a sample of it.
"""

import hashlib
import json
from pathlib import Path

from a3po_jax.tasks import holdout_bucket, make_task, problem_key
from a3po_jax.training.config import load_experiment

MAIN_JOB = Path(__file__).resolve().parents[2] / "experiments" / "quickstart_a3po.py"


def test_the_main_jobs_test_questions_are_never_training_questions():
    cfg = load_experiment(MAIN_JOB)
    task = make_task(cfg.task.name, **cfg.task.kwargs)
    assert 0 < task.holdout < 1, "the main job evaluates on a held-out share of the space"
    test = [problem_key(p.metadata["entry"]) for p in task.prompts("test")[: cfg.eval_prompts]]
    assert len(test) == cfg.eval_prompts >= 128
    assert len(set(test)) == len(test), "each test question is asked once"
    assert all(holdout_bucket(key) < task.holdout for key in test)
    train = {problem_key(p.metadata["entry"]) for p in task.prompts("train")}
    # The whole train split lies on the other side of the partition: no key is a test key.
    assert len(train) > 1000 and not train & set(test)
    assert all(holdout_bucket(key) >= task.holdout for key in train)
    # The run draws at most steps x groups_per_step prompts: far fewer than the split holds.
    assert cfg.steps * cfg.rollout.groups_per_step <= len(task.prompts("train"))


MINIATURE = MAIN_JOB.with_name("rlhf_miniature_smollm2.py")
PROXY = MAIN_JOB.parents[1] / "results" / "rlhf_miniature_smollm2" / "proxy"


def test_the_rlhf_miniatures_proxy_learned_from_no_test_question():
    """The proxy reward model's pairs (committed beside its `reward_model.json`) were sampled
    on training prompts only: the policy trained against it is judged on questions neither
    the proxy nor the policy ever saw."""
    cfg = load_experiment(MINIATURE)
    task = make_task(cfg.task.name, **cfg.task.kwargs)
    pairs_file = PROXY / "pairs.jsonl"
    lines = pairs_file.read_bytes()
    recorded = json.loads((PROXY / "reward_model.json").read_text())
    assert hashlib.sha256(lines).hexdigest() == recorded["pairs_sha256"], "not the proxy's pairs"
    train = {p.prompt_id: p for p in task.prompts("train")}
    test = {problem_key(p.metadata["entry"]) for p in task.prompts("test")}
    pairs = [json.loads(line) for line in lines.splitlines()]
    assert len(pairs) == recorded["pairs"] > 0
    for pair in pairs:
        prompt = train[pair["prompt_id"]]  # a KeyError names a pair from outside the split
        assert pair["prompt"] == [dict(m) for m in prompt.messages]
        assert problem_key(prompt.metadata["entry"]) not in test
