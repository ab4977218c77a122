# The advisor's models moved to the advisor app (advisor.0001_initial takes them over): removed
# from this app's state only, their tables stay as they are.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('marketplace', '0016_node_runtime_ssh_capable'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name='AdvisorCheck'),
                migrations.DeleteModel(name='AdvisorPrior'),
            ],
            database_operations=[],
        ),
    ]
