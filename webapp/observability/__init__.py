"""Operations: Prometheus metrics at ``/metrics`` and the request-latency middleware."""
