"""Celery tasks: thin wrappers over services, enqueued on commit."""

from celery import shared_task

from webapp.jobs import services


@shared_task(name="jobs.drive", acks_late=True, reject_on_worker_lost=True, ignore_result=False)
def job_drive(job_id: int, epoch: int | None = None) -> str:
    """Run a job's driver. Late acknowledgement: a task whose worker was lost is delivered again;
    it takes the job over only if the job's driver is silent (``services._claim_driver``), and the
    delivery count in the database (deliveries in a row that did not move the job on) ends a job
    that keeps killing its worker. ``epoch``: set by ``jobs.reap`` for the driver that replaces a
    lost one, or for a pending job's task sent again."""
    return services.job_drive(job_id=job_id, epoch=epoch)


@shared_task(name="jobs.reap", ignore_result=True)
def jobs_reap() -> list[int]:
    """Periodic (Celery beat): jobs whose driver went silent get a new driver, which resumes from
    the job's last checkpoint; jobs pending too long (their task lost) get their task again."""
    return services.jobs_reap_lost()
