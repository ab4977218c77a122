import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("notifications", "0003_notifications_to_personal_teams"),
    ]

    operations = [
        migrations.RemoveField(model_name="notificationsettings", name="owner"),
        migrations.RemoveField(model_name="notification", name="owner"),
        migrations.AlterField(
            model_name="notificationsettings",
            name="team",
            field=models.OneToOneField(
                on_delete=django.db.models.deletion.CASCADE,
                related_name="notification_settings",
                to="marketplace.team",
            ),
        ),
        migrations.AlterField(
            model_name="notification",
            name="team",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE,
                related_name="notifications",
                to="marketplace.team",
            ),
        ),
        migrations.AddIndex(
            model_name="notification",
            index=models.Index(fields=["team", "-created_at"], name="notification_by_team"),
        ),
    ]
