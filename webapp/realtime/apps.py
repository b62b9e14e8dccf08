from django.apps import AppConfig


class RealtimeConfig(AppConfig):
    """Live delivery of events: the database-backed channel layer of the embedded default."""

    name = "webapp.realtime"
    label = "realtime"
