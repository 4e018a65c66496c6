"""deploy/local_ray.py and deploy/supervisor.py without a stack: the token file, the loopback
hook on a real gRPC server, the supervisor's signal forwarding to a real child, and the
`--api-key-env` check. The live stack is tests/deploy/test_demo_closed.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

_TOKEN_CHECK = """
import os
from ray._private import ray_constants
from ray._private.services import resolve_ip_for_localhost
from deploy.local_ray import LocalRayEnv

cluster = ray_constants.ENABLE_RAY_CLUSTER
local = LocalRayEnv.create()
try:
    # A local-only Ray: the node address stays 127.0.0.1 (deploy/local_ray.py, Step 2).
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert ray_constants.ENABLE_RAY_CLUSTER is False
    assert resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(local.token_file)
    assert "RAY_AUTH_TOKEN" not in os.environ  # it would win over the file
    assert local.token_file.stat().st_mode & 0o777 == 0o600
    assert local.folder.stat().st_mode & 0o777 == 0o700
    token = local.token()
    assert len(token) == 64 and int(token, 16) >= 0
finally:
    local.undo()
assert not local.folder.exists()
assert os.environ["RAY_AUTH_MODE"] == "disabled"
assert os.environ["RAY_AUTH_TOKEN"] == "inherited-token"
assert "RAY_AUTH_TOKEN_PATH" not in os.environ
assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
assert ray_constants.ENABLE_RAY_CLUSTER is cluster
second = LocalRayEnv.create()  # the next local Ray of this process gets a token of its own
try:
    assert second.token() != token
finally:
    second.undo()
print("ok")
"""


def test_token_file_is_private_and_the_environment_comes_back():
    """In a fresh interpreter: this one may hold the session's Ray, whose config must not move."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN_PATH"}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    env.update(RAY_AUTH_MODE="disabled", RAY_AUTH_TOKEN="inherited-token")
    done = subprocess.run(
        [sys.executable, "-c", _TOKEN_CHECK],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_process_with_ray_running_gets_no_second_local_ray(monkeypatch):
    import ray

    from cluster.errors import EnvironmentMissing
    from deploy.local_ray import LocalRayEnv

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    with pytest.raises(EnvironmentMissing, match="already connected"):
        LocalRayEnv.create()


def _listening(port: int) -> set[str]:
    """Addresses this process listens on at TCP `port`."""
    from tests.deploy.test_demo_closed import listening_sockets

    found = set()
    for proto, addr, p in listening_sockets(os.getpid()):
        if proto.startswith("tcp") and p == port:
            found.add(addr)
    return found


def test_loopback_hook_binds_a_wildcard_grpc_port_to_127_0_0_1():
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from ray._common import tls_utils

    from deploy.local_ray import bind_loopback

    before = tls_utils.add_port_to_grpc_server
    bind_loopback()
    bind_loopback()  # a second call changes nothing
    try:
        hooked = tls_utils.add_port_to_grpc_server
        assert hooked.__wrapped__ is before
        servers = [grpc.server(ThreadPoolExecutor(1)) for _ in range(2)]
        wildcard = hooked(servers[0], "[::]:0")
        explicit_port = free_port()
        explicit = hooked(servers[1], f"127.0.0.1:{explicit_port}")
        for server in servers:
            server.start()
        try:
            assert _listening(wildcard) == {"127.0.0.1"}  # nothing on [::]
            assert explicit == explicit_port and _listening(explicit) == {"127.0.0.1"}
        finally:
            for server in servers:
                server.stop(None)
    finally:
        tls_utils.add_port_to_grpc_server = before


_PARENT = """
import sys
from deploy.supervisor import supervise

sys.exit(supervise(sys.argv[1:], module="child_stack"))
"""
_STACK = """
import os, signal, sys, time
from pathlib import Path
from deploy.supervisor import supervise

assert supervise(sys.argv[1:], module="child_stack") is None  # the child runs the 'stack'
out = Path(sys.argv[1])
got = []
signal.signal(signal.SIGTERM, lambda n, f: got.append(n))
(out / "pid").write_text(f"{os.getpid()} {os.getsid(0)}")
while not got:
    time.sleep(0.05)
time.sleep(0.5)  # a second SIGTERM (from the group) would land here
(out / "signals").write_text(str(len(got)))
sys.exit(7)
"""


def _start_supervised(tmp_path: Path) -> tuple[subprocess.Popen, int, int]:
    (tmp_path / "parent.py").write_text(_PARENT)
    (tmp_path / "child_stack.py").write_text(_STACK)
    path = os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[2])])
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("MOE_STACK_PARENT", None)
    parent = subprocess.Popen(
        [sys.executable, str(tmp_path / "parent.py"), str(tmp_path)],
        env=env,
        start_new_session=True,
    )
    _wait_for(tmp_path / "pid")
    child, child_sid = map(int, (tmp_path / "pid").read_text().split())
    return parent, child, child_sid


def test_supervisor_forwards_a_group_sigterm_once_and_returns_the_childs_status(tmp_path):
    parent, child, child_sid = _start_supervised(tmp_path)
    try:
        assert child_sid == child != parent.pid  # the child leads a session of its own
        os.killpg(parent.pid, signal.SIGTERM)  # the parent's whole process group
        assert parent.wait(timeout=30) == 7
        assert (tmp_path / "signals").read_text() == "1"  # forwarded once, not twice
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_killed_supervisor_still_stops_its_child(tmp_path):
    parent, _, _ = _start_supervised(tmp_path)
    parent.kill()  # SIGKILL: nothing forwarded; the kernel sends the child SIGTERM
    parent.wait()
    _wait_for(tmp_path / "signals")
    assert (tmp_path / "signals").read_text() == "1"


def test_api_key_env_must_name_a_set_variable(moectl, monkeypatch):
    monkeypatch.delenv("MOE_TEST_UNSET_KEY", raising=False)
    code, out, err = moectl(
        "demo", "--api-key-env", "MOE_TEST_UNSET_KEY", "--port", str(free_port())
    )
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "--api-key-env='MOE_TEST_UNSET_KEY'" in lines[0]
    monkeypatch.setenv("MOE_TEST_UNSET_KEY", "")
    code, _, err = moectl("demo", "--api-key-env", "MOE_TEST_UNSET_KEY", "--layout", "qq2")
    assert code == 2


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)
