"""People and programs: users (customers and ops staff), providers, hashed API tokens."""

from django.conf import settings
from django.contrib.auth.models import AbstractUser
from django.db import models
from django.db.models import Q


class User(AbstractUser):
    """A person who logs in: a customer, a provider's operator, or ops staff (is_staff)."""

    email = models.EmailField(unique=True)

    class Meta:
        db_table = "marketplace_user"


class Provider(models.Model):
    """An organisation that lists GPU servers; the platform itself is one (is_platform)."""

    name = models.CharField(max_length=120, unique=True)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="providers"
    )
    is_platform = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["is_platform"], condition=Q(is_platform=True), name="one_platform_provider"
            )
        ]

    def __str__(self) -> str:
        return self.name


class ApiToken(models.Model):
    """A bearer token for programs, acting as its user for one team; only its SHA-256 is
    stored, the secret is shown once."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    team = models.ForeignKey(
        "marketplace.Team", on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=80)
    # The public prefix lets a user recognise a token in a list without the secret.
    prefix = models.CharField(max_length=16, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"
