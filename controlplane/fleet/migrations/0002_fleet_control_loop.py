# Workers register by name with one fleet-wide token (issue 5): per-worker token hashes go away,
# heartbeats move to the live cache, and replicas record why they failed.

import django.core.validators
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("fleet", "0001_initial"),
    ]

    operations = [
        migrations.RemoveField(model_name="worker", name="token_hash"),
        migrations.RenameField(model_name="worker", old_name="host", new_name="name"),
        migrations.AlterField(
            model_name="worker",
            name="name",
            field=models.CharField(
                max_length=80, unique=True,
                validators=[django.core.validators.RegexValidator(
                    "^[A-Za-z0-9][A-Za-z0-9._-]*$", "Use letters, digits and . _ - only.")],
            ),
        ),
        migrations.AlterField(model_name="worker", name="queue_name", field=models.CharField(max_length=100, unique=True)),
        migrations.RemoveField(model_name="worker", name="last_heartbeat_at"),
        migrations.AddField(
            model_name="worker", name="state_changed_at",
            field=models.DateTimeField(default=django.utils.timezone.now),
        ),
        migrations.AddField(
            model_name="worker", name="advertise_host",
            field=models.CharField(
                default="127.0.0.1", max_length=255,
                help_text="Host name or address the replicas' endpoints are reached at."),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="worker", name="device",
            field=models.CharField(choices=[("cuda", "CUDA"), ("cpu", "CPU")], default="cuda", max_length=10),
        ),
        migrations.AddField(model_name="worker", name="cpu_memory_total_bytes", field=models.PositiveBigIntegerField(default=0)),
        migrations.AddField(model_name="worker", name="cpu_cores", field=models.PositiveIntegerField(default=0)),
        migrations.AddField(model_name="worker", name="version", field=models.CharField(blank=True, max_length=50)),
        migrations.AlterField(
            model_name="worker", name="state",
            field=models.CharField(
                choices=[("online", "Online"), ("draining", "Draining"), ("lost", "Lost"), ("offline", "Offline")],
                default="online", max_length=20),
        ),
        migrations.AlterModelOptions(name="worker", options={"ordering": ["name"]}),
        migrations.AddField(model_name="gpu", name="present", field=models.BooleanField(default=True)),
        migrations.AddField(
            model_name="replica", name="failure",
            field=models.CharField(
                blank=True, default="", max_length=20,
                choices=[("", "None"), ("load", "Load failed"), ("crashed", "Crashed"),
                         ("worker_lost", "Worker lost"), ("not_acknowledged", "Not acknowledged"),
                         ("vanished", "Vanished")]),
        ),
        migrations.AddIndex(
            model_name="replica",
            index=models.Index(fields=["worker", "state"], name="fleet_repli_worker__b7d30b_idx"),
        ),
    ]
