"""Ballast worker engine: the guarded training loop that applies a stability recipe."""
