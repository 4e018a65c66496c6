"""A same-node step channel: engine steps to a ShardWorker actor over a Unix domain socket.

A plain Ray call per rank per step costs about 2 ms on the CI box (task submission, the object
store, the reply), a compiled graph about 1 ms but its actors poll their channels even when idle.
When the driver and a ShardWorker actor share a Ray node, the actor serves a Unix socket
instead: one blocking `recv` waits for a step (no CPU while idle), the step runs the code of
`execute_packed`, and the reply goes back on the same socket. Actors on other nodes keep plain
Ray calls (`Replica` mixes both in one fan-out).

Wire (little-endian; no pickle, the payloads are `actors/executor/step_wire.py` bytes):

    hello    driver -> actor: TOKEN_BYTES of the token the actor handed out (plain Ray call)
    ack      actor -> driver: ACK (8 bytes) once the token matched
    request  driver -> actor: length [u64], the packed step [length bytes]
    reply    actor -> driver: length [u64], status [u64] (OK, COMM_ERROR, ERROR), payload:
             the packed rank output (OK) or "ExceptionType: message" in UTF-8 (errors)

Security: the socket lives in a fresh `mkdtemp` directory (mode 0700) and is itself 0600; the
actor accepts only a peer of its own uid (SO_PEERCRED) that then sends the 32-byte random
token, compared in constant time. Anything else closes the connection without running a step.
Once the driver is in, the socket file and its directory are removed (nobody else can connect,
and an actor killed later leaves nothing behind in the temp dir); the thread serves that one
connection and ends with it. A new channel is a new `StepChannelServer`.

Concurrency: the actor serves one connection at a time from one daemon thread. Every step runs
under the lock the actor shell's default-group methods take (build, KV block reads and writes,
close), so a step never overlaps them; `abort` and `health` stay lock-free (control group).

Failures: EOF, a reset or refused socket, a frame that does not parse, or no reply within the
timeout raise `CommError` on the driver (the world must be rebuilt: the recovery path's
`is_worker_fault`), after which the channel is closed and every later call raises `CommError`
until the replica builds a new one. A step that raised in the worker comes back as a reply:
`CommError` (and its subclasses) again as `CommError`, anything else as `StepChannelError`
(a bug or bad input, not rebuildable), and the channel stays in step.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable

from actors.comm.errors import CommError
from actors.comm.local_transport import peer_uid, private_socket_path, recv_exact

TOKEN_BYTES = 32
ACK = b"STEPCHN1"
OK, COMM_ERROR, ERROR = 0, 1, 2
MAX_FRAME = 1 << 30
"""Largest request or reply accepted (bytes); a longer length prefix is a protocol error."""
HELLO_TIMEOUT_S = 10.0
"""How long the actor waits for a fresh connection's token."""
SOCKET_NAME = "step.sock"
_LEN = struct.Struct("<Q")
_REPLY = struct.Struct("<QQ")


class StepChannelError(RuntimeError):
    """A step raised in the worker with an error that is not a `CommError` (the message names
    its type); the channel itself is fine."""


def run_packed(worker, blob) -> bytes:
    """One engine step on `worker` (a ShardWorker) from `actors/executor/step_wire.py` bytes -> this
    rank's packed output: what `execute_packed` runs, for the Ray call and the channel alike."""
    from actors.executor.step_wire import pack_output, unpack_step
    from actors.executor.worker import ShardStep

    if worker is None:
        raise RuntimeError("the actor holds no ShardWorker (build it first)")
    step, owners, copies = unpack_step(blob)
    out = worker.execute(ShardStep(step=step, owners=owners, copies=copies))
    return pack_output(out.rank, out.rows, out.token_ids, out.logprobs, out.timings_s)


class StepChannelServer:
    """The actor side: a Unix socket listener in a private directory, served by one thread.

    `handler(blob) -> bytes` runs one packed step (under `lock`); `path` and `token` go to the
    driver through a plain Ray call. `steps` counts the steps served (errors included)."""

    def __init__(self, handler: Callable[[bytearray], bytes], lock: threading.Lock) -> None:
        self._handler, self._lock = handler, lock
        self._dir, self.path = private_socket_path("moe-step-", SOCKET_NAME)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.steps = 0
        self.connected = False
        """Whether a driver passed the hello (the socket file is then gone)."""
        self._closed = False
        self._conn: socket.socket | None = None
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.path)
            os.chmod(self.path, 0o600)
            self._listener.listen(1)
        except OSError:
            self._listener.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._thread = threading.Thread(target=self._serve, name="moe-step-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Accept until a peer passes the hello, then serve it until it goes away."""
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            self._conn = conn
            try:
                if not self._closed and self._hello(conn):
                    self.connected = True
                    self._remove_path()
                    self._serve_connection(conn)
            except (OSError, EOFError, ValueError):
                pass  # a peer that failed the hello, or the driver went away
            finally:
                self._conn = None
                conn.close()
            if self.connected:
                return  # one driver per channel

    def _remove_path(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def _hello(self, conn: socket.socket) -> bool:
        """Same uid (SO_PEERCRED) and the token; then the ack. False: drop the connection."""
        if peer_uid(conn) != os.getuid():
            return False
        conn.settimeout(HELLO_TIMEOUT_S)
        token = bytes(recv_exact(conn, TOKEN_BYTES))
        if not hmac.compare_digest(token, self.token):
            return False
        conn.settimeout(None)  # blocking: an idle channel sleeps in recv
        conn.sendall(ACK)
        return True

    def _serve_connection(self, conn: socket.socket) -> None:
        while not self._closed:
            (n,) = _LEN.unpack(recv_exact(conn, _LEN.size))
            if n > MAX_FRAME:
                raise ValueError(f"request of {n} bytes (at most {MAX_FRAME})")
            blob = recv_exact(conn, n)
            with self._lock:
                # The channel's boundary, like a Ray task's: whatever the step raised goes back
                # to the driver as a reply (CommError keeps its meaning: rebuild the world).
                try:
                    payload, status = self._handler(blob), OK
                except CommError as exc:
                    payload, status = f"{type(exc).__name__}: {exc}".encode(), COMM_ERROR
                except Exception as exc:  # reported to the driver, see above
                    payload, status = f"{type(exc).__name__}: {exc}".encode(), ERROR
            self.steps += 1
            conn.sendall(_REPLY.pack(len(payload), status) + payload)

    def close(self, join_timeout_s: float = 5.0) -> None:
        """Stop serving: wake the thread (shutdown of the listener and of the connection),
        wait for it (a step in flight finishes first), remove the socket and its directory."""
        self._closed = True
        for sock in (self._listener, self._conn):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(join_timeout_s)
        self._listener.close()
        self._remove_path()


class StepChannel:
    """The driver side of one rank's channel: `send` a packed step, later `recv` the reply.

    Transport failures raise `CommError` and close the channel for good (see the module
    docstring); `timeout_s` bounds the connect and hello."""

    def __init__(self, path: str, token: bytes, *, rank: int, timeout_s: float) -> None:
        self.rank, self.path = rank, path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(token)
            if bytes(recv_exact(sock, len(ACK))) != ACK:
                raise OSError(f"step channel {path}: unexpected hello reply")
        except (OSError, EOFError):
            sock.close()
            raise
        self._sock: socket.socket | None = sock

    @property
    def closed(self) -> bool:
        return self._sock is None

    def _fail(self, what: str, exc: BaseException) -> CommError:
        self.close()
        return CommError(f"step channel of rank {self.rank}: {what}: {type(exc).__name__}: {exc}")

    def send(self, blob: bytes) -> None:
        if self._sock is None:
            raise CommError(f"step channel of rank {self.rank} is closed; rebuild the replica")
        try:
            self._sock.sendall(_LEN.pack(len(blob)) + blob)
        except OSError as exc:
            raise self._fail("send", exc) from exc

    def recv(self, deadline: float) -> bytearray:
        """The reply to the last `send` by `deadline` (time.monotonic)."""
        if self._sock is None:
            raise CommError(f"step channel of rank {self.rank} is closed; rebuild the replica")
        try:
            self._sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            n, status = _REPLY.unpack(recv_exact(self._sock, _REPLY.size))
            if n > MAX_FRAME or status not in (OK, COMM_ERROR, ERROR):
                raise ValueError(f"reply header ({n} bytes, status {status}) does not parse")
            payload = recv_exact(self._sock, n)
        except (OSError, EOFError, ValueError) as exc:
            raise self._fail("reply", exc) from exc
        if status == OK:
            return payload
        message = f"rank {self.rank}: {payload.decode(errors='replace')}"
        raise CommError(message) if status == COMM_ERROR else StepChannelError(message)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
