"""Benchmark cases: one YAML file each under ``cases/<half>/``.

A case file holds::

    case:                         # what the case is, for the report (not sent to the service)
      family: high_lr_no_warmup   # the failure family
      expected: recoverable       # recoverable | control | unrecoverable-vanishing
      onset_step: null            # the known fault step (injected faults; 0 = present from the start), or null:
                                  # then the onset is read off the loss (see metrics.loss_onset)
      summary: one line for the table
    recipe: {...}                 # the unstable recipe, a complete Ballast recipe without `recovery`
    reference: {...}              # a deep-merge patch over `recipe` (mappings merge, lists and scalars replace)
                                  # giving the stable reference: same model and data at a safe setting.
                                  # `reference: same` means the recipe itself is the reference (controls).

The three policies only change ``recovery`` (the recipe must not set it, so no case is tuned per policy):
``none`` = ``{max_retries: 0}``, ``restart-latest`` = ``{strategy: restart_latest}``, ``ballast`` = ``{}``
(the defaults). The reference runs under ``none``: a safe run must need no recovery.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CASES_DIR = Path(__file__).resolve().parent / "cases"
HALVES = ("dev", "validation")
EXPECTATIONS = ("recoverable", "control", "unrecoverable-vanishing")
POLICIES: dict[str, dict[str, Any]] = {
    "none": {"max_retries": 0},
    "restart-latest": {"strategy": "restart_latest"},
    "ballast": {},
}
REFERENCE_POLICY = "none"


@dataclass
class Case:
    name: str
    half: str
    family: str
    expected: str
    recipe: dict[str, Any]
    reference: dict[str, Any]
    onset_step: int | None = None
    summary: str = ""
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def max_steps(self) -> int:
        return int(self.recipe["training"]["max_steps"])

    def policy_recipe(self, policy: str) -> dict[str, Any]:
        """The unstable recipe as submitted under ``policy`` (only ``recovery`` and the name differ)."""
        return _with_recovery(self.recipe, POLICIES[policy], f"{self.name}.{policy}")

    def reference_recipe(self) -> dict[str, Any]:
        return _with_recovery(self.reference, POLICIES[REFERENCE_POLICY], f"{self.name}.reference")


def _with_recovery(recipe: dict[str, Any], recovery: dict[str, Any], name: str) -> dict[str, Any]:
    doc = copy.deepcopy(recipe)
    doc["name"] = name
    doc["recovery"] = copy.deepcopy(recovery)
    return doc


def deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``patch`` applied: nested mappings merge, everything else (lists included) replaces."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def training_key(recipe: dict[str, Any]) -> str:
    """Identity of what a recipe trains, ignoring its name and description (equal keys train identically)."""
    doc = {k: v for k, v in recipe.items() if k not in ("name", "description")}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def load_case(path: Path, half: str) -> Case:
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or not {"case", "recipe", "reference"} <= doc.keys():
        raise ValueError(f"{path}: a case needs `case`, `recipe` and `reference`")
    meta, recipe, ref = doc["case"], doc["recipe"], doc["reference"]
    if "recovery" in recipe:
        raise ValueError(f"{path}: the recipe must not set `recovery` (the policy is the benchmark's variable)")
    if meta.get("expected") not in EXPECTATIONS:
        raise ValueError(f"{path}: case.expected must be one of {EXPECTATIONS}")
    reference = copy.deepcopy(recipe) if ref == "same" else deep_merge(recipe, ref)
    reference.pop("recovery", None)
    return Case(
        name=path.stem, half=half, family=str(meta["family"]), expected=str(meta["expected"]), recipe=recipe,
        reference=reference, onset_step=meta.get("onset_step"), summary=str(meta.get("summary", "")), path=path,
        meta=meta,
    )


def load_cases(halves: tuple[str, ...] = HALVES, names: list[str] | None = None) -> list[Case]:
    """Every case of ``halves`` (sorted by half, then file name), optionally only those whose name is in
    ``names`` (a name may also be given without its half prefix)."""
    out: list[Case] = []
    for half in halves:
        for path in sorted((CASES_DIR / half).glob("*.yaml")):
            out.append(load_case(path, half))
    if names:
        wanted = set(names)
        out = [c for c in out if c.name in wanted]
        missing = wanted - {c.name for c in out}
        if missing:
            raise SystemExit(f"unknown case(s) {sorted(missing)}; known: {[c.name for c in load_cases(halves)]}")
    return out
