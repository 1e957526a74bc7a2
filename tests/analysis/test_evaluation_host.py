"""`evaluate` through the real in-process inference host (tiny random model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.model_reference import greedy_generate

from a3po_jax import model
from a3po_jax.analysis.evaluation import evaluate, host_generate_fn
from a3po_jax.inference.host import InferenceHost
from a3po_jax.model.char_tokenizer import char_tokenizer
from a3po_jax.tasks import Prompt, render_prompt


class EchoTask:
    """Gold answer = the completion the tiny model produces greedily for prompt 0, so exactly
    the prompts whose greedy completion matches score 1 (checked against the model's own
    greedy decode below)."""

    name = "echo"

    def __init__(self, answers):
        self.answers = answers

    def prompts(self, split):
        return [
            Prompt(f"echo/{split}/{i}", ({"role": "user", "content": f"q{i}"},), a)
            for i, a in enumerate(self.answers)
        ]

    def score(self, prompt, completion_text):
        return float(completion_text == prompt.answer)

    def format_ok(self, completion_text):
        return True

    def extract_answer(self, prompt, completion_text):
        return completion_text


@pytest.mark.e2e  # a whole host, its serving thread answering the evaluation
def test_greedy_evaluation_through_the_host_matches_model_greedy():
    cfg = model.ModelConfig.tiny(max_seq_len=512)
    params = model.init_params(cfg, jax.random.key(3))
    tok = char_tokenizer()
    probe = EchoTask(["?"] * 4)
    new = 5
    expected = []
    for p in probe.prompts("test"):
        ids = render_prompt(tok, p)
        out = greedy_generate(
            params, cfg, jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32), new
        )
        expected.append(tok.decode(np.asarray(out[0]).tolist(), skip_special_tokens=True))
    # Prompts 0 and 2 carry the model's own greedy completion as gold; 1 and 3 a wrong one.
    task = EchoTask([expected[0], "zzz", expected[2], "zzz"])
    with InferenceHost(cfg, params, num_slots=4, prefill_buckets=(64,), max_cache_len=96) as host:
        result = evaluate(task, "test", host_generate_fn(host), tok, max_new_tokens=new)
    assert [r.completions[0] for r in result.records] == expected
    assert result.accuracy == 0.5
    assert abs(result.stderr - 0.25) < 1e-9  # sqrt(0.5 * 0.5 / 4)
