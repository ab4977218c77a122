import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("marketplace", "0011_personal_teams"),
    ]

    operations = [
        migrations.AlterField(
            model_name='apitoken',
            name='team',
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='api_tokens', to='marketplace.team'),
        ),
        migrations.AlterField(
            model_name='rental',
            name='team',
            field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='rentals', to='marketplace.team'),
        ),
    ]
