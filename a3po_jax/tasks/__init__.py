"""Tasks: prompts with gold answers, verifiable rewards, and a resumable prompt iterator.

Tasks layer (host-side shell).

task = make_task("chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1)
it = PromptIterator(task.prompts("train"), batch_size=8, seed=0)
batch = it.next_batch()                       # list[Prompt]
ids = render_prompt(tokenizer, batch[0])      # chat template + generation prompt
reward, info = shaped_reward(task, batch[0], text, finished=True, num_tokens=12,
                             config=RewardConfig(format_reward=0.1))
"""

from a3po_jax.tasks.answers import (
    ExtractedAnswer,
    answers_match,
    canonical_number,
    extract_answer,
    extract_boxed,
    extract_final_text,
    gold_from_gsm8k_solution,
    has_boxed_answer,
    parse_number,
)
from a3po_jax.tasks.gsm8k import (
    Gsm8kOfflineTask,
    Gsm8kTask,
    load_offline_gsm8k,
    load_tfds_gsm8k,
)
from a3po_jax.tasks.jsonl_task import JsonlTask, load_jsonl_prompts
from a3po_jax.tasks.prompt_iterator import PromptIterator
from a3po_jax.tasks.reasoning_gym_tasks import (
    TEST_SEED_OFFSET,
    ReasoningGymTask,
    holdout_bucket,
    problem_key,
)
from a3po_jax.tasks.registry import TASK_NAMES, make_task
from a3po_jax.tasks.rewards import RewardConfig, shaped_reward
from a3po_jax.tasks.task import (
    BOXED_INSTRUCTION,
    CHATML_TEMPLATE,
    MATH_INSTRUCTION,
    Prompt,
    Task,
    render_prompt,
)

__all__ = [
    "BOXED_INSTRUCTION",
    "CHATML_TEMPLATE",
    "ExtractedAnswer",
    "Gsm8kOfflineTask",
    "Gsm8kTask",
    "JsonlTask",
    "MATH_INSTRUCTION",
    "Prompt",
    "PromptIterator",
    "ReasoningGymTask",
    "RewardConfig",
    "TASK_NAMES",
    "TEST_SEED_OFFSET",
    "Task",
    "answers_match",
    "canonical_number",
    "extract_answer",
    "extract_boxed",
    "extract_final_text",
    "gold_from_gsm8k_solution",
    "has_boxed_answer",
    "holdout_bucket",
    "load_jsonl_prompts",
    "load_offline_gsm8k",
    "load_tfds_gsm8k",
    "make_task",
    "parse_number",
    "problem_key",
    "render_prompt",
    "shaped_reward",
]
