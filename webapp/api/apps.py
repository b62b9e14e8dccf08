from django.apps import AppConfig


class ApiConfig(AppConfig):
    """The versioned REST API (``/api/v1/``): thin views over the services and selectors."""

    name = "webapp.api"
    label = "api"

    def ready(self) -> None:
        from webapp.api import schema  # noqa: F401 - registers the bearer scheme with spectacular
