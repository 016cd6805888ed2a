"""Every exception a worker can raise crosses Ray's process boundary intact: it pickles with its message and
fields, so the control plane reports the cause instead of "worker rank 0 died"."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import contracts
import workers


def _exception_types() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for pkg in (workers, contracts):
        for mod in pkgutil.walk_packages(pkg.__path__, prefix=f"{pkg.__name__}."):
            module = importlib.import_module(mod.name)
            for obj in vars(module).values():
                if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


def _instance(cls: type[BaseException]) -> BaseException:
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.default is inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if cls.__name__ == "RecipeError":
        from contracts.recipe import FieldError

        return cls([FieldError("training.seed", "too big", 3)])  # type: ignore[call-arg]
    if cls.__name__ == "CrossFieldErrors":
        return cls([("data.vocab_size", "must equal model.vocab_size")])  # type: ignore[call-arg]
    args = [f"arg{i}" for i in range(len(params))] or ["what went wrong"]
    return cls(*args)


def test_the_known_worker_exceptions_are_found() -> None:
    names = {t.__name__ for t in _exception_types()}
    assert {"CorruptCheckpoint", "InjectedCrash", "SpecError", "RecipeError"} <= names


@pytest.mark.parametrize("cls", _exception_types(), ids=lambda c: c.__name__)
def test_every_worker_exception_pickles_with_its_message_and_fields(cls: type[BaseException]) -> None:
    exc = _instance(cls)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert str(back) == str(exc)
    assert {k: v for k, v in vars(back).items()} == {k: v for k, v in vars(exc).items()}
