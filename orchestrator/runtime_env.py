"""A recipe's ``code:`` section → Ray's ``runtime_env`` for the preflight probe and the worker group.

Two checks, both naming the field: ``code_refusals`` is what the server's settings refuse (``pip`` unless the
operator allows it), asked at submit and again at launch (settings change); ``build_runtime_env`` also checks
that local paths exist *where the scheduler runs* — Ray uploads them from the process that starts the work, which
is the scheduler, not necessarily the API server — and merges the section over the operator's own
``BALLAST_RUNTIME_ENV``. A failed check at launch is a config error: the run fails before any Ray work starts.
"""

from __future__ import annotations

import os
from typing import Any

from contracts.recipe import Code
from orchestrator.settings import Settings


class CodeError(ValueError):
    """The ``code`` section cannot be shipped as it is; the message starts with the field's path."""


def code_refusals(code: Code, settings: Settings) -> list[tuple[str, str]]:
    """``(field, message)`` for each part of ``code`` this server refuses."""
    if code.pip and not settings.allow_runtime_pip:
        return [("code.pip", "installing packages on the cluster is not allowed on this server "
                             "(the operator's BALLAST_ALLOW_RUNTIME_PIP)")]
    return []


def _is_uri(location: str) -> bool:
    return "://" in location


def _check_local(field: str, location: str, *, directory: bool) -> None:
    if _is_uri(location):
        return  # fetched by Ray itself
    if directory and not os.path.isdir(location):
        raise CodeError(f"{field}: {location} is not a directory on the scheduler's host")
    if not directory and not os.path.exists(location):
        raise CodeError(f"{field}: {location} does not exist on the scheduler's host")


def build_runtime_env(code: Code, settings: Settings) -> dict[str, Any] | None:
    """The ``runtime_env`` for ``code`` over the operator's ``BALLAST_RUNTIME_ENV`` (None: nothing to ship).
    Raises ``CodeError`` naming the field when the server refuses a part or a local path is missing."""
    for field, message in code_refusals(code, settings):
        raise CodeError(f"{field}: {message}")
    env: dict[str, Any] = dict(settings.runtime_env)
    if code.working_dir is not None:
        _check_local("code.working_dir", code.working_dir, directory=True)
        env["working_dir"] = code.working_dir
    for i, module in enumerate(code.py_modules):
        _check_local(f"code.py_modules.{i}", module, directory=False)
    if code.py_modules:
        env["py_modules"] = [*env.get("py_modules", []), *code.py_modules]
    if code.pip:
        base = env.get("pip") or []
        if isinstance(base, dict):  # the operator's {"packages": [...], "pip_check": ...} form
            env["pip"] = {**base, "packages": [*base.get("packages", []), *code.pip]}
        else:
            env["pip"] = [*base, *code.pip]
    return env or None
