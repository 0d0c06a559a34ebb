"""The API server's Prometheus metrics, in a registry of their own (one per app)."""

from __future__ import annotations

from typing import Any

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
        self.cached_tokens = Counter(
            "corolla_api_cached_prompt_tokens",
            "prompt tokens the servers held already (reused prefixes): neither sent nor computed again",
            registry=self.registry,
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

    def watch_client(self, client: Any) -> None:
        """What the swarm client (client/client.py) found of servers, read when scraped: spot checks by
        result, servers caught computing wrong outputs, DHT records refused."""
        checks = Gauge(
            "corolla_api_spot_checks",
            "spot checks of servers' outputs so far, by result",
            ["result"],
            registry=self.registry,
        )
        checker = client.checker
        for result in ("passed", "failed", "unchecked", "third opinions"):
            checks.labels(result).set_function(lambda r=result, c=checker: c.counts[r] if c else 0)
        faulty = Gauge(
            "corolla_api_faulty_servers",
            "servers caught computing wrong outputs (banned for good)",
            registry=self.registry,
        )
        faulty.set_function(lambda: len(client.swarm.bans.faulty))
        refused = Gauge(
            "corolla_api_refused_records",
            "unsigned or malformed DHT records read (ignored)",
            registry=self.registry,
        )
        refused.set_function(lambda: sum(client.swarm.view.rejected_records.values()))
        prefixes = client.prefixes
        hit_rate = Gauge(
            "corolla_api_prefix_hit_rate",
            "share of generations that started from a prefix the servers held (reused prefixes)",
            registry=self.registry,
        )
        hit_rate.set_function(lambda: prefixes.stats.hits / max(prefixes.stats.lookups, 1) if prefixes else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
