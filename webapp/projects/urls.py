from django.urls import path

from webapp.projects import views

app_name = "projects"
urlpatterns = [
    path("", views.project_list, name="list"),
    path("<slug:slug>/", views.project_detail, name="detail"),
    path("<slug:slug>/tokens/", views.token_create_view, name="token-create"),
    path("<slug:slug>/tokens/<int:token_id>/revoke/", views.token_revoke_view, name="token-revoke"),
]
