"""Template context every page gets: the signed-in person's teams and the current one."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.http import HttpRequest

from accounts import selectors
from accounts.tenancy import request_membership

User = get_user_model()


def teams(request: HttpRequest) -> dict:
    user = getattr(request, "user", None)
    if not isinstance(user, User) or not user.is_authenticated:
        return {}
    return {
        "membership": request_membership(request),
        "memberships": selectors.membership_list(user=user),
    }
