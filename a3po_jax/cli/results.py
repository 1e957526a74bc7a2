"""Tables and plots of one or more runs: `python -m a3po_jax.cli.results RUN... --out DIR`."""

import sys

from a3po_jax.analysis.results import main

if __name__ == "__main__":
    sys.exit(main())
