"""Communication, one module per parallel axis (tp, ep, pp) over `group.Group`; no globals."""

from actors.comm.ep import DispatchHandle, ExpertParallel
from actors.comm.group import (
    CollectiveTimeout,
    CommAborted,
    CommError,
    Group,
    Rendezvous,
    destroy_world,
    init_world,
    new_axis_group,
)
from actors.comm.pp import PipelineParallel
from actors.comm.tp import TensorParallel

__all__ = [
    "CollectiveTimeout",
    "CommAborted",
    "CommError",
    "DispatchHandle",
    "ExpertParallel",
    "Group",
    "PipelineParallel",
    "Rendezvous",
    "TensorParallel",
    "destroy_world",
    "init_world",
    "new_axis_group",
]
