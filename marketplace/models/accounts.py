"""People and providers: users (customers and ops staff) and the organisations that list GPU
servers. Teams, their API tokens and SSH keys live in the accounts app."""

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
