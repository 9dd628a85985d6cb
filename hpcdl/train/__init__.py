"""Training: the loop, evaluation, checkpoints and exact resume, metrics (issue 5, in progress)."""
