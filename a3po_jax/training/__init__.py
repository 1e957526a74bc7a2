"""Host-side shell: the trainer loop, its config, checkpoints and metrics.

Training layer (host-side shell).
"""
