from django.apps import AppConfig


class JobsConfig(AppConfig):
    """Jobs, their state machine and their append-only event logs."""

    name = "webapp.jobs"
    label = "jobs"
