"""Where the suite's compile time goes, test by test (a pytest plugin, registered by
tests/conftest.py; docs/development.md, "What makes the suite fit").

With ``A3PO_TEST_COMPILE_REPORT=FILE`` set, every process of the run (each xdist worker)
appends one JSON line per test to FILE: the XLA programs it compiled, and the seconds JAX
spent tracing, lowering and compiling them, beside the test's own seconds. Off by default.

    A3PO_TEST_COMPILE_REPORT=/tmp/compiles.jsonl bash scripts/run_tests.sh --quick
    .venv/bin/python tests/helpers/compile_report.py /tmp/compiles.jsonl   # per file

A test that compiles a hundred programs is running JAX eagerly: every primitive on a new
shape compiles its own program, where one `jax.jit` around the computation compiles one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "A3PO_TEST_COMPILE_REPORT"
# JAX's duration events for one program: tracing to a jaxpr, lowering it to MLIR, and XLA's
# compile (the last is recorded once per program compiled, not for a persistent-cache hit).
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
PROGRAMS = "/jax/core/compile/backend_compile_duration"


class _Recorder:
    def __init__(self, path: Path):
        self.path = path
        self.current: dict | None = None

    def on_duration(self, event: str, duration: float, **_kwargs) -> None:
        if self.current is None or event not in EVENTS:
            return
        self.current[EVENTS[event]] += duration
        if event == PROGRAMS:
            self.current["programs"] += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        self.current = {"test": item.nodeid, "programs": 0, **dict.fromkeys(EVENTS.values(), 0.0)}
        start = time.perf_counter()
        try:
            yield
        finally:
            record, self.current = self.current, None
            record["wall_s"] = time.perf_counter() - start
            with self.path.open("a") as f:  # one short line per write: workers append safely
                f.write(json.dumps(record) + "\n")


def pytest_configure(config):
    path = os.environ.get(ENV)
    if not path:
        return
    import jax

    recorder = _Recorder(Path(path))
    jax.monitoring.register_event_duration_secs_listener(recorder.on_duration)
    config.pluginmanager.register(recorder, "compile_report_recorder")
    config.stash[_KEY] = recorder


def pytest_unconfigure(config):
    recorder = config.stash.get(_KEY, None)
    if recorder is not None:
        import jax

        jax.monitoring.unregister_event_duration_listener(recorder.on_duration)


_KEY = pytest.StashKey[_Recorder]()


def summary(path: str | Path, top: int = 30) -> str:
    """The report per test file, the most compile seconds first."""
    files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        totals = files[record["test"].split("::")[0]]
        totals["tests"] += 1
        for key in ("programs", "wall_s", *EVENTS.values()):
            totals[key] += record[key]
    rows = sorted(files.items(), key=lambda kv: -(kv[1]["compile_s"] + kv[1]["lower_s"]))
    lines = [
        "| file | tests | programs | trace+lower s | compile s | test s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, t in rows[:top]:
        lines.append(
            f"| {name} | {t['tests']:.0f} | {t['programs']:.0f} "
            f"| {t['trace_s'] + t['lower_s']:.1f} | {t['compile_s']:.1f} | {t['wall_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/helpers/compile_report.py FILE")
    print(summary(sys.argv[1]))
