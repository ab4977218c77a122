"""Sign-in now asks for a verified email address (django-allauth). People who exist already were
created by ops or the demo seed, so their address counts as verified: they keep signing in."""

from django.db import migrations


def verify_existing(apps, schema_editor):
    User = apps.get_model("marketplace", "User")
    EmailAddress = apps.get_model("account", "EmailAddress")
    known = set(EmailAddress.objects.values_list("user_id", flat=True))
    EmailAddress.objects.bulk_create(
        [
            EmailAddress(user_id=pk, email=email.lower(), verified=True, primary=True)
            for pk, email in User.objects.exclude(email="").values_list("pk", "email")
            if pk not in known
        ]
    )


class Migration(migrations.Migration):
    dependencies = [
        ("marketplace", "0005_node_measured_reliability"),
        ("account", "0009_emailaddress_unique_primary_email"),
    ]

    operations = [migrations.RunPython(verify_existing, migrations.RunPython.noop)]
