"""Ballast front door: the FastAPI control plane and the `ballast` CLI."""
