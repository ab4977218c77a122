"""Create the S3 bucket of S3_BUCKET unless it exists (a deployment's first start runs it
beside `migrate`; the embedded stack creates its own)."""

from django.core.management.base import BaseCommand, CommandError

from storage import objectstore


class Command(BaseCommand):
    help = "Create the object storage bucket (S3_BUCKET) unless it exists."

    def handle(self, *args, **options) -> None:
        if not objectstore.configured():
            raise CommandError("S3_BUCKET is not set")
        try:
            created = objectstore.bucket_create()
        except objectstore.StorageUnavailable as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write("created" if created else "exists")
