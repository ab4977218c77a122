# The content types (and so the admin permissions) of the moved models follow them: the rows
# the marketplace app had are relabelled, keeping their ids and the permissions that point at
# them. A database that never had them (a fresh one) gets the accounts app's rows after migrate.

from django.db import migrations

MODELS = ("team", "membership", "invitation", "apitoken", "sshkey")


def _relabel(apps, old: str, new: str) -> None:
    ContentType = apps.get_model("contenttypes", "ContentType")
    for model in MODELS:
        if ContentType.objects.filter(app_label=new, model=model).exists():
            continue
        ContentType.objects.filter(app_label=old, model=model).update(app_label=new)


def forwards(apps, schema_editor):
    _relabel(apps, "marketplace", "accounts")


def backwards(apps, schema_editor):
    _relabel(apps, "accounts", "marketplace")


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0001_initial'),
        ('contenttypes', '0002_remove_content_type_name'),
    ]

    operations = [
        migrations.RunPython(forwards, backwards),
    ]
