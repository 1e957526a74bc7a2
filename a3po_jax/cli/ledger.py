"""Command line: audit a run's prompt ledger.

CLI layer (entry points): nothing in the package imports it.

    python -m a3po_jax.cli.ledger RUN_DIR        # or the ledger.jsonl file itself

Replays ``RUN_DIR/ledger.jsonl`` (`a3po_jax.rollout.ledger.audit`): rolls back what each
resume redid, then reports positions trained more than once, drawn twice, skipped or lost
at a resume, with the counts of trained, dropped and filtered (by reason, e.g.
``zero_variance`` for dynamic sampling) and still-in-flight prompts.
Prints "ledger audit: OK" and exits 0, or names each violation and exits 1; exit 2 for a
wrong command line.
"""

from __future__ import annotations

import sys

from a3po_jax.rollout.ledger import audit


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m a3po_jax.cli.ledger RUN_DIR|LEDGER_FILE", file=sys.stderr)
        return 2
    result = audit(args[0])
    print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
