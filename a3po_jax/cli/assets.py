"""Prepare the offline SmolLM2 cache: `python -m a3po_jax.cli.assets prepare-smollm2`."""

import sys

from a3po_jax.model.assets import main

if __name__ == "__main__":
    sys.exit(main())
