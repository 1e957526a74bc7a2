"""Shared test set-up: CPU only, float32, quiet TensorFlow."""

import os

# Tests run on the CPU whatever the machine has: results must not depend on an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
