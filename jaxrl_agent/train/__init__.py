"""The training loop: train state, jitted train step, supervised warm-up, checkpoints, metrics."""
