"""Ballast control-plane core: recipe schema, settings, SQL store, scheduling and recovery policy."""
