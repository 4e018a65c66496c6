"""`moectl cache serve|stats|health` as a user runs them: a real subprocess, real Redis, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cache_service.client import CacheClient
from cache_service.errors import CacheUnavailable
from tests.cache_service.grpc_helpers import (
    blocks_for,
    chain_keys,
    delete_redis_keys,
    unique_deployment,
)
from tests.conftest import REPO, free_port

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]
TOKEN = "cli-test-token"


def _serve(*args: str, token: str | None = TOKEN) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MOE_CACHE_TOKEN"}
    if token:
        env["MOE_CACHE_TOKEN"] = token
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "cache", "serve", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_health(process: subprocess.Popen, address: str, token: str | None) -> dict:
    deadline = time.monotonic() + 90
    with CacheClient(address, token=token, timeout_s=1.0, retries=0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                _, err = process.communicate()
                pytest.fail(f"moectl cache serve exited with {process.returncode}: {err}")
            try:
                return client.health()
            except CacheUnavailable:
                time.sleep(0.2)
    process.kill()
    pytest.fail(f"moectl cache serve did not answer Health on {address} within 90 s")


def _stop(process: subprocess.Popen) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    return process.returncode, err


def test_serve_answers_then_stops_cleanly_on_sigterm(redis_url, tmp_path, moectl, monkeypatch):
    deployment = unique_deployment("cli")
    port = free_port()
    address = f"127.0.0.1:{port}"
    process = _serve(
        "--redis", redis_url, "--host-bytes", "64M", "--redis-bytes", "256M",
        "--disk", str(tmp_path / "disk"), "--disk-bytes", "1G",
        "--port", str(port), "--namespace", deployment,
    )  # fmt: skip
    try:
        health = _wait_for_health(process, address, TOKEN)
        assert health["serving"] is True
        assert set(health["tiers"]) == {"host", "redis", "disk"}
        keys = chain_keys(2, seed=21)
        blocks = blocks_for(keys, 3000, seed=21)
        with CacheClient(address, token=TOKEN) as client:
            assert client.put_many(list(zip(keys, blocks, strict=True))) == [True, True]
            assert client.get_many(keys) == blocks
        # The query commands, in-process, token from the environment.
        monkeypatch.setenv("MOE_CACHE_TOKEN", TOKEN)
        code, out, _ = moectl("cache", "health", "--address", address, "--json")
        assert code == 0 and json.loads(out)["serving"] is True
        code, out, _ = moectl("cache", "stats", "--address", address, "--json")
        assert code == 0
        stats = json.loads(out)
        assert {t["name"]: t["blocks"] for t in stats["tiers"]}["host"] == 2
        assert stats["server"]["requests"]["Put"] == 1
        monkeypatch.setenv("MOE_CACHE_TOKEN", "not-the-token")
        code, _, err = moectl("cache", "stats", "--address", address)
        assert code == 2 and "UNAUTHENTICATED" in err and len(err.strip().splitlines()) == 1
    finally:
        code, err = _stop(process)
        delete_redis_keys(redis_url, deployment)
    assert code == 0, err
    assert f"serving on {address}" in err
    assert "Traceback" not in err


def test_unreachable_redis_beside_another_tier_serves_without_it(tmp_path):
    port = free_port()
    dead = f"redis://127.0.0.1:{free_port()}/0"
    process = _serve(
        "--redis", dead, "--host-bytes", "16M", "--port", str(port), "--namespace", "cli-dead",
        token=None,
    )  # fmt: skip
    try:
        health = _wait_for_health(process, f"127.0.0.1:{port}", None)
        assert health["serving"] is True
        assert health["tiers"]["host"]["available"] is True
        assert health["tiers"]["redis"]["available"] is False
    finally:
        code, err = _stop(process)
    assert code == 0, err
    assert "does not answer" in err


def test_unreachable_redis_as_the_only_tier_exits_3(moectl):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    code, _, err = moectl(
        "cache", "serve", "--redis", dead, "--host-bytes", "0", "--port", str(free_port())
    )
    assert code == 3
    assert "does not answer" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--redis", "http://127.0.0.1:6379"], "not a redis:// or rediss:// URL"),
        (["--host-bytes", "8X"], "--host-bytes='8X' is not a size"),
        (["--host-bytes", "0"], "no tier asked for"),
        (["--tls-cert", "cert.pem"], "TLS needs both"),
        (["--port", "70000"], "port 70000 is outside"),
        (["--disk", "/tmp/x", "--disk-bytes", "lots"], "--disk-bytes='lots'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(moectl, args, needle):
    code, out, err = moectl("cache", "serve", *args)
    assert code == 2, err
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == ""


def test_query_commands_against_nothing_exit_3(moectl):
    address = f"127.0.0.1:{free_port()}"
    for command in ("stats", "health"):
        code, _, err = moectl("cache", command, "--address", address, "--timeout", "1")
        assert code == 3
        assert len(err.strip().splitlines()) == 1
