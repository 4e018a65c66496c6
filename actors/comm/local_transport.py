"""Collectives between the members of one group that share a host, over Unix sockets.

A gloo collective between two processes of one machine costs ~120-300 us even for a few hundred
bytes (its TCP pairs and worker threads), and a decode step of a CPU replica with expert
parallelism makes three per MoE layer. Members of a group on one host instead exchange the bytes
directly over one Unix stream socket per pair, from the calling thread: a small message costs one
`send` and one `recv` (~20-40 us here). `Group` routes its collectives (all_to_all, all_gather,
all_reduce, barrier) and its point-to-point sends and receives (pipeline hand-offs, KV block
copies between DP ranks) through a `LocalTransport` when every member is on this host and the
backend is gloo. `MOE_LOCAL_TRANSPORT=0` turns it off.

Point-to-point (`isend` / `irecv`, each returning a `P2PWork` to `wait` on): a send goes into the
socket at once as far as it fits without blocking and the rest when it is waited for (or before
anything else this member sends or receives on the transport); a receive reads nothing until it
is waited for. Messages between two members are matched in posting order (the tag of gloo's
p2p is not needed: the stream keeps the order); a collective on the group first completes the
member's posted sends and receives, so a p2p message must have its receive posted before the
receiver's next collective on that group (else the collective sees it and raises `CommError`). A gloo p2p wait runs on a helper thread beside
gloo's own threads: on a 2-core host each pipeline hand-off costs the receiver ~0.3 ms and the
sender ~0.8 ms of thread wake-ups.

Wire: every message is a 16-byte header (the collective's sequence number, the payload's byte
count) and the payload, a tensor's raw bytes (no pickle). The receiver checks both against what
it expects, so members that disagree about a collective get a `CommError`, never wrong data.

Waiting: first up to `SPIN_S` of non-blocking tries (with `sched_yield`), then `poll` in slices
of `WAIT_SLICE_MS`, between which the group's abort flag and deadline are checked, like
`Group.wait` does for gloo. A closed peer (EOF, reset) is a `CommError`; the
transport is then unusable and the world is rebuilt.

Security: each member listens in a fresh `mkdtemp` directory (mode 0700) on a socket of mode
0600, accepts only peers of its own uid (SO_PEERCRED), and removes the socket once the group is
connected.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.comm.affinity import SPIN_S, usable_cores
from actors.comm.errors import CollectiveTimeout, CommAborted, CommError

HEADER = struct.Struct("<qq")
"""(sequence number, payload bytes); sequence -1 with the member index is the hello."""
P2P_SEQ = 1 << 62
"""Sequence numbers of point-to-point messages: P2P_SEQ + the count of earlier ones between the
same two members in that direction (collectives count from 0 over the whole group)."""
WAIT_SLICE_MS = 20
BUFFER_BYTES = 4 << 20
MAX_BUFFERS = 64
"""Buffers handed to one `sendmsg` at most (well under IOV_MAX)."""
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_OPEN: list[LocalTransport] = []
_OPEN_LOCK = threading.Lock()


def enabled() -> bool:
    return os.environ.get("MOE_LOCAL_TRANSPORT", "1") != "0"


def core_per_rank(ranks_on_host: int) -> bool:
    """Whether the cores this process may use number at least the ranks on its host."""
    return ranks_on_host <= len(usable_cores())  # (the cores from before a rank pinned itself)


def spin_for(ranks_on_host: int) -> float:
    """`SPIN_S` when the host has a core per rank, else 0."""
    return SPIN_S if core_per_rank(ranks_on_host) else 0.0


def private_socket_path(prefix: str, name: str) -> tuple[str, str]:
    """(folder, path): a socket path in a fresh `mkdtemp` folder (mode 0700, this uid's), under
    /tmp when the temp dir's path would not fit `sun_path` (108 bytes with its NUL)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    os.chmod(folder, 0o700)
    path = os.path.join(folder, name)
    if len(path.encode()) >= 108:
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        path = os.path.join(folder, name)
    return folder, path


def host_id() -> str:
    """Where a Unix socket path of this process is reachable: hostname, kernel boot id and mount
    namespace. Processes of one container share all three; two pods on one node (even with the
    node's hostname, as with hostNetwork) have different mount namespaces, so they keep gloo
    instead of failing to find each other's socket."""
    boot = mounts = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with contextlib.suppress(OSError):
        mounts = os.readlink("/proc/self/ns/mnt")
    return f"{socket.gethostname()}/{boot}/{mounts}"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of contiguous CPU tensor `t` (shared with it: receiving writes into it)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("local transport: tensors must be contiguous and on the CPU")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


@dataclass(frozen=True, kw_only=True)
class Member:
    """Who this process is in its group, and how it waits."""

    index: int
    size: int
    label: str
    """For messages: e.g. "ep group (0, 1)"."""
    timeout_s: float
    aborted: threading.Event
    spin_s: float = 0.0


class LocalTransport:
    """One member's sockets to the other members of its group (`index` of `size`)."""

    def __init__(self, peers: dict[int, socket.socket], member: Member) -> None:
        self.peers = peers
        self.index, self.size, self.label = member.index, member.size, member.label
        self.timeout_s, self.aborted, self.spin_s = member.timeout_s, member.aborted, member.spin_s
        self.seq = 0
        self.broken: str | None = None
        self._fd_peer = {sock.fileno(): p for p, sock in peers.items()}
        for sock in peers.values():
            sock.setblocking(False)
        self._outq: dict[int, list[memoryview]] = {p: [] for p in peers}
        """Point-to-point bytes posted to each peer and not yet in its socket, in order."""
        self._sent = dict.fromkeys(peers, 0)
        self._queued = dict.fromkeys(peers, 0)
        """Bytes of point-to-point messages put in each peer's socket / posted to it so far."""
        self._p2p_out = dict.fromkeys(peers, 0)
        self._p2p_in = dict.fromkeys(peers, 0)
        """Point-to-point messages posted to / from each peer so far (their sequence numbers)."""
        self._posted: dict[int, list[P2PWork]] = {p: [] for p in peers}
        """Receives posted from each peer and not yet read, in order."""

    # ---------------------------------------------------------------- setup

    @classmethod
    def connect(cls, store, key: str, member: Member) -> LocalTransport:
        """Meet the other members through `store` (keys under `key`); every member calls this.

        Step 1: listen in a private directory and publish the socket's path.
        Step 2: connect to every lower index and say hello (our index).
        Step 3: accept every higher index, checking its uid and hello; remove the socket.
        """
        index, size, timeout_s = member.index, member.size, member.timeout_s
        folder, path = private_socket_path("moe-local-", "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peers: dict[int, socket.socket] = {}
        try:
            listener.bind(path)
            os.chmod(path, 0o600)
            listener.listen(size)
            store.set(f"{key}/{index}", path)
            for lower in range(index):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout_s)
                sock.connect(store.get(f"{key}/{lower}").decode())
                sock.sendall(HEADER.pack(-1, index))
                peers[lower] = sock
            listener.settimeout(timeout_s)
            uid = os.getuid()
            while len(peers) < size - 1:
                conn, _ = listener.accept()
                conn.settimeout(timeout_s)
                seq, peer = HEADER.unpack(recv_exact(conn, HEADER.size))
                if peer_uid(conn) != uid or seq != -1 or not index < peer < size or peer in peers:
                    conn.close()
                    continue
                peers[peer] = conn
        except BaseException:
            for sock in peers.values():
                sock.close()
            raise
        finally:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        for sock in peers.values():
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)
        transport = cls(peers, member)
        with _OPEN_LOCK:
            _OPEN.append(transport)
        return transport

    def close(self) -> None:
        self.broken = self.broken or "closed"
        for sock in self.peers.values():
            sock.close()
        with _OPEN_LOCK:
            if self in _OPEN:
                _OPEN.remove(self)

    # ---------------------------------------------------------- collectives

    def all_to_all(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
    ) -> torch.Tensor:
        """Rows `input_splits[p]` of `tensor` to member p; rows from p into `output`."""
        row_out = output[0].numel() * output.element_size() if output.shape[0] else 0
        row_in = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
        out_bytes, in_bytes = tensor_bytes(output), tensor_bytes(tensor)
        sends, recvs = {}, {}
        o = i = 0
        for p in range(self.size):
            no, ni = output_splits[p] * row_out, input_splits[p] * row_in
            if p == self.index:
                if no != ni:
                    raise ValueError(f"all_to_all: {ni} bytes to self, {no} expected back")
                out_bytes[o : o + no] = in_bytes[i : i + ni]
            else:
                sends[p], recvs[p] = in_bytes[i : i + ni], out_bytes[o : o + no]
            o, i = o + no, i + ni
        self.exchange(sends, recvs, "all_to_all")
        return output

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's `tensor` (same shape everywhere), in member order."""
        tensor = tensor.contiguous()
        parts = [tensor if p == self.index else torch.empty_like(tensor) for p in range(self.size)]
        payload = tensor_bytes(tensor)
        self.exchange(
            {p: payload for p in self.peers},
            {p: tensor_bytes(parts[p]) for p in self.peers},
            "all_gather",
        )
        return parts

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the members in place, added in member order (the same result everywhere)."""
        parts = self.all_gather(tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        tensor.copy_(total)
        return tensor

    # ------------------------------------------------------- point-to-point

    def isend(self, tensor: torch.Tensor, peer: int) -> P2PWork:
        """Post `tensor` (contiguous, CPU; kept alive until waited for) to member `peer`."""
        self._usable("send")
        data = tensor_bytes(tensor)
        seq, self._p2p_out[peer] = P2P_SEQ + self._p2p_out[peer], self._p2p_out[peer] + 1
        self._outq[peer] += [memoryview(HEADER.pack(seq, len(data))), data]
        self._queued[peer] += HEADER.size + len(data)
        work = P2PWork(self, peer, tensor, end=self._queued[peer])
        try:
            self._push_queued(peer)
        except OSError as exc:
            self.broken = f"broken ({exc})"
            raise CommError(f"send on {self.label} failed: {exc}") from exc
        return work

    def irecv(self, tensor: torch.Tensor, peer: int) -> P2PWork:
        """Post a receive of exactly `tensor`'s bytes from member `peer` (read at `wait`)."""
        self._usable("recv")
        seq, self._p2p_in[peer] = P2P_SEQ + self._p2p_in[peer], self._p2p_in[peer] + 1
        work = P2PWork(self, peer, tensor, seq=seq)
        self._posted[peer].append(work)
        return work

    def complete(self, work: P2PWork, what: str) -> None:
        """Block until `work` is done: a send's bytes are all in the socket, a receive (and
        every receive posted before it from that peer) is read. Pending sends to every peer
        go out meanwhile, so two members waiting on each other's receives never stall."""
        self._usable(what)
        deadline = time.monotonic() + self.timeout_s
        try:
            while not work.done:
                for p in self.peers:
                    if self._outq[p]:
                        self._push_queued(p)
                if work.seq is not None:
                    self._read_posted(work)
                if work.done:
                    break
                poller = select.poll()
                for p, sock in self.peers.items():
                    reading = work.seq is not None and p == work.peer
                    mask = (select.POLLOUT if self._outq[p] else 0) | (
                        select.POLLIN if reading else 0
                    )
                    if mask:
                        poller.register(sock, mask)
                if not poller.poll(WAIT_SLICE_MS):
                    self._check(what, deadline)
        except (OSError, _Desync) as exc:
            self.broken = f"broken ({exc})"
            raise CommError(f"{what} on {self.label} failed: {exc}") from exc

    def _usable(self, what: str) -> None:
        if self.broken is not None:
            raise CommError(f"{what} on {self.label}: the local transport is {self.broken}")

    def _push_queued(self, p: int) -> None:
        """Put as much of the bytes queued for `p` into its socket as fits without blocking."""
        pending = self._outq[p]
        while pending:
            try:
                self._sent[p] += _send_some(self.peers[p], pending)
            except BlockingIOError:
                return

    def _read_posted(self, upto: P2PWork) -> None:
        """Read the receives posted from `upto.peer`, oldest first, until `upto` is done or the
        socket has no more bytes now."""
        posted = self._posted[upto.peer]
        while posted and not upto.done:
            work = posted[0]
            got = {work.peer: work.got}
            head = {work.peer: work.head}
            self._pull(work.peer, work.seq, head, got, {work.peer: work.view})
            if work.peer in got:
                work.got = got[work.peer]
                return
            work.done = True
            posted.pop(0)

    def _flush_p2p(self, what: str) -> None:
        """Before a collective: every posted send out and every posted receive read, so the
        collective's messages are next on every socket."""
        for queue in self._posted.values():
            if queue:
                self.complete(queue[-1], what)
        for p, queue in self._outq.items():
            if queue:
                self.complete(P2PWork(self, p, None, end=self._queued[p]), what)

    # ------------------------------------------------------------- the wire

    def exchange(
        self, sends: dict[int, memoryview], recvs: dict[int, memoryview], what: str
    ) -> None:
        """Send `sends[p]` to and receive `recvs[p]` (exactly that many bytes) from each peer,
        all at once (no order between peers, so no member waits on another's send)."""
        seq = self._next_seq(what, 1)
        out = {p: [memoryview(HEADER.pack(seq, len(b))), b] for p, b in sends.items()}
        self._transfer(out, recvs, seq, what, finish_sends=True)

    def exchange_counted(
        self,
        counts: dict[int, memoryview],
        rows: dict[int, memoryview],
        recv_counts: dict[int, memoryview],
        recv_rows: Callable[[], dict[int, memoryview]],
        what: str,
    ) -> None:
        """Two exchanges in one round: `counts[p]` then `rows[p]` go to each peer at once; once
        every peer's counts are in `recv_counts`, `recv_rows()` gives the buffers the peers'
        rows are read into (sized from those counts). The receiver learns its sizes from the
        stream, so the sender never waits for them: a variable all-to-all costs one wait for
        the slowest peer instead of two (the counts' round, then the rows')."""
        seq = self._next_seq(what, 2)
        out = {
            p: [
                memoryview(HEADER.pack(seq, len(c))),
                c,
                memoryview(HEADER.pack(seq + 1, len(rows[p]))),
                rows[p],
            ]
            for p, c in counts.items()
        }
        self._transfer(out, recv_counts, seq, what, finish_sends=False)
        self._transfer(out, recv_rows(), seq + 1, what, finish_sends=True)

    def _next_seq(self, what: str, count: int) -> int:
        """The next collective's sequence number (`count` of them taken), once every posted
        point-to-point message is through."""
        self._usable(what)
        if any(self._outq.values()) or any(self._posted.values()):
            self._flush_p2p(what)
        seq, self.seq = self.seq, self.seq + count
        return seq

    def _transfer(
        self,
        out: dict[int, list[memoryview]],
        recvs: dict[int, memoryview],
        seq: int,
        what: str,
        *,
        finish_sends: bool,
    ) -> None:
        """Push `out` (bytes per peer, consumed as sent) and read message `seq` of each peer
        into `recvs`; returns once every receive is read and, with `finish_sends`, every send
        is in its socket (else what is left stays in `out` for the next call)."""
        head = {p: bytearray(HEADER.size) for p in recvs}
        got = dict.fromkeys(recvs, 0)
        deadline = time.monotonic() + self.timeout_s
        try:
            for p in list(out):
                self._push(p, out)
            spin_until = time.perf_counter() + self.spin_s
            while got and time.perf_counter() < spin_until:
                for p in list(got):
                    self._pull(p, seq, head, got, recvs)
                if got:
                    os.sched_yield()
            while got or (finish_sends and out):
                poller = select.poll()
                for p, sock in self.peers.items():
                    mask = (select.POLLOUT if p in out else 0) | (select.POLLIN if p in got else 0)
                    if mask:
                        poller.register(sock, mask)
                events = poller.poll(WAIT_SLICE_MS)
                if not events:
                    self._check(what, deadline)
                for fd, ev in events:
                    p = self._fd_peer[fd]
                    if ev & select.POLLOUT and p in out:
                        self._push(p, out)
                    if ev & (select.POLLIN | select.POLLHUP | select.POLLERR) and p in got:
                        self._pull(p, seq, head, got, recvs)
        except (OSError, _Desync) as exc:
            self.broken = f"broken ({exc})"
            raise CommError(f"{what} on {self.label} failed: {exc}") from exc

    def _push(self, p: int, out: dict[int, list[memoryview]]) -> None:
        pending = out[p]
        while pending:
            try:
                _send_some(self.peers[p], pending)
            except BlockingIOError:
                return
        del out[p]

    def _pull(self, p, seq, head, got, recvs) -> None:
        sock = self.peers[p]
        while p in got:
            n = got[p]
            if n < HEADER.size:
                view = memoryview(head[p])[n:]
            else:
                view = recvs[p][n - HEADER.size :]
            try:
                k = sock.recv_into(view) if len(view) else 0
            except BlockingIOError:
                return
            if len(view) and k == 0:
                raise _Desync(f"member {p} closed its socket")
            got[p] = n = n + k
            if n == HEADER.size:
                their_seq, size = HEADER.unpack(head[p])
                if their_seq != seq or size != len(recvs[p]):
                    raise _Desync(
                        f"member {p} sent collective #{their_seq} of {size} bytes; "
                        f"expected #{seq} of {len(recvs[p])}"
                    )
            if n >= HEADER.size and n == HEADER.size + len(recvs[p]):
                del got[p]

    def _check(self, what: str, deadline: float) -> None:
        if self.aborted.is_set():
            self.broken = "aborted"
            raise CommAborted(f"{what} on {self.label} aborted")
        if time.monotonic() > deadline:
            self.broken = "timed out"
            raise CollectiveTimeout(
                f"{what} on {self.label} (member {self.index}) did not complete within "
                f"{self.timeout_s:g} s"
            )


class P2PWork:
    """One posted point-to-point send or receive of a `LocalTransport` (see `isend`/`irecv`)."""

    def __init__(
        self, transport: LocalTransport, peer: int, tensor, *, end: int = 0, seq: int | None = None
    ) -> None:
        self.transport, self.peer, self.tensor = transport, peer, tensor
        self.end = end
        """A send: the peer's byte count queued up to the end of this message."""
        self.seq = seq
        """A receive: the sequence number expected (None for a send)."""
        self.view = tensor_bytes(tensor) if seq is not None else None
        self.head = bytearray(HEADER.size)
        self.got = 0
        self._done = False

    @property
    def done(self) -> bool:
        if self.seq is None:
            return self.transport._sent[self.peer] >= self.end
        return self._done

    @done.setter
    def done(self, value: bool) -> None:
        self._done = value

    def is_completed(self) -> bool:
        return self.done

    def wait(self, what: str = "p2p") -> None:
        self.transport.complete(self, what)


def _send_some(sock: socket.socket, pending: list[memoryview]) -> int:
    """One `sendmsg` of the queued buffers (headers and payloads together: one system call and
    one wake-up of the peer, where a `send` per buffer could wake it for a header alone); the
    bytes sent are dropped from the front of `pending`. Returns their count."""
    sent = left = sock.sendmsg(pending[:MAX_BUFFERS])
    while pending and left >= len(pending[0]):
        left -= len(pending[0])
        pending.pop(0)
    if left:
        pending[0] = pending[0][left:]
    return sent


class _Desync(Exception):
    """The peer closed or sent a message this member did not expect."""


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly `n` bytes from blocking `sock`; EOFError if the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError(f"peer closed after {got} of {n} bytes")
        got += k
    return buf


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of Unix socket `conn` (SO_PEERCRED)."""
    _, uid, _ = _PEERCRED.unpack(
        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return uid


def close_all() -> None:
    """Close every transport of this process (the world is being torn down)."""
    with _OPEN_LOCK:
        transports = list(_OPEN)
    for transport in transports:
        transport.close()
