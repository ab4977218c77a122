# The object storage models moved to the storage app (storage.0001_initial takes them over):
# removed from this app's state only, their tables stay as they are.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('marketplace', '0017_advisor_to_own_app'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name='DatasetFile'),
                migrations.DeleteModel(name='RentalDataset'),
                migrations.DeleteModel(name='Artifact'),
                migrations.DeleteModel(name='Dataset'),
            ],
            database_operations=[],
        ),
    ]
