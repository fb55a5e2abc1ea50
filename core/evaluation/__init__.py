"""Held-out evaluation: during a run, and of a checkpoint (`mimo eval`)."""
