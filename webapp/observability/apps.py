from django.apps import AppConfig


class ObservabilityConfig(AppConfig):
    name = "webapp.observability"
    label = "observability"
    verbose_name = "Observability"
