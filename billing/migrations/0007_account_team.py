import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0006_budgets_and_limits"),
        ("marketplace", "0012_team_required"),
    ]

    operations = [
        migrations.AddField(
            model_name="account",
            name="team",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="billing_accounts",
                to="marketplace.team",
            ),
        ),
    ]
