"""Request latency by route and method, for ``nereus_http_request_duration_seconds``; probes that
reach the web process by its address.

The route is the URL pattern that matched (``api/v1/jobs/<int:pk>/``), never the raw path, so the
number of label values stays bounded whatever clients request."""

from __future__ import annotations

import time

from django.core.exceptions import DisallowedHost

from webapp.observability import metrics

UNMATCHED = "<unmatched>"


class RequestLatencyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        started = time.perf_counter()
        response = self.get_response(request)
        elapsed = time.perf_counter() - started
        match = getattr(request, "resolver_match", None)
        route = (match.route or match.view_name) if match is not None else UNMATCHED
        method = request.method if request.method in _METHODS else "OTHER"
        metrics.HTTP_LATENCY.labels(route=route or UNMATCHED, method=method).observe(elapsed)
        metrics.HTTP_RESPONSES.labels(
            route=route or UNMATCHED, method=method, status=f"{response.status_code // 100}xx"
        ).inc()
        return response


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class ProbeMiddleware:
    """``/healthz`` and ``/metrics`` for callers that name the process by its address.

    A kubelet probe, a Prometheus pod scrape and a container ``HEALTHCHECK`` send the pod's IP or
    ``127.0.0.1`` as the Host, which production's ``ALLOWED_HOSTS`` (the public name) refuses
    with a 400 in the first middleware that asks for the host. For those two paths only, a
    request whose Host is not allowed is answered here, before any middleware that asks, as an
    anonymous caller (``/healthz`` then shows no details; ``/metrics`` still wants its token when
    one is set). A request with an allowed Host goes through the whole stack as any other."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        view = _probe_view(request.path_info)
        if view is not None:
            try:
                request.get_host()
            except DisallowedHost:
                from django.contrib.auth.models import AnonymousUser

                request.user = AnonymousUser()
                return view(request)
        return self.get_response(request)


def _probe_view(path: str):
    if path == "/healthz":
        from webapp.health import healthz

        return healthz
    if path == "/metrics":
        return metrics.metrics_view
    return None
