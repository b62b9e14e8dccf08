from django.urls import path

from webapp.plans import views

app_name = "plans"
urlpatterns = [
    path("", views.approvals_inbox, name="inbox"),
    path("<int:proposal_id>/decide/", views.proposal_decide_view, name="decide"),
]
