from django.urls import path

from webapp.jobs.consumers import JobEventsConsumer

websocket_urlpatterns = [path("ws/jobs/<int:job_id>/", JobEventsConsumer.as_asgi())]
