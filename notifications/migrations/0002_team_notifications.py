import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("marketplace", "0012_team_required"),
        ("notifications", "0001_notification_outbox"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="notification", name="notification_by_owner"),
        migrations.AddField(
            model_name="notificationsettings",
            name="team",
            field=models.OneToOneField(
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="notification_settings",
                to="marketplace.team",
            ),
        ),
        migrations.AddField(
            model_name="notification",
            name="team",
            field=models.ForeignKey(
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="notifications",
                to="marketplace.team",
            ),
        ),
    ]
