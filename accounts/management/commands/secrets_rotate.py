"""Re-encrypt every team secret with the first of SECRETS_ENCRYPTION_KEYS."""

from django.core.management.base import BaseCommand

from accounts.services.secrets import secrets_reencrypt


class Command(BaseCommand):
    help = (
        "Re-encrypt every team secret with the first key of SECRETS_ENCRYPTION_KEYS; afterwards "
        "the older keys can be dropped from it."
    )

    def handle(self, *args, **options) -> None:
        count = secrets_reencrypt()
        self.stdout.write(f"{count} secrets re-encrypted with the first key")
