from django.apps import AppConfig


class ProjectsConfig(AppConfig):
    """Projects, their members' roles, and project-scoped API tokens."""

    name = "webapp.projects"
    label = "projects"

    def ready(self) -> None:
        from webapp.projects import signals  # noqa: F401  (connects the membership receivers)
