"""Team secrets: values a team's rentals use by name (API keys, registry credentials)."""

from django.conf import settings
from django.db import models
from django.db.models import Q


class TeamSecret(models.Model):
    """A named value of a team, encrypted at rest (accounts.services.secrets): write-only,
    it reaches nobody but the node that runs a rental naming it."""

    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="secrets")
    # An environment variable's name: a rental gets it as $NAME unless it says otherwise.
    name = models.CharField(max_length=64)
    # A Fernet token of the UTF-8 value (settings.SECRETS_ENCRYPTION_KEYS).
    ciphertext = models.TextField()
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["team", "name"], name="secret_name_unique_per_team"),
            models.CheckConstraint(
                condition=Q(name__regex=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"),
                name="secret_name_is_a_variable_name",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.team_id}/{self.name}"
