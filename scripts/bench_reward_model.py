"""What a reward model (``task.reward=model:PATH``) adds to a step: the seconds it takes to
score one step's samples, its weights' memory, and its matmul work as a fraction of this
machine's matmul peak measured in the same run.

Command:  python scripts/bench_reward_model.py        # SmolLM2-135M shapes, the main job's step
          python scripts/bench_reward_model.py --config tiny --batch 8 --repeats 2   # a smoke run
Hardware: any; prints the machine (CPU model and flags, or accelerator) beside the figures.

The scorer is the pipeline's own (:class:`a3po_jax.tasks.reward_model_scorer.RewardScorer`,
rows sorted by length, padded to power-of-two length buckets, ``--score-batch`` rows per
forward pass) over random weights of the named shapes (speed does not depend on their
values) and random token rows of the main job's lengths: ``--batch`` samples a step, each a
``--prompt-len``-token prompt and a ``--completion-len``-token completion.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_common import CONFIGS, describe_machine, matmul_size  # noqa: E402

from a3po_jax import model  # noqa: E402
from a3po_jax.model.reward_model import RewardModel, reward_params_from_policy  # noqa: E402
from a3po_jax.tasks.reward_model_scorer import RewardScorer  # noqa: E402
from a3po_jax.training.metrics import peak_memory  # noqa: E402


def layer_flops(cfg: model.ModelConfig, tokens: int, t: int) -> float:
    """Matmul FLOPs of the decoder layers over ``tokens`` positions of rows of length ``t``
    (the reward model has no lm_head: one [D, 1] head per row, negligible)."""
    d, h, n, k, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    layer_mm = d * h * k + 2 * d * n * k + h * k * d + 3 * d * f
    return float(tokens * (2 * cfg.n_layers * layer_mm + 4 * t * h * k * cfg.n_layers))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="smollm2", choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=32, help="samples scored per step")
    parser.add_argument("--prompt-len", type=int, default=60)
    parser.add_argument("--completion-len", type=int, default=61)
    parser.add_argument("--score-batch", type=int, default=16, help="rows per forward pass")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    for flag in ("batch", "prompt_len", "completion_len", "score_batch", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")

    info = describe_machine()
    print(f"machine: {json.dumps(info)}", flush=True)
    cfg = CONFIGS[args.config]
    rss_before = peak_memory()["mem/peak_rss_gb"]
    params = model.init_params(cfg, jax.random.key(0))
    trunk_cfg, trunk = reward_params_from_policy(params, cfg, jax.random.key(1), head_std=0.02)
    del params
    rm = RewardModel(trunk_cfg, trunk, tokenizer=None, pad_token_id=0, base=args.config)
    scorer = RewardScorer(name=f"bench:{args.config}", version="random", model=rm,
                          batch_size=args.score_batch)  # fmt: skip
    rng = np.random.default_rng(0)
    length = args.prompt_len + args.completion_len
    rows = [list(rng.integers(1, cfg.vocab_size, length)) for _ in range(args.batch)]

    mm_n = matmul_size()
    mm = jax.jit(jnp.matmul)
    a, b = (jax.random.normal(jax.random.key(i), (mm_n, mm_n), jnp.float32) for i in (2, 3))
    mm(a, b).block_until_ready()
    t0 = time.perf_counter()
    scorer.score_tokens(rows)  # compiles the bucket
    compile_s = time.perf_counter() - t0

    score_s, mm_s = [], []
    for _ in range(args.repeats):  # round robin: both see the same machine state
        t0 = time.perf_counter()
        scorer.score_tokens(rows)  # returns numpy: waited for
        score_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        mm_s.append(time.perf_counter() - t0)
    peak = 2 * mm_n**3 / min(mm_s)
    bucket = scorer.buckets[int(np.searchsorted(scorer.buckets, length))]
    padded_rows = -(-args.batch // args.score_batch) * args.score_batch
    flops = layer_flops(trunk_cfg, padded_rows * bucket, bucket)
    results = {
        **info,
        "config": args.config,
        "samples_per_step": args.batch,
        "tokens_per_sample": length,
        "padded_to": [padded_rows, bucket],
        "compile_s": compile_s,
        "score_s_per_step": {
            "min": min(score_s),
            "median": statistics.median(score_s),
            "max": max(score_s),
        },  # fmt: skip
        "matmul_peak_gflops": peak / 1e9,
        "fraction_of_peak": flops / min(score_s) / peak,
        "weights_gb": scorer.param_bytes / 2**30,
        "peak_rss_gb_before": rss_before,
        "peak_rss_gb_after": peak_memory()["mem/peak_rss_gb"],
    }
    s = results["score_s_per_step"]
    print(
        f"{args.config} reward model, {args.batch} samples x {length} tokens (padded "
        f"{padded_rows} x {bucket}): {s['median']:.3f} s a step (min {s['min']:.3f}, max "
        f"{s['max']:.3f}; compile {compile_s:.1f} s), {results['fraction_of_peak']:.0%} of this "
        f"run's matmul peak ({peak / 1e9:.1f} GFLOP/s); weights {results['weights_gb']:.3f} GiB, "
        f"peak RSS {rss_before:.2f} -> {results['peak_rss_gb_after']:.2f} GiB"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
