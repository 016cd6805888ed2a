"""Bearer API tokens, scopes and tenancy.

Tokens are random strings shown once; the store keeps only HMAC-SHA256(pepper, token), so a leaked database
does not yield usable tokens. Scopes: ``read`` (see own runs), ``submit`` (create, cancel, retry own runs) and
``admin`` (everything, every principal's runs, token management). With ``auth_mode=off`` (allowed only on a
loopback bind, see ``Settings.check_serving_safety``) every request is the principal ``local`` with all scopes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.deps import RunId, SessionDep, session_factory
from api.errors import ApiError
from orchestrator.settings import AuthMode, Settings
from orchestrator.store import repo
from orchestrator.store.models import ApiToken, Run, utcnow

SCOPES = ("read", "submit", "admin")
TOKEN_PREFIX = "blst_"
LOCAL_PRINCIPAL = "local"
_TOUCH_EVERY = timedelta(minutes=1)  # last_used_at is advisory: don't turn every read into a write


def generate_token() -> str:
    """A new random bearer token (256 bits)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str, pepper: SecretStr | str) -> str:
    secret = pepper.get_secret_value() if isinstance(pepper, SecretStr) else pepper
    return hmac.new(secret.encode(), token.encode(), hashlib.sha256).hexdigest()


def issue_token(
    *, session: Session, pepper: SecretStr | str, name: str, principal: str | None, scopes: list[str]
) -> tuple[ApiToken, str]:
    """Create a token row and return it with the plaintext (the only time the plaintext exists)."""
    bad = sorted(set(scopes) - set(SCOPES))
    if bad or not scopes:
        raise ValueError(f"scopes must be among {list(SCOPES)}, got {scopes}")
    token = generate_token()
    row = repo.create_token(
        session=session, name=name, principal=principal or name, scopes=scopes, token_hash=hash_token(token, pepper)
    )
    return row, token


@dataclass(frozen=True)
class Principal:
    """Who is calling, and what they may do."""

    name: str
    scopes: frozenset[str]
    token_id: int | None = None

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes

    def has(self, scope: str) -> bool:
        return self.is_admin or scope in self.scopes

    @property
    def owner_filter(self) -> str | None:
        """The owner to restrict queries to (None for an admin: everyone's runs)."""
        return None if self.is_admin else self.name


LOCAL = Principal(LOCAL_PRINCIPAL, frozenset(SCOPES))

_WWW_AUTH = {"WWW-Authenticate": 'Bearer realm="ballast"'}


class TokenCache:
    """Tokens verified in the last ``ttl`` seconds, by hash, so most requests skip the token query.

    A token revoked through this server's API stops working at once (the cache is cleared); revoked elsewhere
    (the CLI, another server process) it keeps working here for at most ``ttl`` seconds. Unknown tokens are
    never cached: every failed attempt is checked against the store.
    """

    def __init__(self, ttl: float = 5.0, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.clock: Callable[[], float] = time.monotonic
        self._entries: dict[str, tuple[float, Principal]] = {}

    def get(self, digest: str) -> Principal | None:
        hit = self._entries.get(digest)
        if hit is None or hit[0] < self.clock():
            return None
        return hit[1]

    def put(self, digest: str, principal: Principal) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[digest] = (self.clock() + self.ttl, principal)

    def clear(self) -> None:
        self._entries.clear()


def _lookup(factory: sessionmaker[Session], digest: str) -> Principal | None:
    with factory() as session:
        tok = repo.get_token_by_hash(session=session, token_hash=digest)
        if tok is None:
            return None
        now = utcnow()
        if tok.last_used_at is None or now - tok.last_used_at > _TOUCH_EVERY:
            tok.last_used_at = now
            session.commit()
        return Principal(tok.principal, frozenset(tok.scopes), tok.id)


async def authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    """The caller, from its bearer token: a cache hit costs no worker thread and no query; a miss queries in a
    session of its own, so a route that needs no session of the request's does not get one."""
    settings: Settings = request.app.state.settings
    if settings.auth_mode is AuthMode.off:
        return LOCAL
    if credentials is None:
        raise ApiError(401, "a bearer token is required", slug="unauthorized", headers=_WWW_AUTH)
    digest = hash_token(credentials.credentials, settings.token_pepper)
    cache: TokenCache = request.app.state.token_cache
    principal = cache.get(digest)
    if principal is None:
        # not counted against the request slots (``in_db_thread``): a sync route's session already holds one, and
        # waiting for a second could deadlock under load. A known token misses once per cache TTL; lookups of
        # unknown tokens are bounded by the worker-thread pool, as every sync route is
        principal = await run_in_threadpool(_lookup, session_factory(request), digest)
        if principal is None:
            raise ApiError(
                401, "the token is unknown or revoked", slug="unauthorized",
                headers={"WWW-Authenticate": 'Bearer realm="ballast", error="invalid_token"'},
            )
        cache.put(digest, principal)
    return principal


class RequireScope(HTTPBearer):
    """A dependency that authenticates the caller from its bearer token and admits it if it holds ``scope`` (admin
    holds every scope); OpenAPI shows it as the ``BearerToken`` scheme.

    One dependency node, the scheme itself: FastAPI resolves each node of a route's dependency tree on every
    request (a scope check depending on a bearer-scheme dependency cost two), and that resolution was the
    largest item of a ``GET /runs/{id}``'s profile. Async: a sync dependency would cost a worker-thread hop."""

    def __init__(self, scope: str) -> None:
        super().__init__(
            auto_error=False,
            scheme_name="BearerToken",
            description="An API token from `ballast token create` (not needed when the server runs with auth off).",
        )
        self.scope = scope

    async def __call__(self, request: Request) -> Principal:  # type: ignore[override]
        principal = await authenticate(request, await super().__call__(request))
        if not principal.has(self.scope):
            raise ApiError(403, f"this operation needs the {self.scope!r} scope", slug="forbidden")
        return principal


ReadPrincipal = Annotated[Principal, Depends(RequireScope("read"))]
SubmitPrincipal = Annotated[Principal, Depends(RequireScope("submit"))]
AdminPrincipal = Annotated[Principal, Depends(RequireScope("admin"))]


def run_not_found(run_id: int) -> ApiError:
    """The 404 for a run that is absent or someone else's (the two are not told apart)."""
    return ApiError(404, f"run {run_id} not found", slug="not-found")


def _visible_run(session: Session, run_id: int, principal: Principal) -> Run:
    run = repo.get_run(session=session, run_id=run_id, owner=principal.owner_filter)
    if run is None:
        raise run_not_found(run_id)
    return run


def _readable_run(run_id: RunId, session: SessionDep, principal: ReadPrincipal) -> Run:
    return _visible_run(session, run_id, principal)


def _writable_run(run_id: RunId, session: SessionDep, principal: SubmitPrincipal) -> Run:
    return _visible_run(session, run_id, principal)


ReadableRun = Annotated[Run, Depends(_readable_run)]
"""The run at ``{run_id}`` if the caller may read it (someone else's run is a 404, not a 403)."""
WritableRun = Annotated[Run, Depends(_writable_run)]
"""The run at ``{run_id}`` if the caller may change it (submit scope and ownership, or admin)."""
