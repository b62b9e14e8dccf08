from django.urls import path

from webapp.api import jobs, projects

app_name = "api"
urlpatterns = [
    path("jobs/", jobs.JobListCreateApi.as_view(), name="job-list"),
    path("jobs/<int:job_id>/", jobs.JobDetailApi.as_view(), name="job-detail"),
    path("jobs/<int:job_id>/cancel/", jobs.JobCancelApi.as_view(), name="job-cancel"),
    path("jobs/<int:job_id>/events/", jobs.JobEventsApi.as_view(), name="job-events"),
    path("projects/", projects.ProjectListApi.as_view(), name="project-list"),
    path("projects/<slug:slug>/tokens/", projects.TokenListCreateApi.as_view(), name="token-list"),
    path(
        "projects/<slug:slug>/tokens/<int:token_id>/revoke/",
        projects.TokenRevokeApi.as_view(),
        name="token-revoke",
    ),
]
