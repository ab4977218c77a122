from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0008_account_to_personal_team"),
    ]

    operations = [
        migrations.RemoveConstraint(model_name="account", name="account_owner_matches_kind"),
        migrations.RemoveConstraint(model_name="account", name="account_one_per_customer"),
        migrations.RemoveField(model_name="account", name="user"),
        migrations.AddConstraint(
            model_name="account",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("kind", "customer"), ("provider__isnull", True), ("team__isnull", False)),
                    models.Q(("kind", "provider"), ("provider__isnull", False), ("team__isnull", True)),
                    models.Q(("kind", "platform"), ("provider__isnull", True), ("team__isnull", True)),
                    _connector="OR",
                ),
                name="account_owner_matches_kind",
            ),
        ),
        migrations.AddConstraint(
            model_name="account",
            constraint=models.UniqueConstraint(
                condition=models.Q(("kind", "customer")),
                fields=("team",),
                name="account_one_per_team",
            ),
        ),
    ]
