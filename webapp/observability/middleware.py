"""Request latency by route and method, for ``nereus_http_request_duration_seconds``.

The route is the URL pattern that matched (``api/v1/jobs/<int:pk>/``), never the raw path, so the
number of label values stays bounded whatever clients request."""

from __future__ import annotations

import time

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
