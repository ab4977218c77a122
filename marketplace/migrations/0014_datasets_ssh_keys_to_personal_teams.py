from django.db import migrations


def to_personal_teams(apps, schema_editor):
    """Existing datasets and SSH keys move into their owner's personal team (made by 0011 for
    everyone who existed then; a person made later without one gets it here)."""
    User = apps.get_model("marketplace", "User")
    Team = apps.get_model("marketplace", "Team")
    Membership = apps.get_model("marketplace", "Membership")
    Dataset = apps.get_model("marketplace", "Dataset")
    SshKey = apps.get_model("marketplace", "SshKey")
    owners = set(Dataset.objects.values_list("owner_id", flat=True))
    owners |= set(SshKey.objects.values_list("owner_id", flat=True))
    for user in User.objects.filter(pk__in=owners).order_by("pk"):
        team = Team.objects.filter(personal_of=user).first()
        if team is None:
            team = Team.objects.create(name=user.username[:80], personal_of=user)
            Membership.objects.create(team=team, user=user, role="owner")
        Dataset.objects.filter(owner=user).update(team=team)
        SshKey.objects.filter(owner=user).update(team=team)


class Migration(migrations.Migration):
    dependencies = [
        ("marketplace", "0013_team_datasets_ssh_keys"),
    ]

    operations = [
        migrations.RunPython(to_personal_teams, migrations.RunPython.noop),
    ]
