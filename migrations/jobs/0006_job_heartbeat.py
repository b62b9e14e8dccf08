from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0005_project_required"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="heartbeat_at",
            field=models.DateTimeField(
                blank=True,
                help_text="The current epoch's driver was last alive then; stale means lost.",
                null=True,
            ),
        ),
    ]
