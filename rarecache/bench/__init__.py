"""Speed harness: every figure is a ratio to a baseline timed in the same run."""
