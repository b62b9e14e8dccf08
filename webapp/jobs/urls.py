from django.urls import path

from webapp.jobs import views

app_name = "jobs"
urlpatterns = [
    path("", views.job_list, name="list"),
    path("new/", views.job_new, name="new"),
    path("new/preview/", views.job_preview_view, name="preview"),
    path("cancel/", views.job_bulk_cancel, name="bulk-cancel"),
    path("<int:job_id>/", views.job_detail, name="detail"),
    path("<int:job_id>/cancel/", views.job_cancel, name="cancel"),
    path("<int:job_id>/pool/", views.job_pool, name="pool"),
]
