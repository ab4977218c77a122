"""Template context every page gets: the signed-in person's teams and the current one."""

from __future__ import annotations

from django.http import HttpRequest

from marketplace import selectors
from marketplace.models import User
from marketplace.tenancy import request_membership


def teams(request: HttpRequest) -> dict:
    user = getattr(request, "user", None)
    if not isinstance(user, User) or not user.is_authenticated:
        return {}
    return {
        "membership": request_membership(request),
        "memberships": selectors.membership_list(user=user),
    }
