"""Settings: the BALLAST_ prefix, URL normalisation, defaults under BALLAST_HOME, Ray address, serving safety."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from pydantic import ValidationError

from orchestrator.settings import AuthMode, Settings, get_settings, settings_error_lines
from orchestrator.store.db import make_engine

BALLAST = Path(sys.executable).with_name("ballast")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No BALLAST_* or RAY_ADDRESS from the caller's shell; a scratch working directory."""
    for var in list(os.environ):
        if var.startswith("BALLAST_") or var == "RAY_ADDRESS":
            monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_env_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALLAST_MAX_CONCURRENT_RUNS", "7")
    monkeypatch.setenv("MAX_CONCURRENT_RUNS", "99")  # unprefixed: ignored
    monkeypatch.setenv("BALLAST_BIND_PORT", "9000")
    s = Settings()
    assert (s.max_concurrent_runs, s.bind_port) == (7, 9000)


def test_get_settings_is_one_cached_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    first = get_settings()
    monkeypatch.setenv("BALLAST_MAX_CONCURRENT_RUNS", "5")
    assert get_settings() is first
    get_settings.cache_clear()
    assert get_settings().max_concurrent_runs == 5


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgres://u:p@db:5432/ballast", "postgresql+psycopg://u:p@db:5432/ballast"),
        ("postgresql://u@127.0.0.1/ballast", "postgresql+psycopg://u@127.0.0.1/ballast"),
        ("  postgresql://h/db  ", "postgresql+psycopg://h/db"),
        ("postgresql+psycopg://h/db", "postgresql+psycopg://h/db"),
        ("postgresql+asyncpg://h/db", "postgresql+asyncpg://h/db"),
        ("sqlite:////var/lib/ballast.db", "sqlite:////var/lib/ballast.db"),
    ],
)
def test_database_url_normalisation(monkeypatch: pytest.MonkeyPatch, given: str, expected: str) -> None:
    monkeypatch.setenv("BALLAST_DATABASE_URL", given)
    assert Settings().database_url == expected


def test_defaults_live_under_ballast_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home = tmp_path / "state"
    monkeypatch.setenv("BALLAST_HOME", str(home))
    s = Settings()
    assert s.home == home
    assert s.database_url == f"sqlite:///{home}/ballast.db"
    assert Path(s.checkpoint_root) == home / "checkpoints"


def test_default_home_is_dot_ballast_in_the_working_directory(tmp_path: Path) -> None:
    s = Settings()
    assert s.home == Path(".ballast")
    assert s.database_url == "sqlite:///.ballast/ballast.db"
    assert Path(s.checkpoint_root) == tmp_path.resolve() / ".ballast" / "checkpoints"


def test_explicit_values_win_over_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALLAST_HOME", "/elsewhere")
    monkeypatch.setenv("BALLAST_DATABASE_URL", "postgres://db/ballast")
    monkeypatch.setenv("BALLAST_CHECKPOINT_ROOT", "s3://bucket/prefix")
    s = Settings()
    assert (s.database_url, s.checkpoint_root) == ("postgresql+psycopg://db/ballast", "s3://bucket/prefix")


def test_default_database_is_sqlite_in_wal_mode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BALLAST_HOME", str(tmp_path / "h"))
    engine = make_engine(Settings().database_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("PRAGMA journal_mode")).scalar_one() == "wal"
            assert conn.execute(sa.text("PRAGMA foreign_keys")).scalar_one() == 1
    finally:
        engine.dispose()
    assert (tmp_path / "h" / "ballast.db").is_file()


def test_ray_address_unset_means_local_ray() -> None:
    assert Settings().ray_address is None


def test_ray_address_env_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert Settings().ray_address == "ray://head:10001"


def test_ballast_ray_address_wins_over_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "ray://other:10001")
    monkeypatch.setenv("BALLAST_RAY_ADDRESS", "ray://head:10001")
    assert Settings().ray_address == "ray://head:10001"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("mylab", ["mylab"]),
        ("mylab, team.models ,", ["mylab", "team.models"]),
        ('["mylab", "team.models"]', ["mylab", "team.models"]),
        ("", []),
    ],
)
def test_allowed_import_modules_from_env(monkeypatch: pytest.MonkeyPatch, value: str, expected: list[str]) -> None:
    monkeypatch.setenv("BALLAST_ALLOWED_IMPORT_MODULES", value)
    assert Settings().allowed_import_modules == expected


def test_limits_are_ranged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALLAST_MAX_RECIPE_BYTES", "100")
    monkeypatch.setenv("BALLAST_BIND_PORT", "70000")
    with pytest.raises(ValidationError) as info:
        Settings()
    lines = settings_error_lines(info.value)
    assert lines == [
        "BALLAST_MAX_RECIPE_BYTES: Input should be greater than or equal to 1024",
        "BALLAST_BIND_PORT: Input should be less than or equal to 65535",
    ]


@pytest.mark.slow
def test_bad_setting_is_a_one_line_cli_error(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BALLAST_")}
    env["BALLAST_MAX_RECIPE_BYTES"] = "lots"
    proc = subprocess.run([str(BALLAST), "recipe", "validate", str(recipe)], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr == "configuration error: BALLAST_MAX_RECIPE_BYTES: " \
                          "Input should be a valid integer, unable to parse string as an integer\n"


def test_token_pepper_is_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALLAST_TOKEN_PEPPER", "s3cret-value")
    s = Settings()
    assert s.token_pepper.get_secret_value() == "s3cret-value"
    assert "s3cret-value" not in repr(s) and "s3cret-value" not in str(s.model_dump())


# --------------------------------------------------------------------------------------- serving safety
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_local_mode_allows_auth_off_and_the_default_pepper(host: str) -> None:
    s = Settings(bind_host=host)
    assert s.auth_mode is AuthMode.off
    s.check_serving_safety()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "ballast.internal"])
def test_auth_off_is_refused_on_a_non_loopback_bind(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    monkeypatch.setenv("BALLAST_BIND_HOST", host)
    monkeypatch.setenv("BALLAST_TOKEN_PEPPER", "a-real-secret")
    with pytest.raises(ValueError, match="BALLAST_AUTH_MODE=off is only allowed on a loopback bind"):
        Settings().check_serving_safety()


def test_default_pepper_is_refused_outside_local_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALLAST_BIND_HOST", "0.0.0.0")
    monkeypatch.setenv("BALLAST_AUTH_MODE", "token")
    with pytest.raises(ValueError, match="BALLAST_TOKEN_PEPPER must be set"):
        Settings().check_serving_safety()


def test_token_auth_with_a_real_pepper_may_serve_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALLAST_BIND_HOST", "0.0.0.0")
    monkeypatch.setenv("BALLAST_AUTH_MODE", "token")
    monkeypatch.setenv("BALLAST_TOKEN_PEPPER", "a-real-secret")
    Settings().check_serving_safety()


def test_unknown_auth_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALLAST_AUTH_MODE", "basic")
    with pytest.raises(ValidationError) as info:
        Settings()
    assert settings_error_lines(info.value)[0].startswith("BALLAST_AUTH_MODE: Input should be 'off' or 'token'")
