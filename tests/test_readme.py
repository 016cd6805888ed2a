"""The README stays true: its settings table matches Settings, its example recipe validates, its commands exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from contracts.recipe import load_recipe
from orchestrator.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_settings_table", ROOT / "scripts" / "gen_settings_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_table_is_current() -> None:
    gen = _gen()
    assert gen.readme_table(README) == gen.render_table(), "run: python scripts/gen_settings_table.py --write"


def test_settings_table_has_one_row_per_field() -> None:
    rows = re.findall(r"^\| `(BALLAST_[A-Z0-9_]+)` \|", _gen().readme_table(README), re.M)
    assert rows == [f"BALLAST_{name.upper()}" for name in Settings.model_fields]


def test_readme_opens_with_the_two_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block is not None and README.index("```bash") < README.index("\n## ")
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make demo", "make test"]


def test_makefile_has_the_verbs_the_readme_uses() -> None:
    targets = set(re.findall(r"^([a-z]+):", (ROOT / "Makefile").read_text(), re.M))
    assert {"setup", "test", "lint", "demo", "bench", "clean"} <= targets
    assert (ROOT / "scripts" / "demo.sh").is_file()


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in ci
    assert re.search(r"^step make test$", ci, re.M)


def test_walkthrough_recipe_is_valid() -> None:
    block = re.search(r"```yaml\n(.*?)```", README, re.S)
    assert block is not None
    recipe = load_recipe(block.group(1))
    assert recipe.name == "walkthrough"
    assert recipe.schedule.warmup_fraction == 0.05  # the preset filled it, as the comment says
    assert recipe.warnings() == []
