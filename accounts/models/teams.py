"""Teams: who rentals, API tokens and the balance belong to, its members and their roles."""

from django.conf import settings
from django.db import models
from django.db.models import Q


class TeamRole(models.TextChoices):
    OWNER = "owner", "Owner"
    BILLING = "billing", "Billing"
    MEMBER = "member", "Member"


# Roles that may move money (top-ups, invoices, budgets); owners also manage the members.
MONEY_ROLES = frozenset({TeamRole.OWNER, TeamRole.BILLING})


class Team(models.Model):
    """An organisation that owns rentals, API tokens and a balance; every person has a personal
    one and may belong to others."""

    name = models.CharField(max_length=80)
    # The team made for a person when their account was created (shown as "personal").
    personal_of = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="personal_team",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "marketplace_team"
        ordering = ["name", "id"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    """One person in one team with one role; the role decides who manages members and money."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=8, choices=TeamRole.choices, default=TeamRole.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "marketplace_membership"
        ordering = ["team_id", "id"]
        constraints = [
            models.UniqueConstraint(fields=["team", "user"], name="membership_once_per_team"),
        ]

    def __str__(self) -> str:
        return f"{self.user_id} in {self.team_id} ({self.role})"

    @property
    def manages_money(self) -> bool:
        return self.role in MONEY_ROLES

    @property
    def manages_members(self) -> bool:
        return self.role == TeamRole.OWNER


class Invitation(models.Model):
    """An emailed link that lets the person signed in as `email` join the team once, before it
    expires; only the SHA-256 of its secret is stored."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField()
    role = models.CharField(max_length=8, choices=TeamRole.choices, default=TeamRole.MEMBER)
    key_hash = models.CharField(max_length=64, unique=True)
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "marketplace_invitation"
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(accepted_at__isnull=True) | Q(revoked_at__isnull=True),
                name="invitation_accepted_or_revoked",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.email} to {self.team_id}"
