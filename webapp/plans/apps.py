from django.apps import AppConfig


class PlansConfig(AppConfig):
    """A job's plans, the transitions between them, and proposals waiting for a person."""

    name = "webapp.plans"
    label = "plans"
