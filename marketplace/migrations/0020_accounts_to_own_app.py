# Teams, memberships, invitations, API tokens and SSH keys moved to the accounts app
# (accounts.0001_initial takes them over): the rental's team key follows them and the models
# are removed from this app's state only; their tables stay as they are. The foreign keys of
# billing, notifications and storage follow first (their migrations below), so nothing in the
# state points at the old models when they go.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0001_initial'),
        ('billing', '0010_account_team_in_accounts'),
        ('marketplace', '0019_node_fabric_address'),
        ('notifications', '0005_team_in_accounts'),
        ('storage', '0003_dataset_team_in_accounts'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='rental',
                    name='team',
                    field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='rentals', to='accounts.team'),
                ),
                migrations.DeleteModel(name='ApiToken'),
                migrations.DeleteModel(name='SshKey'),
                migrations.DeleteModel(name='Invitation'),
                migrations.DeleteModel(name='Membership'),
                migrations.DeleteModel(name='Team'),
            ],
            database_operations=[],
        ),
    ]
