"""Bearer-token authentication for programs: `Authorization: Bearer gpm_...`; a token acts
for the one team it was created in (accounts.tenancy)."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Q
from django.utils import timezone
from rest_framework import authentication, exceptions

from accounts import selectors
from accounts.models import ApiToken
from accounts.services import token_hash
from accounts.tenancy import membership_decided

# Writing last_used_at on every request would turn reads into writes; a minute is precise enough.
_LAST_USED_GRANULARITY = timedelta(minutes=1)


class ApiTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("malformed Authorization header")
        try:
            raw = header[1].decode()
        except UnicodeError as exc:
            raise exceptions.AuthenticationFailed("malformed token") from exc
        token = selectors.api_token_authenticating(key_hash=token_hash(raw))
        now = timezone.now()
        if (
            token is None
            or token.revoked_at is not None
            or (token.expires_at is not None and token.expires_at <= now)
            or not token.user.is_active
        ):
            raise exceptions.AuthenticationFailed("invalid or revoked token")
        membership = token.membership
        if membership is None:
            # Leaving a team revokes its tokens; this covers a membership deleted by other means.
            raise exceptions.AuthenticationFailed("the token's user is no longer in its team")
        membership_decided(request, membership)
        if token.last_used_at is None or now - token.last_used_at > _LAST_USED_GRANULARITY:
            ApiToken.objects.filter(pk=token.pk).filter(
                Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - _LAST_USED_GRANULARITY)
            ).update(last_used_at=now)
        return token.user, token

    def authenticate_header(self, request) -> str:
        return self.keyword
