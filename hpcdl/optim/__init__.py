"""Large-batch optimization: LARS, LAMB, the optimizer registry, and per-step lr schedules."""
