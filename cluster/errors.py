"""Errors a user can act on.

Every command maps them to one line on stderr and an exit status (DESIGN.md, "Conventions for every
command"): 1 a check failed, 2 bad input, 3 the environment is missing something. Internal bugs stay
ordinary exceptions so they keep their traceback. `cluster` is the bottom layer, so `placement`,
`actors` and `deploy` raise these too; `cache_service` stands alone and has its own.
"""

from __future__ import annotations


class MoeError(Exception):
    """Base class: the message is one line naming the file/field/value and what was expected."""

    exit_code = 2


class InputError(MoeError):
    """Bad input: a missing file, invalid JSON/YAML, a missing or mistyped field, contradictory flags."""

    exit_code = 2


class CheckFailed(MoeError):
    """A check ran and failed (validate, adapt, a bench goal, an incomplete nccl-tests run)."""

    exit_code = 1


class EnvironmentMissing(MoeError):
    """The environment lacks something the command needs (no Redis, no GPU, no Ray cluster)."""

    exit_code = 3
