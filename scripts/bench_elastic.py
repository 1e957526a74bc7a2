"""Benchmark: a real run's steps per hour as inference hosts join it and leave it.

    python scripts/bench_elastic.py                          # tiny model, 1 -> 3 -> 1 hosts
    python scripts/bench_elastic.py --steps-per-phase 20 --max-hosts 4 --out elastic.json

It starts one gRPC host process (``python -m a3po_jax.cli.serve``, its flags read from the
run's config as ``scripts/launch.py join-host`` does), then an asynchronous run on it
(``python -m a3po_jax.cli.train EXPERIMENT``) with ``system.placement.hosts_file`` and the
host token file. Once a phase has its steps, a further host is started with ``--join``
(it adds its own line to the file), up to ``--max-hosts``; then the newest hosts are sent
SIGTERM one after another (each removes its line and leaves), back to one host. Where
``taskset`` and two cores are there, the trainer is pinned to the first core and every host
to the second ("1+1 cores"); on more cores, to the rest.

A phase starts at the first step the trainer's record shows the new number of hosts (and,
after a join, the first samples of the new host: its first requests compile), and lasts
``--steps-per-phase`` steps, longer until every host in it has served. The steps between an
action and its phase's start are left out. Per phase it prints the steps, the median
seconds per step (``time/step_s``), steps per hour, the samples each host delivered
(``hosts/served/HOST``) and which side waited: the medians of ``time/wait_frac`` (the
trainer's share of the step waiting for rollouts) and ``host/busy_frac`` per host, read
with the run report's thresholds (docs/training.md, "Which side waited"). The default
workload (longer answers, two groups a step) makes generation the bound with one host.
Then the machine and, last, one JSON line with everything (also written to ``--out``).
Progress goes to stderr; every process it started is stopped on exit, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_common import describe_machine  # noqa: E402  (scripts/ is on sys.path)
from launch import READY_LINE, _host_argv, _resolve, ensure_token_file  # noqa: E402

from a3po_jax.analysis.run_report import HOST_BUSY, WAITS

ROOT = Path(__file__).resolve().parents[1]
# Generation-bound with one host on a CPU: long answers (a learning rate too small to teach
# the random model the toy task's one-letter answer), one sample at a time per host (its
# slots bound it, as memory bounds an accelerator's), a small trainer batch padded to one
# shape (one compile), and the hosts' stats read every half second.
WORKLOAD = (
    "rollout.max_new_tokens=192",
    "optim.learning_rate=1e-7",
    "rollout.num_slots=1",
    "rollout.groups_per_step=2",
    "system.batch.length_bucket=256",
    "system.batch.packed_prompts=false",
    "system.max_staleness=2",
    "system.hosts.health_interval_s=0.5",
)
NAMES = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# The trainer's command: Linux's parent-death signal set in the new interpreter, then
# a3po-train, so that no trainer outlives the benchmark; a preexec_fn would run Python in
# the child of this threaded process between fork and exec, which can deadlock.
TRAINER_WITH_PARENT = (
    "import runpy, sys; from a3po_jax.cli.serve import die_with_parent; "
    "die_with_parent(int(sys.argv[1])); sys.argv = ['a3po-train', *sys.argv[2:]]; "
    "runpy.run_module('a3po_jax.cli.train', run_name='__main__', alter_sys=True)"
)


def say(text: str) -> None:
    print(f"[bench_elastic {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def core_plan() -> tuple[list[str], list[str], str]:
    """taskset prefixes for the trainer and the hosts, and how they were pinned."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2 or shutil.which("taskset") is None:
        return [], [], "not pinned (taskset or a second core missing)"
    host_cores = ",".join(str(c) for c in cores[1:])
    where = f"trainer on core {cores[0]}, every host on core(s) {host_cores}"
    return ["taskset", "-c", str(cores[0])], ["taskset", "-c", host_cores], where


class Fleet:
    """The processes the benchmark started: a trainer and its hosts, stopped on close."""

    def __init__(self, tmp: Path, env: dict[str, str]):
        self.tmp, self.env = tmp, env
        self.trainer: subprocess.Popen | None = None
        self.hosts: list[tuple[str, str, subprocess.Popen]] = []  # (name, address, process)

    def start_host(self, argv: list[str], name: str, timeout_s: float) -> str:
        """Starts a host and waits for its ready line; returns its address."""
        log = (self.tmp / f"host-{name}.log").open("w")
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=log, text=True
        )
        self.hosts.append((name, "", proc))
        address: list[str] = []

        def read_ready() -> None:
            for line in proc.stdout:
                if line.startswith(READY_LINE):
                    address.append(line.split()[1])
                    break
            for _ in proc.stdout:  # drained, so the host never blocks on a full pipe
                pass

        reader = threading.Thread(target=read_ready, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        while not address:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host {name} did not serve:\n{self.tail(f'host-{name}.log')}")
            time.sleep(0.1)
        self.hosts[-1] = (name, address[0], proc)
        return address[0]

    def tail(self, log: str, chars: int = 3000) -> str:
        path = self.tmp / log
        return path.read_text()[-chars:] if path.exists() else ""

    def close(self) -> dict[str, int]:
        """SIGTERM to the trainer (it saves and stops), then to every host, then SIGKILL to
        whatever is still running after its grace; returns each one's exit status."""
        procs = [("trainer", self.trainer)] if self.trainer else []
        procs += [(name, proc) for name, _, proc in self.hosts]
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60 if proc is self.trainer else 30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        return {name: proc.returncode for name, proc in procs}


def read_records(path: Path) -> list[dict]:
    """The complete lines of a growing metrics.jsonl."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line]


def phase_labels(max_hosts: int) -> list[tuple[str, int]]:
    """(label, hosts) of every phase: up to max_hosts, then back to one."""
    up = [(f"{k} host{'s' if k > 1 else ''}", k) for k in range(1, max_hosts + 1)]
    down = [(f"back to {k}", k) for k in range(max_hosts - 1, 0, -1)]
    return up + down


def phase_begun(record: dict, hosts: int, newcomer: str | None) -> bool:
    """Whether the pool counts ``hosts`` at this step and the host that joined (its
    ``hosts/served/...`` key, or None after a leave) has delivered samples."""
    joined = newcomer is None or record.get(newcomer, 0) > 0
    return record.get("hosts/hosts_total") == hosts and joined


def summarize(label: str, hosts: int, records: list[dict], before: dict, names: dict) -> dict:
    """One phase's figures from its step records (``before``: the record just before it)."""
    step_s = statistics.median(r["time/step_s"] for r in records)
    last = records[-1]
    served = {
        names[key[len("hosts/served/") :]]: int(last[key] - before.get(key, 0))
        for key in sorted(last, key=lambda k: names.get(k[len("hosts/served/") :], ""))
        if key.startswith("hosts/served/") and last[key] - before.get(key, 0) > 0
    }
    # Shares of the phase's wall time: host/busy_s sums the hosts' serving seconds (read
    # every health interval), so its difference over the phase, per host.
    wall = sum(r["time/step_s"] for r in records[1:]) or float("nan")
    wait = sum(r.get("time/wait_rollouts_s", 0.0) for r in records[1:]) / wall
    busy = (last.get("host/busy_s", 0.0) - records[0].get("host/busy_s", 0.0)) / wall / hosts
    if wait >= WAITS:
        side = "generation"
    elif busy < HOST_BUSY:
        side = "training"
    else:
        side = "both busy"
    return {
        "phase": label,
        "hosts": hosts,
        "steps": len(records),
        "first_step": records[0]["step"],
        "median_step_s": step_s,
        "steps_per_hour": 3600.0 / step_s,
        "served": served,
        "trainer_wait_frac": wait,
        "host_busy_frac_each": busy,
        "bound": side,
    }


def markdown(phases: list[dict]) -> str:
    head = ("phase", "steps", "median s/step", "steps/hour", "samples served per host")
    lines = [
        "| " + " | ".join((*head, "which side waited")) + " |",
        "|---|---|---|---|---|---|",
    ]
    for p in phases:
        served = ", ".join(f"{name} {n}" for name, n in p["served"].items())
        waited = (
            f"{p['bound']} (trainer waited {100 * p['trainer_wait_frac']:.0f} %, "
            f"each host busy {100 * p['host_busy_frac_each']:.0f} %)"
        )
        lines.append(
            f"| {p['phase']} | {p['steps']} | {p['median_step_s']:.2f} | "
            f"{p['steps_per_hour']:.0f} | {served} | {waited} |"
        )
    return "\n".join(lines)


def run(args, tmp: Path, fleet: Fleet) -> dict:
    overrides = [*WORKLOAD, *args.overrides]
    hosts_file, token_file = tmp / "hosts.txt", ensure_token_file(str(tmp / "token"))
    trainer_pin, host_pin, pinning = core_plan()
    parent = os.getpid()  # the trainer is killed with it, even by kill -9 (Linux)
    say(f"{pinning}; {args.experiment} {' '.join(overrides)}")
    cfg = _resolve(args.experiment, overrides)
    host_argv = [
        *host_pin,
        *_host_argv(sys.executable, cfg, port=0, bind="127.0.0.1", token_file=str(token_file),
                    weight_port=0),
        "--exit-with-parent", str(parent),  # no host outlives the benchmark
    ]  # fmt: skip
    join_argv = [*host_argv, "--join", str(hosts_file), "--leave-quiet-s", "1"]
    names: dict[str, str] = {}  # address -> A, B, C...
    address = fleet.start_host(host_argv, "A", args.host_timeout_s)
    names[address] = "A"
    say(f"host A serves at {address}")
    plan = phase_labels(args.max_hosts)
    run_dir = tmp / "run"
    steps = 1_000_000  # stopped with SIGTERM once every phase is measured
    fleet.trainer = subprocess.Popen(
        [
            *trainer_pin, sys.executable, "-c", TRAINER_WITH_PARENT, str(parent), args.experiment,
            *overrides, "system.mode=async", f"system.placement.inference_hosts={address}",
            f"system.placement.hosts_file={hosts_file}",
            f"system.placement.host_token_file={token_file}", f"steps={steps}",
            "checkpoint_every=0", "evaluate=false", "eval_every=0", f"run_dir={run_dir}",
        ],
        cwd=ROOT, env=fleet.env, stdout=(tmp / "trainer.log").open("w"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    say("trainer started (stopped once the phases are measured)")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + args.timeout_s
    seen = 0

    def records() -> list[dict]:
        nonlocal seen
        if fleet.trainer.poll() is not None:
            raise RuntimeError(f"the trainer stopped:\n{fleet.tail('trainer.log')}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not done within --timeout-s {args.timeout_s:g}")
        rs = read_records(metrics)
        if len(rs) > seen:
            r = rs[-1]
            say(f"step {r['step']}: {r.get('hosts/hosts_total')} host(s), {r['time/step_s']:.2f} s")
            seen = len(rs)
        time.sleep(0.2)
        return rs

    phases, start, end = [], args.warmup, 0
    for i, (label, hosts) in enumerate(plan):
        if i:  # the action that starts this phase
            if hosts > plan[i - 1][1]:
                name = NAMES[len(fleet.hosts)]
                address = fleet.start_host(join_argv, name, args.host_timeout_s)
                names[address] = name
                say(f"host {name} serves at {address} and joins")
                newcomer = f"hosts/served/{address}"
            else:
                name, address, proc = fleet.hosts[hosts]  # the newest still serving
                proc.send_signal(signal.SIGTERM)
                say(f"host {name} ({address}) sent SIGTERM: it leaves")
                newcomer = None

            start = None
            while start is None:
                rs = records()
                begun = (j for j in range(end, len(rs)) if phase_begun(rs[j], hosts, newcomer))
                start = next(begun, None)
        while True:  # the phase's steps, and more until every host in it has served
            rs = records()
            body = rs[start:]
            if any(r.get("hosts/hosts_total") != hosts for r in body):
                raise RuntimeError(f"{label}: the pool's hosts changed by themselves: {body[-1]}")
            if len(body) >= args.steps_per_phase:
                summary = summarize(label, hosts, body, rs[start - 1] if start else {}, names)
                if len(summary["served"]) >= hosts:
                    break
        phases.append(summary)
        end = len(rs)
        say(f"{label}: {summary['steps']} steps, median {summary['median_step_s']:.2f} s")
    # The leavers stopped by themselves, once idle.
    for name, _, proc in fleet.hosts[1:]:
        code = proc.wait(timeout=120)
        say(f"host {name} stopped by itself (exit {code})")
    last = read_records(metrics)[-1]
    return {
        "phases": phases,
        "steps_left_out": end - sum(p["steps"] for p in phases),
        "hosts": {name: address for address, name in names.items()},
        "joined": last.get("hosts/joined"),
        "left": last.get("hosts/left"),
        "host_failures": sum(v for k, v in last.items() if k.startswith("hosts/host_failures/")),
        "pinning": pinning,
        "overrides": overrides,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--experiment", default="experiments/smoke_tiny.py")
    p.add_argument("--steps-per-phase", type=int, default=30, help="steps measured per phase")
    p.add_argument("--max-hosts", type=int, default=3, help="hosts at the peak (2 or more)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out (compilation)")
    p.add_argument("--out", default="", help="also write the JSON report here")
    p.add_argument("--keep", default="", help="work in this folder and keep it (run, logs)")
    p.add_argument("--host-timeout-s", type=float, default=300.0, help="for a host to serve")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="for the whole benchmark")
    p.add_argument("overrides", nargs="*", help="extra section.field=value for the run")
    args = p.parse_args(argv)
    if args.max_hosts < 2 or args.max_hosts > len(NAMES) or args.steps_per_phase < 1:
        p.error("--max-hosts takes 2 to 26 and --steps-per-phase 1 or more")

    def stop(signum, frame):  # SIGTERM as Ctrl-C: the fleet is stopped on the way out
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")  # functional scale: several processes, one machine
    load_before = list(os.getloadavg())
    try:
        with tempfile.TemporaryDirectory(prefix="bench_elastic-") as tmp:
            work = Path(args.keep or tmp)
            work.mkdir(parents=True, exist_ok=True)
            fleet = Fleet(work, env)
            try:
                report = run(args, work, fleet)
            finally:
                exits = fleet.close()
            report["exit_codes"] = exits
    finally:
        signal.signal(signal.SIGTERM, previous)
    machine = describe_machine()
    report.update(machine=machine, load_before=load_before, load_after=list(os.getloadavg()))
    report["args"] = vars(args)
    print(
        f"{args.experiment} {' '.join(report['overrides'])}, asynchronous, "
        f"{args.steps_per_phase} steps a phase; {report['pinning']}"
    )
    print(
        f"{machine['cpu']} ({', '.join(machine['isa'])}), {machine['cores']} cores; load "
        f"average {load_before[0]:.1f} before, {report['load_after'][0]:.1f} after"
    )
    print()
    print(markdown(report["phases"]))
    print()
    print(
        f"hosts: {', '.join(f'{n} {a}' for n, a in report['hosts'].items())}; joined "
        f"{report['joined']}, left {report['left']}, failures {report['host_failures']}; "
        f"{report['steps_left_out']} steps left out (compilation, joins and leaves under way); "
        f"exit status {', '.join(f'{n} {c}' for n, c in report['exit_codes'].items())}"
    )
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("bench_elastic: interrupted; every process it started has stopped")
