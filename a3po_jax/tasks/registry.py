"""`make_task`: build a task by name, e.g. from an experiment config or the command line.

Tasks layer (host-side shell).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from a3po_jax.tasks.gsm8k import Gsm8kOfflineTask, Gsm8kTask
from a3po_jax.tasks.jsonl_task import JsonlTask
from a3po_jax.tasks.reasoning_gym_tasks import ReasoningGymTask
from a3po_jax.tasks.task import Task
from a3po_jax.tasks.toy import LetterTask

REASONING_GYM_PREFIX = "reasoning_gym:"

_BUILDERS: dict[str, Callable[..., Task]] = {
    "chain_sum": lambda **kw: ReasoningGymTask("chain_sum", **kw),
    "basic_arithmetic": lambda **kw: ReasoningGymTask("basic_arithmetic", **kw),
    "countdown": lambda **kw: ReasoningGymTask("countdown", **kw),
    "gsm_symbolic": lambda **kw: ReasoningGymTask("gsm_symbolic", **kw),
    "gsm8k": Gsm8kTask,
    "gsm8k_offline": Gsm8kOfflineTask,
    "jsonl": JsonlTask,
    "letters": LetterTask,
}
TASK_NAMES = tuple(_BUILDERS)


def make_task(name: str, **kwargs: Any) -> Task:
    """The task called `name`, built with `kwargs`.

    Names: "chain_sum", "basic_arithmetic", "countdown", "gsm_symbolic" (reasoning-gym;
    kwargs: seed, train_size, test_size, partial_credit, instruction, system_prompt and the
    dataset's difficulty options), "gsm8k" (tfds; data_dir, download), "gsm8k_offline"
    (100 GSM8K test problems shipped offline), "jsonl" (path, prompt_field, answer_field,
    id_field), "letters" (toy task for tiny models; letters, seed, train_size,
    test_size), and "reasoning_gym:<dataset>" for any other reasoning-gym dataset (scored
    on its final line or boxed text).

    Raises:
      ValueError: for an unknown name, listing the known ones.
    """
    if name in _BUILDERS:
        return _BUILDERS[name](**kwargs)
    if name.startswith(REASONING_GYM_PREFIX):
        return ReasoningGymTask(name[len(REASONING_GYM_PREFIX) :], **kwargs)
    raise ValueError(
        f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}, "
        f"or '{REASONING_GYM_PREFIX}<dataset>' for any reasoning-gym dataset"
    )
