"""Host-side shell: rollout types, staleness admission and the queue between host and trainer.

Rollout layer (host-side shell).
"""
