"""The errors of `actors/comm`: a collective that timed out, was aborted, or failed."""


class CommError(RuntimeError):
    """A collective did not complete; the world must be rebuilt with a fresh rendezvous."""


class CollectiveTimeout(CommError):
    """A peer did not arrive within the group's timeout (dead, hung or absent)."""


class CommAborted(CommError):
    """A control call aborted the worker while it waited on a collective."""
