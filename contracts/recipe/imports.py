"""The import-string rule: which ``module:function`` strings a recipe may name.

One rule, used by the schema, the scheduler, manual retry and overrides alike: a module is admitted when it is
on the operator's allow-list (``BALLAST_ALLOWED_IMPORT_MODULES``, a prefix match on dotted names), or when the
stored recipe already names it (it was admitted when the recipe was accepted).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, ValidationInfo

_IMPORT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
IMPORT_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "model": {"custom": ("factory",)},
    "data": {"custom": ("factory",), "dataset": ("factory", "eval_factory")},
    "loss": {"custom": ("function",)},
}
"""Section → kind (``name``) → the fields of that kind that hold a ``module:function`` import string."""
FACTORY_SECTIONS = tuple(IMPORT_FIELDS)
"""The recipe sections with a kind that names an import string."""


def module_allowed(module: str, allowed: Iterable[str]) -> bool:
    """True when ``module`` is one of ``allowed`` or inside one of them (``a.b`` admits ``a.b.c``)."""
    return any(module == a or module.startswith(a + ".") for a in allowed)


def check_import_string(v: str, info: ValidationInfo) -> str:
    """Field validator: ``v`` is a ``module:function`` string whose module the validation context admits."""
    if not _IMPORT_RE.match(v):
        raise ValueError(f"{v!r} is not a 'module:function' import string")
    allowed: list[str] = list((info.context or {}).get("allowed_import_modules", []))
    module = v.split(":", 1)[0]
    if not module_allowed(module, allowed):
        raise ValueError(
            f"module {module!r} is not on the operator's allow-list (BALLAST_ALLOWED_IMPORT_MODULES: {allowed})"
        )
    return v


def named_modules(doc: Mapping[str, Any]) -> list[str]:
    """Modules of the factory import strings a recipe document (its JSON form) names."""
    mods: list[str] = []
    for section, kinds in IMPORT_FIELDS.items():
        part = doc.get(section)
        if not isinstance(part, Mapping):
            continue
        for field in kinds.get(str(part.get("name")), ()):
            if isinstance(part.get(field), str):
                mods.append(part[field].split(":", 1)[0])
    return mods


def admitted_modules(doc: Mapping[str, Any], operator_allowed: Iterable[str] = ()) -> list[str]:
    """The allow-list a stored recipe is re-validated under: the operator's list plus the modules it names."""
    return sorted(set(operator_allowed) | set(named_modules(doc)))


ImportString = Annotated[str, AfterValidator(check_import_string)]
"""A ``module:function`` field, checked against the allow-list in the validation context."""
