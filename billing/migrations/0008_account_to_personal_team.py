from django.db import migrations


def accounts_to_teams(apps, schema_editor):
    """A customer's account becomes their personal team's (made in marketplace.0007)."""
    Account = apps.get_model("billing", "Account")
    Team = apps.get_model("marketplace", "Team")
    for account in Account.objects.filter(kind="customer").order_by("pk").iterator():
        team = Team.objects.get(personal_of_id=account.user_id)
        Account.objects.filter(pk=account.pk).update(team=team)


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0007_account_team"),
    ]

    operations = [
        migrations.RunPython(accounts_to_teams, migrations.RunPython.noop),
    ]
