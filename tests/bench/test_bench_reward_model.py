"""scripts/bench_reward_model.py on the tiny model: the FLOPs it divides by are the ones the
reward model's compiled forward pass runs, and every figure it prints is in its results."""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_common import CONFIGS, dot_flops  # noqa: E402
from bench_reward_model import layer_flops, main  # noqa: E402

from a3po_jax import model  # noqa: E402
from a3po_jax.model.reward_model import reward_params_from_policy, reward_scores  # noqa: E402


def test_the_counted_flops_are_the_compiled_forward_passes():
    cfg = CONFIGS["tiny"]
    trunk_cfg, params = reward_params_from_policy(model.init_params(cfg, jax.random.key(0)), cfg)
    b, t = 4, 64
    tokens, lengths = jnp.ones((b, t), jnp.int32), jnp.full((b,), t, jnp.int32)
    scores = jax.jit(functools.partial(reward_scores, config=trunk_cfg))
    ran = dot_flops(scores.lower(params, tokens, lengths).compile().as_text())
    # The layers' matmuls, plus the [D] -> 1 head on each row's last position.
    assert ran == layer_flops(trunk_cfg, b * t, t) + 2 * b * cfg.d_model


def test_the_benchmark_reports_its_machine_and_figures(capsys):
    results = main(["--config", "tiny", "--batch", "8", "--repeats", "2"])
    assert results["padded_to"] == [16, 128]  # 8 rows of 121 tokens: one 16-row batch, bucket 128
    assert results["cores"] >= 1 and results["device"]
    assert 0 < results["fraction_of_peak"] and results["weights_gb"] > 0
    s = results["score_s_per_step"]
    assert 0 < s["min"] <= s["median"] <= s["max"]
    out = capsys.readouterr().out
    assert "machine: " in out and "of this run's matmul peak" in out
