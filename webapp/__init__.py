"""The Nereus web service: Django + Channels + Celery around the runtime."""

# Load the Celery app with Django so that tasks enqueued from the web process use its settings.
from webapp.celery import app as celery_app

__all__ = ["celery_app"]
