"""Benchmark: one training step, the whole story in one run (issue 15).

Prints a short table and one JSON line with:

* the machine: CPU model and ISA flags (avx512f / avx2 / neon, from /proc/cpuinfo), or the
  accelerator's name; and its matmul peak measured in this run (a jitted 2048^3 matmul in
  ``--dtype``, 8192^3 on an accelerator; GFLOP/s, the fastest of 10 runs per round);
* the policy log-prob pass (``logprobs.forward_logprobs``): its forward, its
  forward+backward (``jax.value_and_grad`` of the masked sum of the log-probs with respect
  to every parameter) and their ratio (issue 15's target: <= 3.0); the same for the layer
  stack alone (``model.hidden_states`` to the final hidden state, no lm_head: ``layers``);
* one training step (jitted with the state donated and fed its own output, as the trainer
  runs it) with prox = recompute (decoupled PPO: one more no-grad forward pass),
  a3po (the proximal log-prob interpolated, no pass) and behav (plain PPO): seconds each and
  a3po / recompute (target <= 0.78; design §6's ideal, fwd+bwd = 3 forward-equivalents plus
  1 for the pass, is 0.75);
* achieved FLOP/s of each step and its fraction of the measured peak (target for the
  a3po step: >= 55 %);
* the optimizer update alone (``optim.apply_grads``: 1/count, clip, AdamW, skip if
  non-finite) on the params' shapes, and its share of the a3po step;
* peak memory: this process's peak RSS (``getrusage``; on a CPU every array lives there),
  ``memory_stats()["peak_bytes_in_use"]`` on an accelerator, and XLA's temporaries of each
  compiled program (``memory_analysis()``).

FLOPs are counted analytically, as the matmuls the compiled program executes on the padded
[B, T] batch (padding included, masked attention scores included):

    forward F = B·T · (2·P_mm + 4·T·H·K·L)
    P_mm = L · (D·H·K + 2·D·N·K + H·K·D + 3·D·F) + D·V    (layer matmuls + the lm_head)
    4·T·H·K per layer and token = QKᵀ and PV over all T keys

The embedding lookup, norms, softmax and optimizer are not counted. A backward pass costs
twice its forward, so fwd+bwd = 3F; the a3po and behav steps are 3F and the recompute step
4F (its extra no-grad pass).

The "run GFLOP" column counts instead the matmuls each compiled program really runs
(``bench_common.dot_flops``: every dot of the optimised HLO, loop bodies times their trip
count), recomputation included: the layers' attention scores rematerialised in the
backward pass, and the chunked lm_head's logits recomputed there (what keeps [B, T, V] out
of memory). Its "of peak" is the fraction of the matmul peak the program's matmul work
reaches, and the three ratios are printed with their value in these FLOPs beside them: a
ratio of times below its FLOP ratio would need the backward's matmuls to run faster than
the forward's.

Timing: every program is compiled and run once first; then all of them run round-robin
``--repeats`` times and each keeps its fastest run, so the ratios compare runs made under
the same machine load (a shared CPU's load varies from minute to minute). Beside each
ratio of fastest runs the table prints its range over the rounds (the ratio within each
round; JSON ``ratio_per_round``, with every run's seconds in ``seconds_per_round``): on a
2-core machine a ratio moves by a few hundredths from one sitting to the next, and a
target that close needs the range, not one figure.

    python scripts/bench_train_step.py                       # small random model, CPU-sized
    python scripts/bench_train_step.py --config smollm2 --batch 8 --prompt-len 40 \\
        --response-len 32                                    # issue 15's CPU shapes: (8, 128)
    python scripts/bench_train_step.py --config smollm2 --batch 32 --group-size 4 \\
        --prompt-len 40 --response-len 32                    # (32, 128)
    python scripts/bench_train_step.py --config smollm2 --batch 64 --prompt-len 256 \\
        --response-len 256 --dtype bfloat16                  # a GPU
    python scripts/bench_train_step.py --config smollm2 --batch 32 --group-size 4 \\
        --prompt-len 57 --response-len 13 --packed --groups-per-row 2   # packed rows

With ``--packed`` the batch is ``packing.pack_groups``'s (shared-prompt rows of
``--groups-per-row`` groups) and every program reads it; FLOPs are then counted on the
packed [N, L] rows (B·T above becomes N·L) with the lm_head's D·V on the N·K listed
completion positions only, so the packed and unpacked runs' FLOP/s count different work:
compare their seconds.

Speed does not depend on weight values, so models are randomly initialised with the real
architecture's shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from bench_common import CONFIGS, dot_flops, matmul_size, synthetic_groups  # noqa: E402  (scripts/ is on sys.path)

from a3po_jax import model
from a3po_jax.core import logprobs, optim, packing
from a3po_jax.core import train_step as ts
from a3po_jax.core.batching import build_batch
from a3po_jax.core.stats import Stats
from a3po_jax.training import step_builder
from a3po_jax.training.config import (
    AlgoSection,
    BatchSection,
    RolloutSection,
    SystemSection,
    TrainConfig,
)
from a3po_jax.training.metrics import peak_memory

PROX_MODES = ("recompute", "a3po", "behav")
MATMUL_RUNS_PER_ROUND = 10  # ~0.05-0.1 s each on a CPU
# Issue 15's ratios of program times: (label, JSON key, numerator, denominator, target).
RATIOS = (
    ("fwd+bwd / fwd", "fwd_bwd_over_fwd", "forward_backward", "forward", "<= 3.0"),
    ("layers fwd+bwd/fwd", "layers_fwd_bwd_over_fwd", "layers_backward", "layers", "<= 3.0"),
    ("a3po / recompute", "a3po_over_recompute", "a3po", "recompute", "<= 0.78"),
)


def machine() -> dict[str, str]:
    """The accelerator's name, or the CPU model and the ISA flags that set its matmul speed."""
    device = jax.devices()[0]
    if jax.default_backend() != "cpu":
        return {"backend": jax.default_backend(), "device": device.device_kind}
    model_name, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key == "model name":
                model_name = value.strip()
            elif key in ("flags", "features"):  # x86 / ARM
                flags |= set(value.split())
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_tile", "avx2", "fma") if f in flags]
    if flags & {"asimd", "neon"}:
        isa.append("neon")
    return {"backend": "cpu", "device": model_name, "isa": " ".join(isa) or "none listed"}


def forward_flops(cfg: model.ModelConfig, b: int, t: int, head_tokens: int | None = None) -> float:
    """F: matmul FLOPs of one forward pass over a [b, t] batch (see the module docstring);
    ``head_tokens``: positions the lm_head runs on (default all b·t; packed: N·K)."""
    d, h, n, k, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    layer_mm = d * h * k + 2 * d * n * k + h * k * d + 3 * d * f
    attention = 4 * t * h * k * cfg.n_layers
    head_tokens = b * t if head_tokens is None else head_tokens
    layers = b * t * (2 * cfg.n_layers * layer_mm + attention)
    return float(layers + head_tokens * 2 * d * cfg.vocab_size)


def _temporaries(compiled) -> int | None:
    """XLA's temporary bytes of a compiled program (activations, workspace), if reported."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # not every backend implements it
        return None


def _executed_dot_flops(compiled) -> float | None:
    """The matmul FLOPs the compiled program runs (`bench_common.dot_flops`), if countable."""
    try:
        return dot_flops(compiled.as_text())
    except ValueError:  # a loop of unknown length
        return None


def time_round_robin(
    programs: dict, repeats: int, runs_per_round: dict[str, int]
) -> dict[str, list[float]]:
    """Each program's fastest run in each of `repeats` rounds (a list per program), the
    programs interleaved; a program in `runs_per_round` runs that many times per round (a
    short one: more tries at a quiet moment of a shared machine)."""
    rounds = {}
    for name, run in programs.items():
        jax.block_until_ready(run())  # warm-up (compiled already)
        rounds[name] = []
    for _ in range(repeats):
        for name, run in programs.items():
            best = float("inf")
            for _ in range(runs_per_round.get(name, 1)):
                start = time.perf_counter()
                jax.block_until_ready(run())
                best = min(best, time.perf_counter() - start)
            rounds[name].append(best)
    return rounds


def round_ratios(rounds: dict[str, list[float]], num: str, den: str) -> list[float]:
    """`num` / `den` within each round: the spread of a ratio over runs made under the same
    load, next to the ratio of the two fastest runs."""
    return [a / b for a, b in zip(rounds[num], rounds[den], strict=True)]


def chained_step(compiled, state, *rest):
    """A no-argument callable running a state-donating step on its own last output, as the
    trainer does (the donated buffers are reused: no fresh state is allocated per step)."""
    cell = [state]

    def run():
        cell[0], metrics = compiled(cell[0], *rest)
        return cell[0], metrics

    return run


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="small", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=16, help="sequences per step (B)")
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt; divides B")
    p.add_argument("--prompt-len", type=int, default=96, help="prompt tokens")
    p.add_argument(
        "--response-len",
        type=int,
        default=160,
        help="completion tokens; T = prompt + response - 1 rounded up to a multiple of 64",
    )
    p.add_argument("--micro-batch", type=int, default=0, help="0 = whole batch at once")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each program")
    p.add_argument(
        "--packed",
        action="store_true",
        help="shared-prompt packed rows (system.batch.packed_prompts): FLOPs counted on the\n"
        "packed [N, L] rows and the lm_head's N·K completion positions",
    )
    p.add_argument(
        "--groups-per-row", type=int, default=1, help="with --packed: system.batch.groups_per_row"
    )
    args = p.parse_args(argv)

    mcfg = dataclasses.replace(
        CONFIGS[args.config], param_dtype=args.dtype, compute_dtype=args.dtype
    )
    groups = synthetic_groups(
        args.batch // args.group_size,
        args.group_size,
        args.prompt_len,
        args.response_len,
        mcfg.vocab_size,
        versions=lambda g, i: g % 3,  # staleness 0-2 across groups: a3po's α paths all run
    )
    if args.packed:
        packed = packing.pack_groups(
            groups, advantage="grpo", length_bucket=64, groups_per_row=args.groups_per_row
        )
        batch, arrays_np = packed.batch, packed.arrays()
        b, t = packed.shape  # FLOPs and the printed shape are the packed rows'
        head_tokens = packed.head_token_slots
    else:
        batch = build_batch(groups, advantage="grpo", length_bucket=64)
        arrays_np = batch.arrays()
        b, t = batch.shape
        head_tokens = None
    arrays = {k: jnp.asarray(v) for k, v in arrays_np.items()}
    n_tok = int(batch.loss_mask.sum())
    logp_fn = packing.packed_token_logprobs if args.packed else logprobs.forward_logprobs
    params = model.init_params(mcfg, jax.random.key(0))
    info = machine()
    print(
        f"device: {info['device']} ({info['backend']}"
        + (f"; {info['isa']}" if "isa" in info else "")
        + f"); model {args.config} ({mcfg.n_params / 1e6:.1f}M params, {args.dtype}); "
        f"{'packed rows' if args.packed else 'batch'} {b}x{t} ({n_tok} completion tokens"
        + (f", head on {head_tokens}" if args.packed else "")
        + f"); micro-batch {args.micro_batch or batch.shape[0]}",
        flush=True,
    )

    # The programs, all compiled before anything is timed.
    mm_dtype, mm_n = jnp.dtype(args.dtype), matmul_size()
    mm_args = tuple(jax.random.normal(jax.random.key(i), (mm_n, mm_n), mm_dtype) for i in (1, 2))
    programs = {"matmul": (jax.jit(jnp.matmul), mm_args)}

    def policy_logp(prm, batch_arrays):
        logp, _ = logp_fn(prm, batch_arrays, model_config=mcfg, temperature=1.0)
        return jnp.sum(logp * batch_arrays["loss_mask"])

    def layer_stack(prm, batch_arrays):
        """The decoder layers to the final hidden state (no lm_head): issue 15's second ratio."""
        hidden_fn = packing.packed_hidden if args.packed else logprobs.batch_hidden
        return jnp.sum(hidden_fn(prm, batch_arrays, model_config=mcfg))

    programs["forward"] = (jax.jit(policy_logp), (params, arrays))
    programs["forward_backward"] = (jax.jit(jax.value_and_grad(policy_logp)), (params, arrays))
    programs["layers"] = (jax.jit(layer_stack), (params, arrays))
    programs["layers_backward"] = (jax.jit(jax.value_and_grad(layer_stack)), (params, arrays))
    for prox in PROX_MODES:
        cfg = TrainConfig(
            rollout=RolloutSection(
                group_size=args.group_size, groups_per_step=args.batch // args.group_size
            ),
            algo=AlgoSection(prox=prox),
            system=SystemSection(
                batch=BatchSection(
                    micro_batch_size=args.micro_batch,
                    packed_prompts=args.packed,
                    groups_per_row=args.groups_per_row if args.packed else 1,
                    length_bucket=64,
                )
            ),
        )
        opt = step_builder.optimizer(cfg)
        step = jax.jit(
            functools.partial(
                ts.train_step,
                algo=step_builder.algorithm(cfg, mcfg),
                optimizer=opt,
                grad_clip=1.0,
            ),
            donate_argnums=(0,),  # as the trainer's step
        )
        # Each step owns its state (a copy of the params): donation consumes the buffers.
        state = optim.init_train_state(jax.tree.map(jnp.copy, params), opt)
        programs[prox] = (step, (state, arrays, None))
    # The optimizer update alone (optim.apply_grads: 1/count, clip, AdamW, skip if
    # non-finite), on gradients of the params' shapes: what a step costs beyond its passes.
    update = jax.jit(
        functools.partial(optim.apply_grads, optimizer=opt, grad_clip=1.0), donate_argnums=(0,)
    )
    acc = optim.Accumulated(
        grads=jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params),
        loss_sum=jnp.ones((), jnp.float32),
        count=jnp.full((), float(n_tok), jnp.float32),
        stats=Stats(),
    )
    state = optim.init_train_state(jax.tree.map(jnp.copy, params), opt)
    programs["update"] = (update, (state, acc))

    temporaries, executed, runs = {}, {}, {}
    for name, (fn, fn_args) in programs.items():
        start = time.perf_counter()
        compiled = fn.lower(*fn_args).compile()
        temporaries[name] = _temporaries(compiled)
        executed[name] = _executed_dot_flops(compiled)
        if name in (*PROX_MODES, "update"):
            runs[name] = chained_step(compiled, *fn_args)
        else:
            runs[name] = functools.partial(compiled, *fn_args)
        print(f"compiled {name} in {time.perf_counter() - start:.1f} s", flush=True)
    del programs
    rounds = time_round_robin(runs, args.repeats, {"matmul": MATMUL_RUNS_PER_ROUND})
    seconds = {name: min(times) for name, times in rounds.items()}

    peak = 2 * mm_n**3 / seconds["matmul"]
    fwd = forward_flops(mcfg, b, t, head_tokens)
    flops = {"forward": fwd, "forward_backward": 3 * fwd, "recompute": 4 * fwd}
    flops.update(a3po=3 * fwd, behav=3 * fwd)
    layers = forward_flops(mcfg, b, t, head_tokens=0)  # the same count without the lm_head
    flops.update(layers=layers, layers_backward=3 * layers)
    achieved = {name: flops[name] / seconds[name] for name in flops}
    memory = peak_memory()
    results = {
        **info,
        "config": args.config,
        "dtype": args.dtype,
        "batch": [b, t],
        "packed": args.packed,
        "groups_per_row": args.groups_per_row if args.packed else None,
        "head_tokens": head_tokens,
        "completion_tokens": n_tok,
        "matmul_peak_gflops": peak / 1e9,
        "seconds": {k: v for k, v in seconds.items() if k != "matmul"},
        "seconds_per_round": {k: v for k, v in rounds.items() if k != "matmul"},
        **{key: seconds[num] / seconds[den] for _, key, num, den, _ in RATIOS},
        "flops": flops,
        "executed_dot_flops": {k: v for k, v in executed.items() if k not in ("matmul", "update")},
        "achieved_gflops": {k: v / 1e9 for k, v in achieved.items()},
        "fraction_of_peak": {k: v / peak for k, v in achieved.items()},
        "peak_rss_gb": memory["mem/peak_rss_gb"],
        "device_peak_gb": memory.get("mem/device_peak_gb"),
        "temporaries_gb": {k: v / 2**30 for k, v in temporaries.items() if v is not None},
    }

    print(f"matmul {mm_n}^3 {args.dtype}: {peak / 1e9:.1f} GFLOP/s (this run's peak)")
    print(
        f"{'program':<18}{'seconds':>10}{'GFLOP/s':>10}{'of peak':>9}{'temp GiB':>10}"
        f"{'run GFLOP':>11}{'of peak':>9}"
    )
    for name in ("forward", "forward_backward", "layers", "layers_backward", *PROX_MODES):
        temp, ran = results["temporaries_gb"].get(name), executed[name]
        print(
            f"{name:<18}{seconds[name]:>10.3f}{achieved[name] / 1e9:>10.1f}"
            f"{achieved[name] / peak:>9.1%}{'' if temp is None else f'{temp:.2f}':>10}"
            + ("" if ran is None else f"{ran / 1e9:>11.0f}{ran / seconds[name] / peak:>9.1%}")
        )
    print(
        f"{'update':<18}{seconds['update']:>10.3f}   (the optimizer update alone: "
        f"{seconds['update'] / seconds['a3po']:.1%} of the a3po step)"
    )
    results["executed_dot_flop_ratios"] = {}
    results["ratio_per_round"] = {}
    for what, key, num, den, target in RATIOS:
        line = f"{what:<18}{results[key]:>10.3f}   ("
        spread = round_ratios(rounds, num, den)
        results["ratio_per_round"][what] = spread
        if len(spread) > 1:
            line += f"rounds {min(spread):.3f}-{max(spread):.3f}; "
        line += f"issue 15 target {target}"
        if executed[num] and executed[den]:
            # the same ratio of the FLOPs the programs run: its value at equal matmul speed
            ratio = executed[num] / executed[den]
            results["executed_dot_flop_ratios"][what] = ratio
            line += f"; {ratio:.3f} in the FLOPs the two programs run"
        print(line + ")")
    of_peak = results["fraction_of_peak"]["a3po"]
    print(f"{'a3po step of peak':<18}{of_peak:>10.3f}   (issue 15 target >= 0.55)")
    device_peak = results["device_peak_gb"]
    print(
        f"peak RSS {results['peak_rss_gb']:.2f} GiB"
        + ("" if device_peak is None else f"; device peak {device_peak:.2f} GiB")
    )
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
