"""Host-side shell: evaluation scoring, run tables, plots and sweeps."""
