import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("marketplace", "0012_team_required"),
    ]

    operations = [
        migrations.RemoveConstraint(model_name="dataset", name="dataset_name_per_owner"),
        migrations.RemoveConstraint(model_name="sshkey", name="ssh_key_once_per_owner"),
        migrations.AddField(
            model_name="dataset",
            name="team",
            field=models.ForeignKey(
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="datasets",
                to="marketplace.team",
            ),
        ),
        migrations.AddField(
            model_name="sshkey",
            name="team",
            field=models.ForeignKey(
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="ssh_keys",
                to="marketplace.team",
            ),
        ),
    ]
