# The object storage models, taken over from the marketplace app (marketplace.0018 drops them
# from its state): created in state only, on the tables and constraints marketplace.0008 and
# 0013-0015 created.

import django.db.models.deletion
import uuid
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('marketplace', '0018_storage_to_own_app'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='Dataset',
                    fields=[
                        ('id', models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                        ('name', models.CharField(max_length=80)),
                        ('status', models.CharField(choices=[('uploading', 'Uploading'), ('ready', 'Ready'), ('failed', 'Failed')], default='uploading', max_length=10)),
                        ('status_reason', models.CharField(blank=True, max_length=500)),
                        ('source_url', models.URLField(blank=True, max_length=2000)),
                        ('total_bytes', models.BigIntegerField(default=0)),
                        ('file_count', models.PositiveIntegerField(default=0)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('ready_at', models.DateTimeField(blank=True, null=True)),
                        ('owner', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='datasets', to=settings.AUTH_USER_MODEL)),
                        ('team', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='datasets', to='marketplace.team')),
                    ],
                    options={
                        'db_table': 'marketplace_dataset',
                        'ordering': ['-created_at'],
                        'constraints': [models.UniqueConstraint(fields=('team', 'name'), name='dataset_name_per_team'), models.CheckConstraint(condition=models.Q(('total_bytes__gte', 0)), name='dataset_bytes')],
                    },
                ),
                migrations.CreateModel(
                    name='DatasetFile',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('path', models.CharField(max_length=1024)),
                        ('size_bytes', models.BigIntegerField()),
                        ('sha256', models.CharField(max_length=64)),
                        ('upload_id', models.CharField(blank=True, max_length=1024)),
                        ('part_bytes', models.BigIntegerField(default=0)),
                        ('stored_at', models.DateTimeField(blank=True, null=True)),
                        ('dataset', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='files', to='storage.dataset')),
                    ],
                    options={
                        'db_table': 'marketplace_datasetfile',
                        'ordering': ['path'],
                        'constraints': [models.UniqueConstraint(fields=('dataset', 'path'), name='dataset_file_path'), models.CheckConstraint(condition=models.Q(('size_bytes__gte', 0)), name='dataset_file_size')],
                    },
                ),
                migrations.CreateModel(
                    name='RentalDataset',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('dataset', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='rental_links', to='storage.dataset')),
                        ('rental', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='dataset_links', to='marketplace.rental')),
                    ],
                    options={
                        'db_table': 'marketplace_rentaldataset',
                        'constraints': [models.UniqueConstraint(fields=('rental', 'dataset'), name='rental_dataset_once')],
                    },
                ),
                migrations.CreateModel(
                    name='Artifact',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('path', models.CharField(max_length=1024)),
                        ('size_bytes', models.BigIntegerField()),
                        ('sha256', models.CharField(max_length=64)),
                        ('run_id', models.CharField(max_length=128)),
                        ('reason', models.CharField(blank=True, max_length=12)),
                        ('synced_at', models.DateTimeField()),
                        ('rental', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='artifacts', to='marketplace.rental')),
                    ],
                    options={
                        'db_table': 'marketplace_artifact',
                        'ordering': ['path'],
                        'constraints': [models.UniqueConstraint(fields=('rental', 'path'), name='artifact_path_per_rental'), models.CheckConstraint(condition=models.Q(('size_bytes__gte', 0)), name='artifact_size')],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
