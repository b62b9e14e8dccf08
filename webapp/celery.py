"""The Celery application; configuration comes from Django settings (CELERY_*)."""

import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

app = Celery("nereus")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["webapp.jobs", "webapp.plans"])


@signals.worker_init.connect
def _check_configuration(sender=None, **_kwargs) -> None:
    """Refuse to start a worker whose configuration cannot work (webapp/startup.py); one that
    consumes the drivers' queue must also run on a Ray node of the cluster."""
    from webapp import queues, startup

    consumed = getattr(getattr(sender, "app", app).amqp.queues, "consume_from", None) or {}
    # No --queues: the default queue, the drivers'.
    startup.check_or_exit("celery worker", drives_jobs=not consumed or queues.DRIVERS in consumed)
