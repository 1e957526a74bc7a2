"""Meshes, the logical->mesh sharding table, and multi-process set-up (jax.distributed)."""
