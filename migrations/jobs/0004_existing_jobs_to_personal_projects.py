"""Existing jobs move to their owner's personal project (its admin), so everyone keeps seeing
exactly the jobs they saw before: their own."""

from django.conf import settings
from django.db import migrations


def forwards(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    Project = apps.get_model("projects", "Project")
    Membership = apps.get_model("projects", "Membership")
    User = apps.get_model(settings.AUTH_USER_MODEL)
    owner_ids = Job.objects.filter(project__isnull=True).values_list("owner_id", flat=True)
    for owner in User.objects.filter(pk__in=set(owner_ids)):
        project = Project.objects.filter(personal_for=owner).first()
        if project is None:
            project = Project.objects.create(
                name=f"{owner.username}'s jobs", slug=f"user-{owner.pk}", personal_for=owner
            )
        Membership.objects.update_or_create(user=owner, project=project, defaults={"role": "admin"})
        Job.objects.filter(owner=owner, project__isnull=True).update(project=project)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0003_projects_and_idempotency"),
        ("projects", "0001_initial"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
