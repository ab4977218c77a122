"""Every write of accounts and teams: typed, keyword-only functions, each owning its
transaction."""

from accounts.services.sshkeys import ssh_key_add, ssh_key_delete, ssh_key_parse
from accounts.services.teams import (
    InvitationSent,
    invitation_accept,
    invitation_create,
    invitation_revoke,
    team_create,
    team_member_remove,
    team_member_role_set,
    team_personal_ensure,
    user_create,
)
from accounts.services.tokens import (
    api_token_create,
    api_token_revoke,
    token_hash,
    token_mint,
    user_email_verified_set,
)

__all__ = [
    "InvitationSent",
    "api_token_create",
    "api_token_revoke",
    "invitation_accept",
    "invitation_create",
    "invitation_revoke",
    "ssh_key_add",
    "ssh_key_delete",
    "ssh_key_parse",
    "team_create",
    "team_member_remove",
    "team_member_role_set",
    "team_personal_ensure",
    "token_hash",
    "token_mint",
    "user_create",
    "user_email_verified_set",
]
