"""Host-side shell: evaluation scoring, run tables, plots and sweeps.

Analysis layer (host-side shell).
"""
