"""Team writes: a person's account and personal team, members and roles, invitations by email.

Every customer is created by `user_create` (sign-up, the admin, the demo data): it makes the
person's personal team in the same transaction, so nobody exists without a team to own their
rentals, tokens and balance.
"""

from __future__ import annotations

import logging
import smtplib
import time
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import send_mail
from django.db import transaction
from django.utils import timezone

from accounts.models import ApiToken, Invitation, Membership, Team, TeamRole
from accounts.services.tokens import token_hash, token_mint
from core.errors import Conflict, Forbidden, NotFound, ValidationFailed

User = get_user_model()
log = logging.getLogger(__name__)

INVITATION_TTL = timedelta(days=7)
# Invitation secrets look like API tokens: `gpi_<prefix>_<random>`.
INVITATION_KIND = "gpi"
# One mail, tried this many times with a doubling pause; SMTP's own timeout is EMAIL_TIMEOUT.
MAIL_ATTEMPTS = 3
MAIL_BACKOFF_S = 0.5


def user_create(
    *,
    username: str,
    email: str,
    password: str | None = None,
    first_name: str = "",
    last_name: str = "",
    is_staff: bool = False,
    is_superuser: bool = False,
) -> User:
    """Create a person (customer, provider operator or ops staff) with their personal team,
    whose owner they are. The one way accounts come into being."""
    email = email.strip()
    if not email:
        raise ValidationFailed("an email address is required", field="email")
    if User.objects.filter(email__iexact=email).exists():
        raise ValidationFailed("an account with this email exists", field="email")
    if User.objects.filter(username=username).exists():
        raise ValidationFailed("this username is taken", field="username")
    with transaction.atomic():
        user = User.objects.create_user(
            username=username,
            email=email,
            password=password,
            first_name=first_name,
            last_name=last_name,
            is_staff=is_staff,
            is_superuser=is_superuser,
        )
        team_personal_ensure(user=user)
    return user


def team_personal_ensure(*, user: User) -> Team:
    """The person's personal team, made (with them as owner) if they have none yet; for
    accounts created outside `user_create` (the admin's add form, `createsuperuser`)."""
    with transaction.atomic():
        team = Team.objects.filter(personal_of=user).first()
        if team is None:
            # Two first requests of the same person at once: the person's row lock makes the
            # second wait and then find the team the first made.
            User.objects.select_for_update().filter(pk=user.pk).first()
            team = Team.objects.filter(personal_of=user).first()
        if team is None:
            team = Team.objects.create(name=user.username[:80], personal_of=user)
            Membership.objects.create(team=team, user=user, role=TeamRole.OWNER)
        return team


def team_create(*, owner: User, name: str) -> Team:
    """A new team with `owner` as its first owner."""
    name = (name or "").strip()
    if not name:
        raise ValidationFailed("a team needs a name", field="name")
    if len(name) > 80:
        raise ValidationFailed("at most 80 characters", field="name")
    with transaction.atomic():
        team = Team.objects.create(name=name)
        Membership.objects.create(team=team, user=owner, role=TeamRole.OWNER)
    return team


def _acting_membership(*, team: Team, actor: User) -> Membership:
    membership = Membership.objects.filter(team=team, user=actor).first()
    if membership is None:
        raise NotFound("no such team")
    return membership


def _require_owner(*, team: Team, actor: User) -> None:
    if not _acting_membership(team=team, actor=actor).manages_members:
        raise Forbidden("only the team's owners manage its members")


def _locked_members(team: Team) -> list[Membership]:
    """The team's memberships, locked in id order: role changes and removals take turns, so two
    owners demoting each other at once cannot leave the team without one."""
    Team.objects.select_for_update().filter(pk=team.pk).first()
    return list(Membership.objects.select_for_update().filter(team=team).order_by("pk"))


def _target(members: list[Membership], membership_id: int) -> Membership:
    target = next((m for m in members if m.pk == membership_id), None)
    if target is None:
        raise NotFound("no such member")
    return target


def _keeps_an_owner(members: list[Membership], *, without: Membership) -> bool:
    return any(m.role == TeamRole.OWNER and m.pk != without.pk for m in members)


def team_member_role_set(*, team: Team, actor: User, membership_id: int, role: str) -> Membership:
    """An owner changes a member's role; the last owner cannot step down."""
    if role not in TeamRole.values:
        raise ValidationFailed(f"role must be one of {', '.join(TeamRole.values)}", field="role")
    with transaction.atomic():
        _require_owner(team=team, actor=actor)
        members = _locked_members(team)
        target = _target(members, membership_id)
        if role != TeamRole.OWNER and not _keeps_an_owner(members, without=target):
            raise Conflict("a team keeps at least one owner", field="role")
        if target.role != role:
            target.role = role
            target.save(update_fields=["role"])
        return target


def team_member_remove(*, team: Team, actor: User, membership_id: int) -> None:
    """An owner removes a member, or a member leaves; the last owner cannot. The member's API
    tokens for this team are revoked with the membership."""
    with transaction.atomic():
        acting = _acting_membership(team=team, actor=actor)
        members = _locked_members(team)
        target = _target(members, membership_id)
        if target.user_id != actor.pk and not acting.manages_members:
            raise Forbidden("only the team's owners remove other members")
        if target.role == TeamRole.OWNER and not _keeps_an_owner(members, without=target):
            raise Conflict("a team keeps at least one owner")
        ApiToken.objects.filter(team=team, user_id=target.user_id, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        target.delete()


@dataclass(frozen=True, slots=True)
class InvitationSent:
    """A new invitation, its link (shown once: only its hash is kept) and whether it was
    mailed."""

    invitation: Invitation
    link: str
    mailed: bool


def invitation_path(*, team_id: int, raw: str) -> str:
    return f"/teams/{team_id}/join/{raw}/"


def invitation_create(
    *, team: Team, actor: User, email: str, role: str = TeamRole.MEMBER, base_url: str
) -> InvitationSent:
    """An owner invites someone by email: the mail carries a single-use link that expires after
    INVITATION_TTL. An earlier pending invitation of the same address to the team is revoked."""
    email = (email or "").strip()
    if not email or "@" not in email:
        raise ValidationFailed("a valid email address is required", field="email")
    if role not in TeamRole.values:
        raise ValidationFailed(f"role must be one of {', '.join(TeamRole.values)}", field="role")
    now = timezone.now()
    with transaction.atomic():
        _require_owner(team=team, actor=actor)
        if Membership.objects.filter(team=team, user__email__iexact=email).exists():
            raise Conflict("this person is already a member", field="email")
        Invitation.objects.filter(
            team=team, email__iexact=email, accepted_at__isnull=True, revoked_at__isnull=True
        ).update(revoked_at=now)
        _, raw = token_mint(INVITATION_KIND)
        invitation = Invitation.objects.create(
            team=team,
            email=email,
            role=role,
            key_hash=token_hash(raw),
            invited_by=actor,
            expires_at=now + INVITATION_TTL,
        )
    link = base_url.rstrip("/") + invitation_path(team_id=team.pk, raw=raw)
    mailed = _invitation_mail(invitation=invitation, actor=actor, link=link)
    return InvitationSent(invitation=invitation, link=link, mailed=mailed)


def _invitation_mail(*, invitation: Invitation, actor: User, link: str) -> bool:
    """Send the invitation; a transient SMTP failure is retried, a lasting one is logged and
    reported to the inviter (who still has the link to pass on)."""
    who = actor.get_full_name() or actor.username
    subject = f"{who} invites you to the team {invitation.team.name}"
    body = (
        f"{who} invites you to join the team {invitation.team.name} as {invitation.role}.\n\n"
        f"Sign in (or sign up) as {invitation.email} and open this link to accept:\n\n"
        f"{link}\n\n"
        f"The link works once and expires on {invitation.expires_at:%Y-%m-%d %H:%M} UTC.\n"
    )
    for attempt in range(MAIL_ATTEMPTS):
        try:
            send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, [invitation.email])
            return True
        except (smtplib.SMTPException, OSError) as exc:
            log.warning(
                "invitation %s: mail attempt %d failed: %s", invitation.pk, attempt + 1, exc
            )
            if attempt + 1 < MAIL_ATTEMPTS:
                time.sleep(MAIL_BACKOFF_S * 2**attempt)
    return False


def invitation_revoke(*, team: Team, actor: User, invitation_id: int) -> Invitation:
    with transaction.atomic():
        _require_owner(team=team, actor=actor)
        invitation = (
            Invitation.objects.select_for_update().filter(team=team, pk=invitation_id).first()
        )
        if invitation is None:
            raise NotFound("no such invitation")
        if invitation.accepted_at is None and invitation.revoked_at is None:
            invitation.revoked_at = timezone.now()
            invitation.save(update_fields=["revoked_at"])
        return invitation


def invitation_accept(*, user: User, team_id: int, raw: str) -> Membership:
    """Join the team the link was made for, signed in as the address it was sent to; the link
    then stops working. Any refusal changes nothing."""
    with transaction.atomic():
        invitation = (
            Invitation.objects.select_for_update()
            .select_related("team")
            .filter(key_hash=token_hash(raw or ""))
            .first()
        )
        if invitation is None:
            raise NotFound("no such invitation", field="invitation")
        if invitation.team_id != team_id:
            raise ValidationFailed("this invitation is for another team", field="invitation")
        if invitation.accepted_at is not None:
            raise Conflict("this invitation has been used already", field="invitation")
        if invitation.revoked_at is not None:
            raise Conflict("this invitation was withdrawn", field="invitation")
        if invitation.expires_at <= timezone.now():
            raise Conflict("this invitation has expired: ask for a new one", field="invitation")
        if (user.email or "").strip().lower() != invitation.email.strip().lower():
            raise Forbidden(
                "this invitation was sent to another email address: sign in with that account"
            )
        if Membership.objects.filter(team_id=team_id, user=user).exists():
            raise Conflict("you are already a member of this team", field="invitation")
        membership = Membership.objects.create(
            team=invitation.team, user=user, role=invitation.role
        )
        invitation.accepted_at = timezone.now()
        invitation.accepted_by = user
        invitation.save(update_fields=["accepted_at", "accepted_by"])
        return membership
