"""Hashed API tokens: programs acting as a person for one team."""

from django.conf import settings
from django.db import models


class ApiToken(models.Model):
    """A bearer token for programs, acting as its user for one team; only its SHA-256 is
    stored, the secret is shown once."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=80)
    # The public prefix lets a user recognise a token in a list without the secret.
    prefix = models.CharField(max_length=16, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "marketplace_apitoken"
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"
