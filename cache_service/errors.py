"""Errors of the KV cache a user or an operator can act on.

`cache_service` imports nothing else of ours, so it has its own hierarchy; the root CLI catches
`CacheError` and prints its one-line message, exiting with `exit_code` (2 bad input, 3 the
environment lacks something, such as a reachable Redis). A cache *miss* is never an exception
(STYLE.md rule 10): corrupt or misfiled blocks raise `CorruptBlock` inside the codec and the store
turns that into a miss and a counted metric.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class: the message is one line naming the field/value and what was expected."""

    exit_code = 2


class CacheConfigError(CacheError):
    """Bad configuration: an unknown URL scheme, a bad capacity, a namespace with forbidden
    characters, Redis credentials that the server rejects."""

    exit_code = 2


class InvalidBlock(CacheError):
    """A caller handed the store bytes that are not a valid encoded block for the given key."""

    exit_code = 2


class CacheUnavailable(CacheError):
    """A tier the caller asked for explicitly cannot be reached (e.g. Redis down)."""

    exit_code = 3


class CorruptBlock(CacheError):
    """Stored bytes failed verification (magic, header, length, checksum or header key).

    `reason` is a short label used as the metric label: header, truncated, checksum, key_mismatch,
    decompress.
    """

    exit_code = 1

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
