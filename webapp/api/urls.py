from django.urls import path

from webapp.api import jobs, plans, projects, proposals

app_name = "api"
urlpatterns = [
    path("jobs/", jobs.JobListCreateApi.as_view(), name="job-list"),
    path("jobs/<int:job_id>/", jobs.JobDetailApi.as_view(), name="job-detail"),
    path("jobs/<int:job_id>/cancel/", jobs.JobCancelApi.as_view(), name="job-cancel"),
    path("jobs/<int:job_id>/pool/", jobs.JobPoolApi.as_view(), name="job-pool"),
    path("jobs/<int:job_id>/events/", jobs.JobEventsApi.as_view(), name="job-events"),
    path("jobs/<int:job_id>/artifacts/", jobs.JobArtifactsApi.as_view(), name="job-artifacts"),
    path(
        "jobs/<int:job_id>/artifacts/<str:artifact>/<str:name>",
        jobs.JobArtifactFileApi.as_view(),
        name="job-artifact-file",
    ),
    path("jobs/<int:job_id>/override/", proposals.JobOverrideApi.as_view(), name="job-override"),
    path("jobs/<int:job_id>/plans/", plans.JobPlansApi.as_view(), name="job-plans"),
    path(
        "jobs/<int:job_id>/transitions/", plans.JobTransitionsApi.as_view(), name="job-transitions"
    ),
    path(
        "transitions/<int:transition_id>/",
        plans.TransitionDetailApi.as_view(),
        name="transition-detail",
    ),
    path("proposals/", proposals.ProposalListApi.as_view(), name="proposal-list"),
    path(
        "proposals/<int:proposal_id>/",
        proposals.ProposalDetailApi.as_view(),
        name="proposal-detail",
    ),
    path(
        "proposals/<int:proposal_id>/approve/",
        proposals.ProposalApproveApi.as_view(),
        name="proposal-approve",
    ),
    path(
        "proposals/<int:proposal_id>/reject/",
        proposals.ProposalRejectApi.as_view(),
        name="proposal-reject",
    ),
    path("projects/", projects.ProjectListApi.as_view(), name="project-list"),
    path("projects/<slug:slug>/tokens/", projects.TokenListCreateApi.as_view(), name="token-list"),
    path(
        "projects/<slug:slug>/tokens/<int:token_id>/revoke/",
        projects.TokenRevokeApi.as_view(),
        name="token-revoke",
    ),
]
