"""Account writes: verified addresses of people ops vouch for, API tokens (stored hashed, shown
once), each acting for one team.

People and their teams are created in accounts.services.teams (`user_create`)."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from allauth.account.models import EmailAddress
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from accounts.models import ApiToken, Team
from core.errors import NotFound, ValidationFailed

User = get_user_model()

TOKEN_PREFIX = "gpm"


def token_hash(raw: str) -> str:
    """SHA-256 is enough for 256-bit random secrets (no dictionary to guess from)."""
    return hashlib.sha256(raw.encode()).hexdigest()


def token_mint(kind: str) -> tuple[str, str]:
    """A new secret `<kind>_<prefix>_<random>` and its public prefix; only its hash is stored.

    Kinds: `gpm` API tokens, `gpj` join tokens, `gpn` node tokens.
    """
    prefix = secrets.token_hex(4)
    return prefix, f"{kind}_{prefix}_{secrets.token_urlsafe(32)}"


def user_email_verified_set(*, user: User) -> EmailAddress:
    """Mark the user's address verified without a mail: for accounts ops or the demo seed
    create, never for sign-ups (those follow the link in their mail)."""
    if not user.email:
        raise ValidationFailed("the user has no email address", field="email")
    with transaction.atomic():
        address, _ = EmailAddress.objects.update_or_create(
            user=user,
            email__iexact=user.email,
            defaults={"email": user.email.lower(), "verified": True, "primary": True},
        )
    return address


def api_token_create(
    *,
    user: User,
    team: Team,
    name: str,
    expires_at: datetime | None = None,
    issued_by: ApiToken | None = None,
) -> tuple[ApiToken, str]:
    """Create a token; the raw secret is returned once and never stored.

    `issued_by` is the token the request came with, if any: a token that expires cannot mint one
    that outlives it (one with no expiry given inherits the issuer's), or a leaked short-lived
    token would be a way to a permanent one."""
    name = name.strip()
    if not name:
        raise ValidationFailed("a token needs a name", field="name")
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationFailed("expires_at must be in the future", field="expires_at")
    limit = issued_by.expires_at if issued_by is not None else None
    if limit is not None:
        if expires_at is None:
            expires_at = limit
        elif expires_at > limit:
            raise ValidationFailed(
                f"must not be later than the expiry of the token used ({limit.isoformat()})",
                field="expires_at",
            )
    prefix, raw = token_mint(TOKEN_PREFIX)
    token = ApiToken.objects.create(
        user=user,
        team=team,
        name=name,
        prefix=prefix,
        key_hash=token_hash(raw),
        expires_at=expires_at,
    )
    return token, raw


def api_token_revoke(*, team: Team, user: User, token_id: int) -> ApiToken:
    """Revoke one of the user's tokens for the team; any other id is not found."""
    with transaction.atomic():
        token = (
            ApiToken.objects.select_for_update().filter(team=team, user=user, pk=token_id).first()
        )
        if token is None:
            raise NotFound("no such token")
        if token.revoked_at is None:
            token.revoked_at = timezone.now()
            token.save(update_fields=["revoked_at"])
        return token
