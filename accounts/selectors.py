"""Reads of accounts and teams: querysets with their relations loaded, for views and other apps."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from django.utils import timezone

from accounts import queries
from accounts.models import ApiToken, Invitation, Membership, SshKey, Team, TeamSecret

User = get_user_model()


def membership_get(*, user: User, team_id) -> Membership | None:
    """The user's membership of one team (with the team); a team they are not in is None."""
    if not isinstance(team_id, int) or isinstance(team_id, bool):
        return None
    return Membership.objects.select_related("team").filter(user=user, team_id=team_id).first()


def membership_current(*, user: User, team_id=None) -> Membership | None:
    """The team a signed-in person acts for: `team_id` when they are in it, else their
    personal team, else the first team they joined."""
    chosen = membership_get(user=user, team_id=team_id) if team_id is not None else None
    if chosen is not None:
        return chosen
    memberships = Membership.objects.select_related("team").filter(user=user)
    return memberships.filter(team__personal_of=user).first() or memberships.order_by("pk").first()


def membership_list(*, user: User) -> QuerySet[Membership]:
    """The teams a person belongs to, with their role in each (the switcher, GET /teams/)."""
    return (
        Membership.objects.select_related("team")
        .filter(user=user)
        .order_by("team__name", "team_id")
    )


def team_members(*, team: Team) -> QuerySet[Membership]:
    return Membership.objects.select_related("user").filter(team=team).order_by("created_at", "pk")


def invitation_pending_list(*, team: Team) -> QuerySet[Invitation]:
    return Invitation.objects.filter(
        team=team,
        accepted_at__isnull=True,
        revoked_at__isnull=True,
        expires_at__gt=timezone.now(),
    ).order_by("-created_at", "-id")


def invitation_by_key(*, raw: str) -> Invitation | None:
    """The invitation a link's secret names, whatever its state (the accept page shows why a
    link no longer works)."""
    from accounts.services.tokens import token_hash

    return Invitation.objects.select_related("team").filter(key_hash=token_hash(raw)).first()


def api_token_authenticating(*, key_hash: str) -> ApiToken | None:
    """The token with that hash, its user and team, and as `membership` its user's membership
    of its team (None when they are no longer in it): one statement."""
    loaded = queries.api_token_with_membership(key_hash=key_hash)
    if loaded is None:
        return None
    token, user, team, membership = loaded
    token.user, token.team = user, team
    if membership is not None:
        membership.user, membership.team = user, team
    token.membership = membership
    return token


def api_token_list(*, team: Team, user: User) -> QuerySet[ApiToken]:
    """The user's own tokens for the team."""
    return ApiToken.objects.filter(team=team, user=user)


def ssh_key_scope(*, team: Team) -> QuerySet[SshKey]:
    """The SSH keys a member of `team` may list, delete and log in with: the one place that says
    who owns a key (the team; any member adds and removes them)."""
    return SshKey.objects.filter(team=team)


def ssh_key_list(*, team: Team) -> QuerySet[SshKey]:
    """The team's keys with who added each."""
    return ssh_key_scope(team=team).select_related("owner").order_by("-created_at", "-id")


def secret_list(*, team: Team) -> QuerySet[TeamSecret]:
    """The team's secrets by name, with who created each; their ciphertext is not even read."""
    return (
        TeamSecret.objects.filter(team=team)
        .select_related("created_by")
        .defer("ciphertext")
        .order_by("name")
    )
