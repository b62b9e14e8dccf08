"""The Celery application; configuration comes from Django settings (CELERY_*)."""

import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("nereus")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["webapp.jobs", "webapp.plans"])


@signals.worker_init.connect
def _check_configuration(**_kwargs) -> None:
    """Refuse to start a worker whose configuration cannot work (webapp/startup.py)."""
    from webapp import startup

    startup.check_or_exit("celery worker")
