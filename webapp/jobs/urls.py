from django.urls import path

from webapp.jobs import views

app_name = "jobs"
urlpatterns = [
    path("", views.job_list, name="list"),
    path("<int:job_id>/", views.job_detail, name="detail"),
    path("<int:job_id>/cancel/", views.job_cancel, name="cancel"),
]
