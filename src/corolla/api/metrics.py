"""The API server's Prometheus metrics, in a registry of their own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "corolla_api_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "corolla_api_prompt_tokens", "prompt tokens processed", registry=self.registry
        )
        self.generated_tokens = Counter(
            "corolla_api_generated_tokens", "tokens generated (all choices)", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "corolla_api_time_to_first_token_seconds",
            "from a request's arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_per_token = Histogram(
            "corolla_api_time_per_output_token_seconds",
            "between consecutive generated tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.active_requests = Gauge(
            "corolla_api_active_requests", "generations running now", registry=self.registry
        )
        self.errors = Counter(
            "corolla_api_errors",
            "requests that ended in an error, by kind",
            ["kind"],
            registry=self.registry,
        )
        self.aborted = Counter(
            "corolla_api_aborted_requests",
            "generations cancelled because the client went away",
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
