"""Checkpoints and resume: the manager, damaged and killed saves, cheap checkpoints, the sampler
across world sizes, faults and restarts, and nodes without a shared disk."""
