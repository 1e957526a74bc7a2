"""Meshes, the logical->mesh sharding table, and multi-process set-up (jax.distributed).

Parallel layer (core side): meshes, sharding and processes, used by the core and the shell.
"""
