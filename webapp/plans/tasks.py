"""Celery tasks of the plans app: thin wrappers over services."""

from celery import shared_task

from webapp.plans import services


@shared_task(name="plans.expire", ignore_result=True)
def proposals_expire() -> int:
    """Periodic (Celery beat): waiting proposals past their deadline are marked expired, so the
    Approvals page and the API stop offering them even when no driver is left to expire its own
    (the job keeps its plan either way)."""
    return services.proposals_expire_overdue()
