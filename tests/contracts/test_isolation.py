"""The contracts package sits below everyone: importing all of it pulls in no torch, no Ray, and none of
``api``, ``orchestrator`` or ``workers`` (checked in a clean interpreter, since this test session has them all)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import contracts

FORBIDDEN = ("torch", "ray", "api", "orchestrator", "workers", "numpy")


def _contract_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(contracts.__path__, prefix="contracts."))


def test_every_contracts_module_imports_without_torch_ray_or_other_packages() -> None:
    modules = _contract_modules()
    assert {"contracts.recipe", "contracts.checkpoint", "contracts.wire", "contracts.overrides"} <= set(modules)
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], check=True, capture_output=True, text=True,
                         cwd=str(__import__("pathlib").Path(contracts.__file__).parents[1]))
    loaded = set(json.loads(out.stdout))
    assert not loaded & set(FORBIDDEN), f"contracts pulled in {sorted(loaded & set(FORBIDDEN))}"
    assert "contracts" in loaded and "pydantic" in loaded  # the probe really imported the package


def test_orchestrator_and_api_do_not_import_workers_outside_the_launch_entry_points() -> None:
    """The only doors from the control plane into the engine: the Ray channel actor's train function,
    ``ballast train``, which runs the engine in-process, and the export route, which rebuilds the recipe's model
    from a checkpoint (imported on the first export only)."""
    allowed = {"orchestrator/channel.py", "api/cli/train_cmd.py", "api/routes/export.py"}
    root = __import__("pathlib").Path(contracts.__file__).parents[1]
    offenders = []
    for pkg in ("orchestrator", "api"):
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            text = path.read_text()
            if ("from workers" in text or "import workers" in text) and rel not in allowed:
                offenders.append(rel)
    assert offenders == []
