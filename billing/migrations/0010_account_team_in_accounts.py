# Teams moved to the accounts app (accounts.0001_initial): the account's foreign key follows in
# state only; the column and its constraint already point at the same table.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0001_initial'),
        ('billing', '0009_account_owned_by_team'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='account',
                    name='team',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='billing_accounts', to='accounts.team'),
                ),
            ],
            database_operations=[],
        ),
    ]
