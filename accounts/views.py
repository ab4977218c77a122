"""Account pages: API tokens, SSH keys, secrets, the current team with its members and invitations,
the team switcher and an invitation's link. Reads go through the selectors; every action is a
call from the page to the REST API with the session, as the marketplace's pages do."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts import selectors, services
from accounts.models import TeamRole
from accounts.tenancy import refused, request_membership, request_team, session_team_set, team_page
from core.errors import DomainError, Forbidden


@require_GET
@login_required
@team_page
def tokens(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "accounts/tokens.html",
        {
            "tokens": selectors.api_token_list(
                team=request_team(request), user=request.user
            ).order_by("-created_at")
        },
    )


@require_GET
@login_required
@team_page
def ssh_keys(request: HttpRequest) -> HttpResponse:
    keys = selectors.ssh_key_list(team=request_team(request))
    return render(request, "accounts/ssh_keys.html", {"keys": keys})


@require_GET
@login_required
@team_page
def secrets(request: HttpRequest) -> HttpResponse:
    """The team's secrets by name; set and delete go through the API (values never shown)."""
    return render(
        request,
        "accounts/secrets.html",
        {"secrets": selectors.secret_list(team=request_team(request))},
    )


@require_GET
@login_required
def team(request: HttpRequest) -> HttpResponse:
    """The current team: its members and roles; owners invite and manage them from here."""
    membership = request_membership(request)
    if membership is None:
        return refused(request, Forbidden("you belong to no team"))
    return render(
        request,
        "accounts/team.html",
        {
            "team": membership.team,
            "members": selectors.team_members(team=membership.team),
            "invitations": selectors.invitation_pending_list(team=membership.team),
            "roles": TeamRole.choices,
        },
    )


@require_POST
@login_required
def team_switch(request: HttpRequest) -> HttpResponse:
    """The team switcher: the session acts for another of the person's teams from now on."""
    try:
        team_id = int(request.POST.get("team", ""))
    except ValueError:
        raise Http404("no such team") from None
    try:
        session_team_set(request, team_id=team_id)
    except DomainError as exc:
        raise Http404(exc.message) from exc
    back = request.POST.get("next") or "/"
    if not url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()}):
        back = "/"
    return redirect(back)


@require_http_methods(["GET", "POST"])
@login_required
def invitation(request: HttpRequest, team_id: int, key: str) -> HttpResponse:
    """An invitation's link: shows the team; the button joins it (signed in as the address it
    was sent to), makes it the session's team and opens its rentals."""
    found = selectors.invitation_by_key(raw=key)
    if found is None or found.team_id != team_id:
        return render(
            request, "accounts/invitation.html", {"error": "no such invitation"}, status=404
        )
    if request.method == "GET":
        return render(request, "accounts/invitation.html", {"invitation": found})
    try:
        membership = services.invitation_accept(user=request.user, team_id=team_id, raw=key)
    except DomainError as exc:
        return render(
            request,
            "accounts/invitation.html",
            {"invitation": found, "error": exc.message},
            status=exc.status,
        )
    session_team_set(request, team_id=membership.team_id)
    return redirect("web-rentals")
