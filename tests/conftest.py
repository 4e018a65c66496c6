"""Shared fixtures: the real Redis, one local Ray instance per session, ../shared, the CLI.

Everything here uses the real thing (DESIGN.md, "Real parts, not mocks"); only GPUs are absent.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

# Offline and quiet before anything imports transformers or Ray.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The session's test cluster only (`ray_session`); the local stacks that moectl starts in
# subprocesses make a token of their own whatever this says (deploy/local_ray.py).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The deployment secret: shared cache tiers (Redis) MAC every block with it and refuse to open
# without one; the same value as the Ray session's workers get (`ray_session`).
SESSION_SECRET = "moe-test-session-secret"
os.environ.setdefault("MOE_CACHE_SECRET", SESSION_SECRET)
TEST_API_KEY = "moe-test-api-key"

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
DATA = Path(__file__).resolve().parent / "data"
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    _group_for_workers(config, items)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


RAY_GROUP = "ray"


def _group_for_workers(config, items) -> None:
    """Work units for `pytest -n N --dist loadgroup` (what `make test` runs): the tests that use
    the session's Ray (the `ray_session` fixture, directly or through another fixture, or the
    `ray` marker) in one group, so they share one Ray in one worker in collection order as in a
    plain run, and in an xdist worker first (the longest group); every other test in its
    module's group, so a module-scoped fixture (a vLLM engine, a checkpoint) is built once per
    worker. Without xdist the markers do nothing and the order stays."""
    ray = {
        item.nodeid
        for item in items
        if "ray_session" in getattr(item, "fixturenames", ()) or item.get_closest_marker("ray")
    }
    for item in items:
        group = RAY_GROUP if item.nodeid in ray else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.nodeid not in ray)


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    """Ray sets OMP_NUM_THREADS=1 in workers; the test process sets its own thread count."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared beside the clone (third-party facts kept outside the repository)."""
    if not SHARED.is_dir():
        pytest.skip(
            f"{SHARED} is absent: the real configs and fixtures live there, beside the clone"
        )
    return SHARED


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The shared Redis (.ci/run starts it). Tests never stop or flush it."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.exceptions.ConnectionError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"Redis at {REDIS_URL} does not answer in CI: {exc}")
        pytest.skip(f"Redis at {REDIS_URL} does not answer: {exc}")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test run: a head and two labelled fake nodes.

    `ray.cluster_utils.Cluster` runs three raylets on this machine, so multi-node paths (discovery
    with node-affinity tasks, placement groups spread over nodes) are exercised for real. The
    logical CPU counts are slots, not cores: actors ask for fractional CPUs (e.g. 0.25).
    Labels: every node carries `moe.io/node` (`head`, `fake-a`, `fake-b`).
    """
    import ray
    from ray.cluster_utils import Cluster

    env = {
        "RAY_AUTH_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Serve replicas that share cache tiers key blocks with one deployment secret.
        "MOE_CACHE_SECRET": SESSION_SECRET,
        # An API key a served test may name in http.api_key_env (no app does by default).
        "MOE_TEST_API_KEY": TEST_API_KEY,
    }
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "include_dashboard": False,
            # A port the OS picks for the dashboard agent's HTTP server, not Ray's fixed 52365 on
            # 127.0.0.1, which the local stacks that tests start beside this Ray bind too.
            "dashboard_agent_listen_port": None,
            "labels": {"moe.io/node": "head"},
            # Workers report metrics every 2 s instead of Ray's 10 s, so the tests that wait for
            # a replica's figures on /metrics wait less (the figures are the same).
            "_system_config": {"metrics_report_interval_ms": 2000},
        },
    )
    for name in ("fake-a", "fake-b"):
        cluster.add_node(num_cpus=2, labels={"moe.io/node": name})
    ray.init(
        address=cluster.address,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": env},
    )
    cluster.wait_for_nodes()
    yield ray
    ray.shutdown()
    cluster.shutdown()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def moectl(capsys):
    """Run `moectl ARGS...` in-process; returns (exit_code, stdout, stderr)."""
    from deploy.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        else:  # pragma: no cover - main always exits
            code = 0
        out, err = capsys.readouterr()
        return code, out, err

    return run
