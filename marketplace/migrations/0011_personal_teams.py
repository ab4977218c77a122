from django.db import migrations


def personal_teams(apps, schema_editor):
    """Every existing person gets a personal team they own; their rentals and API tokens move
    into it (billing's accounts follow in billing.0006)."""
    User = apps.get_model("marketplace", "User")
    Team = apps.get_model("marketplace", "Team")
    Membership = apps.get_model("marketplace", "Membership")
    Rental = apps.get_model("marketplace", "Rental")
    ApiToken = apps.get_model("marketplace", "ApiToken")
    for user in User.objects.order_by("pk").iterator():
        team = Team.objects.create(name=user.username[:80], personal_of=user)
        Membership.objects.create(team=team, user=user, role="owner")
        Rental.objects.filter(customer=user).update(team=team)
        ApiToken.objects.filter(user=user).update(team=team)


class Migration(migrations.Migration):
    dependencies = [
        ("marketplace", "0010_teams"),
    ]

    operations = [
        migrations.RunPython(personal_teams, migrations.RunPython.noop),
    ]
