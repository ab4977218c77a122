from django.db import migrations


def to_personal_teams(apps, schema_editor):
    """Each person's settings and notifications move to their personal team (made by
    marketplace 0011 for everyone who existed then; a person made later without one gets it
    here)."""
    User = apps.get_model("marketplace", "User")
    Team = apps.get_model("marketplace", "Team")
    Membership = apps.get_model("marketplace", "Membership")
    NotificationSettings = apps.get_model("notifications", "NotificationSettings")
    Notification = apps.get_model("notifications", "Notification")
    owners = set(NotificationSettings.objects.values_list("owner_id", flat=True))
    owners |= set(Notification.objects.values_list("owner_id", flat=True))
    for user in User.objects.filter(pk__in=owners).order_by("pk"):
        team = Team.objects.filter(personal_of=user).first()
        if team is None:
            team = Team.objects.create(name=user.username[:80], personal_of=user)
            Membership.objects.create(team=team, user=user, role="owner")
        NotificationSettings.objects.filter(owner=user).update(team=team)
        Notification.objects.filter(owner=user).update(team=team)


class Migration(migrations.Migration):
    dependencies = [
        ("notifications", "0002_team_notifications"),
    ]

    operations = [
        migrations.RunPython(to_personal_teams, migrations.RunPython.noop),
    ]
