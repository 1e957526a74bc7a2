"""Test helper: a3po-train's run of ``experiments/smoke_tiny.py`` with "long responses".

Usage: python tests/helpers/exactly_once_run.py RUN_DIR [section.field=value ...] [--resume]

The trainer gets the embedded inference host wrapped so that every group whose id is
1 mod 3 comes back late (its samples are held for ``DELAY_S`` after they finished), as long
responses do: groups complete out of order, the situation in which a resume from "the
oldest pending prompt" trained prompts twice. Used by tests/e2e/test_exactly_once.py, which
kills this process with SIGKILL and resumes it.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DELAY_S = 0.6


class LateGroupsHost:
    """Delegates to an inference host; holds back the results of groups 1, 4, 7, ..."""

    def __init__(self, inner):
        self.inner = inner
        self._held: list[tuple[float, object]] = []
        self._lock = threading.Lock()

    def poll(self, timeout=None, max_results=None):
        now = time.monotonic()
        out = []
        for res in self.inner.poll(timeout=timeout, max_results=max_results):
            if int(res.request_id[1:].split(".")[0]) % 3 == 1:
                with self._lock:
                    self._held.append((now + DELAY_S, res))
            else:
                out.append(res)
        with self._lock:
            out.extend(r for t, r in self._held if t <= now)
            self._held = [(t, r) for t, r in self._held if t > now]
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    from a3po_jax.training.config import apply_overrides, load_experiment
    from a3po_jax.training.trainer import Trainer, load_policy

    resume = "--resume" in argv
    args = [a for a in argv if a != "--resume"]
    run_dir, overrides = args[0], args[1:]
    cfg = apply_overrides(
        load_experiment(REPO / "experiments" / "smoke_tiny.py"), [f"run_dir={run_dir}", *overrides]
    )
    policy = load_policy(cfg.model)
    trainer = Trainer(cfg, policy, console=False)
    # The trainer's own embedded host, seen through the delaying wrapper.
    trainer.workers.host = LateGroupsHost(trainer.workers.host)
    trainer.run(resume=resume)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
