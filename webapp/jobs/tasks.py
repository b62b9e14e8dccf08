"""Celery tasks: thin wrappers over services, enqueued on commit."""

from celery import shared_task

from webapp.jobs import services


@shared_task(name="jobs.drive", acks_late=True, reject_on_worker_lost=True, ignore_result=False)
def job_drive(job_id: int) -> str:
    """Run a job's driver. Late acknowledgement: a worker lost mid-job gets the task redelivered,
    and the delivery count in the database ends a job that keeps killing its worker."""
    return services.job_drive(job_id=job_id)
