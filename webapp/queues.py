"""The Celery queues. A job's driver holds a worker's pool process for as long as the job runs
(hours), and a worker whose processes all drive jobs takes no other message: the periodic tasks
that rescue jobs (a lost driver's takeover, a lost task sent again, overdue proposals) have a queue
of their own, consumed by a worker that never drives a job (``nereus.processes``: the maintenance
worker). On the drivers' queue they would wait behind the very jobs they are to rescue."""

DRIVERS = "celery"  # Celery's default queue: jobs.drive
MAINTENANCE = "nereus.maintenance"  # jobs.reap, plans.expire
