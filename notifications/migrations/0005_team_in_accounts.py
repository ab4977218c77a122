# Teams moved to the accounts app (accounts.0001_initial): the foreign keys follow in state
# only; the columns and their constraints already point at the same table.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0001_initial'),
        ('notifications', '0004_team_notifications_required'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='notification',
                    name='team',
                    field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='notifications', to='accounts.team'),
                ),
                migrations.AlterField(
                    model_name='notificationsettings',
                    name='team',
                    field=models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='notification_settings', to='accounts.team'),
                ),
            ],
            database_operations=[],
        ),
    ]
