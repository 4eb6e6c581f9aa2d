"""Probe state: checkpoints (save, load, merge) and the distributed all-reduce of a probe."""
