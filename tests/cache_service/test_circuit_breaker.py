"""CircuitBreaker state machine (an injected clock, no sleeping)."""

from __future__ import annotations

import pytest

from cache_service.circuit_breaker import CircuitBreaker
from cache_service.errors import CacheConfigError


def test_opens_after_threshold_probes_after_cooldown_and_recovers():
    now = [0.0]
    changes = []
    breaker = CircuitBreaker(
        failure_threshold=3, cooldown_s=5, clock=lambda: now[0], on_change=changes.append
    )
    for _ in range(2):
        assert breaker.allow()
        breaker.failure()
    assert not breaker.is_open
    breaker.failure()
    assert breaker.is_open and changes == [False]
    assert not breaker.allow()
    now[0] = 5.1
    assert breaker.allow()  # the single probe
    assert not breaker.allow()  # others still refused while it is in flight
    breaker.failure()  # probe failed: open for another cool-down
    assert not breaker.allow()
    now[0] = 10.3
    assert breaker.allow()
    breaker.success()
    assert not breaker.is_open and breaker.allow() and changes == [False, True]


def test_success_resets_the_count_and_bad_settings_are_refused():
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=1)
    breaker.failure()
    breaker.success()
    breaker.failure()
    assert not breaker.is_open
    with pytest.raises(CacheConfigError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(CacheConfigError):
        CircuitBreaker(cooldown_s=0)
