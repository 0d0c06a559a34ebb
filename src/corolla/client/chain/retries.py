"""How many failed servers one request may replace: the same budget for a step and for a training pass."""

from __future__ import annotations

import time
from collections.abc import Callable

from corolla.config import ClientConfig
from corolla.errors import ServerUnavailable, counted


class RetryBudget:
    """At most `max_retries` failed servers replaced, and none after `failover_timeout`."""

    def __init__(self, config: ClientConfig, clock: Callable[[], float] = time.monotonic):
        self.max_retries = config.max_retries
        self.clock = clock  # seconds (corolla.sim spends budgets under a simulated clock)
        self.deadline = clock() + config.failover_timeout
        self.failures = 0

    def spend(self, error: Exception) -> None:
        """One more server failed with `error`; ServerUnavailable if the budget is spent."""
        self.failures += 1
        if self.failures > self.max_retries or self.clock() > self.deadline:
            raise ServerUnavailable(
                f"giving up after {counted(self.failures, 'failed server')}; last: {error}"
            ) from error
