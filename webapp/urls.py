from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from webapp.api.exceptions import not_found
from webapp.health import healthz
from webapp.observability.metrics import metrics_view

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="jobs:list", permanent=False)),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("jobs/", include("webapp.jobs.urls")),
    path("approvals/", include("webapp.plans.urls")),
    path("projects/", include("webapp.projects.urls")),
    path("admin/", admin.site.urls),
    path("api/v1/", include("webapp.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/schema/ui/", SpectacularSwaggerView.as_view(url_name="schema"), name="schema-ui"),
    # Any other path under /api/ answers in the API's error shape, in debug mode too.
    re_path(r"^api/", not_found),
]

handler404 = "webapp.api.exceptions.not_found"
handler500 = "webapp.api.exceptions.server_error"
