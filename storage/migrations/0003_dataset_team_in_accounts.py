# Teams moved to the accounts app (accounts.0001_initial): the dataset's foreign key follows in
# state only; the column and its constraint already point at the same table.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('accounts', '0001_initial'),
        ('storage', '0002_content_types'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='dataset',
                    name='team',
                    field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='datasets', to='accounts.team'),
                ),
            ],
            database_operations=[],
        ),
    ]
