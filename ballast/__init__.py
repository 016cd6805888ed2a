"""Ballast's Python SDK: ``from ballast import Client``.

``Client`` is the one client of the REST API (``api/client.py``; the ``ballast`` CLI uses it too): submit a
recipe (YAML text, a ``Path`` or a dict), ``wait`` for the run, read its attempts, checkpoints, anomalies and
metrics, cancel or retry it, and ``export`` its weights (``ballast.export``, which needs torch).
"""

from __future__ import annotations

from api.client import ApiError, Client, ClientError, Submitted, Unreachable, WaitTimeout

__all__ = ["ApiError", "Client", "ClientError", "Submitted", "Unreachable", "WaitTimeout"]
