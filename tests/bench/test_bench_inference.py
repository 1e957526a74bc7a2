"""scripts/bench_inference.py --experiment: generation as a run of the experiment does it
(its host, its task's prompts through the chat template, groups of G sampled at the run's
temperature with per-sample keys and EOS stops), with the host's time by part as the run's
record sets it out. On the tiny model and the toy task: nothing downloads."""

import os
import re
import sys
from collections import defaultdict

import pytest
from helpers.paths import REPO

sys.path.insert(0, str(REPO / "scripts"))

from bench_inference import RunLikeHost, main  # noqa: E402

from a3po_jax.inference.host_metrics import LOOP_PARTS  # noqa: E402
from a3po_jax.tasks import PromptIterator, make_task, render_prompt  # noqa: E402
from a3po_jax.training.config import apply_overrides, load_experiment  # noqa: E402

EXPERIMENT = REPO / "experiments" / "smoke_tiny.py"
# Long enough answers that the random model ends some of them with its EOS token.
OVERRIDES = ["rollout.max_new_tokens=24", "rollout.groups_per_step=4", "rollout.group_size=8"]


@pytest.fixture(scope="module")
def cfg():
    return apply_overrides(load_experiment(EXPERIMENT), OVERRIDES)


def test_a_round_is_one_steps_groups_sampled_and_stopped_as_the_run_does(cfg):
    r = cfg.rollout
    with RunLikeHost(cfg) as bench:
        eos = bench.tokenizer.eos_token_id
        assert eos is not None and bench.sampling.stop_tokens == (eos,)
        assert bench.sampling.temperature == r.temperature == 1.0
        seconds, results, parts, decode_steps = bench.round()
    # The run's first prompts, in its order, through the chat template.
    task = make_task(cfg.task.name, **cfg.task.kwargs)
    prompts = PromptIterator(task.prompts(cfg.task.split), batch_size=1, seed=cfg.seed)
    rendered = [render_prompt(bench.tokenizer, prompts.next_batch()[0]) for _ in range(4)]
    groups = defaultdict(list)
    for res in results:
        groups[res.request_id].append(res)
    assert sorted(groups) == ["g0", "g1", "g2", "g3"]
    for i, request_id in enumerate(sorted(groups)):
        samples = groups[request_id]
        assert sorted(s.sample_index for s in samples) == list(range(r.group_size))
        assert all(list(s.prompt_tokens) == rendered[i] for s in samples)
        # Per-sample keys: a group's samples from one prompt are not copies of each other.
        assert len({tuple(s.tokens) for s in samples}) > 1
    for res in results:
        tokens = list(res.tokens)
        assert res.finish_reason in ("stop", "length")
        if res.finish_reason == "stop":
            assert tokens[-1] == eos and eos not in tokens[:-1]
        else:
            assert len(tokens) == r.max_new_tokens and eos not in tokens
    assert any(res.finish_reason == "stop" for res in results)
    # The parts and idle split the round's seconds: none negative, none counted twice.
    assert set(parts) == {*LOOP_PARTS, "idle"} and all(v >= 0 for v in parts.values())
    assert parts["prefill_wait"] > 0 and parts["decode_wait"] > 0
    assert sum(parts.values()) == pytest.approx(seconds, rel=0.05, abs=0.01)
    # The longest answer's decode steps at least (the prefill makes its first token), and
    # no more than all the samples' one after another.
    lengths = [len(res.tokens) for res in results]
    assert max(lengths) - 1 <= decode_steps <= sum(lengths)


def test_main_prints_the_breakdown_under_the_records_names(capsys):
    main(["--experiment", str(EXPERIMENT), "--rounds", "1", *OVERRIDES])
    out = capsys.readouterr().out
    assert "4 prompts x 8 samples per step, temperature 1.0, at most 24 new tokens" in out
    for part in (*LOOP_PARTS, "idle"):
        assert f"host/{part}_s" in out
    assert re.search(r"host/decode_steps +\d+\.\d   \(decode_wait \d+\.\d ms each\)", out)


def test_heap_as_run_trims_as_the_runs_settings_say(cfg, capsys):
    from a3po_jax.training.config import apply_overrides

    quick = apply_overrides(cfg, ["system.run.trim_heap_every_s=0.02"])
    with RunLikeHost(quick, heap_as_run=True) as bench:
        bench.round()
        trimmer = bench.trimmer
        assert trimmer is not None and trimmer.period_s == 0.02 and trimmer.trims > 0
    assert not trimmer._thread.is_alive()  # closed with the host
    with RunLikeHost(cfg) as bench:
        assert bench.trimmer is None  # the host alone, as before
    # A run that does not trim: nothing to do as it does.
    with RunLikeHost(
        apply_overrides(cfg, ["system.run.trim_heap_every_s=0"]), heap_as_run=True
    ) as b:
        assert b.trimmer is None
    main(["--experiment", str(EXPERIMENT), "--rounds", "1", "--heap-as-run", *OVERRIDES])
    out = capsys.readouterr().out
    threshold = (
        "blocks from 1 MiB mmapped"
        if os.environ.get("A3PO_MMAP_LARGE_BLOCKS", "1") != "0"
        else "glibc's own mmap threshold (A3PO_MMAP_LARGE_BLOCKS=0)"
    )
    assert f"heap: trimmed every 1 s, {threshold} (the run's system.run)" in out


def test_overrides_without_an_experiment_are_refused():
    with pytest.raises(SystemExit):
        main(["--no-hf", "rollout.group_size=4"])
