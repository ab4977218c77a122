# The advisor's models, taken over from the marketplace app (marketplace.0017 drops them from its
# state): created in state only, on the tables and constraints marketplace.0004 created.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('marketplace', '0017_advisor_to_own_app'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='AdvisorCheck',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('card', models.SlugField(max_length=40)),
                        ('gpus', models.PositiveIntegerField()),
                        ('estimated_step_s', models.FloatField()),
                        ('measured_step_s', models.FloatField()),
                        ('estimated_tokens_per_s', models.FloatField()),
                        ('measured_tokens_per_s', models.FloatField()),
                        ('estimated_peak_gb', models.FloatField()),
                        ('measured_peak_gb', models.FloatField(blank=True, null=True)),
                        ('prior_before', models.FloatField()),
                        ('prior_after', models.FloatField()),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('rental', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='advisor_check', to='marketplace.rental')),
                    ],
                    options={
                        'db_table': 'marketplace_advisorcheck',
                        'ordering': ['-created_at'],
                        'constraints': [models.CheckConstraint(condition=models.Q(('estimated_step_s__gt', 0), ('measured_step_s__gt', 0)), name='check_steps_positive')],
                    },
                ),
                migrations.CreateModel(
                    name='AdvisorPrior',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('mfu', models.FloatField()),
                        ('runs', models.PositiveIntegerField(default=0)),
                        ('updated_at', models.DateTimeField(auto_now=True)),
                        ('card', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='advisor_prior', to='marketplace.gpumodel')),
                    ],
                    options={
                        'db_table': 'marketplace_advisorprior',
                        'constraints': [models.CheckConstraint(condition=models.Q(('mfu__gt', 0), ('mfu__lte', 1)), name='prior_mfu_range')],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
