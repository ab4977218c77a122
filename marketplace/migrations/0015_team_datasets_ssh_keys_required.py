import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("marketplace", "0014_datasets_ssh_keys_to_personal_teams"),
    ]

    operations = [
        migrations.AlterField(
            model_name="dataset",
            name="team",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT,
                related_name="datasets",
                to="marketplace.team",
            ),
        ),
        migrations.AlterField(
            model_name="sshkey",
            name="team",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE,
                related_name="ssh_keys",
                to="marketplace.team",
            ),
        ),
        migrations.AddConstraint(
            model_name="dataset",
            constraint=models.UniqueConstraint(
                fields=("team", "name"), name="dataset_name_per_team"
            ),
        ),
        migrations.AddConstraint(
            model_name="sshkey",
            constraint=models.UniqueConstraint(
                fields=("team", "fingerprint"), name="ssh_key_once_per_team"
            ),
        ),
    ]
