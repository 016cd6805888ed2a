"""API tokens: stored by their hash only (the plaintext is shown once to its creator)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.store.models import ApiToken, utcnow


def create_token(
    *, session: Session, name: str, principal: str, scopes: Sequence[str], token_hash: str
) -> ApiToken:
    """Store a token by its hash (the plaintext is shown once to its creator and never stored)."""
    tok = ApiToken(name=name, principal=principal, scopes=sorted(set(scopes)), token_hash=token_hash)
    session.add(tok)
    session.flush()
    return tok


def get_token_by_hash(*, session: Session, token_hash: str) -> ApiToken | None:
    """A live (not revoked) token by its hash."""
    return session.scalars(
        select(ApiToken).where(ApiToken.token_hash == token_hash, ApiToken.revoked_at.is_(None))
    ).one_or_none()


def list_tokens(*, session: Session, principal: str | None = None) -> list[ApiToken]:
    stmt = select(ApiToken).order_by(ApiToken.id)
    if principal is not None:
        stmt = stmt.where(ApiToken.principal == principal)
    return list(session.scalars(stmt))


def revoke_token(*, session: Session, token_id: int) -> ApiToken | None:
    tok = session.get(ApiToken, token_id)
    if tok is not None and tok.revoked_at is None:
        tok.revoked_at = utcnow()
        session.flush()
    return tok
