"""SSH public keys of a team: its rentals that ask for SSH let their holders in."""

from django.conf import settings
from django.db import models


class SshKey(models.Model):
    """A public key that may log in to the SSH of the team's rentals, whichever member created
    them (only the public half is ever sent here)."""

    # The team owns it (any member adds and removes keys); ownership is read in one place
    # (selectors.ssh_key_scope).
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="ssh_keys")
    # The member who added it (shown in the listing).
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="ssh_keys"
    )
    name = models.CharField(max_length=80, blank=True)
    key_type = models.CharField(max_length=40)
    # "TYPE BASE64" exactly as the key parsed; the comment is kept apart and never sent to nodes.
    public_key = models.TextField()
    comment = models.CharField(max_length=200, blank=True)
    fingerprint = models.CharField(max_length=60, help_text="SHA256:..., as ssh-keygen -l shows")
    bits = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "marketplace_sshkey"
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["team", "fingerprint"], name="ssh_key_once_per_team")
        ]

    def __str__(self) -> str:
        return f"{self.name or self.key_type} {self.fingerprint}"
