# Teams, memberships, invitations, API tokens and SSH keys, taken over from the marketplace app
# (marketplace.0020 drops them from its state): created in state only, on the tables and
# constraints marketplace.0007 and 0010-0015 created (db_table keeps their names).

import django.db.models.deletion
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
                    name='Team',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(max_length=80)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('personal_of', models.OneToOneField(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='personal_team', to=settings.AUTH_USER_MODEL)),
                    ],
                    options={
                        'db_table': 'marketplace_team',
                        'ordering': ['name', 'id'],
                    },
                ),
                migrations.CreateModel(
                    name='ApiToken',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(max_length=80)),
                        ('prefix', models.CharField(db_index=True, max_length=16)),
                        ('key_hash', models.CharField(max_length=64, unique=True)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('last_used_at', models.DateTimeField(blank=True, null=True)),
                        ('expires_at', models.DateTimeField(blank=True, null=True)),
                        ('revoked_at', models.DateTimeField(blank=True, null=True)),
                        ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='api_tokens', to=settings.AUTH_USER_MODEL)),
                        ('team', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='api_tokens', to='accounts.team')),
                    ],
                    options={
                        'db_table': 'marketplace_apitoken',
                        'ordering': ['-created_at', '-id'],
                    },
                ),
                migrations.CreateModel(
                    name='SshKey',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(blank=True, max_length=80)),
                        ('key_type', models.CharField(max_length=40)),
                        ('public_key', models.TextField()),
                        ('comment', models.CharField(blank=True, max_length=200)),
                        ('fingerprint', models.CharField(help_text='SHA256:..., as ssh-keygen -l shows', max_length=60)),
                        ('bits', models.PositiveIntegerField()),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='ssh_keys', to=settings.AUTH_USER_MODEL)),
                        ('team', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='ssh_keys', to='accounts.team')),
                    ],
                    options={
                        'db_table': 'marketplace_sshkey',
                        'ordering': ['-created_at', '-id'],
                        'constraints': [models.UniqueConstraint(fields=('team', 'fingerprint'), name='ssh_key_once_per_team')],
                    },
                ),
                migrations.CreateModel(
                    name='Membership',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('role', models.CharField(choices=[('owner', 'Owner'), ('billing', 'Billing'), ('member', 'Member')], default='member', max_length=8)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='memberships', to=settings.AUTH_USER_MODEL)),
                        ('team', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='memberships', to='accounts.team')),
                    ],
                    options={
                        'db_table': 'marketplace_membership',
                        'ordering': ['team_id', 'id'],
                        'constraints': [models.UniqueConstraint(fields=('team', 'user'), name='membership_once_per_team')],
                    },
                ),
                migrations.CreateModel(
                    name='Invitation',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('email', models.EmailField(max_length=254)),
                        ('role', models.CharField(choices=[('owner', 'Owner'), ('billing', 'Billing'), ('member', 'Member')], default='member', max_length=8)),
                        ('key_hash', models.CharField(max_length=64, unique=True)),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('expires_at', models.DateTimeField()),
                        ('accepted_at', models.DateTimeField(blank=True, null=True)),
                        ('revoked_at', models.DateTimeField(blank=True, null=True)),
                        ('accepted_by', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
                        ('invited_by', models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
                        ('team', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='invitations', to='accounts.team')),
                    ],
                    options={
                        'db_table': 'marketplace_invitation',
                        'ordering': ['-created_at', '-id'],
                        'constraints': [models.CheckConstraint(condition=models.Q(('accepted_at__isnull', True), ('revoked_at__isnull', True), _connector='OR'), name='invitation_accepted_or_revoked')],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
