"""The divergence benchmark: cases that diverge reproducibly on CPU, run under three recovery policies through
the real service. See README.md beside this file; the entry point is ``python -m benchmarks.divergence.run``."""
