"""Score a policy (a run's checkpoint or a named model) on a task: pass@1 / mean@k."""

import sys

from a3po_jax.analysis.evaluation import main

if __name__ == "__main__":
    sys.exit(main())
