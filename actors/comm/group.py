"""One process group of one parallel axis: its ranks, a timeout, an abort switch.

Every collective of `actors/comm` goes through `Group.wait`, so a dead or absent peer turns into
`CollectiveTimeout` after `timeout_s` and a control call (`abort`) turns a blocked step into
`CommAborted` at once, instead of hanging the worker. A group of one rank has no process group
(`pg is None`) and the axis modules return at once.

The world itself is built by `init_world` from a `Rendezvous` handed out by the driver: a fresh
TCP store address and world id at every (re)build, so ranks of an old world can never join a new
one.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.comm import local_transport
from actors.comm.errors import CollectiveTimeout, CommAborted, CommError
from actors.comm.local_transport import LocalTransport, P2PWork

WAIT_SLICE = timedelta(milliseconds=20)
"""How long one blocking wait on a gloo collective lasts before the abort flag and the deadline
are checked again."""


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """`tcp://host:port` with a port the OS just reported free (bound and released)."""
    return f"tcp://{host}:{_free_port(host)}"


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where the ranks of one world meet; a fresh one for every (re)build."""

    address: str
    """`tcp://host:port` of the TCP store that rank 0 hosts."""
    world_id: str
    """Prefix of every store key, unique per build."""
    backend: str = "gloo"
    """"gloo" (CPU) or "nccl" (CUDA)."""
    timeout_s: float = 60.0
    """Seconds a rendezvous or collective may wait for its peers."""
    external_store: bool = False
    """The TCP store at `address` is hosted by a process outside the world (`run_ranks`' parent,
    `host_store`): every rank, rank 0 too, connects to it as a client."""

    @classmethod
    def fresh(
        cls, *, backend: str = "gloo", host: str = "127.0.0.1", timeout_s: float = 60.0
    ) -> Rendezvous:
        """A new address on a free port of `host` and a new world id."""
        return cls.hosted(host, _free_port(host), backend=backend, timeout_s=timeout_s)

    @classmethod
    def hosted(
        cls,
        host: str,
        port: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        external_store: bool = False,
    ) -> Rendezvous:
        """A new world id at `host:port`; given the port of the store rank 0's process already
        hosts (`host_store`), there is no window between choosing a free port and binding it
        in which another socket can take it (`fresh` has one)."""
        return cls(
            address=f"tcp://{host}:{port}",
            world_id=uuid.uuid4().hex[:12],
            backend=backend,
            timeout_s=timeout_s,
            external_store=external_store,
        )

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.removeprefix("tcp://").rpartition(":")
        return host, int(port)


@dataclass(eq=False, kw_only=True)
class Group:
    """Ranks of one axis group seen from one member.

    `ranks` are global ranks of the world; `index` is this member's position in them (the rank
    an axis module uses as `tp_rank`, `ep_rank`, stage). `pg` is None when the group has one rank.
    """

    axis: str
    ranks: tuple[int, ...]
    index: int
    pg: dist.ProcessGroup | None
    timeout_s: float = 60.0
    backend: str = "gloo"
    aborted: threading.Event = field(default_factory=threading.Event)
    waited_s: float = 0.0
    """Seconds this member spent blocked in `wait` (communication not hidden by compute)."""
    local: LocalTransport | None = None
    """Set when every member is on this host and the backend is gloo: the collectives and the
    point-to-point sends go over Unix sockets (`actors/comm/local_transport.py`)."""
    hosts: tuple[str, ...] = ()
    """On the world group (gloo): each rank's `local_transport.host_id()`."""
    ranks_on_host: int = 1
    """On the world group: how many of its ranks share this rank's host (gloo; 1 otherwise)."""
    store: dist.Store | None = field(default=None, repr=False)
    """On the world group, while local transports may be connected: the world's store."""

    @classmethod
    def single(cls, axis: str, rank: int = 0) -> Group:
        """The world-size-1 group: every collective returns its input."""
        return cls(axis=axis, ranks=(rank,), index=0, pg=None)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def wait(self, work, what: str, *, p2p: bool = False) -> None:
        """Block until `work` completes; raise on timeout, abort, or a peer's failure.

        gloo runs collectives on its own threads; `wait` is a condition-variable wait cut into
        `WAIT_SLICE`s, so this thread wakes at completion (no polling delay: a sleep-and-poll
        loop added ~90 us to a ~130 us collective) and between slices notices an abort. gloo's
        point-to-point works only complete inside `wait`, so `p2p=True` waits on a helper
        thread instead. NCCL's `wait` only orders the CUDA stream; its watchdog enforces the
        process-group timeout and `abort` tears the communicator down.
        """
        if work is None:
            return
        if isinstance(work, P2PWork):
            self._waited(work.wait, what)
            return
        start = time.monotonic()
        try:
            self._wait(work, what, p2p)
        finally:
            self.waited_s += time.monotonic() - start

    def _waited(self, call, *args):
        """`call(*args)` (a local transport's collective), its time counted as waited."""
        start = time.monotonic()
        try:
            return call(*args)
        finally:
            self.waited_s += time.monotonic() - start

    def _wait(self, work, what: str, p2p: bool) -> None:
        if self.backend == "nccl":
            work.wait()
            return
        if p2p:
            self._wait_on_thread(work, what)
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError as exc:
                if not work.is_completed():  # only this slice ended: the collective runs on
                    self._check(what, deadline)
                    continue
                if "imed out" in str(exc):  # the backend's own timeout fired before our deadline
                    raise CollectiveTimeout(
                        f"{what} on {self.axis} group {self.ranks} (rank {self.ranks[self.index]}) "
                        f"did not complete within {self.timeout_s:g} s"
                    ) from exc
                raise CommError(f"{what} on {self.axis} group {self.ranks} failed: {exc}") from exc

    def _check(self, what: str, deadline: float) -> None:
        if self.aborted.is_set():
            raise CommAborted(f"{what} on {self.axis} group {self.ranks} aborted")
        if time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"{what} on {self.axis} group {self.ranks} (rank {self.ranks[self.index]}) "
                f"did not complete within {self.timeout_s:g} s"
            )

    def _wait_on_thread(self, work, what: str) -> None:
        done = threading.Event()
        failure: list[RuntimeError] = []

        def waiter() -> None:
            try:
                work.wait(timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=waiter, name=f"wait-{what}", daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not done.wait(0.02):
            self._check(what, deadline + 1.0)
        if failure:
            if "imed out" in str(failure[0]):
                raise CollectiveTimeout(
                    f"{what} on {self.axis} group {self.ranks} (rank {self.ranks[self.index]}) "
                    f"did not complete within {self.timeout_s:g} s"
                ) from failure[0]
            raise CommError(f"{what} on {self.axis} group {self.ranks} failed: {failure[0]}")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group, in place; returns it."""
        if self.pg is None:
            return tensor
        if self.local is not None:
            return self._waited(self.local.all_reduce, tensor)
        self.wait(dist.all_reduce(tensor, group=self.pg, async_op=True), "all_reduce")
        return tensor

    def all_to_all(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
    ) -> torch.Tensor:
        """`all_to_all_single` with per-rank row counts along dim 0; returns `output`."""
        if self.pg is None:
            output.copy_(tensor)
            return output
        self.wait(self.start_all_to_all(output, tensor, output_splits, input_splits), "all_to_all")
        return output

    def start_all_to_all(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
    ):
        """Start `all_to_all_single` (group of 2+); returns the work to `wait` on (None: done
        already, over the local transport)."""
        if self.local is not None:
            self._waited(self.local.all_to_all, output, tensor, output_splits, input_splits)
            return None
        return dist.all_to_all_single(
            output, tensor, output_splits, input_splits, group=self.pg, async_op=True
        )

    def exchange_counted(self, counts, rows, recv_counts, recv_rows, what: str) -> None:
        """`LocalTransport.exchange_counted` (a group with a local transport only): counts and
        rows to every peer in one round, the received rows sized from the received counts."""
        self._waited(self.local.exchange_counted, counts, rows, recv_counts, recv_rows, what)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's `tensor` (same shape everywhere), in group order."""
        if self.pg is None:
            return [tensor]
        if self.local is not None:
            return self._waited(self.local.all_gather, tensor)
        out = [torch.empty_like(tensor) for _ in self.ranks]
        self.wait(dist.all_gather(out, tensor, group=self.pg, async_op=True), "all_gather")
        return out

    def isend(self, tensor: torch.Tensor, dst_index: int, tag: int = 0):
        """Start sending `tensor` to group member `dst_index`; returns the work to `wait`.
        Over the local transport the messages between two members match in posting order
        (`tag` unused), and `tensor` may be empty (a zero-byte message)."""
        if self.local is not None:
            return self.local.isend(tensor, dst_index)
        return dist.isend(tensor, group=self.pg, group_dst=dst_index, tag=tag)

    def irecv(self, tensor: torch.Tensor, src_index: int, tag: int = 0):
        """Start receiving into `tensor` from group member `src_index`; returns the work."""
        if self.local is not None:
            return self.local.irecv(tensor, src_index)
        return dist.irecv(tensor, group=self.pg, group_src=src_index, tag=tag)

    def barrier(self) -> None:
        """Wait until every member arrives (an all-reduce of one element)."""
        self.all_reduce(torch.zeros(1, device=self.device))

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """A TCP store server on a port the OS picks, in this process (rank 0's): `init_world` of
    rank 0 at `Rendezvous.hosted(host, store.port)` joins it (a multi-tenant store), so the
    port is bound before anyone is told it. Keep the returned store until that build is done."""
    return dist.TCPStore(
        host, 0, None, is_master=True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False, multi_tenant=True, master_listen_fd=_listen_fd(host, 0),
    )  # fmt: skip


def _listen_fd(host: str, port: int) -> int:
    """A listening socket on `host:port` (port 0: one the OS picks), handed to torch's TCP store
    server as `master_listen_fd`: given only a host, the store listens on every interface."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024).detach()


def _free_listen_fd(host: str, port: int) -> int | None:
    """`_listen_fd`, or None where the port is taken: by the server `host_store` runs in this
    process, which a multi-tenant master store joins (anyone else's makes the store fail)."""
    try:
        return _listen_fd(host, port)
    except OSError:
        return None


def init_world(
    rendezvous: Rendezvous, *, rank: int, world_size: int, aborted: threading.Event | None = None
) -> Group:
    """Join the world of `rendezvous` as `rank`; returns the world group.

    Step 1: rank 0 hosts a TCP store at the rendezvous address; the others connect to it.
    Step 2: every key lives under the world id, so a stale rank of an earlier build finds
    nothing. Step 3: the default process group is built over that store with the timeout.
    """
    aborted = aborted or threading.Event()
    if world_size == 1:
        return Group(axis="world", ranks=(0,), index=0, pg=None, aborted=aborted)
    timeout = timedelta(seconds=rendezvous.timeout_s)
    host, port = rendezvous.host_port
    master = rank == 0 and not rendezvous.external_store
    store = dist.TCPStore(
        host, port, world_size, is_master=master, timeout=timeout, wait_for_workers=False,
        multi_tenant=master,  # rank 0 joins the server its process hosts, if `host_store` ran
        master_listen_fd=_free_listen_fd(host, port) if master else None,
    )  # fmt: skip
    prefixed = dist.PrefixStore(f"moe/{rendezvous.world_id}/", store)
    dist.init_process_group(
        rendezvous.backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout
    )
    world = Group(
        axis="world",
        ranks=tuple(range(world_size)),
        index=rank,
        pg=dist.group.WORLD,
        timeout_s=rendezvous.timeout_s,
        backend=rendezvous.backend,
        aborted=aborted,
    )
    # Step 4 (gloo): every rank's host; members of a group on one host talk over Unix sockets.
    if rendezvous.backend == "gloo":
        prefixed.set(f"host/{rank}", local_transport.host_id())
        world.hosts = tuple(prefixed.get(f"host/{r}").decode() for r in range(world_size))
        world.ranks_on_host = world.hosts.count(world.hosts[rank])
        if local_transport.enabled():
            world.store = prefixed
            world.local = _connect_local(world, "world", world.ranks, rank)
    return world


def _connect_local(world: Group, axis: str, ranks: tuple[int, ...], rank: int):
    """The local transport of group `ranks` (every member calls this), or None when the world
    keeps no store (NCCL, or turned off) or the members are on more than one host."""
    if world.store is None or len({world.hosts[r] for r in ranks}) != 1:
        return None
    member = local_transport.Member(
        index=ranks.index(rank),
        size=len(ranks),
        label=f"{axis} group {ranks}",
        timeout_s=world.timeout_s,
        aborted=world.aborted,
        spin_s=local_transport.spin_for(world.ranks_on_host),
    )
    return LocalTransport.connect(world.store, f"local/{axis}/{'-'.join(map(str, ranks))}", member)


def new_axis_group(
    world: Group, axis: str, groups: tuple[tuple[int, ...], ...], rank: int
) -> Group:
    """The group of `axis` containing `rank`; every rank must call this with the same `groups`.

    torch.distributed requires every member of the world to take part in creating every
    subgroup, in the same order; groups of one rank get no process group.
    """
    mine: Group | None = None
    for ranks in groups:
        pg = None
        if len(ranks) > 1 and world.pg is not None:
            pg = dist.new_group(
                list(ranks), timeout=timedelta(seconds=world.timeout_s), backend=world.backend
            )
        if rank in ranks:
            mine = Group(
                axis=axis,
                ranks=ranks,
                index=ranks.index(rank),
                pg=pg,
                timeout_s=world.timeout_s,
                backend=world.backend,
                aborted=world.aborted,
                local=_connect_local(world, axis, ranks, rank) if pg is not None else None,
            )
    if mine is None:
        raise ValueError(f"rank {rank} is in no {axis} group of {groups}")
    return mine


def destroy_world() -> None:
    """Tear down the local transports, the default process group and its subgroups (no-op
    when none exists)."""
    local_transport.close_all()
    if dist.is_initialized():
        dist.destroy_process_group()
