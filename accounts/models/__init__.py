"""Accounts models: teams, their members and invitations, API tokens, SSH keys and
secrets.

The tables keep the names they had in the marketplace app (`db_table`); the user model stays
there (settings.AUTH_USER_MODEL)."""

from accounts.models.secrets import TeamSecret
from accounts.models.sshkeys import SshKey
from accounts.models.teams import MONEY_ROLES, Invitation, Membership, Team, TeamRole
from accounts.models.tokens import ApiToken

__all__ = [
    "MONEY_ROLES",
    "ApiToken",
    "Invitation",
    "Membership",
    "SshKey",
    "Team",
    "TeamRole",
    "TeamSecret",
]
