"""A circuit breaker for a remote tier: fail fast while the backend is down, probe, recover.

States: closed (calls go through) -> open after `failure_threshold` consecutive failures (calls are
refused at once for `cooldown_s`) -> half-open (one probe call goes through; success closes the
breaker, failure re-opens it for another cool-down). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cache_service.errors import CacheConfigError


class CircuitBreaker:
    """Counts consecutive failures; `allow()` says whether a call may go to the backend now."""

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        cooldown_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        if failure_threshold < 1 or cooldown_s <= 0:
            raise CacheConfigError(
                f"failure_threshold={failure_threshold} must be >= 1 and "
                f"cooldown_s={cooldown_s} > 0"
            )
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._on_change = on_change
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        """True while calls are refused (open, or half-open with a probe in flight)."""
        with self._lock:
            return self._opened_at is not None

    def allow(self) -> bool:
        """True if a call may proceed: closed, or the single probe of a half-open breaker."""
        with self._lock:
            if self._opened_at is None:
                return True
            if self._probing or self._clock() - self._opened_at < self.cooldown_s:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            was_open = self._opened_at is not None
            self._failures = 0
            self._opened_at = None
            self._probing = False
        if was_open and self._on_change is not None:
            self._on_change(True)

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            opened = False
            if self._probing or (
                self._opened_at is None and self._failures >= self.failure_threshold
            ):
                opened = self._opened_at is None
                self._opened_at = self._clock()
                self._probing = False
        if opened and self._on_change is not None:
            self._on_change(False)

    def trip(self) -> None:
        """Open now (e.g. the backend was unreachable at start)."""
        with self._lock:
            opened = self._opened_at is None
            self._opened_at = self._clock()
            self._probing = False
        if opened and self._on_change is not None:
            self._on_change(False)
