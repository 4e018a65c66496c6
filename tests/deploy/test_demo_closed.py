"""`moectl demo --keep` is closed and stops cleanly (issue 41, items 3-5), on one real run:

- every listening socket of its process tree (the `moectl` parent, the driver, Ray's GCS,
  raylet, agents and workers, the Serve actors, the ShardWorkers) is on the loopback address,
  read from /proc (the sockets' inodes in /proc/PID/fd matched with /proc/PID/net/{tcp,udp}{,6});
- Ray refuses a caller without the stack's token: raw gRPC calls to the GCS (none, a wrong one,
  the right one as a control) and a real `ray.init` driver that sends none;
- `--api-key-env` asks every OpenAI request for the key, as the serve YAML's http.api_key_env;
- SIGTERM to the process group: exit status 0 within Serve's graceful timeout plus a few
  seconds, the demo's Redis namespace gone, its Ray token removed, no process of the tree left.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = [pytest.mark.ray, pytest.mark.redis]

MOECTL = Path(sys.executable).with_name("moectl")
KEY_ENV = "MOE_TEST_DEMO_KEY"
GRACEFUL_S = 20.0
"""Serve's graceful_shutdown_timeout_s (its default; the demo's deployments keep it)."""
SLACK_S = 10.0


# -- /proc ---------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, session id, start time in clock ticks) of a live process, else None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie is gone but not yet reaped
        return None
    return int(fields[1]), int(fields[3]), int(fields[19])


def _tree(root: int) -> dict[int, int]:
    """pid -> start time of `root`, its descendants, and every process in their sessions (so a
    process that left the tree by double-forking is still found)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = st
    found = {root} if root in stats else set()
    grew = True
    while grew:
        sessions = {stats[p][1] for p in found} - {os.getsid(0)}
        more = {p for p, (ppid, sid, _) in stats.items() if ppid in found or sid in sessions}
        grew = not more <= found
        found |= more
    return {p: stats[p][2] for p in found}


def _alive(tree: dict[int, int]) -> dict[int, str]:
    """The processes of `tree` still running (same pid and start time): pid -> command line."""
    left = {}
    for pid, start in tree.items():
        st = _stat(pid)
        if st is not None and st[2] == start:
            left[pid] = _cmdline(pid)
    return left


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return str(ip.ipv4_mapped or ip)  # an IPv4-mapped address in its IPv4 form


def listening_sockets(pid: int) -> list[tuple[str, str, int]]:
    """(protocol, address, port) of every TCP socket in LISTEN and every bound, unconnected UDP
    socket that process `pid` holds."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for proto, state in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        try:
            rows = Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == state and cols[9] in inodes:
                addr, port = cols[1].split(":")
                out.append((proto, _address(addr), int(port, 16)))
    return out


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


# -- the run -------------------------------------------------------------------------------------


def _redis_keys(url: str, namespace: str) -> list:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    try:
        return list(client.scan_iter(match=f"*{namespace}*", count=1000))
    finally:
        client.close()


@pytest.fixture(scope="module")
def kept_demo(redis_url, tmp_path_factory):
    """`moectl demo --keep --json --api-key-env` started in a process group of its own (as a
    shell job or a service), up and answering; stopped by the last test (or here, by force)."""
    tmp = tmp_path_factory.mktemp("demo-closed")
    port, ready, key = free_port(), tmp / "ready", secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    # What the test session itself runs with (RAY_AUTH_MODE=disabled) must not open the stack.
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", REDIS_URL=redis_url)
    env[KEY_ENV] = key
    cmd = [str(MOECTL), "demo", "--keep", "--json", "--port", str(port), "--api-key-env", KEY_ENV]
    started = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, "--ready-file", str(ready)],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    errors: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True).start()
    run = {"proc": proc, "port": port, "key": key, "errors": errors, "tree": {}}
    try:
        deadline = time.monotonic() + 240
        while not lines and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert lines, f"no report (exit {proc.poll()}): {''.join(errors)[-3000:]}"
        run["up_s"] = time.monotonic() - started
        run["report"] = json.loads(lines[0])
        run["tree"] = _tree(proc.pid)
        yield run
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _alive(run["tree"]):
            os.kill(pid, signal.SIGKILL)


def _sockets(tree: dict[int, int]) -> list[tuple[int, str, str, str, int]]:
    """(pid, command line, protocol, address, port) of every listening socket of the tree."""
    return [(pid, _cmdline(pid), *sock) for pid in sorted(tree) for sock in listening_sockets(pid)]


def test_every_listening_socket_of_the_demo_is_on_loopback(kept_demo):
    rows = _sockets(kept_demo["tree"])
    print()
    for pid, cmd, proto, addr, port in rows:
        print(f"{pid:>7} {proto:<4} {addr:>15}:{port:<6} {cmd[:70]}")
    # The replica's rendezvous store (torch's TCPStore, rank 0 of its world) included: given a
    # host alone it listens on every interface, so actors/comm/group.py hands it a bound socket.
    open_ = [r for r in rows if not _is_loopback(r[3])]
    assert not open_, open_
    # The scan saw the stack: the HTTP port, the GCS, a raylet, the agents, the ShardWorkers.
    assert ("tcp", "127.0.0.1", kept_demo["port"]) in {r[2:] for r in rows}
    commands = " ".join(r[1] for r in rows)
    for name in ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "ShardWorker"):
        assert name in commands, name
    assert len(rows) >= 30


def _gcs_port(tree: dict[int, int]) -> int:
    for pid in tree:
        if "gcs_server" in _cmdline(pid).split(" ")[0]:
            ports = {port for proto, _, port in listening_sockets(pid) if proto.startswith("tcp")}
            flag = [a for a in _cmdline(pid).split() if a.startswith("--gcs_server_port=")]
            wanted = int(flag[0].split("=")[1]) if flag else 0
            return wanted if wanted in ports else min(ports)
    raise AssertionError("no gcs_server in the demo's process tree")


def _driver_token(tree: dict[int, int]) -> str:
    for pid in tree:
        path = _environ(pid).get("RAY_AUTH_TOKEN_PATH")
        if path and "gcs_server" in _cmdline(pid):
            token_file = Path(path)
            assert token_file.stat().st_mode & 0o777 == 0o600
            assert token_file.parent.stat().st_mode & 0o777 == 0o700
            return token_file.read_text().strip()
    raise AssertionError("the GCS has no RAY_AUTH_TOKEN_PATH")


def test_ray_refuses_a_client_without_the_token(kept_demo):
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    tree = kept_demo["tree"]
    address = f"127.0.0.1:{_gcs_port(tree)}"
    token = _driver_token(tree)
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        request = gcs_service_pb2.GetAllNodeInfoRequest()
        for metadata in ((), (("authorization", "Bearer " + "0" * 64),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.GetAllNodeInfo(request, metadata=metadata, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.GetAllNodeInfo(
            request, metadata=(("authorization", f"Bearer {token}"),), timeout=10
        )
        assert len(reply.node_info_list) == 1
    # A real driver that sends no token (authentication off on its side) is refused too. It
    # keeps the loopback address as given (a local-only Ray, as the stack's own processes do);
    # else Ray swaps 127.0.0.1 for this machine's address, where nothing listens.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    client = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address={address!r}); print('joined')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert client.returncode != 0 and "joined" not in client.stdout
    assert "auth" in client.stderr.lower(), client.stderr[-2000:]


def test_demo_asks_every_request_for_the_api_key(kept_demo):
    url = f"http://127.0.0.1:{kept_demo['port']}/v1/models"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url, timeout=10)
    assert info.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {kept_demo['key']}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 200
    assert kept_demo["report"]["api_key_env"] == KEY_ENV
    assert all(row["completion_tokens"] > 0 for row in kept_demo["report"]["requests"])


def test_sigterm_to_the_process_group_drains_and_leaves_nothing(kept_demo, redis_url):
    proc, tree = kept_demo["proc"], kept_demo["tree"]
    namespace = kept_demo["report"]["cache"]["namespace"]
    token_files = {
        Path(p) for pid in tree if (p := _environ(pid).get("RAY_AUTH_TOKEN_PATH")) is not None
    }
    if kept_demo["report"]["cache"]["mode"] == "redis":
        assert _redis_keys(redis_url, namespace), "the demo wrote nothing to its namespace"
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=GRACEFUL_S + 60)
    took = time.monotonic() - t0
    errors = "".join(kept_demo["errors"])
    print(f"up in {kept_demo['up_s']:.1f} s; SIGTERM to the group -> exit {code} in {took:.1f} s")
    assert code == 0, errors[-3000:]
    assert took <= GRACEFUL_S + SLACK_S, errors[-3000:]
    assert _redis_keys(redis_url, namespace) == []
    assert "Traceback" not in errors and "failed to shut down" not in errors, errors[-3000:]
    assert token_files and not any(p.exists() for p in token_files)
    deadline = time.monotonic() + 10
    while (left := _alive(tree)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
