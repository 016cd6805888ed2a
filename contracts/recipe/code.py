"""The ``code:`` section: the user's own code, shipped to the Ray workers as Ray's ``runtime_env``.

A recipe whose ``custom`` model or data factory lives in the user's package names where that package is; the
scheduler passes it to Ray (``working_dir``, ``py_modules``, ``pip``) for the preflight probe and the whole worker
group, so it reaches every node of a remote cluster. The allow-list (``BALLAST_ALLOWED_IMPORT_MODULES``) still
decides which modules a factory may name; shipping code does not admit it.

Paths are read where the scheduler runs (Ray uploads a local directory from the process that starts the work),
so a path must be absolute, or a URI Ray fetches itself (``s3://``, ``gs://``, ``https://`` … to a zip or wheel).
Whether a local path exists is checked when the attempt is launched, not at submit: the API server may not be the
scheduler's host. ``pip`` installs packages on the cluster, an operator's decision: it is refused unless the
server allows it (``BALLAST_ALLOW_RUNTIME_PIP``). Details: ``docs/user-code.md``.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from contracts.recipe.base import Section

_URI = re.compile(r"^[a-z][a-z0-9+.-]*://\S+$")


def _location(v: str) -> str:
    if "\x00" in v or "\n" in v:
        raise ValueError("must be one line without NUL characters")
    if not (v.startswith("/") or _URI.match(v)):
        raise ValueError(f"{v!r} must be an absolute path (on the scheduler's host) or a URI such as s3://…/pkg.zip")
    return v


def _requirement(v: str) -> str:
    if not v.strip() or "\x00" in v or "\n" in v:
        raise ValueError("must be one non-empty line (a pip requirement such as 'einops==0.8.0')")
    return v.strip()


Location = Annotated[str, Field(min_length=1, max_length=1000), AfterValidator(_location)]
Requirement = Annotated[str, Field(min_length=1, max_length=500), AfterValidator(_requirement)]


class Code(Section):
    working_dir: Location | None = None
    """A directory (or zip URI) that becomes the workers' working directory; its top level is importable there."""
    py_modules: list[Location] = Field(default_factory=list, max_length=32)
    """Python packages or modules (directories, .py files, wheel/zip URIs), each importable on the workers."""
    pip: list[Requirement] = Field(default_factory=list, max_length=64)
    """Requirements installed for the workers; refused unless the server allows it (BALLAST_ALLOW_RUNTIME_PIP)."""

    @property
    def shipped(self) -> bool:
        """Whether the section ships anything at all."""
        return bool(self.working_dir or self.py_modules or self.pip)
