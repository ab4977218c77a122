"""Which team a request acts for: the one place it is decided, for the API, the web pages and
every app's views.

A program's API token acts for the one team it was created in (set by the token
authentication). A browser's session acts for the team picked in the switcher (kept in the
session), else the person's personal team, else the first team they joined. A signed-in person
in no team at all (an account made by `createsuperuser` or by hand in the database) gets their
personal team here, on their first request, so ops staff can rent too. Views pass the
team returned here to selectors and services (`team=`); the role decides money and members.
"""

from __future__ import annotations

from functools import wraps

from django.contrib.auth import get_user_model
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from accounts import selectors, services
from accounts.models import Membership, Team
from core.errors import Forbidden, NotFound

User = get_user_model()

TEAM_SESSION_KEY = "gpumarket_team_id"
_MEMBERSHIP = "_gpumarket_membership"


def membership_decided(request, membership: Membership | None) -> None:
    """Record the request's membership (the token authentication does, for the token's team)."""
    setattr(getattr(request, "_request", request), _MEMBERSHIP, membership)


def request_membership(request) -> Membership | None:
    """The membership the request acts through: the token's team, else the session's current
    team, else the person's personal team (or first team). None for anonymous callers and for
    people in no team. Decided once per request."""
    raw = getattr(request, "_request", request)
    if hasattr(raw, _MEMBERSHIP):
        return getattr(raw, _MEMBERSHIP)
    user = getattr(request, "user", None)
    membership = None
    if isinstance(user, User) and user.is_authenticated:
        session = getattr(raw, "session", None)
        wanted = session.get(TEAM_SESSION_KEY) if session is not None else None
        membership = selectors.membership_current(user=user, team_id=wanted)
        if membership is None:  # in no team at all
            services.team_personal_ensure(user=user)
            membership = selectors.membership_current(user=user)
    membership_decided(raw, membership)
    return membership


def request_team(request, *, money: bool = False) -> Team:
    """The team of the request; `money` asks for a role that manages money (owner, billing).
    Raises Forbidden (403) otherwise."""
    membership = request_membership(request)
    if membership is None:
        raise Forbidden("you belong to no team")
    if money and not membership.manages_money:
        raise Forbidden("only the team's owners and billing members manage its money")
    return membership.team


def session_team_set(request, *, team_id: int) -> Membership:
    """Switch the session's current team (the web's team switcher); another team's id is not
    found."""
    membership = selectors.membership_get(user=request.user, team_id=team_id)
    if membership is None:
        raise NotFound("no such team", field="team")
    request.session[TEAM_SESSION_KEY] = membership.team_id
    membership_decided(request, membership)
    return membership


def refused(request: HttpRequest, error: Forbidden) -> HttpResponse:
    """The page a person sees when the team or their role does not allow what they asked."""
    return render(request, "accounts/refused.html", {"message": error.message}, status=error.status)


def team_page(view):
    """A web page of the current team: a person in no team, or whose role does not allow the
    page (`request_team(request, money=True)` in the view), gets the refusal page (403)."""

    @wraps(view)
    def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        try:
            return view(request, *args, **kwargs)
        except Forbidden as exc:
            return refused(request, exc)

    return wrapped
