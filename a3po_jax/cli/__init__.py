"""Command-line entry points (``a3po-train`` and ``python -m a3po_jax.cli.*``).

CLI layer (entry points): nothing in the package imports it.
"""
