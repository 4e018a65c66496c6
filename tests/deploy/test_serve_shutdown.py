"""`moectl serve` on a local Ray stops in order on SIGTERM to its process group and keeps its
cache namespace on the shared Redis (the deployment's data), saying so (issue 41, item 5)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import free_port

pytestmark = [pytest.mark.ray, pytest.mark.redis]

MOECTL = Path(sys.executable).with_name("moectl")
REPO = Path(__file__).resolve().parents[2]


def test_sigterm_to_the_group_stops_serve_and_keeps_the_shared_namespace(redis_url, tmp_path):
    import redis

    from cache_service.namespace import CacheNamespace

    namespace = f"serve-keep-{secrets.token_hex(4)}"
    cfg = yaml.safe_load((REPO / "deploy/examples/serve.yaml").read_text())
    cfg["cache"].update(
        tiers=[{"url": "host://", "bytes": "1M"}, {"url": redis_url, "bytes": "16M"}],
        listen=f"127.0.0.1:{free_port()}",
        namespace=namespace,
    )
    cfg["autoscaling"] = {"min_replicas": 1, "max_replicas": 1}
    cfg["http"]["port"] = free_port()
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(cfg))
    # Data another replica of the deployment wrote: it must outlive this process.
    prefix = CacheNamespace(model_fingerprint="serve", deployment=namespace).prefix
    client = redis.Redis.from_url(redis_url)
    shared = f"moe:kvmeta:{prefix}"
    client.set(shared, b"shared", ex=600)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", GRPC_VERBOSITY="ERROR")
    proc = subprocess.Popen(
        [str(MOECTL), "serve", "-c", "serve.yaml"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 150
        while not any(line.startswith("serving ") for line in lines):
            assert proc.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.5)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
        took = time.monotonic() - t0
        time.sleep(0.5)  # the reader thread drains the pipe
        err = "".join(lines)
        assert code == 0, err[-3000:]
        assert took <= 30, err[-3000:]
        assert f"cache namespace '{namespace}' kept on" in err and "(shared data)" in err
        assert client.get(shared) == b"shared"
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        client.delete(shared)
        client.close()
